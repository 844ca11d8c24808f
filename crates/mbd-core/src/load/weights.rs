//! Safetensors checkpoints (single file or sharded with an index), read tensor by tensor straight into the
//! buffers the model keeps. Only the JSON headers are parsed up front; each tensor's bytes are read with one
//! positioned read into an owned, typed buffer, so loading never holds a second copy of the checkpoint
//! (no file mapping is resident, no intermediate byte buffer): peak memory is the model's own weights plus
//! at most one tensor in the checkpoint's dtype when it differs from the compute dtype.
//! Errors name the file, the tensor, and what was expected and found.
//!
//! The files are untrusted input. Shard names from the index stay inside the model directory (no absolute or
//! `..` paths; symlinks resolved). Headers are checked before anything is allocated from them: element counts
//! with checked arithmetic, byte ranges inside the data section and not overlapping, so every buffer is
//! justified by bytes the file holds; buffers are allocated fallibly (an allocation failure is an error, not
//! an abort). A file that is not safetensors is called that, without echoing its bytes. Weights holding NaN
//! or infinity are refused (they would only ever give NaN logits).

use crate::error::{Error, Result};
use crate::kernels::blocks::{QMatrix, QuantFormat};
use crate::util::try_zeroed;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor, WithDType};
use safetensors::tensor::{Dtype, TensorInfo};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Largest header the safetensors format allows (100 MB).
const MAX_HEADER: u64 = 100_000_000;

struct Shard {
    path: PathBuf,
    file: File,
    /// Offset of the data section (safetensors: 8 + header length; GGUF: after the aligned header).
    data_start: u64,
    tensors: HashMap<String, Entry>,
    /// The header's `__metadata__` (string to string; safetensors only).
    metadata: HashMap<String, String>,
}

/// How a stored tensor's elements are encoded.
#[derive(Clone, Copy, Debug)]
enum Element {
    /// Floats: safetensors F32/F16/BF16/F64, GGUF f32/f16/bf16.
    Float(DType),
    /// A GGUF block format (q8_0, q4_k, q6_k, ...).
    Block(GgmlDType),
    /// A safetensors dtype we do not read (named in the error when the tensor is asked for).
    Other(Dtype),
}

impl Element {
    fn name(&self) -> String {
        match self {
            Element::Float(d) => format!("{d:?}").to_uppercase(),
            Element::Block(g) => crate::load::gguf::dtype_name(*g).to_string(),
            Element::Other(d) => format!("{d:?}"),
        }
    }
}

/// One stored tensor: its shape (PyTorch order), encoding and byte range inside its file's data section.
struct Entry {
    shape: Vec<usize>,
    element: Element,
    start: u64,
    end: u64,
}

/// Reports loading progress: (checkpoint bytes read so far, checkpoint bytes in all), after each tensor.
#[derive(Clone)]
pub struct Progress(pub std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

/// A matrix as a checkpoint stores it ([`Weights::matrix`]).
pub enum Stored {
    /// Floats, read into a tensor (the compute dtype; a bf16 checkpoint's matrix kept bf16 on the CPU).
    Dense(Tensor),
    /// A block format the kernels multiply, as stored.
    Blocks(QMatrix),
    /// A block format the kernels lack, dequantized to f32.
    Dequantized(Tensor),
}

pub struct Weights {
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    device: Device,
    dtype: DType,
    keep_bf16: bool,
    /// Bytes of the tensors handed out so far (as held in memory).
    loaded: std::cell::Cell<usize>,
    /// Checkpoint bytes read so far, of `total` (the tensors' data in all shards), and who hears of it.
    read: std::cell::Cell<u64>,
    total: u64,
    progress: Option<Progress>,
}

/// The safetensors files of a model directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`. Each is checked to lie inside the directory (`model_file`).
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let m = crate::load::json::read_json(&index)?;
        let wm = m.get("weight_map").and_then(|v| v.as_object()).ok_or_else(|| {
            Error::config(format!("{}: field 'weight_map' is missing or not an object", index.display()))
        })?;
        if wm.is_empty() {
            return Err(Error::config(format!("{}: field 'weight_map' is empty: it names no tensor", index.display())));
        }
        let mut files: Vec<String> = Vec::new();
        for (name, f) in wm {
            let f = f.as_str().ok_or_else(|| {
                Error::config(format!("{}: weight_map['{name}'] must be a file name", index.display()))
            })?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
        }
        files.sort();
        return files
            .iter()
            .map(|f| model_file(dir, f, &format!("{}: weight_map names shard '{f}'", index.display())))
            .collect();
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![model_file(dir, "model.safetensors", "the model weights")?]);
    }
    Err(Error::FileNotFound {
        path: single,
        what: "the model weights (model.safetensors or model.safetensors.index.json)".into(),
    })
}

/// `dir/name`, refused unless `name` is a plain relative path (no root, no `..`) and the file, symlinks
/// resolved, lies inside `dir`; or, for a Hugging Face cache snapshot (`<repo>/snapshots/<rev>/`, whose files
/// are links to `<repo>/blobs/`), inside that blobs folder. A missing file is `FileNotFound`.
pub fn model_file(dir: &Path, name: &str, what: &str) -> Result<PathBuf> {
    use std::path::Component;
    let rel = Path::new(name);
    let plain = !name.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !plain || name.contains('\0') {
        return Err(Error::load(format!(
            "{what}: shard names must be file names inside the model directory (no absolute path, no '..')"
        )));
    }
    let path = dir.join(rel);
    if !path.exists() {
        return Err(Error::FileNotFound { path, what: what.to_string() });
    }
    let canon = |p: &Path| p.canonicalize().map_err(|e| Error::load(format!("{}: cannot resolve: {e}", p.display())));
    let real = canon(&path)?;
    let root = canon(dir)?;
    let mut roots = vec![root.clone()];
    if let (Some(snapshots), Some(repo)) = (root.parent(), root.parent().and_then(|p| p.parent())) {
        if snapshots.file_name().is_some_and(|n| n == "snapshots") {
            roots.push(repo.join("blobs"));
        }
    }
    if !roots.iter().any(|r| real.starts_with(r)) {
        return Err(Error::load(format!(
            "{what}: {} resolves to a file outside the model directory {}; refused",
            path.display(),
            root.display()
        )));
    }
    if !real.is_file() {
        return Err(Error::load(format!("{what}: {} is not a regular file", path.display())));
    }
    Ok(path)
}

fn element_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

/// Element count of a shape, None when it overflows.
fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Parse and check a shard's header: every tensor's byte range lies in the data section, matches its shape
/// and dtype (element counts in checked arithmetic), and overlaps no other tensor's range.
fn open_shard(path: &Path) -> Result<Shard> {
    let bad = |what: String| Error::load(format!("{}: not a readable safetensors file: {what}", path.display()));
    // Said of a file whose first bytes are not a safetensors header; never quotes them (it may be any file).
    let not_st = |why: &str| Error::load(format!("{}: not a safetensors file ({why})", path.display()));
    let mut file = File::open(path).map_err(|e| bad(e.to_string()))?;
    let file_len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|_| not_st(&format!("{file_len} bytes is too short for a header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(not_st(&format!(
            "its first 8 bytes are not a header length that fits the file of {file_len} bytes"
        )));
    }
    let mut header = try_zeroed(n as usize, 0u8, &|| format!("{}: header", path.display()))?;
    file.read_exact(&mut header).map_err(|e| bad(e.to_string()))?;
    let json: HashMap<String, serde_json::Value> = serde_json::from_slice(&header).map_err(|e| {
        // serde's message can quote the input; say only where and what kind of problem it is.
        not_st(&format!(
            "the header is not a JSON object: {:?} error at line {} column {}",
            e.classify(),
            e.line(),
            e.column()
        ))
    })?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut tensors = HashMap::new();
    let mut ranges: Vec<(usize, usize, String)> = Vec::new();
    let mut metadata = HashMap::new();
    for (name, v) in json {
        if name == "__metadata__" {
            // strings to strings by the format; a checkpoint's other metadata is not ours to refuse
            metadata = serde_json::from_value(v).unwrap_or_default();
            continue;
        }
        let info: TensorInfo = serde_json::from_value(v).map_err(|e| {
            bad(format!("header entry '{name}' is not a tensor description {{dtype, shape, data_offsets}}: {e}"))
        })?;
        let (s, e) = info.data_offsets;
        let want = numel(&info.shape)
            .and_then(|k| k.checked_mul(info.dtype.bitsize()))
            .map(|bits| bits.div_ceil(8))
            .filter(|&b| b as u64 <= data_len);
        let Some(want) = want else {
            return Err(bad(format!(
                "tensor '{name}' ({:?}, shape {:?}) claims more bytes than the file's data section ({data_len} bytes)",
                info.dtype, info.shape
            )));
        };
        if s > e || e as u64 > data_len || e - s != want {
            return Err(bad(format!(
                "tensor '{name}' ({:?}, shape {:?}) has byte range {s}..{e}, expected {want} bytes within {data_len}",
                info.dtype, info.shape
            )));
        }
        if s < e {
            ranges.push((s, e, name.clone()));
        }
        let element = element_dtype(info.dtype).map(Element::Float).unwrap_or(Element::Other(info.dtype));
        tensors.insert(name, Entry { shape: info.shape, element, start: s as u64, end: e as u64 });
    }
    ranges.sort();
    for w in ranges.windows(2) {
        let ((s0, e0, a), (s1, e1, b)) = (&w[0], &w[1]);
        if s1 < e0 {
            return Err(bad(format!(
                "tensors '{a}' (bytes {s0}..{e0}) and '{b}' (bytes {s1}..{e1}) overlap; each tensor must have its own bytes"
            )));
        }
    }
    Ok(Shard { path: path.to_path_buf(), file, data_start, tensors, metadata })
}

/// Bit patterns of a float type: `Some(i)` when element i is NaN or infinite (all exponent bits set).
trait FiniteCheck: Sized {
    fn first_non_finite(v: &[Self]) -> Option<usize>;
}

macro_rules! finite_check {
    ($t:ty, $exp:expr, $to_bits:expr) => {
        impl FiniteCheck for $t {
            fn first_non_finite(v: &[Self]) -> Option<usize> {
                let bad = |x: &$t| ($to_bits(*x) & $exp) == $exp;
                // Branch-free over chunks (vectorises), then locate the element inside the bad chunk.
                const CHUNK: usize = 4096;
                v.chunks(CHUNK).enumerate().find_map(|(c, ch)| {
                    if ch.iter().fold(false, |acc, x| acc | bad(x)) {
                        ch.iter().position(bad).map(|i| c * CHUNK + i)
                    } else {
                        None
                    }
                })
            }
        }
    };
}
finite_check!(f32, 0x7f80_0000u32, f32::to_bits);
finite_check!(f64, 0x7ff0_0000_0000_0000u64, f64::to_bits);
finite_check!(half::f16, 0x7c00u16, half::f16::to_bits);
finite_check!(half::bf16, 0x7f80u16, half::bf16::to_bits);

/// Why `read_typed` failed.
enum ReadError {
    Io(std::io::Error),
    Alloc(Error),
    NonFinite(usize, f64),
}

/// One positioned read of `numel` little-endian elements into a fallibly allocated typed buffer; refuses a
/// tensor holding NaN or infinity.
fn read_typed<T: WithDType + FiniteCheck>(
    file: &File,
    offset: u64,
    numel: usize,
    shape: &[usize],
    what: &dyn Fn() -> String,
) -> std::result::Result<Tensor, ReadError> {
    let mut buf: Vec<T> = try_zeroed(numel, T::zero(), what).map_err(ReadError::Alloc)?;
    // SAFETY: T is a plain numeric type (f32/f64/f16/bf16) for which every bit pattern is a valid value; the
    // byte view covers exactly the vector's initialised elements and is dropped before the vector is moved.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, numel * std::mem::size_of::<T>()) };
    let mut f = file;
    f.seek(SeekFrom::Start(offset)).map_err(ReadError::Io)?;
    f.read_exact(bytes).map_err(ReadError::Io)?;
    if let Some(i) = T::first_non_finite(&buf) {
        return Err(ReadError::NonFinite(i, buf[i].to_f64()));
    }
    Tensor::from_vec(buf, shape, &Device::Cpu).map_err(|e| ReadError::Io(std::io::Error::other(e)))
}

impl Weights {
    /// `keep_bf16`: on the CPU with f32 compute, a bf16 checkpoint's matrices (`get_matrix`) stay bf16.
    pub fn open(paths: &[PathBuf], device: &Device, dtype: DType, keep_bf16: bool) -> Result<Self> {
        if cfg!(target_endian = "big") {
            return Err(Error::load("safetensors files are little-endian; big-endian hosts are not supported"));
        }
        if paths.is_empty() {
            return Err(Error::load("no weights file: the checkpoint names no safetensors file"));
        }
        let mut shards: Vec<Shard> = Vec::new();
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            if !p.exists() {
                return Err(Error::FileNotFound { path: p.clone(), what: "a weights shard named by the index".into() });
            }
            let shard = open_shard(p)?;
            for name in shard.tensors.keys() {
                if let Some(j) = index.insert(name.clone(), i) {
                    let other: &Shard = &shards[j];
                    return Err(Error::load(format!(
                        "tensor '{name}' is stored twice: in {} and in {}",
                        other.path.display(),
                        p.display()
                    )));
                }
            }
            shards.push(shard);
        }
        Ok(Self::from_shards(shards, index, device, dtype, keep_bf16))
    }

    /// The tensors of a GGUF file ([`load::gguf`](crate::load::gguf)), under the Hugging Face names the model asks for.
    /// Block-format matrices our kernel multiplies (q8_0, q4_0, q5_0, q2_k..q6_k) are kept as stored on the CPU in
    /// float32; other block formats are dequantized at load and held as q8_0 (or in the `quantize` format when one is
    /// asked for); on other devices every matrix is dequantized to the compute dtype.
    pub fn open_gguf(g: &crate::load::gguf::GgufFile, device: &Device, dtype: DType, keep_bf16: bool) -> Result<Self> {
        if cfg!(target_endian = "big") {
            return Err(Error::load("GGUF files are little-endian; big-endian hosts are not supported"));
        }
        let file = File::open(&g.path).map_err(|e| Error::load(format!("{}: cannot read: {e}", g.path.display())))?;
        let mut tensors = HashMap::new();
        for t in g.hf_tensors()? {
            let element = match t.dtype {
                GgmlDType::F32 => Element::Float(DType::F32),
                GgmlDType::F16 => Element::Float(DType::F16),
                GgmlDType::BF16 => Element::Float(DType::BF16),
                b => Element::Block(b),
            };
            let e = Entry { shape: t.shape, element, start: t.start, end: t.end };
            if tensors.insert(t.name.clone(), e).is_some() {
                return Err(Error::load(format!(
                    "{}: two tensors of the file are both '{}' under Hugging Face names",
                    g.path.display(),
                    t.name
                )));
            }
        }
        let index = tensors.keys().map(|k| (k.clone(), 0)).collect();
        let shard = Shard { path: g.path.clone(), file, data_start: g.data_start, tensors, metadata: HashMap::new() };
        Ok(Self::from_shards(vec![shard], index, device, dtype, keep_bf16))
    }

    fn from_shards(
        shards: Vec<Shard>,
        index: HashMap<String, usize>,
        device: &Device,
        dtype: DType,
        keep_bf16: bool,
    ) -> Self {
        let total = shards.iter().flat_map(|s| s.tensors.values()).map(|t| t.end - t.start).sum();
        Weights {
            shards,
            index,
            device: device.clone(),
            dtype,
            keep_bf16,
            loaded: std::cell::Cell::new(0),
            read: std::cell::Cell::new(0),
            total,
            progress: None,
        }
    }

    /// A multimodal checkpoint's language model under the names a text model has: `model.language_model.X` is
    /// read as `model.X` (Qwen3.5's VL checkpoints). The vision tower (`model.visual.*`) and the multi-token
    /// prediction head (`mtp.*`) are left unread. A text checkpoint is unchanged.
    pub fn language_model(mut self) -> Self {
        const LM: &str = "model.language_model.";
        if !self.index.keys().any(|k| k.starts_with(LM)) {
            return self;
        }
        let rename = |k: &str| k.strip_prefix(LM).map(|r| format!("model.{r}"));
        self.index = self.index.drain().map(|(k, i)| (rename(&k).unwrap_or(k), i)).collect();
        for s in &mut self.shards {
            s.tensors = s.tensors.drain().map(|(k, e)| (rename(&k).unwrap_or(k), e)).collect();
        }
        self
    }

    /// Report progress to `p` after each tensor read.
    pub fn with_progress(mut self, p: Option<Progress>) -> Self {
        self.progress = p;
        self
    }

    /// The first file's `__metadata__` entry `key` (safetensors).
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.shards.first().and_then(|s| s.metadata.get(key)).map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let i = *self.index.get(name)?;
        self.shards[i].tensors.get(name).map(|t| t.shape.clone())
    }

    /// Total number of parameters stored.
    pub fn num_parameters(&self) -> usize {
        self.shards.iter().flat_map(|s| s.tensors.values()).map(|t| t.shape.iter().product::<usize>()).sum()
    }

    /// Names of all stored tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    /// The checkpoint's file, for messages.
    pub fn where_(&self) -> String {
        match self.shards.len() {
            1 => self.shards[0].path.display().to_string(),
            n => format!("{} (and {} more shards)", self.shards[0].path.display(), n - 1),
        }
    }

    /// Bytes of all tensors loaded so far, in the dtype they are held in.
    pub fn loaded_bytes(&self) -> usize {
        self.loaded.get()
    }

    /// The compute device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Load a tensor, checking its shape, in the compute dtype on the compute device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load(name, shape, false)
    }

    /// Load a weight matrix that only the products of [`crate::net::linear::Matrix`] and row lookups read: like
    /// `get`, except that on the CPU a bf16 checkpoint's matrix stays bf16 (half the memory and traffic; the
    /// kernel widens it to f32 exactly as a conversion at load would).
    pub fn get_matrix(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load(name, shape, true)
    }

    /// A matrix (n × k) as stored: with `keep_blocks`, a block-format tensor whose format the kernels multiply stays
    /// in its blocks ([`Stored::Blocks`]) and one whose format they lack is dequantized ([`Stored::Dequantized`]);
    /// everything else is read as `get_matrix` reads it ([`Stored::Dense`]). How it is then held is the caller's rule
    /// ([`net::linear::HoldPolicy`](crate::net::linear::HoldPolicy)).
    pub fn matrix(&self, name: &str, shape: &[usize], keep_blocks: bool) -> Result<Stored> {
        let (shard, e) = self.entry(name, shape)?;
        if let (Element::Block(g), true) = (e.element, keep_blocks) {
            if let (Some(format), [n, k]) = (QuantFormat::from_ggml(g), shape) {
                let data = self.read_bytes(shard, e, name)?;
                let q = QMatrix::from_bytes(format, *n, *k, data)
                    .map_err(|err| Error::load(format!("{}: tensor '{name}': {err}", shard.path.display())))?;
                self.count(q.bytes().len(), e);
                return Ok(Stored::Blocks(q));
            }
            return Ok(Stored::Dequantized(self.get_matrix(name, shape)?));
        }
        Ok(Stored::Dense(self.get_matrix(name, shape)?))
    }

    /// Count `held` bytes in memory in place of `was` (a matrix read, then held in another form).
    pub fn recount(&self, was: usize, held: usize) {
        self.loaded.set(self.loaded.get() - was.min(self.loaded.get()) + held);
    }

    /// The shard and entry of tensor `name`, its shape checked.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<(&Shard, &Entry)> {
        let i = *self.index.get(name).ok_or_else(|| {
            Error::load(format!("{}: tensor '{name}' is missing (expected shape {shape:?})", self.where_()))
        })?;
        let shard = &self.shards[i];
        let e = &shard.tensors[name];
        if e.shape != shape {
            return Err(Error::load(format!(
                "{}: tensor '{name}' has shape {:?}, expected {shape:?}",
                shard.path.display(),
                e.shape
            )));
        }
        Ok((shard, e))
    }

    /// A tensor's stored bytes, in a fallibly allocated buffer.
    fn read_bytes(&self, shard: &Shard, e: &Entry, name: &str) -> Result<Vec<u8>> {
        let path = shard.path.display();
        let n = (e.end - e.start) as usize;
        let mut buf = try_zeroed(n, 0u8, &|| format!("{path}: tensor '{name}'"))?;
        let mut f = &shard.file;
        f.seek(SeekFrom::Start(shard.data_start + e.start))
            .and_then(|_| f.read_exact(&mut buf))
            .map_err(|err| Error::load(format!("{path}: tensor '{name}': cannot read its data: {err}")))?;
        Ok(buf)
    }

    /// Count a tensor as loaded (`held` bytes in memory) and report progress.
    fn count(&self, held: usize, e: &Entry) {
        self.loaded.set(self.loaded.get() + held);
        self.read.set(self.read.get() + (e.end - e.start));
        if let Some(p) = &self.progress {
            (p.0)(self.read.get().min(self.total), self.total);
        }
    }

    fn load(&self, name: &str, shape: &[usize], matrix: bool) -> Result<Tensor> {
        let (shard, e) = self.entry(name, shape)?;
        let path = shard.path.display();
        let numel: usize = shape.iter().product();
        let offset = shard.data_start + e.start;
        let what = || format!("{path}: tensor '{name}' ({}, shape {shape:?})", e.element.name());
        let (t, file_dtype) = match e.element {
            Element::Other(d) => {
                return Err(Error::load(format!(
                    "{path}: tensor '{name}' has dtype {d:?}; supported weight dtypes are F32, F16, BF16 and F64"
                )))
            }
            Element::Float(dt) => {
                let t = match dt {
                    DType::F32 => read_typed::<f32>(&shard.file, offset, numel, shape, &what),
                    DType::F16 => read_typed::<half::f16>(&shard.file, offset, numel, shape, &what),
                    DType::BF16 => read_typed::<half::bf16>(&shard.file, offset, numel, shape, &what),
                    _ => read_typed::<f64>(&shard.file, offset, numel, shape, &what),
                }
                .map_err(|err| match err {
                    ReadError::Io(err) => Error::load(format!("{path}: tensor '{name}': cannot read its data: {err}")),
                    ReadError::Alloc(err) => err,
                    ReadError::NonFinite(i, x) => Error::load(format!(
                        "{path}: tensor '{name}' holds a non-finite value ({x}) at flat index {i}; refused (transformers \
                         would load it and compute NaN logits)"
                    )),
                })?;
                (t, dt)
            }
            Element::Block(g) => (self.dequantize(shard, e, name, g, shape)?, DType::F32),
        };
        let keep_bf16 =
            matrix && file_dtype == DType::BF16 && self.dtype == DType::F32 && self.device.is_cpu() && self.keep_bf16;
        let t = if keep_bf16 { t } else { t.to_dtype(self.dtype)?.to_device(&self.device)? };
        self.count(t.elem_count() * t.dtype().size_in_bytes(), e);
        Ok(t)
    }

    /// A block-format tensor dequantized to f32 on the CPU (candle's dequantization, which follows ggml's).
    fn dequantize(&self, shard: &Shard, e: &Entry, name: &str, g: GgmlDType, shape: &[usize]) -> Result<Tensor> {
        let path = shard.path.display();
        let data = self.read_bytes(shard, e, name)?;
        let bad =
            |err: candle_core::Error| Error::load(format!("{path}: tensor '{name}' ({}): {err}", e.element.name()));
        // The byte count was checked against the shape when the file was opened (gguf::GgufFile::read).
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(g, &data, shape.to_vec(), &Device::Cpu)
            .map_err(bad)?;
        let t = q.dequantize(&Device::Cpu).map_err(bad)?;
        let v = t.flatten_all()?.to_vec1::<f32>()?;
        if let Some(i) = f32::first_non_finite(&v) {
            return Err(Error::load(format!(
                "{path}: tensor '{name}' ({}) dequantizes to a non-finite value at flat index {i}; refused",
                e.element.name()
            )));
        }
        Ok(t)
    }
}

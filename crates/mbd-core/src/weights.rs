//! Safetensors checkpoints (single file or sharded with an index), read tensor by tensor straight into the
//! buffers the model keeps. Only the JSON headers are parsed up front; each tensor's bytes are read with one
//! positioned read into an owned, typed buffer, so loading never holds a second copy of the checkpoint
//! (no file mapping is resident, no intermediate byte buffer): peak memory is the model's own weights plus
//! at most one tensor in the checkpoint's dtype when it differs from the compute dtype.
//! Errors name the file, the tensor, and what was expected and found.

use crate::error::{Error, Result};
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
    /// Offset of the data section (8 + header length).
    data_start: u64,
    tensors: HashMap<String, TensorInfo>,
}

pub struct Weights {
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    device: Device,
    dtype: DType,
    keep_bf16: bool,
    /// Bytes of the tensors handed out so far (as held in memory).
    loaded: std::cell::Cell<usize>,
}

/// The safetensors files of a model directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let m = crate::config::read_json(&index)?;
        let wm = m.get("weight_map").and_then(|v| v.as_object()).ok_or_else(|| {
            Error::config(format!("{}: field 'weight_map' is missing or not an object", index.display()))
        })?;
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
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::FileNotFound {
        path: single,
        what: "the model weights (model.safetensors or model.safetensors.index.json)".into(),
    })
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

/// Parse and check a shard's header: every tensor's byte range lies in the data section and matches its
/// shape and dtype.
fn open_shard(path: &Path) -> Result<Shard> {
    let bad = |what: String| Error::load(format!("{}: not a readable safetensors file: {what}", path.display()));
    let mut file = File::open(path).map_err(|e| bad(e.to_string()))?;
    let file_len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|_| bad(format!("{file_len} bytes is too short for a header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(bad(format!("header length {n} does not fit the file ({file_len} bytes)")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|e| bad(e.to_string()))?;
    let json: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut tensors = HashMap::new();
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo =
            serde_json::from_value(v).map_err(|e| bad(format!("header entry '{name}': {e}")))?;
        let (s, e) = info.data_offsets;
        let numel: usize = info.shape.iter().product();
        let want = (numel * info.dtype.bitsize()).div_ceil(8);
        if s > e || e as u64 > data_len || e - s != want {
            return Err(bad(format!(
                "tensor '{name}' ({:?}, shape {:?}) has byte range {s}..{e}, expected {want} bytes within {data_len}",
                info.dtype, info.shape
            )));
        }
        tensors.insert(name, info);
    }
    Ok(Shard { path: path.to_path_buf(), file, data_start, tensors })
}

/// One positioned read of `numel` little-endian elements into a freshly allocated typed buffer.
fn read_typed<T: WithDType>(file: &File, offset: u64, numel: usize, shape: &[usize]) -> std::io::Result<Tensor> {
    let mut buf: Vec<T> = vec![T::zero(); numel];
    // SAFETY: T is a plain numeric type (f32/f64/f16/bf16) for which every bit pattern is a valid value; the
    // byte view covers exactly the vector's initialised elements and is dropped before the vector is moved.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, numel * std::mem::size_of::<T>()) };
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(bytes)?;
    Tensor::from_vec(buf, shape, &Device::Cpu).map_err(std::io::Error::other)
}

impl Weights {
    /// `keep_bf16`: on the CPU with f32 compute, a bf16 checkpoint's matrices (`get_matrix`) stay bf16.
    pub fn open(paths: &[PathBuf], device: &Device, dtype: DType, keep_bf16: bool) -> Result<Self> {
        if cfg!(target_endian = "big") {
            return Err(Error::load("safetensors files are little-endian; big-endian hosts are not supported"));
        }
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            if !p.exists() {
                return Err(Error::FileNotFound { path: p.clone(), what: "a weights shard named by the index".into() });
            }
            let shard = open_shard(p)?;
            for name in shard.tensors.keys() {
                index.insert(name.clone(), i);
            }
            shards.push(shard);
        }
        Ok(Weights { shards, index, device: device.clone(), dtype, keep_bf16, loaded: std::cell::Cell::new(0) })
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

    fn where_(&self) -> String {
        match self.shards.len() {
            1 => self.shards[0].path.display().to_string(),
            n => format!("{} (and {} more shards)", self.shards[0].path.display(), n - 1),
        }
    }

    /// Bytes of all tensors loaded so far, in the dtype they are held in.
    pub fn loaded_bytes(&self) -> usize {
        self.loaded.get()
    }

    /// Load a tensor, checking its shape, in the compute dtype on the compute device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load(name, shape, false)
    }

    /// Load a weight matrix that only the skinny kernel (`crate::skinny::linear`) and row lookups read: like
    /// `get`, except that on the CPU a bf16 checkpoint's matrix stays bf16 (half the memory and traffic; the
    /// kernel widens it to f32 exactly as a conversion at load would).
    pub fn get_matrix(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load(name, shape, true)
    }

    fn load(&self, name: &str, shape: &[usize], matrix: bool) -> Result<Tensor> {
        let i = *self
            .index
            .get(name)
            .ok_or_else(|| Error::load(format!("{}: tensor '{name}' is missing (expected shape {shape:?})", self.where_())))?;
        let shard = &self.shards[i];
        let path = shard.path.display();
        let info = &shard.tensors[name];
        if info.shape != shape {
            return Err(Error::load(format!("{path}: tensor '{name}' has shape {:?}, expected {shape:?}", info.shape)));
        }
        let file_dtype = element_dtype(info.dtype).ok_or_else(|| {
            Error::load(format!(
                "{path}: tensor '{name}' has dtype {:?}; supported weight dtypes are F32, F16, BF16 and F64",
                info.dtype
            ))
        })?;
        let numel: usize = shape.iter().product();
        let offset = shard.data_start + info.data_offsets.0 as u64;
        let t = match file_dtype {
            DType::F32 => read_typed::<f32>(&shard.file, offset, numel, shape),
            DType::F16 => read_typed::<half::f16>(&shard.file, offset, numel, shape),
            DType::BF16 => read_typed::<half::bf16>(&shard.file, offset, numel, shape),
            _ => read_typed::<f64>(&shard.file, offset, numel, shape),
        }
        .map_err(|e| Error::load(format!("{path}: tensor '{name}': cannot read its data: {e}")))?;
        let keep_bf16 = matrix
            && file_dtype == DType::BF16
            && self.dtype == DType::F32
            && self.device.is_cpu()
            && self.keep_bf16;
        let t = if keep_bf16 { t } else { t.to_dtype(self.dtype)?.to_device(&self.device)? };
        self.loaded.set(self.loaded.get() + t.elem_count() * t.dtype().size_in_bytes());
        Ok(t)
    }

    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}

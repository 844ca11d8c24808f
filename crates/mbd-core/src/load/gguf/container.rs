//! The GGUF container as stored: the untrusted header read within the file's bytes and the metadata caps, the
//! values of the keys the loader reads, the tensor table.

use crate::error::{Error, Result};
use crate::load::json::MAX_CHAT_TEMPLATE_BYTES;
use candle_core::quantized::GgmlDType;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// "GGUF" read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Largest metadata array accepted (a vocabulary of 256K tokens has 256K entries; merges about twice that).
const MAX_ARRAY: u64 = 1 << 24;
/// Largest number of metadata entries and of tensors accepted.
pub(super) const MAX_ENTRIES: u64 = 1 << 20;
/// Arrays of arrays are allowed one level down.
const MAX_DEPTH: usize = 2;
/// Longest metadata key, tensor name, or string value the loader keeps (other than the chat template): real ones
/// are a few bytes to a few hundred (a token, a merge, an architecture name).
const MAX_STRING: u64 = 1 << 16;
/// What the metadata the loader keeps may take in memory, counted as one JSON value (32 bytes) per element plus its
/// text: Qwen2's 151K-token tokenizer (tokens, types, merges) takes about 18 MB.
const MAX_METADATA_BYTES: u64 = 256 << 20;
/// Metadata arrays the loader reads element by element (every other array is skipped unread, its length kept).
const ARRAYS_READ: &[&str] = &["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"];
/// Other keys whose values the loader reads: every other value is skipped without being built.
const KEYS_READ: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "tokenizer.chat_template",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.mask_token_id",
    "tokenizer.ggml.add_bos_token",
];
/// The architecture's keys (`<arch>.<key>`) and the config.json field each becomes ([`GgufFile::hf_config`]).
pub(super) const ARCH_FIELDS: [(&str, &str); 12] = [
    ("block_count", "num_hidden_layers"),
    ("embedding_length", "hidden_size"),
    ("feed_forward_length", "intermediate_size"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
    ("attention.key_length", "head_dim"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    ("rope.freq_base", "rope_theta"),
    ("context_length", "max_position_embeddings"),
    ("expert_count", "num_experts"),
    ("expert_used_count", "num_experts_per_tok"),
    ("expert_feed_forward_length", "moe_intermediate_size"),
];
/// The architecture's other keys the loader reads.
const ARCH_KEYS: &[&str] = &[
    "attention.value_length",
    "expert_weights_norm",
    "rope.scaling.type",
    "rope.scaling.factor",
    // Qwen3.5 (`qwen35`, `qwen35moe`)
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "full_attention_interval",
    "nextn_predict_layers",
    "rope.dimension_count",
    "expert_shared_feed_forward_length",
    "attention.recurrent_layers",
];

/// Architecture arrays read element by element (`<arch>.<key>`).
const ARCH_ARRAYS_READ: &[&str] = &["attention.recurrent_layers"];

/// Whether the loader reads this array's elements.
fn reads_array(key: &str) -> bool {
    ARRAYS_READ.contains(&key)
        || key
            .split_once('.')
            .is_some_and(|(arch, rest)| !matches!(arch, "general" | "tokenizer") && ARCH_ARRAYS_READ.contains(&rest))
}

/// Whether the loader reads this key's value (an architecture's keys under any prefix: `general.architecture` may
/// come after them).
fn read_key(key: &str) -> bool {
    ARRAYS_READ.contains(&key)
        || KEYS_READ.contains(&key)
        || key.split_once('.').is_some_and(|(arch, rest)| {
            !matches!(arch, "general" | "tokenizer")
                && (ARCH_KEYS.contains(&rest) || ARCH_FIELDS.iter().any(|(k, _)| *k == rest))
        })
}

/// The longest string value `key` may hold.
fn max_string(key: &str) -> u64 {
    if key == "tokenizer.chat_template" {
        MAX_CHAT_TEMPLATE_BYTES as u64
    } else {
        MAX_STRING
    }
}

/// One tensor of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// Dimensions in PyTorch order (outermost first; GGUF stores them innermost first).
    pub shape: Vec<usize>,
    pub dtype: GgmlDType,
    /// Byte range inside the data section.
    pub start: u64,
    pub end: u64,
}

/// A parsed GGUF header: metadata as JSON values, the tensor table, and where the data section starts.
pub struct GgufFile {
    pub path: PathBuf,
    /// The values of the keys the loader reads (`read_key`); the other keys' values are skipped unread.
    pub metadata: Map<String, Value>,
    /// Arrays under keys the loader reads that it does not read element by element (e.g. a per-layer
    /// `<arch>.attention.head_count_kv`): their lengths, so that they can be refused by name.
    pub arrays: BTreeMap<String, u64>,
    pub tensors: Vec<GgufTensor>,
    pub data_start: u64,
}

/// The GGUF element types, by their number in the file (`ggml_type`), that we can read.
fn ggml_dtype(t: u32) -> Option<GgmlDType> {
    Some(match t {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// A GGML type's name as llama.cpp writes it.
pub fn dtype_name(d: GgmlDType) -> &'static str {
    match d {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2_k",
        GgmlDType::Q3K => "q3_k",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q5K => "q5_k",
        GgmlDType::Q6K => "q6_k",
        GgmlDType::Q8K => "q8_k",
    }
}

/// A reader over the header that never reads past the file's length, and keeps count of the memory the metadata
/// it builds takes.
struct Header {
    r: BufReader<File>,
    /// Bytes consumed so far.
    pos: u64,
    len: u64,
    path: PathBuf,
    /// Memory taken by the metadata built so far (see `MAX_METADATA_BYTES`).
    built: u64,
}

/// The bytes of one element of a metadata array of this value type, for the fixed-size types.
fn fixed_size(t: u32) -> Option<u64> {
    Some(match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        _ => return None,
    })
}

impl Header {
    fn bad(&self, what: impl std::fmt::Display) -> Error {
        Error::load(format!("{}: not a readable GGUF file: {what} (at byte {})", self.path.display(), self.pos))
    }
    fn left(&self) -> u64 {
        self.len - self.pos
    }
    /// Count `bytes` of memory against `MAX_METADATA_BYTES` before it is allocated.
    fn charge(&mut self, bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
        self.built = self.built.saturating_add(bytes);
        if self.built > MAX_METADATA_BYTES {
            return Err(self.bad(format!(
                "{}: the metadata and tensor table would take more than {} MiB of memory (a real model's take a few \
                 tens)",
                what(),
                MAX_METADATA_BYTES >> 20
            )));
        }
        Ok(())
    }
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if (N as u64) > self.left() {
            return Err(self.bad("the file ends inside its header"));
        }
        self.r.read_exact(&mut b).map_err(|e| self.bad(e))?;
        self.pos += N as u64;
        Ok(b)
    }
    /// Move past `n` bytes without reading them.
    fn skip(&mut self, n: u64) -> Result<()> {
        if n > self.left() {
            return Err(self.bad("the file ends inside its header"));
        }
        let step = i64::try_from(n).map_err(|_| self.bad("a value larger than the file"))?;
        self.r.seek_relative(step).map_err(|e| self.bad(e))?;
        self.pos += n;
        Ok(())
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    /// A count of items of at least `min_size` bytes each, bounded by `max` and by the bytes left.
    fn count(&mut self, what: &str, max: u64, min_size: u64) -> Result<usize> {
        let n = self.u64()?;
        if n > max || n.saturating_mul(min_size) > self.left() {
            return Err(self.bad(format!("{what} count {n} is more than the file can hold")));
        }
        Ok(n as usize)
    }
    /// A string of at most `max` bytes (each byte counted as metadata memory).
    fn string(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64()?;
        if n > self.left() {
            return Err(self.bad(format!("{}: a string of {n} bytes runs past the end of the file", what())));
        }
        if n > max {
            return Err(self.bad(format!("{}: a string of {n} bytes; at most {max} are accepted", what())));
        }
        self.charge(n, what)?;
        let mut b = crate::util::try_zeroed(n as usize, 0u8, what)?;
        self.r.read_exact(&mut b).map_err(|e| self.bad(e))?;
        self.pos += n;
        String::from_utf8(b).map_err(|_| self.bad(format!("{}: a string is not valid UTF-8", what())))
    }
    /// A float the loader reads: finite, or an error that names the key (a NaN would otherwise read as missing, and
    /// the field would silently take its default).
    fn finite(&self, x: f64, key: &str) -> Result<Value> {
        serde_json::Number::from_f64(x).map(Value::Number).ok_or_else(|| {
            Error::config(format!("{}: metadata '{key}' is {x}; expected a finite number", self.path.display()))
        })
    }
    /// An array's element type and length (each element at least its type's bytes, or a string's 8-byte length).
    fn array_head(&mut self, key: &str, depth: usize) -> Result<(u32, usize)> {
        if depth >= MAX_DEPTH {
            return Err(self.bad(format!("metadata '{key}': arrays nested deeper than {MAX_DEPTH} levels")));
        }
        let et = self.u32()?;
        let size = match (et, fixed_size(et)) {
            (_, Some(s)) => s,
            (8 | 9, None) => 8,
            _ => return Err(self.bad(format!("metadata '{key}': unknown array element type {et}"))),
        };
        let n = self.count(&format!("metadata '{key}': array"), MAX_ARRAY, size)?;
        Ok((et, n))
    }
    /// Move past one metadata value of type `t` without building it (a string's or array's bytes are not read).
    fn skip_value(&mut self, t: u32, key: &str, depth: usize) -> Result<()> {
        if let Some(s) = fixed_size(t) {
            return self.skip(s);
        }
        match t {
            8 => {
                let n = self.u64()?;
                self.skip(n)
            }
            9 => self.skip_array(key, depth).map(|_| ()),
            _ => Err(self.bad(format!("metadata '{key}' has unknown value type {t}"))),
        }
    }

    /// Move past an array value without building it; returns its length.
    fn skip_array(&mut self, key: &str, depth: usize) -> Result<usize> {
        let (et, n) = self.array_head(key, depth)?;
        match fixed_size(et) {
            Some(s) => self.skip(s * n as u64)?,
            None => (0..n).try_for_each(|_| self.skip_value(et, key, depth + 1))?,
        }
        Ok(n)
    }
    /// One metadata value of type `t`, built: its text and an array's values are counted against
    /// `MAX_METADATA_BYTES` before they are allocated (the value itself by the caller).
    fn value(&mut self, t: u32, key: &str, depth: usize) -> Result<Value> {
        let num = |x: serde_json::Number| Value::Number(x);
        Ok(match t {
            0 => num(u8::from_le_bytes(self.bytes()?).into()),
            1 => num(i8::from_le_bytes(self.bytes()?).into()),
            2 => num(u16::from_le_bytes(self.bytes()?).into()),
            3 => num(i16::from_le_bytes(self.bytes()?).into()),
            4 => num(self.u32()?.into()),
            5 => num(i32::from_le_bytes(self.bytes()?).into()),
            6 => {
                // The float as written (its shortest decimal), so 1e-6 reads back as 1e-6, not 9.99999997e-7.
                let x = f32::from_le_bytes(self.bytes()?);
                let x: f64 = if x.is_finite() { x.to_string().parse().unwrap_or(x as f64) } else { x as f64 };
                self.finite(x, key)?
            }
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.bad(format!("metadata '{key}': a bool must be 0 or 1, found {b}"))),
            },
            8 => Value::String(self.string(max_string(key), &|| format!("metadata '{key}'"))?),
            9 => {
                let (et, n) = self.array_head(key, depth)?;
                let slots = (n as u64).saturating_mul(std::mem::size_of::<Value>() as u64);
                self.charge(slots, &|| format!("metadata '{key}'"))?;
                let mut v = Vec::new();
                v.try_reserve_exact(n).map_err(|e| self.bad(format!("metadata '{key}': {e}")))?;
                for _ in 0..n {
                    v.push(self.value(et, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => num(self.u64()?.into()),
            11 => num(i64::from_le_bytes(self.bytes()?).into()),
            12 => {
                let x = f64::from_le_bytes(self.bytes()?);
                self.finite(x, key)?
            }
            _ => return Err(self.bad(format!("metadata '{key}' has unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Parse and check the header of a GGUF file (versions 2 and 3, little-endian).
    pub fn read(path: &Path) -> Result<GgufFile> {
        let open_err = |e: std::io::Error| Error::load(format!("{}: cannot read: {e}", path.display()));
        let file = File::open(path).map_err(open_err)?;
        let len = file.metadata().map_err(open_err)?.len();
        let mut h =
            Header { r: BufReader::with_capacity(1 << 16, file), pos: 0, len, path: path.to_path_buf(), built: 0 };
        let not_gguf = |why: &str| Error::load(format!("{}: not a GGUF file ({why})", path.display()));
        if len < 24 {
            return Err(not_gguf(&format!("{len} bytes is too short for a header")));
        }
        if h.u32()? != MAGIC {
            return Err(not_gguf(
                "its first bytes are not the GGUF magic; a safetensors model is loaded from its directory",
            ));
        }
        let version = h.u32()?;
        match version {
            2 | 3 => {}
            1 => return Err(h.bad("GGUF version 1 (32-bit counts) is not supported; convert it again with llama.cpp")),
            0 => return Err(h.bad("GGUF version 0 is not a version llama.cpp ever wrote (2 and 3 are read)")),
            v if v.swap_bytes() <= 3 => return Err(h.bad("a big-endian GGUF file; only little-endian files are read")),
            v => return Err(h.bad(format!("unknown GGUF version {v}"))),
        }
        // Each tensor description takes at least 8 (name length) + 4 + 4 + 8 bytes; each metadata entry 8 + 4 + 1.
        let n_tensors = h.count("tensor", MAX_ENTRIES, 24)?;
        let n_kv = h.count("metadata entry", MAX_ENTRIES, 13)?;
        let mut metadata = Map::new();
        let mut arrays = BTreeMap::new();
        let mut keys = HashSet::new();
        for _ in 0..n_kv {
            let key = h.string(MAX_STRING, &|| "a metadata key".to_string())?;
            // the key kept for the duplicate check: its bytes (counted above) and a set entry
            h.charge(64, &|| format!("metadata '{key}'"))?;
            let t = h.u32()?;
            if !read_key(&key) {
                h.skip_value(t, &key, 0)?;
            } else if t == 9 && !reads_array(&key) {
                let n = h.skip_array(&key, 0)?;
                arrays.insert(key.clone(), n as u64);
            } else {
                h.charge(std::mem::size_of::<Value>() as u64, &|| format!("metadata '{key}'"))?;
                let v = h.value(t, &key, 0)?;
                metadata.insert(key.clone(), v);
            }
            if !keys.insert(key.clone()) {
                return Err(h.bad(format!("metadata '{key}' is stored twice")));
            }
        }
        let mut tensors = Vec::new();
        let mut raw: Vec<(Vec<u64>, u32, u64)> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let name = h.string(MAX_STRING, &|| format!("the name of tensor {i}"))?;
            let nd = h.u32()?;
            if nd == 0 || nd > 4 {
                return Err(h.bad(format!("tensor '{name}' has {nd} dimensions (1 to 4 allowed)")));
            }
            let dims: Vec<u64> = (0..nd).map(|_| h.u64()).collect::<Result<_>>()?;
            let t = h.u32()?;
            let off = h.u64()?;
            // the tensor's entry, its dimensions and the duplicate check's copy of its name
            h.charge(name.len() as u64 + 160, &|| format!("tensor '{name}'"))?;
            if !names.insert(name.clone()) {
                return Err(h.bad(format!("tensor '{name}' is stored twice")));
            }
            tensors.push(GgufTensor { name, shape: vec![], dtype: GgmlDType::F32, start: off, end: off });
            raw.push((dims, t, off));
        }
        if arrays.contains_key("general.alignment") {
            return Err(h.bad("metadata 'general.alignment' must be a power of two, found a list"));
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                _ => return Err(h.bad(format!("metadata 'general.alignment' must be a power of two, found {v}"))),
            },
        };
        let data_start = h.pos.div_ceil(alignment) * alignment;
        if data_start > len {
            return Err(h.bad("the data section starts past the end of the file"));
        }
        let data_len = len - data_start;
        for (t, (dims, ty, off)) in tensors.iter_mut().zip(raw) {
            let name = t.name.clone();
            let dtype = ggml_dtype(ty).ok_or_else(|| {
                Error::Unsupported(format!(
                    "{}: tensor '{name}' has GGML type {ty}, which this version does not read (f32, f16, bf16, q4_0, \
                     q4_1, q5_0, q5_1, q8_0 and q2_k..q6_k are read)",
                    path.display()
                ))
            })?;
            let (bs, ts) = (dtype.block_size() as u64, dtype.type_size() as u64);
            if let Some(i) = dims.iter().position(|&d| d == 0) {
                return Err(h.bad(format!("tensor '{name}' has dimensions {dims:?}: dimension {i} is 0")));
            }
            if dims[0] % bs != 0 {
                return Err(h.bad(format!(
                    "tensor '{name}' has dimensions {dims:?}; its rows ({}) must be a positive multiple of {bs} \
                     values for {}",
                    dims[0],
                    dtype_name(dtype)
                )));
            }
            let bytes = dims[1..]
                .iter()
                .try_fold((dims[0] / bs).checked_mul(ts), |a, &d| a?.checked_mul(d).map(Some))
                .flatten()
                .filter(|&b| b <= data_len)
                .ok_or_else(|| h.bad(format!("tensor '{name}' ({dims:?}) claims more bytes than the file holds")))?;
            if off % alignment != 0 || off > data_len || bytes > data_len - off {
                return Err(h.bad(format!(
                    "tensor '{name}' has data offset {off} ({bytes} bytes): outside the data section of {data_len} \
                     bytes or not aligned to {alignment}"
                )));
            }
            t.shape = dims.iter().rev().map(|&d| d as usize).collect();
            t.dtype = dtype;
            t.end = off + bytes;
        }
        let mut ranges: Vec<&GgufTensor> = tensors.iter().filter(|t| t.end > t.start).collect();
        ranges.sort_by_key(|t| t.start);
        for w in ranges.windows(2) {
            if w[1].start < w[0].end {
                return Err(h.bad(format!("tensors '{}' and '{}' overlap", w[0].name, w[1].name)));
            }
        }
        Ok(GgufFile { path: path.to_path_buf(), metadata, arrays, tensors, data_start })
    }

    pub(super) fn where_(&self) -> String {
        self.path.display().to_string()
    }

    pub fn architecture(&self) -> Result<String> {
        match self.get("general.architecture")? {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(Error::config(format!(
                "{}: metadata 'general.architecture' must be a string, found {}",
                self.where_(),
                crate::load::json::type_name(v)
            ))),
            None => Err(Error::config(format!("{}: metadata 'general.architecture' is missing", self.where_()))),
        }
    }

    /// A key's value; a list under a key that takes one value (kept unread in `arrays`) is an error naming it.
    pub(super) fn get(&self, key: &str) -> Result<Option<&Value>> {
        match self.arrays.get(key) {
            Some(n) => Err(Error::config(format!(
                "{}: metadata '{key}' is a list of {n} values; one value is expected",
                self.where_()
            ))),
            None => Ok(self.metadata.get(key)),
        }
    }

    pub(super) fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

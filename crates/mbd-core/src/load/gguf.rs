//! GGUF files (llama.cpp's single-file format): a model given as one `.gguf` file instead of a directory.
//!
//! What is read from the file, and what it becomes:
//! - the metadata (`general.architecture` = `qwen2`, `qwen3`, `qwen3moe`, `qwen35`, `qwen35moe` or `dream`; `<arch>.block_count`,
//!   `.embedding_length`, ...) becomes the config.json fields of the same model (`hf_config`), which then go through
//!   the one config parser (`config::ModelConfig::from_json`, `config::detect_family`, `Profile::resolve`);
//! - the tokenizer (`tokenizer.ggml.*`: a byte-level BPE vocabulary, its merges, token types, the pre-tokenizer's
//!   name) becomes a Hugging Face tokenizer.json (`tokenizer_json`), and `tokenizer.chat_template` the chat template;
//! - the tensors (llama.cpp's names: `blk.N.attn_q.weight`, ...) are renamed to the Hugging Face names the model
//!   loader asks for (`tensors`), with their shapes in PyTorch order and their element type (`GgmlDType`: floats, or a
//!   block format), and read by `weights::Weights` like a safetensors shard.
//!
//! The file is untrusted input: every length and count is checked against the bytes the file holds before anything
//! is allocated from it; only the values of the keys the loader reads are built (`read_key`: every other value, a
//! gigabyte array or string included, is skipped unread), under caps on each string (`MAX_STRING`, the chat template
//! `MAX_CHAT_TEMPLATE_BYTES`) and on the memory of all of them (`MAX_METADATA_BYTES`, counted before allocating);
//! strings must be UTF-8, floats finite; tensors must lie inside the data section, aligned and not overlapping. A
//! file that is not GGUF is called that without echoing its bytes.

use crate::error::{Error, Result};
use crate::load::json::MAX_CHAT_TEMPLATE_BYTES;
use candle_core::quantized::GgmlDType;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// "GGUF" read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Largest metadata array accepted (a vocabulary of 256K tokens has 256K entries; merges about twice that).
const MAX_ARRAY: u64 = 1 << 24;
/// Largest number of metadata entries and of tensors accepted.
const MAX_ENTRIES: u64 = 1 << 20;
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
/// The architecture's keys (`<arch>.<key>`) and the config.json field each becomes (`GgufFile::hf_config`).
const ARCH_FIELDS: [(&str, &str); 12] = [
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
            if dims.contains(&0) || dims[0] % bs != 0 {
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

    fn where_(&self) -> String {
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
    fn get(&self, key: &str) -> Result<Option<&Value>> {
        match self.arrays.get(key) {
            Some(n) => Err(Error::config(format!(
                "{}: metadata '{key}' is a list of {n} values; one value is expected",
                self.where_()
            ))),
            None => Ok(self.metadata.get(key)),
        }
    }

    fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The config.json of the same model, from the metadata: the architecture's dimensions under the Hugging Face
    /// field names, `vocab_size` from the embedding's rows, `tie_word_embeddings` from whether `output.weight` is
    /// stored, the special token ids. Type checks happen in the one config parser; a key that is missing or has the
    /// wrong type is named here with its GGUF name.
    pub fn hf_config(&self) -> Result<Map<String, Value>> {
        let arch = self.architecture()?;
        let (architectures, model_type) = match arch.as_str() {
            "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
            "qwen3" => ("Qwen3ForCausalLM", "qwen3"),
            "qwen3moe" => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "qwen35" => ("Qwen3_5ForCausalLM", "qwen3_5_text"),
            "qwen35moe" => ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
            "dream" => ("DreamModel", "Dream"),
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF architecture '{other}' is not supported; supported: qwen2, qwen3, qwen3moe, qwen35, \
                     qwen35moe, dream",
                    self.where_()
                )))
            }
        };
        let mut c = Map::new();
        c.insert("architectures".into(), json!([architectures]));
        c.insert("model_type".into(), json!(model_type));
        let key = |k: &str| format!("{arch}.{k}");
        let moe = arch == "qwen3moe" || arch == "qwen35moe";
        for (k, field) in ARCH_FIELDS {
            let required = match k {
                "block_count"
                | "embedding_length"
                | "attention.head_count"
                | "attention.layer_norm_rms_epsilon"
                | "context_length" => true,
                "feed_forward_length" => !moe,
                "expert_count" | "expert_used_count" | "expert_feed_forward_length" => moe,
                _ => false,
            };
            if self.arrays.contains_key(&key(k)) {
                return Err(Error::Unsupported(format!(
                    "{}: metadata '{}' is a per-layer list; only one value for every layer is supported",
                    self.where_(),
                    key(k)
                )));
            }
            match self.get(&key(k))? {
                Some(v) => {
                    c.insert(field.into(), v.clone());
                }
                None if required => {
                    return Err(Error::config(format!(
                        "{}: metadata '{}' is missing (the {field} of a {arch} model)",
                        self.where_(),
                        key(k)
                    )))
                }
                None => {}
            }
        }
        if let (Some(k), Some(v)) = (c.get("head_dim").cloned(), self.get(&key("attention.value_length"))?) {
            if *v != k {
                return Err(Error::Unsupported(format!(
                    "{}: attention.key_length {k} differs from attention.value_length {v}",
                    self.where_()
                )));
            }
        }
        if arch == "qwen3moe" {
            if !c.contains_key("intermediate_size") {
                c.insert("intermediate_size".into(), c.get("moe_intermediate_size").cloned().unwrap_or(json!(0)));
            }
            // Layers stored with a dense MLP (no router) are Qwen3-MoE's `mlp_only_layers`.
            let n = c.get("num_hidden_layers").and_then(|v| v.as_u64()).unwrap_or(0).min(MAX_ENTRIES);
            let dense: Vec<u64> =
                (0..n).filter(|i| self.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_none()).collect();
            c.insert("mlp_only_layers".into(), json!(dense));
            // llama.cpp's qwen3moe graph always renormalises the chosen experts' weights.
            let norm = self.get(&key("expert_weights_norm"))?.cloned().unwrap_or(Value::Bool(true));
            c.insert("norm_topk_prob".into(), norm);
        }
        if let Some(Value::String(t)) = self.get(&key("rope.scaling.type"))? {
            if t != "none" {
                let mut r = Map::new();
                r.insert("rope_type".into(), json!(t));
                if let Some(f) = self.get(&key("rope.scaling.factor"))? {
                    r.insert("factor".into(), f.clone());
                }
                c.insert("rope_scaling".into(), Value::Object(r));
            }
        }
        let embed = self.tensor("token_embd.weight").ok_or_else(|| {
            Error::load(format!("{}: tensor 'token_embd.weight' (the embedding) is missing", self.where_()))
        })?;
        if embed.shape.len() != 2 {
            return Err(Error::load(format!(
                "{}: tensor 'token_embd.weight' has shape {:?}, expected [vocab, hidden]",
                self.where_(),
                embed.shape
            )));
        }
        c.insert("vocab_size".into(), json!(embed.shape[0]));
        c.insert("tie_word_embeddings".into(), json!(self.tensor("output.weight").is_none()));
        if arch == "qwen3" || arch == "qwen3moe" {
            c.insert("attention_bias".into(), json!(self.tensor("blk.0.attn_q.bias").is_some()));
        }
        if arch == "qwen35" || arch == "qwen35moe" {
            self.qwen35_fields(&arch, &mut c)?;
        }
        let mut eos = vec![];
        for k in ["eos_token_id", "eot_token_id", "eom_token_id"] {
            if let Some(v) = self.get(&format!("tokenizer.ggml.{k}"))? {
                if !eos.contains(v) {
                    eos.push(v.clone());
                }
            }
        }
        if !eos.is_empty() {
            c.insert("eos_token_id".into(), Value::Array(eos));
        }
        for (k, field) in [("bos_token_id", "bos_token_id"), ("mask_token_id", "mask_token_id")] {
            if let Some(v) = self.get(&format!("tokenizer.ggml.{k}"))? {
                c.insert(field.into(), v.clone());
            }
        }
        Ok(c)
    }

    /// Qwen3.5's fields from llama.cpp's keys: the Gated DeltaNet sizes (`ssm.*`), which layers are recurrent
    /// (`attention.recurrent_layers`, else `full_attention_interval`), the rotary dims (`rope.dimension_count`), the
    /// trunk's layers (`block_count` counts the multi-token-prediction layers too: `nextn_predict_layers`), the
    /// shared expert's size; and the two conventions of llama.cpp's converter that the model then follows: norm
    /// weights stored with their 1 added, value heads in tiled order (`config::LinearAttnConfig`).
    fn qwen35_fields(&self, arch: &str, c: &mut Map<String, Value>) -> Result<()> {
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| self.qwen35_count(arch, k);
        let layers = self.qwen35_trunk(arch)?;
        c.insert("num_hidden_layers".into(), json!(layers));
        let (hk, hv, inner) = (need("ssm.group_count")?, need("ssm.time_step_rank")?, need("ssm.inner_size")?);
        if hv == 0 || inner % hv != 0 {
            return Err(Error::config(format!(
                "{}: ssm.inner_size ({inner}) must be a multiple of ssm.time_step_rank ({hv}, the value heads)",
                self.where_()
            )));
        }
        c.insert("linear_conv_kernel_dim".into(), json!(need("ssm.conv_kernel")?));
        c.insert("linear_key_head_dim".into(), json!(need("ssm.state_size")?));
        c.insert("linear_num_key_heads".into(), json!(hk));
        c.insert("linear_num_value_heads".into(), json!(hv));
        c.insert("linear_value_head_dim".into(), json!(inner / hv));
        if let Some(n) = self.arrays.get(&key("attention.recurrent_layers")) {
            return Err(Error::config(format!(
                "{}: metadata '{}' ({n} entries) could not be read as a list of booleans",
                self.where_(),
                key("attention.recurrent_layers")
            )));
        }
        match self.metadata.get(&key("attention.recurrent_layers")) {
            Some(Value::Array(flags)) => {
                if (flags.len() as u64) < layers || flags.iter().any(|f| !f.is_boolean()) {
                    return Err(Error::config(format!(
                        "{}: metadata '{}' must hold a boolean for each of the {layers} layers",
                        self.where_(),
                        key("attention.recurrent_layers")
                    )));
                }
                let types: Vec<&str> = flags[..layers as usize]
                    .iter()
                    .map(|f| if f.as_bool() == Some(true) { "linear_attention" } else { "full_attention" })
                    .collect();
                c.insert("layer_types".into(), json!(types));
            }
            Some(v) => {
                return Err(Error::config(format!(
                    "{}: metadata '{}' must be a list of booleans, found {v}",
                    self.where_(),
                    key("attention.recurrent_layers")
                )))
            }
            None => {
                if let Some(v) = self.get(&key("full_attention_interval"))? {
                    c.insert("full_attention_interval".into(), v.clone());
                }
            }
        }
        let head_dim = c.get("head_dim").and_then(|v| v.as_u64()).unwrap_or(0);
        let mut rope = Map::new();
        rope.insert("rope_type".into(), json!("default"));
        if let (Some(Value::Number(d)), true) = (self.get(&key("rope.dimension_count"))?, head_dim > 0) {
            let d = d.as_f64().unwrap_or(0.0);
            rope.insert("partial_rotary_factor".into(), json!(d / head_dim as f64));
        }
        c.insert("rope_parameters".into(), Value::Object(rope));
        if arch == "qwen35moe" {
            let shared = match self.get(&key("expert_shared_feed_forward_length"))? {
                Some(v) => v.clone(),
                None => c.get("intermediate_size").cloned().ok_or_else(|| {
                    Error::config(format!(
                        "{}: metadata '{}' is missing (the shared expert's size)",
                        self.where_(),
                        key("expert_shared_feed_forward_length")
                    ))
                })?,
            };
            c.insert("shared_expert_intermediate_size".into(), shared);
            c.remove("mlp_only_layers");
        }
        c.insert("attention_bias".into(), json!(self.tensors.iter().any(|t| t.name.ends_with(".attn_q.bias"))));
        c.insert("gguf_norms_include_one".into(), json!(true));
        c.insert("gguf_tiled_value_heads".into(), json!(true));
        Ok(())
    }

    /// A count that a Qwen3.5 file's metadata must hold (`{arch}.{k}`).
    fn qwen35_count(&self, arch: &str, k: &str) -> Result<u64> {
        let key = format!("{arch}.{k}");
        match self.get(&key)? {
            Some(v) => v.as_u64().ok_or_else(|| {
                Error::config(format!("{}: metadata '{key}' must be a count, found {v}", self.where_()))
            }),
            None => Err(Error::config(format!(
                "{}: metadata '{key}' is missing (a {arch} model's Gated DeltaNet needs it)",
                self.where_()
            ))),
        }
    }

    /// The trunk's layers of a Qwen3.5 file: `block_count` less the multi-token-prediction layers stored after them
    /// (`nextn_predict_layers`), which must leave at least one.
    fn qwen35_trunk(&self, arch: &str) -> Result<u64> {
        let blocks = self.qwen35_count(arch, "block_count")?;
        let nextn = match self.get(&format!("{arch}.nextn_predict_layers"))? {
            Some(_) => self.qwen35_count(arch, "nextn_predict_layers")?,
            None => 0,
        };
        if nextn >= blocks {
            return Err(Error::config(format!(
                "{}: nextn_predict_layers ({nextn}) leaves no layer of the {blocks} in block_count",
                self.where_()
            )));
        }
        Ok(blocks - nextn)
    }

    /// The layers `hf_tensors` maps: a Qwen3.5 file's trunk (None for other architectures, whose every block is a
    /// layer).
    fn trunk_layers(&self) -> Result<Option<usize>> {
        let arch = self.architecture()?;
        if arch != "qwen35" && arch != "qwen35moe" {
            return Ok(None);
        }
        Ok(Some(self.qwen35_trunk(&arch)? as usize))
    }

    /// The tensors under the names the model loader asks for (`model.layers.N.self_attn.q_proj.weight`, ...), with
    /// a MoE layer's stacked experts (`blk.N.ffn_gate_exps.weight`, [experts, rows, cols]) split into one matrix per
    /// expert (`model.layers.N.mlp.experts.E.gate_proj.weight`): a byte range per expert. A tensor this loader does
    /// not know is refused (ignoring it could run a different model than the file describes).
    pub fn hf_tensors(&self) -> Result<Vec<GgufTensor>> {
        let mut out = Vec::with_capacity(self.tensors.len());
        let trunk = self.trunk_layers()?;
        for t in &self.tensors {
            let unknown = || {
                Error::Unsupported(format!(
                    "{}: tensor '{}' is not one of the tensors this loader knows for its architecture; refused",
                    self.where_(),
                    t.name
                ))
            };
            let simple = match t.name.as_str() {
                "token_embd.weight" => Some("model.embed_tokens.weight".to_string()),
                "output_norm.weight" => Some("model.norm.weight".to_string()),
                "output.weight" => Some("lm_head.weight".to_string()),
                _ => None,
            };
            if let Some(n) = simple {
                out.push(GgufTensor { name: n, ..t.clone() });
                continue;
            }
            let Some(rest) = t.name.strip_prefix("blk.") else { return Err(unknown()) };
            let Some((layer, part)) = rest.split_once('.') else { return Err(unknown()) };
            let Ok(layer) = layer.parse::<usize>() else { return Err(unknown()) };
            if trunk.is_some_and(|n| layer >= n) {
                continue; // Qwen3.5's multi-token-prediction layers: not part of the model transformers runs
            }
            let p = format!("model.layers.{layer}");
            // Qwen3.5's Gated DeltaNet layers (those with `ssm_a`), in llama.cpp's names
            let recurrent = trunk.is_some() && self.tensor(&format!("blk.{layer}.ssm_a")).is_some();
            let linear = match part {
                "attn_qkv.weight" if recurrent => Some("in_proj_qkv.weight"),
                "attn_gate.weight" if recurrent => Some("in_proj_z.weight"),
                "ssm_beta.weight" => Some("in_proj_b.weight"),
                "ssm_alpha.weight" => Some("in_proj_a.weight"),
                "ssm_conv1d.weight" => Some("conv1d.weight"),
                "ssm_a" => Some("ssm_a"),
                "ssm_dt.bias" => Some("dt_bias"),
                "ssm_norm.weight" => Some("norm.weight"),
                "ssm_out.weight" => Some("out_proj.weight"),
                _ => None,
            };
            if let Some(n) = linear {
                if trunk.is_none() {
                    return Err(unknown());
                }
                out.push(GgufTensor { name: format!("{p}.linear_attn.{n}"), ..t.clone() });
                continue;
            }
            let experts = match part {
                "ffn_gate_exps.weight" => Some("gate_proj"),
                "ffn_up_exps.weight" => Some("up_proj"),
                "ffn_down_exps.weight" => Some("down_proj"),
                _ => None,
            };
            if let Some(proj) = experts {
                if t.shape.len() != 3 {
                    return Err(Error::load(format!(
                        "{}: tensor '{}' has shape {:?}, expected [experts, rows, columns]",
                        self.where_(),
                        t.name,
                        t.shape
                    )));
                }
                let per = (t.end - t.start) / t.shape[0] as u64;
                for e in 0..t.shape[0] {
                    let start = t.start + e as u64 * per;
                    out.push(GgufTensor {
                        name: format!("{p}.mlp.experts.{e}.{proj}.weight"),
                        shape: t.shape[1..].to_vec(),
                        dtype: t.dtype,
                        start,
                        end: start + per,
                    });
                }
                continue;
            }
            let hf = match part {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_q.bias" => "self_attn.q_proj.bias",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_k.bias" => "self_attn.k_proj.bias",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_v.bias" => "self_attn.v_proj.bias",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "attn_output.bias" => "self_attn.o_proj.bias",
                "attn_q_norm.weight" => "self_attn.q_norm.weight",
                "attn_k_norm.weight" => "self_attn.k_norm.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                "ffn_gate_inp.weight" => "mlp.gate.weight",
                "post_attention_norm.weight" if trunk.is_some() => "post_attention_layernorm.weight",
                "ffn_gate_shexp.weight" if trunk.is_some() => "mlp.shared_expert.gate_proj.weight",
                "ffn_up_shexp.weight" if trunk.is_some() => "mlp.shared_expert.up_proj.weight",
                "ffn_down_shexp.weight" if trunk.is_some() => "mlp.shared_expert.down_proj.weight",
                "ffn_gate_inp_shexp.weight" if trunk.is_some() => "mlp.shared_expert_gate.weight",
                _ => return Err(unknown()),
            };
            out.push(GgufTensor { name: format!("{p}.{hf}"), ..t.clone() });
        }
        Ok(out)
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.get(key)? {
            None => Ok(None),
            Some(Value::Array(a)) => {
                a.iter().map(|v| v.as_str()).collect::<Option<Vec<_>>>().map(Some).ok_or_else(|| {
                    Error::load(format!("{}: metadata '{key}' must be a list of strings", self.where_()))
                })
            }
            Some(v) => Err(Error::load(format!(
                "{}: metadata '{key}' must be a list of strings, found {}",
                self.where_(),
                crate::load::json::type_name(v)
            ))),
        }
    }

    /// The Hugging Face tokenizer.json of the file's vocabulary: a byte-level BPE (`tokenizer.ggml.model` =
    /// `gpt2`) with the vocabulary and merges of the file, the pre-tokenizer its `tokenizer.ggml.pre` names
    /// (`qwen2`, or the GPT-2 split for `default`/`gpt2`/unset), control tokens as special added tokens, other
    /// user-defined tokens as added tokens. The `[PAD<n>]` entries llama.cpp's converter writes to fill the
    /// embedding up to the model's vocab_size are not tokens and are left out.
    pub fn tokenizer_json(&self) -> Result<Value> {
        let w = self.where_();
        match self.get("tokenizer.ggml.model")? {
            Some(Value::String(m)) if m == "gpt2" => {}
            Some(Value::String(m)) => {
                return Err(Error::Unsupported(format!(
                    "{w}: tokenizer.ggml.model '{m}' is not supported (only byte-level BPE, 'gpt2', as Qwen models use)"
                )))
            }
            _ => return Err(Error::load(format!("{w}: metadata 'tokenizer.ggml.model' is missing: no tokenizer"))),
        }
        let tokens = self
            .strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| Error::load(format!("{w}: metadata 'tokenizer.ggml.tokens' is missing")))?;
        let types: Vec<u64> = match self.get("tokenizer.ggml.token_type")? {
            None => vec![1; tokens.len()],
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(0)).collect(),
            Some(_) => return Err(Error::load(format!("{w}: metadata 'tokenizer.ggml.token_type' must be a list"))),
        };
        if types.len() != tokens.len() {
            return Err(Error::load(format!(
                "{w}: {} tokens but {} token types (tokenizer.ggml.token_type)",
                tokens.len(),
                types.len()
            )));
        }
        let merges = self.strings("tokenizer.ggml.merges")?.unwrap_or_default();
        let is_pad = |t: &str| {
            t.strip_prefix("[PAD")
                .and_then(|r| r.strip_suffix(']'))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        };
        // Every token at its own id in the BPE vocabulary, control and user-defined ones too: the tokenizers library
        // gives an added token the id its text has in the vocabulary, and numbers one whose text is not there after
        // the vocabulary, whatever id tokenizer.json says (HF's tokenizer.json files list them in both places).
        let mut vocab = Map::new();
        let (mut added, mut unused) = (vec![], vec![]);
        for (i, (&t, &ty)) in tokens.iter().zip(&types).enumerate() {
            let special = match ty {
                // normal, unknown, byte
                1 | 2 | 6 => None,
                // control: special added tokens; user-defined: added tokens
                3 => Some(true),
                4 if is_pad(t) => continue,
                4 => Some(false),
                // unused: in the vocabulary where its text is free, after the others (it is never produced)
                5 => {
                    unused.push(i);
                    continue;
                }
                other => return Err(Error::load(format!("{w}: token {i} {t:?} has unknown token type {other}"))),
            };
            if let Some(prev) = vocab.insert(t.to_string(), json!(i)) {
                return Err(Error::load(format!(
                    "{w}: token {i} {t:?} appears twice in the vocabulary (also token {prev}, tokenizer.ggml.tokens)"
                )));
            }
            if let Some(special) = special {
                added.push(json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special}));
            }
        }
        for i in unused {
            if !vocab.contains_key(tokens[i]) {
                vocab.insert(tokens[i].to_string(), json!(i));
            }
        }
        for m in &merges {
            let ok = m
                .split_once(' ')
                .is_some_and(|(a, b)| !b.contains(' ') && vocab.contains_key(a) && vocab.contains_key(b));
            if !ok {
                return Err(Error::load(format!(
                    "{w}: merge {m:?} (tokenizer.ggml.merges) is not two vocabulary tokens separated by a space"
                )));
            }
        }
        let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": regex});
        let (normalizer, pre) = match self.get("tokenizer.ggml.pre")?.and_then(|v| v.as_str()) {
            // Qwen2's tokenizer.json normalises to NFC; Qwen3.5's has no normaliser (llama.cpp's golden vectors for
            // it keep a decomposed "e" + U+0301 as two tokens)
            Some(name @ ("qwen2" | "qwen35")) => (
                if name == "qwen2" { json!({"type": "NFC"}) } else { Value::Null },
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": if name == "qwen2" { QWEN2_SPLIT } else { QWEN35_SPLIT }},
                     "behavior": "Isolated", "invert": false},
                    byte_level(false)]}),
            ),
            None | Some("default") | Some("gpt2") => (Value::Null, byte_level(true)),
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{w}: tokenizer.ggml.pre '{other}' (the pre-tokenizer) is not supported; supported: qwen2, \
                     qwen35, default, gpt2"
                )))
            }
        };
        let add_bos = self.get("tokenizer.ggml.add_bos_token")?.and_then(|v| v.as_bool()).unwrap_or(false);
        let post = match (add_bos, self.get("tokenizer.ggml.bos_token_id")?.and_then(|v| v.as_u64())) {
            (true, Some(b)) => {
                let bos = tokens.get(b as usize).ok_or_else(|| {
                    Error::load(format!("{w}: tokenizer.ggml.bos_token_id {b} is outside the vocabulary"))
                })?;
                json!({"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {*bos: {"id": bos, "ids": [b], "tokens": [bos]}}})
            }
            _ => Value::Null,
        };
        let merges: Vec<Value> = merges.iter().map(|m| json!(m)).collect();
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre,
            "post_processor": post,
            "decoder": byte_level(true),
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges},
        }))
    }

    /// `tokenizer.chat_template`, and the bos/eos token strings a template may use.
    pub fn chat_template(&self) -> Result<Option<(String, String, String)>> {
        let Some(v) = self.get("tokenizer.chat_template")? else { return Ok(None) };
        let Some(src) = v.as_str() else {
            return Err(Error::config(format!(
                "{}: metadata 'tokenizer.chat_template' must be a string",
                self.where_()
            )));
        };
        let tokens = self.strings("tokenizer.ggml.tokens")?.unwrap_or_default();
        let tok = |k: &str| -> Result<String> {
            Ok(self
                .get(&format!("tokenizer.ggml.{k}"))?
                .and_then(|v| v.as_u64())
                .and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string())
                .unwrap_or_default())
        };
        Ok(Some((src.to_string(), tok("bos_token_id")?, tok("eos_token_id")?)))
    }
}

/// Qwen2's pre-tokenizer split (llama.cpp's `qwen2` pre-tokenizer; the regex of Qwen2's tokenizer.json).
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's (llama.cpp's `qwen35` pre-tokenizer, the regex of Qwen3.5's tokenizer.json): Qwen2's with combining
/// marks (`\p{M}`) counted as letters.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

//! A loaded model directory: weights, tokenizer, profile. Stateless between calls: each sequence owns
//! its own `KvCache`, so one `Model` serves any number of sequences.

use crate::config::{detect_family, read_json, Fields, ModelConfig, Profile};
use crate::cpu_pool::on_device_pool;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::mask::MaskSpec;
use crate::mask::{Alignment, AttentionKind, BlockGrid};
use crate::models::qwen::{QwenModel, Segment};
use crate::quant::QuantFormat;
use crate::request::{token_ids, LogitsRequest, Params, ProfileOverrides, ScoreRequest};
use crate::sampling::{token_logprobs, TokenLogprob};
use crate::skinny::Kernels;
use crate::weights::{checkpoint_files, Weights};
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

pub struct Model {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub profile: Profile,
    pub net: QwenModel,
    pub tokenizer: tokenizers::Tokenizer,
    pub num_parameters: usize,
    /// Bytes of the weights as held in memory (a bf16 checkpoint's matrices stay bf16 on the CPU).
    pub weight_bytes: usize,
    /// How the weight matrices are held: the `quantize` format ("q8_0" / "q4_k", see `crate::quant` for the
    /// matrices that fall back), else the dtype of the embedding table ("bfloat16" for a bf16 checkpoint on the
    /// CPU, else the compute dtype).
    pub weight_format: String,
    /// The quantized matrices multiply activations rounded to 8 bits (`LoadOptions::int8_activations`).
    pub int8_activations: bool,
    pub chat_template: Option<crate::chat::ChatTemplate>,
    /// UTF-8 bytes of the longest token string (bounds the text a prompt can have and still fit the context).
    pub max_token_bytes: usize,
    /// The special added tokens' strings (control tokens such as `<|im_end|>`).
    pub special_tokens: Vec<String>,
}

/// How to load a model: where, in which precision, with which profile overrides and kernel choices.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub dtype: DType,
    pub overrides: ProfileOverrides,
    /// CPU, f32 compute: a bf16 checkpoint's matrices stay bf16 in memory and are widened exactly inside the
    /// skinny kernel (half the memory and weight traffic). On by default; benchmarks turn it off for A/B runs.
    pub keep_bf16_weights: bool,
    /// Quantize the matrices at load (`crate::quant`; CPU, float32 compute).
    pub quantize: Option<QuantFormat>,
    /// Multiply the quantized matrices (of the `quantize` option or a GGUF file) with integer dot products on
    /// activations rounded to 8 bits (`crate::qdot`; x86-64 CPUs with AVX2, AVX-512 VNNI where present): faster, not
    /// the exact product. `None` (the default): wherever the device can (see `Model::load`); `Some(false)`: the
    /// exact products (CPU only); `Some(true)`: required, an error where it cannot be had.
    pub int8_activations: Option<bool>,
    pub kernels: Kernels,
    /// Told (bytes read, bytes in all) after each tensor of the checkpoint is read.
    pub progress: Option<crate::weights::Progress>,
}

impl Default for LoadOptions {
    /// CPU, f32, the checkpoint's own profile, default kernels.
    fn default() -> Self {
        LoadOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            overrides: ProfileOverrides::default(),
            keep_bf16_weights: true,
            quantize: None,
            int8_activations: None,
            kernels: Kernels::default(),
            progress: None,
        }
    }
}

/// Hand the heap memory freed during a load back to the system. Reading, quantizing and rearranging the weights
/// frees many large temporary buffers among the held ones; glibc keeps such holes in its heap, so the process's RSS
/// after a load stood 4-11% above the weights it holds (quantized models; measured on a 2048-wide 1.0B model: q4_k
/// with int8 activations 1.106x the held bytes before, 1.019x after). Elsewhere a no-op.
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the system; it takes no pointers of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `int8_activations=False` for quantized weights on CUDA.
fn exact_on_cuda_error() -> Error {
    Error::invalid(
        "int8_activations=False: on CUDA the quantized products always round the activations to 8 bits (candle's \
         kernels); the exact products of quantized weights run on the CPU (device='cpu')"
            .to_string(),
    )
}

/// Parse a device string: "auto", "cpu", "cuda", "cuda:N", "metal".
pub fn parse_device(s: &str) -> Result<Device> {
    let (kind, ordinal) = match s.split_once(':') {
        Some((k, n)) => {
            let n: usize =
                n.parse().map_err(|_| Error::invalid(format!("device '{s}': '{n}' is not a device number")))?;
            (k, n)
        }
        None => (s, 0),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "auto" => {
            if candle_core::utils::cuda_is_available() {
                if let Ok(d) = Device::new_cuda(0) {
                    return Ok(single_stream(d));
                }
            }
            if candle_core::utils::metal_is_available() {
                if let Ok(d) = Device::new_metal(0) {
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
        "cuda" => {
            if !candle_core::utils::cuda_is_available() {
                return Err(Error::Unsupported(
                    "device 'cuda': this build of mbd-rs has no CUDA support (install the CUDA wheel)".into(),
                ));
            }
            Device::new_cuda(ordinal)
                .map(single_stream)
                .map_err(|e| Error::Unsupported(format!("device '{s}': no usable CUDA device or driver: {e}")))
        }
        "metal" => {
            if !candle_core::utils::metal_is_available() {
                return Err(Error::Unsupported("device 'metal': this build of mbd-rs has no Metal support".into()));
            }
            Device::new_metal(ordinal)
                .map_err(|e| Error::Unsupported(format!("device '{s}': no usable Metal device: {e}")))
        }
        _ => Err(Error::invalid(format!("device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'metal', got '{s}'"))),
    }
}

/// A CUDA device whose tensors skip cudarc's per-allocation events. cudarc records them only once its context has
/// streams of its own (`new_stream`), which candle's device and this engine never create; until then it still
/// creates two events per allocation and destroys them at the free: four driver calls per op's output, unused.
fn single_stream(d: Device) -> Device {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = &d {
        // SAFETY: no stream is created on this context, so the events would never be recorded or waited on.
        unsafe { c.disable_event_tracking() };
    }
    d
}

pub fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// Parse a dtype string; CPU computes in f32 only (candle has no fast half-precision matmul there).
pub fn parse_dtype(s: Option<&str>, device: &Device) -> Result<DType> {
    let dt = match s {
        None | Some("auto") => {
            if device.is_cpu() {
                DType::F32
            } else {
                DType::BF16
            }
        }
        Some("float32") | Some("f32") => DType::F32,
        Some("bfloat16") | Some("bf16") => DType::BF16,
        Some("float16") | Some("f16") => DType::F16,
        Some(o) => {
            return Err(Error::invalid(format!("dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got '{o}'")))
        }
    };
    if device.is_cpu() && dt != DType::F32 {
        return Err(Error::invalid(format!(
            "dtype '{}' is not supported on the CPU, which computes in float32",
            s.unwrap_or("")
        )));
    }
    Ok(dt)
}

pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "other",
    }
}

/// tokenizer.json, with any padding or truncation it configures switched off: transformers switches them off
/// for a plain call too, and a fixed padding length taken from the file would size every encoding (a hostile
/// `"Fixed": 2^40` aborts on the first prompt) while truncation would silently cut prompts.
/// The tokenizers library panics on some malformed files (a syntax error inside `decoder`, a BPE merge shorter
/// than `continuing_subword_prefix`): the JSON syntax is checked first, and a panic while building is caught
/// here and reported as this file's error.
fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let p = dir.join("tokenizer.json");
    if !p.exists() {
        return Err(Error::FileNotFound { path: p, what: "the tokenizer (tokenizer.json)".into() });
    }
    let bad = |why: String| Error::load(format!("{}: not a valid tokenizer: {why}", p.display()));
    let text = std::fs::read_to_string(&p).map_err(|e| bad(e.to_string()))?;
    tokenizer_from_json(&text, &p.display().to_string())
}

/// A tokenizer from the text of a tokenizer.json (`label`: where it came from, for messages).
fn tokenizer_from_json(text: &str, label: &str) -> Result<tokenizers::Tokenizer> {
    let bad = |why: String| Error::load(format!("{label}: not a valid tokenizer: {why}"));
    serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| {
        bad(format!("malformed JSON ({:?} error at line {} column {})", e.classify(), e.line(), e.column()))
    })?;
    let built = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>());
    let mut tok = match built {
        Ok(r) => r.map_err(|e| bad(e.to_string()))?,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            return Err(bad(format!("the tokenizers library failed on it ({msg})")));
        }
    };
    tok.with_padding(None);
    tok.with_truncation(None).map_err(|e| Error::load(format!("{label}: {e}")))?;
    Ok(tok)
}

/// A mask token named in the tokenizer's added tokens (spellings differ between families' files).
fn tokenizer_mask_id(tok: &tokenizers::Tokenizer) -> Option<u32> {
    ["<|mask|>", "<|MASK|>", "|<MASK>|", "<MASK>", "<mask>"].iter().find_map(|s| tok.token_to_id(s))
}

/// Positions forwarded at once when filling a cache with a prompt (more when a block is longer). Bounds the
/// transient memory: a chunk's attention scores are heads x chunk x prefix floats (for a 0.5B model and an 8K
/// prompt: 0.23 GB per chunk of 512 against 3.8 GB for the whole prompt at once).
pub const PREFILL_CHUNK: usize = 512;

/// Positions scored per forward by `Model::prompt_logprobs` (bounds the logits it holds: 128 rows of a 152K
/// vocabulary are 78 MB of float32).
pub const SCORE_CHUNK: usize = 128;

/// Private-use characters around a message's index while a chat template renders (`Model::chat_prompt_ids`).
const PLACEHOLDER_OPEN: char = '\u{E000}';
const PLACEHOLDER_CLOSE: char = '\u{E001}';

/// [start, stop) cut into pieces of about `PREFILL_CHUNK` positions that end on block boundaries of `grid` (a
/// block's positions see each other, so a block is never split; full attention is one piece).
pub fn chunks(grid: &BlockGrid, start: usize, stop: usize) -> Vec<(usize, usize)> {
    let mut out = vec![];
    let mut s = start;
    while s < stop {
        let mut e = (s + PREFILL_CHUNK).min(stop);
        while e < stop && !grid.is_boundary(e) {
            e += 1;
        }
        out.push((s, e));
        s = e;
    }
    out
}

impl Model {
    /// Load a model directory (config.json, tokenizer.json, safetensors) or a GGUF file (`crate::gguf`).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Model> {
        let (device, dtype, ov) = (&opts.device, opts.dtype, &opts.overrides);
        let gguf = if dir.is_file() {
            Some(crate::gguf::GgufFile::read(dir)?)
        } else if dir.is_dir() {
            None
        } else {
            return Err(Error::FileNotFound {
                path: dir.to_path_buf(),
                what: "no such model directory (expected config.json, tokenizer.json and *.safetensors) or GGUF file"
                    .into(),
            });
        };
        let cfg_path = dir.join("config.json");
        let (cfg_map, cfg_file) = match &gguf {
            Some(g) => (g.hf_config()?, format!("{} (GGUF metadata as config.json)", dir.display())),
            None => (read_json(&cfg_path)?, cfg_path.display().to_string()),
        };
        let cfg_fields = Fields { file: &cfg_file, map: &cfg_map };
        let (family, architecture) = detect_family(&cfg_fields)?;
        let config = ModelConfig::from_json(&cfg_fields, family.arch())?;
        let gen_path = dir.join("generation_config.json");
        let gen_file = gen_path.display().to_string();
        let gen_map = if gguf.is_none() && gen_path.exists() { Some(read_json(&gen_path)?) } else { None };
        let gen_fields = gen_map.as_ref().map(|m| Fields { file: &gen_file, map: m });
        let tokenizer = match &gguf {
            Some(g) => {
                tokenizer_from_json(&g.tokenizer_json()?.to_string(), &format!("{} (GGUF tokenizer)", dir.display()))?
            }
            None => load_tokenizer(dir)?,
        };
        let profile = Profile::resolve(
            family,
            architecture,
            &cfg_fields,
            gen_fields.as_ref(),
            tokenizer_mask_id(&tokenizer),
            ov,
        )?;
        if let Some(m) = profile.mask_token_id {
            if m as usize >= config.vocab_size {
                return Err(Error::config(format!(
                    "mask_token_id {m} is outside the vocabulary of {} tokens",
                    config.vocab_size
                )));
            }
        }
        if profile.block_size > config.max_position_embeddings {
            let msg = format!(
                "block_size {} is larger than the context (max_position_embeddings {} in {cfg_file})",
                profile.block_size, config.max_position_embeddings
            );
            return Err(if ov.block_size.is_some() { Error::invalid(msg) } else { Error::config(msg) });
        }
        if let Some(q) = opts.quantize {
            if !(device.is_cuda() || device.is_cpu() && dtype == DType::F32) {
                return Err(Error::invalid(format!(
                    "quantize='{}': quantized weights run on the CPU in float32 or on CUDA in this version; load \
                     with device='cpu' (and dtype None or 'float32') or device='cuda'",
                    q.name()
                )));
            }
        }
        // 8-bit activations: CUDA's quantized products (candle's kernels) always round them; the CPU's integer dot
        // products need float32 compute and AVX2. Off where nothing ends up quantized (checked after the load).
        let int8_here = device.is_cuda() || device.is_cpu() && dtype == DType::F32 && crate::qdot::available();
        let int8 = match opts.int8_activations {
            None => int8_here,
            Some(false) => false,
            Some(true) => {
                let why = if !device.is_cuda() && (!device.is_cpu() || dtype != DType::F32) {
                    Some("it runs on the CPU in float32 or on CUDA in this version; load with device='cpu' (and dtype None or 'float32') or device='cuda'")
                } else if opts.quantize.is_none() && gguf.is_none() {
                    Some("it multiplies quantized matrices: pass quantize='q8_0', 'q4_k', ... or load a GGUF file")
                } else if !int8_here {
                    Some(
                        "this CPU lacks AVX2, which its integer dot products need (x86-64; AVX-512 VNNI where present)",
                    )
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(Error::invalid(format!("int8_activations=True: {why}")));
                }
                true
            }
        };
        let exact_on_cuda = device.is_cuda() && opts.int8_activations == Some(false);
        if exact_on_cuda && opts.quantize.is_some() {
            return Err(exact_on_cuda_error());
        }
        let ws = match &gguf {
            Some(g) => Weights::open_gguf(g, device, dtype, opts.keep_bf16_weights, opts.quantize)?,
            None => Weights::open(&checkpoint_files(dir)?, device, dtype, opts.keep_bf16_weights, opts.quantize)?,
        }
        .with_progress(opts.progress.clone())
        .with_packing(opts.kernels.packs())
        .with_int8_activations(int8)
        .with_candle_quant(opts.kernels.candle_quant);
        let num_parameters = ws.num_parameters();
        let net = QwenModel::load(&config, &ws, device, dtype, opts.kernels)?;
        let weight_bytes = ws.loaded_bytes();
        let held = ws.held_formats();
        if exact_on_cuda && !held.is_empty() {
            return Err(exact_on_cuda_error()); // a GGUF file's blocks (quantize= is refused before the load)
        }
        let weight_format = match (opts.quantize, net.table_dtype()) {
            (Some(q), _) => q.name().to_string(),
            // A GGUF file's block formats, as held.
            (None, _) if !held.is_empty() => held.join("+"),
            (None, Some(d)) => dtype_name(d).to_string(),
            (None, None) => return Err(Error::Internal("a quantized table without the quantize option".into())),
        };
        let chat_template = match &gguf {
            Some(g) => match g.chat_template()? {
                Some((src, bos, eos)) => {
                    Some(crate::chat::ChatTemplate::new(src, bos, eos, &format!("{} (GGUF metadata)", dir.display()))?)
                }
                None => None,
            },
            None => crate::chat::ChatTemplate::from_dir(dir)?,
        };
        let max_token_bytes = tokenizer.get_vocab(true).keys().map(|t| t.len()).max().unwrap_or(1);
        let mut special_tokens: Vec<String> =
            tokenizer.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        special_tokens.sort();
        release_freed_heap();
        Ok(Model {
            dir: dir.to_path_buf(),
            config,
            profile,
            net,
            tokenizer,
            num_parameters,
            weight_bytes,
            weight_format,
            int8_activations: int8 && !held.is_empty(),
            chat_template,
            max_token_bytes,
            special_tokens,
        })
    }

    pub fn new_cache(&self) -> KvCache {
        self.net.new_cache()
    }

    /// Forward `ids` (at positions `cache.len()..`) under `grid` into the cache and commit them (on the caller's
    /// thread: run it on the engine's pool, as `Generation::step` does), in chunks of
    /// about `PREFILL_CHUNK` positions that end on block boundaries (a block's positions see each other, so a
    /// block is never split). Returns the logits of the last position, (1, V) f32.
    pub fn fill_cache(&self, cache: &mut KvCache, ids: &[u32], grid: &BlockGrid) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(Error::Internal("fill_cache: no tokens".into()));
        }
        let base = cache.len();
        let mut last = None;
        for (start, end) in chunks(grid, base, base + ids.len()) {
            last = Some(self.net.forward(cache, &ids[start - base..end - base], grid, Some(&[end - start - 1]))?);
            cache.commit(end - start)?;
        }
        last.ok_or_else(|| Error::Internal("fill_cache: no chunk".into()))
    }

    /// Token ids from a caller, checked against the vocabulary (`request::token_ids` owns the rule).
    pub fn token_ids(&self, name: &str, ids: &[i64]) -> Result<Vec<u32>> {
        token_ids(name, ids, self.config.vocab_size)
    }

    /// Check ids that are already u32 (e.g. from a Rust caller) against the vocabulary.
    pub fn check_ids(&self, name: &str, ids: &[u32]) -> Result<()> {
        let wide: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        self.token_ids(name, &wide).map(|_| ())
    }

    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| Error::invalid(format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// A prompt's token ids. A text longer than any prompt that fits the context (every token covers at most
    /// `max_token_bytes` bytes; with a margin of 4 for normalisers) is refused before it is tokenized.
    pub fn prompt_ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.check_prompt_bytes(text.len())?;
        self.tokenize(text, add_special_tokens)
    }

    fn check_prompt_bytes(&self, bytes: usize) -> Result<()> {
        let ctx = self.config.max_position_embeddings;
        let limit = ctx.saturating_mul(4 * self.max_token_bytes.max(16));
        if bytes > limit {
            return Err(Error::ContextLength(format!(
                "the prompt has {bytes} bytes of text; no prompt over {limit} bytes fits the maximum context of {ctx} tokens"
            )));
        }
        Ok(())
    }

    /// Token ids of a chat prompt (the template's rendering of `messages` plus a generation prompt). The
    /// template's own markup is tokenized with its control tokens; message contents stay text: a content that
    /// spells a control token (`<|im_end|><|im_start|>system`) is tokenized as plain text, unless
    /// `special_in_content`.
    pub fn chat_prompt_ids(
        &self,
        messages: &serde_json::Value,
        extra: &serde_json::Value,
        special_in_content: bool,
    ) -> Result<Vec<u32>> {
        let contents: Vec<&str> = match messages.as_array() {
            Some(list) => list.iter().map(|m| m.get("content").and_then(|c| c.as_str()).unwrap_or("")).collect(),
            None => vec![],
        };
        let spelled = contents.iter().any(|c| self.special_tokens.iter().any(|s| c.contains(s.as_str())));
        if special_in_content || !spelled {
            return self.prompt_ids(&self.render_chat(messages, true, extra)?, false);
        }
        // Render with a placeholder per content, then tokenize the markup between them with control tokens and
        // each content with control-token parsing off.
        let mut masked = messages.clone();
        for (i, m) in masked.as_array_mut().into_iter().flatten().enumerate() {
            m["content"] = serde_json::Value::String(format!("{PLACEHOLDER_OPEN}{i}{PLACEHOLDER_CLOSE}"));
        }
        let text = self.render_chat(&masked, true, extra)?;
        self.check_prompt_bytes(text.len() + contents.iter().map(|c| c.len()).sum::<usize>())?;
        let mut plain = self.tokenizer.clone();
        plain.set_encode_special_tokens(true);
        let mut ids = vec![];
        let mut next = 0;
        let mut rest = text.as_str();
        while let Some(a) = rest.find(PLACEHOLDER_OPEN) {
            let after = &rest[a + PLACEHOLDER_OPEN.len_utf8()..];
            let b = after.find(PLACEHOLDER_CLOSE).ok_or_else(|| self.content_kept_error())?;
            let i: usize = after[..b].parse().map_err(|_| self.content_kept_error())?;
            if i != next {
                return Err(self.content_kept_error());
            }
            ids.extend(self.tokenize(&rest[..a], false)?);
            let enc = plain.encode(contents[i], false).map_err(|e| Error::invalid(format!("cannot tokenize: {e}")))?;
            ids.extend_from_slice(enc.get_ids());
            next += 1;
            rest = &after[b + PLACEHOLDER_CLOSE.len_utf8()..];
        }
        if next != contents.len() {
            return Err(self.content_kept_error());
        }
        ids.extend(self.tokenize(rest, false)?);
        Ok(ids)
    }

    fn content_kept_error(&self) -> Error {
        Error::invalid(format!(
            "a message content spells a control token (one of {:?}) and this chat template changes contents, so they \
             cannot be kept as plain text; remove it, or pass special_tokens_in_content=True to let it act as one",
            self.special_tokens
        ))
    }

    pub fn detokenize(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids = self.token_ids("ids", ids)?;
        self.tokenizer.decode(&ids, skip_special_tokens).map_err(|e| Error::invalid(format!("cannot detokenize: {e}")))
    }

    /// Render chat `messages` (a JSON list of {role, content}) with the model's template; `extra` are more
    /// template variables (a JSON object or null).
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let tmpl = self.chat_template.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "{}: this model has no chat template (no chat_template.jinja and no 'chat_template' in tokenizer_config.json)",
                self.dir.display()
            ))
        })?;
        tmpl.render(messages, add_generation_prompt, extra)
    }

    /// The attention grid of a logits call: the request's choices over the profile's defaults.
    pub fn grid_for(&self, req: &LogitsRequest, len: usize) -> Result<BlockGrid> {
        let p = &self.profile;
        let kind = req.attention.unwrap_or(p.attention);
        let align = req.alignment.unwrap_or(p.alignment);
        let plen = match (align, kind, req.prompt_len) {
            (_, _, Some(l)) if l > len => {
                return Err(Error::invalid(format!("prompt_len must be between 0 and len(ids) = {len}, got {l}")))
            }
            (Alignment::Prompt, AttentionKind::BlockCausal, None) => {
                return Err(Error::invalid("prompt_len is required with alignment='prompt'"))
            }
            (_, _, l) => l.unwrap_or(0),
        };
        BlockGrid::new(kind, req.block_size.unwrap_or(p.block_size), align, plen)
    }

    /// Logits for every position of `ids` under the request's attention grid. With `prefix_len > 0` the first
    /// `prefix_len` tokens go through the cache (forward + commit) and the rest are forwarded as a window
    /// over the cached prefix; the result equals the no-cache one. Returns row-major (len, vocab) f32.
    pub fn logits(&self, ids: &[u32], req: &LogitsRequest) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::invalid("ids is empty: need at least one token"));
        }
        self.check_ids("ids", ids)?;
        let max_ctx = self.config.max_position_embeddings;
        if ids.len() > max_ctx {
            return Err(Error::ContextLength(format!("maximum context is {max_ctx} tokens; ids has {}", ids.len())));
        }
        let grid = self.grid_for(req, ids.len())?;
        let prefix_len = req.prefix_len.unwrap_or(0);
        if prefix_len > ids.len() {
            return Err(Error::invalid(format!("prefix_len {prefix_len} is longer than ids ({} tokens)", ids.len())));
        }
        if prefix_len > 0 && prefix_len < ids.len() && !grid.is_boundary(prefix_len) {
            return Err(Error::invalid(format!(
                "prefix_len {prefix_len} splits an attention block ({} attention, block_size {}): cached keys would need \
                 to see later tokens; use a block boundary",
                grid.kind.name(),
                grid.block_size
            )));
        }
        let v = self.config.vocab_size;
        let n = ids.len().checked_mul(v).ok_or_else(|| Error::invalid("logits: too many positions"))?;
        let mut out: Vec<f32> = Vec::new();
        out.try_reserve_exact(n).map_err(|_| {
            Error::invalid(format!(
                "logits for {} positions x {v} tokens ({:.1} GB of float32) cannot be allocated; ask for fewer positions",
                ids.len(),
                n as f64 * 4e-9
            ))
        })?;
        on_device_pool(self.net.device(), || {
            let mut cache = self.new_cache();
            let pieces = chunks(&grid, 0, prefix_len).into_iter().chain(chunks(&grid, prefix_len, ids.len()));
            for (start, end) in pieces {
                let l = self.net.forward(&mut cache, &ids[start..end], &grid, None)?;
                out.extend(l.flatten_all()?.to_vec1::<f32>()?);
                cache.commit(end - start)?;
            }
            Ok(out)
        })
    }
}

impl Model {
    /// Each token of `ids` scored given the tokens before it, in autoregressive mode (block size 1: what S2D2's
    /// verifier computes, and what block-causal models are trained to do at block size 1): for shifted models the
    /// logits row of the previous position under causal attention; for unshifted ones (SDAR) a mask token at the
    /// position that sees the tokens before it and itself (two rows per position in one forward, the first half
    /// causal, as S2D2's verification window). The first token has no context and gets None. Full-attention
    /// models (Dream) have no left-to-right likelihood and are refused.
    pub fn prompt_logprobs(&self, ids: &[u32], req: &ScoreRequest) -> Result<Vec<Option<TokenLogprob>>> {
        req.validate()?;
        let k = req.logprobs.unwrap_or(0);
        if ids.is_empty() {
            return Err(Error::invalid("the prompt is empty (0 tokens); give at least one token to score"));
        }
        self.check_ids("prompt", ids)?;
        let max_ctx = self.config.max_position_embeddings;
        if ids.len() > max_ctx {
            return Err(Error::ContextLength(format!(
                "maximum context is {max_ctx} tokens; the prompt to score has {}",
                ids.len()
            )));
        }
        let p = &self.profile;
        if p.attention == AttentionKind::Full {
            return Err(Error::invalid(format!(
                "prompt log-probabilities are left-to-right (block size 1), which needs block-causal or causal \
                 attention; this model ({}) uses full attention",
                p.architecture
            )));
        }
        let mask_id = match (p.logits_shift, p.mask_token_id) {
            (false, None) => {
                return Err(Error::invalid(format!(
                    "this model ({}) predicts a position from a mask token there, and has no mask token id; pass \
                     mask_token_id=... to Engine.load",
                    p.architecture
                )))
            }
            (_, m) => m.unwrap_or(0),
        };
        let causal = BlockGrid::causal();
        let mut out: Vec<Option<TokenLogprob>> = vec![None; ids.len()];
        on_device_pool(self.net.device(), || {
            let mut cache = self.new_cache();
            cache.reserve(ids.len() + SCORE_CHUNK)?;
            for s in (0..ids.len()).step_by(SCORE_CHUNK) {
                let e = (s + SCORE_CHUNK).min(ids.len());
                let w = e - s;
                // (window row whose logits predict position q, q) for the positions q >= 1 of this chunk
                let (logits, scored): (Tensor, Vec<usize>) = if p.logits_shift {
                    // row j (position s + j) predicts s + j + 1
                    let rows: Vec<usize> = (0..w).filter(|j| s + j + 1 < ids.len()).collect();
                    if rows.is_empty() {
                        break;
                    }
                    let l = self.net.forward(&mut cache, &ids[s..e], &causal, Some(&rows))?;
                    (l, rows.iter().map(|j| s + j + 1).collect())
                } else {
                    // rows [0, w): the tokens, causal; rows [w, 2w): a mask at each position, seeing the tokens
                    // before it and itself
                    let mut win = ids[s..e].to_vec();
                    win.extend(std::iter::repeat_n(mask_id, w));
                    let visible: Vec<Vec<std::ops::Range<usize>>> = (0..w)
                        .map(|j| std::iter::once(0..s + j + 1).collect())
                        .chain((0..w).map(|j| vec![0..s + j, s + w + j..s + w + j + 1]))
                        .collect();
                    let first = usize::from(s == 0);
                    let rows: Vec<usize> = (w + first..2 * w).collect();
                    if rows.is_empty() {
                        break; // a one-token prompt
                    }
                    let seg = Segment {
                        cache: &mut cache,
                        ids: &win,
                        positions: (s..e).chain(s..e).collect(),
                        mask: MaskSpec::Custom(visible),
                        rows: rows.clone(),
                    };
                    let l = self
                        .net
                        .forward_segments(&mut [seg])?
                        .pop()
                        .ok_or_else(|| Error::Internal("no logits".into()))?;
                    (l, rows.iter().map(|r| s + r - w).collect())
                };
                cache.commit(w)?;
                let tokens: Vec<u32> = scored.iter().map(|&q| ids[q]).collect();
                for (q, t) in scored.into_iter().zip(token_logprobs(&logits, None, &tokens, k)?) {
                    out[q] = Some(t);
                }
            }
            Ok::<(), Error>(())
        })?;
        Ok(out)
    }

    /// Time `reps` decode forwards of a `window`-token block over a committed prefix of `prefix` tokens
    /// (block-causal: one block, no mask; logits for every window row, or only the last with `last_row`, as a
    /// prefill that continues into decoding needs). Returns seconds per forward.
    /// Used by the benchmarks to compare with other engines on the same computation.
    pub fn bench_forward(&self, prefix: usize, window: usize, reps: usize, last_row: bool) -> Result<Vec<f64>> {
        let v = self.config.vocab_size as u64;
        let mut x: u64 = 0x9E3779B97F4A7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % v) as u32
        };
        let pre: Vec<u32> = (0..prefix).map(|_| next()).collect();
        let win: Vec<u32> = (0..window).map(|_| next()).collect();
        // the window is one block over the prefix: every query sees every key
        let one_block = BlockGrid::new(AttentionKind::Full, 1, Alignment::Absolute, 0)?;
        on_device_pool(self.net.device(), || {
            let mut cache = self.new_cache();
            cache.reserve(prefix + window)?;
            if prefix > 0 {
                self.fill_cache(&mut cache, &pre, &BlockGrid::causal())?;
            }
            let last = [window.saturating_sub(1)];
            let rows = last_row.then_some(&last[..]);
            let mut out = Vec::with_capacity(reps);
            for _ in 0..reps {
                let t = std::time::Instant::now();
                let l = self.net.forward(&mut cache, &win, &one_block, rows)?;
                // wait for the device's work before stopping the clock (not by reading a logit back: candle copies
                // a narrowed CUDA tensor's whole buffer to the host, 39 MB for 64 rows of a 152k vocabulary)
                self.net.device().synchronize()?;
                drop(l);
                out.push(t.elapsed().as_secs_f64());
            }
            Ok(out)
        })
    }
}

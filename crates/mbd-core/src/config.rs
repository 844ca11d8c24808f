//! Reading a model directory's JSON files: the Qwen dimensions (`ModelConfig`) and the block-diffusion
//! family profile (`Profile`) that says how the checkpoint must be decoded.

use crate::decoder::{Acceptance, ForcedProgress};
use crate::error::{Error, Result};
use crate::mask::{Alignment, AttentionKind};
use crate::request::ProfileOverrides;
use serde_json::{Map, Value};
use std::path::Path;

/// Read and parse a JSON object file, naming the file in every error.
pub fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::FileNotFound { path: path.to_path_buf(), what: "required by the model directory".into() }
        } else if e.kind() == std::io::ErrorKind::InvalidData {
            Error::config(format!("{}: not a JSON file (not UTF-8 text)", path.display()))
        } else {
            Error::load(format!("{}: cannot read: {e}", path.display()))
        }
    })?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| Error::config(format!("{}: malformed JSON: {e}", path.display())))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(Error::config(format!(
            "{}: expected a JSON object at the top level, found {}",
            path.display(),
            type_name(&other)
        ))),
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Typed access to a JSON object with errors that name the file and the field.
pub struct Fields<'a> {
    pub file: &'a str,
    pub map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    fn wrong(&self, key: &str, expected: &str, v: &Value) -> Error {
        Error::config(format!("{}: field '{key}' must be {expected}, found {} ({v})", self.file, type_name(v)))
    }
    fn missing(&self, key: &str, expected: &str) -> Error {
        Error::config(format!("{}: field '{key}' is missing (expected {expected})", self.file))
    }
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| self.wrong(key, "a non-negative integer", v)),
        }
    }
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key, "a non-negative integer"))
    }
    /// A size that must be at least 1 (a dimension or a count).
    pub fn positive(&self, key: &str) -> Result<usize> {
        let n = self.opt_usize(key)?.ok_or_else(|| self.missing(key, "a positive integer"))?;
        if n == 0 {
            return Err(Error::config(format!("{}: field '{key}' must be at least 1, found 0", self.file)));
        }
        Ok(n)
    }
    /// A token id: a non-negative integer that fits 32 bits (ids are u32 everywhere; a larger one is refused,
    /// never truncated).
    pub fn opt_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => self.id_value(key, v).map(Some),
        }
    }
    fn id_value(&self, key: &str, v: &Value) -> Result<u32> {
        let n = v.as_u64().ok_or_else(|| self.wrong(key, "a token id (a non-negative integer)", v))?;
        u32::try_from(n).map_err(|_| {
            Error::config(format!(
                "{}: field '{key}': token id {n} does not fit 32 bits (ids are below 2^32)",
                self.file
            ))
        })
    }
    /// A positive, finite number (as the f32 the kernels use when `as_f32`).
    pub fn positive_f64(&self, key: &str, default: f64, as_f32: bool) -> Result<f64> {
        let x = self.f64_or(key, default)?;
        let ok = if as_f32 { (x as f32) > 0.0 && (x as f32).is_finite() } else { x > 0.0 && x.is_finite() };
        if !ok {
            let kind = if as_f32 {
                "a positive number representable as a finite, non-zero f32"
            } else {
                "a positive finite number"
            };
            return Err(Error::config(format!("{}: field '{key}' must be {kind}, found {x}", self.file)));
        }
        Ok(x)
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(key, "a number", v)),
        }
    }
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(key)?.unwrap_or(default))
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(key, "true or false", v)),
        }
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }
    /// An id field that may be one integer or a list of integers (eos_token_id). Ids must fit 32 bits.
    pub fn ids(&self, key: &str) -> Result<Vec<u32>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(|x| self.id_value(key, x)).collect(),
            Some(v) => Ok(vec![self.id_value(key, v)?]),
        }
    }
    pub fn opt_usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|i| i as usize).ok_or_else(|| self.wrong(key, "a list of integers", x)))
                .collect(),
            Some(v) => Err(self.wrong(key, "a list of integers", v)),
        }
    }
}

crate::string_enum! {
    /// Which weight layout the checkpoint uses.
    pub enum Arch ("arch") { Qwen2 = "qwen2", Qwen3 = "qwen3", Qwen3Moe = "qwen3_moe" }
}

#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

/// The transformer's dimensions, read from config.json.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2 always; Qwen3 when `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (Qwen3 with `attention_bias`; never Qwen2).
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub moe: Option<MoeConfig>,
}

/// Largest `max_position_embeddings` accepted: RoPE positions are computed in f32, which represents every
/// integer exactly only up to 2^24.
pub const MAX_POSITIONS: usize = 1 << 24;

/// Check a `rope_scaling` / `rope_parameters` value: plain RoPE passes; scaling we do not implement is refused
/// (transformers would apply it, so ignoring it would change every logit); a value whose type cannot be told
/// is a config error.
fn check_rope(file: &str, key: &str, value: &Value) -> Result<()> {
    // Quote at most 120 characters of the value.
    let v = {
        let s = value.to_string();
        match s.char_indices().nth(120) {
            Some((i, _)) => format!("{}...", &s[..i]),
            None => s,
        }
    };
    let Value::Object(m) = value else {
        return Err(Error::config(format!(
            "{file}: field '{key}' must be an object with a 'rope_type' (or 'type') entry, found {} ({v})",
            type_name(value)
        )));
    };
    let kind = match m.get("rope_type").filter(|t| !t.is_null()).or_else(|| m.get("type").filter(|t| !t.is_null())) {
        None => None,
        Some(Value::String(t)) => Some(t.as_str()),
        Some(t) => {
            return Err(Error::config(format!(
                "{file}: field '{key}': 'rope_type' must be a string, found {} ({t})",
                type_name(t)
            )))
        }
    };
    match kind {
        Some("default") => Ok(()),
        // No type: only an object that says nothing but rope_theta (transformers >= 5 fills in "default") is
        // plain RoPE. Scaling parameters without a type cannot be interpreted, and transformers' config
        // validation refuses them too (missing required key 'rope_type').
        None if m.keys().all(|k| k == "rope_theta" || k == "rope_type" || k == "type") => Ok(()),
        None => Err(Error::config(format!(
            "{file}: field '{key}' {v} has no 'rope_type' (or 'type'): cannot tell which RoPE scaling it means \
             (transformers refuses it too: missing required key 'rope_type')"
        ))),
        Some(t) => Err(Error::Unsupported(format!(
            "{file}: {key} {v} is not supported yet (only plain RoPE: rope_type 'default'); transformers applies \
             '{t}' scaling to the rotary frequencies, so running without it would give different logits"
        ))),
    }
}

impl ModelConfig {
    pub fn from_json(f: &Fields, arch: Arch) -> Result<Self> {
        let hidden_size = f.positive("hidden_size")?;
        let num_attention_heads = f.positive("num_attention_heads")?;
        let num_key_value_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::config(format!(
                "{}: num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})",
                f.file
            )));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_attention_heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(Error::config(format!(
                "{}: head_dim must be a positive even number, found {head_dim}",
                f.file
            )));
        }
        for key in ["rope_scaling", "rope_parameters"] {
            if let Some(v) = f.get(key) {
                check_rope(f.file, key, v)?;
            }
        }
        if f.opt_bool("use_sliding_window")? == Some(true) {
            return Err(Error::Unsupported(format!(
                "{}: use_sliding_window=true is not supported (block-diffusion decoding needs full-context attention)",
                f.file
            )));
        }
        let rope_theta = match f.opt_f64("rope_theta")? {
            Some(_) => f.positive_f64("rope_theta", 10000.0, false)?,
            // transformers >= 5 may keep rope_theta inside rope_parameters.
            None => match f.get("rope_parameters") {
                Some(Value::Object(p)) => Fields { file: &format!("{} (rope_parameters)", f.file), map: p }
                    .positive_f64("rope_theta", 10000.0, false)?,
                _ => 10000.0,
            },
        };
        let rms_norm_eps = f.positive_f64("rms_norm_eps", 1e-6, true)?;
        let max_position_embeddings = f.opt_usize("max_position_embeddings")?.unwrap_or(32768);
        if max_position_embeddings == 0 || max_position_embeddings > MAX_POSITIONS {
            return Err(Error::config(format!(
                "{}: field 'max_position_embeddings' must be between 1 and {MAX_POSITIONS} (positions are exact in f32 \
                 up to 2^24), found {max_position_embeddings}",
                f.file
            )));
        }
        let moe = if arch == Arch::Qwen3Moe {
            Some(MoeConfig {
                // transformers >= 5 writes `num_local_experts`; earlier versions `num_experts`.
                num_experts: match f.opt_usize("num_experts")? {
                    Some(n) => n,
                    None => f.usize("num_local_experts")?,
                },
                num_experts_per_tok: f.usize("num_experts_per_tok")?,
                moe_intermediate_size: f.positive("moe_intermediate_size")?,
                norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
                decoder_sparse_step: f.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1),
                mlp_only_layers: f.opt_usize_list("mlp_only_layers")?,
            })
        } else {
            None
        };
        if let Some(m) = &moe {
            if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
                return Err(Error::config(format!(
                    "{}: num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                    f.file, m.num_experts_per_tok, m.num_experts
                )));
            }
        }
        let (qkv_bias, o_bias, qk_norm) = match arch {
            Arch::Qwen2 => (true, false, false),
            _ => {
                let b = f.opt_bool("attention_bias")?.unwrap_or(false);
                (b, b, true)
            }
        };
        let vocab_size = f.positive("vocab_size")?;
        let intermediate_size = f.positive("intermediate_size")?;
        let num_hidden_layers = f.positive("num_hidden_layers")?;
        // Every weight's element count must be a number: the shapes below are compared with the checkpoint's,
        // and a product that wraps around could match a forged header.
        let mut products: Vec<(&str, Vec<(&str, usize)>)> = vec![
            ("embed_tokens", vec![("vocab_size", vocab_size), ("hidden_size", hidden_size)]),
            ("mlp", vec![("intermediate_size", intermediate_size), ("hidden_size", hidden_size)]),
            (
                "q_proj",
                vec![
                    ("num_attention_heads", num_attention_heads),
                    ("head_dim", head_dim),
                    ("hidden_size", hidden_size),
                ],
            ),
        ];
        if let Some(m) = &moe {
            products.push((
                "experts",
                vec![
                    ("num_experts", m.num_experts),
                    ("", 2),
                    ("moe_intermediate_size", m.moe_intermediate_size),
                    ("hidden_size", hidden_size),
                ],
            ));
        }
        for (what, dims) in products {
            if dims.iter().try_fold(1usize, |a, (_, d)| a.checked_mul(*d)).is_none() {
                let expr: Vec<String> =
                    dims.iter().map(|(n, d)| if n.is_empty() { d.to_string() } else { format!("{n} ({d})") }).collect();
                return Err(Error::config(format!(
                    "{}: the {what} weights would have {} elements, which overflows (absurd sizes)",
                    f.file,
                    expr.join(" x ")
                )));
            }
        }
        Ok(ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            max_position_embeddings,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            qk_norm,
            moe,
        })
    }
}

crate::string_enum! {
    /// The block-diffusion families we recognise, keyed by `architectures[0]` or `model_type`.
    pub enum Family ("family") {
        Qwen2 = "qwen2",
        Qwen3 = "qwen3",
        Qwen3Moe = "qwen3_moe",
        Dream = "dream",
        Sdar = "sdar",
        SdarMoe = "sdar_moe",
        FastDllmV2 = "fast_dllm_v2",
        /// mbd-rs' own tiny trained model: a Qwen3 checkpoint with `"mbd_family": "mbd-tiny"` (SDAR-style).
        MbdTiny = "mbd-tiny",
    }
}

pub const SUPPORTED_ARCHITECTURES: &[(&str, &str, Family)] = &[
    ("Qwen2ForCausalLM", "qwen2", Family::Qwen2),
    ("Qwen3ForCausalLM", "qwen3", Family::Qwen3),
    ("Qwen3MoeForCausalLM", "qwen3_moe", Family::Qwen3Moe),
    ("DreamModel", "Dream", Family::Dream),
    ("SDARForCausalLM", "sdar", Family::Sdar),
    ("SDARMoeForCausalLM", "sdar_moe", Family::SdarMoe),
    ("Fast_dLLM_QwenForCausalLM", "Fast_dLLM_Qwen", Family::FastDllmV2),
];

impl Family {
    pub fn arch(&self) -> Arch {
        match self {
            Family::Qwen2 | Family::Dream | Family::FastDllmV2 => Arch::Qwen2,
            Family::Qwen3 | Family::Sdar | Family::MbdTiny => Arch::Qwen3,
            Family::Qwen3Moe | Family::SdarMoe => Arch::Qwen3Moe,
        }
    }
}

/// Everything the decoder needs to know about how this checkpoint was trained.
#[derive(Debug, Clone)]
pub struct Profile {
    pub family: Family,
    /// The architecture string as written in config.json.
    pub architecture: String,
    pub attention: AttentionKind,
    pub alignment: Alignment,
    /// true: the logit at position i-1 predicts token i (Dream, Fast-dLLM v2, plain causal LMs).
    pub logits_shift: bool,
    pub mask_token_id: Option<u32>,
    pub block_size: usize,
    pub eos_token_ids: Vec<u32>,
    /// Data type of the weights on disk (`torch_dtype` / `dtype`), informational.
    pub stored_dtype: Option<String>,
}

/// A family's decoding defaults (from the authors' scripts), used where a request leaves them unset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeDefaults {
    pub acceptance: Acceptance,
    /// tau
    pub threshold: f64,
    /// alpha
    pub block_add_threshold: f64,
    /// beta
    pub decoded_token_threshold: f64,
    pub forced_progress: ForcedProgress,
    /// Fast-dLLM v2's sub-blocks (small_block_size)
    pub sub_block_size: Option<usize>,
}

impl DecodeDefaults {
    /// Single-block semi-AR with a confidence threshold (SDAR/TraDo: 0.9; Fast-dLLM v2: 0.9); plain causal LMs.
    pub const SEMI_AR: DecodeDefaults = DecodeDefaults {
        acceptance: Acceptance::Confidence,
        threshold: 0.9,
        block_add_threshold: 1.0,
        decoded_token_threshold: 0.95,
        forced_progress: ForcedProgress::First,
        sub_block_size: None,
    };
    /// Fast-dLLM v2: single block, confidence 0.9, sub-blocks of 8 (`small_block_size`).
    pub const FAST_DLLM_V2: DecodeDefaults = DecodeDefaults { sub_block_size: Some(8), ..DecodeDefaults::SEMI_AR };
    /// d3LLM multi-block: entropy 0.5, alpha 0.1, beta 0.95, forced progress in the first block.
    pub const MULTI_BLOCK: DecodeDefaults = DecodeDefaults {
        acceptance: Acceptance::Entropy,
        threshold: 0.5,
        block_add_threshold: 0.1,
        decoded_token_threshold: 0.95,
        forced_progress: ForcedProgress::First,
        sub_block_size: None,
    };
}

impl Profile {
    pub fn decode_defaults(&self) -> DecodeDefaults {
        match self.family {
            Family::FastDllmV2 => DecodeDefaults::FAST_DLLM_V2,
            Family::Sdar | Family::SdarMoe => DecodeDefaults::SEMI_AR,
            _ if self.attention == AttentionKind::Causal => DecodeDefaults::SEMI_AR,
            _ => DecodeDefaults::MULTI_BLOCK,
        }
    }
}

pub fn detect_family(f: &Fields) -> Result<(Family, String)> {
    let (fam, arch) = detect_architecture(f)?;
    if fam == Family::Qwen3 && f.opt_str("mbd_family")? == Some("mbd-tiny") {
        return Ok((Family::MbdTiny, arch));
    }
    Ok((fam, arch))
}

fn detect_architecture(f: &Fields) -> Result<(Family, String)> {
    let arch0 = match f.map.get("architectures") {
        Some(Value::Array(a)) => a.first().and_then(|v| v.as_str()).map(|s| s.to_string()),
        _ => None,
    };
    let model_type = f.opt_str("model_type")?.map(|s| s.to_string());
    if let Some(a) = &arch0 {
        if let Some((_, _, fam)) = SUPPORTED_ARCHITECTURES.iter().find(|(n, _, _)| n == a) {
            return Ok((*fam, a.clone()));
        }
    }
    if let Some(t) = &model_type {
        if let Some((n, _, fam)) = SUPPORTED_ARCHITECTURES.iter().find(|(_, m, _)| m == t) {
            return Ok((*fam, arch0.unwrap_or_else(|| n.to_string())));
        }
    }
    if arch0.is_none() && model_type.is_none() {
        return Err(Error::config(format!(
            "{}: neither 'architectures' nor 'model_type' is set; cannot tell which model this is",
            f.file
        )));
    }
    let supported: Vec<String> = SUPPORTED_ARCHITECTURES.iter().map(|(a, m, _)| format!("{a} ({m})")).collect();
    Err(Error::Unsupported(format!(
        "{}: architecture {} (model_type {}) is not supported; supported: {}",
        f.file,
        arch0.as_deref().map(|s| format!("'{s}'")).unwrap_or_else(|| "unset".into()),
        model_type.as_deref().map(|s| format!("'{s}'")).unwrap_or_else(|| "unset".into()),
        supported.join(", ")
    )))
}

impl Profile {
    /// Build the profile from config.json, generation_config.json (may be absent) and a mask id found in the
    /// tokenizer (for families that keep it there), then apply user overrides.
    pub fn resolve(
        family: Family,
        architecture: String,
        cfg: &Fields,
        gen: Option<&Fields>,
        tokenizer_mask_id: Option<u32>,
        ov: &ProfileOverrides,
    ) -> Result<Profile> {
        let cfg_block = match cfg.opt_usize("block_size")? {
            Some(b) => Some(b),
            None => cfg.opt_usize("bd_size")?,
        };
        if let Some(0) = cfg_block {
            return Err(Error::config(format!(
                "{}: field 'block_size' (or 'bd_size') must be at least 1, found 0",
                cfg.file
            )));
        }
        let cfg_mask = cfg.opt_id("mask_token_id")?;
        let (attention, alignment, logits_shift, mask, block) = match family {
            // Plain checkpoints: causal LMs unless config.json carries diffusion fields.
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe => {
                let attn = if cfg_block.is_some() { AttentionKind::BlockCausal } else { AttentionKind::Causal };
                let shift = cfg.opt_bool("logits_shift")?.unwrap_or(cfg_block.is_none());
                (attn, Alignment::Absolute, shift, cfg_mask.or(tokenizer_mask_id), cfg_block.unwrap_or(32))
            }
            Family::Dream => {
                (AttentionKind::Full, Alignment::Absolute, true, cfg_mask.or(Some(151666)), cfg_block.unwrap_or(32))
            }
            Family::Sdar | Family::SdarMoe | Family::MbdTiny => (
                AttentionKind::BlockCausal,
                Alignment::Absolute,
                false,
                cfg_mask.or(tokenizer_mask_id),
                cfg_block.unwrap_or(4),
            ),
            Family::FastDllmV2 => (
                AttentionKind::BlockCausal,
                Alignment::Absolute,
                true,
                cfg_mask.or(tokenizer_mask_id).or(Some(151665)),
                cfg_block.unwrap_or(32),
            ),
        };
        let mut eos = cfg.ids("eos_token_id")?;
        if let Some(g) = gen {
            for id in g.ids("eos_token_id")? {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let stored_dtype = match cfg.opt_str("torch_dtype")? {
            Some(s) => Some(s.to_string()),
            None => cfg.opt_str("dtype")?.map(|s| s.to_string()),
        };
        let mut p = Profile {
            family,
            architecture,
            attention,
            alignment,
            logits_shift,
            mask_token_id: mask,
            block_size: block,
            eos_token_ids: eos,
            stored_dtype,
        };
        if let Some(m) = ov.mask_token_id {
            p.mask_token_id = Some(m);
        }
        if let Some(b) = ov.block_size {
            p.block_size = b;
        }
        if let Some(a) = ov.attention {
            p.attention = a;
        }
        if let Some(a) = ov.alignment {
            p.alignment = a;
        }
        if let Some(s) = ov.logits_shift {
            p.logits_shift = s;
        }
        if let Some(e) = &ov.eos_token_ids {
            p.eos_token_ids = e.clone();
        }
        Ok(p)
    }
}

//! A checkpoint's Qwen dimensions (`ModelConfig`, `MoeConfig`) and weight layout (`Arch`), from config.json's
//! fields (or a GGUF file's metadata read as those fields).

use crate::error::{Error, Result};
use crate::load::json::{type_name, Fields};
use serde_json::Value;

crate::util::string_enum! {
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

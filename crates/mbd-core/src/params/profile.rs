//! The block-diffusion families (`Family`, `SUPPORTED_ARCHITECTURES`) and the decoding profile a checkpoint implies
//! (`Profile`: block size, mask token, attention, family defaults), with the caller's `ProfileOverrides` applied.

use crate::decode::decoder::{Acceptance, ForcedProgress};
use crate::error::{Error, Result};
use crate::load::config::Arch;
use crate::load::json::Fields;
use crate::net::mask::{Alignment, AttentionKind};
use crate::params::request::ProfileOverrides;
use serde_json::Value;

crate::util::string_enum! {
    /// The block-diffusion families we recognise, keyed by `architectures[0]` or `model_type`.
    pub enum Family ("family") {
        Qwen2 = "qwen2",
        Qwen3 = "qwen3",
        Qwen3Moe = "qwen3_moe",
        /// Qwen3.5: Gated DeltaNet layers beside gated softmax attention (a block-diffusion conversion is a plain
        /// Qwen3.5 checkpoint with diffusion fields, like Qwen3's)
        Qwen35 = "qwen3_5",
        Qwen35Moe = "qwen3_5_moe",
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
    ("Qwen3_5ForCausalLM", "qwen3_5_text", Family::Qwen35),
    // the VL checkpoint's language model (`text_config`, `model.language_model.*`)
    ("Qwen3_5ForConditionalGeneration", "qwen3_5", Family::Qwen35),
    ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", Family::Qwen35Moe),
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", Family::Qwen35Moe),
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
            Family::Qwen35 => Arch::Qwen35,
            Family::Qwen35Moe => Arch::Qwen35Moe,
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
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a.first().and_then(|v| v.as_str()).map(String::from),
        Some(v) => {
            return Err(Error::config(format!(
                "{}: field 'architectures' must be a list of class names (strings), found {}",
                f.file,
                crate::load::json::shown(v)
            )))
        }
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
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::Qwen35 | Family::Qwen35Moe => {
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

//! A checkpoint's Qwen dimensions (`ModelConfig`, `MoeConfig`) and weight layout (`Arch`), from config.json's
//! fields (or a GGUF file's metadata read as those fields).

use crate::error::{Error, Result};
use crate::load::json::{type_name, Fields};
use serde_json::Value;

crate::util::string_enum! {
    /// Which weight layout the checkpoint uses.
    pub enum Arch ("arch") { Qwen2 = "qwen2", Qwen3 = "qwen3", Qwen3Moe = "qwen3_moe", Qwen35 = "qwen3_5", Qwen35Moe = "qwen3_5_moe" }
}

impl Arch {
    /// Qwen3.5's layouts: Gated DeltaNet layers, gated attention, partial RoPE, (1 + w) norms.
    pub fn qwen35(&self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen35Moe)
    }
}

/// What a layer's token mixer is (Qwen3.5's `layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// softmax attention (`full_attention`): the block-diffusion mask applies here
    Attention,
    /// a Gated DeltaNet (`linear_attention`): a causal recurrence, whatever the mask
    Linear,
}

/// Qwen3.5's Gated DeltaNet dimensions and which layers are GDN (`linear_*` fields, `layer_types`).
#[derive(Debug, Clone)]
pub struct LinearAttnConfig {
    pub layer_types: Vec<LayerKind>,
    /// `linear_conv_kernel_dim`: taps of the causal depthwise convolution
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// Value heads stored in tiled order (llama.cpp's GGUF files: stored head j uses key head j % key_heads),
    /// not transformers' grouped order (head h uses key head h / (value_heads / key_heads)).
    pub tiled_value_heads: bool,
}

impl LinearAttnConfig {
    /// Channels of the convolution: q, k (key heads x key dim each) and v (value heads x value dim).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// Largest `linear_conv_kernel_dim` accepted (released models use 4).
const MAX_CONV_KERNEL: usize = 64;

#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// Qwen3.5-MoE: a shared expert of this intermediate size beside the routed ones, its output scaled by
    /// sigmoid(shared_expert_gate(x)).
    pub shared_expert_intermediate_size: Option<usize>,
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
    /// Leading dims of each head that RoPE rotates (head_dim, or Qwen3.5's `partial_rotary_factor` of it).
    pub rotary_dim: usize,
    /// q_proj also gives a per-head output gate: attention output x sigmoid(gate) (Qwen3.5).
    pub attn_gate: bool,
    /// RMSNorm weights are stored as offsets from 1: y = norm(x) (1 + w) (Qwen3.5).
    pub norm_offset: bool,
    /// Qwen3.5's Gated DeltaNet layers; None: every layer is softmax attention.
    pub linear: Option<LinearAttnConfig>,
}

/// The fields mbd-rs adds itself, for the GGUF converter's conventions (`load::gguf`'s `hf_config` sets them):
/// the model reads them, so a checkpoint's own config.json may not name them.
pub const INTERNAL_FIELDS: &[&str] = &["gguf_norms_include_one", "gguf_tiled_value_heads"];

/// A checkpoint's config.json (not a GGUF file's metadata) that names one of [`INTERNAL_FIELDS`] is refused: those
/// switch conventions the checkpoint does not follow, and the model would then compute garbage.
pub fn refuse_internal_fields(f: &Fields) -> Result<()> {
    match INTERNAL_FIELDS.iter().find(|k| f.get(k).is_some()) {
        Some(k) => Err(Error::config(format!(
            "{}: field '{k}' is mbd-rs's own (its GGUF loader sets it for llama.cpp's conventions); a config.json may \
             not name it",
            f.file
        ))),
        None => Ok(()),
    }
}

/// Largest `max_position_embeddings` accepted: RoPE positions are computed in f32, which represents every
/// integer exactly only up to 2^24.
pub const MAX_POSITIONS: usize = 1 << 24;

/// Check a `rope_scaling` / `rope_parameters` value: plain RoPE passes; scaling we do not implement is refused
/// (transformers would apply it, so ignoring it would change every logit); a value whose type cannot be told
/// is a config error.
fn check_rope(file: &str, key: &str, value: &Value, arch: Arch) -> Result<()> {
    let v = crate::load::json::shown(value);
    let Value::Object(m) = value else {
        return Err(Error::config(format!(
            "{file}: field '{key}' must be an object with a 'rope_type' (or 'type') entry, found {} ({v})",
            type_name(value)
        )));
    };
    // `rope_type` (transformers' name) or `type` (its older one): each one given must be a string, and they agree
    let mut kind = None;
    for name in ["rope_type", "type"] {
        match m.get(name).filter(|t| !t.is_null()) {
            None => {}
            Some(Value::String(t)) => match kind {
                Some(k) if k != t.as_str() => {
                    return Err(Error::config(format!(
                        "{file}: field '{key}': 'rope_type' ('{k}') and 'type' ('{t}') disagree"
                    )))
                }
                _ => kind = Some(t.as_str()),
            },
            Some(t) => {
                return Err(Error::config(format!(
                    "{file}: field '{key}': '{name}' must be a string, found {} ({t})",
                    type_name(t)
                )))
            }
        }
    }
    match kind {
        Some("default") => Ok(()),
        // No type: only an object that says nothing but rope_theta (transformers >= 5 fills in "default") is
        // plain RoPE. Scaling parameters without a type cannot be interpreted, and transformers' config
        // validation refuses them too (missing required key 'rope_type').
        None if m.keys().all(|k| {
            k == "rope_theta"
                || k == "rope_type"
                || k == "type"
                || (arch.qwen35() && QWEN35_ROPE_KEYS.contains(&k.as_str()))
        }) =>
        {
            Ok(())
        }
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

/// Qwen3.5's rope_parameters keys besides the type and theta: read by `qwen35_rope` (text positions make its
/// multimodal RoPE the 1-D one).
const QWEN35_ROPE_KEYS: &[&str] = &["partial_rotary_factor", "mrope_section", "mrope_interleaved"];

/// Qwen3.5's rotary dims: `partial_rotary_factor` (in rope_parameters, else top level; default 0.25) of head_dim.
/// Its multimodal RoPE (`mrope_section`) gives each frequency one of three position components; for text all
/// three are the token's position, so whatever the sections it is plain 1-D RoPE over the rotary dims.
fn qwen35_rope(f: &Fields, head_dim: usize) -> Result<usize> {
    let rp = match f.get("rope_parameters") {
        Some(Value::Object(p)) => Some(p),
        _ => None,
    };
    let file = format!("{} (rope_parameters)", f.file);
    let inner = rp.map(|p| Fields { file: &file, map: p });
    let factor = match inner.as_ref().map(|i| i.opt_f64("partial_rotary_factor")).transpose()?.flatten() {
        Some(x) => x,
        None => f.opt_f64("partial_rotary_factor")?.unwrap_or(0.25),
    };
    // (a factor written as rotary dims / head_dim in f64, as a GGUF file's is, gives its integer back)
    let rot = (head_dim as f64 * factor + 1e-9) as usize;
    if !(factor > 0.0 && factor <= 1.0) || rot == 0 || !rot.is_multiple_of(2) {
        return Err(Error::config(format!(
            "{}: partial_rotary_factor {factor} of head_dim {head_dim} must give a positive even number of rotary \
             dims (found {rot})",
            f.file
        )));
    }
    if let Some(i) = &inner {
        // read for their types only: text positions make every section assignment, interleaved or not, the same
        // 1-D RoPE
        i.opt_usize_list("mrope_section")?;
        i.opt_bool("mrope_interleaved")?;
    }
    f.opt_bool("mrope_interleaved")?;
    Ok(rot)
}

/// Qwen3.5's `layer_types` (or `full_attention_interval`) and GDN dimensions, checked.
fn linear_config(f: &Fields, n_layers: usize) -> Result<LinearAttnConfig> {
    let layer_types = match f.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() != n_layers {
                return Err(Error::config(format!(
                    "{}: field 'layer_types' lists {} layers but num_hidden_layers is {n_layers}",
                    f.file,
                    a.len()
                )));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("full_attention") => Ok(LayerKind::Attention),
                    Some("linear_attention") => Ok(LayerKind::Linear),
                    _ => Err(Error::config(format!(
                        "{}: layer_types[{i}] must be 'full_attention' or 'linear_attention', found {v}",
                        f.file
                    ))),
                })
                .collect::<Result<Vec<_>>>()?
        }
        Some(Value::Null) | None => {
            let every = f.opt_usize("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(Error::config(format!("{}: field 'full_attention_interval' must be at least 1", f.file)));
            }
            (0..n_layers).map(|i| if (i + 1) % every == 0 { LayerKind::Attention } else { LayerKind::Linear }).collect()
        }
        Some(v) => {
            return Err(Error::config(format!(
                "{}: field 'layer_types' must be a list of strings, found {}",
                f.file,
                type_name(v)
            )))
        }
    };
    let c = LinearAttnConfig {
        layer_types,
        conv_kernel: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        key_heads: f.opt_usize("linear_num_key_heads")?.unwrap_or(16),
        value_heads: f.opt_usize("linear_num_value_heads")?.unwrap_or(32),
        key_dim: f.opt_usize("linear_key_head_dim")?.unwrap_or(128),
        value_dim: f.opt_usize("linear_value_head_dim")?.unwrap_or(128),
        tiled_value_heads: f.opt_bool("gguf_tiled_value_heads")?.unwrap_or(false),
    };
    if c.conv_kernel == 0 || c.conv_kernel > MAX_CONV_KERNEL {
        return Err(Error::config(format!(
            "{}: field 'linear_conv_kernel_dim' must be between 1 and {MAX_CONV_KERNEL}, found {}",
            f.file, c.conv_kernel
        )));
    }
    for (key, v) in [
        ("linear_num_key_heads", c.key_heads),
        ("linear_num_value_heads", c.value_heads),
        ("linear_key_head_dim", c.key_dim),
        ("linear_value_head_dim", c.value_dim),
    ] {
        if v == 0 {
            return Err(Error::config(format!("{}: field '{key}' must be at least 1, found 0", f.file)));
        }
    }
    if !c.value_heads.is_multiple_of(c.key_heads) {
        return Err(Error::config(format!(
            "{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({}): each key head serves \
             a group of value heads",
            f.file, c.value_heads, c.key_heads
        )));
    }
    // the recurrent state (value heads x key dim x value dim, f32) and the conv channels must be numbers of sane size
    let state = [c.value_heads, c.key_dim, c.value_dim, 4].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let conv = c
        .key_heads
        .checked_mul(c.key_dim)
        .and_then(|k| k.checked_mul(2))
        .and_then(|k| c.value_heads.checked_mul(c.value_dim).and_then(|v| k.checked_add(v)));
    if state.is_none_or(|b| b > MAX_STATE_BYTES) || conv.is_none() {
        return Err(Error::config(format!(
            "{}: a Gated DeltaNet state of linear_num_value_heads ({}) x linear_key_head_dim ({}) x \
             linear_value_head_dim ({}) f32 values is absurd (more than {} MiB per layer)",
            f.file,
            c.value_heads,
            c.key_dim,
            c.value_dim,
            MAX_STATE_BYTES >> 20
        )));
    }
    Ok(c)
}

/// Largest recurrent state accepted per GDN layer and sequence (Qwen3.5-9B's: 2 MiB).
const MAX_STATE_BYTES: usize = 1 << 30;

impl ModelConfig {
    /// Layer i's token mixer.
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        self.linear.as_ref().map_or(LayerKind::Attention, |l| l.layer_types[i])
    }

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
                check_rope(f.file, key, v, arch)?;
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
        let moe = moe_config(f, arch)?;
        let qwen35 = arch.qwen35();
        let rotary_dim = if qwen35 { qwen35_rope(f, head_dim)? } else { head_dim };
        if qwen35 && f.opt_bool("attn_output_gate")? == Some(false) {
            return Err(Error::Unsupported(format!(
                "{}: attn_output_gate=false is not supported (transformers' Qwen3.5 attention always gates its output)",
                f.file
            )));
        }
        let (qkv_bias, o_bias, qk_norm) = match arch {
            Arch::Qwen2 => (true, false, false),
            _ => {
                let b = f.opt_bool("attention_bias")?.unwrap_or(false);
                (b, b, true)
            }
        };
        let vocab_size = f.positive("vocab_size")?;
        // Qwen3.5-MoE has no dense MLP (its shared expert's size stands in, for estimates)
        let intermediate_size = match moe.as_ref().and_then(|m| m.shared_expert_intermediate_size) {
            Some(s) if f.get("intermediate_size").is_none() => s,
            _ => f.positive("intermediate_size")?,
        };
        let num_hidden_layers = f.positive("num_hidden_layers")?;
        let linear = if qwen35 { Some(linear_config(f, num_hidden_layers)?) } else { None };
        let config = ModelConfig {
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
            rotary_dim,
            attn_gate: qwen35,
            // a GGUF file's norm weights already hold the 1 (llama.cpp's converter adds it)
            norm_offset: qwen35 && !f.opt_bool("gguf_norms_include_one")?.unwrap_or(false),
            linear,
        };
        check_weight_sizes(f.file, &config)?;
        Ok(config)
    }
}

/// The mixture of experts of a MoE architecture (None for a dense one), its expert counts checked.
fn moe_config(f: &Fields, arch: Arch) -> Result<Option<MoeConfig>> {
    let moe = if arch == Arch::Qwen35Moe {
        // every layer routed, top-k always renormalised (transformers' Qwen3_5MoeTopKRouter), a shared expert
        Some(MoeConfig {
            num_experts: f.positive("num_experts")?,
            num_experts_per_tok: f.usize("num_experts_per_tok")?,
            moe_intermediate_size: f.positive("moe_intermediate_size")?,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
            shared_expert_intermediate_size: Some(f.positive("shared_expert_intermediate_size")?),
        })
    } else if arch == Arch::Qwen3Moe {
        Some(MoeConfig {
            // transformers >= 5 writes `num_local_experts`; earlier versions `num_experts`.
            num_experts: match (f.opt_usize("num_experts")?, f.opt_usize("num_local_experts")?) {
                (Some(n), _) | (None, Some(n)) => n,
                (None, None) => {
                    return Err(Error::config(format!(
                        "{}: the experts' count is missing: field 'num_experts' (or 'num_local_experts', as \
                         transformers >= 5 writes it)",
                        f.file
                    )))
                }
            },
            num_experts_per_tok: f.usize("num_experts_per_tok")?,
            moe_intermediate_size: f.positive("moe_intermediate_size")?,
            norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
            decoder_sparse_step: f.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1),
            mlp_only_layers: f.opt_usize_list("mlp_only_layers")?,
            shared_expert_intermediate_size: None,
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
    Ok(moe)
}

/// Every weight's element count must be a number: the shapes are compared with the checkpoint's, and a product that
/// wraps around could match a forged header.
fn check_weight_sizes(file: &str, c: &ModelConfig) -> Result<()> {
    let mut products: Vec<(&str, Vec<(&str, usize)>)> = vec![
        ("embed_tokens", vec![("vocab_size", c.vocab_size), ("hidden_size", c.hidden_size)]),
        ("mlp", vec![("intermediate_size", c.intermediate_size), ("hidden_size", c.hidden_size)]),
        (
            "q_proj",
            vec![
                ("num_attention_heads", c.num_attention_heads),
                ("head_dim", c.head_dim),
                ("hidden_size", c.hidden_size),
            ],
        ),
    ];
    if c.arch.qwen35() {
        products.push((
            "gated q_proj",
            vec![
                ("num_attention_heads", c.num_attention_heads),
                ("", 2),
                ("head_dim", c.head_dim),
                ("hidden_size", c.hidden_size),
            ],
        ));
    }
    if let Some(l) = &c.linear {
        products.push(("in_proj_qkv", vec![("conv channels", l.conv_dim()), ("hidden_size", c.hidden_size)]));
    }
    if let Some(m) = &c.moe {
        products.push((
            "experts",
            vec![
                ("num_experts", m.num_experts),
                ("", 2),
                ("moe_intermediate_size", m.moe_intermediate_size),
                ("hidden_size", c.hidden_size),
            ],
        ));
    }
    for (what, dims) in products {
        if dims.iter().try_fold(1usize, |a, (_, d)| a.checked_mul(*d)).is_none() {
            let expr: Vec<String> =
                dims.iter().map(|(n, d)| if n.is_empty() { d.to_string() } else { format!("{n} ({d})") }).collect();
            return Err(Error::config(format!(
                "{}: the {what} weights would have {} elements, which overflows (absurd sizes)",
                file,
                expr.join(" x ")
            )));
        }
    }
    Ok(())
}

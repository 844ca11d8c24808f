//! What is known about a loaded model, in one struct (`ModelInfo`): the binding hands it to Python as a dict
//! (serde), and Python's `mbd_rs.ModelInfo` has exactly these fields (`MODEL_INFO_FIELDS`, checked by a test).

use crate::model::Model;
use crate::net::mask::BlockGrid;
use crate::params::load::{device_name, dtype_name};
use serde::Serialize;

/// Everything known about a loaded model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    pub path: String,
    pub family: String,
    pub architecture: String,
    pub arch: String,
    pub num_parameters: usize,
    /// The weights as held in memory.
    pub weight_bytes: usize,
    /// How the matrices are held: their block formats (sorted), then the dtypes of those held unquantized, joined
    /// by '+' ("q8_0"; "q4_k+q8_0": q4_k layers, q8_0 tables; a GGUF file's formats as held; "float32").
    pub weight_format: String,
    /// The quantized matrices multiply activations rounded to 8 bits (the `int8_activations` load option).
    pub int8_activations: bool,
    /// The Jinja source chat prompts are rendered with (chat_template.jinja, tokenizer_config.json, GGUF metadata).
    pub chat_template: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_context: usize,
    pub num_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub mask_token_id: Option<u32>,
    pub block_size: usize,
    /// The family's decoding defaults ([`Profile::decode_defaults`](crate::params::profile::Profile::decode_defaults)),
    /// what a request that leaves them unset decodes with: acceptance policy, tau, alpha, beta, forced progress,
    /// sub-block size.
    pub default_acceptance: String,
    pub default_threshold: f64,
    pub default_block_add_threshold: f64,
    pub default_decoded_token_threshold: f64,
    pub default_forced_progress: String,
    pub default_sub_block_size: Option<usize>,
    pub eos_token_ids: Vec<u32>,
    pub attention: String,
    pub alignment: String,
    pub logits_shift: bool,
    /// Whether the prefix cache serves this model's requests under its own grid: "exact" (hybrids: "exact, with
    /// recurrent-state snapshots"), or "off: " and why ([`BlockGrid::prefix_stable`](crate::net::mask::BlockGrid::prefix_stable)).
    pub prefix_cache: String,
    pub dtype: String,
    pub stored_dtype: Option<String>,
    pub device: String,
    /// What the load warns about (a `quantize` option that quantized nothing); Engine.load issues each as a Python
    /// warning.
    pub warnings: Vec<String>,
}

/// Each `ModelInfo` field's name and its Python annotation, in declaration order (Python's dataclass is checked
/// against it).
pub const MODEL_INFO_FIELDS: &[(&str, &str)] = &[
    ("path", "str"),
    ("family", "str"),
    ("architecture", "str"),
    ("arch", "str"),
    ("num_parameters", "int"),
    ("weight_bytes", "int"),
    ("weight_format", "str"),
    ("int8_activations", "bool"),
    ("chat_template", "Optional[str]"),
    ("vocab_size", "int"),
    ("hidden_size", "int"),
    ("intermediate_size", "int"),
    ("num_layers", "int"),
    ("num_attention_heads", "int"),
    ("num_key_value_heads", "int"),
    ("head_dim", "int"),
    ("max_context", "int"),
    ("num_experts", "Optional[int]"),
    ("num_experts_per_tok", "Optional[int]"),
    ("mask_token_id", "Optional[int]"),
    ("block_size", "int"),
    ("default_acceptance", "str"),
    ("default_threshold", "float"),
    ("default_block_add_threshold", "float"),
    ("default_decoded_token_threshold", "float"),
    ("default_forced_progress", "str"),
    ("default_sub_block_size", "Optional[int]"),
    ("eos_token_ids", "List[int]"),
    ("attention", "str"),
    ("alignment", "str"),
    ("logits_shift", "bool"),
    ("prefix_cache", "str"),
    ("dtype", "str"),
    ("stored_dtype", "Optional[str]"),
    ("device", "str"),
    ("warnings", "List[str]"),
];

impl Model {
    /// What is known about this model.
    pub fn info(&self) -> ModelInfo {
        let (c, p) = (&self.config, &self.profile);
        let d = p.decode_defaults();
        ModelInfo {
            path: self.dir.display().to_string(),
            family: p.family.name().into(),
            architecture: p.architecture.clone(),
            arch: c.arch.name().into(),
            num_parameters: self.num_parameters,
            weight_bytes: self.weight_bytes,
            weight_format: self.weight_format.clone(),
            int8_activations: self.int8_activations,
            chat_template: self.chat_template.as_ref().map(|t| t.source().to_string()),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            max_context: c.max_position_embeddings,
            num_experts: c.moe.as_ref().map(|x| x.num_experts),
            num_experts_per_tok: c.moe.as_ref().map(|x| x.num_experts_per_tok),
            mask_token_id: p.mask_token_id,
            block_size: p.block_size,
            default_acceptance: d.acceptance.name().into(),
            default_threshold: d.threshold,
            default_block_add_threshold: d.block_add_threshold,
            default_decoded_token_threshold: d.decoded_token_threshold,
            default_forced_progress: d.forced_progress.name().into(),
            default_sub_block_size: d.sub_block_size,
            eos_token_ids: p.eos_token_ids.clone(),
            attention: p.attention.name().into(),
            alignment: p.alignment.name().into(),
            logits_shift: p.logits_shift,
            prefix_cache: match BlockGrid::new(p.attention, p.block_size.max(1), p.alignment, 0)
                .map(|g| g.prefix_stable())
            {
                Ok(Ok(())) if self.is_hybrid() => "exact, with recurrent-state snapshots".into(),
                Ok(Ok(())) => "exact".into(),
                Ok(Err(why)) => format!("off: {why}"),
                Err(e) => format!("off: {e}"),
            },
            dtype: dtype_name(self.dtype()).into(),
            stored_dtype: p.stored_dtype.clone(),
            device: device_name(self.device()),
            warnings: self.load_warnings.clone(),
        }
    }
}

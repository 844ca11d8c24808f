//! A GGUF file's metadata as the config.json fields of the same model (`hf_config`): the architecture's dimensions
//! under the Hugging Face names, and Qwen3.5's Gated DeltaNet sizes and layer kinds from llama.cpp's keys.

use super::container::{GgufFile, ARCH_FIELDS, MAX_ENTRIES};
use crate::error::{Error, Result};
use serde_json::{json, Map, Value};

impl GgufFile {
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
    /// trunk's layers (`block_count` counts the multi-token-prediction layers too: `nextn_predict_layers`), the shared
    /// expert's size; and the two conventions of llama.cpp's converter that the model then follows: norm weights stored
    /// with their 1 added, value heads in tiled order
    /// ([`config::LinearAttnConfig`](crate::load::config::LinearAttnConfig)).
    fn qwen35_fields(&self, arch: &str, c: &mut Map<String, Value>) -> Result<()> {
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| self.qwen35_count(arch, k);
        let (layers, blocks) = self.qwen35_trunk(arch)?;
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
                // one flag per layer of the trunk, or per block with the multi-token-prediction ones after it
                let n = flags.len() as u64;
                if (n != layers && n != blocks) || flags.iter().any(|f| !f.is_boolean()) {
                    let mtp = if blocks > layers {
                        format!(" (or the {blocks} blocks with the MTP layers)")
                    } else {
                        String::new()
                    };
                    return Err(Error::config(format!(
                        "{}: metadata '{}' must hold a boolean for each of the {layers} layers{mtp}, found {n} entries",
                        self.where_(),
                        key("attention.recurrent_layers"),
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
        if self.get(&key("rope.dimension_count"))?.is_some() {
            let d = self.qwen35_count(arch, "rope.dimension_count")?;
            if d == 0 || head_dim == 0 || d > head_dim || d % 2 != 0 {
                return Err(Error::config(format!(
                    "{}: metadata '{}' ({d}) must be an even count of at most the head's {head_dim} dims",
                    self.where_(),
                    key("rope.dimension_count")
                )));
            }
            rope.insert("partial_rotary_factor".into(), json!(d as f64 / head_dim as f64));
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

    /// The trunk's layers of a Qwen3.5 file and its blocks in all: `block_count` less the multi-token-prediction
    /// layers stored after them (`nextn_predict_layers`), which must leave at least one. An MTP layer is known by
    /// its `blk.N.nextn.*` tensors (llama.cpp's names), so each block after the trunk must hold them and none before
    /// it may: a count that would drop a real layer is refused, never taken on trust.
    pub(super) fn qwen35_trunk(&self, arch: &str) -> Result<(u64, u64)> {
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
        let trunk = blocks - nextn;
        let mtp = |i: u64| self.tensors.iter().any(|t| t.name.starts_with(&format!("blk.{i}.nextn.")));
        if let Some(i) = (trunk..blocks).find(|&i| !mtp(i)) {
            return Err(Error::config(format!(
                "{}: metadata '{arch}.nextn_predict_layers' ({nextn}) makes block {i} a multi-token-prediction layer, \
                 but it holds no blk.{i}.nextn.* tensors: it would drop a layer of the model",
                self.where_()
            )));
        }
        if let Some(i) = (0..trunk).find(|&i| mtp(i)) {
            return Err(Error::config(format!(
                "{}: block {i} holds multi-token-prediction tensors (blk.{i}.nextn.*) but metadata \
                 '{arch}.nextn_predict_layers' ({nextn}) counts only the last {nextn} of {blocks} blocks as such",
                self.where_()
            )));
        }
        Ok((trunk, blocks))
    }
}

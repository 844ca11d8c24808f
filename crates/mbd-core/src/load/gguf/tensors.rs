//! A GGUF file's tensors under the Hugging Face names the model loader asks for (`hf_tensors`): llama.cpp's
//! `blk.N.*` names mapped, a MoE layer's stacked experts split into one matrix per expert.

use super::container::{GgufFile, GgufTensor};
use crate::error::{Error, Result};

impl GgufFile {
    /// The layers `hf_tensors` maps and the blocks in all: a Qwen3.5 file's trunk, before its multi-token-prediction
    /// blocks (None for other architectures, whose every block is a layer).
    fn trunk_layers(&self) -> Result<Option<(usize, usize)>> {
        let arch = self.architecture()?;
        if arch != "qwen35" && arch != "qwen35moe" {
            return Ok(None);
        }
        let (trunk, blocks) = self.qwen35_trunk(&arch)?;
        Ok(Some((trunk as usize, blocks as usize)))
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
            if trunk.is_some_and(|(n, blocks)| layer >= n && layer < blocks) {
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
}

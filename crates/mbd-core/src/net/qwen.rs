//! Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5 decoder written for block-diffusion decoding of many sequences at once. Each
//! layer's token mixer is softmax attention or, in Qwen3.5's hybrids, a Gated DeltaNet (`Mixer`,
//! [`net::gdn`](crate::net::gdn)), which is causal whatever the mask and keeps a recurrent state in the sequence's
//! cache. A forward takes segments: each is one sequence's KV cache (P committed positions), a window of W token ids at
//! explicit absolute positions, a mask spec saying which keys each window row sees, and the rows whose logits are
//! wanted. Norms, linear layers and the MLP run once over every segment's rows stacked; attention runs per segment over
//! its own cache. Each window's K/V are written after its cache's committed prefix (scratch); [`KvCache::commit`] /
//! `commit_rows` keep them.
//!
//! Batch invariance: a segment's logits are bit-identical whatever other segments share the forward. Every op on
//! stacked rows is row-wise, and matrix products are cut by sequence, never by the total row count: the few-row windows
//! ([`linear::few_rows`](crate::net::linear::few_rows)) go through the skinny kernel together (it computes each row the
//! same way whatever rows share the call), each long window (a prefill chunk) through gemm on its own (`Groups`). A
//! matrix packed at load ([`panels::PackedMatrix`](crate::kernels::panels::PackedMatrix)) computes every row alike in
//! any window, so the cut changes nothing there.

use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::load::config::LayerKind;
use crate::load::config::{ModelConfig, MoeConfig};
use crate::load::weights::Weights;
use crate::net::attention::{AttnPath, ForwardAttention};
use crate::net::forward::{all_cancelled, Network, Stack, LARGE_WINDOW, RECURRENT_CHECK_ROWS};
use crate::net::gdn::{check_in_order, GatedDeltaNet};
use crate::net::kv_cache::KvCache;
use crate::net::layers::{silu_mul, Linear, RmsNorm, Stacked};
use crate::net::linear::{Groups, Holder, Matrix};
use crate::net::segment::Segment;
use crate::net::step::Step;
use candle_core::{DType, Device, Tensor};

struct Mlp {
    /// gate_proj and up_proj side by side: (rows, 2 · intermediate)
    gate_up: Stacked,
    down: Linear,
}

impl Mlp {
    fn load(ws: &Holder, prefix: &str, hidden: usize, inter: usize, stack: bool) -> Result<Self> {
        Ok(Mlp {
            gate_up: Stacked::load(
                ws,
                &[(format!("{prefix}.gate_proj"), inter), (format!("{prefix}.up_proj"), inter)],
                hidden,
                false,
                stack,
            )?,
            down: Linear::load(ws, &format!("{prefix}.down_proj"), hidden, inter, false)?,
        })
    }
    /// Long inputs go through in chunks of `MLP_ROWS` rows, so that the (rows, intermediate) activations of a
    /// long window (a full-attention canvas, a long prefill) never exist for all rows at once.
    fn forward(&self, x: &Tensor, k: &Kernels, few: bool) -> Result<Tensor> {
        let rows = x.dim(0)?;
        if rows > MLP_ROWS {
            let parts = (0..rows)
                .step_by(MLP_ROWS)
                .map(|r0| self.forward(&x.narrow(0, r0, MLP_ROWS.min(rows - r0))?, k, few))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Tensor::cat(&parts, 0)?);
        }
        let gu = self.gate_up.forward(x, k, few)?;
        self.down.forward(&silu_mul(&gu, k)?, k, few)
    }
}

/// Rows of an MLP product at once (see [`Mlp::forward`]).
const MLP_ROWS: usize = 2048;

/// Sparse mixture of experts (Qwen3-MoE, Qwen3.5-MoE): softmax router in f32, top-k, optional renormalisation,
/// and Qwen3.5-MoE's shared expert (every token, scaled by sigmoid of its gate).
struct Moe {
    router: Linear,
    experts: Vec<Mlp>,
    top_k: usize,
    norm_topk_prob: bool,
    shared: Option<(Mlp, Linear)>,
}

impl Moe {
    fn load(ws: &Holder, prefix: &str, hidden: usize, m: &MoeConfig, stack: bool) -> Result<Self> {
        // the router stays as loaded (see `quant`)
        let router = Linear {
            w: Matrix::Dense(ws.weights().get_matrix(&format!("{prefix}.gate.weight"), &[m.num_experts, hidden])?),
            b: None,
        };
        let inter = m.moe_intermediate_size;
        let fused = format!("{prefix}.experts.gate_up_proj");
        let experts = if ws.weights().contains(&fused) {
            // transformers >= 5 layout: gate_up_proj (E, 2I, H) and down_proj (E, H, I).
            let gu = ws.weights().get(&fused, &[m.num_experts, 2 * inter, hidden])?;
            let down = format!("{prefix}.experts.down_proj");
            let dn = ws.weights().get(&down, &[m.num_experts, hidden, inter])?;
            (0..m.num_experts)
                .map(|e| {
                    let expert = |t: &str| format!("{t} (expert {e})");
                    let gue = gu.get(e)?;
                    Ok(Mlp {
                        // stored stacked: gate_proj's rows, then up_proj's
                        gate_up: Stacked {
                            parts: if stack {
                                vec![Linear { w: ws.to_weight(gue.contiguous()?, false, &expert(&fused))?, b: None }]
                            } else {
                                let half = |o| -> Result<Linear> {
                                    Ok(Linear {
                                        w: ws.to_weight(
                                            gue.narrow(0, o, inter)?.contiguous()?,
                                            false,
                                            &expert(&fused),
                                        )?,
                                        b: None,
                                    })
                                };
                                vec![half(0)?, half(inter)?]
                            },
                        },
                        down: Linear { w: ws.to_weight(dn.get(e)?.contiguous()?, false, &expert(&down))?, b: None },
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..m.num_experts)
                .map(|e| Mlp::load(ws, &format!("{prefix}.experts.{e}"), hidden, inter, stack))
                .collect::<Result<Vec<_>>>()?
        };
        let shared = match m.shared_expert_intermediate_size {
            Some(si) => {
                let mlp = Mlp::load(ws, &format!("{prefix}.shared_expert"), hidden, si, stack)?;
                // the gate, like the router, stays as loaded
                let g = ws.weights().get_matrix(&format!("{prefix}.shared_expert_gate.weight"), &[1, hidden])?;
                Some((mlp, Linear { w: Matrix::Dense(g), b: None }))
            }
            None => None,
        };
        Ok(Moe { router, experts, top_k: m.num_experts_per_tok, norm_topk_prob: m.norm_topk_prob, shared })
    }

    fn forward(&self, x: &Tensor, k: &Kernels, groups: &Groups) -> Result<Tensor> {
        let probs = groups.apply(x, |x, few| self.router.forward(x, k, few))?;
        let probs = candle_nn::ops::softmax_last_dim(&probs.to_dtype(DType::F32)?)?;
        let probs: Vec<Vec<f32>> = probs.to_vec2()?;
        let mut per_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (t, p) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..p.len()).collect();
            // Highest probability first; ties go to the lower expert id, as torch.topk does on CPU.
            order.sort_by(|&a, &b| crate::util::by_score_then_index(p[b], p[a], a, b));
            let chosen = &order[..self.top_k];
            let norm: f32 = if self.norm_topk_prob { chosen.iter().map(|&e| p[e]).sum() } else { 1.0 };
            for &e in chosen {
                per_expert[e].0.push(t as u32);
                per_expert[e].1.push(p[e] / norm);
            }
        }
        let mut out = x.zeros_like()?;
        for (e, (toks, w)) in per_expert.iter().enumerate() {
            // an expert's tokens, cut the way the stack is (few-row windows together, each long window alone)
            for (lo, hi, few) in groups.parts(toks) {
                let idx = Tensor::new(&toks[lo..hi], x.device())?;
                let xs = x.index_select(&idx, 0)?;
                let wt = Tensor::new(&w[lo..hi], x.device())?.to_dtype(x.dtype())?.unsqueeze(1)?;
                let y = self.experts[e].forward(&xs, k, few)?.broadcast_mul(&wt)?;
                out = out.index_add(&idx, &y, 0)?;
            }
        }
        if let Some((mlp, gate)) = &self.shared {
            let y = groups.apply(x, |x, few| mlp.forward(x, k, few))?;
            let g = groups.apply(x, |x, few| gate.forward(x, k, few))?;
            out = (out + y.broadcast_mul(&candle_nn::ops::sigmoid(&g)?)?)?;
        }
        Ok(out)
    }
}

enum Ffn {
    Dense(Mlp),
    Sparse(Moe),
}

struct Attention {
    /// q_proj, k_proj and v_proj side by side: (rows, (heads + 2 · kv heads) · head_dim); with an output gate
    /// q_proj gives each head's query then its gate: (rows, (2 · heads + 2 · kv heads) · head_dim)
    qkv: Stacked,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    /// leading dims of each head that RoPE rotates
    rotary_dim: usize,
    /// output x sigmoid(gate) before o_proj (Qwen3.5)
    gate: bool,
}

/// A layer's token mixer, with its index among the cache's layers of that kind.
enum Mixer {
    Attention(Attention, usize),
    Linear(GatedDeltaNet, usize),
}

struct Layer {
    mixer: Mixer,
    ffn: Ffn,
    ln1: RmsNorm,
    ln2: RmsNorm,
}

pub struct QwenNet {
    pub cfg: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Matrix,
    inv_freq: Tensor,
    device: Device,
    dtype: DType,
    kernels: Kernels,
    /// `rows_independent`, found at load.
    rows_independent: bool,
    /// mbd-rs's fused CUDA attention takes this architecture's heads (full RoPE, no output gate).
    fused_heads: bool,
    /// Every layer softmax attention and a dense MLP: what a CUDA graph of a forward may capture
    /// ([`net::graph`](crate::net::graph)).
    graphable: bool,
}

/// Check config.json's dimensions against the checkpoint's headers before anything is allocated from them:
/// the number of layers stored, and the shapes that the main sizes determine, with messages that name the
/// config fields. (`Weights` checks every tensor's shape again as it loads it.)
pub fn check_checkpoint(cfg: &ModelConfig, ws: &Weights) -> Result<()> {
    let mut stored = 0usize;
    for name in ws.names() {
        if let Some(i) =
            name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok())
        {
            stored = stored.max(i.saturating_add(1));
        }
    }
    let n = cfg.num_hidden_layers;
    if n != stored {
        return Err(Error::config(format!(
            "config.json: num_hidden_layers is {n} but the checkpoint {} stores {stored} layers (model.layers.N.*){}",
            ws.where_(),
            if n < stored {
                "; transformers would load it and leave the extra layers unused (a different model), so it is refused"
            } else {
                ""
            }
        )));
    }
    // each layer stores the mixer config.json says it has
    for i in 0..n {
        let (want, other) = match cfg.layer_kind(i) {
            LayerKind::Attention => {
                (("full_attention", "self_attn.q_proj"), ("linear_attention", "linear_attn.in_proj_qkv"))
            }
            LayerKind::Linear => {
                (("linear_attention", "linear_attn.in_proj_qkv"), ("full_attention", "self_attn.q_proj"))
            }
        };
        // any tensor of the other mixer in this layer: a checkpoint of another layout (the model would leave it
        // unread and run something else)
        let other_prefix = format!("model.layers.{i}.{}.", other.1.split('.').next().unwrap_or(""));
        if let Some(stray) = ws.names().find(|n| n.starts_with(&other_prefix)) {
            return Err(Error::config(format!(
                "config.json: layer {i} is '{}' ({}) but the checkpoint {} stores a '{}' layer's tensor there \
                 ({stray})",
                want.0,
                if cfg.linear.is_some() { "layer_types" } else { "every layer of this architecture" },
                ws.where_(),
                other.0,
            )));
        }
    }
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let a0 = (0..n).find(|&i| cfg.layer_kind(i) == LayerKind::Attention).unwrap_or(0);
    let (q_rows, q_fields) = if cfg.attn_gate {
        (2 * cfg.num_attention_heads * d, "[2 x num_attention_heads x head_dim (queries and gates), hidden_size]")
    } else {
        (cfg.num_attention_heads * d, "[num_attention_heads x head_dim, hidden_size]")
    };
    let mut checks: Vec<(String, Vec<usize>, &str)> = vec![
        ("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], "[vocab_size, hidden_size]"),
        (format!("model.layers.{a0}.self_attn.q_proj.weight"), vec![q_rows, h], q_fields),
        (
            format!("model.layers.{a0}.self_attn.k_proj.weight"),
            vec![cfg.num_key_value_heads * d, h],
            "[num_key_value_heads x head_dim, hidden_size]",
        ),
        ("model.layers.0.input_layernorm.weight".into(), vec![h], "[hidden_size]"),
    ];
    if let Some(l) = &cfg.linear {
        if let Some(g0) = (0..n).find(|&i| cfg.layer_kind(i) == LayerKind::Linear) {
            checks.push((
                format!("model.layers.{g0}.linear_attn.in_proj_qkv.weight"),
                vec![l.conv_dim(), h],
                "[2 x linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x linear_value_head_dim, \
                 hidden_size]",
            ));
        }
    }
    for (name, want, fields) in checks {
        let (name, want) = (name.as_str(), want.as_slice());
        if let Some(found) = ws.shape(name) {
            if found != want {
                return Err(Error::config(format!(
                    "config.json: {fields} = {want:?} (num_attention_heads {}, num_key_value_heads {}, head_dim {}, \
                     hidden_size {h}, vocab_size {}) does not match tensor '{name}' of shape {found:?} in {}",
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    d,
                    cfg.vocab_size,
                    ws.where_()
                )));
            }
        }
    }
    Ok(())
}

impl QwenNet {
    pub fn load(cfg: &ModelConfig, ws: &Holder, device: &Device, dtype: DType, kernels: Kernels) -> Result<Self> {
        check_checkpoint(cfg, ws.weights())?;
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let nh = cfg.num_attention_heads;
        let embed = ws.table("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        // Justified by the checkpoint: check_checkpoint found this many layers stored.
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let (eps, offset) = (cfg.rms_norm_eps, cfg.norm_offset);
        let (mut n_attn, mut n_linear) = (0, 0);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let q_rows = if cfg.attn_gate { 2 * nh * d } else { nh * d };
            let mixer = match (cfg.layer_kind(i), &cfg.linear) {
                (LayerKind::Linear, Some(lc)) => {
                    n_linear += 1;
                    let m = GatedDeltaNet::load(ws, &format!("{p}.linear_attn"), h, lc, eps, kernels.stack)?;
                    Mixer::Linear(m, n_linear - 1)
                }
                _ => {
                    n_attn += 1;
                    Mixer::Attention(Attention::load(ws, cfg, &p, q_rows, kernels)?, n_attn - 1)
                }
            };
            let sparse = match &cfg.moe {
                Some(m) => m.num_experts > 0 && !m.mlp_only_layers.contains(&i) && (i + 1) % m.decoder_sparse_step == 0,
                None => false,
            };
            let ffn = if sparse {
                Ffn::Sparse(Moe::load(ws, &format!("{p}.mlp"), h, cfg.moe.as_ref().unwrap(), kernels.stack)?)
            } else {
                Ffn::Dense(Mlp::load(ws, &format!("{p}.mlp"), h, cfg.intermediate_size, kernels.stack)?)
            };
            layers.push(Layer {
                mixer,
                ffn,
                ln1: RmsNorm::load(ws, &format!("{p}.input_layernorm.weight"), h, eps, offset)?,
                ln2: RmsNorm::load(ws, &format!("{p}.post_attention_layernorm.weight"), h, eps, offset)?,
            });
        }
        let norm = RmsNorm::load(ws, "model.norm.weight", h, eps, offset)?;
        // Tied checkpoints may still store the (identical) head; prefer a stored tensor whenever there is one.
        let lm_head = if ws.weights().contains("lm_head.weight") {
            ws.table("lm_head.weight", &[cfg.vocab_size, h])?
        } else if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            return Err(Error::load(
                "tensor 'lm_head.weight' is missing and config.json has tie_word_embeddings=false".to_string(),
            ));
        };
        let rot = cfg.rotary_dim;
        let inv: Vec<f32> =
            (0..rot / 2).map(|i| (1.0 / cfg.rope_theta.powf((2 * i) as f64 / rot as f64)) as f32).collect();
        let inv_freq = Tensor::from_vec(inv, (1, rot / 2), device)?;
        let mut net = QwenNet {
            cfg: cfg.clone(),
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            device: device.clone(),
            dtype,
            kernels,
            rows_independent: false,
            fused_heads: !cfg.attn_gate && rot == d,
            graphable: false,
        };
        net.graphable = net.layers.iter().all(|l| matches!((&l.mixer, &l.ffn), (Mixer::Attention(..), Ffn::Dense(_))));
        net.rows_independent = net.find_rows_independent();
        Ok(net)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether every window row's logits and K/V are the same bits however a window is cut into forwards: the CPU in
    /// f32 with the blocked attention (per row over its keys) and every product's matrix row-invariant
    /// ([`Matrix::row_invariant`]; not a MoE router, which stays as loaded). The scheduler may then cut a long prefill
    /// into smaller forwards beside other streams ([`Window::limit_next`](crate::generate::window::Window::limit_next))
    /// without changing any output.
    pub fn rows_independent(&self) -> bool {
        self.rows_independent
    }

    fn find_rows_independent(&self) -> bool {
        let c = &self.cfg;
        let heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let blocked = AttnPath::choose(&self.kernels, &self.device, self.dtype, heads) == AttnPath::Blocked;
        blocked
            && self.lm_head.row_invariant()
            && self.layers.iter().all(|l| {
                let mixer = match &l.mixer {
                    Mixer::Attention(a, _) => a.qkv.row_invariant() && a.o.w.row_invariant(),
                    // the recurrence is token by token: the same bits however a window is cut
                    Mixer::Linear(g, _) => g.row_invariant(),
                };
                mixer
                    && match &l.ffn {
                        Ffn::Dense(m) => m.gate_up.row_invariant() && m.down.w.row_invariant(),
                        Ffn::Sparse(_) => false,
                    }
            })
    }

    /// Keys that cost one row's products: a window row attending to this many keys costs about what its
    /// projections and MLP cost (per layer: q/k/v/o and gate/up/down multiply-adds over 2 · heads · head_dim per key,
    /// the attention's multiply-adds taken as `ATTENTION_WEIGHT` times dearer: its exp and its per-key bookkeeping
    /// run slower than the packed products; measured on the embedded model, release build).
    pub fn key_equivalent(&self) -> usize {
        let c = &self.cfg;
        let (h, d, nh, nkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let inter = c.moe.as_ref().map_or(c.intermediate_size, |m| m.moe_intermediate_size * m.num_experts_per_tok);
        let products = h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * inter;
        (products / (ATTENTION_WEIGHT * 2 * nh * d).max(1)).max(1)
    }

    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> Result<KvCache> {
        let attn = self.layers.iter().filter(|l| matches!(l.mixer, Mixer::Attention(..))).count();
        let cache = KvCache::new(attn, self.cfg.num_key_value_heads, self.cfg.head_dim, self.dtype, &self.device);
        let mut linear = self.layers.iter().filter_map(|l| match &l.mixer {
            Mixer::Linear(g, _) => Some(g.shape),
            _ => None,
        });
        match linear.next() {
            Some(shape) => cache.with_recurrent(1 + linear.count(), shape),
            None => Ok(cache),
        }
    }

    /// Whether some layer is a recurrence (Gated DeltaNet): such a model's windows run in order from the cache's
    /// frontier, and its cache only moves forward.
    pub fn is_hybrid(&self) -> bool {
        self.cfg.linear.is_some()
    }
}

/// How much dearer an attention multiply-add is than a packed product's ([`QwenNet::key_equivalent`]).
const ATTENTION_WEIGHT: usize = 3;

impl Network for QwenNet {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn kernels(&self) -> &Kernels {
        &self.kernels
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn check_segment(&self, seg: &Segment<'_>) -> Result<()> {
        if self.is_hybrid() {
            check_in_order(seg)?;
        }
        Ok(())
    }

    fn activation_bytes(&self, total: usize) -> Option<usize> {
        // a hybrid's GDN layers each keep their rows' recurrence inputs in the cache until the commit (about two
        // f32 rows of the convolution's channels per row and layer), beside one layer's working copies
        let recurrent_per_row = self.cfg.linear.as_ref().map_or(0, |l| {
            let (c, gdn) = (l.conv_dim(), l.layer_types.iter().filter(|&&t| t == LayerKind::Linear).count());
            4 * (gdn * (2 * c + 2 * l.value_heads) + 4 * c)
        });
        if total <= LARGE_WINDOW && (recurrent_per_row == 0 || total <= RECURRENT_CHECK_ROWS) {
            return None;
        }
        // f32 activations alive at once, about: the residual, a norm and q/k/v/o per position, and three MLP rows
        // per position of one MLP chunk
        let c = &self.cfg;
        let per_row = 4 * (3 * c.hidden_size + 2 * c.num_attention_heads * c.head_dim) + recurrent_per_row;
        let mlp = 4 * 3 * c.intermediate_size * total.min(MLP_ROWS);
        Some(per_row.saturating_mul(total).saturating_add(mlp))
    }

    fn attention_path(&self) -> AttnPath {
        let c = &self.cfg;
        match AttnPath::choose(
            &self.kernels,
            &self.device,
            self.dtype,
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        ) {
            AttnPath::Fused if !self.fused_heads => AttnPath::Candle,
            p => p,
        }
    }

    fn graphable(&self) -> bool {
        self.graphable
    }

    fn layers(
        &self,
        step: &Step<'_>,
        stack: &Stack,
        segs: &mut [Segment<'_>],
        att: &ForwardAttention,
    ) -> Result<Tensor> {
        let (kn, total, groups) = (&self.kernels, stack.rows(), &stack.groups);
        // RoPE tables in f32 for every row's position; candle's rope takes them cast to the compute dtype.
        let freqs =
            step.view(stack.pos_at)?.to_dtype(DType::F32)?.reshape((total, 1))?.broadcast_mul(&self.inv_freq)?;
        let (cos, sin) = match stack.path {
            AttnPath::Fused => (freqs.cos()?, freqs.sin()?),
            _ => (freqs.cos()?.to_dtype(self.dtype)?, freqs.sin()?.to_dtype(self.dtype)?),
        };
        // each residual add and the norm after it: one launch on CUDA with mbd-rs's kernels
        let fused_norms = kn.cuda_fused && crate::kernels::cuda::runs_on(&self.device, self.dtype);
        let mut x = self.embed.rows(&stack.ids, &step.view(stack.ids_at)?)?.to_dtype(self.dtype)?;
        let mut hn = self.layers.first().map(|l| l.ln1.forward(&x)).transpose()?;
        for (li, layer) in self.layers.iter().enumerate() {
            all_cancelled(segs)?;
            let h = hn.take().expect("the layer's normed input");
            let a = match &layer.mixer {
                Mixer::Attention(a, slot) => a.forward(&h, (&cos, &sin), segs, att, *slot, groups, kn)?,
                Mixer::Linear(g, slot) => g.forward(&h, segs, &stack.spans, *slot, groups, kn)?,
            };
            let (x2, h) = layer.ln2.add_forward(&x, &a, fused_norms)?;
            let f = match &layer.ffn {
                Ffn::Dense(m) => groups.apply(&h, |x, few| m.forward(x, kn, few))?,
                Ffn::Sparse(m) => m.forward(&h, kn, groups)?,
            };
            x = match self.layers.get(li + 1) {
                Some(next) => {
                    let (x3, h) = next.ln1.add_forward(&x2, &f, fused_norms)?;
                    hn = Some(h);
                    x3
                }
                None => (x2 + f)?,
            };
        }
        Ok(x)
    }

    fn head(&self, x: &Tensor, groups: &Groups) -> Result<Tensor> {
        let x = self.norm.forward(x)?;
        groups.apply(&x, |x, few| Ok(self.lm_head.linear(x, &self.kernels, few)?))
    }
}

impl Attention {
    /// Layer `p`'s self_attn (`q_rows`: q_proj's outputs, with the gates where the architecture has them).
    fn load(ws: &Holder, cfg: &ModelConfig, p: &str, q_rows: usize, kernels: Kernels) -> Result<Attention> {
        let (h, d, nh, nkv) = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads);
        let (eps, offset) = (cfg.rms_norm_eps, cfg.norm_offset);
        let norm = |n: &str| -> Result<Option<RmsNorm>> {
            Ok(if cfg.qk_norm {
                Some(RmsNorm::load(ws, &format!("{p}.self_attn.{n}.weight"), d, eps, offset)?)
            } else {
                None
            })
        };
        Ok(Attention {
            qkv: Stacked::load(
                ws,
                &[
                    (format!("{p}.self_attn.q_proj"), q_rows),
                    (format!("{p}.self_attn.k_proj"), nkv * d),
                    (format!("{p}.self_attn.v_proj"), nkv * d),
                ],
                h,
                cfg.qkv_bias,
                kernels.stack,
            )?,
            o: Linear::load(ws, &format!("{p}.self_attn.o_proj"), h, nh * d, cfg.o_bias)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            rotary_dim: cfg.rotary_dim,
            gate: cfg.attn_gate,
        })
    }

    /// Attention of every segment's window rows (stacked in `att.order`, segment i at rows `att.spans[i]`) over its
    /// own cache; returns the stacked (rows, hidden) output. The architecture's part is here (the projections, the
    /// q/k norms and RoPE); the backend that attends is `attention`'s (`AttnPath`).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        segs: &mut [Segment<'_>],
        att: &ForwardAttention,
        layer: usize,
        groups: &Groups,
        kn: &Kernels,
    ) -> Result<Tensor> {
        let r = x.dim(0)?;
        let (nh, nkv, d) = (self.n_heads, self.n_kv, self.head_dim);
        let nq = if self.gate { 2 * nh } else { nh };
        let qkv = groups.apply(x, |x, few| self.qkv.forward(x, kn, few))?.reshape((r, nq + 2 * nkv, d))?;
        // each head's gate follows its query: (r, heads, 2, d)
        let (qkv, gate) = if self.gate {
            let qg = qkv.narrow(1, 0, nq)?.reshape((r, nh, 2, d))?;
            let q = qg.narrow(2, 0, 1)?.squeeze(2)?;
            let gate = qg.narrow(2, 1, 1)?.reshape((r, nh * d))?;
            (Tensor::cat(&[&q, &qkv.narrow(1, nq, 2 * nkv)?], 1)?, Some(gate))
        } else {
            (qkv, None)
        };
        let y = if att.path == AttnPath::Fused {
            // mbd-rs's CUDA kernels take the norms and RoPE with the K/V write
            let eps = self.q_norm.as_ref().or(self.k_norm.as_ref()).map_or(0.0, |n| n.eps);
            let norms = (self.q_norm.as_ref().map(|n| &n.w), self.k_norm.as_ref().map(|n| &n.w), eps);
            att.fused(&qkv.contiguous()?, (cos, sin), norms, segs, layer)?
        } else {
            let norm = |t: Tensor, n: &Option<RmsNorm>| match n {
                Some(n) => n.forward(&t),
                None => Ok(t),
            };
            let q = norm(qkv.narrow(1, 0, nh)?, &self.q_norm)?;
            let k = norm(qkv.narrow(1, nh, nkv)?, &self.k_norm)?;
            let v = qkv.narrow(1, nh + nkv, nkv)?;
            // (R, H, D) -> (1, H, R, D) for the fused rope kernel (element-wise: each row with its own position);
            // with partial RoPE the first rotary_dim dims of each head rotate and the others pass
            let rot = self.rotary_dim;
            let rope = |t: &Tensor| -> Result<Tensor> {
                let t = t.transpose(0, 1)?;
                let rotate = |t: &Tensor| -> Result<Tensor> {
                    Ok(candle_nn::rotary_emb::rope(&t.contiguous()?.unsqueeze(0)?, cos, sin)?.squeeze(0)?)
                };
                if rot == d {
                    return rotate(&t);
                }
                Ok(Tensor::cat(&[&rotate(&t.narrow(2, 0, rot)?)?, &t.narrow(2, rot, d - rot)?], 2)?.contiguous()?)
            };
            let (q, k) = (rope(&q)?.to_dtype(DType::F32)?, rope(&k)?);
            att.over_caches(&q, &k, &v.transpose(0, 1)?.contiguous()?, segs, layer)?
        };
        let y = match gate {
            Some(g) => (&y * candle_nn::ops::sigmoid(&g.to_dtype(y.dtype())?)?)?,
            None => y,
        };
        groups.apply(&y, |y, few| self.o.forward(y, kn, few))
    }
}

/// One model serves every thread: it must stay Send + Sync.
const _: fn() = || {
    fn f<T: Send + Sync>() {}
    f::<QwenNet>();
};

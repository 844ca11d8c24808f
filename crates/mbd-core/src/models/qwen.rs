//! Qwen2 / Qwen3 / Qwen3-MoE decoder, batch 1, written for block-diffusion decoding:
//! a forward takes a window of W tokens at absolute positions [P, P+W) over a KV cache holding P committed
//! tokens, the block grid that says which keys each query sees, and the rows whose logits are wanted.
//! The window's own K/V are written after the committed prefix (scratch); `KvCache::commit` keeps them.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::mask::BlockGrid;
use crate::skinny::Kernels;
use crate::weights::Weights;
use candle_core::{DType, Device, Tensor};

struct Linear {
    w: Tensor,
    b: Option<Tensor>,
}

impl Linear {
    fn load(ws: &Weights, prefix: &str, out_f: usize, in_f: usize, bias: bool) -> Result<Self> {
        let w = ws.get_matrix(&format!("{prefix}.weight"), &[out_f, in_f])?;
        let b = if bias { Some(ws.get(&format!("{prefix}.bias"), &[out_f])?) } else { None };
        Ok(Linear { w, b })
    }
    fn forward(&self, x: &Tensor, k: &Kernels) -> Result<Tensor> {
        let y = crate::skinny::linear(x, &self.w, k)?;
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

struct RmsNorm {
    w: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(ws: &Weights, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm { w: ws.get(name, &[dim])?, eps: eps as f32 })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if x.is_contiguous() { x.clone() } else { x.contiguous()? };
        Ok(candle_nn::ops::rms_norm(&x, &self.w, self.eps)?)
    }
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn load(ws: &Weights, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate: Linear::load(ws, &format!("{prefix}.gate_proj"), inter, hidden, false)?,
            up: Linear::load(ws, &format!("{prefix}.up_proj"), inter, hidden, false)?,
            down: Linear::load(ws, &format!("{prefix}.down_proj"), hidden, inter, false)?,
        })
    }
    fn forward(&self, x: &Tensor, k: &Kernels) -> Result<Tensor> {
        let g = self.gate.forward(x, k)?.silu()?;
        let u = self.up.forward(x, k)?;
        self.down.forward(&(g * u)?, k)
    }
}

/// Sparse mixture of experts (Qwen3-MoE): softmax router in f32, top-k, optional renormalisation.
struct Moe {
    router: Linear,
    experts: Vec<Mlp>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl Moe {
    fn load(ws: &Weights, prefix: &str, hidden: usize, m: &crate::config::MoeConfig) -> Result<Self> {
        let router = Linear::load(ws, &format!("{prefix}.gate"), m.num_experts, hidden, false)?;
        let inter = m.moe_intermediate_size;
        let fused = format!("{prefix}.experts.gate_up_proj");
        let experts = if ws.contains(&fused) {
            // transformers >= 5 layout: gate_up_proj (E, 2I, H) and down_proj (E, H, I).
            let gu = ws.get(&fused, &[m.num_experts, 2 * inter, hidden])?;
            let dn = ws.get(&format!("{prefix}.experts.down_proj"), &[m.num_experts, hidden, inter])?;
            (0..m.num_experts)
                .map(|e| {
                    let gue = gu.get(e)?;
                    Ok(Mlp {
                        gate: Linear { w: gue.narrow(0, 0, inter)?.contiguous()?, b: None },
                        up: Linear { w: gue.narrow(0, inter, inter)?.contiguous()?, b: None },
                        down: Linear { w: dn.get(e)?.contiguous()?, b: None },
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..m.num_experts)
                .map(|e| Mlp::load(ws, &format!("{prefix}.experts.{e}"), hidden, inter))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Moe { router, experts, top_k: m.num_experts_per_tok, norm_topk_prob: m.norm_topk_prob })
    }

    fn forward(&self, x: &Tensor, k: &Kernels) -> Result<Tensor> {
        let probs = candle_nn::ops::softmax_last_dim(&self.router.forward(x, k)?.to_dtype(DType::F32)?)?;
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
            if toks.is_empty() {
                continue;
            }
            let idx = Tensor::new(toks.as_slice(), x.device())?;
            let xs = x.index_select(&idx, 0)?;
            let w = Tensor::new(w.as_slice(), x.device())?.to_dtype(x.dtype())?.unsqueeze(1)?;
            let y = self.experts[e].forward(&xs, k)?.broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        Ok(out)
    }
}

enum Ffn {
    Dense(Mlp),
    Sparse(Moe),
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

struct Layer {
    attn: Attention,
    ffn: Ffn,
    ln1: RmsNorm,
    ln2: RmsNorm,
}

pub struct QwenModel {
    pub cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Tensor,
    inv_freq: Tensor,
    device: Device,
    dtype: DType,
    kernels: Kernels,
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
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let checks: [(&str, [usize; 2], &str); 4] = [
        ("model.embed_tokens.weight", [cfg.vocab_size, h], "[vocab_size, hidden_size]"),
        (
            "model.layers.0.self_attn.q_proj.weight",
            [cfg.num_attention_heads * d, h],
            "[num_attention_heads x head_dim, hidden_size]",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            [cfg.num_key_value_heads * d, h],
            "[num_key_value_heads x head_dim, hidden_size]",
        ),
        ("model.layers.0.input_layernorm.weight", [h, 0], "[hidden_size]"),
    ];
    for (name, want, fields) in checks {
        let want: &[usize] = if want[1] == 0 { &want[..1] } else { &want[..] };
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

impl QwenModel {
    pub fn load(cfg: &ModelConfig, ws: &Weights, device: &Device, dtype: DType, kernels: Kernels) -> Result<Self> {
        check_checkpoint(cfg, ws)?;
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let embed = ws.get_matrix("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        // Justified by the checkpoint: check_checkpoint found this many layers stored.
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = Attention {
                q: Linear::load(ws, &format!("{p}.self_attn.q_proj"), nh * d, h, cfg.qkv_bias)?,
                k: Linear::load(ws, &format!("{p}.self_attn.k_proj"), nkv * d, h, cfg.qkv_bias)?,
                v: Linear::load(ws, &format!("{p}.self_attn.v_proj"), nkv * d, h, cfg.qkv_bias)?,
                o: Linear::load(ws, &format!("{p}.self_attn.o_proj"), h, nh * d, cfg.o_bias)?,
                q_norm: if cfg.qk_norm {
                    Some(RmsNorm::load(ws, &format!("{p}.self_attn.q_norm.weight"), d, cfg.rms_norm_eps)?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(RmsNorm::load(ws, &format!("{p}.self_attn.k_norm.weight"), d, cfg.rms_norm_eps)?)
                } else {
                    None
                },
                n_heads: nh,
                n_kv: nkv,
                head_dim: d,
            };
            let sparse = match &cfg.moe {
                Some(m) => m.num_experts > 0 && !m.mlp_only_layers.contains(&i) && (i + 1) % m.decoder_sparse_step == 0,
                None => false,
            };
            let ffn = if sparse {
                Ffn::Sparse(Moe::load(ws, &format!("{p}.mlp"), h, cfg.moe.as_ref().unwrap())?)
            } else {
                Ffn::Dense(Mlp::load(ws, &format!("{p}.mlp"), h, cfg.intermediate_size)?)
            };
            layers.push(Layer {
                attn,
                ffn,
                ln1: RmsNorm::load(ws, &format!("{p}.input_layernorm.weight"), h, cfg.rms_norm_eps)?,
                ln2: RmsNorm::load(ws, &format!("{p}.post_attention_layernorm.weight"), h, cfg.rms_norm_eps)?,
            });
        }
        let norm = RmsNorm::load(ws, "model.norm.weight", h, cfg.rms_norm_eps)?;
        // Tied checkpoints may still store the (identical) head; prefer a stored tensor whenever there is one.
        let lm_head = if ws.contains("lm_head.weight") {
            ws.get_matrix("lm_head.weight", &[cfg.vocab_size, h])?
        } else if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            return Err(Error::load(
                "tensor 'lm_head.weight' is missing and config.json has tie_word_embeddings=false".to_string(),
            ));
        };
        let half = d / 2;
        let inv: Vec<f32> = (0..half).map(|i| (1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64)) as f32).collect();
        let inv_freq = Tensor::from_vec(inv, (1, half), device)?;
        Ok(QwenModel {
            cfg: cfg.clone(),
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            device: device.clone(),
            dtype,
            kernels,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.cfg.num_hidden_layers,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            self.dtype,
            &self.device,
        )
    }

    /// Forward a window of tokens at positions [cache.len(), cache.len() + ids.len()).
    /// `grid`: which keys each query sees (the additive mask is built from it, per query chunk).
    /// `rows`: window rows whose logits are returned (None = all). Returns (rows, vocab) f32 logits.
    /// The window's K/V are left in the cache's scratch area; `cache.commit(n)` keeps the first n.
    /// Run it on the engine's CPU pool on the CPU (`cpu_pool::on_device_pool`); ids are in the vocabulary
    /// (the caller checked them: `request::token_ids`).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        ids: &[u32],
        grid: &BlockGrid,
        rows: Option<&[usize]>,
    ) -> Result<Tensor> {
        let w = ids.len();
        if w == 0 {
            return Err(Error::Internal("empty window".into()));
        }
        debug_assert!(ids.iter().all(|&t| (t as usize) < self.cfg.vocab_size));
        let p = cache.len();
        let s = p + w;
        if let Some(r) = rows {
            if let Some(&bad) = r.iter().find(|&&i| i >= w) {
                return Err(Error::Internal(format!("logits row {bad} is outside the window of {w} tokens")));
            }
        }
        if w > LARGE_WINDOW {
            // f32 activations alive at once, about: the residual, a norm, q/k/v/o and three MLP rows per position
            let c = &self.cfg;
            let per_row = 4 * (3 * c.hidden_size + 2 * c.num_attention_heads * c.head_dim + 3 * c.intermediate_size);
            crate::util::check_alloc(per_row.saturating_mul(w), || format!("activations of a {w}-position forward"))?;
        }
        cache.begin_window(w)?;
        let dev = &self.device;
        // RoPE tables in f32 for positions [p, p + w), cast to the compute dtype afterwards.
        let pos: Vec<f32> = (p..s).map(|x| x as f32).collect();
        let freqs = Tensor::from_vec(pos, (w, 1), dev)?.broadcast_mul(&self.inv_freq)?;
        let cos = freqs.cos()?.to_dtype(self.dtype)?;
        let sin = freqs.sin()?.to_dtype(self.dtype)?;
        let masks =
            QueryChunks::new(grid, p, w, self.cfg.num_attention_heads, self.kernels.attention_score_bytes, dev)?;
        let ids_t = Tensor::new(ids, dev)?;
        let mut x = self.embed.index_select(&ids_t, 0)?.to_dtype(self.dtype)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let hn = layer.ln1.forward(&x)?;
            let a = layer.attn.forward(&hn, &cos, &sin, &masks, cache, li, p, &self.kernels)?;
            x = (x + a)?;
            let hn = layer.ln2.forward(&x)?;
            let f = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&hn, &self.kernels)?,
                Ffn::Sparse(m) => m.forward(&hn, &self.kernels)?,
            };
            x = (x + f)?;
        }
        let x = match rows {
            Some(r) => {
                let idx: Vec<u32> = r.iter().map(|&i| i as u32).collect();
                x.index_select(&Tensor::new(idx.as_slice(), dev)?, 0)?
            }
            None => x,
        };
        let x = self.norm.forward(&x)?;
        Ok(crate::skinny::linear(&x, &self.lm_head, &self.kernels)?.to_dtype(DType::F32)?)
    }
}

/// Windows longer than this check that their activations can be allocated before computing.
const LARGE_WINDOW: usize = 4096;

/// The query chunks of one forward and their additive masks: one chunk (the mask built once) unless the scores
/// of the whole window exceed `Kernels::attention_score_bytes`, then chunks whose masks are built when used.
struct QueryChunks<'a> {
    grid: &'a BlockGrid,
    p: usize,
    w: usize,
    rows: usize,
    whole: Option<Tensor>,
    device: Device,
}

impl<'a> QueryChunks<'a> {
    fn new(grid: &'a BlockGrid, p: usize, w: usize, heads: usize, score_bytes: usize, device: &Device) -> Result<Self> {
        let s = p + w;
        let rows = (score_bytes / (4 * heads * s).max(1)).clamp(1, w);
        let whole = if rows == w { Self::mask(grid, p, w, s, device)? } else { None };
        Ok(QueryChunks { grid, p, w, rows, whole, device: device.clone() })
    }

    fn mask(grid: &BlockGrid, q0: usize, n: usize, s: usize, device: &Device) -> Result<Option<Tensor>> {
        Ok(match grid.additive_mask_rows(q0, n, s) {
            Some(m) => Some(Tensor::from_vec(m, (n, s), device)?),
            None => None,
        })
    }

    /// (first row, rows, mask) of each chunk.
    fn each(&self) -> impl Iterator<Item = Result<(usize, usize, Option<Tensor>)>> + '_ {
        let s = self.p + self.w;
        (0..self.w).step_by(self.rows).map(move |r0| {
            let n = self.rows.min(self.w - r0);
            let mask =
                if n == self.w { self.whole.clone() } else { Self::mask(self.grid, self.p + r0, n, s, &self.device)? };
            Ok((r0, n, mask))
        })
    }
}

impl Attention {
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        chunks: &QueryChunks,
        cache: &mut KvCache,
        layer: usize,
        p: usize,
        kn: &Kernels,
    ) -> Result<Tensor> {
        let w = x.dim(0)?;
        let (nh, nkv, d) = (self.n_heads, self.n_kv, self.head_dim);
        let q = self.q.forward(x, kn)?.reshape((w, nh, d))?;
        let k = self.k.forward(x, kn)?.reshape((w, nkv, d))?;
        let v = self.v.forward(x, kn)?.reshape((w, nkv, d))?;
        let q = match &self.q_norm {
            Some(n) => n.forward(&q)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k)?,
            None => k,
        };
        // (W, H, D) -> (1, H, W, D) for the fused rope kernel.
        let q = candle_nn::rotary_emb::rope(&q.transpose(0, 1)?.contiguous()?.unsqueeze(0)?, cos, sin)?.squeeze(0)?;
        let k = candle_nn::rotary_emb::rope(&k.transpose(0, 1)?.contiguous()?.unsqueeze(0)?, cos, sin)?.squeeze(0)?;
        let v = v.transpose(0, 1)?.contiguous()?;
        // Write the window's K/V after the committed prefix and attend over [0, p + w).
        let (kk, vv) = cache.write_window(layer, &k, &v, p)?;
        let s = p + w;
        let n_rep = nh / nkv;
        let scale = 1.0 / (d as f64).sqrt();
        let kt = kk.to_dtype(DType::F32)?.t()?;
        let q = q.to_dtype(DType::F32)?;
        let mut ys = Vec::with_capacity(1);
        for chunk in chunks.each() {
            let (r0, n, mask) = chunk?;
            let qc = if n == w { q.clone() } else { q.narrow(1, r0, n)?.contiguous()? };
            // GQA without repeating K/V: the n_rep query heads of a group are adjacent, so fold them into rows.
            let att = qc.reshape((nkv, n_rep * n, d))?.matmul(&kt)?.affine(scale, 0.0)?;
            let att = att.reshape((nkv, n_rep, n, s))?;
            let att = match mask {
                Some(m) => att.broadcast_add(&m)?,
                None => att,
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(vv.dtype())?;
            ys.push(att.reshape((nkv, n_rep * n, s))?.matmul(&vv)?.reshape((nh, n, d))?);
            // (nh, n, d)
        }
        let y = if ys.len() == 1 { ys.pop().expect("one chunk") } else { Tensor::cat(&ys, 1)? };
        let y = y.transpose(0, 1)?.reshape((w, nh * d))?;
        self.o.forward(&y, kn)
    }
}

/// One model serves every thread: it must stay Send + Sync.
const _: fn() = || {
    fn f<T: Send + Sync>() {}
    f::<QwenModel>();
};

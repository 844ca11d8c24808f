//! Qwen3.5's Gated DeltaNet token mixer (transformers' `Qwen3_5GatedDeltaNet`): in_proj_qkv / z / b / a, a causal
//! depthwise convolution with SiLU over q, k and v, L2-normalised q and k, the gated delta rule with decay
//! g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), a gated RMSNorm with z, out_proj.
//!
//! The layer is causal whatever the block-diffusion mask: each segment's window rows run in order from its cache's
//! committed state (`kv_cache::Recurrent`), which the forward leaves as it was; the rows' recurrence inputs stay in
//! the cache so that a commit advances the state over exactly the committed rows. Everything after the projections
//! runs in f32 on the host (`kernels::delta_rule`).

use crate::error::{Error, Result};
use crate::kernels::delta_rule::{causal_conv_silu, scan, DeltaRows, DeltaShape};
use crate::kernels::Kernels;
use crate::load::config::LinearAttnConfig;
use crate::net::kv_cache::{RecurrentShape, RecurrentWindow};
use crate::net::layers::{Linear, Stacked};
use crate::net::linear::{Groups, Holder};
use crate::net::segment::Segment;
use candle_core::{DType, Device, Tensor};

pub(crate) struct GatedDeltaNet {
    /// in_proj_qkv, in_proj_z, in_proj_b and in_proj_a side by side: (rows, conv_dim + value_dim + 2 v_heads)
    proj: Stacked,
    out: Linear,
    /// conv1d.weight (conv_dim, kernel)
    conv_w: Vec<f32>,
    /// -exp(A_log), per value head
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// the gated norm's weight (value dim)
    norm_w: Vec<f32>,
    eps: f32,
    pub(crate) shape: RecurrentShape,
}

/// A small f32 vector of a checkpoint (the convolution, the decay parameters, the gated norm's weight).
fn host_f32(ws: &Holder, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    Ok(ws.weights().get(name, shape)?.to_dtype(DType::F32)?.flatten_all()?.to_device(&Device::Cpu)?.to_vec1()?)
}

/// log(1 + e^x) as torch's softplus computes it (x itself above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// x / sqrt(sum x^2 + 1e-6) times `scale`, in place (transformers' `l2norm`, as FLA computes it).
fn l2norm(x: &mut [f32], scale: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt() * scale;
    x.iter_mut().for_each(|v| *v *= inv);
}

impl GatedDeltaNet {
    pub(crate) fn load(
        ws: &Holder,
        prefix: &str,
        hidden: usize,
        lc: &LinearAttnConfig,
        eps: f64,
        stack: bool,
    ) -> Result<Self> {
        let (hk, hv, dk, dv) = (lc.key_heads, lc.value_heads, lc.key_dim, lc.value_dim);
        let conv_dim = lc.conv_dim();
        let vd = hv * dv;
        let proj = Stacked::load(
            ws,
            &[
                (format!("{prefix}.in_proj_qkv"), conv_dim),
                (format!("{prefix}.in_proj_z"), vd),
                (format!("{prefix}.in_proj_b"), hv),
                (format!("{prefix}.in_proj_a"), hv),
            ],
            hidden,
            false,
            stack,
        )?;
        // llama.cpp's GGUF files store -exp(A_log) (`ssm_a`)
        let neg_a = match ws.weights().contains(&format!("{prefix}.ssm_a")) {
            true => host_f32(ws, &format!("{prefix}.ssm_a"), &[hv])?,
            false => host_f32(ws, &format!("{prefix}.A_log"), &[hv])?.iter().map(|a| -a.exp()).collect(),
        };
        // (conv_dim, 1, kernel) as transformers stores it, (conv_dim, kernel) as llama.cpp's GGUF files do
        let conv = format!("{prefix}.conv1d.weight");
        let conv_shape: &[usize] = match ws.weights().shape(&conv).map(|s| s.len()) {
            Some(2) => &[conv_dim, lc.conv_kernel],
            _ => &[conv_dim, 1, lc.conv_kernel],
        };
        Ok(GatedDeltaNet {
            proj,
            out: Linear::load(ws, &format!("{prefix}.out_proj"), hidden, vd, false)?,
            conv_w: host_f32(ws, &conv, conv_shape)?,
            neg_a,
            dt_bias: host_f32(ws, &format!("{prefix}.dt_bias"), &[hv])?,
            norm_w: host_f32(ws, &format!("{prefix}.norm.weight"), &[dv])?,
            eps: eps as f32,
            shape: RecurrentShape {
                delta: DeltaShape { k_heads: hk, v_heads: hv, dk, dv, tiled: lc.tiled_value_heads },
                conv_dim,
                conv_kernel: lc.conv_kernel,
            },
        })
    }

    pub(crate) fn row_invariant(&self) -> bool {
        self.proj.row_invariant() && self.out.w.row_invariant()
    }

    /// The mixer's output for every segment's window rows (stacked: segment i at rows `spans[i]`), each segment's
    /// rows continuing its cache's GDN layer `slot` from the committed state; the rows' recurrence inputs are left
    /// in the cache for its commit.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        segs: &mut [Segment<'_>],
        spans: &[(usize, usize)],
        slot: usize,
        groups: &Groups,
        kn: &Kernels,
    ) -> Result<Tensor> {
        let sh = self.shape;
        let DeltaShape { k_heads: hk, v_heads: hv, dk, dv, .. } = sh.delta;
        let (c, kd, vd) = (sh.conv_dim, hk * dk, hv * dv);
        let width = c + vd + 2 * hv;
        let p = groups.apply(x, |x, few| self.proj.forward(x, kn, few))?;
        let rows = p.dim(0)?;
        let p: Vec<f32> = p.to_dtype(DType::F32)?.flatten_all()?.to_device(&Device::Cpu)?.to_vec1()?;
        let mut y = vec![0f32; rows * vd];
        let scale = 1.0 / (dk as f32).sqrt();
        for (seg, &(o, n)) in segs.iter_mut().zip(spans) {
            if n == 0 {
                continue;
            }
            let rec = seg.cache.recurrent_mut(slot);
            let block = &p[o * width..(o + n) * width];
            let conv_in: Vec<f32> = block.chunks_exact(width).flat_map(|r| &r[..c]).copied().collect();
            let act = causal_conv_silu(&self.conv_w, sh.conv_kernel, &rec.conv, &conv_in, c);
            let (mut q, mut k, mut v) =
                (Vec::with_capacity(n * kd), Vec::with_capacity(n * kd), Vec::with_capacity(n * vd));
            let (mut g, mut beta) = (Vec::with_capacity(n * hv), Vec::with_capacity(n * hv));
            for (a, r) in act.chunks_exact(c).zip(block.chunks_exact(width)) {
                q.extend_from_slice(&a[..kd]);
                k.extend_from_slice(&a[kd..2 * kd]);
                v.extend_from_slice(&a[2 * kd..]);
                let (b, av) = (&r[c + vd..c + vd + hv], &r[c + vd + hv..]);
                beta.extend(b.iter().map(|&b| 1.0 / (1.0 + (-b).exp())));
                g.extend(av.iter().zip(&self.neg_a).zip(&self.dt_bias).map(|((&a, &na), &dt)| na * softplus(a + dt)));
            }
            q.chunks_exact_mut(dk).for_each(|h| l2norm(h, scale));
            k.chunks_exact_mut(dk).for_each(|h| l2norm(h, 1.0));
            // the forward reads the state; only a commit moves it
            let mut state = rec.state.clone();
            let mut core = vec![0f32; n * vd];
            let xr = DeltaRows { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            scan(sh.delta, &mut state, &xr, n, Some(&mut core));
            // gated RMSNorm per value head: w * norm(o) * silu(z)
            for (t, (yo, r)) in y[o * vd..(o + n) * vd].chunks_exact_mut(vd).zip(block.chunks_exact(width)).enumerate()
            {
                let z = &r[c..c + vd];
                for h in 0..hv {
                    let oh = &core[(t * hv + h) * dv..][..dv];
                    let var = oh.iter().map(|v| v * v).sum::<f32>() / dv as f32;
                    let inv = 1.0 / (var + self.eps).sqrt();
                    for j in 0..dv {
                        let zj = z[h * dv + j];
                        yo[h * dv + j] = self.norm_w[j] * (oh[j] * inv) * (zj / (1.0 + (-zj).exp()));
                    }
                }
            }
            rec.window = Some(RecurrentWindow { conv_in, q, k, v, g, beta });
        }
        let y = Tensor::from_vec(y, (rows, vd), &Device::Cpu)?.to_device(x.device())?.to_dtype(x.dtype())?;
        groups.apply(&y, |y, few| self.out.forward(y, kn, few))
    }
}

/// A recurrent layer sees a segment's rows in order as the next positions of its sequence: a window whose rows are
/// other positions (a verification's second half, two rows per position) cannot run through it.
pub(crate) fn check_in_order(seg: &Segment<'_>) -> Result<()> {
    let p = seg.cache.len();
    if seg.positions.iter().enumerate().any(|(i, &x)| x != p + i) {
        return Err(Error::Unsupported(
            "this model has Gated DeltaNet layers (a causal recurrence): a forward's rows must be the positions \
             right after the cached ones, in order (two rows per position, or rows at other positions, cannot run \
             through it)"
                .into(),
        ));
    }
    Ok(())
}

//! Qwen3.5's Gated DeltaNet token mixer (transformers' `Qwen3_5GatedDeltaNet`): in_proj_qkv / z / b / a, a causal
//! depthwise convolution with SiLU over q, k and v, L2-normalised q and k, the gated delta rule with decay g =
//! -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), a gated RMSNorm with z, out_proj.
//!
//! The layer is causal whatever the block-diffusion mask: each segment's window rows run in order from its cache's
//! committed state ([`kv_cache::Recurrent`](crate::net::kv_cache::Recurrent)), which the forward leaves as it was; the
//! rows' recurrence inputs stay in the cache so that a commit advances the state over exactly the committed rows.
//! Everything after the projections runs in f32 on the model's device
//! ([`kernels::delta_rule`](crate::kernels::delta_rule)).

use crate::error::{Error, Result};
use crate::kernels::delta_rule::{window_out, window_rows, DeltaShape, GdnParams};
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
    /// the convolution, the decay parameters and the gated norm, on the model's device
    params: GdnParams,
    pub(crate) shape: RecurrentShape,
}

/// A small f32 vector of a checkpoint (the convolution, the decay parameters, the gated norm's weight).
fn host_f32(ws: &Holder, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    Ok(ws.weights().get(name, shape)?.to_dtype(DType::F32)?.flatten_all()?.to_device(&Device::Cpu)?.to_vec1()?)
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
        let delta = DeltaShape { k_heads: hk, v_heads: hv, dk, dv, tiled: lc.tiled_value_heads };
        let params = GdnParams::new(
            delta,
            (conv_dim, lc.conv_kernel),
            [
                host_f32(ws, &conv, conv_shape)?,
                neg_a,
                host_f32(ws, &format!("{prefix}.dt_bias"), &[hv])?,
                host_f32(ws, &format!("{prefix}.norm.weight"), &[dv])?,
            ],
            eps as f32,
            ws.weights().device(),
        )?;
        Ok(GatedDeltaNet {
            proj,
            out: Linear::load(ws, &format!("{prefix}.out_proj"), hidden, vd, false)?,
            params,
            shape: RecurrentShape { delta, conv_dim, conv_kernel: lc.conv_kernel },
        })
    }

    pub(crate) fn row_invariant(&self) -> bool {
        self.proj.row_invariant() && self.out.w.row_invariant()
    }

    /// The mixer's output for every segment's window rows (stacked: segment i at rows `spans[i]`), each segment's rows
    /// continuing its cache's GDN layer `slot` from the committed state; the rows' recurrence inputs are left in the
    /// cache for its commit. Everything after the projections stays on the model's device
    /// ([`kernels::delta_rule`](crate::kernels::delta_rule): the host's functions on the CPU, two kernel launches per
    /// segment on CUDA).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        segs: &mut [Segment<'_>],
        spans: &[(usize, usize)],
        slot: usize,
        groups: &Groups,
        kn: &Kernels,
    ) -> Result<Tensor> {
        let p = groups.apply(x, |x, few| self.proj.forward(x, kn, few))?.to_dtype(DType::F32)?;
        // the segments' outputs in the order of their stacked rows
        let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
        order.sort_by_key(|&i| spans[i].0);
        let end = order.iter().try_fold(0, |next, &i| (spans[i].0 == next).then_some(next + spans[i].1));
        if end != Some(p.dim(0)?) {
            return Err(Error::Internal("a forward's segments do not tile its stacked rows".into()));
        }
        let mut ys = Vec::with_capacity(order.len());
        for i in order {
            let (o, n) = spans[i];
            let rec = segs[i].cache.recurrent_mut(slot);
            let ps = p.narrow(0, o, n)?.contiguous()?;
            let rows = window_rows(&self.params, &ps, &rec.conv)?;
            // the forward reads the state; only a commit moves it
            ys.push(window_out(&self.params, &rec.state, &rows, &ps)?);
            rec.window = Some(RecurrentWindow { p: ps, rows });
        }
        let y = match ys.len() {
            0 => Tensor::zeros((0, self.shape.delta.v_heads * self.shape.delta.dv), x.dtype(), x.device())?,
            1 => ys.swap_remove(0).to_dtype(x.dtype())?,
            _ => Tensor::cat(&ys, 0)?.to_dtype(x.dtype())?,
        };
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

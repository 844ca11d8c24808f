//! The layers every architecture is built of: a linear layer (`Linear`: a held matrix and its bias), linear layers
//! of one input computed as one product (`Stacked`), RMSNorm, and the MLP's gate (`silu_mul`).

use crate::error::Result;
use crate::kernels::Kernels;
use crate::net::linear::{Holder, Matrix};
use candle_core::{DType, Tensor};

pub(crate) struct Linear {
    pub(crate) w: Matrix,
    pub(crate) b: Option<Tensor>,
}

impl Linear {
    pub(crate) fn load(ws: &Holder, prefix: &str, out_f: usize, in_f: usize, bias: bool) -> Result<Self> {
        let w = ws.weight(&format!("{prefix}.weight"), &[out_f, in_f])?;
        let b = if bias { Some(ws.weights().get(&format!("{prefix}.bias"), &[out_f])?) } else { None };
        Ok(Linear { w, b })
    }
    pub(crate) fn forward(&self, x: &Tensor, k: &Kernels, few: bool) -> Result<Tensor> {
        let y = self.w.linear(x, k, few)?;
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Linear layers of one input computed as one product (q/k/v, gate/up): their matrices and biases stacked at
/// load when they are held alike ([`Matrix::stack`]), so one call of the kernel (one pass over x, one launch on a
/// GPU) gives every output side by side. The few-row kernel computes each output column alone, so there
/// stacking changes no bit; gemm (long windows) may block the wider matrix differently (rounding-level
/// differences; batch invariance is unaffected: a window is computed the same way alone or batched). Matrices
/// that cannot be stacked (a GGUF file may store q, k and v in different block formats) run one by one and
/// their outputs are concatenated.
pub(crate) struct Stacked {
    pub(crate) parts: Vec<Linear>,
}

impl Stacked {
    pub(crate) fn row_invariant(&self) -> bool {
        self.parts.iter().all(|l| l.w.row_invariant())
    }

    /// `specs`: (name prefix, output features) of each layer, in output order. `stack`: [`Kernels::stack`].
    pub(crate) fn load(ws: &Holder, specs: &[(String, usize)], in_f: usize, bias: bool, stack: bool) -> Result<Self> {
        let parts =
            specs.iter().map(|(p, out_f)| Linear::load(ws, p, *out_f, in_f, bias)).collect::<Result<Vec<_>>>()?;
        if !stack || parts.len() < 2 {
            return Ok(Stacked { parts });
        }
        let ws: Vec<Matrix> = parts.iter().map(|l| l.w.clone()).collect();
        Ok(match Matrix::stack(&ws)? {
            Some(w) => {
                let b = match parts.iter().map(|l| l.b.clone()).collect::<Option<Vec<_>>>() {
                    Some(bs) => Some(Tensor::cat(&bs, 0)?),
                    None => None,
                };
                Stacked { parts: vec![Linear { w, b }] }
            }
            _ => Stacked { parts },
        })
    }
    /// (rows, Σ outputs): every layer's outputs side by side, in load order.
    pub(crate) fn forward(&self, x: &Tensor, k: &Kernels, few: bool) -> Result<Tensor> {
        if let [one] = self.parts.as_slice() {
            return one.forward(x, k, few);
        }
        let ys = self.parts.iter().map(|l| l.forward(x, k, few)).collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&ys, 1)?)
    }
}

pub(crate) struct RmsNorm {
    pub(crate) w: Tensor,
    pub(crate) eps: f32,
}

impl RmsNorm {
    /// `offset`: the checkpoint stores w - 1 (Qwen3.5's norms compute norm(x) (1 + w)); 1 is added here, in f32.
    pub(crate) fn load(ws: &Holder, name: &str, dim: usize, eps: f64, offset: bool) -> Result<Self> {
        let w = ws.weights().get(name, &[dim])?;
        let w = if offset { (w.to_dtype(DType::F32)? + 1.0)?.to_dtype(w.dtype())? } else { w };
        Ok(RmsNorm { w, eps: eps as f32 })
    }
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if x.is_contiguous() { x.clone() } else { x.contiguous()? };
        Ok(candle_nn::ops::rms_norm(&x, &self.w, self.eps)?)
    }
    /// (x + a, this norm of it): the residual add and the norm after it, in one launch where `fused`
    /// ([`cuda::add_rms_norm`](crate::kernels::cuda::add_rms_norm), on CUDA), else candle's add and `forward`.
    pub(crate) fn add_forward(&self, x: &Tensor, a: &Tensor, fused: bool) -> Result<(Tensor, Tensor)> {
        if fused && x.is_contiguous() && a.is_contiguous() {
            return crate::kernels::cuda::add_rms_norm(x, a, &self.w, self.eps);
        }
        let s = (x + a)?;
        let h = self.forward(&s)?;
        Ok((s, h))
    }
}

/// silu(g) · u, the MLP's gate, from `gu` = (rows, 2I): g its first I columns, u the last I. On the CPU one pass over
/// f32 rows, in parallel for long windows (candle's unary and binary maps run on one thread and allocate twice), e^-g
/// vectorised where the CPU has AVX2 and FMA ([`vmath::silu_mul`](crate::kernels::vmath::silu_mul), within a few ulp of
/// candle's silu, whose scalar `expf` took a visible share of a forward), else candle's formula. On CUDA one launch
/// ([`cuda::silu_mul`](crate::kernels::cuda::silu_mul), in f32).
pub(crate) fn silu_mul(gu: &Tensor, k: &Kernels) -> Result<Tensor> {
    if gu.device().is_cpu() && gu.dtype() == DType::F32 {
        return Ok(gu.contiguous()?.apply_op1_no_bwd(&SiluMul)?);
    }
    if k.cuda_fused && crate::kernels::cuda::runs_on(gu.device(), gu.dtype()) {
        return crate::kernels::cuda::silu_mul(gu);
    }
    let i = gu.dim(1)? / 2;
    Ok((gu.narrow(1, 0, i)?.silu()? * gu.narrow(1, i, i)?)?)
}

struct SiluMul;

impl candle_core::CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }
    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let candle_core::CpuStorage::F32(gu) = s else {
            candle_core::bail!("silu-mul: an f32 operand expected");
        };
        let (Some((a0, a1)), Ok((rows, two_i))) = (l.contiguous_offsets(), l.shape().dims2()) else {
            candle_core::bail!("silu-mul: a contiguous (rows, 2I) operand expected");
        };
        if !two_i.is_multiple_of(2) {
            candle_core::bail!("silu-mul: an even number of columns expected, got {two_i}");
        }
        let i = two_i / 2;
        let gu = &gu[a0..a1];
        let mut y = vec![0f32; rows * i];
        if i == 0 {
            return Ok((candle_core::CpuStorage::F32(y), (rows, 0).into()));
        }
        let f = |(y, gu): (&mut [f32], &[f32])| {
            for (y, gu) in y.chunks_exact_mut(i).zip(gu.chunks_exact(two_i)) {
                let (g, u) = gu.split_at(i);
                crate::kernels::vmath::silu_mul(g, u, y);
            }
        };
        // rows per parallel chunk: about 16k outputs
        let chunk = ((1 << 14) / i).max(1);
        if rows * i >= 4 << 14 {
            y.par_chunks_mut(chunk * i).zip(gu.par_chunks(chunk * two_i)).for_each(f);
        } else {
            f((&mut y, gu));
        }
        Ok((candle_core::CpuStorage::F32(y), (rows, i).into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn silu_mul_is_candles_silu_then_mul_to_a_few_ulp() {
        // one-thread and parallel sizes, and a non-contiguous operand; rows alone give the bits they give stacked
        for rows in [3usize, 64] {
            let g = Tensor::randn(0f32, 3.0, (rows, 1100), &Device::Cpu).unwrap();
            let u = Tensor::randn(0f32, 1.0, (1100, rows), &Device::Cpu).unwrap().t().unwrap();
            let want = (g.silu().unwrap() * &u).unwrap().to_vec2::<f32>().unwrap();
            let gu = Tensor::cat(&[&g, &u], 1).unwrap();
            let got = silu_mul(&gu, &Kernels::default()).unwrap().to_vec2::<f32>().unwrap();
            for (a, b) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((a - b).abs() <= 4.0 * f32::EPSILON * b.abs() + 1e-30, "{a} vs {b}");
            }
            let gu_t = gu.t().unwrap().contiguous().unwrap().t().unwrap();
            assert_eq!(silu_mul(&gu_t, &Kernels::default()).unwrap().to_vec2::<f32>().unwrap(), got);
            let one = silu_mul(&gu.narrow(0, 1, 1).unwrap(), &Kernels::default()).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(one[0], got[1]);
        }
    }
}

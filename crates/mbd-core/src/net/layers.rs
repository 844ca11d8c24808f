//! The layers every architecture is built of: a linear layer (`Linear`: a held matrix and its bias), linear layers
//! of one input computed as one product (`Stacked`), and RMSNorm.

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
/// load when they are held alike (`Matrix::stack`), so one call of the kernel (one pass over x, one launch on a
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

    /// `specs`: (name prefix, output features) of each layer, in output order. `stack`: `Kernels::stack`.
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
    /// (`cuda::add_rms_norm`, on CUDA), else candle's add and `forward`.
    pub(crate) fn add_forward(&self, x: &Tensor, a: &Tensor, fused: bool) -> Result<(Tensor, Tensor)> {
        if fused && x.is_contiguous() && a.is_contiguous() {
            return crate::kernels::cuda::add_rms_norm(x, a, &self.w, self.eps);
        }
        let s = (x + a)?;
        let h = self.forward(&s)?;
        Ok((s, h))
    }
}

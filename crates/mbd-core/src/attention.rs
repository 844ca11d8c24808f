//! Attention on the CPU. Windows of a model computing in f32 on an x86-64 CPU with AVX2 and FMA take
//! `attend` (`blocked`: blocked over keys, mask-aware from the segment's key ranges, an online softmax: no score
//! matrix, no mask array); elsewhere candle's ops run, with `scaled_softmax` fusing the scale, the additive mask
//! and the softmax into one parallel pass. `SegmentKv` is what the kernel reads of a segment.

use crate::error::{Error, Result};
use rayon::prelude::*;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
pub mod blocked;

/// One segment's operands: its cache's K and V of one layer ((n_kv, capacity, head_dim) f32, the window's rows
/// already written after the committed prefix), its first row in the stacked queries, and per row the key
/// ranges it sees.
pub struct SegmentKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub capacity: usize,
    pub row0: usize,
    pub visible: &'a [Vec<Range<usize>>],
}

/// Whether `attend` runs here: x86-64 with AVX2 and FMA, query heads a multiple of kv heads (at most 16 per kv
/// head), head_dim a multiple of 16 up to 256.
pub fn available(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return blocked::available(heads, kv_heads, head_dim);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Attention of every segment's rows into `out` ((rows, heads × head_dim), row-major; other rows are left as they
/// are), in the blocked kernel (`blocked`).
/// `q`: the stacked queries, (heads, rows, head_dim) row-major, RoPE applied. An error where not `available`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    rows: usize,
    segs: &[SegmentKv<'_>],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    if !available(heads, kv_heads, head_dim) {
        return Err(Error::Internal("the blocked attention kernel is not available on this CPU or head shape".into()));
    }
    #[cfg(target_arch = "x86_64")]
    blocked::run(q, rows, segs, (heads, kv_heads, head_dim), scale, out);
    Ok(())
}

/// softmax(att · scale + mask) over the last dimension, for candle's attention path: att (.., n, s) scores, mask
/// (n, s) additive or none. On the CPU (f32, contiguous) one parallel pass per row instead of three tensor ops
/// (two of them on one thread, each allocating the whole score tensor); the same arithmetic as candle's
/// `affine`, `broadcast_add` and `softmax_last_dim` in that order (its max and its vectorised sum), so the same bits.
pub fn scaled_softmax(
    att: &candle_core::Tensor,
    scale: f64,
    mask: Option<&candle_core::Tensor>,
) -> Result<candle_core::Tensor> {
    use candle_core::cpu::kernels::VecOps;
    use candle_core::{DType, Tensor};
    let dims = att.dims().to_vec();
    let on_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
    let (n, s) = match dims[..] {
        [.., n, s] if s > 0 && on_cpu(att) && mask.is_none_or(|m| on_cpu(m) && m.dims() == [n, s]) => (n, s),
        _ => {
            let att = att.affine(scale, 0.0)?;
            let att = match mask {
                Some(m) => att.broadcast_add(m)?,
                None => att,
            };
            return Ok(candle_nn::ops::softmax_last_dim(&att)?);
        }
    };
    let (a_st, a_l) = att.storage_and_layout();
    let a = cpu_f32(&a_st, a_l.start_offset(), att.elem_count())?;
    let m_guard = mask.map(|m| m.storage_and_layout());
    let m = match &m_guard {
        Some((st, l)) => Some(cpu_f32(st, l.start_offset(), n * s)?),
        None => None,
    };
    let (mul, add) = (scale as f32, 0f32);
    // every value is written by the row's first loop: no zero fill of the (heads × rows × keys) scores
    let mut out: Vec<f32> = Vec::with_capacity(a.len());
    out.spare_capacity_mut()[..a.len()].par_chunks_mut(s).zip(a.par_chunks(s)).enumerate().for_each(|(r, (y, x))| {
        match m {
            Some(m) => {
                let mr = &m[(r % n) * s..(r % n + 1) * s];
                for ((y, &x), &mv) in y.iter_mut().zip(x).zip(mr) {
                    y.write((x * mul + add) + mv);
                }
            }
            None => {
                for (y, &x) in y.iter_mut().zip(x) {
                    y.write(x * mul + add);
                }
            }
        }
        // SAFETY: every element of y was written above; MaybeUninit<f32> has f32's layout.
        let y = unsafe { &mut *(y as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
        let mut max = f32::NEG_INFINITY;
        // SAFETY: y has s > 0 elements.
        unsafe { <f32 as VecOps>::vec_reduce_max(y.as_ptr(), &mut max, s) };
        for y in y.iter_mut() {
            *y = (*y - max).exp();
        }
        let mut sum = 0f32;
        // SAFETY: as above.
        unsafe { <f32 as VecOps>::vec_reduce_sum(y.as_ptr(), &mut sum, s) };
        for y in y.iter_mut() {
            *y /= sum;
        }
    });
    // SAFETY: the chunks covered all a.len() values and wrote each of them.
    unsafe { out.set_len(a.len()) };
    Ok(Tensor::from_vec(out, dims, att.device())?)
}

/// The f32 values [offset, offset + n) of a CPU storage.
pub(crate) fn cpu_f32(s: &candle_core::Storage, offset: usize, n: usize) -> Result<&[f32]> {
    match s {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) if offset + n <= v.len() => {
            Ok(&v[offset..offset + n])
        }
        _ => Err(Error::Internal("CPU attention needs f32 CPU tensors".into())),
    }
}

#[cfg(test)]
mod scaled_softmax_tests {
    use super::scaled_softmax;
    use candle_core::{Device, Tensor};

    #[test]
    fn equals_candles_three_ops_bit_for_bit() {
        let att = Tensor::randn(0f32, 4.0, (2, 3, 5, 37), &Device::Cpu).unwrap();
        let mut m = vec![0f32; 5 * 37];
        for (i, v) in m.iter_mut().enumerate() {
            if i % 7 == 3 {
                *v = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(m, (5, 37), &Device::Cpu).unwrap();
        for mask in [Some(&mask), None] {
            let want = att.affine(0.125, 0.0).unwrap();
            let want = match mask {
                Some(m) => want.broadcast_add(m).unwrap(),
                None => want,
            };
            let want =
                candle_nn::ops::softmax_last_dim(&want).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = scaled_softmax(&att, 0.125, mask).unwrap();
            assert_eq!(got.dims(), att.dims());
            assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        }
    }
}

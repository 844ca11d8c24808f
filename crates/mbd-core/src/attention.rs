//! Attention of small windows on the CPU, every segment of a forward in one pass.
//!
//! A decode window is a few query rows over a cache of tens to thousands of keys: in candle ops its attention is
//! a dozen small tensor operations (transposes, a masked score matrix built on the host, softmax, two matmuls) per
//! segment and layer, whose fixed costs dominate on small models and grow with the number of batched sequences.
//! Here each (row, kv head) of every segment is one task on the engine's pool: an online softmax over the keys
//! the row sees (the ranges of its `MaskSpec`, so no mask array is ever built) for the kv head's query heads at
//! once, each key and value row read once, written straight into the (rows, heads x head_dim) layout the output
//! projection reads. A row's result depends only on
//! its own query and keys: batch-invariant by construction.
//!
//! Windows whose attention is large (a prefill chunk, a long window over a long cache) keep candle's matmul path,
//! where gemm's blocking pays off (`fits`). The choice is made per segment, from its own sizes.
//!
//! Opt-in (`Kernels::direct_attention`): measured even with candle's path so far (attention is ~5% of a batched
//! forward on the tiny model; the linear layers dominate), so it is not the default yet.

use crate::error::{Error, Result};
use rayon::prelude::*;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
pub mod blocked;

/// Whether long windows' attention can take `blocked::attend` here (x86-64 with AVX2 and FMA, a supported head
/// shape).
pub fn blocked_available(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return blocked::available(heads, kv_heads, head_dim);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Multiply-adds (twice: scores and values) below which the call runs on the calling thread.
const PAR_MIN_MACS: usize = 1 << 18;

/// Multiply-adds (rows x keys x heads x head_dim) up to which a segment's attention takes this path.
const MAX_MACS: usize = 1 << 22;

/// Whether a segment of `w` rows over `s` keys takes this path.
pub fn fits(w: usize, s: usize, heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    heads <= MAX_REP * kv_heads && w.saturating_mul(s).saturating_mul(heads).saturating_mul(head_dim) <= MAX_MACS
}

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

/// Attention of the rows of `segs` into `out` ((rows, heads x head_dim), row-major; other rows are left as
/// they are). `q`: the stacked queries, (heads, rows, head_dim) row-major, RoPE applied.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    rows: usize,
    segs: &[SegmentKv<'_>],
    heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
) {
    let n_rep = heads / kv_heads;
    // one task per (segment row, kv group): each key row is read once for the group's n_rep query heads
    let mut tasks: Vec<(usize, usize)> = vec![];
    for (si, s) in segs.iter().enumerate() {
        tasks.extend((0..s.visible.len()).map(|i| (si, i)));
    }
    let out_ptr = OutRows(out.as_mut_ptr());
    let work = |&(si, i): &(usize, usize), g: usize| {
        let s = &segs[si];
        let r = s.row0 + i;
        let kg = &s.k[g * s.capacity * d..];
        let vg = &s.v[g * s.capacity * d..];
        // online softmax per head: running max m, running sum z, unnormalised output in acc
        let mut m = [f32::NEG_INFINITY; MAX_REP];
        let mut z = [0f32; MAX_REP];
        let mut acc = vec![0f32; n_rep * d];
        for range in &s.visible[i] {
            for j in range.clone() {
                let kj = &kg[j * d..(j + 1) * d];
                let vj = &vg[j * d..(j + 1) * d];
                for t in 0..n_rep {
                    let h = g * n_rep + t;
                    let qv = &q[(h * rows + r) * d..(h * rows + r + 1) * d];
                    let x = dot(qv, kj) * scale;
                    let a = &mut acc[t * d..(t + 1) * d];
                    if x > m[t] {
                        // a new maximum: rescale what was summed so far
                        let c = (m[t] - x).exp();
                        z[t] *= c;
                        for v in a.iter_mut() {
                            *v *= c;
                        }
                        m[t] = x;
                    }
                    let p = (x - m[t]).exp();
                    z[t] += p;
                    for (v, &b) in a.iter_mut().zip(vj) {
                        *v += p * b;
                    }
                }
            }
        }
        for t in 0..n_rep {
            let h = g * n_rep + t;
            let inv = 1.0 / z[t];
            // SAFETY: (row r, head h) owns out[r * heads * d + h * d ..][..d]; no other task writes it.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.at((r * heads + h) * d), d) };
            for (o, a) in dst.iter_mut().zip(&acc[t * d..(t + 1) * d]) {
                *o = a * inv;
            }
        }
    };
    // split over the pool only when there is enough work to pay for waking it
    let keys: usize =
        segs.iter().flat_map(|s| s.visible.iter()).map(|rs| rs.iter().map(|r| r.len()).sum::<usize>()).sum();
    if keys * heads * d < PAR_MIN_MACS {
        for t in &tasks {
            for g in 0..kv_heads {
                work(t, g);
            }
        }
    } else {
        (0..tasks.len() * kv_heads).into_par_iter().for_each(|x| work(&tasks[x / kv_heads], x % kv_heads));
    }
}

/// Query heads per kv head this kernel handles (Qwen models: up to 8); `fits` says no above it.
const MAX_REP: usize = 16;

/// Dot product in 8 independent lanes (vectorised by the compiler), then summed.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut s = (lanes[0] + lanes[4]) + (lanes[1] + lanes[5]) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

#[derive(Clone, Copy)]
struct OutRows(*mut f32);
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}
impl OutRows {
    #[inline]
    unsafe fn at(self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_direct_softmax_attention() {
        // 2 segments, GQA (4 heads over 2 kv heads), ranges with a hole; reference in f64
        let (heads, kvh, d, cap) = (4usize, 2usize, 20usize, 9usize);
        let mut x = 1u64;
        let mut rnd = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let rows = 3;
        let q: Vec<f32> = (0..heads * rows * d).map(|_| rnd()).collect();
        let kv: Vec<Vec<f32>> = (0..4).map(|_| (0..kvh * cap * d).map(|_| rnd()).collect()).collect();
        let vis_a = vec![vec![0..5], vec![0..2, 3..6]];
        let vis_b = vec![vec![1..7]];
        let segs = [
            SegmentKv { k: &kv[0], v: &kv[1], capacity: cap, row0: 0, visible: &vis_a },
            SegmentKv { k: &kv[2], v: &kv[3], capacity: cap, row0: 2, visible: &vis_b },
        ];
        let mut out = vec![0f32; rows * heads * d];
        attend(&q, rows, &segs, heads, kvh, d, 0.3, &mut out);
        for (si, s) in segs.iter().enumerate() {
            for (i, ranges) in s.visible.iter().enumerate() {
                let r = s.row0 + i;
                for h in 0..heads {
                    let g = h / 2;
                    let keys: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
                    let sc: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            (0..d).map(|t| (q[(h * rows + r) * d + t] * s.k[(g * cap + j) * d + t]) as f64).sum::<f64>()
                                * 0.3
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    for t in 0..d {
                        let want: f64 = keys
                            .iter()
                            .zip(&sc)
                            .map(|(&j, x)| (x - m).exp() / z * s.v[(g * cap + j) * d + t] as f64)
                            .sum();
                        let got = out[(r * heads + h) * d + t] as f64;
                        assert!((got - want).abs() < 1e-5, "seg {si} row {i} head {h} dim {t}: {got} vs {want}");
                    }
                }
            }
        }
    }
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

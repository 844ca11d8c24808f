//! What a decode step reads from each logits row: the argmax (ties -> lowest id), the entropy
//! and the max probability of softmax(row). One rule, run where the logits are: on the host, two passes per row
//! (`row_stats`: the argmax, then the softmax sums around its value), the rows read in place and split across the
//! calling pool by rows; on a CUDA device, one kernel launch over every row (`kernels.cu`'s `mbd_row_stats_*`, the
//! same two passes per row: terms in f32, sums in f64) and one copy of three numbers per row back to the host, so
//! that the logits never leave the GPU on the greedy path.
//!
//! Only rows are split across threads, never a row's vocabulary: the sums' f64 order within a row is fixed
//! ([`vmath::softmax_sums`](crate::kernels::vmath::softmax_sums)), so a row's statistics are the same bits whatever
//! the threads and whatever other rows share the call.

use crate::error::Result;
use crate::kernels::cuda;
use candle_core::{DType, Storage, Tensor};
use rayon::prelude::*;

/// (argmax, entropy, max probability) of one row.
pub type RowStats = (u32, f64, f64);

/// One row's argmax (ties -> lowest id), entropy and max probability of softmax(row), in two passes: the max
/// ([`argmax`]), then Z = Σ e^(x - m) and S = Σ e^(x - m)(x - m)
/// ([`vmath::softmax_sums`](crate::kernels::vmath::softmax_sums): terms in f32, sums in f64), so that H = -Σ p log p
/// = ln Z - S / Z and max p = 1 / Z. A NaN anywhere (or an infinite logit) makes the entropy NaN, which the sampler
/// reports as broken logits.
pub fn row_stats(row: &[f32]) -> RowStats {
    let best = argmax(row);
    let (z, sum) = crate::kernels::vmath::softmax_sums(row, row[best]);
    (best as u32, z.ln() - sum / z, 1.0 / z)
}

/// The first index of a row's largest value ([`argmax_scalar`]'s answer, the same index for every row): vectorised
/// where the CPU has AVX2 and FMA (each lane keeps its own first largest value, then the lanes' smallest index among
/// those equal to the largest; a NaN anywhere hands the row to the scalar loop, whose order rule NaN decides).
pub fn argmax(row: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if row.len() >= 16 && crate::kernels::vmath::has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected.
        if let Some(i) = unsafe { x86::argmax(row) } {
            return i;
        }
    }
    argmax_scalar(row)
}

/// The definition: the index `best` that moves only to a value greater than `row[best]`, from 0 (so the first of
/// equal largest values; -0 and +0 are equal; a NaN is never greater, nor anything greater than a NaN at 0).
pub fn argmax_scalar(row: &[f32]) -> usize {
    let mut best = 0usize;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// `row_stats` of each of `rows` rows of `v` values in `flat` (host memory), rows in parallel on the calling pool
/// when there is enough work (a full vocabulary).
pub fn host_rows(flat: &[f32], v: usize) -> Vec<RowStats> {
    let v = v.max(1);
    if flat.len() > v && flat.len() >= 1 << 16 {
        flat.par_chunks_exact(v).map(row_stats).collect()
    } else {
        flat.chunks_exact(v).map(row_stats).collect()
    }
}

/// `f` of the f32 values of `t` (any device and dtype) in host memory, read in place where `t` is a contiguous f32
/// tensor on the host (no copy of a step's logits), else copied there.
pub fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() == DType::F32 && t.device().is_cpu() {
        let (st, l) = t.storage_and_layout();
        if let (Storage::Cpu(cs), Some((a, b))) = (&*st, l.contiguous_offsets()) {
            return Ok(f(&cs.as_slice::<f32>()?[a..b]));
        }
    }
    let flat = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&flat))
}

/// `row_stats` of every row of `logits` (R, V), on the device that holds them: mbd-rs's kernel on a CUDA device
/// (f32 / bf16 / f16 logits read as they are; R × 3 f64 come back), the host otherwise (f32 rows read in place).
pub fn rows(logits: &Tensor) -> Result<Vec<RowStats>> {
    let (r, v) = logits.dims2()?;
    if r == 0 {
        return Ok(vec![]);
    }
    if v > 0 && cuda::runs_on(logits.device(), logits.dtype()) {
        let out = cuda::row_stats(logits)?.flatten_all()?.to_vec1::<f64>()?;
        return Ok(out.chunks_exact(3).map(|s| (s[0] as u32, s[1], s[2])).collect());
    }
    with_host_f32(logits, |flat| host_rows(flat, v))
}

/// The AVX2 code; callers check `has_avx2_fma`.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::argmax`] over 8 lanes (two registers of 8 in turn, so 16 values a round): each lane keeps its
    /// first strictly greater value and its index; None when a NaN is in the row. `row.len() >= 16`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn argmax(row: &[f32]) -> Option<usize> {
        let n = row.len();
        let p = row.as_ptr();
        let (mut b0, mut b1) = (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
        let mut i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
        let (mut c0, mut c1) = (i0, i1);
        let step = _mm256_set1_epi32(16);
        let mut nan = _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(b0, b0), _mm256_cmp_ps::<_CMP_UNORD_Q>(b1, b1));
        let mut i = 16;
        while i + 16 <= n {
            c0 = _mm256_add_epi32(c0, step);
            c1 = _mm256_add_epi32(c1, step);
            let (x0, x1) = (_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + 8)));
            let (g0, g1) = (_mm256_cmp_ps::<_CMP_GT_OQ>(x0, b0), _mm256_cmp_ps::<_CMP_GT_OQ>(x1, b1));
            b0 = _mm256_blendv_ps(b0, x0, g0);
            b1 = _mm256_blendv_ps(b1, x1, g1);
            i0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(c0), g0));
            i1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i1), _mm256_castsi256_ps(c1), g1));
            nan = _mm256_or_ps(
                nan,
                _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(x0, x0), _mm256_cmp_ps::<_CMP_UNORD_Q>(x1, x1)),
            );
            i += 16;
        }
        if _mm256_movemask_ps(nan) != 0 {
            return None;
        }
        let (mut bv, mut bi) = ([0f32; 16], [0i32; 16]);
        _mm256_storeu_ps(bv.as_mut_ptr(), b0);
        _mm256_storeu_ps(bv.as_mut_ptr().add(8), b1);
        _mm256_storeu_si256(bi.as_mut_ptr() as *mut __m256i, i0);
        _mm256_storeu_si256(bi.as_mut_ptr().add(8) as *mut __m256i, i1);
        // the lanes' first largest values, then the tail: the smallest index among the values equal to the largest
        let (mut m, mut at) = (bv[0], bi[0] as usize);
        for (&v, &j) in bv.iter().zip(&bi).skip(1) {
            if v > m || (v == m && (j as usize) < at) {
                (m, at) = (v, j as usize);
            }
        }
        for (j, &x) in row.iter().enumerate().skip(i) {
            if x.is_nan() {
                return None;
            }
            if x > m {
                (m, at) = (x, j);
            }
        }
        Some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The definition in f64, independently of `vmath`: softmax over the row, its entropy, its largest entry.
    fn reference(row: &[f32]) -> RowStats {
        let m = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
        let p: Vec<f64> = row.iter().map(|&x| (x as f64 - m).exp() / z).collect();
        let h: f64 = -p.iter().filter(|&&q| q > 0.0).map(|q| q * q.ln()).sum::<f64>();
        let first_max = row.iter().position(|&x| x as f64 == m).unwrap() as u32;
        (first_max, h, p.iter().cloned().fold(0.0, f64::max))
    }

    fn close(a: RowStats, b: RowStats) -> bool {
        a.0 == b.0 && (a.1 - b.1).abs() < 1e-6 && (a.2 - b.2).abs() < 1e-6
    }

    #[test]
    fn row_stats_match_the_definition() {
        let rows: [&[f32]; 5] =
            [&[0.0, 1.0, 2.0, 3.0], &[5.0, 5.0, -1.0], &[-30.0, 10.0, 9.5, -2.0, 0.0], &[7.0], &[-1.0, 4.0, 4.0, 4.0]];
        for row in rows {
            assert!(close(row_stats(row), reference(row)), "{row:?}");
        }
        assert_eq!(row_stats(&[5.0, 5.0, -1.0]).0, 0, "ties go to the lowest id");
        assert!(row_stats(&[0.5, f32::NAN, 1.0]).1.is_nan(), "a NaN logit makes the entropy NaN");
    }

    #[test]
    fn argmax_is_the_scalar_definition() {
        // ties (the first wins), signed zeros, infinities, NaNs, every length around the 16-value rounds
        let mut seed = 12345u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let specials = [0.0f32, -0.0, 3.0, -3.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN];
        for n in (1..80).chain([151_936, 152_064]) {
            for trial in 0..12 {
                let row: Vec<f32> = (0..n)
                    .map(|_| match next() % 8 {
                        0 if trial % 3 == 0 => specials[(next() % 9) as usize],
                        1 | 2 => 3.0,
                        _ => (next() % 1000) as f32 / 100.0 - 5.0,
                    })
                    .collect();
                assert_eq!(argmax(&row), argmax_scalar(&row), "n {n} trial {trial}");
                let zeros: Vec<f32> = (0..n).map(|i| if next() % 2 == 0 || i == 0 { -0.0 } else { 0.0 }).collect();
                assert_eq!(argmax(&zeros), argmax_scalar(&zeros));
                let low = vec![f32::NEG_INFINITY; n];
                assert_eq!(argmax(&low), 0);
            }
        }
    }

    #[test]
    fn host_rows_are_each_rows_stats_in_place() {
        // the rows read in place (no copy) and split across the pool: the same bits as one row at a time
        let (r, v) = (9, 30_011);
        let flat: Vec<f32> = (0..r * v).map(|i| (i * 104_729 % 7919) as f32 / 500.0 - 8.0).collect();
        let one: Vec<RowStats> = flat.chunks_exact(v).map(row_stats).collect();
        let t = Tensor::from_vec(flat.clone(), (r, v), &Device::Cpu).unwrap();
        for got in [host_rows(&flat, v), rows(&t).unwrap(), rows(&t.narrow(0, 2, 5).unwrap()).unwrap()] {
            let want = if got.len() == r { &one[..] } else { &one[2..7] };
            assert_eq!(got.len(), want.len());
            for (a, b) in got.iter().zip(want) {
                assert!(a.0 == b.0 && a.1.to_bits() == b.1.to_bits() && a.2.to_bits() == b.2.to_bits());
            }
        }
    }

    #[test]
    fn rows_of_a_tensor_in_any_dtype_are_each_rows_stats() {
        // a vocabulary-sized row count so that the parallel path runs too
        let (r, v) = (6, 20_011);
        let flat: Vec<f32> = (0..r * v).map(|i| ((i * 7919 % 1000) as f32 / 100.0 - 5.0) * ((i % 3) as f32)).collect();
        let t = Tensor::from_vec(flat.clone(), (r, v), &Device::Cpu).unwrap();
        let got = rows(&t).unwrap();
        assert_eq!(got.len(), r);
        for (i, s) in got.iter().enumerate() {
            assert!(close(*s, reference(&flat[i * v..(i + 1) * v])), "row {i}");
        }
        // bf16 logits: the stats of their f32 values
        let b = t.to_dtype(DType::BF16).unwrap();
        let as_f32 = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, s) in rows(&b).unwrap().iter().enumerate() {
            assert!(close(*s, reference(&as_f32[i * v..(i + 1) * v])), "bf16 row {i}");
        }
        assert!(rows(&Tensor::zeros((0, 5), DType::F32, &Device::Cpu).unwrap()).unwrap().is_empty());
    }
}

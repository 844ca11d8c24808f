//! What a decode step reads from each logits row: the argmax (ties -> lowest id), the entropy
//! and the max probability of softmax(row). One rule, run where the logits are: on the host, two passes per row
//! (`row_stats`); on a CUDA device, one kernel launch over every row (`kernels.cu`'s `mbd_row_stats_*`, the same
//! two passes per row: terms in f32, sums in f64) and one copy of three numbers per row back to the host, so that
//! the logits never leave the GPU on the greedy path.

use crate::error::Result;
use crate::kernels::cuda;
use candle_core::{DType, Tensor};
use rayon::prelude::*;

/// (argmax, entropy, max probability) of one row.
pub type RowStats = (u32, f64, f64);

/// One row's argmax (ties -> lowest id), entropy and max probability of softmax(row), in two passes: the max, then Z =
/// Σ e^(x - m) and S = Σ e^(x - m)(x - m) ([`vmath::softmax_sums`](crate::kernels::vmath::softmax_sums): terms in f32,
/// sums in f64), so that H = -Σ p log p = ln Z - S / Z and max p = 1 / Z. A NaN anywhere (or an infinite logit) makes
/// the entropy NaN, which the sampler reports as broken logits.
pub fn row_stats(row: &[f32]) -> RowStats {
    let mut best = 0usize;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    let (z, sum) = crate::kernels::vmath::softmax_sums(row, row[best]);
    (best as u32, z.ln() - sum / z, 1.0 / z)
}

/// `row_stats` of each of `rows` rows of `v` values in `flat` (host memory), rows in parallel on the calling pool
/// when there is enough work (a full vocabulary).
pub fn host_rows(flat: &[f32], v: usize) -> Vec<RowStats> {
    let rows: Vec<&[f32]> = flat.chunks_exact(v.max(1)).collect();
    if rows.len() > 1 && flat.len() >= 1 << 16 {
        rows.par_iter().map(|row| row_stats(row)).collect()
    } else {
        rows.iter().map(|row| row_stats(row)).collect()
    }
}

/// `row_stats` of every row of `logits` (R, V), on the device that holds them: mbd-rs's kernel on a CUDA device
/// (f32 / bf16 / f16 logits read as they are; R × 3 f64 come back), the host otherwise (the rows copied as f32).
pub fn rows(logits: &Tensor) -> Result<Vec<RowStats>> {
    let (r, v) = logits.dims2()?;
    if r == 0 {
        return Ok(vec![]);
    }
    if v > 0 && cuda::runs_on(logits.device(), logits.dtype()) {
        let out = cuda::row_stats(logits)?.flatten_all()?.to_vec1::<f64>()?;
        return Ok(out.chunks_exact(3).map(|s| (s[0] as u32, s[1], s[2])).collect());
    }
    let flat = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(host_rows(&flat, v))
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

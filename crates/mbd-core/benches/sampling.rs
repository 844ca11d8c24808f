//! Per-step predictions (argmax, entropy, max probability) from logits rows on the CPU: the host path
//! `Sampler::predict` takes there (two passes per row, `kernels::stats`) against the same statistics in candle's
//! tensor ops (log-softmax, exp, product, sums, max, argmax: the path GPUs took before mbd-rs's row-statistics
//! kernel), side by side. Then the host path against the one before it (the logits copied out of the tensor, the
//! argmax by the scalar loop), interleaved call by call, for a W=32 window and a 512-row canvas of a 151936
//! vocabulary, the same bits checked.
//!
//!     cargo bench -p mbd-core --bench sampling

use candle_core::{Device, Tensor, D};
use mbd_core::decode::sampling::{Sampler, SamplingParams};
use mbd_core::kernels::{stats, vmath};
use rayon::prelude::*;

mod common;
use common::median;

/// (argmax, entropy) of each row in candle's tensor ops.
fn tensor_ops(logits: &Tensor) -> Vec<(u32, f64)> {
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1).unwrap();
    let h = (lsm.exp().unwrap() * &lsm).unwrap().sum(D::Minus1).unwrap().neg().unwrap().to_vec1::<f32>().unwrap();
    let _max = lsm.max(D::Minus1).unwrap().to_vec1::<f32>().unwrap();
    let t = logits.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
    t.into_iter().zip(h).map(|(t, h)| (t, h as f64)).collect()
}

fn main() {
    mbd_core::cpu_pool::pin_thread_count();
    let mut s = Sampler::new(SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(0) });
    println!("{:>6} {:>7} {:>12} {:>14} {:>7}", "rows", "vocab", "host ms", "tensor-op ms", "ratio");
    for (r, v) in [(2usize, 100usize), (8, 100), (2, 151936), (8, 151936), (32, 151936)] {
        let logits = Tensor::randn(0f32, 3.0, (r, v), &Device::Cpu).unwrap();
        let reps = if v > 10_000 { 21 } else { 501 };
        let (mut a, mut b) = (vec![], vec![]);
        for _ in 0..reps {
            let t = std::time::Instant::now();
            let p = mbd_core::cpu_pool::on_cpu_pool(|| s.predict(&logits)).unwrap();
            a.push(t.elapsed().as_secs_f64() * 1e3);
            let t = std::time::Instant::now();
            let q = mbd_core::cpu_pool::on_cpu_pool(|| tensor_ops(&logits));
            b.push(t.elapsed().as_secs_f64() * 1e3);
            for (x, y) in p.iter().zip(&q) {
                assert_eq!(x.token, y.0);
                assert!((x.entropy - y.1).abs() < 1e-3 * (1.0 + y.1));
            }
        }
        let (ha, hb) = (median(a), median(b));
        println!("{r:>6} {v:>7} {ha:>12.4} {hb:>14.4} {:>7.2}", ha / hb);
    }
    // the host path before: a copy of the rows, then per row the scalar argmax and the sums
    let before = |logits: &Tensor| -> Vec<stats::RowStats> {
        let v = logits.dim(1).unwrap();
        let flat = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let one = |row: &[f32]| {
            let best = stats::argmax_scalar(row);
            let (z, sum) = vmath::softmax_sums(row, row[best]);
            (best as u32, z.ln() - sum / z, 1.0 / z)
        };
        flat.par_chunks_exact(v).map(one).collect()
    };
    println!("\n{:>6} {:>7} {:>12} {:>12} {:>8}", "rows", "vocab", "before ms", "now ms", "now/bef");
    for (r, v) in [(1usize, 151936usize), (32, 151936), (512, 151936)] {
        let logits = Tensor::randn(0f32, 3.0, (r, v), &Device::Cpu).unwrap();
        let reps = if r > 100 { 11 } else { 41 };
        let (mut a, mut b) = (vec![], vec![]);
        for _ in 0..reps {
            let t = std::time::Instant::now();
            let old = mbd_core::cpu_pool::on_cpu_pool(|| before(&logits));
            a.push(t.elapsed().as_secs_f64() * 1e3);
            let t = std::time::Instant::now();
            let new = mbd_core::cpu_pool::on_cpu_pool(|| s.predict(&logits)).unwrap();
            b.push(t.elapsed().as_secs_f64() * 1e3);
            for (x, y) in new.iter().zip(&old) {
                assert!(
                    x.token == y.0 && x.entropy.to_bits() == y.1.to_bits() && x.max_prob.to_bits() == y.2.to_bits()
                );
            }
        }
        let (ha, hb) = (median(a), median(b));
        println!("{r:>6} {v:>7} {ha:>12.3} {hb:>12.3} {:>8.3}", hb / ha);
    }
}

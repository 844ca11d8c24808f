//! Per-step predictions (argmax, entropy, max probability) from logits rows on the CPU: the host path
//! `Sampler::predict` takes there (two passes per row) against the tensor-op path GPUs take, side by side.
//!
//!     cargo bench -p mbd-core --bench sampling

use candle_core::{Device, Tensor};
use mbd_core::decode::sampling::{Sampler, SamplingParams};

#[path = "common.rs"]
mod common;
use common::median;

fn main() {
    mbd_core::cpu_pool::pin_thread_count();
    let mut s = Sampler::new(SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: Some(0) });
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
            let q = mbd_core::cpu_pool::on_cpu_pool(|| s.predict_on_device(&logits)).unwrap();
            b.push(t.elapsed().as_secs_f64() * 1e3);
            for (x, y) in p.iter().zip(&q) {
                assert_eq!(x.token, y.token);
                assert!((x.entropy - y.entropy).abs() < 1e-3 * (1.0 + y.entropy));
            }
        }
        let (ha, hb) = (median(a), median(b));
        println!("{r:>6} {v:>7} {ha:>12.4} {hb:>14.4} {:>7.2}", ha / hb);
    }
}

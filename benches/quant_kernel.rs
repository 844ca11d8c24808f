//! x · Wᵀ on the CPU for the row counts of decode windows: bf16-held weights against q8_0 and q4_k (issue #18),
//! all through the skinny kernel, interleaved (rounds alternate the formats), on the Qwen2.5-0.5B shapes. For
//! one row the weight bytes streamed per second are printed too (a one-row product is bandwidth-bound).
//!
//!     cargo bench -p mbd-core --bench quant_kernel

use candle_core::{DType, Device, Tensor};
use mbd_core::quant::{QMatrix, QuantFormat};
use mbd_core::skinny::{linear, linear_q, Kernels};

#[path = "common.rs"]
mod common;
use common::median;

fn main() {
    mbd_core::cpu_pool::on_cpu_pool(run)
}

fn run() {
    let threads = mbd_core::cpu_pool::pin_thread_count();
    let dev = Device::Cpu;
    let kn = Kernels::default();
    println!("{threads} threads; ms (median), GB/s of weights for one row");
    println!(
        "{:>18} {:>4} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7}",
        "W (n x k)", "rows", "bf16", "q8_0", "q4_k", "q8/bf", "q4/bf", "GB/s q8", "GB/s bf"
    );
    for (n, k, name) in
        [(4864usize, 896usize, "gate/up 4864x896"), (896, 4864, "down 896x4864"), (151936, 896, "head 151936x896")]
    {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let q8 = QMatrix::quantize(&w, QuantFormat::Q8_0).unwrap();
        let q4 = if k % 256 == 0 { Some(QMatrix::quantize(&w, QuantFormat::Q4K).unwrap()) } else { None };
        for m in [1usize, 2, 4, 8, 16, 32, 64] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let reps = if n > 100_000 { 9 } else { 61 };
            let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
            for _ in 0..reps {
                let t = std::time::Instant::now();
                linear(&x, &w, &kn, true).unwrap();
                a.push(t.elapsed().as_secs_f64() * 1e3);
                let t = std::time::Instant::now();
                linear_q(&x, &q8, &kn, true).unwrap();
                b.push(t.elapsed().as_secs_f64() * 1e3);
                if let Some(q4) = &q4 {
                    let t = std::time::Instant::now();
                    linear_q(&x, q4, &kn, true).unwrap();
                    c.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            let (ta, tb) = (median(a), median(b));
            let tc = if c.is_empty() { f64::NAN } else { median(c) };
            let gbs =
                |bytes: usize, ms: f64| if m == 1 { format!("{:.1}", bytes as f64 / ms / 1e6) } else { "".into() };
            println!(
                "{name:>18} {m:>4} {ta:>9.3} {tb:>9.3} {tc:>9.3} {:>7.2} {:>7.2} {:>7} {:>7}",
                tb / ta,
                tc / ta,
                gbs(q8.bytes().len(), tb),
                gbs(n * k * 2, ta)
            );
        }
    }
}

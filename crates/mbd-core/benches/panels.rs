//! x · Wᵀ for many-row x on the CPU (a prefill chunk), f32 out: candle's matmul (f32 W; bf16 W widened per call)
//! against `mbd_core::kernels::panels` (bf16 and f32 W), side by side on the Qwen2.5-0.5B shapes. Prints the median of
//! repeated runs in ms and GFLOP/s.
//!
//!     cargo bench -p mbd-core --bench panels

use candle_core::{DType, Device, Tensor};
use mbd_core::kernels::Kernels;
use mbd_core::net::linear::linear;

mod common;
use common::median;

fn main() {
    mbd_core::cpu_pool::on_cpu_pool(run)
}

fn run() {
    let threads = mbd_core::cpu_pool::pin_thread_count();
    let dev = Device::Cpu;
    println!("{threads} threads; median ms (GFLOP/s)");
    println!(
        "{:>22} {:>5} {:>16} {:>16} {:>16} {:>16}",
        "W (n x k)", "rows", "candle f32", "candle bf16", "panels f32", "panels bf16"
    );
    let shapes = [
        (896usize, 896usize, "q/o 896x896"),
        (4864, 896, "gate/up 4864x896"),
        (896, 4864, "down 896x4864"),
        (151936, 896, "head 151936x896"),
    ];
    let candle = Kernels { skinny: false, panels: false, ..Kernels::default() };
    let panels = Kernels::default();
    for (n, k, name) in shapes {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap();
        let wb = w.to_dtype(DType::BF16).unwrap();
        for m in [128usize, 512] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let reps = if n > 100_000 { 5 } else { 21 };
            let mut t = [vec![], vec![], vec![], vec![]];
            for _ in 0..reps {
                for (i, (w, kn)) in
                    [(&w, &candle), (&wb, &candle), (&w, &panels), (&wb, &panels)].into_iter().enumerate()
                {
                    let s = std::time::Instant::now();
                    std::hint::black_box(linear(&x, w, kn, false).unwrap());
                    t[i].push(s.elapsed().as_secs_f64() * 1e3);
                }
            }
            let gf = |ms: f64| 2.0 * (m * n * k) as f64 / ms / 1e6;
            let cell = |v: &mut Vec<f64>| {
                let ms = median(std::mem::take(v));
                format!("{ms:8.2} ({:5.1})", gf(ms))
            };
            let [a, b, c, d] = &mut t;
            println!("{name:>22} {m:>5} {:>16} {:>16} {:>16} {:>16}", cell(a), cell(b), cell(c), cell(d));
        }
    }
}

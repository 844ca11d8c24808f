//! x · Wᵀ for few-row x on the CPU, f32: candle's matmul (gemm) against the skinny kernel
//! (`mbd_core::kernels::skinny`), side by side on the Qwen2.5-0.5B shapes, for the row counts a decode window has.
//! Prints the median of repeated runs and the ratio; the weights are 4x the size of the last-level cache
//! apart for the head, so the MLP shapes show cache-warm speed and the head shows memory-bound speed.
//!
//!     cargo bench -p mbd-core --bench skinny

use candle_core::{Device, Tensor};

mod common;
use common::median;

fn main() {
    // on the engine's pool, as in a forward (calling into a pool from outside costs a cross-thread wake-up)
    mbd_core::cpu_pool::on_cpu_pool(run)
}

fn run() {
    let threads = mbd_core::cpu_pool::pin_thread_count();
    let dev = Device::Cpu;
    println!("{threads} threads; times in ms (median)");
    println!("{:>22} {:>4} {:>10} {:>10} {:>7}", "W (n x k)", "rows", "gemm", "skinny", "ratio");
    let shapes = [
        (576usize, 192usize, "tiny gate/up 576x192"),
        (192, 192, "tiny q/o 192x192"),
        (4864, 896, "gate/up 4864x896"),
        (896, 4864, "down 896x4864"),
        (151936, 896, "head 151936x896"),
    ];
    for (n, k, name) in shapes {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap();
        for m in [1usize, 2, 4, 8, 12, 16, 32, 64] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let reps = if n > 100_000 {
                7
            } else if n * k < 1 << 20 {
                401
            } else {
                41
            };
            let (mut a, mut b) = (vec![], vec![]);
            for _ in 0..reps {
                let t = std::time::Instant::now();
                let y1 = x.matmul(&w.t().unwrap()).unwrap();
                a.push(t.elapsed().as_secs_f64() * 1e3);
                let t = std::time::Instant::now();
                let y2 = x
                    .apply_op2_no_bwd(
                        &w,
                        &mbd_core::net::linear::DenseMatmulT {
                            par_min_macs: mbd_core::kernels::Kernels::default().par_min_macs,
                            panels: false,
                            avx512: true,
                        },
                    )
                    .unwrap();
                b.push(t.elapsed().as_secs_f64() * 1e3);
                let d = (y1 - y2).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-3, "results differ by {d}");
            }
            let (ga, sb) = (median(a), median(b));
            println!("{name:>22} {m:>4} {ga:>10.3} {sb:>10.3} {:>7.2}", sb / ga);
        }
    }
}

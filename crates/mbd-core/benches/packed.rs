//! x · Wᵀ for decode windows on the CPU (bf16 W, f32 out): the few-row kernel (`skinny`, W row-major, lane-wise
//! partial sums) against the packed product on W packed once at load (`panels::PackedMatrix`, an in-order FMA chain
//! per element), alternating call by call, on the tiny model's and the Qwen2.5-0.5B shapes, for the row counts of
//! decode windows; the packed product with its AVX2 tiles and, where the CPU has AVX-512, its AVX-512 tiles (the
//! same bits). Prints the median ms of each, GFLOP/s and the ratios packed / few-row.
//!
//!     cargo bench -p mbd-core --bench packed

use candle_core::{DType, Device, Tensor};
use mbd_core::kernels::panels::{matmul_t_with, PackedMatrix, Source};
use mbd_core::kernels::Kernels;
use mbd_core::net::linear::DenseMatmulT;

mod common;
use common::median;

fn main() {
    // on the engine's pool, as in a forward
    mbd_core::cpu_pool::on_cpu_pool(run)
}

fn run() {
    let threads = mbd_core::cpu_pool::pin_thread_count();
    let dev = Device::Cpu;
    let only: Option<String> = std::env::var("MBD_BENCH_SHAPES").ok();
    println!("{threads} threads; median ms (GFLOP/s), bf16 W");
    println!(
        "{:>24} {:>4} {:>16} {:>16} {:>16} {:>6} {:>6}",
        "W (n x k)", "rows", "few-row", "packed, AVX2", "packed, AVX-512", "/few", "/few"
    );
    let shapes = [
        (384usize, 256usize, "tiny qkv 384x256"),
        (1280, 256, "tiny gate/up 1280x256"),
        (256, 640, "tiny down 256x640"),
        (1152, 896, "0.5B qkv 1152x896"),
        (9728, 896, "0.5B gate/up 9728x896"),
        (896, 4864, "0.5B down 896x4864"),
        (151936, 896, "0.5B head 151936x896"),
        (248320, 1024, "q35 head 248320x1024"),
        (6144, 1024, "q35 qkv 6144x1024"),
        (7168, 1024, "q35 gate/up 7168x1024"),
        (1024, 3584, "q35 down 1024x3584"),
    ];
    let par = Kernels::default().par_min_macs;
    for (n, k, name) in shapes {
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let p = PackedMatrix::from_tensor(&w).unwrap().expect("this CPU has the packed product");
        for m in [1usize, 2, 3, 4, 6, 8, 12, 16, 32, 64] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let macs = m * n * k;
            let reps = (3e9 / macs as f64).clamp(5.0, 801.0) as usize;
            let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
            for _ in 0..reps {
                let t = std::time::Instant::now();
                std::hint::black_box(
                    x.apply_op2_no_bwd(&w, &DenseMatmulT { par_min_macs: par, panels: false, avx512: true }).unwrap(),
                );
                a.push(t.elapsed().as_secs_f64() * 1e3);
                for (wide, v) in [(false, &mut b), (true, &mut c)] {
                    let t = std::time::Instant::now();
                    std::hint::black_box(matmul_t_with(&xv, m, k, Source::Packed(&p), n, par, wide));
                    v.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            let (ta, tb, tc) = (median(a), median(b), median(c));
            let gf = |ms: f64| 2.0 * macs as f64 / ms / 1e6;
            println!(
                "{name:>24} {m:>4} {:>8.3} ({:5.1}) {:>8.3} ({:5.1}) {:>8.3} ({:5.1}) {:>6.2} {:>6.2}",
                ta,
                gf(ta),
                tb,
                gf(tb),
                tc,
                gf(tc),
                tb / ta,
                tc / ta
            );
        }
    }
}

//! x · Wᵀ on the CPU for the row counts of decode windows: bf16-held weights against every block format the kernel
//! multiplies (q8_0, q6_k, q5_k, q5_0, q4_k, q4_0, q3_k, q2_k: the quantized formats), all through the skinny kernel,
//! interleaved (each repetition runs every format in turn), on the Qwen2.5-0.5B shapes and the Qwen3-1.7B MLP's.
//! For one row the weight bytes streamed per second are printed too (a one-row product is bandwidth-bound; the last
//! columns, under each format's name). The k-quants need rows of whole 256-value super-blocks ("-" where they do not
//! split).
//!
//!     cargo bench -p mbd-core --bench quant_kernel
//!     MBD_BENCH_ROWS=1,2 cargo bench -p mbd-core --bench quant_kernel     # only these row counts (e.g. for perf)
//!     MBD_BENCH_FORMATS=q8_0,q5_0,q4_k cargo bench -p mbd-core --bench quant_kernel    # only these formats
//!
//! `MBD_BENCH_PACKED=1`: every matrix held as the engine holds it on this CPU (`Matrix::dense` / `Matrix::quant`
//! with packing: bf16 and every format packed at load where the CPU has the packed product).
//! `MBD_BENCH_PACKED=ab`: both, interleaved: bf16 and each format packed at load, and each format held in its
//! blocks too (the `.b` columns).
//! `MBD_BENCH_PACKED=int8`: bf16 and each format packed at load, and each format held for integer dot products on
//! 8-bit activations too (`Matrix::quant_int8`, the `int8_activations` load option: the `.i8` columns).

use candle_core::{DType, Device, Tensor};
use mbd_core::kernels::blocks::{QMatrix, QuantFormat};
use mbd_core::kernels::Kernels;
use mbd_core::net::linear::Matrix;

mod common;
use common::median;

const FORMATS: [QuantFormat; 8] = [
    QuantFormat::Q8_0,
    QuantFormat::Q6K,
    QuantFormat::Q5K,
    QuantFormat::Q5_0,
    QuantFormat::Q4K,
    QuantFormat::Q4_0,
    QuantFormat::Q3K,
    QuantFormat::Q2K,
];

/// How a format's matrix is held: packed at load, in its blocks, or for integer dot products.
#[derive(Clone, Copy, PartialEq)]
enum Hold {
    Packed,
    Blocks,
    Int8,
}

fn main() {
    mbd_core::cpu_pool::on_cpu_pool(run)
}

fn run() {
    let threads = mbd_core::cpu_pool::pin_thread_count();
    let dev = Device::Cpu;
    let kn = Kernels::default();
    let rows: Vec<usize> = match std::env::var("MBD_BENCH_ROWS") {
        Ok(v) => v.split(',').map(|r| r.trim().parse().expect("MBD_BENCH_ROWS: row counts, e.g. 1,2,4")).collect(),
        Err(_) => vec![1, 2, 4, 8, 16, 32, 64],
    };
    let formats: Vec<QuantFormat> = match std::env::var("MBD_BENCH_FORMATS") {
        Ok(v) => {
            v.split(',').map(|f| QuantFormat::parse(f.trim()).expect("MBD_BENCH_FORMATS: e.g. q8_0,q4_k")).collect()
        }
        Err(_) => FORMATS.to_vec(),
    };
    let packed = std::env::var("MBD_BENCH_PACKED").unwrap_or_default();
    let pack = matches!(packed.as_str(), "1" | "ab" | "int8");
    // (the format, how it is held): every column of the table
    let second = match packed.as_str() {
        "ab" => Some(Hold::Blocks),
        "int8" => Some(Hold::Int8),
        _ => None,
    };
    let formats: Vec<(QuantFormat, Hold)> = formats
        .iter()
        .map(|&f| (f, if pack { Hold::Packed } else { Hold::Blocks }))
        .chain(second.into_iter().flat_map(|h| formats.iter().map(move |&f| (f, h))))
        .collect();
    let label = |&(f, h): &(QuantFormat, Hold)| match h {
        Hold::Blocks if pack => format!("{}.b", f.name()),
        Hold::Int8 => format!("{}.i8", f.name()),
        _ => f.name().to_string(),
    };
    println!("{threads} threads; ms (median), each format's time over bf16's, GB/s of weights for one row");
    print!("{:>22} {:>4} {:>8}", "W (n x k)", "rows", "bf16");
    for f in &formats {
        print!(" {:>8} {:>6}", label(f), "/bf16");
    }
    print!(" {:>7}", "GB/s bf");
    for f in &formats {
        print!(" {:>7}", label(f));
    }
    println!();
    for (n, k, name) in [
        (4864usize, 896usize, "gate/up 4864x896"),
        (896, 4864, "down 896x4864"),
        (151936, 896, "head 151936x896"),
        (6144, 2048, "1.7B gate/up 6144x2048"),
        (2048, 6144, "1.7B down 2048x6144"),
    ] {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        // (matrix, its bytes in the format's blocks)
        let qs: Vec<Option<(Matrix, usize)>> = formats
            .iter()
            .map(|&(f, hold)| {
                k.is_multiple_of(f.block_values()).then(|| {
                    let q = QMatrix::quantize(&w, f).unwrap();
                    let bytes = q.bytes().len();
                    let m = match hold {
                        Hold::Int8 => Matrix::quant_int8(q, true),
                        h => Matrix::quant(q, h == Hold::Packed),
                    };
                    (m.unwrap(), bytes)
                })
            })
            .collect();
        let w = Matrix::dense(w, pack).unwrap();
        for m in rows.iter().copied() {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let reps = if n > 100_000 { 9 } else { 61 };
            let mut times = vec![vec![]; 1 + formats.len()];
            for _ in 0..reps {
                let t = std::time::Instant::now();
                w.linear(&x, &kn, true).unwrap();
                times[0].push(t.elapsed().as_secs_f64() * 1e3);
                for (i, q) in qs.iter().enumerate() {
                    if let Some((q, _)) = q {
                        let t = std::time::Instant::now();
                        q.linear(&x, &kn, true).unwrap();
                        times[i + 1].push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            let ms: Vec<Option<f64>> = times.into_iter().map(|t| (!t.is_empty()).then(|| median(t))).collect();
            let bf = ms[0].unwrap();
            print!("{name:>22} {m:>4} {bf:>8.3}");
            for t in &ms[1..] {
                match t {
                    Some(t) => print!(" {t:>8.3} {:>6.2}", t / bf),
                    None => print!(" {:>8} {:>6}", "-", "-"),
                }
            }
            let gbs = |bytes: usize, t: Option<f64>| match t {
                Some(t) if m == 1 => format!("{:.1}", bytes as f64 / t / 1e6),
                _ => "".into(),
            };
            print!(" {:>7}", gbs(n * k * 2, ms[0]));
            for (q, t) in qs.iter().zip(&ms[1..]) {
                print!(" {:>7}", gbs(q.as_ref().map_or(0, |q| q.1), *t));
            }
            println!();
        }
    }
}

//! One decode forward of a W-token block over a committed prefix, on a Qwen2.5-0.5B-shaped random checkpoint
//! (make it with `python scripts/make_bench_model.py`, add `--bf16` for a bf16 one), on the CPU. Median of
//! repeated runs, no extra crates. Side by side in one run (interleaved per case):
//! - the default engine (skinny kernel; a bf16 checkpoint's matrices held as bf16),
//! - for a bf16 checkpoint, the same with the matrices widened to f32 at load,
//! - candle's matmul only, on f32-held weights (the engine before the skinny kernel).
//!
//!     MBD_BENCH_MODEL=/tmp/mbd-bench/qwen2.5-0.5b-shape cargo bench -p mbd-core --bench forward

use mbd_core::skinny::Kernels;
use mbd_core::{LoadOptions, Model};

fn load(dir: &str, opts: LoadOptions) -> Model {
    match Model::load(std::path::Path::new(dir), &opts) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cannot load {dir}: {e}\nrun: python scripts/make_bench_model.py {dir}");
            std::process::exit(1);
        }
    }
}

fn main() {
    mbd_core::cpu_pool::pin_thread_count();
    let dir = std::env::var("MBD_BENCH_MODEL").unwrap_or_else(|_| "/tmp/mbd-bench/qwen2.5-0.5b-shape".into());
    let reps: usize = std::env::var("MBD_BENCH_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let model = load(&dir, LoadOptions::default());
    let f32_held_opts = LoadOptions { keep_bf16_weights: false, ..Default::default() };
    let bf16 = model.profile.stored_dtype.as_deref() == Some("bfloat16");
    let f32_twin = bf16.then(|| load(&dir, f32_held_opts.clone()));
    // candle's matmul only, on f32-held weights (the weights are loaded once more with the kernel off)
    let gemm_only =
        load(&dir, LoadOptions { kernels: Kernels { skinny: false, ..Default::default() }, ..f32_held_opts });
    println!(
        "model {dir}: {} parameters, weights held {:.1} MiB, {} threads",
        model.num_parameters,
        model.weight_bytes as f64 / 1048576.0,
        candle_core::utils::get_num_threads()
    );
    println!(
        "{:>7} {:>4} {:>10} {:>10} {:>14} {:>14} {:>7}",
        "prefix", "W", "median ms", "min ms", "f32-held ms", "gemm-only ms", "ratio"
    );
    let median = |mut t: Vec<f64>| {
        t.remove(0); // warm-up
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        (t[t.len() / 2] * 1e3, t[0] * 1e3)
    };
    for prefix in [0usize, 512, 2048] {
        for w in [1usize, 4, 16, 32, 64] {
            let (med, min) = median(model.bench_forward(prefix, w, reps + 1, false).expect("forward"));
            let held = match &f32_twin {
                Some(m) => format!("{:.2}", median(m.bench_forward(prefix, w, reps + 1, false).expect("forward")).0),
                None => "-".into(),
            };
            let (gemm, _) = median(gemm_only.bench_forward(prefix, w, reps + 1, false).expect("forward"));
            println!("{prefix:>7} {w:>4} {med:>10.2} {min:>10.2} {held:>14} {gemm:>14.2} {:>7.2}", med / gemm);
        }
    }
}

//! One decode forward of a W-token block over a committed prefix, on a Qwen2.5-0.5B-shaped random checkpoint
//! (make it with `python scripts/make_bench_model.py`, add `--bf16` for a bf16 one), on the CPU. Median of
//! repeated runs, no extra crates. Side by side in one run (interleaved per case):
//! - the default engine (skinny kernel; a bf16 checkpoint's matrices held as bf16),
//! - for a bf16 checkpoint, the same with the matrices widened to f32 at load,
//! - candle's matmul only, on f32-held weights (the engine before the skinny kernel).
//!
//!     MBD_BENCH_MODEL=/tmp/mbd-bench/qwen2.5-0.5b-shape cargo bench -p mbd-core --bench forward
//!
//! `MBD_BENCH_QUANTIZE=q4_k` (any `quantize` format): time only that engine, the matrices quantized at load (no
//! twins); `MBD_BENCH_CASES=0:1,512:1` picks the prefix:window cases (for perf, e.g. one W = 1 forward).

use mbd_core::kernels::blocks::QuantFormat;
use mbd_core::kernels::Kernels;
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
    let quantize = std::env::var("MBD_BENCH_QUANTIZE")
        .ok()
        .map(|f| QuantFormat::parse(&f).expect("MBD_BENCH_QUANTIZE: a quantize format, e.g. q8_0 or q4_k"));
    let cases: Vec<(usize, usize)> = match std::env::var("MBD_BENCH_CASES") {
        Ok(v) => v
            .split(',')
            .map(|c| {
                let (p, w) = c.trim().split_once(':').expect("MBD_BENCH_CASES: prefix:window pairs, e.g. 0:1,512:4");
                (p.parse().expect("MBD_BENCH_CASES: prefix"), w.parse().expect("MBD_BENCH_CASES: window"))
            })
            .collect(),
        Err(_) => [0usize, 512, 2048].into_iter().flat_map(|p| [1usize, 4, 16, 32, 64].map(|w| (p, w))).collect(),
    };
    let model = load(&dir, LoadOptions { quantize, ..Default::default() });
    let f32_held_opts = LoadOptions { keep_bf16_weights: false, ..Default::default() };
    let bf16 = model.profile.stored_dtype.as_deref() == Some("bfloat16");
    let twins = quantize.is_none();
    let f32_twin = (bf16 && twins).then(|| load(&dir, f32_held_opts.clone()));
    // candle's matmul only, on f32-held weights (the weights are loaded once more with the kernel off)
    let gemm_only = twins
        .then(|| load(&dir, LoadOptions { kernels: Kernels { skinny: false, ..Default::default() }, ..f32_held_opts }));
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
    for (prefix, w) in cases {
        let (med, min) = median(model.bench_forward(prefix, w, reps + 1, false).expect("forward"));
        let held = match &f32_twin {
            Some(m) => format!("{:.2}", median(m.bench_forward(prefix, w, reps + 1, false).expect("forward")).0),
            None => "-".into(),
        };
        let (gemm, ratio) = match &gemm_only {
            Some(m) => {
                let (g, _) = median(m.bench_forward(prefix, w, reps + 1, false).expect("forward"));
                (format!("{g:.2}"), format!("{:.2}", med / g))
            }
            None => ("-".into(), "-".into()),
        };
        println!("{prefix:>7} {w:>4} {med:>10.2} {min:>10.2} {held:>14} {gemm:>14} {ratio:>7}");
    }
}

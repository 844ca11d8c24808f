//! One decode forward of a W-token block over a committed prefix, on a Qwen2.5-0.5B-shaped random checkpoint
//! (make it with `python scripts/make_bench_model.py`), f32 on CPU. Median of repeated runs, no extra crates.
//! Each case runs with the skinny kernel and with candle's matmul only (A/B in one run); ratio = skinny / gemm.
//!
//!     MBD_BENCH_MODEL=/tmp/mbd-bench/qwen2.5-0.5b-shape cargo bench -p mbd-core --bench forward

use mbd_core::config::ProfileOverrides;
use mbd_core::Model;

fn main() {
    let dir = std::env::var("MBD_BENCH_MODEL").unwrap_or_else(|_| "/tmp/mbd-bench/qwen2.5-0.5b-shape".into());
    let reps: usize = std::env::var("MBD_BENCH_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    mbd_core::pin_thread_count();
    let dev = candle_core::Device::Cpu;
    let model = match Model::load(std::path::Path::new(&dir), &dev, candle_core::DType::F32, &ProfileOverrides::default()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cannot load {dir}: {e}\nrun: python scripts/make_bench_model.py {dir}");
            std::process::exit(1);
        }
    };
    println!("model {dir}: {} parameters, {} threads", model.num_parameters, candle_core::utils::get_num_threads());
    println!("{:>7} {:>4} {:>10} {:>10} {:>14} {:>7}", "prefix", "W", "median ms", "min ms", "gemm-only ms", "ratio");
    let median = |mut t: Vec<f64>| {
        t.remove(0); // warm-up
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        (t[t.len() / 2] * 1e3, t[0] * 1e3)
    };
    for prefix in [0usize, 512, 2048] {
        for w in [1usize, 4, 16, 32, 64] {
            let (med, min) = median(model.bench_forward(prefix, w, reps + 1).expect("forward"));
            mbd_core::skinny::set_tuning(Some(false), None, None);
            let (gemm, _) = median(model.bench_forward(prefix, w, reps + 1).expect("forward"));
            mbd_core::skinny::set_tuning(Some(true), None, None);
            println!("{prefix:>7} {w:>4} {med:>10.2} {min:>10.2} {gemm:>14.2} {:>7.2}", med / gemm);
        }
    }
}

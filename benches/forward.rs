//! One decode forward of a W-token block over a committed prefix, on a Qwen2.5-0.5B-shaped random checkpoint
//! (make it with `python scripts/make_bench_model.py`), f32 on CPU. Median of repeated runs, no extra crates.
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
    println!("{:>7} {:>4} {:>10} {:>10}", "prefix", "W", "median ms", "min ms");
    for prefix in [0usize, 512, 2048] {
        for w in [1usize, 4, 16, 32, 64] {
            let mut t = model.bench_forward(prefix, w, reps + 1).expect("forward");
            t.remove(0); // warm-up
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!("{prefix:>7} {w:>4} {:>10.2} {:>10.2}", t[t.len() / 2] * 1e3, t[0] * 1e3);
        }
    }
}

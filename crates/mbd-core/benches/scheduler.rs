//! The scheduler alone (no Python): N generations of the same model submitted at once and drained by N reader
//! threads, against the same N run one after another with `Generation::step`; also the time of one batched
//! forward of N one-row segments against N lone ones, for the default kernels and one other choice
//! (`MBD_BENCH_AB`: `packed`, the default: matrices held row-major instead of packed at load; `attention`:
//! candle's attention ops instead of the blocked kernel). Prints tokens/s both ways.
//!
//!     MBD_BENCH_MODEL=python/mbd_rs/models/mbd-tiny cargo bench -p mbd-core --bench scheduler

use mbd_core::generate::generation::Generation;
use mbd_core::generate::scheduler::Scheduler;
use mbd_core::kernels::Kernels;
use mbd_core::params::load::BatchLimits;
use mbd_core::params::request::{GenRequest, ProfileOverrides};
use mbd_core::{LoadOptions, Model};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    mbd_core::cpu_pool::pin_thread_count();
    let dir = std::env::var("MBD_BENCH_MODEL").unwrap_or_else(|_| "python/mbd_rs/models/mbd-tiny".into());
    let overrides = ProfileOverrides { eos_token_ids: Some(vec![]), ..Default::default() };
    let load = |kernels: Kernels| {
        let opts = LoadOptions { overrides: overrides.clone(), kernels, ..Default::default() };
        Arc::new(Model::load(std::path::Path::new(&dir), &opts).unwrap())
    };
    let (other, other_name) = match std::env::var("MBD_BENCH_AB").as_deref() {
        Ok("attention") => (Kernels { blocked_attention: false, ..Default::default() }, "candle attention"),
        _ => (Kernels { packed_weights: false, ..Default::default() }, "row-major weights"),
    };
    let model = load(Kernels::default());
    let other = load(other);
    let v = model.config.vocab_size as u32;
    let prefix: Vec<u32> = std::env::var("MBD_BENCH_PREFIX")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .map(|n| (0..n).map(|i| (i * 13 + 5) % v).collect())
        .unwrap_or_else(|| vec![5, 6, 7, 8, 9, 10, 11, 12]);
    // one forward of N one-row segments against N lone one-row forwards
    let grid = mbd_core::BlockGrid::causal();
    for (n, which) in [1usize, 8, 16].into_iter().flat_map(|n| [(n, true), (n, false)]) {
        let model = if which { &model } else { &other };
        let mut caches: Vec<_> = (0..n).map(|_| model.new_cache().unwrap()).collect();
        for c in caches.iter_mut() {
            model.fill_cache(c, &prefix, &grid).unwrap();
        }
        let ids = [13u32];
        let time = |batched: bool, caches: &mut Vec<mbd_core::net::kv_cache::KvCache>| {
            let t = Instant::now();
            for _ in 0..200 {
                mbd_core::cpu_pool::on_cpu_pool(|| {
                    if batched {
                        let mut segs: Vec<_> = caches
                            .iter_mut()
                            .map(|c| mbd_core::net::segment::Segment {
                                cache: c,
                                ids: &ids,
                                positions: vec![prefix.len()],
                                mask: mbd_core::net::mask::MaskSpec::Grid(grid),
                                rows: vec![0],
                                cancel: None,
                            })
                            .collect();
                        model.forward_segments(&mut segs).unwrap();
                    } else {
                        for c in caches.iter_mut() {
                            model.forward(c, &ids, &grid, Some(&[0]), None).unwrap();
                        }
                    }
                });
            }
            t.elapsed().as_secs_f64() / 200.0 * 1e3
        };
        let (a, b) = (time(false, &mut caches), time(true, &mut caches));
        let kind = if which { "default kernels" } else { other_name };
        println!("forward of {n} one-row segments ({kind}): lone {a:.3} ms, batched {b:.3} ms");
    }
    if std::env::var("MBD_BENCH_FORWARD_ONLY").is_ok() {
        return;
    }
    for (model, kind) in [(&model, "default kernels"), (&other, other_name)] {
        for (name, block) in [("ar", 1usize), ("mb", 4)] {
            for n in [1usize, 2, 4, 8, 16] {
                let req = GenRequest {
                    max_tokens: Some(32),
                    block_size: Some(block),
                    threshold: Some(0.9),
                    ..Default::default()
                };
                let prompts: Vec<Vec<u32>> =
                    (0..n).map(|i| (0..8u32).map(|j| (i as u32 * 7 + j * 3 + 5) % v).collect()).collect();
                let t = Instant::now();
                let mut tokens = 0;
                for p in &prompts {
                    let mut g = Generation::new(model.clone(), p.clone(), &req).unwrap();
                    while let Some(o) = g.step().unwrap() {
                        tokens += o.token_ids.len();
                    }
                }
                let seq = tokens as f64 / t.elapsed().as_secs_f64();
                let sched = Scheduler::new(model.clone(), BatchLimits::default()).unwrap();
                let t = Instant::now();
                let handles: Vec<_> = prompts
                    .iter()
                    .map(|p| sched.submit(Generation::new(model.clone(), p.clone(), &req).unwrap()).unwrap())
                    .collect();
                let total: usize = std::thread::scope(|s| {
                    let ts: Vec<_> = handles
                        .into_iter()
                        .map(|h| s.spawn(move || h.map(|o| o.unwrap().token_ids.len()).sum::<usize>()))
                        .collect();
                    ts.into_iter().map(|t| t.join().unwrap()).sum()
                });
                let bat = total as f64 / t.elapsed().as_secs_f64();
                let (f, segs, rows) = sched.stats();
                println!(
                    "{kind}, {name} N={n:>2}: sequential {seq:>8.1} tok/s, batched {bat:>8.1} tok/s ({:.2}x), {:.2} segments/forward, {rows} rows",
                    bat / seq,
                    segs as f64 / f as f64
                );
            }
        }
    }
}

//! The engine's CPU thread pool: forwards and decoding steps run on it, the caller waiting.

/// Pin candle's CPU thread count for the process (`RAYON_NUM_THREADS`, when the user has not set it) to the
/// number it would detect, and return it. candle looks the count up on every CPU matmul; unset, that
/// re-detects the physical cores each time (on Linux by parsing /proc/cpuinfo), which costs more than a
/// small model's whole matmul (benches/results/cpu-forward.md). Call it once at start-up, before other threads run.
pub fn pin_thread_count() -> usize {
    if let Some(n) = std::env::var("RAYON_NUM_THREADS").ok().and_then(|s| s.parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    let n = candle_core::utils::get_num_threads();
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}

static CPU_POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();

/// Run `f` on the engine's CPU thread pool (`pin_thread_count()` threads), the calling thread waiting.
/// Forwards and decoding steps run this way so that the caller (a Python thread) sleeps while the pool
/// works: the pool's threads are then the only runnable ones, instead of the caller's serial work
/// competing with idle workers that spin for jobs (oversubscription on small machines). candle's matmul
/// (gemm) and the skinny kernel parallelise on the pool they are called from, so they use this one.
/// Re-entrant: called from one of the pool's threads, `f` runs in place.
pub fn on_cpu_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = CPU_POOL.get_or_init(|| {
        let n = pin_thread_count();
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("mbd-cpu-{i}"))
            .build()
            .expect("cannot start the CPU thread pool")
    });
    pool.install(f)
}

/// Run `f` on the CPU pool when `device` is the CPU, in place otherwise (GPU work is queued, not computed, by
/// the calling thread).
pub fn on_device_pool<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() {
        on_cpu_pool(f)
    } else {
        f()
    }
}

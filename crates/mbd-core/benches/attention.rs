//! One layer's attention of a window over its cache on the CPU, Qwen2.5-0.5B heads (14 query heads over 2 kv
//! heads, head_dim 64), causal: candle's ops as the model ran them before `attention::blocked` (per kv head the
//! query heads folded into rows, scores = q · Kᵀ, `scaled_softmax` with the additive mask, · V) against
//! `attention::attend` (the blocked kernel), side by side, alternating. Prints the median in ms and GFLOP/s (the
//! FLOPs of the full rows × keys products, masked ones included, for both).
//!
//!     cargo bench -p mbd-core --bench attention

use candle_core::{Device, Tensor};
use mbd_core::kernels::attention::SegmentKv;
use mbd_core::net::attention::scaled_softmax;
use mbd_core::net::mask::{BlockGrid, MaskSpec};

mod common;
use common::median;

fn main() {
    mbd_core::cpu_pool::on_cpu_pool(run)
}

fn run() {
    let threads = mbd_core::cpu_pool::pin_thread_count();
    let (nh, nkv, d) = (14usize, 2usize, 64usize);
    if !mbd_core::kernels::attention::available(nh, nkv, d) {
        println!("blocked attention is not available on this CPU (needs x86-64 with AVX2 and FMA)");
        return;
    }
    let n_rep = nh / nkv;
    let dev = Device::Cpu;
    let scale = 1.0 / (d as f64).sqrt();
    println!("{threads} threads; median ms (GFLOP/s)");
    println!("{:>6} {:>5} {:>16} {:>16} {:>7}", "cache", "rows", "candle ops", "blocked", "ratio");
    for (p, w) in [(0usize, 512usize), (0, 128), (512, 32), (512, 4), (2048, 8), (2048, 1), (64, 8)] {
        let s = p + w;
        let q = Tensor::randn(0f32, 1.0, (nh, w, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (nkv, s, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (nkv, s, d), &dev).unwrap();
        let spec = MaskSpec::Grid(BlockGrid::causal());
        let positions: Vec<usize> = (p..s).collect();
        let visible = spec.visible(p, &positions);
        let (qv, kv, vv) = (
            q.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let candle = || {
            let mask = spec.additive_rows(p, &positions, 0, w).map(|m| Tensor::from_vec(m, (w, s), &dev).unwrap());
            let att = q.reshape((nkv, n_rep * w, d)).unwrap().matmul(&k.t().unwrap()).unwrap();
            let att = scaled_softmax(&att.reshape((nkv, n_rep, w, s)).unwrap(), scale, mask.as_ref()).unwrap();
            let y = att.reshape((nkv, n_rep * w, s)).unwrap().matmul(&v).unwrap();
            y.reshape((nh, w, d)).unwrap().transpose(0, 1).unwrap().contiguous().unwrap()
        };
        let mut out = vec![0f32; w * nh * d];
        let mut blocked = || {
            let seg = [SegmentKv { k: &kv, v: &vv, capacity: s, row0: 0, visible: &visible }];
            mbd_core::kernels::attention::attend(&qv, w, &seg, nh, nkv, d, scale as f32, &mut out, None).unwrap();
        };
        let reps = (20_000_000 / (w * s * nh * d)).clamp(5, 2000);
        let (mut a, mut b) = (vec![], vec![]);
        for _ in 0..reps {
            let t = std::time::Instant::now();
            std::hint::black_box(candle());
            a.push(t.elapsed().as_secs_f64() * 1e3);
            let t = std::time::Instant::now();
            blocked();
            b.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let gf = |ms: f64| 4.0 * (w * s * nh * d) as f64 / ms / 1e6;
        let (a, b) = (median(a), median(b));
        println!(
            "{p:>6} {w:>5} {:>16} {:>16} {:>7.2}",
            format!("{a:8.3} ({:5.1})", gf(a)),
            format!("{b:8.3} ({:5.1})", gf(b)),
            b / a
        );
    }
}

//! `vmath` against the scalar code it replaced, one thread, alternating call by call:
//! - silu(g) · u over an MLP's rows: the scalar formula (`g / (1 + exp(-g)) · u`, glibc's `expf`, what candle's silu
//!   computes) against `vmath::silu_mul`, on the tiny model's, the Qwen2.5-0.5B's and the Qwen3-1.7B's widths;
//! - a logits row's softmax sums (Z, S) for the sampler's entropy: the scalar loop (f32 `expf` terms, f64 sums)
//!   against `vmath::softmax_sums`, on the tiny model's and Qwen's vocabularies.
//!
//!     cargo bench -p mbd-core --bench vmath

mod common;
use common::median;
use mbd_core::kernels::vmath;

fn main() {
    if !vmath::has_avx2_fma() {
        println!("no AVX2 + FMA on this CPU: nothing to compare");
        return;
    }
    println!("{:>22} {:>11} {:>11} {:>7}", "rows x I", "scalar ms", "vector ms", "ratio");
    for (rows, i, what) in [(16usize, 640usize, "tiny"), (1, 4864, "0.5B"), (32, 4864, "0.5B"), (1, 6144, "1.7B")] {
        let n = rows * i;
        let g: Vec<f32> = (0..n).map(|k| ((k * 7919) % 1000) as f32 / 100.0 - 5.0).collect();
        let u: Vec<f32> = (0..n).map(|k| ((k * 104_729) % 1000) as f32 / 500.0 - 1.0).collect();
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        let (mut ta, mut tb) = (vec![], vec![]);
        for _ in 0..301 {
            let t = std::time::Instant::now();
            vmath::silu_mul_scalar(&g, &u, &mut a);
            ta.push(t.elapsed().as_secs_f64() * 1e3);
            let t = std::time::Instant::now();
            vmath::silu_mul(&g, &u, &mut b);
            tb.push(t.elapsed().as_secs_f64() * 1e3);
        }
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 4.0 * f32::EPSILON * x.abs() + 1e-30, "{x} vs {y}");
        }
        let (ma, mb) = (median(ta), median(tb));
        println!("{:>22} {ma:>11.4} {mb:>11.4} {:>7.2}", format!("{what} {rows} x {i}"), mb / ma);
    }
    println!("{:>22} {:>11} {:>11} {:>7}", "softmax sums, vocab", "scalar ms", "vector ms", "ratio");
    for v in [96usize, 151_936] {
        let row: Vec<f32> = (0..v).map(|k| ((k * 7919) % 2000) as f32 / 100.0 - 10.0).collect();
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (mut ta, mut tb) = (vec![], vec![]);
        let (mut za, mut zb) = ((0f64, 0f64), (0f64, 0f64));
        for _ in 0..301 {
            let t = std::time::Instant::now();
            za = vmath::softmax_sums_scalar(&row, m);
            ta.push(t.elapsed().as_secs_f64() * 1e3);
            let t = std::time::Instant::now();
            zb = vmath::softmax_sums(&row, m);
            tb.push(t.elapsed().as_secs_f64() * 1e3);
        }
        assert!((za.0 - zb.0).abs() <= 1e-6 * za.0 && (za.1 - zb.1).abs() <= 1e-6 * za.1.abs() + 1e-12);
        let (ma, mb) = (median(ta), median(tb));
        println!("{:>22} {ma:>11.4} {mb:>11.4} {:>7.2}", v, mb / ma);
    }
}

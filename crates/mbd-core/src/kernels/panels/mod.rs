//! Many-row products y = x · Wᵀ on the CPU (a prefill chunk, a long window).
//!
//! On x86-64 with AVX2 and FMA: `packed`, a BLIS-style product with a 6 × 16 register tile (6 × 64 with AVX-512) that
//! packs x once and each task's weight rows a block at a time, widening bf16 or dequantizing as it packs (or reads a
//! matrix packed at load, `PackedMatrix`, as it is). Every y element is the in-order f32 fused-multiply-add chain over
//! k, so a row's bits do not depend on m, the tiling, the threads or the instruction set.
//!
//! Elsewhere: W is taken in panels of weight rows (about `PANEL_VALUES` values); each panel is widened (bf16) or
//! dequantized (quantized) into a reused f32 scratch, in parallel, then the gemm crate (the one candle's CPU matmul
//! calls, with its own parallel split) multiplies every x row by it, writing the panel's columns of y. An f32 matrix is
//! one panel, as in candle. There a row's result depends on x's row, W and m (through gemm's blocking).
//!
//! Why not candle's matmul: on a bf16 matrix it needs an f32 copy of the whole matrix per call (on the 0.5B shape 2 GB
//! of fresh pages per forward, the head alone 545 MB), and a quantized matrix has no many-row path there. (Panels as
//! single-threaded parallel tasks were tried first: slower than gemm's own split, which packs x once.)
//!
//! The engine sends a long window here alone, never stacked with other sequences' rows
//! ([`linear::Groups`](crate::net::linear::Groups)).

mod packed;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use packed::PackedMatrix;

use crate::kernels::blocks::QMatrix;
#[cfg(target_arch = "x86_64")]
use crate::kernels::cpu::Cpu;
use crate::kernels::unpack::dequantize_rows;
use half::bf16;
use rayon::prelude::*;

/// A weight matrix (n × k) as the panels read it: row-major f32 or bf16, quantized, or packed at load.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    Quant(&'a QMatrix),
    Packed(&'a PackedMatrix),
}

/// y (m × n) = x (m × k) · Wᵀ, parallel on the calling pool from `par_min_macs` multiply-adds, with the widest
/// tiles this CPU has.
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: Source<'_>, n: usize, par_min_macs: usize) -> Vec<f32> {
    matmul_t_with(x, m, k, w, n, par_min_macs, true)
}

/// `matmul_t`; `avx512`: the packed product's AVX-512 tiles where the CPU has them (false: its AVX2 tiles, for A/B
/// runs and tests; the same bits either way).
pub fn matmul_t_with(
    x: &[f32],
    m: usize,
    k: usize,
    w: Source<'_>,
    n: usize,
    par_min_macs: usize,
    avx512: bool,
) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    #[cfg(target_arch = "x86_64")]
    if Cpu::get().avx2() {
        return x86::matmul_t(x, m, k, w, n, par_min_macs, avx512 && Cpu::get().avx512());
    }
    let _ = avx512;
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut y = vec![0f32; m * n];
    let out = y.as_mut_ptr();
    let threads = rayon::current_num_threads();
    // f32 weights need no conversion: one panel, the whole matrix
    let rows = if let Source::F32(_) = w { n.max(1) } else { panel_rows(n, k) };
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        for n0 in (0..n).step_by(rows) {
            let nw = rows.min(n - n0);
            let panel: &[f32] = match w {
                Source::F32(w) => &w[n0 * k..(n0 + nw) * k],
                Source::Bf16(w) => {
                    fill(&mut s, nw * k, |r0, dst| widen(&w[(n0 + r0) * k..(n0 + r0) * k + dst.len()], dst), k);
                    &s[..nw * k]
                }
                Source::Quant(q) => {
                    fill(&mut s, nw * k, |r0, dst| dequantize_rows(q, n0 + r0, dst.len() / k, dst), k);
                    &s[..nw * k]
                }
                Source::Packed(p) => {
                    fill(&mut s, nw * k, |r0, dst| p.rows_into(n0 + r0, dst.len() / k, dst), k);
                    &s[..nw * k]
                }
            };
            let par = if threads > 1 && m * nw * k >= par_min_macs {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            // SAFETY: columns [n0, n0 + nw) of y (m × n, row stride n); x is m × k and the panel nw × k, both
            // row-major and in bounds; this call is the only writer.
            unsafe { gemm_panel(x, m, k, panel, nw, out, n0, n, par) }
        }
    });
    y
}

/// Fill the first `len` values of `scratch` (rows of `k`) with `f(first_row, rows' values)`, in parallel chunks.
fn fill(scratch: &mut Vec<f32>, len: usize, f: impl Fn(usize, &mut [f32]) + Sync, k: usize) {
    if len == 0 {
        return;
    }
    if scratch.len() < len {
        scratch.resize(len, 0.0);
    }
    let chunk_rows = (FILL_CHUNK / k.max(1)).max(1);
    scratch[..len].par_chunks_mut(chunk_rows * k).enumerate().for_each(|(i, dst)| f(i * chunk_rows, dst));
}

/// Values widened or dequantized per parallel task.
const FILL_CHUNK: usize = 1 << 15;

/// Weight rows per panel: about `PANEL_VALUES` values (16-row multiples, gemm's tile), at most all n.
fn panel_rows(n: usize, k: usize) -> usize {
    ((PANEL_VALUES / k.max(1)).div_ceil(16) * 16).max(16).min(n.max(1))
}

/// Values of W converted to f32 at a time (the scratch: 8 MB, about the last-level cache).
const PANEL_VALUES: usize = 2 << 20;

/// bf16 → f32 (exact: a bf16 is the high half of an f32), vectorised by the compiler.
fn widen(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// y[:, n0..n0 + nw] = x · panelᵀ with the gemm crate.
///
/// # Safety
/// `y` points at an m × n row-major matrix whose columns [n0, n0 + nw) nothing else writes meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_panel(
    x: &[f32],
    m: usize,
    k: usize,
    panel: &[f32],
    nw: usize,
    y: *mut f32,
    n0: usize,
    n: usize,
    par: gemm::Parallelism,
) {
    debug_assert_eq!(panel.len(), nw * k);
    gemm::gemm(
        m,
        nw,
        k,
        y.add(n0),
        1,          // dst column stride
        n as isize, // dst row stride
        false,      // do not read dst (alpha is ignored)
        x.as_ptr(),
        1,
        k as isize,
        // rhs = panelᵀ (k × nw): element (i, j) is panel[j·k + i]
        panel.as_ptr(),
        k as isize,
        1,
        0.0,
        1.0,
        false,
        false,
        false,
        par,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::blocks::QuantFormat;

    fn randn(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Products in f64 of the same operands: every path must be within f32 rounding of it.
    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum();
            }
        }
        y
    }

    fn close(got: &[f32], want: &[f64], k: usize) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((*g as f64 - w).abs() <= 1e-5 * k as f64, "element {i}: {g} vs {w}");
        }
    }

    #[test]
    fn panels_match_a_reference_for_every_weight_form_and_split() {
        // n not a multiple of the panel width, several panels, serial and parallel splits; and tiny matrices
        // (8300 rows of 256: two panels)
        for (m, k, n) in [(67usize, 256usize, 530usize), (5, 256, 8300), (70, 32, 5), (3, 32, 1)] {
            one_shape(m, k, n);
        }
    }

    fn one_shape(m: usize, k: usize, n: usize) {
        let x = randn(m * k, 1);
        let w = randn(n * k, 2);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let format = if k.is_multiple_of(256) { QuantFormat::Q4K } else { QuantFormat::Q8_0 };
        let q = QMatrix::quantize(
            &candle_core::Tensor::from_vec(w.clone(), (n, k), &candle_core::Device::Cpu).unwrap(),
            format,
        )
        .unwrap();
        let mut wq = vec![0f32; n * k];
        q.dequantize_rows(0, n, &mut wq);
        for par in [usize::MAX, 1] {
            close(&matmul_t(&x, m, k, Source::F32(&w), n, par), &reference(&x, m, k, &w, n), k);
            close(&matmul_t(&x, m, k, Source::Bf16(&wb), n, par), &reference(&x, m, k, &wb32, n), k);
            close(&matmul_t(&x, m, k, Source::Quant(&q), n, par), &reference(&x, m, k, &wq, n), k);
        }
    }

    #[test]
    fn bf16_and_quantized_panels_equal_the_f32_path_on_the_same_values() {
        // widening and dequantizing are exact, so the products are those of the f32 matrix holding the same values
        let (m, k, n) = (100, 512, 300);
        let x = randn(m * k, 3);
        let w = randn(n * k, 4);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let par = 1;
        assert_eq!(matmul_t(&x, m, k, Source::Bf16(&wb), n, par), matmul_t(&x, m, k, Source::F32(&wb32), n, par));
        let q = QMatrix::quantize(
            &candle_core::Tensor::from_vec(w, (n, k), &candle_core::Device::Cpu).unwrap(),
            QuantFormat::Q8_0,
        )
        .unwrap();
        let mut wq = vec![0f32; n * k];
        q.dequantize_rows(0, n, &mut wq);
        assert_eq!(matmul_t(&x, m, k, Source::Quant(&q), n, par), matmul_t(&x, m, k, Source::F32(&wq), n, par));
    }

    /// The packed product's tile sets this CPU runs: AVX2 (false), and AVX-512 (true) where it has it.
    fn widths() -> impl Iterator<Item = bool> + Clone {
        #[cfg(target_arch = "x86_64")]
        let wide = Cpu::get().avx512();
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        [false, true].into_iter().filter(move |&w| !w || wide)
    }

    /// The packed product's contract: each element is the in-order f32 fused-multiply-add chain over k from 0; the
    /// AVX2 and AVX-512 tiles alike.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn packed_elements_are_the_in_order_fma_chain_whatever_the_rows_and_split() {
        if !Cpu::get().avx2() {
            return;
        }
        // tails in every dimension (m not a multiple of 6 or of the 144-row block, n of 16 or of a task, k of 256),
        // several depth blocks, serial and parallel
        for (m, k, n) in [(151usize, 600usize, 141usize), (1, 257, 16), (7, 31, 3), (13, 512, 300)] {
            let x = randn(m * k, 5);
            let w = randn(n * k, 6);
            let want: Vec<f32> = (0..m * n)
                .map(|e| {
                    let (r, c) = (e / n, e % n);
                    (0..k).fold(0f32, |acc, i| x[r * k + i].mul_add(w[c * k + i], acc))
                })
                .collect();
            for (par, wide) in [usize::MAX, 1].into_iter().flat_map(|p| widths().map(move |w| (p, w))) {
                let mm = |x: &[f32], m: usize| matmul_t_with(x, m, k, Source::F32(&w), n, par, wide);
                assert_eq!(mm(&x, m), want, "{m}x{k}x{n} par {par} avx512 {wide}");
                // a row alone gives its bits in the stacked product
                let r = m / 2;
                assert_eq!(mm(&x[r * k..(r + 1) * k], 1), want[r * n..(r + 1) * n]);
            }
        }
    }

    fn tensor<T: candle_core::WithDType>(v: Vec<T>, n: usize, k: usize) -> candle_core::Tensor {
        candle_core::Tensor::from_vec(v, (n, k), &candle_core::Device::Cpu).unwrap()
    }

    /// A matrix packed at load gives every element as the in-order FMA chain, for every row count (each tile
    /// shape: the 6-row tile, the last 1-5 rows over 1-4 groups, partial groups), alone or stacked, serial or in
    /// parallel; and the same bits as the row-major matrix packed per call.
    #[test]
    fn packed_at_load_is_the_in_order_chain_for_every_window() {
        if !PackedMatrix::available() {
            return;
        }
        for (k, n) in [(300usize, 141usize), (64, 16), (257, 200), (31, 7), (512, 1030), (96, 37), (256, 45)] {
            let w = randn(n * k, 7);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let pf = PackedMatrix::from_tensor(&tensor(w.clone(), n, k)).unwrap().unwrap();
            let pb = PackedMatrix::from_tensor(&tensor(wb.clone(), n, k)).unwrap().unwrap();
            assert_eq!((pf.dtype(), pb.dtype()), (Some(candle_core::DType::F32), Some(candle_core::DType::BF16)));
            // the block formats (rows of whole blocks): the chain over their dequantized values
            let quants: Vec<(QuantFormat, PackedMatrix, Vec<f32>)> = [
                QuantFormat::Q8_0,
                QuantFormat::Q5_0,
                QuantFormat::Q4K,
                QuantFormat::Q6K,
                QuantFormat::Q4_0,
                QuantFormat::Q5K,
                QuantFormat::Q3K,
                QuantFormat::Q2K,
            ]
            .into_iter()
            .filter(|f| k.is_multiple_of(f.block_values()))
            .map(|f| {
                let q = QMatrix::quantize(&tensor(w.clone(), n, k), f).unwrap();
                let mut wq = vec![0f32; n * k];
                q.dequantize_rows(0, n, &mut wq);
                (f, PackedMatrix::from_quant(&q).unwrap().expect("the format packs"), wq)
            })
            .collect();
            let x = randn(31 * k, 8);
            let chain = |w: &[f32], m: usize| -> Vec<f32> {
                (0..m * n)
                    .map(|e| {
                        let (r, c) = (e / n, e % n);
                        (0..k).fold(0f32, |acc, i| x[r * k + i].mul_add(w[c * k + i], acc))
                    })
                    .collect()
            };
            // (from `Panel::DECODE_ROWS` rows on, the 4- to 6-bit formats are decoded before the tiles run)
            for m in (1..=13).chain([20, 24, 31]) {
                let (want_f, want_b) = (chain(&w, m), chain(&wb32, m));
                let want_q: Vec<Vec<f32>> = quants.iter().map(|(_, _, wq)| chain(wq, m)).collect();
                for (par, wide) in [usize::MAX, 1].into_iter().flat_map(|p| widths().map(move |w| (p, w))) {
                    let mm = |x: &[f32], m: usize, w| matmul_t_with(x, m, k, w, n, par, wide);
                    let xs = &x[..m * k];
                    let at = format!("{m}x{k}x{n} par {par} avx512 {wide}");
                    assert_eq!(mm(xs, m, Source::Packed(&pf)), want_f, "f32 {at}");
                    assert_eq!(mm(xs, m, Source::Packed(&pb)), want_b, "bf16 {at}");
                    assert_eq!(mm(xs, m, Source::Bf16(&wb)), want_b, "per call {at}");
                    let r = m - 1;
                    assert_eq!(mm(&x[r * k..(r + 1) * k], 1, Source::Packed(&pb)), want_b[r * n..(r + 1) * n]);
                    for ((f, pq, _), want_q) in quants.iter().zip(&want_q) {
                        let f = f.name();
                        assert_eq!(mm(xs, m, Source::Packed(pq)), *want_q, "{f} {at}");
                        let one = &want_q[r * n..(r + 1) * n];
                        assert_eq!(mm(&x[r * k..(r + 1) * k], 1, Source::Packed(pq)), one, "{f} row {r} alone, {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn packed_block_formats_rows_stacks_and_bytes() {
        if !PackedMatrix::available() {
            return;
        }
        let k = 512;
        for (f, bytes_per_256) in [
            (QuantFormat::Q8_0, 8 * 34),
            (QuantFormat::Q5_0, 8 * 22),
            (QuantFormat::Q4K, 128 + 20),
            (QuantFormat::Q6K, 210),
            (QuantFormat::Q4_0, 8 * 18),
            (QuantFormat::Q5K, 176 + 4),
            (QuantFormat::Q3K, 110 + 4),
            (QuantFormat::Q2K, 84),
        ] {
            let q = |n: usize, seed: u64| QMatrix::quantize(&tensor(randn(n * k, seed), n, k), f).unwrap();
            let (a, b) = (q(32, 11), q(21, 12));
            let (pa, pb) =
                (PackedMatrix::from_quant(&a).unwrap().unwrap(), PackedMatrix::from_quant(&b).unwrap().unwrap());
            assert_eq!(pb.dtype(), None);
            // per 256 values: q8_0, q6_k, q5_0, q4_0 and q2_k their blocks' bytes; q5_k, q4_k and q3_k theirs and 4
            // more (their 6-bit scales, and mins, a byte each), for the rows padded to a whole group
            assert_eq!(pb.bytes(), 32 * k / 256 * bytes_per_256, "{}", f.name());
            let mut want = vec![0f32; 53 * k];
            a.dequantize_rows(0, 32, &mut want[..32 * k]);
            b.dequantize_rows(0, 21, &mut want[32 * k..]);
            let st = PackedMatrix::stack(&[&pa, &pb]).unwrap().expect("whole groups stack");
            let mut got = vec![0f32; 53 * k];
            st.rows_into(0, 53, &mut got);
            assert_eq!(got, want, "{}", f.name());
            // not with another kind or format, nor after a partial group
            let dense = PackedMatrix::from_tensor(&tensor(randn(32 * k, 13), 32, k)).unwrap().unwrap();
            assert!(PackedMatrix::stack(&[&pa, &dense]).unwrap().is_none());
            assert!(PackedMatrix::stack(&[&pb, &pa]).unwrap().is_none());
            let other = if f == QuantFormat::Q8_0 { QuantFormat::Q5_0 } else { QuantFormat::Q8_0 };
            let po = PackedMatrix::from_quant(&QMatrix::quantize(&tensor(randn(32 * k, 15), 32, k), other).unwrap());
            assert!(PackedMatrix::stack(&[&pa, &po.unwrap().unwrap()]).unwrap().is_none());
        }
    }

    #[test]
    fn packed_rows_and_stacks_are_exact() {
        if !PackedMatrix::available() {
            return;
        }
        let k = 40;
        let (a, b) = (randn(32 * k, 9), randn(21 * k, 10));
        let ab: Vec<bf16> = a.iter().chain(&b).map(|&v| bf16::from_f32(v)).collect();
        for bf in [false, true] {
            let t = |v: &[f32], n: usize| {
                let t = tensor(v.to_vec(), n, k);
                if bf {
                    t.to_dtype(candle_core::DType::BF16).unwrap()
                } else {
                    t
                }
            };
            let (pa, pb) = (
                PackedMatrix::from_tensor(&t(&a, 32)).unwrap().unwrap(),
                PackedMatrix::from_tensor(&t(&b, 21)).unwrap().unwrap(),
            );
            let want: Vec<f32> =
                if bf { ab.iter().map(|v| v.to_f32()).collect() } else { a.iter().chain(&b).copied().collect() };
            let st = PackedMatrix::stack(&[&pa, &pb]).unwrap().expect("whole groups stack");
            assert_eq!((st.n, st.k), (53, k));
            let mut got = vec![0f32; 53 * k];
            st.rows_into(0, 53, &mut got);
            assert_eq!(got, want);
            let mut one = vec![0f32; k];
            pb.rows_into(20, 1, &mut one);
            assert_eq!(one, want[52 * k..]);
            // a first part of 21 rows has a partial group: no stack
            assert!(PackedMatrix::stack(&[&pb, &pa]).unwrap().is_none());
            assert_eq!(st.bytes(), 64 * k * if bf { 2 } else { 4 });
        }
    }
}

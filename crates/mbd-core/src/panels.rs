//! Many-row products y = x · Wᵀ on the CPU (a prefill chunk, a long window): W is taken in panels of weight rows
//! (about `PANEL_VALUES` values); each panel is widened (bf16) or dequantized (quantized) into a reused f32
//! scratch, in parallel, then the gemm crate (the one candle's CPU matmul calls, with its own parallel split)
//! multiplies every x row by it, writing the panel's columns of y. An f32 matrix is one panel, as in candle.
//!
//! Why not candle's matmul: on a bf16 matrix it needs an f32 copy of the whole matrix per call (on the 0.5B shape
//! 2 GB of fresh pages per forward, the head alone 545 MB), and a quantized matrix has no many-row path there.
//! (Panels as single-threaded parallel tasks were tried first: slower than gemm's own split, which packs x once.)
//!
//! A row's result depends only on x's row and W (and m, through gemm's blocking): the engine sends a long window
//! here alone, never stacked with other sequences' rows (`models::qwen::Groups`), so batch invariance holds.

use crate::quant::QMatrix;
use crate::skinny::dequantize_rows;
use half::bf16;
use rayon::prelude::*;

/// A weight matrix (n × k, row-major) as the panels read it.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    Quant(&'a QMatrix),
}

/// y (m × n) = x (m × k) · Wᵀ, each gemm call parallel on the calling pool from `par_min_macs` multiply-adds.
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: Source<'_>, n: usize, par_min_macs: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
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
    use crate::quant::QuantFormat;

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
}

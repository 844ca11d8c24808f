//! The packed product's driver: x packed once per call, the output columns cut into tasks, each task's weights
//! packed (or read as packed at load) a depth block at a time, and the sweep of the register tiles over them.

use super::formats::{Cursor, Panel, Q2K, Q3K, Q4K, Q4_0, Q5K, Q5_0, Q6K};
use super::tiles::{edge_tile, Tiles, Ymm, Zmm};
use super::{MR, NR};
use crate::kernels::blocks::QuantFormat;
use crate::kernels::cpu::Cpu;
use crate::kernels::panels::packed::PackedData;
use crate::kernels::panels::Source;
use crate::kernels::simd::{load8, transpose8, with_buf, Out, WeightElem};
use crate::kernels::unpack::dequantize_rows;
use half::bf16;
use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::Cell;

/// Depth of a packed block: a weight micro-panel (`KC` × `NR`, 16 KB) stays in L1 while the x micro-panels stream.
const KC: usize = 256;

/// x rows per block (`MC` × `KC` f32: 144 KB, in L2 with the task's weight block).
const MC: usize = 144;

/// `NR`-column groups per task at most (the task's packed weight block: `KC` × 128 f32, 128 KB).
const MAX_TASK_GROUPS: usize = 8;

thread_local! {
    static A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static B: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static ROWS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// `wide`: the AVX-512 tiles (`Zmm`; the caller checked [`Cpu::avx512`]), else the AVX2 ones.
pub(in crate::kernels::panels) fn matmul_t(
    x: &[f32],
    m: usize,
    k: usize,
    w: Source<'_>,
    n: usize,
    par_min_macs: usize,
    wide: bool,
) -> Vec<f32> {
    assert!(Cpu::get().avx2() && (!wide || Cpu::get().avx512()), "packed::matmul_t needs AVX2 and FMA (AVX-512: wide)");
    // every element is stored by its first depth block before anything reads it (no zero fill needed)
    let mut y: Vec<f32> = Vec::with_capacity(m * n);
    if m == 0 || n == 0 || k == 0 {
        y.resize(m * n, 0.0);
        return y;
    }
    let par = rayon::current_num_threads() > 1 && m * n * k >= par_min_macs;
    let m_pad = m.div_ceil(MR) * MR;
    with_buf(&A, m_pad * k, |a| {
        pack_x(x, m, k, m_pad, a, par);
        let a: &[f32] = a;
        let groups = n.div_ceil(NR);
        let tasks = task_count(groups, if par { rayon::current_num_threads() } else { 1 });
        let out = Out(y.as_mut_ptr());
        let task = |t: usize| {
            // task t: groups [t·groups/tasks, (t+1)·groups/tasks) of NR columns (sizes differ by at most one)
            let (j0, j1) = (t * groups / tasks * NR, ((t + 1) * groups / tasks * NR).min(n));
            // SAFETY: the task writes columns [j0, j1) of y (m × n) only; x is packed m_pad × k in `a`.
            let t = Task { a, m, m_pad, k, j0, nt: j1 - j0, n, y: out };
            unsafe {
                if wide {
                    columns::<Zmm>(t, w)
                } else {
                    columns::<Ymm>(t, w)
                }
            }
        };
        if par {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        // SAFETY: the tasks wrote all m × n elements (first depth block of every tile)
        unsafe { y.set_len(m * n) };
    });
    y
}

/// Tasks over `groups` column groups of `NR`: at most `MAX_TASK_GROUPS` groups each, at least 2 per thread where
/// there are enough groups, and a multiple of the threads, so that the threads get equal work.
fn task_count(groups: usize, threads: usize) -> usize {
    let tasks = groups.div_ceil(MAX_TASK_GROUPS).max(2 * threads).div_ceil(threads) * threads;
    tasks.min(groups)
}

/// x (m × k) into `a`: per `KC` block (at offset kc0 · m_pad), `MR`-row micro-panels of kc × `MR` values
/// (row r of panel i at [p · MR + r]), rows past m zero.
fn pack_x(x: &[f32], m: usize, k: usize, m_pad: usize, a: &mut [f32], par: bool) {
    // each panel's values lie in every block: split the work by panel over raw offsets
    let panels = m_pad / MR;
    let a_ptr = Out(a.as_mut_ptr());
    let one = |i: usize| {
        for kc0 in (0..k).step_by(KC) {
            let kc = KC.min(k - kc0);
            // SAFETY: panel i of block kc0 is [kc0·m_pad + i·MR·kc, + MR·kc), inside `a` (m_pad × k) and
            // written by this call only.
            let dst = unsafe { std::slice::from_raw_parts_mut(a_ptr.offset(kc0 * m_pad + i * MR * kc).0, MR * kc) };
            for r in 0..MR {
                let row = i * MR + r;
                if row < m {
                    let src = &x[row * k + kc0..row * k + kc0 + kc];
                    for (p, &v) in src.iter().enumerate() {
                        dst[p * MR + r] = v;
                    }
                } else {
                    for p in 0..kc {
                        dst[p * MR + r] = 0.0;
                    }
                }
            }
        }
    };
    if par && panels > 1 {
        (0..panels).into_par_iter().for_each(one);
    } else {
        (0..panels).for_each(one);
    }
}

/// One task's share of a product: columns [j0, j0 + nt) of y (m × n, row-major) from x packed by `pack_x`
/// (m_pad × k in `a`).
#[derive(Clone, Copy)]
struct Task<'a> {
    a: &'a [f32],
    m: usize,
    m_pad: usize,
    k: usize,
    j0: usize,
    nt: usize,
    n: usize,
    y: Out,
}

/// The task's columns of y.
///
/// # Safety
/// `t.y` is m × n; only this call writes the task's columns.
unsafe fn columns<T: Tiles>(t: Task<'_>, w: Source<'_>) {
    let (k, j0, nt) = (t.k, t.j0, t.nt);
    match w {
        Source::F32(w) => columns_of::<T, f32>(t, &w[j0 * k..(j0 + nt) * k]),
        Source::Bf16(w) => columns_of::<T, bf16>(t, &w[j0 * k..(j0 + nt) * k]),
        Source::Quant(q) => with_buf(&ROWS, nt * k, |rows| {
            dequantize_rows(q, j0, nt, rows);
            columns_of::<T, f32>(t, rows)
        }),
        Source::Packed(p) => {
            // the task's groups (j0 is a multiple of NR)
            let g = (j0 / NR, (j0 + nt).div_ceil(NR));
            match &p.data {
                PackedData::F32(d) => columns_packed::<T, f32>(t, d, &[], g),
                PackedData::Bf16(d) => columns_packed::<T, u16>(t, d, &[], g),
                PackedData::Block { format, w, s } => match format {
                    QuantFormat::Q8_0 => columns_packed::<T, i8>(t, bytes_as(w), s, g),
                    QuantFormat::Q6K => columns_packed::<T, Q6K>(t, bytes_as(w), s, g),
                    QuantFormat::Q5K => columns_packed::<T, Q5K>(t, bytes_as(w), s, g),
                    QuantFormat::Q5_0 => columns_packed::<T, Q5_0>(t, bytes_as(w), s, g),
                    QuantFormat::Q4K => columns_packed::<T, Q4K>(t, bytes_as(w), s, g),
                    QuantFormat::Q4_0 => columns_packed::<T, Q4_0>(t, bytes_as(w), s, g),
                    QuantFormat::Q3K => columns_packed::<T, Q3K>(t, bytes_as(w), s, g),
                    QuantFormat::Q2K => columns_packed::<T, Q2K>(t, bytes_as(w), s, g),
                },
            }
        }
    }
}

/// Bytes as the one-byte element `E` a `Panel` reads them as.
fn bytes_as<E: Panel>(w: &[u8]) -> &[E] {
    assert_eq!(std::mem::size_of::<E>(), 1);
    // SAFETY: E is one byte with no invalid bit patterns (i8 or a `repr(transparent)` struct over u8)
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const E, w.len()) }
}

/// The task's columns from its groups [g0, g1) (`groups`) of a `PackedMatrix`'s values `w` and scale records
/// `scales`, `KC` deep at a time as x is packed. (A window of one row panel taking the whole depth at once, each
/// group streamed in one pass, measured the same.)
unsafe fn columns_packed<T: Tiles, E: Panel>(t: Task<'_>, w: &[E], scales: &[u8], groups: (usize, usize)) {
    // a block format's scale records: group g's after g's (KC is a multiple of `sblock`, so every depth block
    // starts a record)
    let l = E::LAYOUT;
    let records = if E::BLOCK > 0 { t.k / l.sblock } else { 0 };
    let (g0, g1) = groups;
    let w = &w[g0 * t.k * l.step..g1 * t.k * l.step];
    let scales = &scales[g0 * records * l.sbytes..g1 * records * l.sbytes];
    let at = |g: usize, kc0: usize| Cursor {
        fetch: false,
        w: w.as_ptr().add((g * t.k + kc0) * l.step),
        s: if E::BLOCK > 0 { scales.as_ptr().add((g * records + kc0 / l.sblock) * l.sbytes) } else { std::ptr::null() },
    };
    if E::BLOCK > 0 && t.m >= E::DECODE_ROWS {
        let groups = t.nt.div_ceil(NR);
        with_buf(&B, KC * groups * NR, |b| {
            for kc0 in (0..t.k).step_by(KC) {
                let kc = KC.min(t.k - kc0);
                for g in 0..groups {
                    T::decode::<E>(kc, at(g, kc0), &mut b[g * NR * kc..(g + 1) * NR * kc]);
                }
                let b: &[f32] = b;
                sweep::<T, f32>(t, kc0, kc, |g| Cursor::dense(b.as_ptr().add(g * NR * kc)));
            }
        });
        return;
    }
    for kc0 in (0..t.k).step_by(KC) {
        let kc = KC.min(t.k - kc0);
        sweep::<T, E>(t, kc0, kc, |g| at(g, kc0));
    }
}

/// The task's columns from its weight rows `w` (nt × k), packed here `KC` deep at a time.
unsafe fn columns_of<T: Tiles, E: WeightElem>(t: Task<'_>, w: &[E]) {
    let groups = t.nt.div_ceil(NR);
    with_buf(&B, KC * groups * NR, |b| {
        for kc0 in (0..t.k).step_by(KC) {
            let kc = KC.min(t.k - kc0);
            pack_w(w, t.k, t.nt, kc0, kc, b);
            let b: &[f32] = b;
            sweep::<T, f32>(t, kc0, kc, |g| Cursor::dense(b.as_ptr().add(g * NR * kc)));
        }
    });
}

/// One depth block [kc0, kc0 + kc) of the task's columns: `b(g)` points at group g's `NR`-wide values at depth
/// kc0, consecutive depths `NR` apart. Full row panels take the `MR`-row tile (over up to `T::FULL` whole groups
/// at once, a partial last group alone), `MC` rows of x at a time over each group; the last rows (fewer than `MR`)
/// a tile as wide as its accumulators allow ([`Tiles::last_rows`]).
unsafe fn sweep<T: Tiles, E: Panel>(t: Task<'_>, kc0: usize, kc: usize, b: impl Fn(usize) -> Cursor<E>) {
    let Task { a, m, m_pad, j0, nt, n, y, .. } = t;
    let groups = nt.div_ceil(NR);
    let full = m / MR * MR;
    let acc = kc0 > 0;
    // tall tiles take the full panels two at a time from each block's start (`MC` is a multiple of 2 · `MR`), so
    // with an odd count the last full panel is left alone: it takes the last rows with it (a shorter tall tile)
    let rest_tall = T::TALL && E::BLOCK == 0 && m > full && (full / MR) % 2 == 1;
    for i0 in (0..full).step_by(MC) {
        let i1 = (i0 + MC).min(full);
        let mut g = 0;
        while g < groups {
            // whole groups this tile covers (none: a partial last group)
            let count = (nt / NR - g).min(T::full_groups::<E>());
            let mut i = i0;
            while i < i1 {
                let ap = a.as_ptr().add(kc0 * m_pad + i * kc);
                let c = y.offset(i * n + j0 + g * NR).0;
                // the first row panel reads the weights from memory (the others from the cache)
                let b = |g| Cursor { fetch: i == 0, ..b(g) };
                // two panels, the last one with the last rows, or one panel
                let rows = if T::TALL && E::BLOCK == 0 && count > 0 && i + 2 * MR <= i1 {
                    2 * MR
                } else if rest_tall && count > 0 && i + MR == full {
                    MR + m - full
                } else {
                    MR
                };
                if count > 0 {
                    T::full(rows, kc, ap, &b, g, count, c, n, acc);
                } else {
                    edge_tile::<T, E, MR>(kc, ap, b(g), c, n, nt - g * NR, acc);
                }
                i += if rows == 2 * MR { 2 * MR } else { MR };
            }
            g += count.max(1);
        }
    }
    if m > full {
        let ap = a.as_ptr().add(kc0 * m_pad + full * kc);
        // with `rest_tall` the whole groups' last rows are done: only a partial last group is left
        let g0 = if rest_tall { nt / NR } else { 0 };
        let b = |g| Cursor { fetch: full == 0, ..b(g0 + g) };
        if g0 * NR < nt {
            T::last_rows(m - full, kc, ap, &b, nt - g0 * NR, y.offset(full * n + j0 + g0 * NR).0, n, acc);
        }
    }
}

/// Weight rows `w` (nt × k), columns [kc0, kc0 + kc), into `NR`-column micro-panels: group g's value for
/// column c at depth p is at [g · NR · kc + p · NR + c]; columns past nt zero. 8 × 8 blocks are transposed in
/// registers (bf16 widened as they load), the last kc % 8 depths one by one.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_w<E: WeightElem>(w: &[E], k: usize, nt: usize, kc0: usize, kc: usize, b: &mut [f32]) {
    let kc8 = kc / 8 * 8;
    for g in 0..nt.div_ceil(NR) {
        let dst = &mut b[g * NR * kc..(g + 1) * NR * kc];
        for h in 0..NR / 8 {
            let c0 = g * NR + h * 8;
            // the 8 rows' starts at depth kc0 (None: past nt)
            let rows: [Option<*const E>; 8] =
                std::array::from_fn(|r| (c0 + r < nt).then(|| w[(c0 + r) * k + kc0..].as_ptr()));
            for p0 in (0..kc8).step_by(8) {
                let v: [__m256; 8] = std::array::from_fn(|r| rows[r].map_or(_mm256_setzero_ps(), |q| load8(q.add(p0))));
                for (j, t) in transpose8(v).into_iter().enumerate() {
                    _mm256_storeu_ps(dst.as_mut_ptr().add((p0 + j) * NR + h * 8), t);
                }
            }
            for p in kc8..kc {
                for (r, row) in rows.iter().enumerate() {
                    dst[p * NR + h * 8 + r] = row.map_or(0.0, |q| (*q.add(p)).to_f32());
                }
            }
        }
    }
}

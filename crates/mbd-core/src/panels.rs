//! Many-row products y = x · Wᵀ on the CPU (a prefill chunk, a long window).
//!
//! On x86-64 with AVX2 and FMA: `packed`, a BLIS-style product with a 6 × 16 register tile that packs x once and
//! each task's weight rows a block at a time, widening bf16 or dequantizing as it packs. Every y element is the
//! in-order f32 fused-multiply-add chain over k, so a row's bits do not depend on m, the tiling or the threads.
//!
//! Elsewhere: W is taken in panels of weight rows (about `PANEL_VALUES` values); each panel is widened (bf16) or
//! dequantized (quantized) into a reused f32 scratch, in parallel, then the gemm crate (the one candle's CPU matmul
//! calls, with its own parallel split) multiplies every x row by it, writing the panel's columns of y. An f32 matrix
//! is one panel, as in candle. There a row's result depends on x's row, W and m (through gemm's blocking).
//!
//! Why not candle's matmul: on a bf16 matrix it needs an f32 copy of the whole matrix per call (on the 0.5B shape
//! 2 GB of fresh pages per forward, the head alone 545 MB), and a quantized matrix has no many-row path there.
//! (Panels as single-threaded parallel tasks were tried first: slower than gemm's own split, which packs x once.)
//!
//! The engine sends a long window here alone, never stacked with other sequences' rows (`models::qwen::Groups`).

use crate::quant::QMatrix;
use crate::skinny::dequantize_rows;
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

/// Output columns per group of a packed matrix (the register tile's width).
const GROUP: usize = 16;

/// A dense weight matrix (n × k, f32 or bf16) packed once at load for the packed product: its rows (output
/// columns) in groups of `GROUP`, each group k-major (depth p of group g: `GROUP` values at (g · k + p) · `GROUP`),
/// n padded with zero rows to a whole group. The product then reads W as it streams, with no packing per call, for
/// every window: a one-row decode window, a few-row window and a prefill alike, so that every output element is
/// the same in-order f32 fused-multiply-add chain over k whatever the window (see `packed`). Only CPUs with the
/// packed product (x86-64 with AVX2 and FMA) hold matrices this way.
///
/// bf16 is kept as bf16 (half the bytes) and widened in registers: within a depth's 16 values, slot 2i holds
/// column i and slot 2i + 1 column 8 + i, so that one 32-byte load widens to columns 0-7 (each 32-bit lane's low
/// half shifted up) and 8-15 (its high half masked) in two integer instructions.
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    data: PackedData,
}

enum PackedData {
    F32(Vec<f32>),
    /// bf16 bit patterns in the slot order above
    Bf16(Vec<u16>),
}

impl PackedMatrix {
    /// Whether this CPU multiplies packed matrices (otherwise they are never made).
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            packed::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// A contiguous 2-D f32 or bf16 CPU tensor, packed; None where packed matrices are not available or the tensor
    /// is not of that kind.
    pub fn from_tensor(t: &candle_core::Tensor) -> candle_core::Result<Option<PackedMatrix>> {
        use candle_core::{CpuStorage, Device, Storage};
        if !Self::available() || !matches!(t.device(), Device::Cpu) || t.rank() != 2 {
            return Ok(None);
        }
        let (n, k) = t.dims2()?;
        let (storage, layout) = t.storage_and_layout();
        let (Storage::Cpu(s), Some((o0, o1))) = (&*storage, layout.contiguous_offsets()) else { return Ok(None) };
        Ok(Some(match s {
            CpuStorage::F32(w) => Self::pack(&w[o0..o1], n, k, |v: &f32| *v, PackedData::F32)?,
            CpuStorage::BF16(w) => Self::pack(&w[o0..o1], n, k, |v: &bf16| v.to_bits(), PackedData::Bf16)?,
            _ => return Ok(None),
        }))
    }

    /// Pack row-major W (n × k) in parallel, a group per task (an error, not an abort, when the copy cannot be
    /// allocated).
    fn pack<E: Sync, T: Copy + Default + Send>(
        w: &[E],
        n: usize,
        k: usize,
        f: impl Fn(&E) -> T + Sync,
        wrap: fn(Vec<T>) -> PackedData,
    ) -> candle_core::Result<PackedMatrix> {
        assert_eq!(w.len(), n * k);
        let groups = n.div_ceil(GROUP);
        let mut data = Vec::new();
        if data.try_reserve_exact(groups * GROUP * k).is_err() {
            candle_core::bail!("cannot allocate the packed copy of a {n}x{k} matrix");
        }
        data.resize(groups * GROUP * k, T::default());
        let bf16 = std::mem::size_of::<T>() == 2;
        if k > 0 {
            data.par_chunks_mut(GROUP * k).enumerate().for_each(|(g, dst)| {
                // the group's rows read side by side, its values written in order
                let rows: Vec<(usize, &[E])> = (0..GROUP.min(n - g * GROUP))
                    .map(|c| (slot(c, bf16), &w[(g * GROUP + c) * k..(g * GROUP + c + 1) * k]))
                    .collect();
                for (p, out) in dst.chunks_exact_mut(GROUP).enumerate() {
                    for &(s, row) in &rows {
                        out[s] = f(&row[p]);
                    }
                }
            });
        }
        Ok(PackedMatrix { n, k, data: wrap(data) })
    }

    /// Whether the values are held as bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, PackedData::Bf16(_))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.data {
            PackedData::F32(d) => d.len() * 4,
            PackedData::Bf16(d) => d.len() * 2,
        }
    }

    /// Rows [first, first + count) of W (exact, f32) into `dst` (count × k).
    pub fn rows_into(&self, first: usize, count: usize, dst: &mut [f32]) {
        let k = self.k;
        assert!(first + count <= self.n && dst.len() == count * k);
        for (i, out) in dst.chunks_mut(k.max(1)).enumerate() {
            let (g, c) = ((first + i) / GROUP, (first + i) % GROUP);
            let base = g * GROUP * k;
            match &self.data {
                PackedData::F32(d) => {
                    for (p, o) in out.iter_mut().enumerate() {
                        *o = d[base + p * GROUP + c];
                    }
                }
                PackedData::Bf16(d) => {
                    let s = slot(c, true);
                    for (p, o) in out.iter_mut().enumerate() {
                        *o = f32::from_bits((d[base + p * GROUP + s] as u32) << 16);
                    }
                }
            }
        }
    }

    /// Matrices of the same width and element stacked (their rows one after another), when every one but the last
    /// has whole groups; None otherwise; an error when the stacked copy cannot be allocated.
    pub fn stack(parts: &[&PackedMatrix]) -> candle_core::Result<Option<PackedMatrix>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let whole = parts[..parts.len() - 1].iter().all(|p| p.n.is_multiple_of(GROUP));
        if !whole || parts.iter().any(|p| p.k != first.k || p.is_bf16() != first.is_bf16()) {
            return Ok(None);
        }
        fn cat<T: Copy>(parts: &[&PackedMatrix], get: fn(&PackedData) -> &[T]) -> candle_core::Result<Vec<T>> {
            let len = parts.iter().map(|p| get(&p.data).len()).sum();
            let mut out = Vec::new();
            if out.try_reserve_exact(len).is_err() {
                candle_core::bail!("cannot allocate a stacked packed matrix of {len} values");
            }
            for p in parts {
                out.extend_from_slice(get(&p.data));
            }
            Ok(out)
        }
        let data = match first.data {
            PackedData::F32(_) => PackedData::F32(cat(parts, PackedData::f32s)?),
            PackedData::Bf16(_) => PackedData::Bf16(cat(parts, PackedData::bf16s)?),
        };
        Ok(Some(PackedMatrix { n: parts.iter().map(|p| p.n).sum(), k: first.k, data }))
    }
}

impl PackedData {
    /// The values if held as f32 (else none).
    fn f32s(&self) -> &[f32] {
        if let PackedData::F32(d) = self {
            d
        } else {
            &[]
        }
    }
    /// The bf16 bit patterns if held as bf16 (else none).
    fn bf16s(&self) -> &[u16] {
        if let PackedData::Bf16(d) = self {
            d
        } else {
            &[]
        }
    }
}

/// Where column c (0..`GROUP`) of a group sits among a depth's values (see `PackedMatrix`).
fn slot(c: usize, bf16: bool) -> usize {
    match (bf16, c < GROUP / 2) {
        (false, _) => c,
        (true, true) => 2 * c,
        (true, false) => 2 * (c - GROUP / 2) + 1,
    }
}

/// y (m × n) = x (m × k) · Wᵀ, each gemm call parallel on the calling pool from `par_min_macs` multiply-adds.
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: Source<'_>, n: usize, par_min_macs: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    #[cfg(target_arch = "x86_64")]
    if packed::available() {
        return packed::matmul_t(x, m, k, w, n, par_min_macs);
    }
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

/// 8 × 8 register transposes and the thread-local aligned buffers, shared with `attention::blocked`.
#[cfg(target_arch = "x86_64")]
pub(crate) use packed::{transpose8, with_buf};

/// The packed AVX2+FMA product (x86-64 CPUs with AVX2 and FMA): the BLIS scheme with a 6 × 16 register tile.
///
/// x is packed once per call into `MR`-row micro-panels (`KC` columns deep); the output columns are cut into
/// parallel tasks, each packing its weight rows `KC` columns at a time into `NR`-column micro-panels (widening bf16,
/// or from a dequantized copy of its rows) and running the tile over every x micro-panel, `MC` rows of x at a time.
///
/// Numerics: every y element is one f32 fused-multiply-add chain over k in order, starting from 0 (a tile continues
/// the chain of the previous `KC` block from the stored value). So a row's result depends only on x's row and W — not
/// on m, the tiling, the task split or the thread count — and equals `acc = x[i].mul_add(w[i], acc)` for i = 0..k.
#[cfg(target_arch = "x86_64")]
mod packed {
    use super::{PackedData, Source};
    use crate::skinny::{dequantize_rows, load8, Out, WeightElem};
    use half::bf16;
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    use std::cell::Cell;
    use std::thread::LocalKey;

    /// Register tile: `MR` x rows × `NR` output columns (12 of the 16 ymm registers hold it).
    const MR: usize = 6;
    const NR: usize = super::GROUP;
    /// Depth of a packed block: a weight micro-panel (`KC` × `NR`, 16 KB) stays in L1 while the x micro-panels stream.
    const KC: usize = 256;
    /// x rows per block (`MC` × `KC` f32: 144 KB, in L2 with the task's weight block).
    const MC: usize = 144;
    /// `NR`-column groups per task at most (the task's packed weight block: `KC` × 128 f32, 128 KB).
    const MAX_TASK_GROUPS: usize = 8;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    thread_local! {
        static A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
        static B: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
        static ROWS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    }

    /// `f` on a 64-byte aligned slice of `len` values of the thread's buffer `buf`. The buffer is taken out while
    /// `f` runs, so a call that re-enters on this thread (a rayon worker picking up other work while it waits)
    /// gets a fresh one instead of a borrow error.
    pub(crate) fn with_buf<R>(
        buf: &'static LocalKey<Cell<Vec<f32>>>,
        len: usize,
        f: impl FnOnce(&mut [f32]) -> R,
    ) -> R {
        let mut v = buf.take();
        if v.len() < len + 16 {
            v.resize(len + 16, 0.0);
        }
        let skip = v.as_ptr().align_offset(64);
        let r = f(&mut v[skip..skip + len]);
        buf.set(v);
        r
    }

    pub(super) fn matmul_t(x: &[f32], m: usize, k: usize, w: Source<'_>, n: usize, par_min_macs: usize) -> Vec<f32> {
        assert!(available(), "packed::matmul_t needs AVX2 and FMA");
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
                unsafe { columns(Task { a, m, m_pad, k, j0, nt: j1 - j0, n, y: out }, w) }
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
    unsafe fn columns(t: Task<'_>, w: Source<'_>) {
        let (k, j0, nt) = (t.k, t.j0, t.nt);
        match w {
            Source::F32(w) => columns_of(t, &w[j0 * k..(j0 + nt) * k]),
            Source::Bf16(w) => columns_of::<bf16>(t, &w[j0 * k..(j0 + nt) * k]),
            Source::Quant(q) => with_buf(&ROWS, nt * k, |rows| {
                dequantize_rows(q, j0, nt, rows);
                columns_of(t, rows)
            }),
            Source::Packed(p) => {
                // the task's groups (j0 is a multiple of NR)
                let (lo, hi) = (j0 * k, (j0 + nt).div_ceil(NR) * NR * k);
                match &p.data {
                    PackedData::F32(d) => columns_packed(t, &d[lo..hi]),
                    PackedData::Bf16(d) => columns_packed(t, &d[lo..hi]),
                }
            }
        }
    }

    /// The task's columns from its groups `w` of a `PackedMatrix`, `KC` deep at a time as x is packed. (A window of
    /// one row panel taking the whole depth at once, each group streamed in one pass, measured the same.)
    unsafe fn columns_packed<E: Panel>(t: Task<'_>, w: &[E]) {
        for kc0 in (0..t.k).step_by(KC) {
            let kc = KC.min(t.k - kc0);
            sweep(t, kc0, kc, |g| w.as_ptr().add(g * NR * t.k + kc0 * NR));
        }
    }

    /// The task's columns from its weight rows `w` (nt × k), packed here `KC` deep at a time.
    unsafe fn columns_of<E: WeightElem>(t: Task<'_>, w: &[E]) {
        let groups = t.nt.div_ceil(NR);
        with_buf(&B, KC * groups * NR, |b| {
            for kc0 in (0..t.k).step_by(KC) {
                let kc = KC.min(t.k - kc0);
                pack_w(w, t.k, t.nt, kc0, kc, b);
                let b: &[f32] = b;
                sweep(t, kc0, kc, |g| b.as_ptr().add(g * NR * kc));
            }
        });
    }

    /// One depth block [kc0, kc0 + kc) of the task's columns: `b(g)` points at group g's `NR`-wide values at depth
    /// kc0, consecutive depths `NR` apart. Full row panels take the `MR` × `NR` tile, `MC` rows of x at a time over
    /// each group; the last rows (fewer than `MR`) a tile as wide as its accumulators allow.
    unsafe fn sweep<E: Panel>(t: Task<'_>, kc0: usize, kc: usize, b: impl Fn(usize) -> *const E) {
        let Task { a, m, m_pad, j0, nt, n, y, .. } = t;
        let groups = nt.div_ceil(NR);
        let full = m / MR * MR;
        let acc = kc0 > 0;
        for i0 in (0..full).step_by(MC) {
            for g in 0..groups {
                let cols = NR.min(nt - g * NR);
                for i in (i0..(i0 + MC).min(full)).step_by(MR) {
                    let ap = a.as_ptr().add(kc0 * m_pad + i * kc);
                    let c = y.offset(i * n + j0 + g * NR).0;
                    if cols == NR {
                        tile::<E, MR, 1>(kc, ap, [b(g)], c, n, acc);
                    } else {
                        edge_tile::<E, MR>(kc, ap, b(g), c, n, cols, acc);
                    }
                }
            }
        }
        let ap = a.as_ptr().add(kc0 * m_pad + full * kc);
        let c = y.offset(full * n + j0).0;
        match m - full {
            0 => {}
            1 => last_rows::<E, 1, 4>(kc, ap, &b, nt, c, n, acc),
            2 => last_rows::<E, 2, 2>(kc, ap, &b, nt, c, n, acc),
            3 => last_rows::<E, 3, 2>(kc, ap, &b, nt, c, n, acc),
            4 => last_rows::<E, 4, 1>(kc, ap, &b, nt, c, n, acc),
            _ => last_rows::<E, 5, 1>(kc, ap, &b, nt, c, n, acc),
        }
    }

    /// The last `R` (< `MR`) rows over every group: `P` groups per tile (2 · R · P accumulators), then what is left.
    #[allow(clippy::too_many_arguments)]
    unsafe fn last_rows<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> *const E,
        nt: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) {
        let whole = nt / NR;
        let mut g = 0;
        while g + P <= whole {
            tile::<E, R, P>(kc, a, std::array::from_fn(|q| b(g + q)), c.add(g * NR), n, acc);
            g += P;
        }
        match whole - g {
            0 => {}
            1 => tile::<E, R, 1>(kc, a, [b(g)], c.add(g * NR), n, acc),
            2 => tile::<E, R, 2>(kc, a, [b(g), b(g + 1)], c.add(g * NR), n, acc),
            _ => tile::<E, R, 3>(kc, a, [b(g), b(g + 1), b(g + 2)], c.add(g * NR), n, acc),
        }
        if whole * NR < nt {
            edge_tile::<E, R>(kc, a, b(whole), c.add(whole * NR), n, nt - whole * NR, acc);
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
                    let v: [__m256; 8] =
                        std::array::from_fn(|r| rows[r].map_or(_mm256_setzero_ps(), |q| load8(q.add(p0))));
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

    /// Rows r0..r7 of an 8 × 8 block → its columns (out[j][r] = v[r][j]).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(v[0], v[1]);
        let t1 = _mm256_unpackhi_ps(v[0], v[1]);
        let t2 = _mm256_unpacklo_ps(v[2], v[3]);
        let t3 = _mm256_unpackhi_ps(v[2], v[3]);
        let t4 = _mm256_unpacklo_ps(v[4], v[5]);
        let t5 = _mm256_unpackhi_ps(v[4], v[5]);
        let t6 = _mm256_unpacklo_ps(v[6], v[7]);
        let t7 = _mm256_unpackhi_ps(v[6], v[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }

    /// How a tile reads `NR` weights of one depth: packed f32 (two loads), or a `PackedMatrix`'s bf16 pairs (one
    /// load, widened: each 32-bit lane's low half shifted up is column i, its high half masked column 8 + i).
    pub(super) trait Panel: Copy {
        unsafe fn load(p: *const Self) -> (__m256, __m256);
    }

    impl Panel for f32 {
        #[inline(always)]
        unsafe fn load(p: *const f32) -> (__m256, __m256) {
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
    }

    impl Panel for u16 {
        #[inline(always)]
        unsafe fn load(p: *const u16) -> (__m256, __m256) {
            let v = _mm256_loadu_si256(p as *const __m256i);
            let lo = _mm256_slli_epi32::<16>(v);
            let hi = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
            (_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi))
        }
    }

    /// A tile with fewer than `NR` valid columns (`R` rows, one group), through a full-width copy.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn edge_tile<E: Panel, const R: usize>(
        kc: usize,
        a: *const f32,
        b: *const E,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        acc: bool,
    ) {
        let mut t = [[0f32; NR]; R];
        if acc {
            for (r, t) in t.iter_mut().enumerate() {
                for (j, t) in t.iter_mut().enumerate().take(cols) {
                    *t = *c.add(r * ldc + j);
                }
            }
        }
        tile::<E, R, 1>(kc, a, [b], t.as_mut_ptr() as *mut f32, NR, acc);
        for (r, t) in t.iter().enumerate() {
            for (j, t) in t.iter().enumerate().take(cols) {
                *c.add(r * ldc + j) = *t;
            }
        }
    }

    /// c (`R` rows × `P` groups of `NR` columns, row stride ldc) = (acc ? c : 0) + Σ_p a_p ⊗ b_p over kc depths, one
    /// FMA per element and depth in order. `a`: packed x (`MR` values per depth, the first `R` used); `b[q]`: group
    /// q's weights, `NR` per depth. Whatever `R` and `P`, each element is the same chain.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: [*const E; P],
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        let mut s = [[[_mm256_setzero_ps(); 2]; P]; R];
        if acc {
            for (r, s) in s.iter_mut().enumerate() {
                for (q, s) in s.iter_mut().enumerate() {
                    s[0] = _mm256_loadu_ps(c.add(r * ldc + q * NR));
                    s[1] = _mm256_loadu_ps(c.add(r * ldc + q * NR + 8));
                }
            }
        }
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            if P == 1 {
                let (b0, b1) = E::load(b[0]);
                for (r, s) in s.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*a.add(r));
                    s[0][0] = _mm256_fmadd_ps(x, b0, s[0][0]);
                    s[0][1] = _mm256_fmadd_ps(x, b1, s[0][1]);
                }
            } else {
                // few rows, several groups: each x value broadcast once per depth
                let x: [__m256; R] = std::array::from_fn(|r| _mm256_broadcast_ss(&*a.add(r)));
                for q in 0..P {
                    let (b0, b1) = E::load(b[q]);
                    for (r, s) in s.iter_mut().enumerate() {
                        s[q][0] = _mm256_fmadd_ps(x[r], b0, s[q][0]);
                        s[q][1] = _mm256_fmadd_ps(x[r], b1, s[q][1]);
                    }
                }
            }
            a = a.add(MR);
            for b in b.iter_mut() {
                *b = b.add(NR);
            }
        }
        for (r, s) in s.iter().enumerate() {
            for (q, s) in s.iter().enumerate() {
                _mm256_storeu_ps(c.add(r * ldc + q * NR), s[0]);
                _mm256_storeu_ps(c.add(r * ldc + q * NR + 8), s[1]);
            }
        }
    }
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

    /// The packed product's contract: each element is the in-order f32 fused-multiply-add chain over k from 0.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn packed_elements_are_the_in_order_fma_chain_whatever_the_rows_and_split() {
        if !packed::available() {
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
            for par in [usize::MAX, 1] {
                assert_eq!(matmul_t(&x, m, k, Source::F32(&w), n, par), want, "{m}x{k}x{n} par {par}");
                // a row alone gives its bits in the stacked product
                let r = m / 2;
                assert_eq!(matmul_t(&x[r * k..(r + 1) * k], 1, k, Source::F32(&w), n, par), want[r * n..(r + 1) * n]);
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
        for (k, n) in [(300usize, 141usize), (64, 16), (257, 200), (31, 7), (512, 1030)] {
            let w = randn(n * k, 7);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let pf = PackedMatrix::from_tensor(&tensor(w.clone(), n, k)).unwrap().unwrap();
            let pb = PackedMatrix::from_tensor(&tensor(wb.clone(), n, k)).unwrap().unwrap();
            assert!(!pf.is_bf16() && pb.is_bf16());
            let x = randn(20 * k, 8);
            let chain = |w: &[f32], m: usize| -> Vec<f32> {
                (0..m * n)
                    .map(|e| {
                        let (r, c) = (e / n, e % n);
                        (0..k).fold(0f32, |acc, i| x[r * k + i].mul_add(w[c * k + i], acc))
                    })
                    .collect()
            };
            for m in (1..=13).chain([20]) {
                let (want_f, want_b) = (chain(&w, m), chain(&wb32, m));
                for par in [usize::MAX, 1] {
                    let xs = &x[..m * k];
                    assert_eq!(matmul_t(xs, m, k, Source::Packed(&pf), n, par), want_f, "f32 {m}x{k}x{n} par {par}");
                    assert_eq!(matmul_t(xs, m, k, Source::Packed(&pb), n, par), want_b, "bf16 {m}x{k}x{n} par {par}");
                    assert_eq!(matmul_t(xs, m, k, Source::Bf16(&wb), n, par), want_b, "per call {m}x{k}x{n}");
                    let r = m - 1;
                    let alone = matmul_t(&x[r * k..(r + 1) * k], 1, k, Source::Packed(&pb), n, par);
                    assert_eq!(alone, want_b[r * n..(r + 1) * n]);
                }
            }
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

//! `x · Wᵀ` on the CPU in f32 for windows of few rows (a decode window: 1 to a few dozen tokens).
//!
//! candle's CPU matmul (the `gemm` crate) packs the weight matrix into panels on every call; when x has a handful of
//! rows that repacking costs more than the arithmetic (on the 0.5B shape a 4-row product took several times a 1-row
//! one, where streaming the weight once should make them about equal: benches/results/cpu-forward.md). This kernel
//! streams each weight row once from memory and keeps a small tile of x and accumulators in registers: 4 weight rows ×
//! up to 4 x rows per tile, `L` f32 lanes each. It is split over output columns on the rayon pool it is called from
//! (the engine's, see `on_cpu_pool`; candle's matmul parallelises on it too) and picks AVX-512 / AVX2+FMA at run time.
//! Weights may be f32 or bf16 (widened in registers).
//!
//! Numerics: each output is one f32 dot product summed in `L` lane-wise partial sums then reduced; the result differs
//! from gemm's only by summation order.
//!
//! On CPUs with the packed product (x86-64, AVX2 + FMA) dense matrices are packed at load
//! ([`panels::PackedMatrix`](crate::kernels::panels::PackedMatrix)) and every window goes there (`linear_packed`), as
//! are quantized ones; this kernel then takes row-major and quantized matrices where packing is off
//! ([`Kernels::packed_weights`](crate::kernels::Kernels::packed_weights)) or unavailable.

use crate::kernels::blocks::QMatrix;
#[cfg(target_arch = "x86_64")]
use crate::kernels::blocks::QuantFormat;
use crate::kernels::cpu::Cpu;
use crate::kernels::simd::{Out, WeightElem};
use crate::kernels::unpack::dequantize_rows_on;
use rayon::prelude::*;

/// Which tiles the few-row products run (from `Cpu`; tests run every one this CPU has).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tile {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// aarch64 (NEON has fused multiply-add) or plain SSE2.
    Baseline,
}

impl Tile {
    /// The widest tiles this CPU runs.
    fn best() -> Tile {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = Cpu::get();
            if cpu.avx512() {
                return Tile::Avx512;
            }
            if cpu.avx2() {
                return Tile::Avx2;
            }
        }
        Tile::Baseline
    }
}

/// Rows of x a task multiplies at once (stacked windows of many sequences are cut into such blocks, so x stays
/// in cache while the task's weight rows stream by).
const ROW_BLOCK: usize = 64;

/// Weight rows per parallel task: 4-row multiples, at least 16 and at most about 256, for a task count that is a
/// multiple of the threads (at least 2 per thread), so that work stays balanced (5 equal tasks on 2 threads
/// would leave one idle for a fifth of the product).
fn rows_per_task(n: usize, threads: usize) -> usize {
    let tasks = n.div_ceil(256).max(2 * threads).div_ceil(threads) * threads;
    (n.div_ceil(tasks).div_ceil(4) * 4).max(16)
}

/// Portable tile (other CPUs): dot products of x rows `xs` (each `k` long) with 4 weight rows, `L` lane sums.
/// Returns `acc[r][c] = <xs[r], w_c>`.
#[inline(always)]
fn tile<E: WeightElem, const L: usize, const R: usize>(
    xs: [&[f32]; R],
    ws: [&[E]; 4],
    _: Prefetch,
    k: usize,
) -> [[f32; 4]; R] {
    let mut acc = [[[0f32; L]; 4]; R];
    let body = k / L * L;
    let mut i = 0;
    while i < body {
        for r in 0..R {
            let xv: &[f32; L] = xs[r][i..i + L].try_into().unwrap();
            for c in 0..4 {
                let wv: &[E; L] = ws[c][i..i + L].try_into().unwrap();
                for l in 0..L {
                    acc[r][c][l] += xv[l] * wv[l].to_f32();
                }
            }
        }
        i += L;
    }
    let mut out = [[0f32; 4]; R];
    for r in 0..R {
        for c in 0..4 {
            let mut s = acc[r][c].iter().sum::<f32>();
            for j in body..k {
                s += xs[r][j] * ws[c][j].to_f32();
            }
            out[r][c] = s;
        }
    }
    out
}

/// Columns [n0, n0 + nw) of y = x · Wᵀ, written into `y` (row-major m × n, full width `n`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns<E: WeightElem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    n0: usize,
    nw: usize,
    n: usize,
    y: Out,
    tile4: impl Fn([&[f32]; 4], [&[E]; 4], Prefetch, usize) -> [[f32; 4]; 4],
    tile2: impl Fn([&[f32]; 2], [&[E]; 4], Prefetch, usize) -> [[f32; 4]; 2],
    tile1: impl Fn([&[f32]; 1], [&[E]; 4], Prefetch, usize) -> [[f32; 4]; 1],
) {
    let wrow = |j: usize| &w[j * k..(j + 1) * k];
    let xrow = |r: usize| &x[r * k..(r + 1) * k];
    let mut j = n0;
    let end = n0 + nw;
    while j < end {
        // a 4-row weight tile; the tail reuses the last row (its results are not stored)
        let idx = [j, (j + 1).min(end - 1), (j + 2).min(end - 1), (j + 3).min(end - 1)];
        let ws = [wrow(idx[0]), wrow(idx[1]), wrow(idx[2]), wrow(idx[3])];
        let valid = (end - j).min(4);
        // the next tile's weight rows, fetched while this one computes (its rows are short streams that the
        // hardware prefetcher would only pick up after a few misses each); once per tile: by the first x rows
        let next = Prefetch::after(w.as_ptr() as *const u8, j, end, k * std::mem::size_of::<E>());
        let mut r = 0;
        let pf = |r: usize| if r == 0 { next } else { Prefetch::NONE };
        // SAFETY (each store): x rows r.. of the tile and its valid weight rows are inside y, and only this task
        // writes columns [n0, n0 + nw).
        while r + 4 <= m {
            unsafe {
                store_tile(y, &tile4([xrow(r), xrow(r + 1), xrow(r + 2), xrow(r + 3)], ws, pf(r), k), r, j, valid, n)
            };
            r += 4;
        }
        if r + 2 <= m {
            unsafe { store_tile(y, &tile2([xrow(r), xrow(r + 1)], ws, pf(r), k), r, j, valid, n) };
            r += 2;
        }
        if r < m {
            unsafe { store_tile(y, &tile1([xrow(r)], ws, pf(r), k), r, j, valid, n) };
        }
        j += 4;
    }
}

/// Where a tile fetches the next tile's weight rows ahead (null: nothing to fetch). Fetching never changes results.
/// (Only the x86 tiles fetch ahead; elsewhere the addresses are computed and unused.)
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Prefetch([*const u8; 4]);

impl Prefetch {
    const NONE: Prefetch = Prefetch([std::ptr::null(); 4]);
    /// The 4 weight rows after the tile at row `j` (of rows ending at `end`, `stride` bytes apart from `base`).
    fn after(base: *const u8, j: usize, end: usize, stride: usize) -> Prefetch {
        Prefetch::rows(base, j + 4, end, stride)
    }
    /// Rows `first..first + 4` (clamped before `end`; a tile of fewer weight rows fetches its first ones).
    fn rows(base: *const u8, first: usize, end: usize, stride: usize) -> Prefetch {
        Prefetch(rows4(base, first, end, stride))
    }
    #[cfg(target_arch = "x86_64")]
    fn active(&self) -> bool {
        !self.0[0].is_null()
    }
}

/// The starts of rows `first..first + 4` (clamped to the last row before `end`), `stride` bytes apart from `base`.
fn rows4(base: *const u8, first: usize, end: usize, stride: usize) -> [*const u8; 4] {
    [0, 1, 2, 3].map(|c| base.wrapping_add((first + c).min(end - 1) * stride))
}

/// Store a tile's results: `acc[r][c]` is `y[r0 + r][j + c]`, for the first `valid` weight rows (a tail tile repeats
/// its last row, whose results are not stored).
///
/// # Safety
/// Those entries are inside y (m × n) and only this task writes columns j..j + valid.
#[inline(always)]
unsafe fn store_tile<const C: usize, const R: usize>(
    y: Out,
    acc: &[[f32; C]; R],
    r0: usize,
    j: usize,
    valid: usize,
    n: usize,
) {
    for (r, row) in acc.iter().enumerate() {
        for (c, &v) in row.iter().take(valid).enumerate() {
            y.write((r0 + r) * n + j + c, v);
        }
    }
}

/// The tile of `tile` with AVX-512 (16 lanes) or AVX2+FMA (8 lanes) intrinsics: the x rows' loads are
/// shared by the 4 weight rows and each weight load by the R x rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
mod x86 {
    use crate::kernels::blocks::QMatrix;
    use crate::kernels::simd::{hsum256, load8, WeightElem};
    use crate::kernels::unpack::x86::*;
    use std::arch::x86_64::*;

    /// 16 weights as f32 lanes (bf16: zero-extend to 32 bits and shift into the high half).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<E: WeightElem>(p: *const E) -> __m512 {
        if E::BF16 {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_loadu_ps(p as *const f32)
        }
    }

    /// One step of every tile below: the x lanes `$x` of each of the R x rows (`$ri` names the row), the weight
    /// lanes `$w` of each of the `$c` weight rows (`$ci` names it; formed once, shared by the R x rows), and
    /// `acc[r][c] += x_r · w_c`.
    macro_rules! tile_step {
        ($r:ident, $c:expr, $zero:ident, $loadx:ident, $fma:ident, $acc:ident, |$ri:ident| $x:expr, |$ci:ident| $w:expr) => {{
            let mut xv = [$zero(); $r];
            for $ri in 0..$r {
                xv[$ri] = $loadx($x);
            }
            for $ci in 0..$c {
                let wv = $w;
                for r in 0..$r {
                    $acc[r][$ci] = $fma(xv[r], wv, $acc[r][$ci]);
                }
            }
        }};
    }

    /// One tile function per instruction set: `$lanes` f32 lanes per register, x loads shared by the 4 weight
    /// rows, each weight load shared by the R x rows, one reduction per accumulator at the end.
    macro_rules! tile_fn {
        ($name:ident, $feature:literal, $lanes:literal, $zero:ident, $loadx:ident, $loadw:ident, $fma:ident, $sum:ident) => {
            #[target_feature(enable = $feature)]
            pub unsafe fn $name<E: WeightElem, const R: usize>(
                xs: [&[f32]; R],
                ws: [&[E]; 4],
                pf: super::Prefetch,
                k: usize,
            ) -> [[f32; 4]; R] {
                let mut acc = [[$zero(); 4]; R];
                let mut i = 0;
                let fetch = pf.active();
                let es = std::mem::size_of::<E>();
                while i + $lanes <= k {
                    if fetch && (i * es) % 64 == 0 {
                        for c in 0..4 {
                            _mm_prefetch::<_MM_HINT_T0>(pf.0[c].wrapping_add(i * es) as *const i8);
                        }
                    }
                    tile_step!(R, 4, $zero, $loadx, $fma, acc, |r| xs[r].as_ptr().add(i), |c| $loadw(
                        ws[c].as_ptr().add(i)
                    ));
                    i += $lanes;
                }
                let mut out = [[0f32; 4]; R];
                for r in 0..R {
                    for c in 0..4 {
                        let mut s = $sum(acc[r][c]);
                        for j in i..k {
                            s += xs[r][j] * ws[c][j].to_f32();
                        }
                        out[r][c] = s;
                    }
                }
                out
            }
        };
    }

    tile_fn!(
        tile_avx512,
        "avx512f",
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        load16,
        _mm512_fmadd_ps,
        _mm512_reduce_add_ps
    );
    tile_fn!(tile_avx2, "avx2,fma", 8, _mm256_setzero_ps, _mm256_loadu_ps, load8, _mm256_fmadd_ps, hsum256);

    /// The loop of the fused (in-register) kernels over columns [n0, n0 + nw): one or two x rows take 4 weight
    /// rows at a time (`tile::<4, R>`: a one-row window is bound by memory, the 4 rows' streams keep it busy);
    /// longer windows take 2 weight rows at a time with x rows `$rmax` at a time (`tile::<2, R>`, then the rows
    /// left), so each weight value is decoded once per `$rmax` x rows (4; 3 for the k-quants with a min, whose
    /// 4-row tile runs out of registers and is slower). The first x rows fetch the next weight rows ahead.
    /// Every tile computes each output the same way (lane-wise multiply-adds along k, one reduction), so the tile
    /// shape never changes a result.
    macro_rules! fused_rows {
        ($feature:literal, $tile:ident, $rmax:literal, $x:ident, $m:ident, $q:ident, $n0:ident, $nw:ident, $y:ident) => {
            /// One tile shape, in a function of its own (with several shapes inlined into one function LLVM
            /// stopped unrolling the k-quant tiles, and they ran slower).
            #[inline(never)]
            #[target_feature(enable = $feature)]
            unsafe fn shape<const C: usize, const R: usize>(
                xs: [*const f32; R],
                ws: [*const u8; C],
                pf: super::Prefetch,
                k: usize,
            ) -> [[f32; C]; R] {
                $tile::<C, R>(xs, ws, pf, k)
            }
            let (n, k, rb) = ($q.n, $q.k, $q.row_bytes());
            let base = $q.bytes().as_ptr();
            let end = $n0 + $nw;
            let xp = $x.as_ptr();
            let xs = |r: usize| xp.add(r * k);
            let y = $y;
            if $m <= 2 {
                for j in ($n0..end).step_by(4) {
                    let (ws, pf) = (super::rows4(base, j, end, rb), super::Prefetch::after(base, j, end, rb));
                    let valid = (end - j).min(4);
                    match $m {
                        2 => super::store_tile(y, &shape::<4, 2>([xs(0), xs(1)], ws, pf, k), 0, j, valid, n),
                        1 => super::store_tile(y, &shape::<4, 1>([xs(0)], ws, pf, k), 0, j, valid, n),
                        _ => {}
                    }
                }
            } else {
                for j in ($n0..end).step_by(2) {
                    let w4 = super::rows4(base, j, end, rb);
                    let ws = [w4[0], w4[1]];
                    let next = super::Prefetch::rows(base, j + 2, end, rb);
                    let valid = (end - j).min(2);
                    let mut r = 0;
                    while r < $m {
                        let pf = if r == 0 { next } else { super::Prefetch::NONE };
                        let left = ($m - r).min($rmax);
                        let xr = |i: usize| xs(r + i);
                        match left {
                            1 => super::store_tile(y, &shape::<2, 1>([xr(0)], ws, pf, k), r, j, valid, n),
                            2 => super::store_tile(y, &shape::<2, 2>([xr(0), xr(1)], ws, pf, k), r, j, valid, n),
                            3 => super::store_tile(y, &shape::<2, 3>([xr(0), xr(1), xr(2)], ws, pf, k), r, j, valid, n),
                            _ => {
                                let a = shape::<2, 4>([xr(0), xr(1), xr(2), xr(3)], ws, pf, k);
                                super::store_tile(y, &a, r, j, valid, n)
                            }
                        }
                        r += left;
                    }
                }
            }
        };
    }

    /// Columns [n0, n0 + nw) of y = x · Wᵀ for a q6_k (or q3_k) W and a few x rows (`fused_rows`), dequantizing in
    /// registers: a super-block of each of the C weight rows decoded to bytes (`$ints`: `q6_ints` / `q3k_ints`),
    /// then per sub-block of 16 the value (d·sc)·q (`$factors`: its 16 d·sc) and the multiply-adds in the order of
    /// the f32 tile over the dequantized scratch, so the same bits. `$bb`: bytes per super-block.
    macro_rules! q6k_fused_fn {
        ($name:ident, $feature:literal, $lanes:literal, $zero:ident, $loadx:ident, $loadq:ident, $set1:ident, $mul:ident, $_sub:ident, $fma:ident, $sum:ident, $bb:literal, $ints:ident, $factors:ident) => {
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: super::Out) {
                #[inline(always)]
                unsafe fn tile<const C: usize, const R: usize>(
                    xs: [*const f32; R],
                    ws: [*const u8; C],
                    pf: super::Prefetch,
                    k: usize,
                ) -> [[f32; C]; R] {
                    let mut acc = [[$zero(); C]; R];
                    let mut buf = [[0i8; 256]; C];
                    for sb in 0..k / 256 {
                        let b = ws.map(|w| w.add($bb * sb));
                        for c in 0..C {
                            if pf.active() {
                                for l in 0..($bb as usize).div_ceil(64) {
                                    _mm_prefetch::<_MM_HINT_T0>(pf.0[c].wrapping_add($bb * sb + 64 * l) as *const i8);
                                }
                            }
                            $ints(b[c], &mut buf[c]);
                        }
                        let f = b.map(|p| $factors(p));
                        for s in 0..16 {
                            let mut ds = [$zero(); C];
                            for c in 0..C {
                                ds[c] = $set1(f[c][s]);
                            }
                            for t in 0..16 / $lanes {
                                let i = 256 * sb + 16 * s + $lanes * t;
                                tile_step!(R, C, $zero, $loadx, $fma, acc, |r| xs[r].add(i), |c| $mul(
                                    ds[c],
                                    $loadq(buf[c].as_ptr().add(16 * s + $lanes * t) as *const u8)
                                ));
                            }
                        }
                    }
                    acc.map(|a| a.map(|v| $sum(v)))
                }
                fused_rows!($feature, tile, 4, x, m, q, n0, nw, y);
            }
        };
    }
    /// Columns [n0, n0 + nw) of y = x · Wᵀ for a q8_0 (or q5_0) W and a few x rows, dequantizing in registers:
    /// the same values (q·d) and the same multiply-adds in the same order as the f32 tile over the dequantized
    /// scratch (`q_columns`), so the same results bit for bit, without the scratch's store and reload (a 1-row
    /// window streams the weights once and is bound by memory). `$bb`: bytes per block of 32; `$ints`: a block's
    /// 32 signed 8-bit values (q8_0: its bytes after the scale; q5_0: decoded into the buffer).
    macro_rules! q8_fused_fn {
        ($name:ident, $feature:literal, $lanes:literal, $zero:ident, $loadx:ident, $loadq:ident, $set1:ident, $mul:ident, $_sub:ident, $fma:ident, $sum:ident, $bb:literal, $ints:ident) => {
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: super::Out) {
                #[inline(always)]
                unsafe fn tile<const C: usize, const R: usize>(
                    xs: [*const f32; R],
                    ws: [*const u8; C],
                    pf: super::Prefetch,
                    k: usize,
                ) -> [[f32; C]; R] {
                    let mut acc = [[$zero(); C]; R];
                    let mut buf = [[0i8; 32]; C];
                    for blk in 0..k / 32 {
                        if blk % 2 == 0 && pf.active() {
                            for c in 0..C {
                                _mm_prefetch::<_MM_HINT_T0>(pf.0[c].wrapping_add($bb * blk) as *const i8);
                            }
                        }
                        let mut d = [$zero(); C];
                        let mut qv = [std::ptr::null::<u8>(); C];
                        for c in 0..C {
                            d[c] = $set1(scale(ws[c].add($bb * blk)));
                            qv[c] = $ints(ws[c].add($bb * blk), &mut buf[c]);
                        }
                        for g in 0..32 / $lanes {
                            let i = 32 * blk + $lanes * g;
                            tile_step!(R, C, $zero, $loadx, $fma, acc, |r| xs[r].add(i), |c| $mul(
                                $loadq(qv[c].add($lanes * g)),
                                d[c]
                            ));
                        }
                    }
                    acc.map(|a| a.map(|v| $sum(v)))
                }
                fused_rows!($feature, tile, 4, x, m, q, n0, nw, y);
            }
        };
    }

    /// Columns [n0, n0 + nw) of y = x · Wᵀ for a q4_k (or q5_k, q2_k) W and a few x rows (`fused_rows`), dequantizing
    /// in registers: a super-block of each of the C weight rows decoded to bytes (`$ints`), then per sub-block of `$sl`
    /// values (32; q2_k 16) the value (d·sc)·q − dmin·m (`$factors`: each sub-block's d·sc and dmin·m) and the
    /// multiply-adds in the order of the f32 tile over the dequantized scratch, so the same bits. `$bb`: bytes per
    /// super-block.
    macro_rules! q4k_fused_fn {
        ($name:ident, $feature:literal, $lanes:literal, $zero:ident, $loadx:ident, $loadq:ident, $set1:ident, $mul:ident, $sub:ident, $fma:ident, $sum:ident, $bb:literal, $ints:ident, $sl:literal, $factors:ident) => {
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: super::Out) {
                #[inline(always)]
                unsafe fn tile<const C: usize, const R: usize>(
                    xs: [*const f32; R],
                    ws: [*const u8; C],
                    pf: super::Prefetch,
                    k: usize,
                ) -> [[f32; C]; R] {
                    let mut acc = [[$zero(); C]; R];
                    let mut buf = [[0i8; 256]; C];
                    let mut dm = [[(0f32, 0f32); 256 / $sl]; C];
                    for sb in 0..k / 256 {
                        let b = ws.map(|w| w.add($bb * sb));
                        for c in 0..C {
                            if pf.active() {
                                for l in 0..($bb as usize).div_ceil(64) {
                                    _mm_prefetch::<_MM_HINT_T0>(pf.0[c].wrapping_add($bb * sb + 64 * l) as *const i8);
                                }
                            }
                            $ints(b[c], &mut buf[c]);
                            $factors!(b[c], dm[c]);
                        }
                        for j in 0..256 / $sl {
                            let d1 = dm.map(|r| $set1(r[j].0));
                            let m1 = dm.map(|r| $set1(r[j].1));
                            for t in 0..$sl / $lanes {
                                let i = 256 * sb + $sl * j + $lanes * t;
                                tile_step!(R, C, $zero, $loadx, $fma, acc, |r| xs[r].add(i), |c| $sub(
                                    $mul(d1[c], $loadq(buf[c].as_ptr().add($sl * j + $lanes * t) as *const u8)),
                                    m1[c]
                                ));
                            }
                        }
                    }
                    acc.map(|a| a.map(|v| $sum(v)))
                }
                fused_rows!($feature, tile, 3, x, m, q, n0, nw, y);
            }
        };
    }
    /// A fused kernel family (`q8_fused_fn`, `q4k_fused_fn`, `q6k_fused_fn`) instantiated for AVX2 and for AVX-512
    /// (whose CPUs have AVX2, FMA and F16C too, see `isa`), followed by the family's own arguments.
    macro_rules! avx2_and_avx512 {
        ($family:ident, $avx2:ident, $avx512:ident $(, $extra:tt)*) => {
            $family!(
                $avx2,
                "avx2,fma,f16c",
                8,
                _mm256_setzero_ps,
                _mm256_loadu_ps,
                q8_8,
                _mm256_set1_ps,
                _mm256_mul_ps,
                _mm256_sub_ps,
                _mm256_fmadd_ps,
                hsum256
                $(, $extra)*
            );
            $family!(
                $avx512,
                "avx512f,avx2,fma,f16c",
                16,
                _mm512_setzero_ps,
                _mm512_loadu_ps,
                q8_16,
                _mm512_set1_ps,
                _mm512_mul_ps,
                _mm512_sub_ps,
                _mm512_fmadd_ps,
                _mm512_reduce_add_ps
                $(, $extra)*
            );
        };
    }
    avx2_and_avx512!(q8_fused_fn, q8_fused_avx2, q8_fused_avx512, 34, q8_ints);
    avx2_and_avx512!(q8_fused_fn, q5_fused_avx2, q5_fused_avx512, 22, q5_ints);
    avx2_and_avx512!(q8_fused_fn, q4_0_fused_avx2, q4_0_fused_avx512, 18, q4_0_ints);
    avx2_and_avx512!(q4k_fused_fn, q4k_fused_avx2, q4k_fused_avx512, 144, q4_ints, 32, q4k_factors);
    avx2_and_avx512!(q4k_fused_fn, q5k_fused_avx2, q5k_fused_avx512, 176, q5k_ints, 32, q4k_factors);
    avx2_and_avx512!(q4k_fused_fn, q2k_fused_avx2, q2k_fused_avx512, 84, q2k_ints, 16, q2k_factors);
    avx2_and_avx512!(q6k_fused_fn, q6k_fused_avx2, q6k_fused_avx512, 210, q6_ints, q6k_factors);
    avx2_and_avx512!(q6k_fused_fn, q3k_fused_avx2, q3k_fused_avx512, 110, q3k_ints, q3k_factors);

    #[target_feature(enable = "avx512f")]
    pub unsafe fn columns_avx512<E: WeightElem>(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[E],
        n0: usize,
        nw: usize,
        n: usize,
        y: super::Out,
    ) {
        super::columns(
            x,
            m,
            k,
            w,
            n0,
            nw,
            n,
            y,
            |a, b, p, k| tile_avx512::<E, 4>(a, b, p, k),
            |a, b, p, k| tile_avx512::<E, 2>(a, b, p, k),
            |a, b, p, k| tile_avx512::<E, 1>(a, b, p, k),
        )
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn q_columns_avx512(
        x: &[f32],
        m: usize,
        q: &QMatrix,
        n0: usize,
        nw: usize,
        y: super::Out,
        s: &mut [f32],
    ) {
        super::q_columns(super::Tile::Avx512, x, m, q, n0, nw, y, s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q_columns_avx2(x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: super::Out, s: &mut [f32]) {
        super::q_columns(super::Tile::Avx2, x, m, q, n0, nw, y, s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn columns_avx2<E: WeightElem>(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[E],
        n0: usize,
        nw: usize,
        n: usize,
        y: super::Out,
    ) {
        // 16 ymm registers hold a 2 x 4 tile of accumulators; 4 rows are two such tiles.
        let tile4 = |a: [&[f32]; 4], b: [&[E]; 4], pf: super::Prefetch, k: usize| {
            let (p, q) = (
                tile_avx2::<E, 2>([a[0], a[1]], b, pf, k),
                tile_avx2::<E, 2>([a[2], a[3]], b, super::Prefetch::NONE, k),
            );
            [p[0], p[1], q[0], q[1]]
        };
        super::columns(
            x,
            m,
            k,
            w,
            n0,
            nw,
            n,
            y,
            tile4,
            |a, b, p, k| tile_avx2::<E, 2>(a, b, p, k),
            |a, b, p, k| tile_avx2::<E, 1>(a, b, p, k),
        )
    }
}

/// y (m × n) = x (m × k) · Wᵀ, W (n × k), all row-major; parallel on the calling pool from `par_min_macs`
/// multiply-adds.
pub fn matmul_t<E: WeightElem>(x: &[f32], m: usize, k: usize, w: &[E], n: usize, par_min_macs: usize) -> Vec<f32> {
    matmul_t_with(Tile::best(), x, m, k, w, n, par_min_macs)
}

fn matmul_t_with<E: WeightElem>(
    isa: Tile,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    n: usize,
    par_min_macs: usize,
) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    by_columns(m, k, n, par_min_macs, |n0, nw, out| {
        // x in blocks of ROW_BLOCK rows (a decode window is one block): each dot product is computed the same way
        // whatever the block, so a row's result never depends on the other rows.
        for r0 in (0..m).step_by(ROW_BLOCK) {
            let mb = ROW_BLOCK.min(m - r0);
            // SAFETY: rows r0.. of y start at r0 * n, inside y.
            let yb = unsafe { out.offset(r0 * n) };
            // SAFETY: `isa` is one this CPU has (`Tile::best()` checked it).
            unsafe { columns_on(isa, &x[r0 * k..(r0 + mb) * k], mb, k, w, n0, nw, n, yb) };
        }
    })
}

/// Columns [n0, n0 + nw) of y = x · Wᵀ with the tile of `isa`.
///
/// # Safety
/// The CPU has `isa`'s features; `y` is m × n and only this caller writes columns [n0, n0 + nw).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn columns_on<E: WeightElem>(
    isa: Tile,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    n0: usize,
    nw: usize,
    n: usize,
    y: Out,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Tile::Avx512 => x86::columns_avx512(x, m, k, w, n0, nw, n, y),
        #[cfg(target_arch = "x86_64")]
        Tile::Avx2 => x86::columns_avx2(x, m, k, w, n0, nw, n, y),
        Tile::Baseline => columns(x, m, k, w, n0, nw, n, y, tile::<E, 8, 4>, tile::<E, 8, 2>, tile::<E, 8, 1>),
    }
}

/// y (m × n), computed by `task(n0, nw, y)` over column ranges: in parallel tasks on the calling pool from
/// `par_min_macs` multiply-adds (m·n·k), else in one task. Each task writes only its columns.
fn by_columns(m: usize, k: usize, n: usize, par_min_macs: usize, task: impl Fn(usize, usize, Out) + Sync) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    let out = Out(y.as_mut_ptr());
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && m * n * k >= par_min_macs;
    let per_task = if parallel { rows_per_task(n, threads) } else { n.max(1) };
    let tasks = n.div_ceil(per_task);
    let run = |t: usize| {
        let n0 = t * per_task;
        task(n0, per_task.min(n - n0), out)
    };
    if parallel {
        (0..tasks).into_par_iter().for_each(run);
    } else {
        (0..tasks).for_each(run);
    }
    y
}

/// y (m × n) = x (m × k) · Wᵀ for a quantized W (n × k): for each 4 weight rows, dequantize them into an f32
/// scratch (once for every x row) and run the f32 tile over all rows. So a row's result is exactly what the f32
/// kernel gives on the dequantized matrix, whatever rows share the call.
pub fn matmul_q(x: &[f32], m: usize, q: &QMatrix, par_min_macs: usize) -> Vec<f32> {
    matmul_q_with(Tile::best(), x, m, q, par_min_macs)
}

fn matmul_q_with(isa: Tile, x: &[f32], m: usize, q: &QMatrix, par_min_macs: usize) -> Vec<f32> {
    let (n, k) = (q.n, q.k);
    assert_eq!(x.len(), m * k);
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    by_columns(m, k, n, par_min_macs, |n0, nw, out| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < 4 * k {
                s.resize(4 * k, 0.0);
            }
            // SAFETY: `isa` is one this CPU has; the task owns columns [n0, n0 + nw).
            unsafe { q_columns_on(isa, x, m, q, n0, nw, out, &mut s[..4 * k]) }
        })
    })
}

/// Columns [n0, n0 + nw) of y = x · Wᵀ for a quantized W, 4 weight rows at a time through `scratch` (4·k);
/// windows of up to `fused_max_rows` rows dequantize in registers instead (same values, same order of
/// multiply-adds, so the same bits, without the scratch's store and reload).
///
/// # Safety
/// As `columns_on`.
#[allow(clippy::too_many_arguments)]
unsafe fn q_columns_on(isa: Tile, x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: Out, scratch: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Tile::Avx512 => x86::q_columns_avx512(x, m, q, n0, nw, y, scratch),
        #[cfg(target_arch = "x86_64")]
        Tile::Avx2 => x86::q_columns_avx2(x, m, q, n0, nw, y, scratch),
        Tile::Baseline => q_columns(isa, x, m, q, n0, nw, y, scratch),
    }
}

/// Longest window a format's fused kernel takes (longer ones dequantize 4 weight rows at a time through the
/// scratch, once for every x row): q8_0 / q5_0 / q4_0 and q6_k / q3_k decode once per 4 x rows and stay ahead of
/// the scratch up to 8 rows; q4_k / q5_k / q2_k (a tile of 3 x rows: a 4th spills) up to 6 (`benches/quant_kernel.rs`
/// against bf16 on the 0.5B and 1.7B shapes: benches/results/quantization.md).
#[cfg(target_arch = "x86_64")]
fn fused_max_rows(f: QuantFormat) -> usize {
    match f {
        QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q2K => 6,
        _ => 8,
    }
}

/// The body of `q_columns_on`, inlined into each instruction set's variant (so the dequantization is
/// vectorised for it).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q_columns(isa: Tile, x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: Out, scratch: &mut [f32]) {
    let (n, k) = (q.n, q.k);
    #[cfg(target_arch = "x86_64")]
    match (isa, q.format) {
        (Tile::Avx512 | Tile::Avx2, _) if m > fused_max_rows(q.format) => {}
        (Tile::Avx512, QuantFormat::Q8_0) => return x86::q8_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q8_0) => return x86::q8_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q5_0) => return x86::q5_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q5_0) => return x86::q5_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q4_0) => return x86::q4_0_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q4_0) => return x86::q4_0_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q4K) => return x86::q4k_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q4K) => return x86::q4k_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q5K) => return x86::q5k_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q5K) => return x86::q5k_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q6K) => return x86::q6k_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q6K) => return x86::q6k_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q3K) => return x86::q3k_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q3K) => return x86::q3k_fused_avx2(x, m, q, n0, nw, y),
        (Tile::Avx512, QuantFormat::Q2K) => return x86::q2k_fused_avx512(x, m, q, n0, nw, y),
        (Tile::Avx2, QuantFormat::Q2K) => return x86::q2k_fused_avx2(x, m, q, n0, nw, y),
        _ => {}
    }
    for j in (n0..n0 + nw).step_by(4) {
        let valid = (n0 + nw - j).min(4);
        dequantize_rows_on(isa != Tile::Baseline, q, j, valid, scratch);
        for r0 in (0..m).step_by(ROW_BLOCK) {
            let mb = ROW_BLOCK.min(m - r0);
            columns_on(isa, &x[r0 * k..(r0 + mb) * k], mb, k, &scratch[..valid * k], 0, valid, n, y.offset(r0 * n + j));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::uniform;
    use candle_core::Tensor;

    /// Every instruction set this CPU has, not only the one picked at run time.
    fn available_isas() -> Vec<Tile> {
        let mut isas = vec![Tile::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if Tile::best() != Tile::Baseline {
                isas.push(Tile::Avx2);
            }
            if Tile::best() == Tile::Avx512 {
                isas.push(Tile::Avx512);
            }
        }
        isas
    }

    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum();
            }
        }
        y
    }

    #[test]
    fn matches_f64_reference_on_odd_shapes() {
        let mut rnd = uniform(7);
        // odd k (lane tails), odd n (4-row tile tails, task tails), odd m (2-row tails), big enough to go parallel
        let isas = available_isas();
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 17, 5),
            (2, 16, 4),
            (3, 33, 7),
            (5, 100, 131),
            (7, 333, 259),
            (32, 896, 200),
            (13, 64, 6000),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let r = reference(&x, m, k, &w, n);
            for &isa in &isas {
                let y = matmul_t_with(isa, &x, m, k, &w, n, 1 << 14);
                for (i, (a, b)) in y.iter().zip(&r).enumerate() {
                    let tol = 1e-5 * (1.0 + b.abs()) * (k as f64).sqrt();
                    assert!((*a as f64 - b).abs() <= tol, "{isa:?} m{m} k{k} n{n} at {i}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn bf16_weights_compute_as_their_f32_widening() {
        // bf16 storage must give what the f32 kernel gives on the widened weights (same products, same order)
        let mut rnd = uniform(11);
        let isas = available_isas();
        for &(m, k, n) in &[(1, 19, 9), (4, 192, 100), (9, 896, 70), (64, 40, 300)] {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let wb: Vec<half::bf16> = (0..n * k).map(|_| half::bf16::from_f32(rnd())).collect();
            let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            for &isa in &isas {
                let a = matmul_t_with(isa, &x, m, k, &wb, n, 1 << 14);
                let b = matmul_t_with(isa, &x, m, k, &wf, n, 1 << 14);
                assert_eq!(a, b, "{isa:?} m{m} k{k} n{n}");
            }
        }
    }

    #[test]
    fn a_row_is_computed_the_same_whatever_rows_share_the_call() {
        // batch invariance: row r of a stacked product is bit-identical to that row alone, for every row count
        // (tiles of 4/2/1 rows, row blocks past ROW_BLOCK) and both weight types
        let mut rnd = uniform(5);
        let (k, n) = (200, 97);
        let x: Vec<f32> = (0..150 * k).map(|_| rnd()).collect();
        let wf: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
        let wb: Vec<half::bf16> = wf.iter().map(|&v| half::bf16::from_f32(v)).collect();
        for &isa in &available_isas() {
            for m in [1usize, 2, 3, 5, 64, 65, 150] {
                let all = matmul_t_with(isa, &x[..m * k], m, k, &wf, n, 1);
                let allb = matmul_t_with(isa, &x[..m * k], m, k, &wb, n, 1);
                for r in [0, m / 2, m - 1] {
                    let one = matmul_t_with(isa, &x[r * k..(r + 1) * k], 1, k, &wf, n, 1 << 30);
                    assert_eq!(&all[r * n..(r + 1) * n], &one[..], "{isa:?} m{m} row {r}");
                    let oneb = matmul_t_with(isa, &x[r * k..(r + 1) * k], 1, k, &wb, n, 1 << 30);
                    assert_eq!(&allb[r * n..(r + 1) * n], &oneb[..], "{isa:?} bf16 m{m} row {r}");
                }
            }
        }
    }

    #[test]
    fn quantized_rows_compute_as_the_f32_kernel_on_the_dequantized_matrix() {
        // exact: q8_0 / q4_k through matmul_q = the f32 kernel on the dequantized weights, bit for bit, for every
        // instruction set and row count (so also batch-invariant), and close to an f64 reference
        let mut rnd = uniform(13);
        for &(format, k, n) in &[
            (crate::kernels::blocks::QuantFormat::Q8_0, 96, 37),
            (crate::kernels::blocks::QuantFormat::Q4K, 512, 21),
            (crate::kernels::blocks::QuantFormat::Q8_0, 2304, 13),
            (crate::kernels::blocks::QuantFormat::Q5_0, 896, 11),
            (crate::kernels::blocks::QuantFormat::Q6K, 768, 13),
            (crate::kernels::blocks::QuantFormat::Q5K, 768, 13),
            (crate::kernels::blocks::QuantFormat::Q4_0, 896, 11),
            (crate::kernels::blocks::QuantFormat::Q3K, 768, 13),
            (crate::kernels::blocks::QuantFormat::Q2K, 768, 13),
        ] {
            let wv: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let w = Tensor::from_vec(wv, (n, k), &candle_core::Device::Cpu).unwrap();
            let q = QMatrix::quantize(&w, format).unwrap();
            let mut deq = vec![0f32; n * k];
            q.dequantize_rows(0, n, &mut deq);
            for &isa in &available_isas() {
                for m in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 64, 65, 130] {
                    let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
                    let a = matmul_q_with(isa, &x, m, &q, 1);
                    let b = matmul_t_with(isa, &x, m, k, &deq, n, 1 << 30);
                    assert_eq!(a, b, "{format:?} {isa:?} m{m}");
                    let r = reference(&x, m, k, &deq, n);
                    for (a, b) in a.iter().zip(&r) {
                        assert!((*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()) * (k as f64).sqrt());
                    }
                }
            }
        }
    }
}

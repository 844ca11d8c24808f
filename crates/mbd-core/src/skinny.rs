//! `x · Wᵀ` on the CPU in f32 for windows of few rows (a decode window: 1 to a few dozen tokens).
//!
//! candle's CPU matmul (the `gemm` crate) packs the weight matrix into panels on every call; when x has a
//! handful of rows that repacking costs more than the arithmetic (measured on the 0.5B shape: a 4-row
//! product took 4.8x the time of a 1-row one, where streaming the weight once should make them about equal).
//! This kernel streams each weight row once from memory and keeps a small tile of x and accumulators in
//! registers: 4 weight rows × up to 4 x rows per tile, `L` f32 lanes each. It is split over output columns on
//! the rayon pool it is called from (the engine's, see `on_cpu_pool`; candle's matmul parallelises on it too)
//! and picks AVX-512 / AVX2+FMA at run time. Weights may be f32 or bf16 (widened in registers).
//!
//! Numerics: each output is one f32 dot product summed in `L` lane-wise partial sums then reduced; the
//! result differs from gemm's only by summation order.
//!
//! On CPUs with the packed product (x86-64, AVX2 + FMA) dense matrices are packed at load (`panels::PackedMatrix`)
//! and every window goes there (`linear_packed`), as are quantized ones; this kernel then takes row-major and
//! quantized matrices where packing is off (`Kernels::packed_weights`) or unavailable.

use crate::panels::PackedMatrix;
use crate::quant::QMatrix;
#[cfg(target_arch = "x86_64")]
use crate::quant::QuantFormat;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Kernel choices of a loaded model (load options; benchmarks and tests load with other values for A/B runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// Use this kernel at all (false: candle's matmul everywhere).
    pub skinny: bool,
    /// Products smaller than this many multiply-adds run on the calling thread. Called from the engine's pool
    /// (forwards run there) splitting costs a few µs, so only the smallest products stay serial; called from
    /// outside a pool waking the workers costs ~30 µs. Chosen with benches/ab_kernels.py.
    pub par_min_macs: usize,
    /// Windows of at most this many rows take the kernel; longer ones (prefill) go to gemm. (64: on the tiny
    /// model the kernel is faster up to ~64 rows and about even with gemm at 100; on the 0.5B shapes it is
    /// 0.8-1.0x gemm's time at 64 rows. benches/forward.rs and benches/ab_kernels.py measure both sides.)
    pub max_rows: usize,
    /// Bytes of f32 attention scores (heads x query rows x keys) one query chunk may take: a long window (a
    /// recompute without cache, a full-attention canvas, a logits call) is attended in query chunks so that no
    /// forward allocates scores for every row at once (a 100k-token window would need 100k x 100k per head).
    pub attention_score_bytes: usize,
    /// Attention on the CPU (f32, AVX2 + FMA) in `attention::attend`: blocked over keys, mask-aware,
    /// an online softmax with a vectorised exp, no score matrix. false: candle's ops (scores per query chunk, a
    /// host-built additive mask, softmax, a second matmul).
    pub blocked_attention: bool,
    /// Long windows' products on the CPU through `panels` (a packed AVX2 product widening or dequantizing W as
    /// it packs; gemm per widened panel on other CPUs). false: candle's matmul (a bf16 W widened whole per call; a
    /// quantized W through this kernel).
    pub panels: bool,
    /// Dense f32 / bf16 and quantized matrices packed at load (`panels::PackedMatrix`) on CPUs with the packed
    /// product (x86-64 with AVX2, FMA and F16C), so that every window, from one row to a prefill chunk, runs the
    /// packed product on them with no packing per call (and every row the same arithmetic, alone or stacked).
    /// false: held row-major (quantized ones in their blocks), few-row windows through this kernel (for A/B runs).
    pub packed_weights: bool,
    /// The packed product's AVX-512 tiles (`panels::matmul_t_with`) where the CPU has AVX-512. false: its AVX2 tiles
    /// (the same bits; for A/B runs).
    pub packed_avx512: bool,
    /// Linear layers of one input held as one matrix (q/k/v, gate/up: `models::qwen::Stacked`), one product
    /// instead of several. false: each its own product (the same bits; for A/B runs).
    pub stack: bool,
    /// On CUDA, mbd-rs's own kernels (`cuda`): a window's q/k norms, RoPE and K/V cache write in one launch,
    /// its attention in two (f32 scores, key ranges from the mask spec, no score matrix), silu·mul in one.
    /// false: candle's ops (for A/B runs).
    pub cuda_fused: bool,
    /// Quantized linear layers on the CPU held as candle's quantized tensors and multiplied by candle's quantized
    /// matmul (`quant::Matrix::Candle`), as they always are on CUDA: tests and A/B runs of that path on the CPU.
    pub candle_quant: bool,
}

impl Default for Kernels {
    fn default() -> Self {
        Kernels {
            skinny: true,
            par_min_macs: 1 << 14,
            max_rows: 64,
            attention_score_bytes: 256 << 20,
            blocked_attention: true,
            panels: true,
            packed_weights: true,
            packed_avx512: true,
            stack: true,
            cuda_fused: true,
            candle_quant: false,
        }
    }
}

impl Kernels {
    /// Whether a CPU f32 model holds its dense matrices packed (`packed_weights`, with this kernel and the panels
    /// on: with either off the products go elsewhere).
    pub fn packs(&self) -> bool {
        self.packed_weights && self.skinny && self.panels
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

/// Element type of a weight matrix the kernel reads: f32, or bf16 widened to f32 as it is loaded (exact: a bf16
/// is the top half of an f32), so a bf16 checkpoint computes exactly as its f32 conversion would, from half the bytes.
pub trait WeightElem: Copy + Send + Sync + 'static {
    const BF16: bool;
    fn to_f32(self) -> f32;
}

impl WeightElem for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl WeightElem for half::bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// Portable tile (other CPUs): dot products of x rows `xs` (each `k` long) with 4 weight rows, `L` lane sums.
/// Returns acc[r][c] = <xs[r], w_c>.
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

/// Store a tile's results: acc[r][c] is y[r0 + r][j + c], for the first `valid` weight rows (a tail tile repeats
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

/// The output buffer shared by the tasks, each writing its own columns.
#[derive(Clone, Copy)]
pub(crate) struct Out(pub(crate) *mut f32);
unsafe impl Send for Out {}
unsafe impl Sync for Out {}
impl Out {
    /// The buffer i elements on (a method, so that closures capture the `Sync` wrapper, not its pointer).
    #[inline(always)]
    pub(crate) unsafe fn offset(self, i: usize) -> Out {
        Out(self.0.add(i))
    }
    #[inline(always)]
    unsafe fn write(self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}

/// 8 weights as f32 lanes with AVX2 (`panels` packs with it too).
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{hsum256, load8};

/// The tile of `tile` with AVX-512 (16 lanes) or AVX2+FMA (8 lanes) intrinsics: the x rows' loads are
/// shared by the 4 weight rows and each weight load by the R x rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
mod x86 {
    use super::WeightElem;
    use crate::quant::{QMatrix, QuantFormat};
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

    /// 8 weights as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn load8<E: WeightElem>(p: *const E) -> __m256 {
        if E::BF16 {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// One step of every tile below: the x lanes `$x` of each of the R x rows (`$ri` names the row), the weight
    /// lanes `$w` of each of the `$c` weight rows (`$ci` names it; formed once, shared by the R x rows), and
    /// acc[r][c] += x_r · w_c.
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

    /// The little-endian f16 scale at `p` (a q8_0 block's d, a q4_k block's d and dmin), as f32.
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn scale(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([*p, *p.add(1)]) as i32)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_8(p: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn q8_16(p: *const u8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }

    /// A q8_0 block's 32 values: its bytes after the scale.
    #[inline(always)]
    unsafe fn q8_ints(block: *const u8, _buf: &mut [i8; 32]) -> *const u8 {
        block.add(2)
    }

    /// A q5_0 block's 32 values q − 16 as i8, decoded into `buf`: byte j of `high` is 0x10 where bit j of qh is
    /// set (qh's byte j / 8 broadcast to 8 bytes, each tested against its own bit), OR-ed into the nibbles
    /// (values 0-15 the low ones, 16-31 the high ones).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q5_ints(block: *const u8, buf: &mut [i8; 32]) -> *const u8 {
        let pick = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        let low = _mm_set1_epi8(0xF);
        let qh = u32::from_le_bytes([*block.add(2), *block.add(3), *block.add(4), *block.add(5)]);
        let v = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), pick);
        let high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
        let qs = _mm_loadu_si128(block.add(6) as *const __m128i);
        let nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(qs), low), _mm_and_si128(qs, low));
        let vals = _mm256_sub_epi8(_mm256_or_si256(nib, high), _mm256_set1_epi8(16));
        _mm256_storeu_si256(buf.as_mut_ptr() as *mut __m256i, vals);
        buf.as_ptr() as *const u8
    }

    /// A q4_0 block's 32 values q − 8 as i8, decoded into `buf` (values 0-15 the low nibbles, 16-31 the high ones).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q4_0_ints(block: *const u8, buf: &mut [i8; 32]) -> *const u8 {
        let low = _mm_set1_epi8(0xF);
        let qs = _mm_loadu_si128(block.add(2) as *const __m128i);
        let nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(qs), low), _mm_and_si128(qs, low));
        _mm256_storeu_si256(buf.as_mut_ptr() as *mut __m256i, _mm256_sub_epi8(nib, _mm256_set1_epi8(8)));
        buf.as_ptr() as *const u8
    }

    /// The loop of the fused (in-register) kernels over columns [n0, n0 + nw): one or two x rows take 4 weight
    /// rows at a time (`tile::<4, R>`: a one-row window is bound by memory, the 4 rows' streams keep it busy);
    /// longer windows take 2 weight rows at a time with x rows `$rmax` at a time (`tile::<2, R>`, then the rows
    /// left), so each weight value is decoded once per `$rmax` x rows (4; 3 for the k-quants with a min, whose
    /// 4-row tile runs out of registers: 1.2-1.7x slower). The first x rows fetch the next weight rows ahead.
    /// Every tile computes each output the same way (lane-wise multiply-adds along k, one reduction), so the tile
    /// shape never changes a result.
    macro_rules! fused_rows {
        ($feature:literal, $tile:ident, $rmax:literal, $x:ident, $m:ident, $q:ident, $n0:ident, $nw:ident, $y:ident) => {
            /// One tile shape, in a function of its own (with several shapes inlined into one function LLVM
            /// stopped unrolling the k-quant tiles: 1.5x slower).
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

    /// A q6_k super-block's 256 values q − 32 as i8 (`quant::q6k_value`), decoded into `buf`: per half, the 32
    /// bytes of `qh` give each quarter's fifth and sixth bits (shifted to bits 4-5 in 16-bit lanes, where no bit
    /// crosses into the masked byte), OR-ed into the low or high nibbles of `ql`'s first or second 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q6_ints(block: *const u8, buf: &mut [i8; 256]) {
        let low = _mm256_set1_epi8(0xF);
        let two = _mm256_set1_epi8(0x30);
        let bias = _mm256_set1_epi8(32);
        for half in 0..2 {
            let ql0 = _mm256_loadu_si256(block.add(64 * half) as *const __m256i);
            let ql1 = _mm256_loadu_si256(block.add(64 * half + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(block.add(128 + 32 * half) as *const __m256i);
            let quarters = [
                (_mm256_and_si256(ql0, low), _mm256_slli_epi16::<4>(qh)),
                (_mm256_and_si256(ql1, low), _mm256_slli_epi16::<2>(qh)),
                (_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low), qh),
                (_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low), _mm256_srli_epi16::<2>(qh)),
            ];
            for (g, (nib, high)) in quarters.into_iter().enumerate() {
                let v = _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_and_si256(high, two)), bias);
                _mm256_storeu_si256(buf.as_mut_ptr().add(128 * half + 32 * g) as *mut __m256i, v);
            }
        }
    }

    /// A q3_k super-block's 256 values in [−4, 3] as i8 (`quant::q3k_value`), decoded into `buf`: per half, quarter
    /// g is bits 2g, 2g + 1 of the half's 32 `qs` bytes (at 32), plus 4 where bit 4·half + g of the 32 `hmask`
    /// bytes (at 0) is set, minus 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q3k_ints(block: *const u8, buf: &mut [i8; 256]) {
        let three = _mm256_set1_epi8(3);
        let one = _mm256_set1_epi8(1);
        let four = _mm256_set1_epi8(4);
        let hm = _mm256_loadu_si256(block as *const __m256i);
        for half in 0..2 {
            let qs = _mm256_loadu_si256(block.add(32 + 32 * half) as *const __m256i);
            for g in 0..4 {
                let q = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * g as i32)), three);
                // the high bit moved to bit 0 of each byte (16-bit shifts, masked per byte), then to bit 2
                let h = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128((4 * half + g) as i32)), one);
                let v = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_slli_epi16::<2>(h)), four);
                _mm256_storeu_si256(buf.as_mut_ptr().add(128 * half + 32 * g) as *mut __m256i, v);
            }
        }
    }

    /// A q2_k super-block's 256 values 0-3 as bytes (`quant::q2k_value`), decoded into `buf`: per half, quarter g is
    /// bits 2g, 2g + 1 of the half's 32 `qs` bytes (at 16).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q2k_ints(block: *const u8, buf: &mut [i8; 256]) {
        let three = _mm256_set1_epi8(3);
        for half in 0..2 {
            let qs = _mm256_loadu_si256(block.add(16 + 32 * half) as *const __m256i);
            for g in 0..4 {
                let v = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * g as i32)), three);
                _mm256_storeu_si256(buf.as_mut_ptr().add(128 * half + 32 * g) as *mut __m256i, v);
            }
        }
    }

    /// The little-endian f16 at `p` as f32 without F16C (exact either way), for helper functions inlined into a
    /// kernel's tile: the tile carries no target features of its own, so a helper that does is called instead
    /// of inlined, spilling the tile's accumulators at each call.
    #[inline(always)]
    unsafe fn scale_soft(p: *const u8) -> f32 {
        half::f16::from_le_bytes([*p, *p.add(1)]).to_f32()
    }

    /// A q6_k super-block's 16 sub-block factors d·sc (f32, as the dequantization computes them).
    #[inline(always)]
    unsafe fn q6k_factors(b: *const u8) -> [f32; 16] {
        let d = scale_soft(b.add(208));
        std::array::from_fn(|s| d * (*b.add(192 + s) as i8) as f32)
    }

    /// A q3_k super-block's 16 sub-block factors d·(sc − 32).
    #[inline(always)]
    unsafe fn q3k_factors(b: *const u8) -> [f32; 16] {
        let d = scale_soft(b.add(108));
        let sc = crate::quant::q3k_scales(std::slice::from_raw_parts(b, 110));
        sc.map(|s| d * s as f32)
    }

    /// A q4_k (or q5_k) super-block's 8 sub-block factors (d·sc, dmin·m) into `$dm[0..8]`. A macro, not a
    /// function: expanded in the tile, the 2-row q4_k and q5_k tiles run as fast as before q2_k shared them
    /// (an inlined helper function made them 1.1-1.3x slower).
    macro_rules! q4k_factors {
        ($b:expr, $dm:expr) => {{
            let b: *const u8 = $b;
            let (d, dmin) = (scale(b), scale(b.add(2)));
            let sc = std::slice::from_raw_parts(b.add(4), 12);
            for j in 0..8 {
                let (s, m) = crate::quant::scale_min_k4(j, sc);
                $dm[j] = (d * s as f32, dmin * m as f32);
            }
        }};
    }

    /// A q2_k super-block's 16 sub-block factors (d·sc, dmin·m) into `$dm[0..16]`: byte j's low nibble sc and
    /// high nibble m.
    macro_rules! q2k_factors {
        ($b:expr, $dm:expr) => {{
            let b: *const u8 = $b;
            let (d, dmin) = (scale(b.add(80)), scale(b.add(82)));
            for j in 0..16 {
                let s = *b.add(j);
                $dm[j] = (d * (s & 0xF) as f32, dmin * (s >> 4) as f32);
            }
        }};
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
    /// A q4_k super-block's 256 nibbles as bytes 0-15 in value order (`buf`): each 32 bytes of `qs` hold the low
    /// nibbles of one sub-block of 32 and the high nibbles of the next.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q4_ints(block: *const u8, buf: &mut [i8; 256]) {
        let low = _mm256_set1_epi8(0xF);
        for g in 0..4 {
            let qs = _mm256_loadu_si256(block.add(16 + 32 * g) as *const __m256i);
            let o = buf.as_mut_ptr().add(64 * g) as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_and_si256(qs, low));
            _mm256_storeu_si256(o.add(1), _mm256_and_si256(_mm256_srli_epi16::<4>(qs), low));
        }
    }

    /// A q5_k super-block's 256 values 0-31 as bytes in value order (`quant::q5k_value`): q4_k's nibbles (`qs`
    /// at byte 48) with bit j of each of the 32 `qh` bytes (at 16) as sub-block j's fifth bit (shifted down in
    /// 16-bit lanes, masked to bit 0 of each byte, moved to bit 4).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q5k_ints(block: *const u8, buf: &mut [i8; 256]) {
        let low = _mm256_set1_epi8(0xF);
        let one = _mm256_set1_epi8(1);
        let qh = _mm256_loadu_si256(block.add(16) as *const __m256i);
        let fifth = |j: i32| {
            let b = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
            _mm256_slli_epi16::<4>(b)
        };
        for g in 0..4 {
            let qs = _mm256_loadu_si256(block.add(48 + 32 * g) as *const __m256i);
            let o = buf.as_mut_ptr().add(64 * g) as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_or_si256(_mm256_and_si256(qs, low), fifth(2 * g as i32)));
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(qs), low);
            _mm256_storeu_si256(o.add(1), _mm256_or_si256(hi, fifth(2 * g as i32 + 1)));
        }
    }

    /// Columns [n0, n0 + nw) of y = x · Wᵀ for a q4_k (or q5_k, q2_k) W and a few x rows (`fused_rows`), dequantizing in
    /// registers: a super-block of each of the C weight rows decoded to bytes (`$ints`), then per sub-block of
    /// `$sl` values (32; q2_k 16) the value (d·sc)·q − dmin·m (`$factors`: each sub-block's d·sc and dmin·m) and
    /// the multiply-adds in the order of the f32 tile over the dequantized scratch, so the same bits. `$bb`: bytes
    /// per super-block.
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

    /// `QMatrix::dequantize_rows` with AVX2 (same operations, so the same values: q8_0 `q·d`, q4_k
    /// `(d·sc)·q − dmin·m` with a separate multiply and subtract).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_rows_avx2(q: &QMatrix, j0: usize, count: usize, out: &mut [f32]) {
        let rb = q.row_bytes();
        let src = &q.bytes()[j0 * rb..(j0 + count) * rb];
        let out = &mut out[..count * q.k];
        let o = out.as_mut_ptr();
        match q.format {
            // q8_0 and q5_0: a block's 32 signed bytes (its own, or q5_0's decoded), times its scale
            QuantFormat::Q8_0 | QuantFormat::Q5_0 | QuantFormat::Q4_0 => {
                let ints = match q.format {
                    QuantFormat::Q5_0 => q5_ints,
                    QuantFormat::Q4_0 => q4_0_ints,
                    _ => q8_ints,
                };
                let mut buf = [0i8; 32];
                for (i, b) in src.chunks_exact(q.format.block_bytes()).enumerate() {
                    let d = _mm256_set1_ps(scale(b.as_ptr()));
                    let p = ints(b.as_ptr(), &mut buf);
                    for g in 0..4 {
                        _mm256_storeu_ps(o.add(32 * i + 8 * g), _mm256_mul_ps(q8_8(p.add(8 * g)), d));
                    }
                }
            }
            QuantFormat::Q4K => {
                let low = _mm_set1_epi8(0xF);
                for (i, b) in src.chunks_exact(144).enumerate() {
                    let (d, dmin) = (scale(b.as_ptr()), scale(b.as_ptr().add(2)));
                    let scales = &b[4..16];
                    for g in 0..4 {
                        let (sc1, m1) = crate::quant::scale_min_k4(2 * g, scales);
                        let (sc2, m2) = crate::quant::scale_min_k4(2 * g + 1, scales);
                        let (d1, m1) = (_mm256_set1_ps(d * sc1 as f32), _mm256_set1_ps(dmin * m1 as f32));
                        let (d2, m2) = (_mm256_set1_ps(d * sc2 as f32), _mm256_set1_ps(dmin * m2 as f32));
                        let base = o.add(256 * i + 64 * g);
                        for h in 0..2 {
                            let qb = _mm_loadu_si128(b.as_ptr().add(16 + 32 * g + 16 * h) as *const __m128i);
                            let lo = _mm_and_si128(qb, low);
                            let hi = _mm_and_si128(_mm_srli_epi16::<4>(qb), low);
                            for (half, v, dd, mm) in [(0, lo, d1, m1), (32, hi, d2, m2)] {
                                let a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                                let bq = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)));
                                let dst = base.add(half + 16 * h);
                                _mm256_storeu_ps(dst, _mm256_sub_ps(_mm256_mul_ps(dd, a), mm));
                                _mm256_storeu_ps(dst.add(8), _mm256_sub_ps(_mm256_mul_ps(dd, bq), mm));
                            }
                        }
                    }
                }
            }
            // q5_k and q2_k: a super-block's values as bytes, then (d·sc)·q − dmin·m per sub-block of 32 / 16
            QuantFormat::Q5K | QuantFormat::Q2K => {
                let five = q.format == QuantFormat::Q5K;
                let sl = if five { 32 } else { 16 };
                let mut buf = [0i8; 256];
                let mut dm = [(0f32, 0f32); 16];
                for (i, b) in src.chunks_exact(q.format.block_bytes()).enumerate() {
                    if five {
                        q5k_ints(b.as_ptr(), &mut buf);
                        q4k_factors!(b.as_ptr(), dm);
                    } else {
                        q2k_ints(b.as_ptr(), &mut buf);
                        q2k_factors!(b.as_ptr(), dm);
                    }
                    for (j, &(dd, mm)) in dm[..256 / sl].iter().enumerate() {
                        let (dd, mm) = (_mm256_set1_ps(dd), _mm256_set1_ps(mm));
                        for t in 0..sl / 8 {
                            let v = q8_8(buf.as_ptr().add(sl * j + 8 * t) as *const u8);
                            _mm256_storeu_ps(o.add(256 * i + sl * j + 8 * t), _mm256_sub_ps(_mm256_mul_ps(dd, v), mm));
                        }
                    }
                }
            }
            QuantFormat::Q6K | QuantFormat::Q3K => {
                let six = q.format == QuantFormat::Q6K;
                let mut buf = [0i8; 256];
                for (i, b) in src.chunks_exact(q.format.block_bytes()).enumerate() {
                    let f = if six { q6k_factors(b.as_ptr()) } else { q3k_factors(b.as_ptr()) };
                    if six {
                        q6_ints(b.as_ptr(), &mut buf)
                    } else {
                        q3k_ints(b.as_ptr(), &mut buf)
                    }
                    for (s, &f) in f.iter().enumerate() {
                        let ds = _mm256_set1_ps(f);
                        for h in 0..2 {
                            let v = q8_8(buf.as_ptr().add(16 * s + 8 * h) as *const u8);
                            _mm256_storeu_ps(o.add(256 * i + 16 * s + 8 * h), _mm256_mul_ps(ds, v));
                        }
                    }
                }
            }
        }
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
        super::q_columns(super::Isa::Avx512, x, m, q, n0, nw, y, s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q_columns_avx2(x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: super::Out, s: &mut [f32]) {
        super::q_columns(super::Isa::Avx2, x, m, q, n0, nw, y, s)
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// aarch64 (NEON has fused multiply-add) or plain SSE2.
    Baseline,
}

fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        // (every CPU with AVX2 or AVX-512 has F16C and FMA; checked all the same: the quantized path converts
        // f16 scales with F16C)
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Baseline
}

/// y (m × n) = x (m × k) · Wᵀ, W (n × k), all row-major; parallel on the calling pool from `par_min_macs`
/// multiply-adds.
pub fn matmul_t<E: WeightElem>(x: &[f32], m: usize, k: usize, w: &[E], n: usize, par_min_macs: usize) -> Vec<f32> {
    matmul_t_with(isa(), x, m, k, w, n, par_min_macs)
}

fn matmul_t_with<E: WeightElem>(
    isa: Isa,
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
            // SAFETY: `isa` is one this CPU has (`isa()` checked it).
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
    isa: Isa,
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
        Isa::Avx512 => x86::columns_avx512(x, m, k, w, n0, nw, n, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::columns_avx2(x, m, k, w, n0, nw, n, y),
        Isa::Baseline => columns(x, m, k, w, n0, nw, n, y, tile::<E, 8, 4>, tile::<E, 8, 2>, tile::<E, 8, 1>),
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
    matmul_q_with(isa(), x, m, q, par_min_macs)
}

fn matmul_q_with(isa: Isa, x: &[f32], m: usize, q: &QMatrix, par_min_macs: usize) -> Vec<f32> {
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
unsafe fn q_columns_on(isa: Isa, x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: Out, scratch: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::q_columns_avx512(x, m, q, n0, nw, y, scratch),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::q_columns_avx2(x, m, q, n0, nw, y, scratch),
        Isa::Baseline => q_columns(isa, x, m, q, n0, nw, y, scratch),
    }
}

/// Rows `j0..j0 + count` of a quantized matrix as f32 into `out` (`QMatrix::dequantize_rows`, vectorised where
/// the CPU allows; the same values either way).
pub(crate) fn dequantize_rows(q: &QMatrix, j0: usize, count: usize, out: &mut [f32]) {
    // SAFETY: `isa()` is an instruction set this CPU has.
    unsafe { dequantize_rows_on(isa(), q, j0, count, out) }
}

/// # Safety
/// `isa` is one this CPU has.
#[inline(always)]
unsafe fn dequantize_rows_on(isa: Isa, q: &QMatrix, j0: usize, count: usize, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => x86::dequantize_rows_avx2(q, j0, count, out),
        Isa::Baseline => q.dequantize_rows(j0, count, out),
    }
}

/// Longest window a format's fused kernel takes (longer ones dequantize 4 weight rows at a time through the
/// scratch, once for every x row). Measured with `benches/quant_kernel.rs` against bf16 on the 0.5B and 1.7B
/// shapes (benches/RESULTS.md): q8_0 / q5_0 / q4_0 and q6_k / q3_k decode once per 4 x rows and stay ahead of the
/// scratch up to 8 rows; q4_k / q5_k / q2_k (a tile of 3 x rows: a 4th spills) up to 6.
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
unsafe fn q_columns(isa: Isa, x: &[f32], m: usize, q: &QMatrix, n0: usize, nw: usize, y: Out, scratch: &mut [f32]) {
    let (n, k) = (q.n, q.k);
    #[cfg(target_arch = "x86_64")]
    match (isa, q.format) {
        (Isa::Avx512 | Isa::Avx2, _) if m > fused_max_rows(q.format) => {}
        (Isa::Avx512, QuantFormat::Q8_0) => return x86::q8_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q8_0) => return x86::q8_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q5_0) => return x86::q5_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q5_0) => return x86::q5_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q4_0) => return x86::q4_0_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q4_0) => return x86::q4_0_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q4K) => return x86::q4k_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q4K) => return x86::q4k_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q5K) => return x86::q5k_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q5K) => return x86::q5k_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q6K) => return x86::q6k_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q6K) => return x86::q6k_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q3K) => return x86::q3k_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q3K) => return x86::q3k_fused_avx2(x, m, q, n0, nw, y),
        (Isa::Avx512, QuantFormat::Q2K) => return x86::q2k_fused_avx512(x, m, q, n0, nw, y),
        (Isa::Avx2, QuantFormat::Q2K) => return x86::q2k_fused_avx2(x, m, q, n0, nw, y),
        _ => {}
    }
    for j in (n0..n0 + nw).step_by(4) {
        let valid = (n0 + nw - j).min(4);
        dequantize_rows_on(isa, q, j, valid, scratch);
        for r0 in (0..m).step_by(ROW_BLOCK) {
            let mb = ROW_BLOCK.min(m - r0);
            columns_on(isa, &x[r0 * k..(r0 + mb) * k], mb, k, &scratch[..valid * k], 0, valid, n, y.offset(r0 * n + j));
        }
    }
}

/// The candle op for a dense W: (x: (m, k) f32, w: (n, k) f32 or bf16) -> (m, n), both contiguous on the CPU;
/// this kernel (`matmul_t`), or `panels::matmul_t` for a long window (`panels`).
pub struct DenseMatmulT {
    pub par_min_macs: usize,
    pub panels: bool,
    /// `Kernels::packed_avx512`
    pub avx512: bool,
}

impl CustomOp2 for DenseMatmulT {
    fn name(&self) -> &'static str {
        "dense-matmul-t"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use crate::panels::Source;
        let ((m, k), (n, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
        if k != k2 {
            candle_core::bail!("dense-matmul-t: inner dimensions differ ({k} vs {k2})");
        }
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("dense-matmul-t: operands must be contiguous");
        };
        let (CpuStorage::F32(x), w) = (s1, s2) else { candle_core::bail!("dense-matmul-t: x must be f32") };
        let (x, par) = (&x[a0..a1], self.par_min_macs);
        let panels = |w: Source<'_>| crate::panels::matmul_t_with(x, m, k, w, n, par, self.avx512);
        let y = match (w, self.panels) {
            (CpuStorage::F32(w), false) => matmul_t(x, m, k, &w[b0..b1], n, par),
            (CpuStorage::BF16(w), false) => matmul_t(x, m, k, &w[b0..b1], n, par),
            (CpuStorage::F32(w), true) => panels(Source::F32(&w[b0..b1])),
            (CpuStorage::BF16(w), true) => panels(Source::Bf16(&w[b0..b1])),
            _ => candle_core::bail!("dense-matmul-t: w must be f32 or bf16"),
        };
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// Whether this kernel can compute `x · wᵀ`: the operands fit `DenseMatmulT` and the kernel is switched on.
pub fn supports(x: &Tensor, w: &Tensor, k: &Kernels) -> bool {
    k.skinny && dense_operands(x, w)
}

/// Whether `DenseMatmulT` takes these operands: CPU, x f32 2-D contiguous, w f32 or bf16 2-D contiguous.
fn dense_operands(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::BF16)
        && x.rank() == 2
        && w.rank() == 2
        && x.is_contiguous()
        && w.is_contiguous()
}

/// Whether a sequence's window of `rows` rows takes the few-row kernel (1 to `max_rows` rows) rather than gemm.
/// The choice is made per sequence, never from the total rows of a batched forward: the kernel computes each
/// row the same way whatever rows share the call, so stacking the few-row windows of many sequences into one
/// call (any total) gives every row exactly what it gets alone; a long window (prefill) goes to gemm on its own.
pub fn few_rows(rows: usize, k: &Kernels) -> bool {
    k.skinny && (1..=k.max_rows).contains(&rows)
}

/// `x · wᵀ` for x (m, k) and w (n, k): the skinny kernel when `few` (the rows are few-row windows, see `few_rows`)
/// and it `supports` the operands; otherwise (a long window) `panels` on the CPU, candle's matmul elsewhere (or
/// with `Kernels::panels` off; a bf16 w is then widened to f32 for the call).
pub fn linear(x: &Tensor, w: &Tensor, k: &Kernels, few: bool) -> candle_core::Result<Tensor> {
    // bf16 weights exist only on the CPU and only this kernel reads them: give it a contiguous x
    let x = if w.dtype() == DType::BF16 && !x.is_contiguous() { x.contiguous()? } else { x.clone() };
    if few && supports(&x, w, k) {
        x.apply_op2_no_bwd(w, &DenseMatmulT { par_min_macs: k.par_min_macs, panels: false, avx512: k.packed_avx512 })
    } else if k.panels && dense_operands(&x, w) {
        x.apply_op2_no_bwd(w, &DenseMatmulT { par_min_macs: k.par_min_macs, panels: true, avx512: k.packed_avx512 })
    } else if w.dtype() == DType::BF16 {
        x.matmul(&w.to_dtype(x.dtype())?.t()?)
    } else {
        x.matmul(&w.t()?)
    }
}

/// A matrix `HeldMatmulT` multiplies: through the panels (or this kernel), or by integer dot products (`qdot`).
#[derive(Clone, Copy)]
enum Held<'a> {
    Panels(crate::panels::Source<'a>),
    Dot(&'a crate::qdot::DotMatrix),
}

/// The candle op for a quantized or packed W held outside candle: x (m, k) contiguous f32 on the CPU -> (m, n).
/// A quantized W's few-row windows take this kernel (`matmul_q`); everything else `panels::matmul_t`.
struct HeldMatmulT<'a> {
    w: Held<'a>,
    n: usize,
    k: usize,
    par_min_macs: usize,
    /// a quantized W's few-row window: this kernel rather than the panels
    few: bool,
    /// `Kernels::packed_avx512`
    avx512: bool,
}

impl HeldMatmulT<'_> {
    /// The op on x, converted to contiguous f32 first.
    fn apply(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = if x.dtype() == DType::F32 { x.contiguous()? } else { x.to_dtype(DType::F32)?.contiguous()? };
        x.apply_op1_no_bwd(self)
    }
}

impl CustomOp1 for HeldMatmulT<'_> {
    fn name(&self) -> &'static str {
        "held-matmul-t"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        if k != self.k {
            candle_core::bail!("held-matmul-t: x has rows of {k}, the matrix of {}", self.k);
        }
        let (CpuStorage::F32(x), Some((a0, a1))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("held-matmul-t: x must be contiguous f32");
        };
        let x = &x[a0..a1];
        let y = match self.w {
            Held::Panels(crate::panels::Source::Quant(q)) if self.few => matmul_q(x, m, q, self.par_min_macs),
            Held::Panels(w) => crate::panels::matmul_t_with(x, m, k, w, self.n, self.par_min_macs, self.avx512),
            Held::Dot(d) => {
                use crate::qdot::Isa;
                let isa = if self.avx512 { Isa::best() } else { Isa::best().min(Isa::Avx2) };
                crate::qdot::matmul(x, m, d, self.par_min_macs, isa)
            }
        };
        Ok((CpuStorage::F32(y), Shape::from((m, self.n))))
    }
}

/// `x · wᵀ` for a packed w (CPU): every window, a one-row decode window or a prefill chunk, through the packed
/// product, so each row's result is the same whatever window it is in.
pub fn linear_packed(x: &Tensor, p: &PackedMatrix, k: &Kernels) -> candle_core::Result<Tensor> {
    let w = Held::Panels(crate::panels::Source::Packed(p));
    HeldMatmulT { w, n: p.n, k: p.k, par_min_macs: k.par_min_macs, few: false, avx512: k.packed_avx512 }.apply(x)
}

/// `x · wᵀ` for a quantized w (CPU): few-row windows (`few`) take this kernel (`matmul_q`), long windows
/// `panels` (each panel dequantized once, then gemm), or this kernel too with `Kernels::panels` off (it streams
/// the weights once per ROW_BLOCK rows, each time dequantizing them again).
pub fn linear_q(x: &Tensor, q: &QMatrix, k: &Kernels, few: bool) -> candle_core::Result<Tensor> {
    let w = Held::Panels(crate::panels::Source::Quant(q));
    let few = few || !k.panels;
    HeldMatmulT { w, n: q.n, k: q.k, par_min_macs: k.par_min_macs, few, avx512: k.packed_avx512 }.apply(x)
}

/// `x · wᵀ` for a matrix held for integer dot products (CPU): every window through `qdot::matmul`, its AVX-512 VNNI
/// kernels where the CPU has them (and `Kernels::packed_avx512` is on), else its AVX2 ones, else the scalar ones
/// (the same bits on each).
pub fn linear_dot(x: &Tensor, d: &crate::qdot::DotMatrix, k: &Kernels) -> candle_core::Result<Tensor> {
    HeldMatmulT { w: Held::Dot(d), n: d.n, k: d.k, par_min_macs: k.par_min_macs, few: false, avx512: k.packed_avx512 }
        .apply(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::uniform;

    /// Every instruction set this CPU has, not only the one picked at run time.
    fn available_isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if isa() != Isa::Baseline {
                isas.push(Isa::Avx2);
            }
            if isa() == Isa::Avx512 {
                isas.push(Isa::Avx512);
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
        // through candle: one row and many rows (the latter widens w and uses candle's matmul)
        let dev = candle_core::Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (50, 24), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let wf = w.to_dtype(DType::F32).unwrap();
        for m in [1usize, 3, 64, 65, 200] {
            let x = Tensor::randn(0f32, 1.0, (m, 24), &dev).unwrap();
            let a = linear(&x, &w, &Kernels::default(), few_rows(m, &Kernels::default())).unwrap();
            let b = x.matmul(&wf.t().unwrap()).unwrap();
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "m{m}: {d}");
        }
    }

    #[test]
    fn op_agrees_with_candle_matmul() {
        let dev = candle_core::Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (6, 40), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (30, 40), &dev).unwrap();
        let kn = Kernels::default();
        assert!(supports(&x, &w, &kn) && few_rows(6, &kn) && few_rows(1, &kn) && !few_rows(65, &kn));
        let a = linear(&x, &w, &kn, true).unwrap();
        let b = x.matmul(&w.t().unwrap()).unwrap();
        assert_eq!(a.dims(), &[6, 30]);
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-4, "{d}");
        // a transposed (non-contiguous) x falls back to candle's matmul
        let xt = Tensor::randn(0f32, 1.0, (40, 6), &dev).unwrap().t().unwrap();
        assert!(!supports(&xt, &w, &kn));
        assert_eq!(linear(&xt, &w, &kn, true).unwrap().dims(), &[6, 30]);
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
            (crate::quant::QuantFormat::Q8_0, 96, 37),
            (crate::quant::QuantFormat::Q4K, 512, 21),
            (crate::quant::QuantFormat::Q8_0, 2304, 13),
            (crate::quant::QuantFormat::Q5_0, 896, 11),
            (crate::quant::QuantFormat::Q6K, 768, 13),
            (crate::quant::QuantFormat::Q5K, 768, 13),
            (crate::quant::QuantFormat::Q4_0, 896, 11),
            (crate::quant::QuantFormat::Q3K, 768, 13),
            (crate::quant::QuantFormat::Q2K, 768, 13),
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
        // through candle, rows of a stacked call equal the row alone
        let q = QMatrix::quantize(
            &Tensor::randn(0f32, 1.0, (70, 64), &candle_core::Device::Cpu).unwrap(),
            crate::quant::QuantFormat::Q8_0,
        )
        .unwrap();
        let x = Tensor::randn(0f32, 1.0, (9, 64), &candle_core::Device::Cpu).unwrap();
        let all = linear_q(&x, &q, &Kernels::default(), true).unwrap();
        let one = linear_q(&x.narrow(0, 4, 1).unwrap(), &q, &Kernels::default(), true).unwrap();
        assert_eq!(all.narrow(0, 4, 1).unwrap().to_vec2::<f32>().unwrap(), one.to_vec2::<f32>().unwrap());
    }
}

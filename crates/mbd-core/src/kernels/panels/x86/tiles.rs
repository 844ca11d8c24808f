//! The register tiles of the packed product, per instruction set (`Ymm`: AVX2, `Zmm`: AVX-512): every output
//! element the in-order FMA chain over k, whatever the tile.

use super::formats::{next_scales, Cursor, Panel};
use super::{MR, NR};
use std::arch::x86_64::*;

/// Bytes ahead in each group's weights that a tile asks the memory for at every depth (software prefetch). A
/// matrix packed at load streams from memory in the first row panel of each depth block; the hardware
/// prefetcher picks up each of the tile's groups only after some misses.
const PREFETCH: usize = 1024;

/// Ask for the line `PREFETCH` bytes after each group's current weights (past the matrix's end: a prefetch
/// never faults).
#[inline(always)]
unsafe fn prefetch<E, const P: usize>(w: &[*const E; P]) {
    for w in w {
        _mm_prefetch::<_MM_HINT_T0>((*w as *const i8).wrapping_add(PREFETCH));
    }
}

/// A group's `kc` depths from `b` on, as f32 (`NR` per depth, column order) into `dst` ([`Ymm::decode`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
    assert!(dst.len() >= kc * NR && E::SLOTS.is_none());
    let (mut w, b) = (b.w, [b]);
    let mut d = [[_mm256_setzero_ps(); 4]];
    for p in 0..kc {
        next_scales(p, &b, &mut d, |r, j| E::scales(r, j));
        let (lo, hi) = E::load(w, &d[0]);
        _mm256_storeu_ps(dst.as_mut_ptr().add(p * NR), lo);
        _mm256_storeu_ps(dst.as_mut_ptr().add(p * NR + 8), hi);
        w = w.add(E::LAYOUT.step);
    }
}

/// `decode` with AVX-512 ([`Zmm::decode`]): the same values.
#[target_feature(enable = "avx512f")]
unsafe fn decode512<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
    assert!(dst.len() >= kc * NR && E::SLOTS.is_none());
    let (mut w, b) = (b.w, [b]);
    let mut d = [[_mm512_setzero_ps(); 2]];
    for p in 0..kc {
        next_scales(p, &b, &mut d, |r, j| E::scales16(r, j));
        _mm512_storeu_ps(dst.as_mut_ptr().add(p * NR), E::load16(w, &d[0]));
        w = w.add(E::LAYOUT.step);
    }
}

/// The register tiles of one instruction set.
pub(super) trait Tiles {
    /// Whole groups the full `MR`-row tile covers at once, at most.
    const FULL: usize;
    /// Whole groups the full tile takes at once for weights `E` (fewer where their scales take registers).
    fn full_groups<E: Panel>() -> usize {
        Self::FULL.min(E::FULL512)
    }
    /// Whether `full` takes tall tiles: `rows` from `MR` + 1 to 2 · `MR` (a full row panel and rows of the
    /// next), for dense weights (f32 or bf16, no block format's scales). Each group's weights are then formed
    /// once for all the rows, where an `MR`-row tile forms them once per `MR`.
    const TALL: bool = false;
    /// The `rows`-row tile over groups [g, g + count) (count: 1 to `FULL`): `MR` rows, or a tall tile (`TALL`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn full<E: Panel>(
        rows: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        g: usize,
        count: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    );
    /// c (`R` rows × `P` groups) as `tile` describes.
    unsafe fn tile<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: [Cursor<E>; P],
        c: *mut f32,
        ldc: usize,
        acc: bool,
    );
    /// `R` rows over some of the `left` whole groups from group g (fewer than `last_rows` takes at once); returns
    /// how many.
    #[allow(clippy::too_many_arguments)]
    unsafe fn rest<E: Panel, const R: usize>(
        left: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        g: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) -> usize;
    /// A block format's group, `kc` depths from `b` on, as f32 into `dst` (`NR` per depth, column order).
    unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]);
    /// The last `rows` (1 to `MR` − 1) rows over every group (`last_rows` with this set's widths).
    #[allow(clippy::too_many_arguments)]
    unsafe fn last_rows<E: Panel>(
        rows: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        nt: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    );
}

/// AVX2: 16 ymm registers, a group in two; the 6-row tile over one group (12 accumulators).
pub(super) struct Ymm;

/// AVX-512: 32 zmm registers, a group in one; the 6-row tile over 4 groups (24 accumulators), the last rows over
/// up to 8. Each lane is the same in-order chain as in `Ymm`'s tiles: the same bits.
pub(super) struct Zmm;

impl Tiles for Ymm {
    const FULL: usize = 1;
    unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
        decode::<E>(kc, b, dst)
    }
    unsafe fn full<E: Panel>(
        rows: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        g: usize,
        _count: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        debug_assert_eq!(rows, MR);
        tile::<E, MR, 1>(kc, a, [b(g)], c, ldc, acc)
    }
    unsafe fn tile<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: [Cursor<E>; P],
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        tile::<E, R, P>(kc, a, b, c, ldc, acc)
    }
    unsafe fn rest<E: Panel, const R: usize>(
        left: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        g: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) -> usize {
        match left {
            1 => tile::<E, R, 1>(kc, a, [b(g)], c, n, acc),
            2 => tile::<E, R, 2>(kc, a, [b(g), b(g + 1)], c, n, acc),
            _ => tile::<E, R, 3>(kc, a, [b(g), b(g + 1), b(g + 2)], c, n, acc),
        }
        left.min(3)
    }
    unsafe fn last_rows<E: Panel>(
        rows: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        nt: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) {
        match rows {
            1 => last_rows::<Self, E, 1, 4>(kc, a, b, nt, c, n, acc),
            2 => last_rows::<Self, E, 2, 2>(kc, a, b, nt, c, n, acc),
            3 => last_rows::<Self, E, 3, 2>(kc, a, b, nt, c, n, acc),
            4 => last_rows::<Self, E, 4, 1>(kc, a, b, nt, c, n, acc),
            _ => last_rows::<Self, E, 5, 1>(kc, a, b, nt, c, n, acc),
        }
    }
}

impl Tiles for Zmm {
    const FULL: usize = 4;
    const TALL: bool = true;
    unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
        decode512::<E>(kc, b, dst)
    }
    unsafe fn full<E: Panel>(
        rows: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        g: usize,
        count: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        // tall: up to 12 rows over 2 groups, 24 accumulators; at 12 rows 4 widening uops for bf16 per 24 FMAs
        // (the 6-row tile over 4 groups: 8)
        match rows {
            7 => return last_rows::<Self, E, 7, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
            8 => return last_rows::<Self, E, 8, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
            9 => return last_rows::<Self, E, 9, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
            10 => return last_rows::<Self, E, 10, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
            11 => return last_rows::<Self, E, 11, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
            12 => return last_rows::<Self, E, { 2 * MR }, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
            _ => debug_assert_eq!(rows, MR),
        }
        match count {
            1 => tile512::<E, MR, 1>(kc, a, [b(g)], c, ldc, acc),
            2 => tile512::<E, MR, 2>(kc, a, [b(g), b(g + 1)], c, ldc, acc),
            3 => tile512::<E, MR, 3>(kc, a, [b(g), b(g + 1), b(g + 2)], c, ldc, acc),
            _ => tile512::<E, MR, 4>(kc, a, [b(g), b(g + 1), b(g + 2), b(g + 3)], c, ldc, acc),
        }
    }
    unsafe fn tile<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: [Cursor<E>; P],
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        tile512::<E, R, P>(kc, a, b, c, ldc, acc)
    }
    unsafe fn rest<E: Panel, const R: usize>(
        left: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        g: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) -> usize {
        // all that is left in one tile (at least 8 accumulators while R · left allows: FMA latency × ports)
        let bs = |q: usize| b(g + q);
        match left {
            1 => tile512::<E, R, 1>(kc, a, [bs(0)], c, n, acc),
            2 => tile512::<E, R, 2>(kc, a, std::array::from_fn(bs), c, n, acc),
            3 => tile512::<E, R, 3>(kc, a, std::array::from_fn(bs), c, n, acc),
            4 => tile512::<E, R, 4>(kc, a, std::array::from_fn(bs), c, n, acc),
            5 => tile512::<E, R, 5>(kc, a, std::array::from_fn(bs), c, n, acc),
            6 => tile512::<E, R, 6>(kc, a, std::array::from_fn(bs), c, n, acc),
            _ => tile512::<E, R, 7>(kc, a, std::array::from_fn(bs), c, n, acc),
        }
        left.min(7)
    }
    unsafe fn last_rows<E: Panel>(
        rows: usize,
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        nt: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) {
        match rows {
            // a block format's scales take registers too: fewer groups at once (spills otherwise)
            1 if E::BLOCK > 0 => last_rows::<Self, E, 1, 4>(kc, a, b, nt, c, n, acc),
            1 => last_rows::<Self, E, 1, 8>(kc, a, b, nt, c, n, acc),
            2 => last_rows::<Self, E, 2, 6>(kc, a, b, nt, c, n, acc),
            3 => last_rows::<Self, E, 3, 4>(kc, a, b, nt, c, n, acc),
            4 => last_rows::<Self, E, 4, 4>(kc, a, b, nt, c, n, acc),
            _ => last_rows::<Self, E, 5, 4>(kc, a, b, nt, c, n, acc),
        }
    }
}

/// `R` rows over every group: `P` groups per tile (`R · P` accumulator groups), then what is left
/// ([`Tiles::rest`]). The last rows (R < `MR`), and the tall tiles ([`Tiles::TALL`], P = 2).
#[allow(clippy::too_many_arguments)]
unsafe fn last_rows<T: Tiles, E: Panel, const R: usize, const P: usize>(
    kc: usize,
    a: *const f32,
    b: &impl Fn(usize) -> Cursor<E>,
    nt: usize,
    c: *mut f32,
    n: usize,
    acc: bool,
) {
    let whole = nt / NR;
    let mut g = 0;
    while g + P <= whole {
        T::tile::<E, R, P>(kc, a, std::array::from_fn(|q| b(g + q)), c.add(g * NR), n, acc);
        g += P;
    }
    while g < whole {
        g += T::rest::<E, R>(whole - g, kc, a, b, g, c.add(g * NR), n, acc);
    }
    if whole * NR < nt {
        edge_tile::<T, E, R>(kc, a, b(whole), c.add(whole * NR), n, nt - whole * NR, acc);
    }
}

/// `tile` with AVX-512: a group in one register (lanes in `E::SLOTS` order), the x value of a row broadcast once
/// per depth for all `P` groups. Each lane is the same in-order FMA chain as `tile`'s, so the same bits. `R` up to
/// 2 · `MR` ([`Tiles::TALL`]): rows past `MR` are read from the next row panel of `a`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile512<E: Panel, const R: usize, const P: usize>(
    kc: usize,
    a: *const f32,
    b: [Cursor<E>; P],
    c: *mut f32,
    ldc: usize,
    acc: bool,
) {
    // lanes → columns (store) and columns → lanes (load) where the lanes are not in column order
    let (to_cols, to_lanes) = match E::SLOTS {
        Some(slots) => {
            let mut inv = [0u32; NR];
            for (j, &col) in slots.iter().enumerate() {
                inv[col as usize] = j as u32;
            }
            let v = |x: [u32; NR]| _mm512_loadu_si512(x.as_ptr() as *const __m512i);
            (Some(v(inv)), Some(v(slots)))
        }
        None => (None, None),
    };
    let mut s = [[_mm512_setzero_ps(); P]; R];
    if acc {
        for (r, s) in s.iter_mut().enumerate() {
            for (q, s) in s.iter_mut().enumerate() {
                let v = _mm512_loadu_ps(c.add(r * ldc + q * NR));
                *s = match to_lanes {
                    Some(i) => _mm512_permutexvar_ps(i, v),
                    None => v,
                };
            }
        }
    }
    // rows past `MR` (a tall tile) lie in the next row panel, MR · kc on (`x_at`)
    let (mut a, mut a1) = (a, a.wrapping_add(MR * kc));
    let (mut w0, fetch) = (b.map(|b| b.w), b.iter().any(|b| b.fetch));
    let mut d = [[_mm512_setzero_ps(); 2]; P];
    for p in 0..kc {
        next_scales(p, &b, &mut d, |r, j| E::scales16(r, j));
        if fetch {
            prefetch(&w0);
        }
        if R < MR {
            // few rows: each group's weights formed and used in turn (fewer live registers)
            let x: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(x_at(a, a1, r)));
            for q in 0..P {
                let w = E::load16(w0[q], &d[q]);
                for (s, x) in s.iter_mut().zip(&x) {
                    s[q] = _mm512_fmadd_ps(*x, w, s[q]);
                }
            }
        } else {
            let w: [__m512; P] = std::array::from_fn(|q| E::load16(w0[q], &d[q]));
            for (r, s) in s.iter_mut().enumerate() {
                let x = _mm512_set1_ps(x_at(a, a1, r));
                for q in 0..P {
                    s[q] = _mm512_fmadd_ps(x, w[q], s[q]);
                }
            }
        }
        a = a.add(MR);
        a1 = a1.wrapping_add(MR);
        for w in w0.iter_mut() {
            *w = w.add(E::LAYOUT.step);
        }
    }
    for (r, s) in s.iter().enumerate() {
        for (q, &v) in s.iter().enumerate() {
            let v = match to_cols {
                Some(i) => _mm512_permutexvar_ps(i, v),
                None => v,
            };
            _mm512_storeu_ps(c.add(r * ldc + q * NR), v);
        }
    }
}

/// Row r's x value at a depth of a tile's row panels: the panel at `a`, then (r >= `MR`) the next at `a1`.
#[inline(always)]
unsafe fn x_at(a: *const f32, a1: *const f32, r: usize) -> f32 {
    if r < MR {
        *a.add(r)
    } else {
        *a1.add(r - MR)
    }
}

/// A tile with fewer than `NR` valid columns (`R` rows, one group), through a full-width copy.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn edge_tile<T: Tiles, E: Panel, const R: usize>(
    kc: usize,
    a: *const f32,
    b: Cursor<E>,
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
    T::tile::<E, R, 1>(kc, a, [b], t.as_mut_ptr() as *mut f32, NR, acc);
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
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<E: Panel, const R: usize, const P: usize>(
    kc: usize,
    a: *const f32,
    b: [Cursor<E>; P],
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
    let (mut a, mut w0, fetch) = (a, b.map(|b| b.w), b.iter().any(|b| b.fetch));
    let mut d = [[_mm256_setzero_ps(); 4]; P];
    for p in 0..kc {
        next_scales(p, &b, &mut d, |r, j| E::scales(r, j));
        if fetch {
            prefetch(&w0);
        }
        if P == 1 {
            let (b0, b1) = E::load(w0[0], &d[0]);
            for (r, s) in s.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(r));
                s[0][0] = _mm256_fmadd_ps(x, b0, s[0][0]);
                s[0][1] = _mm256_fmadd_ps(x, b1, s[0][1]);
            }
        } else {
            // few rows, several groups: each x value broadcast once per depth
            let x: [__m256; R] = std::array::from_fn(|r| _mm256_broadcast_ss(&*a.add(r)));
            for q in 0..P {
                let (b0, b1) = E::load(w0[q], &d[q]);
                for (r, s) in s.iter_mut().enumerate() {
                    s[q][0] = _mm256_fmadd_ps(x[r], b0, s[q][0]);
                    s[q][1] = _mm256_fmadd_ps(x[r], b1, s[q][1]);
                }
            }
        }
        a = a.add(MR);
        for w in w0.iter_mut() {
            *w = w.add(E::LAYOUT.step);
        }
    }
    for (r, s) in s.iter().enumerate() {
        for (q, s) in s.iter().enumerate() {
            _mm256_storeu_ps(c.add(r * ldc + q * NR), s[0]);
            _mm256_storeu_ps(c.add(r * ldc + q * NR + 8), s[1]);
        }
    }
}

//! The integer products with AVX-512 VNNI (`vpdpbusd`: 64 byte products summed into 16 32-bit lanes per
//! instruction): the same bits as `dot_scalar`.

use super::*;
use std::arch::x86_64::*;

/// `dot_scalar` with AVX-512 VNNI: the same bits.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `data` holds one group's k / depths records; each row covers k values.
pub(super) unsafe fn group(
    format: QuantFormat,
    data: &[u8],
    k: usize,
    tile: &[Row],
    acc: &mut [[f32; GROUP]; MAX_TILE],
) {
    macro_rules! rows {
        ($f:ident) => {
            match tile.len() {
                1 => store(&$f::<1>(data, k, tile), acc),
                2 => store(&$f::<2>(data, k, tile), acc),
                3 => store(&$f::<3>(data, k, tile), acc),
                4 => store(&$f::<4>(data, k, tile), acc),
                5 => store(&$f::<5>(data, k, tile), acc),
                6 => store(&$f::<6>(data, k, tile), acc),
                7 => store(&$f::<7>(data, k, tile), acc),
                _ => store(&$f::<8>(data, k, tile), acc),
            }
        };
    }
    per_format!(format, rows)
}

/// `round_block` with AVX-512: the same values (the maximum and the integer sums are exact in any order, and
/// the conversion rounds to nearest, ties to even, as `round_ties_even`).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn round_block(x: &[f32], q: &mut [i8]) -> (f32, i32, i32) {
    assert!(x.len() == ABLOCK && q.len() == ABLOCK);
    let (a, b) = (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16)));
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let (d, id) = Acts::scale_of(amax);
    let id = _mm512_set1_ps(id);
    let (qa, qb) = (_mm512_cvtps_epi32(_mm512_mul_ps(a, id)), _mm512_cvtps_epi32(_mm512_mul_ps(b, id)));
    _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtepi32_epi8(qb));
    (d, _mm512_reduce_add_epi32(qa), _mm512_reduce_add_epi32(qb))
}

#[target_feature(enable = "avx512f")]
unsafe fn store<const R: usize>(v: &[__m512; R], acc: &mut [[f32; GROUP]; MAX_TILE]) {
    for r in 0..R {
        _mm512_storeu_ps(acc[r].as_mut_ptr(), v[r]);
    }
}

/// Bytes ahead of the current weights that each 64-byte load asks the memory for (software prefetch: a
/// one-row product streams the weights once, with little else to hide the memory's latency behind).
const PREFETCH: usize = 1024;

/// A 64-byte load of weights at `p` in a tile of R rows, asking for the line `PREFETCH` bytes on where R > 1: it
/// helps tiles of several rows and costs a one-row product, which already streams at the memory's speed
/// (benches/results/quantization.md, "Measurements that stood in code comments").
#[inline(always)]
unsafe fn load<const R: usize>(p: *const u8) -> __m512i {
    if R > 1 {
        _mm_prefetch::<_MM_HINT_T0>(p.add(PREFETCH) as *const i8);
    }
    _mm512_loadu_si512(p as *const _)
}

/// Whether a tile of R rows keeps two integer sums per row (the second for every other 4 depths): one row's
/// chain of dependent `vpdpbusd`s is then half as long; the sums are exact, so their split changes no bit.
/// Wider tiles have chains enough (and would run out of registers).
const fn split(r: usize) -> bool {
    r <= 4
}

/// isum (or, `second` in a split tile, isum2) += the 4-byte dot products of `w` with row r's values at i.
#[inline(always)]
unsafe fn dot<const R: usize>(
    isum: &mut [__m512i; R],
    isum2: &mut [__m512i; R],
    second: bool,
    w: __m512i,
    x: &[Row],
    i: usize,
) {
    for r in 0..R {
        if second && split(R) {
            isum2[r] = _mm512_dpbusd_epi32(isum2[r], w, quad(&x[r], i));
        } else {
            isum[r] = _mm512_dpbusd_epi32(isum[r], w, quad(&x[r], i));
        }
    }
}

/// isum + isum2 per row.
#[inline(always)]
unsafe fn join<const R: usize>(isum: [__m512i; R], isum2: [__m512i; R]) -> [__m512i; R] {
    if split(R) {
        std::array::from_fn(|r| _mm512_add_epi32(isum[r], isum2[r]))
    } else {
        isum
    }
}

/// 4 bytes of row x from value i, broadcast.
#[inline(always)]
unsafe fn quad(x: &Row, i: usize) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(x.q.add(i) as *const i32))
}

/// A record's 16 f16 at byte `at`, as f32.
#[inline(always)]
unsafe fn f16s(rec: *const u8, at: usize) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at) as *const __m256i))
}

/// 16 unsigned (signed: `_mm512_cvtepi8_epi32`) bytes at `at` as f32.
#[inline(always)]
unsafe fn u8s(rec: *const u8, at: usize) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(at) as *const __m128i)))
}
#[inline(always)]
unsafe fn i8s(rec: *const u8, at: usize) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(at) as *const __m128i)))
}

/// acc = fma(f32(isum + isum2), scale·dx, acc) per row.
#[inline(always)]
unsafe fn scale<const R: usize>(
    acc: &mut [__m512; R],
    isum: [__m512i; R],
    isum2: [__m512i; R],
    scale: __m512,
    x: &[Row],
    b: usize,
) {
    let isum = join(isum, isum2);
    for r in 0..R {
        let s = _mm512_mul_ps(scale, _mm512_set1_ps(*x[r].d.add(b)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
    }
}

/// The sums of `count` octets (64 bytes each at `v`: depths p0 + 8o + 0..8), the low nibbles OR'd with
/// `high`'s bits for depth quad u, added into `isum` (the high nibbles' into `isum2`, see `split`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn octets<const R: usize>(
    v: *const u8,
    count: usize,
    x: &[Row],
    p0: usize,
    isum: &mut [__m512i; R],
    isum2: &mut [__m512i; R],
    high: High<__m512i>,
) {
    let m4 = _mm512_set1_epi8(0x0F);
    for o in 0..count {
        let b = load::<R>(v.add(o * VEC));
        let lo = _mm512_or_si512(_mm512_and_si512(b, m4), high_bits(high, 2 * o));
        let hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(b), m4), high_bits(high, 2 * o + 1));
        dot(isum, isum2, false, lo, x, p0 + 8 * o);
        dot(isum, isum2, true, hi, x, p0 + 8 * o + 4);
    }
}

/// `high`'s bits for depth quad u, in place over the nibbles (bit 4, bits 4-5).
#[inline(always)]
unsafe fn high_bits(high: High<__m512i>, u: usize) -> __m512i {
    match high.at(u) {
        Some((plane, bit, mask)) => bit_to(plane, bit, 4, mask),
        None => _mm512_setzero_si512(),
    }
}

/// Bits u (depth quad u) of each byte of a plane, moved to bit `to` (only that bit kept).
#[inline(always)]
unsafe fn bit_to(plane: __m512i, u: usize, to: usize, mask: i8) -> __m512i {
    _mm512_and_si512(
        shift16!(plane, to as i32 - u as i32, _mm512_slli_epi16, _mm512_srli_epi16),
        _mm512_set1_epi8(mask),
    )
}

/// Per row, the integer sums start at −offset · (the block's sum of xq).
#[inline(always)]
unsafe fn start<const R: usize>(x: &[Row], sums: impl Fn(&Row) -> i32, off: i32) -> [__m512i; R] {
    std::array::from_fn(|r| _mm512_set1_epi32(-off * sums(&x[r])))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q8_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    let sh = shape(QuantFormat::Q8_0).unwrap();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut rec = data.as_ptr();
    for b in 0..k / 32 {
        let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s32.add(b), 128), [_mm512_setzero_si512(); R]);
        let v = rec.add(sh.scales);
        for t in 0..8 {
            dot(&mut isum, &mut isum2, t % 2 == 1, load::<R>(v.add(t * VEC)), x, 32 * b + 4 * t);
        }
        scale(&mut acc, isum, isum2, f16s(rec, D), x, b);
        rec = rec.add(sh.bytes());
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q4_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    let sh = shape(QuantFormat::Q4_0).unwrap();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut rec = data.as_ptr();
    let zero = _mm512_setzero_si512();
    for b in 0..k / 32 {
        let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s32.add(b), 8), [zero; R]);
        octets(rec.add(sh.scales), 4, x, 32 * b, &mut isum, &mut isum2, High::None);
        scale(&mut acc, isum, isum2, f16s(rec, D), x, b);
        rec = rec.add(sh.bytes());
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q5_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    let sh = shape(QuantFormat::Q5_0).unwrap();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut rec = data.as_ptr();
    for b in 0..k / 32 {
        let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s32.add(b), 16), [_mm512_setzero_si512(); R]);
        let v = rec.add(sh.scales);
        let fifth = load::<R>(v.add(4 * VEC));
        octets(v, 4, x, 32 * b, &mut isum, &mut isum2, High::Fifth(fifth));
        scale(&mut acc, isum, isum2, f16s(rec, D), x, b);
        rec = rec.add(sh.bytes());
    }
    acc
}

/// q4_k and q5_k (`FIFTH`): per sub-block of 32, the scaled sum, then the min times the block's sum.
#[inline(always)]
unsafe fn k4<const R: usize, const FIFTH: bool>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    let format = if FIFTH { QuantFormat::Q5K } else { QuantFormat::Q4K };
    let sh = shape(format).unwrap();
    let per = if FIFTH { 5 * VEC } else { 4 * VEC };
    let mut acc = [_mm512_setzero_ps(); R];
    let mut rec = data.as_ptr();
    let zero = _mm512_setzero_si512();
    for sb in 0..k / 256 {
        let (d, dmin) = (f16s(rec, D), f16s(rec, DMIN));
        let v = rec.add(sh.scales);
        for j in 0..8 {
            let b = 8 * sb + j;
            let (mut isum, mut isum2) = ([zero; R], [zero; R]);
            let vj = v.add(j * per);
            if FIFTH {
                let fifth = load::<R>(vj.add(4 * VEC));
                octets(vj, 4, x, 32 * b, &mut isum, &mut isum2, High::Fifth(fifth));
            } else {
                octets(vj, 4, x, 32 * b, &mut isum, &mut isum2, High::None);
            }
            scale(&mut acc, isum, isum2, _mm512_mul_ps(d, u8s(rec, K4_SCALES + GROUP * j)), x, b);
            let dm = _mm512_mul_ps(dmin, u8s(rec, K4_MINS + GROUP * j));
            for r in 0..R {
                acc[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(*x[r].xs.add(b)), acc[r]);
            }
        }
        rec = rec.add(sh.bytes());
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q4_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    k4::<R, false>(data, k, x)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q5_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    k4::<R, true>(data, k, x)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q6_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
    let sh = shape(QuantFormat::Q6K).unwrap();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut rec = data.as_ptr();
    let zero = _mm512_setzero_si512();
    for sb in 0..k / 256 {
        let d = f16s(rec, D);
        let v = rec.add(sh.scales);
        for j in 0..16 {
            let p0 = 256 * sb + 16 * j;
            let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s16.add(p0 / 16), 32), [zero; R]);
            let vj = v.add(j * 3 * VEC);
            let high = load::<R>(vj.add(2 * VEC));
            octets(vj, 2, x, p0, &mut isum, &mut isum2, High::Pairs(high));
            scale(&mut acc, isum, isum2, _mm512_mul_ps(d, i8s(rec, K6_SCALES + GROUP * j)), x, p0 / 32);
        }
        rec = rec.add(sh.bytes());
    }
    acc
}

//! The integer products on CPUs with AVX2 only (`vpmaddubsw` + `vpmaddwd`, 8 lanes at a time): the same bits as
//! `dot_scalar`.

use super::*;
use std::arch::x86_64::*;

/// A group's 16 columns as two registers of 8 (columns 0-7 from the low 32 bytes of each 64-byte vector, 8-15
/// from the high ones).
type Pair = [__m256i; 2];

/// `dot_scalar` with AVX2: the same bits. The 4-byte products go through `vpmaddubsw` (pairs into 16 bits,
/// saturating: the stored values are at most 63 there, so a pair stays within 2·63·127; q8_0's signed bytes
/// are multiplied as |w| times x with w's sign, at most 2·128·127) and `vpmaddwd` (pairs of those into 32
/// bits), which gives `vpdpbusd`'s sums.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `data` holds one group's k / depths records; each row covers k values;
/// the tile has at most `Isa::Avx2.tile()` rows.
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
                _ => store(&$f::<4>(data, k, tile), acc),
            }
        };
    }
    per_format!(format, rows)
}

/// `round_block` with AVX2: the same values (the maximum and the integer sums are exact in any order, and the
/// conversion rounds to nearest, ties to even, as `round_ties_even`).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn round_block(x: &[f32], q: &mut [i8]) -> (f32, i32, i32) {
    assert!(x.len() == ABLOCK && q.len() == ABLOCK);
    let p = x.as_ptr();
    let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let m = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
        _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
    );
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)));
    let (d, id) = Acts::scale_of(amax);
    let id = _mm256_set1_ps(id);
    let r = [
        _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)),
        _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id)),
        _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)),
        _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id)),
    ];
    // the packs work per 128-bit lane: 4-value pieces come out as r0a r1a r2a r3a r0b r1b r2b r3b
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
    (d, hsum(_mm256_add_epi32(r[0], r[1])), hsum(_mm256_add_epi32(r[2], r[3])))
}

#[inline(always)]
unsafe fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
}

#[target_feature(enable = "avx2")]
unsafe fn store<const R: usize>(v: &[[__m256; 2]; R], acc: &mut [[f32; GROUP]; MAX_TILE]) {
    for r in 0..R {
        _mm256_storeu_ps(acc[r].as_mut_ptr(), v[r][0]);
        _mm256_storeu_ps(acc[r].as_mut_ptr().add(8), v[r][1]);
    }
}

#[inline(always)]
unsafe fn load(p: *const u8) -> Pair {
    [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i)]
}

#[inline(always)]
unsafe fn quad(x: &Row, i: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(x.q.add(i) as *const i32))
}

/// isum += the 4-byte dot products of unsigned `w` (each value ≤ 63) with row r's values at i.
#[inline(always)]
unsafe fn dot<const R: usize>(isum: &mut [Pair; R], w: Pair, x: &[Row], i: usize) {
    let ones = _mm256_set1_epi16(1);
    for r in 0..R {
        let xq = quad(&x[r], i);
        for h in 0..2 {
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w[h], xq), ones);
            isum[r][h] = _mm256_add_epi32(isum[r][h], p);
        }
    }
}

/// isum += the 4-byte dot products of q8_0's stored bytes (w + 128) with row r's values at i, as |w| · (x with
/// w's sign).
#[inline(always)]
unsafe fn dot_signed<const R: usize>(isum: &mut [Pair; R], stored: Pair, x: &[Row], i: usize) {
    let ones = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    let w = [_mm256_xor_si256(stored[0], flip), _mm256_xor_si256(stored[1], flip)];
    let a = [_mm256_sign_epi8(w[0], w[0]), _mm256_sign_epi8(w[1], w[1])];
    for r in 0..R {
        let xq = quad(&x[r], i);
        for h in 0..2 {
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a[h], _mm256_sign_epi8(xq, w[h])), ones);
            isum[r][h] = _mm256_add_epi32(isum[r][h], p);
        }
    }
}

#[inline(always)]
unsafe fn f16s(rec: *const u8, at: usize) -> [__m256; 2] {
    let p = rec.add(at) as *const __m128i;
    [_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)))]
}

#[inline(always)]
unsafe fn u8s(rec: *const u8, at: usize) -> [__m256; 2] {
    let (a, b) = (rec.add(at) as *const __m128i, rec.add(at + 8) as *const __m128i);
    [
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(a))),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(b))),
    ]
}

#[inline(always)]
unsafe fn i8s(rec: *const u8, at: usize) -> [__m256; 2] {
    let (a, b) = (rec.add(at) as *const __m128i, rec.add(at + 8) as *const __m128i);
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(a))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(b))),
    ]
}

#[inline(always)]
unsafe fn mul(a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
    [_mm256_mul_ps(a[0], b[0]), _mm256_mul_ps(a[1], b[1])]
}

/// acc = fma(f32(isum), scale·dx, acc) per row.
#[inline(always)]
unsafe fn scale<const R: usize>(acc: &mut [[__m256; 2]; R], isum: &[Pair; R], scale: [__m256; 2], x: &[Row], b: usize) {
    for r in 0..R {
        let dx = _mm256_set1_ps(*x[r].d.add(b));
        for h in 0..2 {
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(scale[h], dx), acc[r][h]);
        }
    }
}

#[inline(always)]
unsafe fn start<const R: usize>(x: &[Row], sums: impl Fn(&Row) -> i32, off: i32) -> [Pair; R] {
    std::array::from_fn(|r| [_mm256_set1_epi32(-off * sums(&x[r])); 2])
}

/// `high`'s bits for depth quad u, in place over the nibbles (bit 4, bits 4-5), per half.
#[inline(always)]
unsafe fn high_bits(high: High<Pair>, u: usize) -> Pair {
    match high.at(u) {
        Some((plane, bit, mask)) => bit_to(plane, bit, 4, mask),
        None => ZERO,
    }
}

/// Bits u of each byte moved to bit `to` (only that bit kept), per half.
#[inline(always)]
unsafe fn bit_to(plane: Pair, u: usize, to: usize, mask: i8) -> Pair {
    [shift_and(plane[0], to as i32 - u as i32, mask), shift_and(plane[1], to as i32 - u as i32, mask)]
}

/// v shifted left by `by` bits (right where negative) within 16-bit lanes, ANDed with `mask` per byte.
#[inline(always)]
unsafe fn shift_and(v: __m256i, by: i32, mask: i8) -> __m256i {
    _mm256_and_si256(shift16!(v, by, _mm256_slli_epi16, _mm256_srli_epi16), _mm256_set1_epi8(mask))
}

/// `count` octets from `v` (depths p0 + 8o ..), low nibbles OR'd with `high(u)` for depth quad u, into isum.
#[inline(always)]
unsafe fn octets<const R: usize>(
    v: *const u8,
    count: usize,
    x: &[Row],
    p0: usize,
    isum: &mut [Pair; R],
    high: High<Pair>,
) {
    let m4 = _mm256_set1_epi8(0x0F);
    for o in 0..count {
        let b = load(v.add(o * VEC));
        let (hl, hh) = (high_bits(high, 2 * o), high_bits(high, 2 * o + 1));
        let lo =
            [_mm256_or_si256(_mm256_and_si256(b[0], m4), hl[0]), _mm256_or_si256(_mm256_and_si256(b[1], m4), hl[1])];
        let hi = [
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b[0]), m4), hh[0]),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b[1]), m4), hh[1]),
        ];
        dot(isum, lo, x, p0 + 8 * o);
        dot(isum, hi, x, p0 + 8 * o + 4);
    }
}

const ZERO: Pair = unsafe { std::mem::zeroed() };

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    let sh = shape(QuantFormat::Q8_0).unwrap();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut rec = data.as_ptr();
    for b in 0..k / 32 {
        let mut isum = [ZERO; R];
        let v = rec.add(sh.scales);
        for t in 0..8 {
            dot_signed(&mut isum, load(v.add(t * VEC)), x, 32 * b + 4 * t);
        }
        scale(&mut acc, &isum, f16s(rec, D), x, b);
        rec = rec.add(sh.bytes());
    }
    acc
}

/// q4_0 and q5_0 (`FIFTH`).
#[inline(always)]
unsafe fn b32<const R: usize, const FIFTH: bool>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    let sh = shape(if FIFTH { QuantFormat::Q5_0 } else { QuantFormat::Q4_0 }).unwrap();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut rec = data.as_ptr();
    for b in 0..k / 32 {
        let mut isum = start::<R>(x, |row| *row.s32.add(b), if FIFTH { 16 } else { 8 });
        let v = rec.add(sh.scales);
        if FIFTH {
            let fifth = load(v.add(4 * VEC));
            octets(v, 4, x, 32 * b, &mut isum, High::Fifth(fifth));
        } else {
            octets(v, 4, x, 32 * b, &mut isum, High::None);
        }
        scale(&mut acc, &isum, f16s(rec, D), x, b);
        rec = rec.add(sh.bytes());
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    b32::<R, false>(data, k, x)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    b32::<R, true>(data, k, x)
}

/// q4_k and q5_k (`FIFTH`).
#[inline(always)]
unsafe fn k4<const R: usize, const FIFTH: bool>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    let sh = shape(if FIFTH { QuantFormat::Q5K } else { QuantFormat::Q4K }).unwrap();
    let per = if FIFTH { 5 * VEC } else { 4 * VEC };
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut rec = data.as_ptr();
    for sb in 0..k / 256 {
        let (d, dmin) = (f16s(rec, D), f16s(rec, DMIN));
        let v = rec.add(sh.scales);
        for j in 0..8 {
            let b = 8 * sb + j;
            let mut isum = [ZERO; R];
            let vj = v.add(j * per);
            if FIFTH {
                let fifth = load(vj.add(4 * VEC));
                octets(vj, 4, x, 32 * b, &mut isum, High::Fifth(fifth));
            } else {
                octets(vj, 4, x, 32 * b, &mut isum, High::None);
            }
            scale(&mut acc, &isum, mul(d, u8s(rec, K4_SCALES + GROUP * j)), x, b);
            let dm = mul(dmin, u8s(rec, K4_MINS + GROUP * j));
            for r in 0..R {
                let xs = _mm256_set1_ps(*x[r].xs.add(b));
                for h in 0..2 {
                    acc[r][h] = _mm256_fnmadd_ps(dm[h], xs, acc[r][h]);
                }
            }
        }
        rec = rec.add(sh.bytes());
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    k4::<R, false>(data, k, x)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    k4::<R, true>(data, k, x)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
    let sh = shape(QuantFormat::Q6K).unwrap();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut rec = data.as_ptr();
    for sb in 0..k / 256 {
        let d = f16s(rec, D);
        let v = rec.add(sh.scales);
        for j in 0..16 {
            let p0 = 256 * sb + 16 * j;
            let mut isum = start::<R>(x, |row| *row.s16.add(p0 / 16), 32);
            let vj = v.add(j * 3 * VEC);
            let high = load(vj.add(2 * VEC));
            octets(vj, 2, x, p0, &mut isum, High::Pairs(high));
            scale(&mut acc, &isum, mul(d, i8s(rec, K6_SCALES + GROUP * j)), x, p0 / 32);
        }
        rec = rec.add(sh.bytes());
    }
    acc
}

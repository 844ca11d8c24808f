//! Block formats decoded to f32 rows (`dequantize_rows`: AVX2 where the CPU has it, else the scalar
//! [`QMatrix::dequantize_rows`]; the same values either way), and the per-format x86 decoders (`x86`: a block's
//! values as bytes, its scales and factors) that the few-row kernels (`skinny`) also use in registers.

use crate::kernels::blocks::QMatrix;
use crate::kernels::cpu::Cpu;

/// Rows `j0..j0 + count` of a quantized matrix as f32 into `out` ([`QMatrix::dequantize_rows`], vectorised where
/// the CPU allows; the same values either way).
pub(crate) fn dequantize_rows(q: &QMatrix, j0: usize, count: usize, out: &mut [f32]) {
    // SAFETY: `avx2` is what this CPU has.
    unsafe { dequantize_rows_on(Cpu::get().avx2(), q, j0, count, out) }
}

/// `dequantize_rows` with the AVX2 decoders (`avx2`) or the scalar ones.
///
/// # Safety
/// With `avx2`, the CPU has AVX2, FMA and F16C.
#[inline(always)]
pub(crate) unsafe fn dequantize_rows_on(avx2: bool, q: &QMatrix, j0: usize, count: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return x86::dequantize_rows_avx2(q, j0, count, out);
    }
    let _ = avx2;
    q.dequantize_rows(j0, count, out)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::kernels::blocks::{QMatrix, QuantFormat};
    use std::arch::x86_64::*;

    /// The little-endian f16 scale at `p` (a q8_0 block's d, a q4_k block's d and dmin), as f32.
    #[inline]
    #[target_feature(enable = "f16c")]
    pub(crate) unsafe fn scale(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([*p, *p.add(1)]) as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q8_8(p: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    pub(crate) unsafe fn q8_16(p: *const u8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }

    /// A q8_0 block's 32 values: its bytes after the scale.
    #[inline(always)]
    pub(crate) unsafe fn q8_ints(block: *const u8, _buf: &mut [i8; 32]) -> *const u8 {
        block.add(2)
    }

    /// A q5_0 block's 32 values q − 16 as i8, decoded into `buf`: byte j of `high` is 0x10 where bit j of qh is
    /// set (qh's byte j / 8 broadcast to 8 bytes, each tested against its own bit), OR-ed into the nibbles
    /// (values 0-15 the low ones, 16-31 the high ones).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn q5_ints(block: *const u8, buf: &mut [i8; 32]) -> *const u8 {
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
    pub(crate) unsafe fn q4_0_ints(block: *const u8, buf: &mut [i8; 32]) -> *const u8 {
        let low = _mm_set1_epi8(0xF);
        let qs = _mm_loadu_si128(block.add(2) as *const __m128i);
        let nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(qs), low), _mm_and_si128(qs, low));
        _mm256_storeu_si256(buf.as_mut_ptr() as *mut __m256i, _mm256_sub_epi8(nib, _mm256_set1_epi8(8)));
        buf.as_ptr() as *const u8
    }

    /// A q6_k super-block's 256 values q − 32 as i8 ([`blocks::q6k_value`](crate::kernels::blocks::q6k_value)), decoded
    /// into `buf`: per half, the 32 bytes of `qh` give each quarter's fifth and sixth bits (shifted to bits 4-5 in
    /// 16-bit lanes, where no bit crosses into the masked byte), OR-ed into the low or high nibbles of `ql`'s first or
    /// second 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn q6_ints(block: *const u8, buf: &mut [i8; 256]) {
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

    /// A q3_k super-block's 256 values in [−4, 3] as i8 ([`blocks::q3k_value`](crate::kernels::blocks::q3k_value)),
    /// decoded into `buf`: per half, quarter g is bits 2g, 2g + 1 of the half's 32 `qs` bytes (at 32), plus 4 where bit
    /// 4·half + g of the 32 `hmask` bytes (at 0) is set, minus 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn q3k_ints(block: *const u8, buf: &mut [i8; 256]) {
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

    /// A q2_k super-block's 256 values 0-3 as bytes ([`blocks::q2k_value`](crate::kernels::blocks::q2k_value)), decoded
    /// into `buf`: per half, quarter g is bits 2g, 2g + 1 of the half's 32 `qs` bytes (at 16).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn q2k_ints(block: *const u8, buf: &mut [i8; 256]) {
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
    pub(crate) unsafe fn scale_soft(p: *const u8) -> f32 {
        half::f16::from_le_bytes([*p, *p.add(1)]).to_f32()
    }

    /// A q6_k super-block's 16 sub-block factors d·sc (f32, as the dequantization computes them).
    #[inline(always)]
    pub(crate) unsafe fn q6k_factors(b: *const u8) -> [f32; 16] {
        let d = scale_soft(b.add(208));
        std::array::from_fn(|s| d * (*b.add(192 + s) as i8) as f32)
    }

    /// A q3_k super-block's 16 sub-block factors d·(sc − 32).
    #[inline(always)]
    pub(crate) unsafe fn q3k_factors(b: *const u8) -> [f32; 16] {
        let d = scale_soft(b.add(108));
        let sc = crate::kernels::blocks::q3k_scales(std::slice::from_raw_parts(b, 110));
        sc.map(|s| d * s as f32)
    }

    /// A q4_k (or q5_k) super-block's 8 sub-block factors (d·sc, dmin·m) into `$dm[0..8]`. A macro, not a
    /// function: expanded in the tile, the 2-row q4_k and q5_k tiles run as fast as before q2_k shared them (an
    /// inlined helper function made them slower).
    macro_rules! q4k_factors {
        ($b:expr, $dm:expr) => {{
            let b: *const u8 = $b;
            let (d, dmin) = (scale(b), scale(b.add(2)));
            let sc = std::slice::from_raw_parts(b.add(4), 12);
            for j in 0..8 {
                let (s, m) = crate::kernels::blocks::scale_min_k4(j, sc);
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

    /// A q4_k super-block's 256 nibbles as bytes 0-15 in value order (`buf`): each 32 bytes of `qs` hold the low
    /// nibbles of one sub-block of 32 and the high nibbles of the next.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn q4_ints(block: *const u8, buf: &mut [i8; 256]) {
        let low = _mm256_set1_epi8(0xF);
        for g in 0..4 {
            let qs = _mm256_loadu_si256(block.add(16 + 32 * g) as *const __m256i);
            let o = buf.as_mut_ptr().add(64 * g) as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_and_si256(qs, low));
            _mm256_storeu_si256(o.add(1), _mm256_and_si256(_mm256_srli_epi16::<4>(qs), low));
        }
    }

    /// A q5_k super-block's 256 values 0-31 as bytes in value order
    /// ([`blocks::q5k_value`](crate::kernels::blocks::q5k_value)): q4_k's nibbles (`qs` at byte 48) with bit j of each
    /// of the 32 `qh` bytes (at 16) as sub-block j's fifth bit (shifted down in 16-bit lanes, masked to bit 0 of each
    /// byte, moved to bit 4).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn q5k_ints(block: *const u8, buf: &mut [i8; 256]) {
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

    /// [`QMatrix::dequantize_rows`] with AVX2 (same operations, so the same values: q8_0 `q·d`, q4_k
    /// `(d·sc)·q − dmin·m` with a separate multiply and subtract).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize_rows_avx2(q: &QMatrix, j0: usize, count: usize, out: &mut [f32]) {
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
                        let (sc1, m1) = crate::kernels::blocks::scale_min_k4(2 * g, scales);
                        let (sc2, m2) = crate::kernels::blocks::scale_min_k4(2 * g + 1, scales);
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

    pub(crate) use {q2k_factors, q4k_factors};
}

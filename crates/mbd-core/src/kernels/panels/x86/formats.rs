//! How a tile reads `NR` weights of one depth, per format (`Panel`): f32, bf16 slot pairs, and each block
//! format's values formed in registers with their scales, as the format's dequantization forms them.

use super::{MR, NR};
use crate::kernels::records;
use std::arch::x86_64::*;

/// How a tile reads `NR` weights of one depth: packed f32 (two loads), a `PackedMatrix`'s bf16 pairs (one load,
/// widened: each 32-bit lane's low half shifted up is column i, its high half masked column 8 + i), or a block
/// format's values (q8_0: signed bytes; the others nibbles, with fifth bits or bit pairs: `Q6K`, `Q5K`, `Q5_0`,
/// `Q4K`, `Q4_0`) formed with the scales of their block exactly as the format's dequantization forms them.
///
/// With AVX-512 (`load16`) a depth's `NR` values fill one register: f32 and the block formats in column order;
/// bf16 zero-extended slot by slot, so lane j holds slot j's column (`SLOTS`), which `Zmm`'s tile maps back when
/// it loads and stores.
pub(super) trait Panel: Copy {
    /// Lane j of `load16` holds column `SLOTS[j]` (None: column j).
    const SLOTS: Option<[u32; NR]>;
    /// Elements per depth of a group ([`Layout::step`](crate::kernels::records::Layout::step)), and for a block format
    /// its scale records.
    const LAYOUT: records::Layout = records::Layout { step: NR, sblock: 0, sbytes: 0 };
    /// Depths per set of scales (0: none).
    const BLOCK: usize = 0;
    /// Groups the full AVX-512 tile takes at once (its scales take registers too).
    const FULL512: usize = 4;
    /// A block format: windows of this many rows or more take its values decoded into f32 once per depth block
    /// ([`Tiles::decode`](crate::kernels::panels::x86::tiles::Tiles::decode)), then the f32 tiles; fewer form them in
    /// the tile, once per `MR` rows. The same values either way, so the same bits. Each format's count is where
    /// decoding first overtakes forming in the tile (`crates/mbd-core/benches/quant_kernel.rs` with
    /// `MBD_BENCH_PACKED=1`: benches/results/quantization.md, "Measurements that stood in code comments").
    const DECODE_ROWS: usize = usize::MAX;
    /// The scales of set j of a record (a block format only): AVX2 (columns 0-7, 8-15; a second pair where the
    /// format has one, e.g. q4_k's mins) and AVX-512.
    #[inline(always)]
    unsafe fn scales(_rec: *const u8, _j: usize) -> [__m256; 4] {
        [_mm256_setzero_ps(); 4]
    }
    #[inline(always)]
    unsafe fn scales16(_rec: *const u8, _j: usize) -> [__m512; 2] {
        [_mm512_setzero_ps(); 2]
    }
    unsafe fn load(p: *const Self, d: &[__m256; 4]) -> (__m256, __m256);
    unsafe fn load16(p: *const Self, d: &[__m512; 2]) -> __m512;
}

/// A group's weights from some depth on: `Panel::LAYOUT.step` elements per depth at `w`, and for a block format its
/// scale records at `s`, starting with the record of `w`'s depth (a multiple of
/// [`Layout::sblock`](crate::kernels::records::Layout::sblock)).
#[derive(Clone, Copy)]
pub(super) struct Cursor<E> {
    pub(super) w: *const E,
    pub(super) s: *const u8,
    /// Whether the tile that reads these weights is their first since memory (it prefetches, `PREFETCH`).
    pub(super) fetch: bool,
}

impl<E: Panel> Cursor<E> {
    pub(super) fn dense(w: *const E) -> Self {
        Cursor { w, s: std::ptr::null(), fetch: false }
    }
    /// The scale record of depth p (counted from the cursor's first depth).
    #[inline(always)]
    unsafe fn record(&self, p: usize) -> *const u8 {
        self.s.add(p / E::LAYOUT.sblock.max(1) * E::LAYOUT.sbytes)
    }
}

/// The scales of depth p's set, for each of a tile's groups, where p starts a set.
#[inline(always)]
pub(super) unsafe fn next_scales<E: Panel, S: Copy, const P: usize>(
    p: usize,
    b: &[Cursor<E>; P],
    d: &mut [S; P],
    get: impl Fn(*const u8, usize) -> S,
) {
    if E::BLOCK > 0 && p.is_multiple_of(E::BLOCK.max(1)) {
        let j = p % E::LAYOUT.sblock.max(1) / E::BLOCK.max(1);
        for (d, b) in d.iter_mut().zip(b) {
            *d = get(b.record(p), j);
        }
    }
}

/// A `Panel`'s `scales` and `scales16`: those of format `$of`, whose scale records it shares.
macro_rules! scales_of {
    ($of:ty) => {
        #[inline(always)]
        unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
            <$of as Panel>::scales(rec, j)
        }
        #[inline(always)]
        unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
            <$of as Panel>::scales16(rec, j)
        }
    };
}

impl Panel for f32 {
    const SLOTS: Option<[u32; NR]> = None;
    #[inline(always)]
    unsafe fn load(p: *const f32, _: &[__m256; 4]) -> (__m256, __m256) {
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
    #[inline(always)]
    unsafe fn load16(p: *const f32, _: &[__m512; 2]) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Panel for u16 {
    // slot 2i: column i, slot 2i + 1: column 8 + i (`packed::slot`)
    const SLOTS: Option<[u32; NR]> = Some([0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]);
    #[inline(always)]
    unsafe fn load(p: *const u16, _: &[__m256; 4]) -> (__m256, __m256) {
        let v = _mm256_loadu_si256(p as *const __m256i);
        let lo = _mm256_slli_epi32::<16>(v);
        let hi = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
        (_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi))
    }
    #[inline(always)]
    unsafe fn load16(p: *const u16, _: &[__m512; 2]) -> __m512 {
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
    }
}

/// A record's 16 f16 scales at byte `at` (columns 0-7, 8-15).
#[inline(always)]
unsafe fn f16x16(rec: *const u8, at: usize) -> (__m256, __m256) {
    (
        _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at) as *const __m128i)),
        _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at + 16) as *const __m128i)),
    )
}

/// A record's 16 6-bit scales (or mins) at byte `at`, as f32 (columns 0-7, 8-15).
#[inline(always)]
unsafe fn u8x16(rec: *const u8, at: usize) -> (__m256, __m256) {
    let v = _mm_loadu_si128(rec.add(at) as *const __m128i);
    (_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))))
}

/// A depth's 16 nibbles ([`packed::nibble`](crate::kernels::panels::packed::nibble)'s order) in the low 4 bits of each
/// 32-bit lane, columns 0-7 and 8-15 (higher bits: other nibbles).
#[inline(always)]
unsafe fn nibbles8(p: *const u8) -> (__m256i, __m256i) {
    let v = _mm256_set1_epi64x((p as *const i64).read_unaligned());
    (
        _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12)),
        _mm256_srlv_epi32(v, _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28)),
    )
}

/// `nibbles8` with AVX-512: column j's nibble in the low 4 bits of lane j.
#[inline(always)]
unsafe fn nibbles16(p: *const u8) -> __m512i {
    let v = _mm512_set1_epi64((p as *const i64).read_unaligned());
    _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28))
}

impl Panel for i8 {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q8_0_LAYOUT;
    const BLOCK: usize = 32;
    const FULL512: usize = 3;
    #[inline(always)]
    unsafe fn scales(rec: *const u8, _: usize) -> [__m256; 4] {
        let (a, b) = f16x16(rec, 0);
        [a, b, _mm256_setzero_ps(), _mm256_setzero_ps()]
    }
    #[inline(always)]
    unsafe fn scales16(rec: *const u8, _: usize) -> [__m512; 2] {
        [_mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i)), _mm512_setzero_ps()]
    }
    #[inline(always)]
    unsafe fn load(p: *const i8, d: &[__m256; 4]) -> (__m256, __m256) {
        let q = _mm_loadu_si128(p as *const __m128i);
        let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
        (_mm256_mul_ps(lo, d[0]), _mm256_mul_ps(hi, d[1]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const i8, d: &[__m512; 2]) -> __m512 {
        let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm512_mul_ps(_mm512_cvtepi32_ps(q), d[0])
    }
}

/// A packed q5_0 byte ([`records::Q5_0_LAYOUT`]): value (q − 16) · d, q's low 4 bits from the depth's nibbles, its
/// fifth from the 16 bits before them.
#[derive(Clone, Copy)]
#[repr(transparent)]
#[allow(non_camel_case_types)]
pub(super) struct Q5_0(#[allow(dead_code)] u8);

impl Panel for Q5_0 {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q5_0_LAYOUT;
    const BLOCK: usize = 32;
    const DECODE_ROWS: usize = 3 * MR;
    scales_of!(i8);
    #[inline(always)]
    unsafe fn load(p: *const Q5_0, d: &[__m256; 4]) -> (__m256, __m256) {
        let q =
            |q: __m256i, d: __m256| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))), d);
        let (lo, hi) = fives8(p as *const u8);
        (q(lo, d[0]), q(hi, d[1]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q5_0, d: &[__m512; 2]) -> __m512 {
        // q − 16
        let table =
            _mm512_setr_ps(-16., -15., -14., -13., -12., -11., -10., -9., -8., -7., -6., -5., -4., -3., -2., -1.);
        _mm512_mul_ps(fives16(p as *const u8, table), d[0])
    }
}

/// A q5_0 or q5_k depth's 16 5-bit values ([`records::Q5_NIBBLES`]: 2 bytes of fifth bits, bit c column c, then the
/// nibbles), columns 0-7 and 8-15.
#[inline(always)]
unsafe fn fives8(p: *const u8) -> (__m256i, __m256i) {
    let (lo, hi) = nibbles8(p.add(records::Q5_NIBBLES));
    // the fifth bits (and 2 nibble bytes above them) in every lane; bit c shifted to bit 4 of lane c
    let h = _mm256_set1_epi32((p as *const i32).read_unaligned());
    let h_lo = _mm256_srlv_epi32(_mm256_slli_epi32::<4>(h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    let h_hi = _mm256_srlv_epi32(h, _mm256_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11));
    let q = |n: __m256i, h: __m256i| {
        _mm256_or_si256(_mm256_and_si256(n, _mm256_set1_epi32(0xF)), _mm256_and_si256(h, _mm256_set1_epi32(0x10)))
    };
    (q(lo, h_lo), q(hi, h_hi))
}

/// `fives8` with AVX-512, as floats offset by `table`: lane j is table[low 4 bits of column j's value], plus 16
/// where its fifth bit is set (exact for integral tables of magnitude under 2^23).
#[inline(always)]
unsafe fn fives16(p: *const u8, table: __m512) -> __m512 {
    // the low 4 bits (bits above ignored) index the table
    let v = _mm512_permutexvar_ps(nibbles16(p.add(records::Q5_NIBBLES)), table);
    _mm512_mask_add_ps(v, (p as *const u16).read_unaligned(), v, _mm512_set1_ps(16.))
}

/// A packed q4_0 nibble pair ([`records::Q4_0_LAYOUT`]): value (q − 8) · d.
#[derive(Clone, Copy)]
#[repr(transparent)]
#[allow(non_camel_case_types)]
pub(super) struct Q4_0(#[allow(dead_code)] u8);

impl Panel for Q4_0 {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q4_0_LAYOUT;
    const BLOCK: usize = 32;
    const DECODE_ROWS: usize = 4 * MR;
    scales_of!(i8);
    #[inline(always)]
    unsafe fn load(p: *const Q4_0, d: &[__m256; 4]) -> (__m256, __m256) {
        let (lo, hi) = nibbles8(p as *const u8);
        let v = |n: __m256i, d: __m256| {
            let q = _mm256_sub_epi32(_mm256_and_si256(n, _mm256_set1_epi32(0xF)), _mm256_set1_epi32(8));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
        };
        (v(lo, d[0]), v(hi, d[1]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q4_0, d: &[__m512; 2]) -> __m512 {
        // the nibble (bits above ignored) indexes q − 8
        let table = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
        _mm512_mul_ps(_mm512_permutexvar_ps(nibbles16(p as *const u8), table), d[0])
    }
}

/// A packed q5_k byte ([`records::Q5K_LAYOUT`]): value (d · sc) · q − dmin · m as q4_k's, q of 5 bits as q5_0's.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Q5K(#[allow(dead_code)] u8);

impl Panel for Q5K {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q5K_LAYOUT;
    const BLOCK: usize = 32;
    const DECODE_ROWS: usize = 3 * MR;
    scales_of!(Q4K);
    #[inline(always)]
    unsafe fn load(p: *const Q5K, d: &[__m256; 4]) -> (__m256, __m256) {
        let (lo, hi) = fives8(p as *const u8);
        let v = |q: __m256i, d: __m256, m: __m256| _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
        (v(lo, d[0], d[2]), v(hi, d[1], d[3]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q5K, d: &[__m512; 2]) -> __m512 {
        let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        _mm512_sub_ps(_mm512_mul_ps(d[0], fives16(p as *const u8, table)), d[1])
    }
}

/// A packed q4_k nibble pair ([`records::Q4K_LAYOUT`]): value (d · sc) · q − dmin · m, sc and m those of its
/// sub-block of 32 depths.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Q4K(#[allow(dead_code)] u8);

impl Panel for Q4K {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q4K_LAYOUT;
    const BLOCK: usize = 32;
    const DECODE_ROWS: usize = 4 * MR;
    #[inline(always)]
    unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
        let ((d0, d1), (n0, n1)) = (f16x16(rec, 0), f16x16(rec, records::Q4K_DMIN));
        let ((s0, s1), (m0, m1)) = (u8x16(rec, records::Q4K_SCALES + NR * j), u8x16(rec, records::Q4K_MINS + NR * j));
        [_mm256_mul_ps(d0, s0), _mm256_mul_ps(d1, s1), _mm256_mul_ps(n0, m0), _mm256_mul_ps(n1, m1)]
    }
    #[inline(always)]
    unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
        let f16s = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at) as *const __m256i));
        let u8s = |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(at) as *const __m128i)));
        let (dmin, sc, m) = (records::Q4K_DMIN, records::Q4K_SCALES + NR * j, records::Q4K_MINS + NR * j);
        [_mm512_mul_ps(f16s(0), u8s(sc)), _mm512_mul_ps(f16s(dmin), u8s(m))]
    }
    #[inline(always)]
    unsafe fn load(p: *const Q4K, d: &[__m256; 4]) -> (__m256, __m256) {
        let (lo, hi) = nibbles8(p as *const u8);
        let v = |n: __m256i, d: __m256, m: __m256| {
            _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(n, _mm256_set1_epi32(0xF)))), m)
        };
        (v(lo, d[0], d[2]), v(hi, d[1], d[3]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q4K, d: &[__m512; 2]) -> __m512 {
        // the nibble (bits above ignored) indexes 0.0..15.0
        let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let q = _mm512_permutexvar_ps(nibbles16(p as *const u8), table);
        _mm512_sub_ps(_mm512_mul_ps(d[0], q), d[1])
    }
}

/// A packed q6_k byte ([`records::Q6K_LAYOUT`]): value (d · sc) · (q − 32), sc that of its sub-block of 16 depths,
/// q's low 4 bits from the depth's nibbles, its high 2 from the bit pairs after them.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Q6K(#[allow(dead_code)] u8);

impl Panel for Q6K {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q6K_LAYOUT;
    const BLOCK: usize = 16;
    const FULL512: usize = 3;
    const DECODE_ROWS: usize = 4 * MR;
    #[inline(always)]
    unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
        let (d0, d1) = f16x16(rec, 0);
        let sc = _mm_loadu_si128(rec.add(records::Q6K_SCALES + NR * j) as *const __m128i);
        let s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
        let s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)));
        [_mm256_mul_ps(d0, s0), _mm256_mul_ps(d1, s1), _mm256_setzero_ps(), _mm256_setzero_ps()]
    }
    #[inline(always)]
    unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
        let sc = _mm_loadu_si128(rec.add(records::Q6K_SCALES + NR * j) as *const __m128i);
        [_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))), _mm512_setzero_ps()]
    }
    #[inline(always)]
    unsafe fn load(p: *const Q6K, d: &[__m256; 4]) -> (__m256, __m256) {
        let p = p as *const u8;
        let (lo, hi) = nibbles8(p);
        let (h_lo, h_hi) = pairs8(p.add(records::Q6K_HIGH));
        let q = |n: __m256i, h: __m256i, d: __m256| {
            let q = _mm256_or_si256(
                _mm256_and_si256(n, _mm256_set1_epi32(0xF)),
                _mm256_slli_epi32::<4>(_mm256_and_si256(h, _mm256_set1_epi32(3))),
            );
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32))), d)
        };
        (q(lo, h_lo, d[0]), q(hi, h_hi, d[1]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q6K, d: &[__m512; 2]) -> __m512 {
        let p = p as *const u8;
        // the nibble (bits above ignored) indexes 0..15, the bit pair (the 2 bits above it: the next column's,
        // ignored) 16 · pair − 32; their sum is q − 32 (exact)
        let low = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let high = _mm512_setr_ps(-32., -16., 0., 16., -32., -16., 0., 16., -32., -16., 0., 16., -32., -16., 0., 16.);
        let h = pairs16(p.add(records::Q6K_HIGH));
        let q = _mm512_add_ps(_mm512_permutexvar_ps(nibbles16(p), low), _mm512_permutexvar_ps(h, high));
        _mm512_mul_ps(q, d[0])
    }
}

/// A depth's 16 bit pairs (4 bytes, column c at bits 2c, 2c + 1) at the bottom of each 32-bit lane, columns 0-7
/// and 8-15 (higher bits: other columns' pairs).
#[inline(always)]
unsafe fn pairs8(p: *const u8) -> (__m256i, __m256i) {
    let h = _mm256_set1_epi32((p as *const i32).read_unaligned());
    (
        _mm256_srlv_epi32(h, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_srlv_epi32(h, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)),
    )
}

/// `pairs8` with AVX-512: column j's pair at the bottom of lane j.
#[inline(always)]
unsafe fn pairs16(p: *const u8) -> __m512i {
    let h = _mm512_set1_epi32((p as *const i32).read_unaligned());
    _mm512_srlv_epi32(h, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30))
}

/// A packed q3_k byte ([`records::Q3K_LAYOUT`]): value (d · sc) · (pair − 4 + 4 · high), sc that of its sub-block of
/// 16 depths.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Q3K(#[allow(dead_code)] u8);

impl Panel for Q3K {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q3K_LAYOUT;
    const BLOCK: usize = 16;
    const DECODE_ROWS: usize = 3 * MR;
    scales_of!(Q6K);
    #[inline(always)]
    unsafe fn load(p: *const Q3K, d: &[__m256; 4]) -> (__m256, __m256) {
        let p = p as *const u8;
        let (lo, hi) = pairs8(p.add(records::Q3K_PAIRS));
        // the high bits (and 2 pair bytes above them) in every lane; bit c moved to bit 2 of lane c
        let h = _mm256_set1_epi32((p as *const i32).read_unaligned());
        let h_lo = _mm256_srlv_epi32(_mm256_slli_epi32::<2>(h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let h_hi = _mm256_srlv_epi32(h, _mm256_setr_epi32(6, 7, 8, 9, 10, 11, 12, 13));
        let q = |n: __m256i, h: __m256i, d: __m256| {
            let u =
                _mm256_or_si256(_mm256_and_si256(n, _mm256_set1_epi32(3)), _mm256_and_si256(h, _mm256_set1_epi32(4)));
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(4))), d)
        };
        (q(lo, h_lo, d[0]), q(hi, h_hi, d[1]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q3K, d: &[__m512; 2]) -> __m512 {
        let p = p as *const u8;
        // the pair (the 2 bits above it ignored) indexes pair − 4; a set high bit adds 4 (exact)
        let table = _mm512_setr_ps(-4., -3., -2., -1., -4., -3., -2., -1., -4., -3., -2., -1., -4., -3., -2., -1.);
        let v = _mm512_permutexvar_ps(pairs16(p.add(records::Q3K_PAIRS)), table);
        let v = _mm512_mask_add_ps(v, (p as *const u16).read_unaligned(), v, _mm512_set1_ps(4.));
        _mm512_mul_ps(v, d[0])
    }
}

/// A packed q2_k byte ([`records::Q2K_LAYOUT`]): value (d · sc) · q − dmin · m, sc and m those of its sub-block of 16
/// depths.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Q2K(#[allow(dead_code)] u8);

impl Panel for Q2K {
    const SLOTS: Option<[u32; NR]> = None;
    const LAYOUT: records::Layout = records::Q2K_LAYOUT;
    const BLOCK: usize = 16;
    const DECODE_ROWS: usize = 4 * MR;
    #[inline(always)]
    unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
        let ((d0, d1), (n0, n1)) = (f16x16(rec, 0), f16x16(rec, records::Q4K_DMIN));
        let v = _mm_loadu_si128(rec.add(records::Q2K_SCALES + NR * j) as *const __m128i);
        let (lo, hi) = (_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)));
        let sc = |b: __m256i| _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
        let m = |b: __m256i| _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b));
        [_mm256_mul_ps(d0, sc(lo)), _mm256_mul_ps(d1, sc(hi)), _mm256_mul_ps(n0, m(lo)), _mm256_mul_ps(n1, m(hi))]
    }
    #[inline(always)]
    unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
        let f16s = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at) as *const __m256i));
        let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(records::Q2K_SCALES + NR * j) as *const __m128i));
        let sc = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
        let m = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(b));
        [_mm512_mul_ps(f16s(0), sc), _mm512_mul_ps(f16s(records::Q4K_DMIN), m)]
    }
    #[inline(always)]
    unsafe fn load(p: *const Q2K, d: &[__m256; 4]) -> (__m256, __m256) {
        let (lo, hi) = pairs8(p as *const u8);
        let v = |n: __m256i, d: __m256, m: __m256| {
            _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(n, _mm256_set1_epi32(3)))), m)
        };
        (v(lo, d[0], d[2]), v(hi, d[1], d[3]))
    }
    #[inline(always)]
    unsafe fn load16(p: *const Q2K, d: &[__m512; 2]) -> __m512 {
        // the pair (the 2 bits above it ignored) indexes 0.0..3.0
        let table = _mm512_setr_ps(0., 1., 2., 3., 0., 1., 2., 3., 0., 1., 2., 3., 0., 1., 2., 3.);
        let q = _mm512_permutexvar_ps(pairs16(p as *const u8), table);
        _mm512_sub_ps(_mm512_mul_ps(d[0], q), d[1])
    }
}

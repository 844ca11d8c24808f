//! Pieces every x86 kernel shares: the weight element types (`WeightElem`), the output buffer tasks write their
//! own columns of (`Out`), 8-lane loads and sums (`load8`, `hsum256`), aligned thread-local buffers (`with_buf`)
//! and an 8 × 8 transpose (`transpose8`).

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
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{hsum256, load8, transpose8, with_buf};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::WeightElem;
    use std::arch::x86_64::*;
    use std::cell::Cell;
    use std::thread::LocalKey;

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

    /// Rows r0..r7 of an 8 × 8 block → its columns (`out[j][r] = v[r][j]`).
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
}

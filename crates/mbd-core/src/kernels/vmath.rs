//! f32 math on the CPU shared by the kernels: silu·mul (the MLP's gate) and a logits row's softmax sums (the
//! sampler's entropy), vectorised with AVX2 + FMA where the CPU has them (`x86`: `exp8`, also the attention's
//! online softmax), else the scalar formulas (`silu_mul_scalar`, `softmax_sums_scalar`, which the benchmark
//! `benches/vmath.rs` times against the vector code).

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{exp8, exp_scalar};

/// Whether this CPU runs the vectorised code (x86-64 with AVX2 and FMA: [`Cpu::avx2`](crate::kernels::cpu::Cpu::avx2)).
pub fn has_avx2_fma() -> bool {
    crate::kernels::cpu::Cpu::get().avx2_fma
}

/// y = silu(g) · u = g / (1 + e^-g) · u value by value, over the shortest of the three: vectorised where the CPU
/// has AVX2 and FMA (within 4 ulp of the exact value), else `silu_mul_scalar`. Each value depends on its own g and
/// u only.
pub fn silu_mul(g: &[f32], u: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { x86::silu_mul(g, u, y) };
    }
    silu_mul_scalar(g, u, y)
}

/// `silu_mul` with the standard library's `exp`: candle's silu formula, times u.
pub fn silu_mul_scalar(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
        *y = g / (1.0 + (-g).exp()) * u;
    }
}

/// (Z, S) = (Σ e^(x − m), Σ e^(x − m)·(x − m)) over `row`, for m its maximum: each term in f32 (e·d rounded in f32),
/// the sums in f64. The softmax statistics of [`stats::row_stats`](crate::kernels::stats::row_stats) (entropy ln Z −
/// S/Z, max probability 1/Z). Vectorised where the CPU has AVX2 and FMA (e^d within 2 ulp; sums within 1e-6 of f64),
/// else `softmax_sums_scalar`.
pub fn softmax_sums(row: &[f32], m: f32) -> (f64, f64) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { x86::softmax_sums(row, m) };
    }
    softmax_sums_scalar(row, m)
}

/// `softmax_sums` with the standard library's `exp`, summed in order.
pub fn softmax_sums_scalar(row: &[f32], m: f32) -> (f64, f64) {
    let (mut z, mut s) = (0f64, 0f64);
    for &x in row {
        let d = x - m;
        let e = d.exp();
        z += e as f64;
        s += (e * d) as f64;
    }
    (z, s)
}

/// The AVX2 + FMA code; callers check `has_avx2_fma`.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// e^x of one value through `exp8` (the same bits as a lane of it).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_scalar(x: f32) -> f32 {
        _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)))
    }

    /// e^x per lane for |x| ≤ 88 (the softmax's x ≤ 0, silu's e^-g): x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in two
    /// constants so n·ln2 is exact), e^r by a degree-6 polynomial (Cephes' `expf` coefficients), times 2^n built in
    /// the exponent bits. 0 for x < -88 (and for -inf), e^88 for x > 88; NaN stays NaN.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let lo = _mm256_set1_ps(-88.0);
        let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, lo); // x >= -88 or NaN
        let xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0)), lo);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            xc,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.398_2e-3));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.333_452e-3));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.166_579_6e-2));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.666_666_5e-1));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5));
        y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        let y = _mm256_mul_ps(y, pow2);
        // NaN in, NaN out (the min/max above would have turned it into a number)
        let y = _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        _mm256_and_ps(y, keep)
    }

    /// silu(g) · u = g / (1 + e^-g) · u per lane (e^-g by `exp8`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn silu8(g: __m256, u: __m256) -> __m256 {
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
    }

    /// [`super::silu_mul`] vectorised (`silu8`); a partial last vector is padded.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA (`has_avx2_fma`).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &[f32], u: &[f32], y: &mut [f32]) {
        let n = y.len().min(g.len()).min(u.len());
        let body = n / 8 * 8;
        let mut i = 0;
        while i < body {
            let v = silu8(_mm256_loadu_ps(g.as_ptr().add(i)), _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
            i += 8;
        }
        if body < n {
            let (mut gb, mut ub, mut yb) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            gb[..n - body].copy_from_slice(&g[body..n]);
            ub[..n - body].copy_from_slice(&u[body..n]);
            _mm256_storeu_ps(yb.as_mut_ptr(), silu8(_mm256_loadu_ps(gb.as_ptr()), _mm256_loadu_ps(ub.as_ptr())));
            y[body..n].copy_from_slice(&yb[..n - body]);
        }
    }

    /// [`super::softmax_sums`] vectorised: e^d by `exp8`, the sums in f64 over 8 lanes, then across them.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA (`has_avx2_fma`).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax_sums(row: &[f32], m: f32) -> (f64, f64) {
        let mv = _mm256_set1_ps(m);
        let (mut z0, mut z1, mut s0, mut s1) =
            (_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd());
        let mut add = |x: __m256| {
            let d = _mm256_sub_ps(x, mv);
            let e = exp8(d);
            let t = _mm256_mul_ps(e, d);
            z0 = _mm256_add_pd(z0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            z1 = _mm256_add_pd(z1, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(t)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(t)));
        };
        let body = row.len() / 8 * 8;
        let mut i = 0;
        while i < body {
            add(_mm256_loadu_ps(row.as_ptr().add(i)));
            i += 8;
        }
        if body < row.len() {
            // padding of m - 100: its term is e^-100 = 0 (exp8 is 0 below -88), times -100
            let mut b = [m - 100.0; 8];
            b[..row.len() - body].copy_from_slice(&row[body..]);
            add(_mm256_loadu_ps(b.as_ptr()));
        }
        let mut z = [0f64; 4];
        let mut s = [0f64; 4];
        _mm256_storeu_pd(z.as_mut_ptr(), _mm256_add_pd(z0, z1));
        _mm256_storeu_pd(s.as_mut_ptr(), _mm256_add_pd(s0, s1));
        ((z[0] + z[1]) + (z[2] + z[3]), (s[0] + s[1]) + (s[2] + s[3]))
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn exp_of(x: f32) -> f32 {
        // SAFETY: only called after the AVX2 + FMA check.
        unsafe { exp_scalar(x) }
    }

    #[test]
    fn exp_is_within_two_ulp_on_the_softmax_range() {
        if !has_avx2_fma() {
            return;
        }
        let (mut worst, mut at) = (0f64, 0f32);
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let got = exp_of(x) as f64;
            let ulp = (want as f32).abs() * f32::EPSILON;
            let e = (got - want).abs() / ulp as f64;
            if e > worst {
                (worst, at) = (e, x);
            }
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp at {at}");
        // below the normal range: within the smallest normal of the exact value
        for x in [-87.5f32, -88.0, -87.9] {
            assert!((exp_of(x) as f64 - (x as f64).exp()).abs() < 1.2e-38, "{x}");
        }
        assert_eq!(exp_of(0.0), 1.0);
        assert_eq!(exp_of(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_of(-100.0), 0.0);
        assert!(exp_of(f32::NAN).is_nan());
    }

    #[test]
    fn exp_is_within_two_ulp_for_positive_arguments() {
        if !has_avx2_fma() {
            return;
        }
        let mut x = 0.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let e = (exp_of(x) as f64 - want).abs() / ((want as f32) * f32::EPSILON) as f64;
            assert!(e <= 2.0, "{e} ulp at {x}");
            x += 0.000_913;
        }
    }

    #[test]
    fn silu_mul_is_close_to_the_exact_value() {
        if !has_avx2_fma() {
            return;
        }
        // every tail length, and arguments from -100 to 100
        for n in [1usize, 7, 8, 9, 31, 1100] {
            let g: Vec<f32> = (0..n).map(|i| -100.0 + 200.0 * i as f32 / n as f32 + 0.37).collect();
            let u: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
            let mut y = vec![f32::NAN; n];
            silu_mul(&g, &u, &mut y);
            for i in 0..n {
                let (gd, ud) = (g[i] as f64, u[i] as f64);
                let want = gd / (1.0 + (-gd).exp()) * ud;
                let err = (y[i] as f64 - want).abs();
                assert!(err <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-30, "n {n} i {i}: {} vs {want}", y[i]);
            }
        }
    }

    #[test]
    fn softmax_sums_match_f64() {
        if !has_avx2_fma() {
            return;
        }
        for n in [1usize, 5, 8, 13, 1000, 151_936] {
            let row: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2000) as f32 / 100.0 - 10.0).collect();
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (z, s) = softmax_sums(&row, m);
            let zw: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
            let sw: f64 = row.iter().map(|&x| ((x - m) as f64).exp() * (x - m) as f64).sum();
            assert!((z - zw).abs() <= 1e-6 * zw, "n {n}: Z {z} vs {zw}");
            assert!((s - sw).abs() <= 1e-6 * sw.abs() + 1e-12, "n {n}: S {s} vs {sw}");
        }
    }
}

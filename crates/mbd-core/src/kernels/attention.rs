//! The blocked CPU attention: windows of a model computing in f32 on an x86-64 CPU with AVX2 and FMA take
//! `attend` (`blocked`: blocked over keys, mask-aware from the segment's key ranges, an online softmax: no score
//! matrix, no mask array). `SegmentKv` is what the kernel reads of a segment. (Which attention a forward takes is
//! [`net::attention`](crate::net::attention)'s choice.)

use crate::error::{Error, Result};
use crate::util::Cancel;
use std::ops::Range;

/// One segment's operands: its cache's K and V of one layer ((n_kv, capacity, head_dim) f32, the window's rows
/// already written after the committed prefix), its first row in the stacked queries, and per row the key
/// ranges it sees.
pub struct SegmentKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub capacity: usize,
    pub row0: usize,
    pub visible: &'a [Vec<Range<usize>>],
}

/// Whether `attend` runs here: x86-64 with AVX2 and FMA, query heads a multiple of kv heads (at most 16 per kv
/// head), head_dim a multiple of 16 up to 256.
pub fn available(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return blocked::available(heads, kv_heads, head_dim);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Attention of every segment's rows into `out` ((rows, heads × head_dim), row-major; other rows are left as they
/// are), in the blocked kernel (`blocked`).
/// `q`: the stacked queries, (heads, rows, head_dim) row-major, RoPE applied. An error where not `available`.
/// `cancel`: once set, the tasks not yet started are skipped and the call returns [`Error::Cancelled`] (a long
/// window's attention stops within a task's rows).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    rows: usize,
    segs: &[SegmentKv<'_>],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
    cancel: Option<&Cancel>,
) -> Result<()> {
    if !available(heads, kv_heads, head_dim) {
        return Err(Error::Internal("the blocked attention kernel is not available on this CPU or head shape".into()));
    }
    #[cfg(target_arch = "x86_64")]
    blocked::run(q, rows, segs, (heads, kv_heads, head_dim), scale, out, cancel);
    match cancel {
        Some(c) => c.check("the attention"),
        None => Ok(()),
    }
}

#[cfg(target_arch = "x86_64")]
mod blocked {
    //! Attention on the CPU (AVX2 + FMA): blocked, mask-aware, one pass over the keys with an online softmax and a
    //! vectorised exp; every window of a model computing in f32 on such a CPU, a decode window of one row as well as a
    //! prefill chunk.
    //!
    //! Through candle's ops a prefill chunk of hundreds of rows had the scores of every (head, row, key) materialised
    //! (a 512-row window: 14 × 512 × 512 floats per layer), an additive mask built on the host and added, a softmax
    //! whose exp is glibc's scalar `expf`, then a second matmul — and every masked score (half of a causal window)
    //! computed, exponentiated and multiplied by V all the same. Here a task is one kv head and up to `QB` query rows
    //! of one segment, for all the kv head's query heads: it walks the keys its rows see in blocks of
    //! `KB` (blocks no row sees are skipped, blocks every row sees whole take no mask, the rest are masked from the
    //! rows' key ranges), keeps per row a running max, a running sum and an unnormalised output, and computes a
    //! block's scores and its product with V in register tiles. Nothing of size keys × rows is ever allocated.
    //!
    //! Numerics (f32 throughout): a score is the in-order FMA chain over the head dimension, times the scale; the exp
    //! is a degree-6 polynomial after a two-constant range reduction (within 2 ulp of the exact value on the
    //! softmax's range x ≤ 0; 0 below -88); per row the sums run over key blocks in order. A row's result depends only
    //! on its own query and the keys it sees — never on the other rows of its task or segment — so results do not
    //! change with the batch, the window length or the thread count.

    use super::SegmentKv;
    use crate::kernels::cpu::Cpu;
    use crate::kernels::simd::{hsum256, transpose8, with_buf, Out};
    use crate::kernels::vmath::{exp8, exp_scalar};
    use crate::util::Cancel;
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    /// Query rows of a task at most (each with its kv group's query heads).
    const QB: usize = 24;
    /// Keys per block: the block's K, transposed (head_dim × `KB`), stays in L1 while the task's heads and tiles use
    /// it.
    const KB: usize = 64;
    /// Query rows per register tile: scores 6 × 16 keys, outputs 6 × 16 dims (12 of the 16 ymm registers).
    const R: usize = 6;
    /// Query heads per kv head this kernel handles.
    const MAX_REP: usize = 16;
    /// Largest head dimension (a multiple of 16) this kernel handles.
    const MAX_D: usize = 256;

    /// Whether this CPU and head shape can take the blocked kernel.
    pub fn available(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
        kv_heads > 0
            && heads.is_multiple_of(kv_heads)
            && heads / kv_heads <= MAX_REP
            && head_dim.is_multiple_of(16)
            && head_dim <= MAX_D
            && Cpu::get().avx2_fma
    }

    /// [`super::attend`] (its arguments, the head shape as one tuple). Needs `available`: `attend` checks it.
    pub(super) fn run(
        q: &[f32],
        rows: usize,
        segs: &[SegmentKv<'_>],
        (heads, kv_heads, d): (usize, usize, usize),
        scale: f32,
        out: &mut [f32],
        cancel: Option<&Cancel>,
    ) {
        assert!(q.len() >= heads * rows * d && out.len() >= rows * heads * d);
        for s in segs {
            assert!(s.row0 + s.visible.len() <= rows);
            assert!(s.k.len() >= kv_heads * s.capacity * d && s.v.len() >= kv_heads * s.capacity * d);
            assert!(s.visible.iter().flatten().all(|r| r.end <= s.capacity || r.is_empty()));
        }
        // one task per (segment, kv head, block of rows): up to QB rows, fewer in short windows so that there are
        // about four tasks per thread (a row's result does not depend on which rows share its task)
        let threads = rayon::current_num_threads();
        let mut tasks: Vec<(usize, usize, usize, usize)> = vec![];
        for (si, s) in segs.iter().enumerate() {
            let w = s.visible.len();
            let per = (w * kv_heads).div_ceil(4 * threads).clamp(1, QB);
            for g in 0..kv_heads {
                tasks.extend((0..w).step_by(per).map(|i0| (si, g, i0, per.min(w - i0))));
            }
        }
        let out_ptr = Out(out.as_mut_ptr());
        let job = |&(si, g, i0, n): &(usize, usize, usize, usize)| {
            if cancel.is_some_and(Cancel::is_cancelled) {
                return; // the caller reports it
            }
            let s = &segs[si];
            let p = TaskParams { q, rows, heads, n_rep: heads / kv_heads, d, scale, g, i0, n };
            task(&p, s, out_ptr)
        };
        tasks.par_iter().for_each(job);
    }

    struct TaskParams<'a> {
        q: &'a [f32],
        rows: usize,
        heads: usize,
        n_rep: usize,
        d: usize,
        scale: f32,
        /// kv head
        g: usize,
        /// first window row of the task (within the segment) and the number of rows
        i0: usize,
        n: usize,
    }

    /// How a row sees a key block.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Seen {
        None,
        Whole,
        Part,
    }

    fn seen(ranges: &[std::ops::Range<usize>], j0: usize, j1: usize) -> Seen {
        let mut any = false;
        for r in ranges {
            if r.start <= j0 && r.end >= j1 {
                return Seen::Whole;
            }
            any |= r.start < j1 && r.end > j0;
        }
        if any {
            Seen::Part
        } else {
            Seen::None
        }
    }

    /// `$f::<RR>(args)` for a tile of `$rows` query vectors (1 to `R`; fewer than `R` for a task's last ones).
    macro_rules! by_rows {
        ($rows:expr, $f:ident($($a:expr),*)) => {
            match $rows {
                1 => $f::<1>($($a),*),
                2 => $f::<2>($($a),*),
                3 => $f::<3>($($a),*),
                4 => $f::<4>($($a),*),
                5 => $f::<5>($($a),*),
                _ => $f::<R>($($a),*),
            }
        };
    }

    thread_local! {
        static BUF: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    }

    /// One task: kv head `p.g`, window rows [i0, i0 + n) of segment `s`, every query head of the group, on the
    /// thread's buffer.
    fn task(p: &TaskParams<'_>, s: &SegmentKv<'_>, out: Out) {
        let len = 2 * p.n_rep * p.n * p.d + p.d * KB + R * KB + KB;
        // SAFETY: `attend` checked AVX2 and FMA (`available`); the task writes only its own rows' heads of group g.
        with_buf(&BUF, len, |buf| unsafe { task_on(p, s, out, buf) })
    }

    /// `task` on `buf`. Its n_rep × n query vectors (head-major: vector k is head k / n, row k % n) are tiled `R` at a
    /// time, so a window of one row fills a tile with its heads.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn task_on(p: &TaskParams<'_>, s: &SegmentKv<'_>, out: Out, buf: &mut [f32]) {
        let (d, n_rep, n) = (p.d, p.n_rep, p.n);
        let vis = &s.visible[p.i0..p.i0 + n];
        // the keys the task's rows see at all
        let lo = vis.iter().flatten().filter(|r| !r.is_empty()).map(|r| r.start).min();
        let hi = vis.iter().flatten().map(|r| r.end).max().unwrap_or(0);
        let nv = n_rep * n;
        // the query vectors, their unnormalised outputs, K^T of a block, the scores of a tile, the
        // additive mask of a row
        let (qb, rest) = buf.split_at_mut(nv * d);
        let (ob, rest) = rest.split_at_mut(nv * d);
        let (kt, rest) = rest.split_at_mut(d * KB);
        let (sc, madd) = rest.split_at_mut(R * KB);
        ob.fill(0.0);
        let row = s.row0 + p.i0;
        for t in 0..n_rep {
            let h = p.g * n_rep + t;
            let src = &p.q[(h * p.rows + row) * d..(h * p.rows + row + n) * d];
            qb[t * n * d..(t + 1) * n * d].copy_from_slice(src);
        }
        let mut m = [f32::NEG_INFINITY; MAX_REP * QB];
        let mut l = [0f32; MAX_REP * QB];
        if let Some(lo) = lo {
            let kg = &s.k[p.g * s.capacity * d..];
            let vg = &s.v[p.g * s.capacity * d..];
            let mut seen_rows = [Seen::None; QB];
            // blocks at multiples of KB, whatever the task's rows: a row's sums are grouped the same way in any task
            for j0 in (lo / KB * KB..hi).step_by(KB) {
                let j1 = (j0 + KB).min(hi);
                let kb = j1 - j0;
                for (i, r) in vis.iter().enumerate() {
                    seen_rows[i] = seen(r, j0, j1);
                }
                if seen_rows[..n].iter().all(|&x| x == Seen::None) {
                    continue;
                }
                transpose_keys(&kg[j0 * d..j1 * d], kb, d, kt);
                let seen_of = |k: usize| if k < nv { seen_rows[k % n] } else { Seen::None };
                for k0 in (0..nv).step_by(R) {
                    if (k0..k0 + R).all(|k| seen_of(k) == Seen::None) {
                        continue;
                    }
                    // the tile's vectors: R, or the last few (no zero rows computed; a row's bits do not depend on
                    // its tile's other rows)
                    let rows = R.min(nv - k0);
                    by_rows!(rows, scores(&qb[k0 * d..], kt, d, kb.div_ceil(16) * 16, sc));
                    // per vector: scale, mask, online-softmax update; sc becomes its probabilities
                    for (r, srow) in sc.chunks_exact_mut(KB).take(rows).enumerate() {
                        let k = k0 + r;
                        let mask = match seen_of(k) {
                            Seen::None => {
                                srow.fill(0.0);
                                continue;
                            }
                            Seen::Whole => None,
                            Seen::Part => {
                                madd.fill(f32::NEG_INFINITY);
                                for x in &vis[k % n] {
                                    let (a, b) = (x.start.max(j0), x.end.min(j1));
                                    if a < b {
                                        madd[a - j0..b - j0].fill(0.0);
                                    }
                                }
                                Some(&*madd)
                            }
                        };
                        let c = softmax_block(srow, kb, p.scale, mask, &mut m[k], &mut l[k]);
                        if c != 1.0 {
                            let o = ob.as_mut_ptr().add(k * d);
                            let cv = _mm256_set1_ps(c);
                            for x in (0..d).step_by(8) {
                                _mm256_storeu_ps(o.add(x), _mm256_mul_ps(_mm256_loadu_ps(o.add(x)), cv));
                            }
                        }
                    }
                    by_rows!(rows, accumulate(sc, &vg[j0 * d..j1 * d], kb, d, &mut ob[k0 * d..]));
                }
            }
        }
        // normalise into out: (row, head h) at out[(row * heads + h) * d ..]
        for k in 0..nv {
            let (h, i) = (p.g * n_rep + k / n, k % n);
            let inv = 1.0 / l[k];
            let dst = out.offset(((row + i) * p.heads + h) * d).0;
            for x in 0..d {
                *dst.add(x) = ob[k * d + x] * inv;
            }
        }
    }

    /// K rows [j0, j0 + kb) (kb × d, row-major) into kt (d × `KB`): kt[t · KB + j] = k[j · d + t]; columns kb..KB zero
    /// up to the next multiple of 16. 8 × 8 blocks transposed in registers (d is a multiple of 16).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn transpose_keys(k: &[f32], kb: usize, d: usize, kt: &mut [f32]) {
        let kb16 = kb.div_ceil(16) * 16;
        let (kp, ktp) = (k.as_ptr(), kt.as_mut_ptr());
        for j in (0..kb16).step_by(8) {
            for t in (0..d).step_by(8) {
                let v: [__m256; 8] = std::array::from_fn(|r| {
                    if j + r < kb {
                        _mm256_loadu_ps(kp.add((j + r) * d + t))
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                for (x, c) in transpose8(v).into_iter().enumerate() {
                    _mm256_storeu_ps(ktp.add((t + x) * KB + j), c);
                }
            }
        }
    }

    /// sc (`RR` × `KB`) columns [0, kb16) = the `RR` query rows at q (row stride d) times kt's columns: per element
    /// the in-order FMA chain over the head dimension.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores<const RR: usize>(q: &[f32], kt: &[f32], d: usize, kb16: usize, sc: &mut [f32]) {
        let qp = q.as_ptr();
        for c in (0..kb16).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; RR];
            let mut kp = kt.as_ptr().add(c);
            for t in 0..d {
                let k0 = _mm256_loadu_ps(kp);
                let k1 = _mm256_loadu_ps(kp.add(8));
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*qp.add(r * d + t));
                    a[0] = _mm256_fmadd_ps(x, k0, a[0]);
                    a[1] = _mm256_fmadd_ps(x, k1, a[1]);
                }
                kp = kp.add(KB);
            }
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(sc.as_mut_ptr().add(r * KB + c), a[0]);
                _mm256_storeu_ps(sc.as_mut_ptr().add(r * KB + c + 8), a[1]);
            }
        }
    }

    /// One row's scores of a key block (srow[..kb]) → scaled, masked (`mask`: additive 0 / -inf per key), folded into
    /// the row's running max `m` and sum `l`; srow[..KB] becomes exp(score - new max) (0 where masked and past kb).
    /// Returns the factor the row's output accumulated so far must be multiplied by (1 when the max did not move).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn softmax_block(
        srow: &mut [f32],
        kb: usize,
        scale: f32,
        mask: Option<&[f32]>,
        m: &mut f32,
        l: &mut f32,
    ) -> f32 {
        let sp = srow.as_mut_ptr();
        let sv = _mm256_set1_ps(scale);
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut mx = ninf;
        for x in (0..KB).step_by(8) {
            let mut v = _mm256_mul_ps(_mm256_loadu_ps(sp.add(x)), sv);
            if let Some(mk) = mask {
                v = _mm256_add_ps(v, _mm256_loadu_ps(mk.as_ptr().add(x)));
            }
            if x + 8 > kb {
                // keys past the block's end
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let live = _mm256_cmpgt_epi32(_mm256_set1_epi32((kb - x.min(kb)) as i32), idx);
                v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(live));
            }
            _mm256_storeu_ps(sp.add(x), v);
            mx = _mm256_max_ps(mx, v);
        }
        let bm = hmax(mx);
        if bm == f32::NEG_INFINITY {
            // nothing visible in this block for the row
            srow.fill(0.0);
            return 1.0;
        }
        let m_new = m.max(bm);
        let c = if *m == m_new { 1.0 } else { exp_scalar(*m - m_new) };
        let mv = _mm256_set1_ps(m_new);
        let mut sum = _mm256_setzero_ps();
        for x in (0..KB).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(x)), mv));
            _mm256_storeu_ps(sp.add(x), e);
            sum = _mm256_add_ps(sum, e);
        }
        *l = *l * c + hsum256(sum);
        *m = m_new;
        c
    }

    /// o (`RR` rows × d, stride d) += p (`RR` × `KB`, columns [0, kb)) · v (kb × d, row-major), an FMA per key in
    /// order.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate<const RR: usize>(p: &[f32], v: &[f32], kb: usize, d: usize, o: &mut [f32]) {
        let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        for c in (0..d).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; RR];
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_loadu_ps(op.add(r * d + c));
                a[1] = _mm256_loadu_ps(op.add(r * d + c + 8));
            }
            for j in 0..kb {
                let v0 = _mm256_loadu_ps(vp.add(j * d + c));
                let v1 = _mm256_loadu_ps(vp.add(j * d + c + 8));
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*pp.add(r * KB + j));
                    a[0] = _mm256_fmadd_ps(x, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(x, v1, a[1]);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(op.add(r * d + c), a[0]);
                _mm256_storeu_ps(op.add(r * d + c + 8), a[1]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::ops::Range;

        fn rnd_vec(seed: u64, n: usize) -> Vec<f32> {
            let mut u = crate::util::uniform(seed);
            (0..n).map(|_| u() * 4.0).collect()
        }

        /// softmax(q·k · scale) · v over the row's keys, in f64.
        fn reference(q: &[f32], k: &[f32], v: &[f32], keys: &[usize], d: usize, scale: f64) -> Vec<f64> {
            let sc: Vec<f64> =
                keys.iter().map(|&j| (0..d).map(|t| q[t] as f64 * k[j * d + t] as f64).sum::<f64>() * scale).collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            (0..d).map(|t| keys.iter().zip(&sc).map(|(&j, x)| (x - m).exp() / z * v[j * d + t] as f64).sum()).collect()
        }

        #[test]
        #[allow(clippy::single_range_in_vec_init)]
        fn matches_softmax_attention_and_a_row_alone() {
            if !available(14, 2, 64) {
                return;
            }
            // 14 query heads over 2 kv heads (the 0.5B's GQA), head_dim 64; two segments: a 150-row causal window
            // over 37 cached keys, and 29 rows with holes, partial blocks and keys past the first block
            let (heads, kvh, d, scale) = (14usize, 2usize, 64usize, 0.125f32);
            let (cap_a, cap_b) = (200usize, 160usize);
            let vis_a: Vec<Vec<Range<usize>>> = (0..150).map(|i| vec![0..37 + i + 1]).collect();
            let vis_b: Vec<Vec<Range<usize>>> = (0..29)
                .map(|i| match i % 4 {
                    0 => vec![0..3, 70..71 + i],
                    1 => vec![5..64],
                    2 => vec![64..128, 130..131],
                    _ => vec![i..i + 1, 100..160],
                })
                .collect();
            let rows = 150 + 29;
            let q = rnd_vec(1, heads * rows * d);
            let (ka, va) = (rnd_vec(2, kvh * cap_a * d), rnd_vec(3, kvh * cap_a * d));
            let (kb, vb) = (rnd_vec(4, kvh * cap_b * d), rnd_vec(5, kvh * cap_b * d));
            let segs = [
                SegmentKv { k: &ka, v: &va, capacity: cap_a, row0: 0, visible: &vis_a },
                SegmentKv { k: &kb, v: &vb, capacity: cap_b, row0: 150, visible: &vis_b },
            ];
            let mut out = vec![f32::NAN; rows * heads * d];
            run(&q, rows, &segs, (heads, kvh, d), scale, &mut out, None);
            // a cancelled call starts no task and says so
            let mut untouched = vec![f32::NAN; rows * heads * d];
            let stop = Cancel::default();
            stop.cancel();
            let r = super::super::attend(&q, rows, &segs, heads, kvh, d, scale, &mut untouched, Some(&stop));
            assert!(matches!(r, Err(crate::error::Error::Cancelled(_))));
            assert!(untouched.iter().all(|v| v.is_nan()));
            let n_rep = heads / kvh;
            let mut worst = 0f64;
            for s in &segs {
                for (i, ranges) in s.visible.iter().enumerate() {
                    let r = s.row0 + i;
                    let keys: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
                    for h in 0..heads {
                        let g = h / n_rep;
                        let want = reference(
                            &q[(h * rows + r) * d..],
                            &s.k[g * s.capacity * d..],
                            &s.v[g * s.capacity * d..],
                            &keys,
                            d,
                            scale as f64,
                        );
                        for (t, w) in want.iter().enumerate() {
                            worst = worst.max((out[(r * heads + h) * d + t] as f64 - w).abs());
                        }
                    }
                }
            }
            assert!(worst < 2e-5, "max error {worst}");
            // a row alone (its own segment of one row) gives the same bits as inside the windows above
            for (si, i) in [(0usize, 0usize), (0, 77), (0, 149), (1, 0), (1, 6), (1, 28)] {
                let s = &segs[si];
                let r = s.row0 + i;
                let q1: Vec<f32> =
                    (0..heads).flat_map(|h| q[(h * rows + r) * d..(h * rows + r + 1) * d].to_vec()).collect();
                let vis1 = vec![s.visible[i].clone()];
                let one = [SegmentKv { k: s.k, v: s.v, capacity: s.capacity, row0: 0, visible: &vis1 }];
                let mut o1 = vec![0f32; heads * d];
                run(&q1, 1, &one, (heads, kvh, d), scale, &mut o1, None);
                assert!(
                    o1.iter().zip(&out[r * heads * d..(r + 1) * heads * d]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "segment {si} row {i}: alone differs"
                );
            }
        }
    }
}

//! The gated delta rule (Qwen3.5's Gated DeltaNet recurrence) and the causal depthwise convolution before it, in
//! f32 on the CPU.
//!
//! The recurrence runs token by token (not in chunks): every row updates the state the same way whatever rows come
//! with it, so a sequence's state after n tokens has the same bits however its tokens were cut into windows, and a
//! window's state after any of its rows can be found again by running the same rows (`net::kv_cache` commits a
//! prefix of a window that way). Block-diffusion windows are short (a few blocks), where the recurrence's
//! (value heads x key dim x value dim) work per token is a few percent of the token's matrix products.

use rayon::prelude::*;

/// The recurrence's dimensions: value head h reads key/query head h / (v_heads / k_heads) (transformers'
/// `repeat_interleave` grouping), or h % k_heads when `tiled` (llama.cpp's order of value heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub tiled: bool,
}

impl DeltaShape {
    /// The key/query head value head h reads.
    pub fn key_head(&self, h: usize) -> usize {
        if self.tiled {
            h % self.k_heads
        } else {
            h / (self.v_heads / self.k_heads)
        }
    }

    /// f32 values of one state: (v_heads, dk, dv).
    pub fn state_len(&self) -> usize {
        self.v_heads * self.dk * self.dv
    }
}

/// A window's rows for the recurrence, row-major: q and k (rows, k_heads, dk) already L2-normalised (q also scaled
/// by dk^-1/2), v (rows, v_heads, dv), g (rows, v_heads) the log decay (<= 0), beta (rows, v_heads).
pub struct DeltaRows<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Work (rows x state values) below which one thread runs every head.
const PAR_MIN_WORK: usize = 1 << 16;

/// Advance `state` ((v_heads, dk, dv)) over the first `rows` rows: per value head, S <- e^g S;
/// delta = beta (v - S^T k); S <- S + k delta^T; the row's output S^T q is read after the update and written to
/// `out` ((rows, v_heads, dv)) when given. Heads run in parallel for long windows (each head's arithmetic is the
/// same either way).
pub fn scan(sh: DeltaShape, state: &mut [f32], x: &DeltaRows<'_>, rows: usize, out: Option<&mut [f32]>) {
    let (dk, dv, hv, hk) = (sh.dk, sh.dv, sh.v_heads, sh.k_heads);
    debug_assert_eq!(state.len(), sh.state_len());
    debug_assert!(x.q.len() >= rows * hk * dk && x.k.len() >= rows * hk * dk && x.v.len() >= rows * hv * dv);
    debug_assert!(x.g.len() >= rows * hv && x.beta.len() >= rows * hv);
    let want = out.is_some();
    let head = |h: usize, s: &mut [f32]| -> Vec<f32> {
        let mut o_all = if want { vec![0f32; rows * dv] } else { vec![] };
        let (mut mem, mut delta) = (vec![0f32; dv], vec![0f32; dv]);
        for t in 0..rows {
            let kq = (t * hk + sh.key_head(h)) * dk;
            let (q, k) = (&x.q[kq..kq + dk], &x.k[kq..kq + dk]);
            let v = &x.v[(t * hv + h) * dv..][..dv];
            let (decay, b) = (x.g[t * hv + h].exp(), x.beta[t * hv + h]);
            mem.fill(0.0);
            for (srow, &ki) in s.chunks_exact_mut(dv).zip(k) {
                for (sv, m) in srow.iter_mut().zip(mem.iter_mut()) {
                    *sv *= decay;
                    *m += *sv * ki;
                }
            }
            for ((d, &vj), &m) in delta.iter_mut().zip(v).zip(&mem) {
                *d = (vj - m) * b;
            }
            if want {
                let o = &mut o_all[t * dv..(t + 1) * dv];
                for ((srow, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
                    for ((sv, &d), oj) in srow.iter_mut().zip(&delta).zip(o.iter_mut()) {
                        *sv += ki * d;
                        *oj += *sv * qi;
                    }
                }
            } else {
                for (srow, &ki) in s.chunks_exact_mut(dv).zip(k) {
                    for (sv, &d) in srow.iter_mut().zip(&delta) {
                        *sv += ki * d;
                    }
                }
            }
        }
        o_all
    };
    let per_head: Vec<Vec<f32>> = if rows * sh.state_len() >= PAR_MIN_WORK && hv > 1 {
        state.par_chunks_mut(dk * dv).enumerate().map(|(h, s)| head(h, s)).collect()
    } else {
        state.chunks_mut(dk * dv).enumerate().map(|(h, s)| head(h, s)).collect()
    };
    if let Some(out) = out {
        for (h, o) in per_head.iter().enumerate() {
            for t in 0..rows {
                out[(t * hv + h) * dv..][..dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
            }
        }
    }
}

/// Causal depthwise convolution of `kernel` taps, then SiLU: `x` (rows, channels) after `tail` (kernel - 1 earlier
/// rows, oldest first; zeros at a sequence's start); `weight` (channels, kernel). Row t's output is
/// silu(sum_j weight[c, j] u[t + j, c]) over u = tail then x (transformers' `causal_conv1d_fn`: left padding of
/// kernel - 1, then the first rows).
pub fn causal_conv_silu(weight: &[f32], kernel: usize, tail: &[f32], x: &[f32], channels: usize) -> Vec<f32> {
    let c = channels;
    let rows = x.len() / c;
    debug_assert_eq!(tail.len(), (kernel - 1) * c);
    let u = |r: usize| -> &[f32] {
        if r < kernel - 1 {
            &tail[r * c..(r + 1) * c]
        } else {
            &x[(r - (kernel - 1)) * c..][..c]
        }
    };
    let mut y = vec![0f32; rows * c];
    let row = |(t, yr): (usize, &mut [f32])| {
        for j in 0..kernel {
            let ur = u(t + j);
            for ((yc, &uc), w) in yr.iter_mut().zip(ur).zip(weight.chunks_exact(kernel)) {
                *yc += w[j] * uc;
            }
        }
        for yc in yr.iter_mut() {
            *yc /= 1.0 + (-*yc).exp();
        }
    };
    if rows * c * kernel >= PAR_MIN_WORK {
        y.par_chunks_mut(c).enumerate().for_each(row);
    } else {
        y.chunks_mut(c).enumerate().for_each(row);
    }
    y
}

/// The last `kernel - 1` rows of `tail` then `x` (rows, channels): the convolution's history after `x`.
pub fn conv_tail_after(kernel: usize, tail: &[f32], x: &[f32], channels: usize) -> Vec<f32> {
    let keep = (kernel - 1) * channels;
    let mut u = Vec::with_capacity(tail.len() + x.len());
    u.extend_from_slice(tail);
    u.extend_from_slice(x);
    u[u.len() - keep..].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect()
    }

    /// The recurrence written with explicit matrices (transformers' torch_recurrent_gated_delta_rule, per head).
    fn naive(sh: DeltaShape, s0: &[f32], x: &DeltaRows<'_>, rows: usize) -> (Vec<f32>, Vec<f32>) {
        let (dk, dv) = (sh.dk, sh.dv);
        let mut s = s0.to_vec();
        let mut out = vec![0f32; rows * sh.v_heads * dv];
        for t in 0..rows {
            for h in 0..sh.v_heads {
                let kh = sh.key_head(h);
                let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
                let g = x.g[t * sh.v_heads + h].exp();
                st.iter_mut().for_each(|v| *v *= g);
                let k = &x.k[(t * sh.k_heads + kh) * dk..][..dk];
                let q = &x.q[(t * sh.k_heads + kh) * dk..][..dk];
                let v = &x.v[(t * sh.v_heads + h) * dv..][..dv];
                let b = x.beta[t * sh.v_heads + h];
                let delta: Vec<f32> =
                    (0..dv).map(|j| (v[j] - (0..dk).map(|i| st[i * dv + j] * k[i]).sum::<f32>()) * b).collect();
                for i in 0..dk {
                    for j in 0..dv {
                        st[i * dv + j] += k[i] * delta[j];
                    }
                }
                for j in 0..dv {
                    out[(t * sh.v_heads + h) * dv + j] = (0..dk).map(|i| st[i * dv + j] * q[i]).sum();
                }
            }
        }
        (s, out)
    }

    #[test]
    fn scan_is_the_recurrence_and_a_prefix_replays_to_the_same_bits() {
        for (sh, rows) in [
            (DeltaShape { k_heads: 2, v_heads: 4, dk: 8, dv: 6, tiled: false }, 7),
            (DeltaShape { k_heads: 1, v_heads: 1, dk: 5, dv: 3, tiled: false }, 3),
            // long enough to run the heads in parallel
            (DeltaShape { k_heads: 2, v_heads: 8, dk: 32, dv: 32, tiled: true }, 12),
        ] {
            let (hk, hv) = (sh.k_heads, sh.v_heads);
            let q = rnd(rows * hk * sh.dk, 1);
            let k = rnd(rows * hk * sh.dk, 2);
            let v = rnd(rows * hv * sh.dv, 3);
            let g: Vec<f32> = rnd(rows * hv, 4).iter().map(|x| -x.abs() * 2.0).collect();
            let beta: Vec<f32> = rnd(rows * hv, 5).iter().map(|x| x + 0.5).collect();
            let x = DeltaRows { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            let s0 = rnd(sh.state_len(), 6);
            let (want_s, want_o) = naive(sh, &s0, &x, rows);
            let mut s = s0.clone();
            let mut o = vec![0f32; rows * hv * sh.dv];
            scan(sh, &mut s, &x, rows, Some(&mut o));
            for (a, b) in s.iter().zip(&want_s).chain(o.iter().zip(&want_o)) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
            // the state after the first r rows, found again without outputs: the same bits as a full scan's rows
            let r = rows - 2;
            let mut s_r = s0.clone();
            scan(sh, &mut s_r, &x, r, None);
            let mut s_more = s_r.clone();
            let tail = DeltaRows {
                q: &q[r * hk * sh.dk..],
                k: &k[r * hk * sh.dk..],
                v: &v[r * hv * sh.dv..],
                g: &g[r * hv..],
                beta: &beta[r * hv..],
            };
            let mut o2 = vec![0f32; 2 * hv * sh.dv];
            scan(sh, &mut s_more, &tail, 2, Some(&mut o2));
            assert_eq!(s_more, s, "two cuts give the one scan's state");
            assert_eq!(o2[..], o[r * hv * sh.dv..], "and its outputs");
        }
    }

    #[test]
    fn conv_is_causal_with_its_history() {
        let (c, kernel, rows) = (3, 4, 5);
        let w = rnd(c * kernel, 7);
        let x = rnd(rows * c, 8);
        let zero = vec![0f32; (kernel - 1) * c];
        let y = causal_conv_silu(&w, kernel, &zero, &x, c);
        for t in 0..rows {
            for ch in 0..c {
                let mut acc = 0f32;
                for j in 0..kernel {
                    let src = t as isize + j as isize - (kernel as isize - 1);
                    if src >= 0 {
                        acc += w[ch * kernel + j] * x[src as usize * c + ch];
                    }
                }
                let want = acc / (1.0 + (-acc).exp());
                assert!((y[t * c + ch] - want).abs() < 1e-6);
            }
        }
        // rows 2.. with the history after rows 0..2 are the same as in one call
        let tail = conv_tail_after(kernel, &zero, &x[..2 * c], c);
        let y2 = causal_conv_silu(&w, kernel, &tail, &x[2 * c..], c);
        assert_eq!(y2[..], y[2 * c..]);
    }
}

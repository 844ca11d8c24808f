//! The gated delta rule (Qwen3.5's Gated DeltaNet recurrence), the causal depthwise convolution before it and the gated
//! RMSNorm after it, in f32: on slices for the CPU, and as the three steps a forward and a commit take on tensors of
//! the model's device (`window_rows`, `window_out`, `advance`: the host's functions on the CPU, mbd-rs's kernels on
//! CUDA, so that a GPU's recurrent state never leaves it).
//!
//! The recurrence runs token by token (not in chunks): every row updates the state the same way whatever rows come with
//! it, so a sequence's state after n tokens has the same bits however its tokens were cut into windows, and a window's
//! state after any of its rows can be found again by running the same rows ([`net::kv_cache`](crate::net::kv_cache)
//! commits a prefix of a window that way). Block-diffusion windows are short (a few blocks), where the recurrence's
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

    /// f32 values of one window row as `window_rows` packs it: q and k (k_heads x dk each), v (v_heads x dv), g and
    /// beta (v_heads each).
    pub fn row_width(&self) -> usize {
        2 * self.k_heads * self.dk + self.v_heads * self.dv + 2 * self.v_heads
    }
}

/// A window's rows for the recurrence, read in place as [`GdnParams::host_rows`] packs them ((rows, row_width)): per
/// row q and k (k_heads, dk) already L2-normalised (q also scaled by dk^-1/2), v (v_heads, dv), g (v_heads) the log
/// decay (<= 0), beta (v_heads).
#[derive(Clone, Copy)]
pub struct DeltaRows<'a> {
    rows: &'a [f32],
    sh: DeltaShape,
}

impl<'a> DeltaRows<'a> {
    /// The rows of `rows` ((rows, `sh.row_width()`)).
    pub fn new(sh: DeltaShape, rows: &'a [f32]) -> DeltaRows<'a> {
        debug_assert_eq!(rows.len() % sh.row_width(), 0);
        DeltaRows { rows, sh }
    }

    /// How many rows there are.
    pub fn len(&self) -> usize {
        self.rows.len() / self.sh.row_width()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    #[inline(always)]
    fn row(&self, t: usize) -> &'a [f32] {
        let w = self.sh.row_width();
        &self.rows[t * w..(t + 1) * w]
    }

    /// Row t's query of key head kh.
    #[inline(always)]
    fn q(&self, t: usize, kh: usize) -> &'a [f32] {
        &self.row(t)[kh * self.sh.dk..][..self.sh.dk]
    }

    /// Row t's key of key head kh.
    #[inline(always)]
    fn k(&self, t: usize, kh: usize) -> &'a [f32] {
        &self.row(t)[(self.sh.k_heads + kh) * self.sh.dk..][..self.sh.dk]
    }

    /// Row t's value of value head h.
    #[inline(always)]
    fn v(&self, t: usize, h: usize) -> &'a [f32] {
        &self.row(t)[2 * self.sh.k_heads * self.sh.dk + h * self.sh.dv..][..self.sh.dv]
    }

    /// Row t's log decay and beta of value head h.
    #[inline(always)]
    fn g_beta(&self, t: usize, h: usize) -> (f32, f32) {
        let (sh, r) = (self.sh, self.row(t));
        let at = 2 * sh.k_heads * sh.dk + sh.v_heads * sh.dv + h;
        (r[at], r[at + sh.v_heads])
    }
}

/// Work (rows x state values) below which one thread runs every head.
const PAR_MIN_WORK: usize = 1 << 16;

/// The recurrence from `state` ((v_heads, dk, dv), read only) over the first `rows` rows: per value head,
/// S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; the row's output S^T q is read after the update and
/// written to `out` ((rows, v_heads, dv)) when given; the state after the rows is written to `next` when given (a
/// commit; a forward leaves the committed state as it was and needs no copy of it). Heads run in parallel for long
/// windows (each head's arithmetic is the same either way).
///
/// Each column of a head's state evolves on its own (its own delta and output), so the columns go through every row
/// in tiles (`scan_head`: a tile stays in the L1 cache instead of the whole head streaming through it per row).
/// Every value sees the same operations in the same order as in a row-by-row pass over the whole state, so
/// the bits do not depend on the tiling.
pub fn scan(
    sh: DeltaShape,
    state: &[f32],
    x: &DeltaRows<'_>,
    rows: usize,
    next: Option<&mut [f32]>,
    out: Option<&mut [f32]>,
) {
    let (dk, dv, hv) = (sh.dk, sh.dv, sh.v_heads);
    debug_assert_eq!(state.len(), sh.state_len());
    debug_assert!(next.as_ref().is_none_or(|n| n.len() == state.len()));
    debug_assert!(x.len() >= rows && x.sh == sh);
    let want = out.is_some();
    let head = |h: usize, s: &[f32], n: Option<&mut [f32]>| scan_head_isa::best(sh, s, n, x, h, rows, want);
    let hs = dk * dv;
    let par = rows * sh.state_len() >= PAR_MIN_WORK && hv > 1;
    // each head's part of `next` (None: no commit)
    let nexts: Vec<Option<&mut [f32]>> = match next {
        Some(next) => next.chunks_mut(hs).map(Some).collect(),
        None => (0..hv).map(|_| None).collect(),
    };
    let per_head: Vec<Vec<f32>> = if par {
        state.par_chunks(hs).zip(nexts).enumerate().map(|(h, (s, n))| head(h, s, n)).collect()
    } else {
        state.chunks(hs).zip(nexts).enumerate().map(|(h, (s, n))| head(h, s, n)).collect()
    };
    if let Some(out) = out {
        for (h, o) in per_head.iter().enumerate() {
            for t in 0..rows {
                out[(t * hv + h) * dv..][..dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
            }
        }
    }
}

/// `scan` of value head `h`'s state `s` ((dk, dv)), tile by tile, the state after the rows into `n` when given;
/// returns its outputs ((rows, dv)) when `want`.
/// Tiles of 64 columns (four AVX-512 registers: four independent sums in flight; at dk 128 the tile is 32 KiB), then
/// of 16, then single columns.
#[inline(always)]
fn scan_head(
    sh: DeltaShape,
    s: &[f32],
    mut n: Option<&mut [f32]>,
    x: &DeltaRows<'_>,
    h: usize,
    rows: usize,
    want: bool,
) -> Vec<f32> {
    let dv = sh.dv;
    let mut o = if want { vec![0f32; rows * dv] } else { vec![] };
    let (wide, narrow) = (dv / 64 * 64, dv / 16 * 16);
    for j0 in (0..wide).step_by(64) {
        scan_columns::<64>(sh, s, n.as_deref_mut(), x, h, rows, j0, want.then_some(&mut o[..]));
    }
    for j0 in (wide..narrow).step_by(16) {
        scan_columns::<16>(sh, s, n.as_deref_mut(), x, h, rows, j0, want.then_some(&mut o[..]));
    }
    for j0 in narrow..dv {
        scan_columns::<1>(sh, s, n.as_deref_mut(), x, h, rows, j0, want.then_some(&mut o[..]));
    }
    o
}

crate::kernels::cpu::per_isa! {
    /// `scan_head` for each instruction set (`scan` runs `best`): with AVX-512 F a tile of 16 columns is one
    /// register, with AVX2 two.
    mod scan_head_isa = scan_head(
        sh: DeltaShape, s: &[f32], n: Option<&mut [f32]>, x: &DeltaRows<'_>, h: usize, rows: usize, want: bool,
    ) -> Vec<f32>;
}

/// `scan` of value head `h`'s state `s` ((dk, dv)) over columns j0..j0 + T, every row, in a copy of the tile (dk
/// rows of T, contiguous); `n` receives the tile's state after the rows, `o` ((rows, dv)) its outputs.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scan_columns<const T: usize>(
    sh: DeltaShape,
    s: &[f32],
    n: Option<&mut [f32]>,
    x: &DeltaRows<'_>,
    h: usize,
    rows: usize,
    j0: usize,
    mut o: Option<&mut [f32]>,
) {
    let dv = sh.dv;
    let kh = sh.key_head(h);
    let mut tile: Vec<[f32; T]> =
        s.chunks_exact(dv).map(|r| r[j0..j0 + T].try_into().expect("a tile of T columns")).collect();
    for t in 0..rows {
        let (q, k) = (x.q(t, kh), x.k(t, kh));
        let v = &x.v(t, h)[j0..j0 + T];
        let (g, b) = x.g_beta(t, h);
        let decay = g.exp();
        let mut mem = [0f32; T];
        for (srow, &ki) in tile.iter_mut().zip(k) {
            for (sv, m) in srow.iter_mut().zip(mem.iter_mut()) {
                *sv *= decay;
                *m += *sv * ki;
            }
        }
        let mut delta = [0f32; T];
        for ((d, &vj), &m) in delta.iter_mut().zip(v).zip(&mem) {
            *d = (vj - m) * b;
        }
        if let Some(o) = o.as_deref_mut() {
            let mut acc = [0f32; T];
            for ((srow, &ki), &qi) in tile.iter_mut().zip(k).zip(q) {
                for ((sv, &d), a) in srow.iter_mut().zip(&delta).zip(acc.iter_mut()) {
                    *sv += ki * d;
                    *a += *sv * qi;
                }
            }
            o[t * dv + j0..][..T].copy_from_slice(&acc);
        } else {
            for (srow, &ki) in tile.iter_mut().zip(k) {
                for (sv, &d) in srow.iter_mut().zip(&delta) {
                    *sv += ki * d;
                }
            }
        }
    }
    if let Some(n) = n {
        for (dst, src) in n.chunks_exact_mut(dv).zip(&tile) {
            dst[j0..j0 + T].copy_from_slice(src);
        }
    }
}

/// A depthwise convolution's weight (channels, kernel) as its taps (kernel, channels): a tap's weights contiguous,
/// so that a row's products run in vector lanes (`causal_conv_silu`).
pub fn conv_taps(weight: &[f32], kernel: usize) -> Vec<f32> {
    let c = weight.len() / kernel;
    let mut taps = vec![0f32; kernel * c];
    for (ch, w) in weight.chunks_exact(kernel).enumerate() {
        for (j, &wj) in w.iter().enumerate() {
            taps[j * c + ch] = wj;
        }
    }
    taps
}

/// Causal depthwise convolution of `kernel` taps, then SiLU: `x` (rows, channels) after `tail` (kernel - 1 earlier
/// rows, oldest first; zeros at a sequence's start); `taps` (kernel, channels: `conv_taps` of the weight
/// (channels, kernel)). Row t's output is silu(sum_j weight[c, j] u[t + j, c]) over u = tail then x (transformers'
/// `causal_conv1d_fn`: left padding of kernel - 1, then the first rows).
pub fn causal_conv_silu(taps: &[f32], kernel: usize, tail: &[f32], x: &[f32], channels: usize) -> Vec<f32> {
    let c = channels;
    let rows = x.len() / c;
    debug_assert_eq!(tail.len(), (kernel - 1) * c);
    debug_assert_eq!(taps.len(), kernel * c);
    let u = |r: usize| -> &[f32] {
        if r < kernel - 1 {
            &tail[r * c..(r + 1) * c]
        } else {
            &x[(r - (kernel - 1)) * c..][..c]
        }
    };
    let mut y = vec![0f32; rows * c];
    let row = |(t, yr): (usize, &mut [f32])| {
        conv_row_isa::best(yr, taps.chunks_exact(c).enumerate().map(|(j, w)| (w, u(t + j))))
    };
    if rows * c * kernel >= PAR_MIN_WORK {
        y.par_chunks_mut(c).enumerate().for_each(row);
    } else {
        y.chunks_mut(c).enumerate().for_each(row);
    }
    y
}

/// One output row of `causal_conv_silu`: the sum over (tap weights, input row) of their products, in tap order,
/// then SiLU.
#[inline(always)]
fn conv_row<'a>(yr: &mut [f32], taps: impl Iterator<Item = (&'a [f32], &'a [f32])>) {
    for (w, ur) in taps {
        for ((yc, &uc), &wc) in yr.iter_mut().zip(ur).zip(w) {
            *yc += wc * uc;
        }
    }
    for yc in yr.iter_mut() {
        *yc /= 1.0 + (-*yc).exp();
    }
}

crate::kernels::cpu::per_isa! {
    /// `conv_row` for each instruction set (`causal_conv_silu` runs `best`).
    mod conv_row_isa = conv_row<'a>(yr: &mut [f32], taps: impl Iterator<Item = (&'a [f32], &'a [f32])>);
}

/// The last `kernel - 1` rows of `tail` then `x` (rows, channels): the convolution's history after `x`.
pub fn conv_tail_after(kernel: usize, tail: &[f32], x: &[f32], channels: usize) -> Vec<f32> {
    let keep = (kernel - 1) * channels;
    let mut u = Vec::with_capacity(tail.len() + x.len());
    u.extend_from_slice(tail);
    u.extend_from_slice(x);
    u[u.len() - keep..].to_vec()
}

/// log(1 + e^x) as torch's softplus computes it (x itself above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// x / sqrt(sum x^2 + 1e-6) times `scale`, in place (transformers' `l2norm`, as FLA computes it).
fn l2norm(x: &mut [f32], scale: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt() * scale;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// A Gated DeltaNet layer's f32 parameters after its projections, on the model's device and (for the CPU's
/// functions) on the host: the convolution's weight (conv_dim, kernel; on the host its taps, `conv_taps`),
/// -exp(A_log) and dt_bias per value head, the gated norm's weight (dv) and eps. A projected row is
/// (conv_dim | z: v_heads x dv | b: v_heads | a: v_heads).
pub struct GdnParams {
    pub shape: DeltaShape,
    pub conv_dim: usize,
    pub conv_kernel: usize,
    pub eps: f32,
    host: [Vec<f32>; 4],
    dev: [candle_core::Tensor; 4],
}

impl GdnParams {
    /// From host values: `conv_w` (conv_dim x kernel), `neg_a` and `dt_bias` (v_heads), `norm_w` (dv).
    pub fn new(
        shape: DeltaShape,
        (conv_dim, conv_kernel): (usize, usize),
        [conv_w, neg_a, dt_bias, norm_w]: [Vec<f32>; 4],
        eps: f32,
        dev: &candle_core::Device,
    ) -> crate::error::Result<GdnParams> {
        let host = [conv_w, neg_a, dt_bias, norm_w];
        let lens = [conv_dim * conv_kernel, shape.v_heads, shape.v_heads, shape.dv];
        if conv_kernel == 0 || host.iter().zip(lens).any(|(h, n)| h.len() != n) {
            return Err(crate::error::Error::Internal("a Gated DeltaNet layer's parameters have other sizes".into()));
        }
        let t = |h: &Vec<f32>| candle_core::Tensor::from_slice(h, h.len(), dev);
        let dev = [t(&host[0])?, t(&host[1])?, t(&host[2])?, t(&host[3])?];
        let [conv_w, neg_a, dt_bias, norm_w] = host;
        let host = [conv_taps(&conv_w, conv_kernel), neg_a, dt_bias, norm_w];
        Ok(GdnParams { shape, conv_dim, conv_kernel, eps, host, dev })
    }

    /// f32 values of a projected row: conv_dim + v_heads x dv + 2 v_heads.
    pub fn width(&self) -> usize {
        self.conv_dim + self.shape.v_heads * self.shape.dv + 2 * self.shape.v_heads
    }

    /// The device's copies: conv_w, neg_a, dt_bias, norm_w.
    pub fn device_params(&self) -> &[candle_core::Tensor; 4] {
        &self.dev
    }

    /// The recurrence's rows of a window on the host: `p` (rows x width) its projected rows, `tail` the
    /// convolution's history before them. q, k and v after the convolution and SiLU, q and k L2-normalised (q
    /// also scaled by dk^-1/2), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): (rows x row_width).
    pub fn host_rows(&self, p: &[f32], tail: &[f32]) -> Vec<f32> {
        let sh = self.shape;
        let (c, hv, dk) = (self.conv_dim, sh.v_heads, sh.dk);
        let (kd, vd, width) = (sh.k_heads * dk, hv * sh.dv, self.width());
        let [taps, neg_a, dt_bias, _] = &self.host;
        let conv_in: Vec<f32> = p.chunks_exact(width).flat_map(|r| &r[..c]).copied().collect();
        let act = causal_conv_silu(taps, self.conv_kernel, tail, &conv_in, c);
        let scale = 1.0 / (dk as f32).sqrt();
        let mut out = Vec::with_capacity(p.len() / width * sh.row_width());
        for (a, r) in act.chunks_exact(c).zip(p.chunks_exact(width)) {
            let at = out.len();
            out.extend_from_slice(&a[..c]);
            out[at..at + kd].chunks_exact_mut(dk).for_each(|h| l2norm(h, scale));
            out[at + kd..at + 2 * kd].chunks_exact_mut(dk).for_each(|h| l2norm(h, 1.0));
            let (b, av) = (&r[c + vd..c + vd + hv], &r[c + vd + hv..]);
            out.extend(av.iter().zip(neg_a).zip(dt_bias).map(|((&a, &na), &dt)| na * softplus(a + dt)));
            out.extend(b.iter().map(|&b| 1.0 / (1.0 + (-b).exp())));
        }
        out
    }

    /// The window's outputs on the host: the recurrence over `rows` (`host_rows`) from the committed state `st`
    /// (read, left as it was), then per value head the gated RMSNorm w * norm(o) * silu(z) with z from the projected
    /// rows `p`: (rows x v_heads·dv).
    pub fn host_out(&self, st: &[f32], rows: &[f32], p: &[f32]) -> Vec<f32> {
        let sh = self.shape;
        let (hv, dv, width) = (sh.v_heads, sh.dv, self.width());
        let n = rows.len() / sh.row_width();
        let mut core = vec![0f32; n * hv * dv];
        scan(sh, st, &DeltaRows::new(sh, rows), n, None, Some(&mut core));
        let norm_w = &self.host[3];
        let mut y = vec![0f32; n * hv * dv];
        for (t, (yo, r)) in y.chunks_exact_mut(hv * dv).zip(p.chunks_exact(width)).enumerate() {
            let z = &r[self.conv_dim..self.conv_dim + hv * dv];
            for h in 0..hv {
                let oh = &core[(t * hv + h) * dv..][..dv];
                let var = oh.iter().map(|v| v * v).sum::<f32>() / dv as f32;
                let inv = 1.0 / (var + self.eps).sqrt();
                for j in 0..dv {
                    let zj = z[h * dv + j];
                    yo[h * dv + j] = norm_w[j] * (oh[j] * inv) * (zj / (1.0 + (-zj).exp()));
                }
            }
        }
        y
    }
}

/// Whether a layer's recurrence runs in mbd-rs's kernel on `dev`: a CUDA device, and heads the kernel takes
/// ([`cuda::gdn_scan_fits`](crate::kernels::cuda::gdn_scan_fits): Qwen3.5's do). Other heads (the tests' tiny ones) run
/// the host's functions on every device, their rows copied there and back. A forward's scan and a commit's ask the same
/// question, so they always run the same arithmetic.
fn on_gpu(dev: &candle_core::Device, sh: DeltaShape) -> bool {
    crate::kernels::cuda::runs_on(dev, candle_core::DType::F32)
        && crate::kernels::cuda::gdn_scan_fits(sh.dk, sh.dv, sh.k_heads, sh.v_heads)
}

fn host(t: &candle_core::Tensor) -> crate::error::Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// `f` of an f32 tensor's values on the host: read in place on the CPU (no copy: a window's projected rows are
/// megabytes at 32 rows), copied from other devices.
fn with_host<R>(t: &candle_core::Tensor, f: impl FnOnce(&[f32]) -> R) -> crate::error::Result<R> {
    let t = t.contiguous()?;
    {
        let (st, l) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cs), Some((a, b))) = (&*st, l.contiguous_offsets()) {
            return Ok(f(&cs.as_slice::<f32>()?[a..b]));
        }
    }
    Ok(f(&host(&t)?))
}

/// A window's recurrence rows on the model's device: `p` (rows, width) its projected rows in f32, `tail`
/// (kernel - 1, conv_dim) f32 the convolution's history. Returns (rows, row_width) f32 ([`GdnParams::host_rows`];
/// one kernel launch on CUDA).
pub fn window_rows(
    prm: &GdnParams,
    p: &candle_core::Tensor,
    tail: &candle_core::Tensor,
) -> crate::error::Result<candle_core::Tensor> {
    let n = p.dim(0)?;
    if crate::kernels::cuda::runs_on(p.device(), candle_core::DType::F32)
        && crate::kernels::cuda::gdn_rows_fit(prm.conv_dim)
    {
        let [cw, na, dt, _] = prm.device_params();
        let sh = prm.shape;
        return crate::kernels::cuda::gdn_rows(p, tail, (cw, na, dt), (sh.k_heads, sh.dk, sh.v_heads, sh.dv));
    }
    let rows = with_host(p, |p| with_host(tail, |tail| prm.host_rows(p, tail)))??;
    Ok(candle_core::Tensor::from_vec(rows, (n, prm.shape.row_width()), p.device())?)
}

/// A window's outputs on the model's device: the recurrence over `rows` (`window_rows`) from `state`
/// ((v_heads, dk, dv) f32, left as it was), then the gated RMSNorm with z from `p`. Returns (rows, v_heads·dv) f32
/// ([`GdnParams::host_out`]; one kernel launch on CUDA).
pub fn window_out(
    prm: &GdnParams,
    state: &candle_core::Tensor,
    rows: &candle_core::Tensor,
    p: &candle_core::Tensor,
) -> crate::error::Result<candle_core::Tensor> {
    let n = rows.dim(0)?;
    if on_gpu(p.device(), prm.shape) {
        let out =
            crate::kernels::cuda::GdnOut { p, conv_dim: prm.conv_dim, norm_w: &prm.device_params()[3], eps: prm.eps };
        return crate::kernels::cuda::gdn_scan(state, rows, Some(out), n, (prm.shape.k_heads, prm.shape.tiled));
    }
    let y = with_host(state, |st| with_host(rows, |rows| with_host(p, |p| prm.host_out(st, rows, p))))???;
    Ok(candle_core::Tensor::from_vec(y, (n, prm.shape.v_heads * prm.shape.dv), p.device())?)
}

/// The state after the first `n` of a window's `rows` (`window_rows`), from `state` ((v_heads, dk, dv) f32):
/// a commit. The same arithmetic as `window_out`'s recurrence, so the same bits as the forward's scan over them.
pub fn advance(
    sh: DeltaShape,
    state: &candle_core::Tensor,
    rows: &candle_core::Tensor,
    n: usize,
) -> crate::error::Result<candle_core::Tensor> {
    if on_gpu(state.device(), sh) {
        return crate::kernels::cuda::gdn_scan(state, rows, None, n, (sh.k_heads, sh.tiled));
    }
    let mut next = vec![0f32; sh.state_len()];
    with_host(&rows.narrow(0, 0, n)?, |r| {
        with_host(state, |st| scan(sh, st, &DeltaRows::new(sh, r), n, Some(&mut next), None))
    })??;
    Ok(candle_core::Tensor::from_vec(next, state.dims(), state.device())?)
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

    /// Rows packed as [`GdnParams::host_rows`] packs them, from q, k ((rows, k_heads, dk) each), v ((rows, v_heads,
    /// dv)), g and beta ((rows, v_heads) each).
    fn pack(sh: DeltaShape, [q, k, v, g, beta]: [&[f32]; 5]) -> Vec<f32> {
        let (kd, vd, hv) = (sh.k_heads * sh.dk, sh.v_heads * sh.dv, sh.v_heads);
        let rows = g.len() / hv;
        let mut out = Vec::with_capacity(rows * sh.row_width());
        for t in 0..rows {
            for (x, n) in [(q, kd), (k, kd), (v, vd), (g, hv), (beta, hv)] {
                out.extend_from_slice(&x[t * n..(t + 1) * n]);
            }
        }
        out
    }

    /// The recurrence written with explicit matrices (transformers' torch_recurrent_gated_delta_rule, per head),
    /// reading q, k, v, g and beta ((rows, heads, dim) each) as separate arrays.
    fn naive(sh: DeltaShape, s0: &[f32], [q, k, v, g, beta]: [&[f32]; 5], rows: usize) -> (Vec<f32>, Vec<f32>) {
        let (xq, xk, xv, xg, xbeta) = (q, k, v, g, beta);
        let (dk, dv) = (sh.dk, sh.dv);
        let mut s = s0.to_vec();
        let mut out = vec![0f32; rows * sh.v_heads * dv];
        for t in 0..rows {
            for h in 0..sh.v_heads {
                let kh = sh.key_head(h);
                let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
                let g = xg[t * sh.v_heads + h].exp();
                st.iter_mut().for_each(|v| *v *= g);
                let k = &xk[(t * sh.k_heads + kh) * dk..][..dk];
                let q = &xq[(t * sh.k_heads + kh) * dk..][..dk];
                let v = &xv[(t * sh.v_heads + h) * dv..][..dv];
                let b = xbeta[t * sh.v_heads + h];
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
            // value columns in a tile of 64, one of 16 and 8 single ones
            (DeltaShape { k_heads: 1, v_heads: 2, dk: 16, dv: 88, tiled: false }, 5),
        ] {
            let (hk, hv) = (sh.k_heads, sh.v_heads);
            let q = rnd(rows * hk * sh.dk, 1);
            let k = rnd(rows * hk * sh.dk, 2);
            let v = rnd(rows * hv * sh.dv, 3);
            let g: Vec<f32> = rnd(rows * hv, 4).iter().map(|x| -x.abs() * 2.0).collect();
            let beta: Vec<f32> = rnd(rows * hv, 5).iter().map(|x| x + 0.5).collect();
            let packed = pack(sh, [&q, &k, &v, &g, &beta]);
            let x = DeltaRows::new(sh, &packed);
            assert_eq!(x.len(), rows);
            let s0 = rnd(sh.state_len(), 6);
            let (want_s, want_o) = naive(sh, &s0, [&q, &k, &v, &g, &beta], rows);
            let mut s = vec![f32::NAN; s0.len()];
            let mut o = vec![0f32; rows * hv * sh.dv];
            scan(sh, &s0, &x, rows, Some(&mut s), Some(&mut o));
            // a forward's scan (no state written) gives the same outputs
            let mut o_only = vec![0f32; o.len()];
            scan(sh, &s0, &x, rows, None, Some(&mut o_only));
            assert_eq!(o_only, o);
            // the naive pass sums in the same order: the tiling changes no bit
            for (a, b) in s.iter().zip(&want_s).chain(o.iter().zip(&want_o)) {
                assert_eq!(a.to_bits(), b.to_bits(), "{a} vs {b}");
            }
            // the state after the first r rows, found again without outputs: the same bits as a full scan's rows
            let r = rows - 2;
            let mut s_r = vec![0f32; s0.len()];
            scan(sh, &s0, &x, r, Some(&mut s_r), None);
            let mut s_more = vec![0f32; s0.len()];
            let tail = DeltaRows::new(sh, &packed[r * sh.row_width()..]);
            let mut o2 = vec![0f32; 2 * hv * sh.dv];
            scan(sh, &s_r, &tail, 2, Some(&mut s_more), Some(&mut o2));
            assert_eq!(s_more, s, "two cuts give the one scan's state");
            assert_eq!(o2[..], o[r * hv * sh.dv..], "and its outputs");
        }
    }

    #[test]
    fn a_commit_then_the_rest_of_the_window_gives_the_windows_bits() {
        use candle_core::{Device, Tensor};
        let sh = DeltaShape { k_heads: 2, v_heads: 4, dk: 8, dv: 6, tiled: false };
        let (c, kernel, n, r) = (2 * 2 * 8 + 4 * 6, 4, 7, 3);
        let neg_a: Vec<f32> = rnd(4, 12).iter().map(|x| -x.abs() - 0.1).collect();
        let prm =
            GdnParams::new(sh, (c, kernel), [rnd(c * kernel, 11), neg_a, rnd(4, 13), rnd(6, 14)], 1e-6, &Device::Cpu)
                .unwrap();
        let width = prm.width();
        let p = Tensor::from_vec(rnd(n * width, 15), (n, width), &Device::Cpu).unwrap();
        let tail = Tensor::from_vec(rnd((kernel - 1) * c, 16), (kernel - 1, c), &Device::Cpu).unwrap();
        let state = Tensor::from_vec(rnd(sh.state_len(), 17), (4, 8, 6), &Device::Cpu).unwrap();
        let rows = window_rows(&prm, &p, &tail).unwrap();
        assert_eq!(rows.dims(), [n, sh.row_width()]);
        let y = window_out(&prm, &state, &rows, &p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(y.len(), n * 4 * 6);
        // the forward left the state alone; a commit of r rows, then the window's other rows from there
        let s_r = advance(sh, &state, &rows, r).unwrap();
        let p_rest = p.narrow(0, r, n - r).unwrap();
        let conv_in: Vec<f32> = p
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .chunks_exact(width)
            .take(r)
            .flat_map(|row| row[..c].to_vec())
            .collect();
        let tail_r = conv_tail_after(kernel, &tail.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &conv_in, c);
        let tail_r = Tensor::from_vec(tail_r, (kernel - 1, c), &Device::Cpu).unwrap();
        let rows_rest = window_rows(&prm, &p_rest, &tail_r).unwrap();
        let want_rows = rows.narrow(0, r, n - r).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(rows_rest.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want_rows);
        let y_rest = window_out(&prm, &s_r, &rows_rest, &p_rest).unwrap();
        assert_eq!(y_rest.flatten_all().unwrap().to_vec1::<f32>().unwrap()[..], y[r * 24..]);
        // and the outputs are the gated norm of the recurrence: not all zero, finite
        assert!(y.iter().all(|v| v.is_finite()) && y.iter().any(|v| v.abs() > 1e-3));
    }

    #[test]
    fn conv_is_causal_with_its_history() {
        let (c, kernel, rows) = (37, 4, 5); // channels past two 16-lane vectors
        let w = rnd(c * kernel, 7);
        let x = rnd(rows * c, 8);
        let zero = vec![0f32; (kernel - 1) * c];
        let y = causal_conv_silu(&conv_taps(&w, kernel), kernel, &zero, &x, c);
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
        let y2 = causal_conv_silu(&conv_taps(&w, kernel), kernel, &tail, &x[2 * c..], c);
        assert_eq!(y2[..], y[2 * c..]);
    }

    /// The recurrence's copies for each instruction set this CPU has give the baseline build's bits (tiles of
    /// 64, 16 and single columns; with and without outputs and a state after the rows).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn scan_copies_are_the_baseline_bits() {
        let (sh, rows) = (DeltaShape { k_heads: 1, v_heads: 2, dk: 16, dv: 88, tiled: false }, 5);
        let (q, k) = (rnd(rows * sh.dk, 21), rnd(rows * sh.dk, 22));
        let v = rnd(rows * 2 * sh.dv, 23);
        let g: Vec<f32> = rnd(rows * 2, 24).iter().map(|x| -x.abs()).collect();
        let beta: Vec<f32> = rnd(rows * 2, 25).iter().map(|x| x + 0.5).collect();
        let packed = pack(sh, [&q, &k, &v, &g, &beta]);
        let x = DeltaRows::new(sh, &packed);
        let s0 = rnd(sh.dk * sh.dv, 26);
        type Copy = unsafe fn(DeltaShape, &[f32], Option<&mut [f32]>, &DeltaRows<'_>, usize, usize, bool) -> Vec<f32>;
        let run = |f: Copy, want: bool| {
            let mut n = vec![0f32; s0.len()];
            // SAFETY: each copy runs only where `Cpu` found its instruction set (below)
            let o = unsafe { f(sh, &s0, Some(&mut n), &x, 1, rows, want) };
            (n, o)
        };
        let cpu = crate::kernels::cpu::Cpu::get();
        let copies: [(bool, Copy); 2] = [(cpu.avx2(), scan_head_isa::avx2), (cpu.avx512(), scan_head_isa::avx512)];
        for want in [true, false] {
            let base = run(scan_head, want);
            assert_eq!(base.0.len(), s0.len());
            assert_eq!(base.1.len(), if want { rows * sh.dv } else { 0 });
            for (_, f) in copies.iter().filter(|(has, _)| *has) {
                let got = run(*f, want);
                assert!(got.0.iter().zip(&base.0).all(|(a, b)| a.to_bits() == b.to_bits()), "state");
                assert!(got.1.iter().zip(&base.1).all(|(a, b)| a.to_bits() == b.to_bits()), "outputs");
            }
        }
    }

    /// The convolution's copies for each instruction set this CPU has give the portable code's bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn conv_copies_are_the_portable_bits() {
        let (c, kernel) = (37, 4);
        let (taps, ins) = (rnd(c * kernel, 9), rnd(c * kernel, 10));
        let run = |f: &dyn Fn(&mut [f32])| {
            let mut y = vec![0f32; c];
            f(&mut y);
            y
        };
        let taps_of = || taps.chunks_exact(c).zip(ins.chunks_exact(c));
        let want = run(&|y| conv_row(y, taps_of()));
        let cpu = crate::kernels::cpu::Cpu::get();
        if cpu.avx2() {
            // SAFETY: AVX2 was detected
            assert_eq!(run(&|y| unsafe { conv_row_isa::avx2(y, taps_of()) }), want);
        }
        if cpu.avx512() {
            // SAFETY: AVX-512 F was detected
            assert_eq!(run(&|y| unsafe { conv_row_isa::avx512(y, taps_of()) }), want);
        }
    }
}

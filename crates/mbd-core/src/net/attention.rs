//! Attention in a forward: which backend every segment of a forward takes (`AttnPath`, chosen once per forward),
//! and candle's path (`scaled_softmax`: the scale, the additive mask and the softmax in one parallel pass).

use crate::error::{Error, Result};
use crate::kernels::attention as blocked;
use crate::kernels::cuda;
use crate::kernels::Kernels;
use crate::net::mask::MaskSpec;
use crate::net::segment::Segment;
use crate::net::step::{Section, Step, StepWords};
use crate::util::Cancel;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

/// softmax(att · scale + mask) over the last dimension, for candle's attention path: att (.., n, s) scores, mask
/// (n, s) additive or none. On the CPU (f32, contiguous) one parallel pass per row instead of three tensor ops
/// (two of them on one thread, each allocating the whole score tensor); the same arithmetic as candle's
/// `affine`, `broadcast_add` and `softmax_last_dim` in that order (its max and its vectorised sum), so the same bits.
pub fn scaled_softmax(
    att: &candle_core::Tensor,
    scale: f64,
    mask: Option<&candle_core::Tensor>,
) -> Result<candle_core::Tensor> {
    use candle_core::cpu::kernels::VecOps;
    use candle_core::{DType, Tensor};
    let dims = att.dims().to_vec();
    let on_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
    let (n, s) = match dims[..] {
        [.., n, s] if s > 0 && on_cpu(att) && mask.is_none_or(|m| on_cpu(m) && m.dims() == [n, s]) => (n, s),
        _ => {
            let att = att.affine(scale, 0.0)?;
            let att = match mask {
                Some(m) => att.broadcast_add(m)?,
                None => att,
            };
            return Ok(candle_nn::ops::softmax_last_dim(&att)?);
        }
    };
    let (a_st, a_l) = att.storage_and_layout();
    let a = cpu_f32(&a_st, a_l.start_offset(), att.elem_count())?;
    let m_guard = mask.map(|m| m.storage_and_layout());
    let m = match &m_guard {
        Some((st, l)) => Some(cpu_f32(st, l.start_offset(), n * s)?),
        None => None,
    };
    let (mul, add) = (scale as f32, 0f32);
    // every value is written by the row's first loop: no zero fill of the (heads × rows × keys) scores
    let mut out: Vec<f32> = Vec::with_capacity(a.len());
    out.spare_capacity_mut()[..a.len()].par_chunks_mut(s).zip(a.par_chunks(s)).enumerate().for_each(|(r, (y, x))| {
        match m {
            Some(m) => {
                let mr = &m[(r % n) * s..(r % n + 1) * s];
                for ((y, &x), &mv) in y.iter_mut().zip(x).zip(mr) {
                    y.write((x * mul + add) + mv);
                }
            }
            None => {
                for (y, &x) in y.iter_mut().zip(x) {
                    y.write(x * mul + add);
                }
            }
        }
        // SAFETY: every element of y was written above; MaybeUninit<f32> has f32's layout.
        let y = unsafe { &mut *(y as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
        let mut max = f32::NEG_INFINITY;
        // SAFETY: y has s > 0 elements.
        unsafe { <f32 as VecOps>::vec_reduce_max(y.as_ptr(), &mut max, s) };
        for y in y.iter_mut() {
            *y = (*y - max).exp();
        }
        let mut sum = 0f32;
        // SAFETY: as above.
        unsafe { <f32 as VecOps>::vec_reduce_sum(y.as_ptr(), &mut sum, s) };
        for y in y.iter_mut() {
            *y /= sum;
        }
    });
    // SAFETY: the chunks covered all a.len() values and wrote each of them.
    unsafe { out.set_len(a.len()) };
    Ok(Tensor::from_vec(out, dims, att.device())?)
}

/// The f32 values [offset, offset + n) of a CPU storage.
pub(crate) fn cpu_f32(s: &candle_core::Storage, offset: usize, n: usize) -> Result<&[f32]> {
    match s {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) if offset + n <= v.len() => {
            Ok(&v[offset..offset + n])
        }
        _ => Err(Error::Internal("CPU attention needs f32 CPU tensors".into())),
    }
}

/// Where a forward's attention runs: one backend for every segment of a forward ([`AttnPath::choose`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttnPath {
    /// candle's ops: scores per query chunk, an additive mask, softmax, a second matmul.
    Candle,
    /// [`kernels::attention::attend`](crate::kernels::attention::attend), the blocked CPU kernel (f32 on x86-64 with
    /// AVX2 and FMA).
    Blocked,
    /// [`cuda::prep`] and [`cuda::attend`], mbd-rs's CUDA kernels.
    Fused,
}

impl AttnPath {
    /// The one choice of attention backend: the blocked CPU kernel where the model computes in f32 on a CPU that runs
    /// it ([`Kernels::blocked_attention`]), mbd-rs's CUDA kernels where they take the dtype and head shape
    /// ([`Kernels::cuda_fused`]), else candle's ops.
    pub(crate) fn choose(kn: &Kernels, dev: &Device, dtype: DType, (heads, kv_heads, head_dim): Heads) -> AttnPath {
        if kn.blocked_attention && dev.is_cpu() && dtype == DType::F32 && blocked::available(heads, kv_heads, head_dim)
        {
            AttnPath::Blocked
        } else if kn.cuda_fused && cuda::available(dev, dtype, heads, kv_heads, head_dim) {
            AttnPath::Fused
        } else {
            AttnPath::Candle
        }
    }
}

/// (heads, kv heads, head_dim).
type Heads = (usize, usize, usize);

/// What every layer's attention needs of one forward: the backend, where each segment's rows sit in the stacked rows
/// (`order`: the stack order; segment i at `spans[i]`), each segment's query chunks, and the head shape.
pub(crate) struct ForwardAttention {
    pub(crate) path: AttnPath,
    spans: Vec<(usize, usize)>,
    order: Vec<usize>,
    chunks: Vec<QueryChunks>,
    heads: Heads,
    scale: f64,
    /// A one-segment forward's cancel: its attention stops between query chunks and kernel tasks (a long
    /// window's attention is most of its forward). Forwards of several segments stop between layers only.
    cancel: Option<Cancel>,
    /// Every segment in one launch per kernel ([`Kernels::cuda_segments`]), when the forward takes it.
    together: Option<Together>,
}

/// What [`cuda::prep_segments`] and [`cuda::attend_segments`] read, on the device, in the forward's one upload
/// ([`net::step`](crate::net::step)): the segment table ([`cuda::segment_table`]) and, per cache layer, each segment's
/// K and V addresses (layers × 2 · segments 8-byte addresses, 4 · segments words per layer).
struct Together {
    table: Tensor,
    kv: Tensor,
    segments: usize,
    most: usize,
}

/// `Together`'s sections of the forward's words, before the upload.
struct TogetherWords {
    table: Section,
    kv: Section,
    segments: usize,
    most: usize,
}

/// What a forward's attention hands the device ([`ForwardAttention::plan`]), as sections of the forward's words: every
/// segment's tables when they are attended together, else each segment's key ranges where [`cuda::attend`] takes it.
pub(crate) struct AttnWords {
    together: Option<TogetherWords>,
    ranges: Vec<Option<Section>>,
}

impl AttnWords {
    /// Every segment is attended in one launch per kernel, with what changes between steps read from the upload.
    pub(crate) fn together(&self) -> bool {
        self.together.is_some()
    }
}

impl TogetherWords {
    /// The tables of `segs` stacked at `spans`, when every segment's attention runs in [`cuda::attend`]'s kernels
    /// ([`cuda::fused_attention`]); else None (a launch per segment). One segment takes them too: then its committed
    /// length, key ranges and cache addresses are read from device memory, and its launches' sizes depend on its
    /// window only ([`cuda::chunk_bound`]), as a captured CUDA graph needs.
    fn plan(
        segs: &[Segment<'_>],
        spans: &[(usize, usize)],
        (heads, _, head_dim): Heads,
        words: &mut StepWords,
    ) -> Result<Option<Self>> {
        if !segs.iter().all(|s| fused_attention(s, heads, head_dim)) {
            return Ok(None);
        }
        let visible: Vec<_> = segs.iter().map(|s| s.mask.visible(s.cache.len(), &s.positions)).collect();
        let rows: Vec<cuda::SegmentRows<'_>> = segs
            .iter()
            .zip(spans)
            .zip(&visible)
            .map(|((s, &(row0, w)), v)| cuda::SegmentRows {
                row0,
                w,
                p: s.cache.len(),
                capacity: s.cache.capacity(),
                visible: v,
            })
            .collect();
        let t = cuda::segment_table(&rows, heads)?;
        let table = words.push(t.words);
        let layers = segs[0].cache.layer_count();
        if segs.iter().any(|s| s.cache.layer_count() != layers) {
            return Err(crate::error::Error::Internal("the segments' caches hold different layers".into()));
        }
        let mut addrs = Vec::with_capacity(layers * 2 * segs.len());
        for l in 0..layers {
            for s in segs {
                let (k, v) = s.cache.layer(l);
                for t in [k, v] {
                    // key and value rows are read 16 bytes at a time
                    let a = cuda::device_address(t)?;
                    if !a.is_multiple_of(16) || !t.is_contiguous() {
                        return Err(crate::error::Error::Internal("a KV cache the CUDA kernels cannot read".into()));
                    }
                    addrs.push(a);
                }
            }
        }
        let kv = words.push_u64(addrs);
        Ok(Some(TogetherWords { table, kv, segments: segs.len(), most: t.most }))
    }
}

/// Whether a segment's attention runs in [`cuda::attend`]'s kernels (on the fused path).
fn fused_attention(s: &Segment<'_>, heads: usize, head_dim: usize) -> bool {
    let (p, w) = (s.cache.len(), s.positions.len());
    cuda::fused_attention(w, p + w, heads, head_dim)
}

/// The default cap on a query chunk's f32 attention scores (`LoadOptions::attention_score_bytes`): 256 MiB.
pub const ATTENTION_SCORE_BYTES: usize = 256 << 20;

impl ForwardAttention {
    /// What the attention of a forward over `segs` (their windows begun in their caches, stacked at `spans`)
    /// reads from the device, pushed onto the forward's `words` before its one upload.
    pub(crate) fn plan(
        segs: &[Segment<'_>],
        path: AttnPath,
        spans: &[(usize, usize)],
        heads: Heads,
        kn: &Kernels,
        words: &mut StepWords,
    ) -> Result<AttnWords> {
        if path != AttnPath::Fused {
            return Ok(AttnWords { together: None, ranges: vec![None; segs.len()] });
        }
        if kn.cuda_segments {
            if let Some(t) = TogetherWords::plan(segs, spans, heads, words)? {
                return Ok(AttnWords { together: Some(t), ranges: vec![] });
            }
        }
        let ranges = segs
            .iter()
            .map(|s| {
                Ok(match fused_attention(s, heads.0, heads.2) {
                    true => Some(words.push(cuda::ranges_layout(&s.mask.visible(s.cache.len(), &s.positions))?)),
                    false => None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(AttnWords { together: None, ranges })
    }

    /// The attention of a forward over `segs` (their windows begun in their caches), stacked as `order` / `spans`;
    /// `planned`: what `plan` pushed, now uploaded in `step`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        segs: &[Segment<'_>],
        path: AttnPath,
        spans: Vec<(usize, usize)>,
        order: Vec<usize>,
        heads: Heads,
        score_bytes: usize,
        planned: &AttnWords,
        step: &Step<'_>,
        dev: &Device,
    ) -> Result<Self> {
        let together = match &planned.together {
            Some(t) => {
                Some(Together { table: step.view(t.table)?, kv: step.view(t.kv)?, segments: t.segments, most: t.most })
            }
            None => None,
        };
        // segments attended together need no per-segment ranges or masks (and a CUDA graph of the forward must not
        // upload a mask)
        let chunks = match together {
            Some(_) => vec![],
            None => segs
                .iter()
                .zip(&planned.ranges)
                .map(|(s, r)| {
                    let (spec, p) = (s.mask.clone(), s.cache.len());
                    let ranges = r.map(|r| step.view(r)).transpose()?;
                    QueryChunks::new(spec, p, s.positions.clone(), heads.0, score_bytes, path, ranges, dev)
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let cancel = match segs {
            [one] => one.cancel.clone(),
            _ => None,
        };
        let scale = 1.0 / (heads.2 as f64).sqrt();
        Ok(ForwardAttention { path, spans, order, chunks, heads, scale, cancel, together })
    }

    /// mbd-rs's CUDA kernels ([`AttnPath::Fused`]): per segment, q/k norms + RoPE + the K/V cache write in one launch
    /// ([`cuda::prep`]), attention over the segment's key ranges in two ([`cuda::attend`]), or candle's matmuls for a
    /// long window over a long cache; or every segment in those three launches (`Together`). `qkv`: the stacked (rows,
    /// heads + 2 · kv heads, head_dim) projections, contiguous; `norms`: the q and k norms' weights and their eps.
    /// Returns (rows, heads · head_dim).
    pub(crate) fn fused(
        &self,
        qkv: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        norms: (Option<&Tensor>, Option<&Tensor>, f32),
        segs: &mut [Segment<'_>],
        layer: usize,
    ) -> Result<Tensor> {
        let (nh, nkv, d) = self.heads;
        if let Some(t) = &self.together {
            let kv = t.kv.narrow(0, layer * 4 * t.segments, 4 * t.segments)?;
            let q = cuda::prep_segments(qkv, (&t.table, &kv), (cos, sin), norms, (nh, nkv), t.segments)?;
            return cuda::attend_segments(&q, (&t.table, &kv), t.segments, nkv, t.most, self.scale as f32, qkv.dtype());
        }
        let mut ys = Vec::with_capacity(self.order.len());
        for &i in &self.order {
            let (o, w) = self.spans[i];
            let cache = &*segs[i].cache;
            let p = cache.len();
            let kv = cache.layer(layer);
            let q = cuda::prep(qkv, cos, sin, norms, (o, w), (nh, nkv), kv, p)?;
            ys.push(match &self.chunks[i].ranges {
                Some(ranges) => cuda::attend(&q, kv, ranges, nkv, p + w, self.scale as f32)?,
                None => {
                    let (kk, vv) = (kv.0.narrow(1, 0, p + w)?, kv.1.narrow(1, 0, p + w)?);
                    let qh = q.transpose(0, 1)?.contiguous()?;
                    let mut parts = Vec::new();
                    let c = self.cancel.as_ref();
                    candle_attention(&qh, &kk, &vv, &self.chunks[i], (nkv, self.scale), &mut parts, c)?;
                    let y = if parts.len() == 1 { parts.pop().expect("one chunk") } else { Tensor::cat(&parts, 1)? };
                    y.transpose(0, 1)?.reshape((w, nh * d))?
                }
            });
        }
        Ok(if ys.len() == 1 { ys.pop().expect("one segment") } else { Tensor::cat(&ys, 0)? })
    }

    /// The blocked CPU kernel or candle's ops ([`AttnPath::Blocked`], `Candle`): each segment's window K/V written
    /// after its cache's committed prefix, then every segment's rows attended over [0, p + w) of its cache.
    /// `q`: (heads, rows, head_dim) f32 with RoPE; `k` with RoPE and `v`: (kv heads, rows, head_dim).
    /// Returns (rows, heads · head_dim).
    pub(crate) fn over_caches(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segs: &mut [Segment<'_>],
        layer: usize,
    ) -> Result<Tensor> {
        let (nh, nkv, d) = self.heads;
        let r = q.dim(1)?;
        let blocked = self.path == AttnPath::Blocked;
        let one = segs.len() == 1;
        // candle's path: per segment, (nh, rows, d) per query chunk
        let mut ys: Vec<Tensor> = Vec::with_capacity(segs.len());
        for &i in &self.order {
            let (o, w) = self.spans[i];
            let (ks, vs) = if one {
                (k.clone(), v.clone())
            } else {
                (k.narrow(1, o, w)?.contiguous()?, v.narrow(1, o, w)?.contiguous()?)
            };
            let cache = &mut *segs[i].cache;
            let p = cache.len();
            let (kk, vv) = cache.write_window(layer, &ks, &vs, p)?;
            if blocked {
                continue; // every segment at once, below
            }
            let qs = if one { q.clone() } else { q.narrow(1, o, w)?.contiguous()? };
            let c = self.cancel.as_ref();
            candle_attention(&qs, &kk, &vv, &self.chunks[i], (nkv, self.scale), &mut ys, c)?;
        }
        if !blocked {
            let y = if ys.len() == 1 { ys.pop().expect("one chunk") } else { Tensor::cat(&ys, 1)? };
            return Ok(y.transpose(0, 1)?.reshape((r, nh * d))?);
        }
        let mut out = vec![0f32; r * nh * d];
        {
            let q = q.contiguous()?;
            let (qs, ql) = q.storage_and_layout();
            let qv = cpu_f32(&qs, ql.start_offset(), nh * r * d)?;
            let guards: Vec<_> = self
                .order
                .iter()
                .map(|&i| {
                    let (ck, cv) = segs[i].cache.layer(layer);
                    (i, ck.storage_and_layout(), cv.storage_and_layout(), segs[i].cache.capacity())
                })
                .collect();
            let mut kvs = Vec::with_capacity(guards.len());
            for (i, (ks, kl), (vs, vl), cap) in &guards {
                kvs.push(blocked::SegmentKv {
                    k: cpu_f32(ks, kl.start_offset(), nkv * cap * d)?,
                    v: cpu_f32(vs, vl.start_offset(), nkv * cap * d)?,
                    capacity: *cap,
                    row0: self.spans[*i].0,
                    visible: self.chunks[*i].visible.as_deref().expect("blocked segment"),
                });
            }
            blocked::attend(qv, r, &kvs, nh, nkv, d, self.scale as f32, &mut out, self.cancel.as_ref())?;
        }
        Ok(Tensor::from_vec(out, (r, nh * d), q.device())?)
    }
}

/// The query chunks of one segment and their additive masks: one chunk (the mask built once) unless the scores
/// of the whole window exceed `score_bytes` (the load's `attention_score_bytes`), then chunks whose masks are built when used.
struct QueryChunks {
    /// Per row, the key ranges it sees, when this segment's attention runs in
    /// [`attention::attend`](crate::kernels::attention::attend) (the blocked CPU kernel); then no mask is built.
    visible: Option<Vec<Vec<std::ops::Range<usize>>>>,
    /// The segment's key ranges on the device in [`cuda::ranges_layout`], when its attention runs in [`cuda::attend`]
    /// ([`cuda::fused_attention`]); a segment of a `prep` forward without them takes candle's matmuls and masks.
    ranges: Option<Tensor>,
    spec: MaskSpec,
    positions: Vec<usize>,
    p: usize,
    w: usize,
    rows: usize,
    whole: Option<Tensor>,
    device: Device,
}

impl QueryChunks {
    /// `path`: where the segment's attention runs (decided per forward: every segment the same way); `ranges`: its
    /// key ranges on the device ([`cuda::ranges_layout`], in the forward's upload) where [`cuda::attend`] takes it.
    #[allow(clippy::too_many_arguments)]
    fn new(
        spec: MaskSpec,
        p: usize,
        positions: Vec<usize>,
        heads: usize,
        score_bytes: usize,
        path: AttnPath,
        ranges: Option<Tensor>,
        device: &Device,
    ) -> Result<Self> {
        let w = positions.len();
        let s = p + w;
        let rows = (score_bytes / (4 * heads * s).max(1)).clamp(1, w);
        let visible = (path == AttnPath::Blocked).then(|| spec.visible(p, &positions));
        let mut c = QueryChunks { visible, ranges, spec, positions, p, w, rows, whole: None, device: device.clone() };
        if rows == w && c.visible.is_none() && c.ranges.is_none() {
            c.whole = c.mask(0, w)?;
        }
        Ok(c)
    }

    fn mask(&self, r0: usize, n: usize) -> Result<Option<Tensor>> {
        Ok(match self.spec.additive_rows(self.p, &self.positions, r0, n) {
            Some(m) => Some(Tensor::from_vec(m, (n, self.p + self.w), &self.device)?),
            None => None,
        })
    }

    /// (first row, rows, mask) of each chunk.
    fn each(&self) -> impl Iterator<Item = Result<(usize, usize, Option<Tensor>)>> + '_ {
        (0..self.w).step_by(self.rows).map(move |r0| {
            let n = self.rows.min(self.w - r0);
            let mask = if n == self.w { self.whole.clone() } else { self.mask(r0, n)? };
            Ok((r0, n, mask))
        })
    }
}

/// One segment's attention in candle's ops, query chunk by query chunk: `qs` (heads, w, d) f32 with RoPE, `kk`/`vv`
/// (kv heads, p + w, d) views of its cache with the window written; pushes each chunk's (heads, rows, d) output.
/// `cancel` is checked before each query chunk.
fn candle_attention(
    qs: &Tensor,
    kk: &Tensor,
    vv: &Tensor,
    chunks: &QueryChunks,
    (nkv, scale): (usize, f64),
    out: &mut Vec<Tensor>,
    cancel: Option<&Cancel>,
) -> Result<()> {
    let (nh, w, d) = qs.dims3()?;
    let (n_rep, s) = (nh / nkv, kk.dim(1)?);
    let kt = kk.to_dtype(DType::F32)?.t()?;
    for chunk in chunks.each() {
        if let Some(c) = cancel {
            c.check("the attention")?;
        }
        let (r0, n, mask) = chunk?;
        let qc = if n == w { qs.clone() } else { qs.narrow(1, r0, n)?.contiguous()? };
        // GQA without repeating K/V: the n_rep query heads of a group are adjacent, so fold them into rows.
        let att = qc.reshape((nkv, n_rep * n, d))?.matmul(&kt)?.reshape((nkv, n_rep, n, s))?;
        let att = scaled_softmax(&att, scale, mask.as_ref())?.to_dtype(vv.dtype())?;
        out.push(att.reshape((nkv, n_rep * n, s))?.matmul(vv)?.reshape((nh, n, d))?);
    }
    Ok(())
}

#[cfg(test)]
mod scaled_softmax_tests {
    use super::scaled_softmax;
    use candle_core::{Device, Tensor};

    #[test]
    fn equals_candles_three_ops_bit_for_bit() {
        let att = Tensor::randn(0f32, 4.0, (2, 3, 5, 37), &Device::Cpu).unwrap();
        let mut m = vec![0f32; 5 * 37];
        for (i, v) in m.iter_mut().enumerate() {
            if i % 7 == 3 {
                *v = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(m, (5, 37), &Device::Cpu).unwrap();
        for mask in [Some(&mask), None] {
            let want = att.affine(0.125, 0.0).unwrap();
            let want = match mask {
                Some(m) => want.broadcast_add(m).unwrap(),
                None => want,
            };
            let want =
                candle_nn::ops::softmax_last_dim(&want).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = scaled_softmax(&att, 0.125, mask).unwrap();
            assert_eq!(got.dims(), att.dims());
            assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        }
    }
}

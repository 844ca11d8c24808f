//! A preallocated per-layer KV cache for one sequence: `len` committed positions, followed by a scratch window that
//! each forward overwrites. Committing the window's first n rows only advances `len` (no copy); any other slice of the
//! window can be committed at any offset up to `len` (copied), and `truncate` rewinds: the primitives of S2D2
//! verification (keep the verified K/V of a window's second half) and of approximate caches (refresh from an offset).
//!
//! A hybrid model (Qwen3.5) also keeps, per Gated DeltaNet layer, its recurrent state and convolution history at the
//! committed frontier (`Recurrent`). A forward starts from them and leaves its rows' recurrence inputs; committing the
//! window's first n rows runs the recurrence over those rows (the same arithmetic as the forward's scan, so the same
//! bits: [`kernels::delta_rule`](crate::kernels::delta_rule)), never a state that saw the rows after them. A recurrent
//! state cannot be rewound or spliced: committing other rows than a prefix, or truncating to a non-zero length, is
//! refused.

use crate::error::{Error, Result};
use crate::kernels::delta_rule::{advance, DeltaShape};
use candle_core::{DType, Device, Tensor};

/// The recurrent states of a sequence at one position, per Gated DeltaNet layer (state, convolution history).
pub type Snapshot = Vec<(Tensor, Tensor)>;

/// A Gated DeltaNet layer's dimensions as its cache needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentShape {
    pub delta: DeltaShape,
    /// channels of the causal convolution (q, k and v before it)
    pub conv_dim: usize,
    pub conv_kernel: usize,
}

impl RecurrentShape {
    /// f32 values of the convolution's history: kernel - 1 rows.
    fn tail_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim
    }
    /// Bytes one layer's state takes per sequence (the state and the convolution history).
    pub fn bytes(&self) -> usize {
        4 * (self.delta.state_len() + self.tail_len())
    }
}

/// One GDN layer's part of a sequence's cache, on the cache's device (f32).
pub(crate) struct Recurrent {
    /// the convolution's input rows before the frontier, (kernel - 1, conv_dim), oldest first
    pub(crate) conv: Tensor,
    /// the recurrent state at the frontier, (v_heads, dk, dv)
    pub(crate) state: Tensor,
    /// the last forward's rows: what committing a prefix of them needs
    pub(crate) window: Option<RecurrentWindow>,
}

/// A forward's window rows as the recurrence took them
/// ([`delta_rule::window_rows`](crate::kernels::delta_rule::window_rows)) and their projected rows (rows, width) f32,
/// whose first conv_dim columns are the convolution's inputs.
pub(crate) struct RecurrentWindow {
    pub(crate) p: Tensor,
    pub(crate) rows: Tensor,
}

impl Recurrent {
    fn new(sh: &RecurrentShape, dev: &Device) -> Result<Recurrent> {
        let d = sh.delta;
        Ok(Recurrent {
            conv: Tensor::zeros((sh.conv_kernel - 1, sh.conv_dim), DType::F32, dev)?,
            state: Tensor::zeros((d.v_heads, d.dk, d.dv), DType::F32, dev)?,
            window: None,
        })
    }

    /// Advance the state and history over the first `n` rows of the last forward.
    fn commit(&mut self, sh: &RecurrentShape, n: usize) -> Result<()> {
        let w = self.window.take();
        if n == 0 {
            return Ok(());
        }
        let w = w.ok_or_else(|| Error::Internal("a recurrent layer has no window to commit".into()))?;
        self.state = advance(sh.delta, &self.state, &w.rows, n)?;
        let keep = sh.conv_kernel - 1;
        let u = Tensor::cat(&[&self.conv, &w.p.narrow(0, 0, n)?.narrow(1, 0, sh.conv_dim)?], 0)?;
        self.conv = u.narrow(0, u.dim(0)? - keep, keep)?.contiguous()?;
        Ok(())
    }
}

pub struct KvCache {
    /// Per layer (K, V), each (n_kv, capacity, head_dim), contiguous.
    layers: Vec<(Tensor, Tensor)>,
    n_layers: usize,
    n_kv: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    len: usize,
    capacity: usize,
    /// Length of the window written by the last forward (committable), 0 when none.
    window: usize,
    /// Per Gated DeltaNet layer (hybrid models), its state at the committed frontier.
    recurrent: Vec<Recurrent>,
    recurrent_shape: Option<RecurrentShape>,
}

impl KvCache {
    pub fn new(n_layers: usize, n_kv: usize, head_dim: usize, dtype: DType, device: &Device) -> Self {
        KvCache {
            layers: vec![],
            n_layers,
            n_kv,
            head_dim,
            dtype,
            device: device.clone(),
            len: 0,
            capacity: 0,
            window: 0,
            recurrent: vec![],
            recurrent_shape: None,
        }
    }

    /// This cache with `layers` Gated DeltaNet layers' states too (zero: the start of a sequence). Their size is
    /// checked before it is allocated.
    pub fn with_recurrent(mut self, layers: usize, shape: RecurrentShape) -> Result<KvCache> {
        crate::util::check_alloc(shape.bytes().saturating_mul(layers), || {
            format!("the recurrent state of {layers} Gated DeltaNet layers")
        })?;
        self.recurrent = (0..layers).map(|_| Recurrent::new(&shape, &self.device)).collect::<Result<_>>()?;
        self.recurrent_shape = Some(shape);
        Ok(self)
    }

    /// A new empty cache of the same shape, dtype and device.
    pub fn fresh(&self) -> Result<KvCache> {
        let c = KvCache::new(self.n_layers, self.n_kv, self.head_dim, self.dtype, &self.device);
        match self.recurrent_shape {
            Some(sh) => c.with_recurrent(self.recurrent.len(), sh),
            None => Ok(c),
        }
    }

    /// Whether this cache holds recurrent states (a hybrid model's): they can only move forward.
    pub fn has_recurrent(&self) -> bool {
        !self.recurrent.is_empty()
    }

    /// GDN layer `l`'s state ([`net::gdn`](crate::net::gdn) reads it and leaves its window rows there).
    pub(crate) fn recurrent_mut(&mut self, l: usize) -> &mut Recurrent {
        &mut self.recurrent[l]
    }

    /// Bytes held by the recurrent states.
    pub fn recurrent_bytes(&self) -> usize {
        self.recurrent_shape.map_or(0, |s| s.bytes() * self.recurrent.len())
    }

    /// Advance every recurrent state over the first `n` rows of the last forward.
    fn commit_recurrent(&mut self, n: usize) -> Result<()> {
        if let Some(sh) = self.recurrent_shape {
            for r in &mut self.recurrent {
                r.commit(&sh, n)?;
            }
        }
        Ok(())
    }

    fn refuse_recurrent(&self, what: &str) -> Result<()> {
        if self.has_recurrent() {
            return Err(Error::Unsupported(format!(
                "{what}: a Gated DeltaNet layer's recurrent state only moves forward over committed rows in order"
            )));
        }
        Ok(())
    }

    /// Number of committed positions.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Make room for `extra` positions past the committed prefix, growing geometrically when needed.
    pub fn reserve(&mut self, extra: usize) -> Result<()> {
        let need = self.len + extra;
        if need <= self.capacity {
            return Ok(());
        }
        let cap = need.max(self.capacity * 2).max(64);
        let bytes = (2 * self.n_layers * self.n_kv * self.head_dim * self.dtype.size_in_bytes()).saturating_mul(cap);
        crate::util::check_alloc(bytes, || format!("a KV cache for {need} positions"))?;
        let mut layers = Vec::with_capacity(self.n_layers);
        for l in 0..self.n_layers {
            let k = Tensor::zeros((self.n_kv, cap, self.head_dim), self.dtype, &self.device)?;
            let v = Tensor::zeros((self.n_kv, cap, self.head_dim), self.dtype, &self.device)?;
            if self.len > 0 {
                let (ok, ov) = &self.layers[l];
                k.slice_set(&ok.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                v.slice_set(&ov.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
            }
            layers.push((k, v));
        }
        self.layers = layers;
        self.capacity = cap;
        Ok(())
    }

    pub(crate) fn begin_window(&mut self, w: usize) -> Result<()> {
        self.reserve(w)?;
        self.window = w;
        for r in &mut self.recurrent {
            r.window = None;
        }
        Ok(())
    }

    /// Layer `l`'s (K, V) buffers, each (n_kv, capacity, head_dim): the committed positions, then the window.
    pub(crate) fn layer(&self, l: usize) -> (&Tensor, &Tensor) {
        let (k, v) = &self.layers[l];
        (k, v)
    }

    /// The layers (attention slots) this cache holds K/V for.
    pub(crate) fn layer_count(&self) -> usize {
        self.layers.len()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Store a window's K/V (n_kv, w, d) at position p (= len) of `layer`; return views over [0, p + w).
    pub(crate) fn write_window(&mut self, layer: usize, k: &Tensor, v: &Tensor, p: usize) -> Result<(Tensor, Tensor)> {
        let w = k.dim(1)?;
        debug_assert_eq!(p, self.len);
        let (ck, cv) = &self.layers[layer];
        ck.slice_set(k, 1, p)?;
        cv.slice_set(v, 1, p)?;
        Ok((ck.narrow(1, 0, p + w)?, cv.narrow(1, 0, p + w)?))
    }

    /// Keep the K/V of the first `n` positions of the last forward's window.
    pub fn commit(&mut self, n: usize) -> Result<()> {
        if n > self.window {
            return Err(Error::Internal(format!(
                "cannot commit {n} positions: the last forward wrote a window of {}",
                self.window
            )));
        }
        self.commit_recurrent(n)?;
        self.len += n;
        self.window = 0;
        Ok(())
    }

    /// Keep the K/V of window rows [from, from + n) of the last forward as positions [at, at + n): everything
    /// committed from `at` on is replaced and the cache ends at `at + n`. `at` may be any offset up to the
    /// committed length (rows move by a copy unless they already sit there: `commit(n)` is `commit_rows(0, n, len)`).
    pub fn commit_rows(&mut self, from: usize, n: usize, at: usize) -> Result<()> {
        if from.checked_add(n).is_none_or(|e| e > self.window) {
            return Err(Error::Internal(format!(
                "cannot commit window rows {from}..{}: the last forward wrote a window of {}",
                from.saturating_add(n),
                self.window
            )));
        }
        if at > self.len {
            return Err(Error::Internal(format!(
                "cannot commit at offset {at}: only {} positions are committed",
                self.len
            )));
        }
        if from == 0 && at == self.len {
            return self.commit(n);
        }
        self.refuse_recurrent("keeping window rows other than a prefix at the end of the cache")?;
        self.move_rows(self.len + from, n, at)?;
        self.len = at + n;
        self.window = 0;
        Ok(())
    }

    /// Keep the first `n` window rows of the last forward and, right after them, its window rows
    /// [from, from + m) (the dual cache's prefix and suffix; the rows between are dropped).
    pub fn commit_split(&mut self, n: usize, from: usize, m: usize) -> Result<()> {
        if n > from || from.checked_add(m).is_none_or(|e| e > self.window) {
            return Err(Error::Internal(format!(
                "cannot keep window rows 0..{n} and {from}..{}: the last forward wrote a window of {}",
                from.saturating_add(m),
                self.window
            )));
        }
        self.refuse_recurrent("keeping a prefix and a suffix of a window (the dual cache)")?;
        let at = self.len + n;
        self.move_rows(self.len + from, m, at)?;
        self.len = at + m;
        self.window = 0;
        Ok(())
    }

    /// Copy slots [src, src + n) to [at, at + n) in every layer (nothing when they are already there). The
    /// source is made contiguous first: a slice of the positions axis is not when there are several KV heads.
    fn move_rows(&self, src: usize, n: usize, at: usize) -> Result<()> {
        if n > 0 && src != at {
            for (k, v) in &self.layers {
                let ks = k.narrow(1, src, n)?.contiguous()?.copy()?;
                let vs = v.narrow(1, src, n)?.contiguous()?.copy()?;
                k.slice_set(&ks, 1, at)?;
                v.slice_set(&vs, 1, at)?;
            }
        }
        Ok(())
    }

    /// Copies of the committed K/V of positions [start, start + n), per layer (K, V), each (n_kv, n, head_dim):
    /// what the prefix cache keeps of a page ([`generate::prefix`](crate::generate::prefix)).
    pub fn copy_rows(&self, start: usize, n: usize) -> Result<Vec<(Tensor, Tensor)>> {
        if start.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(Error::Internal(format!(
                "cannot copy positions {start}..{}: {} are committed",
                start.saturating_add(n),
                self.len
            )));
        }
        self.layers
            .iter()
            .map(|(k, v)| {
                Ok((k.narrow(1, start, n)?.contiguous()?.copy()?, v.narrow(1, start, n)?.contiguous()?.copy()?))
            })
            .collect()
    }

    /// The recurrent states at the committed frontier, per Gated DeltaNet layer (state, convolution history): the
    /// tensors themselves, shared (a commit replaces them, never writes into them). Empty without recurrent layers.
    pub fn recurrent_snapshot(&self) -> Snapshot {
        self.recurrent.iter().map(|r| (r.state.clone(), r.conv.clone())).collect()
    }

    /// Start an empty cache from a cached prefix: K/V rows appended in order (`copy_rows`' shape), the first `n`
    /// positions of them; with recurrent layers, `recurrent` is their state at position `n` (a snapshot taken
    /// there) and every row is taken.
    pub fn start_from(
        &mut self,
        pages: &[Vec<(Tensor, Tensor)>],
        n: usize,
        recurrent: Option<&Snapshot>,
    ) -> Result<()> {
        if self.len != 0 || self.window != 0 {
            return Err(Error::Internal("a cache starts from a prefix only when empty".into()));
        }
        let total =
            pages.iter().map(|p| p.first().map_or(Ok(0), |(k, _)| k.dim(1))).sum::<candle_core::Result<usize>>()?;
        if self.has_recurrent() {
            let snap = recurrent.filter(|s| s.len() == self.recurrent.len() && n == total).ok_or_else(|| {
                Error::Internal("a recurrent cache starts only from whole pages with the states at their end".into())
            })?;
            for (r, (state, conv)) in self.recurrent.iter_mut().zip(snap) {
                r.state = state.clone();
                r.conv = conv.clone();
                r.window = None;
            }
        }
        let mut left = n.min(total);
        for page in pages {
            let Some((k0, _)) = page.first() else { continue };
            let take = left.min(k0.dim(1)?);
            if take == 0 {
                break;
            }
            let cut = page
                .iter()
                .map(|(k, v)| Ok((k.narrow(1, 0, take)?, v.narrow(1, 0, take)?)))
                .collect::<Result<Vec<_>>>()?;
            self.append_rows(&cut)?;
            left -= take;
        }
        Ok(())
    }

    /// Append K/V rows as committed positions (per layer (K, V), each (n_kv, n, head_dim)).
    fn append_rows(&mut self, rows: &[(Tensor, Tensor)]) -> Result<()> {
        let Some((k0, _)) = rows.first() else { return Ok(()) };
        let n = k0.dim(1)?;
        if rows.len() != self.n_layers || self.window != 0 {
            return Err(Error::Internal(format!(
                "cannot append rows of {} layers to a cache of {} (window {})",
                rows.len(),
                self.n_layers,
                self.window
            )));
        }
        self.reserve(n)?;
        for ((ck, cv), (k, v)) in self.layers.iter().zip(rows) {
            ck.slice_set(k, 1, self.len)?;
            cv.slice_set(v, 1, self.len)?;
        }
        self.len += n;
        Ok(())
    }

    /// (layers, KV heads, head dim) of this cache's rows, each layer's K and V (n_kv, positions, head_dim).
    pub fn row_shape(&self) -> (usize, usize, usize) {
        (self.n_layers, self.n_kv, self.head_dim)
    }

    /// The dtype of the K/V it holds.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of K/V one position takes in this cache (every layer's K and V).
    pub fn bytes_per_position(&self) -> usize {
        2 * self.n_layers * self.n_kv * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Drop committed positions past `n` (the refresh primitive of approximate caches: the next forward
    /// writes its window from position n on). Recurrent states go back to the start at 0 and cannot go back
    /// anywhere else.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n < self.len && self.has_recurrent() {
            if n > 0 {
                self.refuse_recurrent(&format!("rewinding the cache from {} to {n} positions", self.len))?;
            }
            let sh = self.recurrent_shape.expect("recurrent layers have a shape");
            for r in &mut self.recurrent {
                *r = Recurrent::new(&sh, &self.device)?;
            }
        }
        self.len = self.len.min(n);
        self.window = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(c: &mut KvCache, vals: &[f32]) -> Tensor {
        let w = vals.len();
        c.begin_window(w).unwrap();
        let p = c.len();
        let k = Tensor::from_slice(vals, (1, w, 1), &Device::Cpu).unwrap();
        c.write_window(0, &k, &k, p).unwrap().0
    }

    #[test]
    fn commit_keeps_a_prefix_and_truncate_rewinds() {
        let mut c = KvCache::new(1, 1, 1, DType::F32, &Device::Cpu);
        window(&mut c, &[1.0, 2.0, 3.0]);
        assert!(c.commit(4).is_err()); // more than the window
        c.commit(2).unwrap();
        assert_eq!(c.len(), 2);
        assert!(c.commit(1).is_err()); // the window was consumed
        let seen = window(&mut c, &[7.0, 8.0]);
        assert_eq!(seen.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [1.0, 2.0, 7.0, 8.0]);
        c.commit(2).unwrap();
        c.truncate(1).unwrap();
        assert_eq!(c.len(), 1);
        let seen = window(&mut c, &[9.0]);
        assert_eq!(seen.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [1.0, 9.0]);
        c.truncate(5).unwrap(); // never grows
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn commit_rows_moves_any_slice_to_any_offset() {
        let mut c = KvCache::new(1, 1, 1, DType::F32, &Device::Cpu);
        window(&mut c, &[1.0, 2.0, 3.0]);
        c.commit(3).unwrap();
        window(&mut c, &[4.0, 5.0, 6.0, 7.0]);
        assert!(c.commit_rows(2, 3, 3).is_err()); // past the window
        assert!(c.commit_rows(0, 1, 4).is_err()); // past the committed length
                                                  // the window's last two rows replace position 1 on
        c.commit_rows(2, 2, 1).unwrap();
        assert_eq!(c.len(), 3);
        let seen = window(&mut c, &[9.0]);
        assert_eq!(seen.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [1.0, 6.0, 7.0, 9.0]);
        // rows already in place: no copy, same result as commit
        c.commit_rows(0, 1, 3).unwrap();
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn commit_split_keeps_a_prefix_and_a_suffix_with_several_kv_heads() {
        // two KV heads: a slice of the positions axis is not contiguous
        let mut c = KvCache::new(1, 2, 1, DType::F32, &Device::Cpu);
        c.begin_window(5).unwrap();
        let k = Tensor::from_slice(&[1f32, 2., 3., 4., 5., 10., 20., 30., 40., 50.], (2, 5, 1), &Device::Cpu).unwrap();
        c.write_window(0, &k, &k, 0).unwrap();
        assert!(c.commit_split(3, 2, 1).is_err()); // the suffix starts inside the prefix
        assert!(c.commit_split(1, 3, 3).is_err()); // past the window
        c.commit_split(1, 3, 2).unwrap(); // keep position 0, then rows 3 and 4
        assert_eq!(c.len(), 3);
        let (ck, _) = c.layer(0);
        let kept: Vec<f32> = ck.narrow(1, 0, 3).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(kept, [1.0, 4.0, 5.0, 10.0, 40.0, 50.0]);
        // commit_rows moves non-contiguous slices too
        c.begin_window(2).unwrap();
        let k = Tensor::from_slice(&[6f32, 7., 60., 70.], (2, 2, 1), &Device::Cpu).unwrap();
        c.write_window(0, &k, &k, 3).unwrap();
        c.commit_rows(1, 1, 1).unwrap();
        let (ck, _) = c.layer(0);
        let kept: Vec<f32> = ck.narrow(1, 0, 2).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(kept, [1.0, 7.0, 10.0, 70.0]);
    }
}

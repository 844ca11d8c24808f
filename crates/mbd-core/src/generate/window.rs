//! The cache/window policy of one generation: which positions a step forwards, over which K/V, and which K/V it keeps.
//! With block-causal or causal attention the K/V of completed blocks never change, so they are cached exactly: after
//! forward s, the leading window blocks that were already complete when forward s started are committed from forward s
//! itself — no extra forward. Without a cache (or with full attention, where no K/V is ever final) every step
//! recomputes from position 0.
//!
//! A step is a short queue of forwards (`begin_step`): the prompt's prefill chunks on the first step, a long canvas's
//! recompute chunks, then the window, and with S2D2 a verification (`begin_verify`). Each is handed out as a `Segment`
//! (`segment`) and its logits are taken back (`consume`), so that a scheduler can run the forwards of many generations
//! together. A window ends after the last position it has a use for; one with no use at all runs no forward
//! (`take_free`: a shifted model's step predicting only the position after the last committed one, from the carry).
//! The first window takes the prompt's last prefill chunk with it when that is short (`FUSE_ROWS`): one forward.
//!
//! S2D2 verification: a forward over [frontier, span end) with the span's drafts filled in, causal among itself (the
//! first half), plus — for unshifted models — one mask row per span position at the same position, which sees the first
//! half strictly before it and itself only (the second half): its logits are that position's block-size-1 prediction.
//! The first half's K/V up to the first rejected draft are final, so they are committed from that forward
//! (`commit_verified`): those positions keep causal K/V. The recompute policy rebuilds exactly the same K/V by giving
//! those positions causal visibility (`causal`) in every forward.
//!
//! ISD ([`decode::strided`](crate::decode::strided)): a step is one causal forward from the frontier, whose first
//! position holds the last written token (the pending one; on the first step the prompt's last token, so the prompt is
//! prefilled but for it), then the step's drafts and masks (`begin_strided`); the pending token's and the accepted
//! drafts' K/V are final and committed from that forward (`commit_strided`). Without a cache every step recomputes from
//! 0.
//!
//! The prefix cache ([`generate::prefix`](crate::generate::prefix)): with the exact policy on a grid where committed
//! K/V are final for any later sequence with the same tokens (causal, or block-causal aligned at 0), the first step
//! starts the cache from the longest cached prefix of the prompt (`seed`: a whole number of grid blocks, short of
//! the carry row's block on shifted models) and prefills the rest; when the generation ends it offers its committed
//! K/V back (`offer_prefix`), up to the first K/V that another grid made (S2D2's causal commits, TCCF's answer).
//! A hybrid's hit also restores its recurrent states, from a snapshot kept at a page's end: its prefill is cut at
//! every [`SNAPSHOT_STRIDE`]-th position and at the prompt's last page boundary, and each commit that ends on a page
//! boundary notes the states there (`note_snapshot`).

use crate::decode::cache_policy::{CachePolicy, PrefixWindow};
use crate::decode::decoder::Decoder;
use crate::error::{Error, Result};
use crate::generate::prefix::{page_size, root_key, PrefixCache, SNAPSHOT_STRIDE};
use crate::model::Model;
use crate::net::kv_cache::{KvCache, Snapshot};
use crate::net::mask::{chunks, PREFILL_CHUNK};
use crate::net::mask::{Alignment, AttentionKind, BlockGrid, MaskSpec};
use crate::net::segment::{Logits, Segment};
use candle_core::Tensor;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Prompt positions at most that the first window takes with it (its last prefill chunk): a short chunk saves a
/// forward (a pass over the weights) at the price of a longer first window, which fair scheduling does not cut.
const FUSE_ROWS: usize = 256;

/// One forward of a step: canvas[start..end) into the generation's cache (or the step's scratch cache).
#[derive(Debug)]
struct Piece {
    start: usize,
    end: usize,
    /// Cached positions the forward runs over (== start except for the dual cache's region forwards).
    keys: usize,
    /// Window rows whose logits are wanted.
    rows: Vec<usize>,
    kind: PieceKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceKind {
    /// A chunk of the prompt into the cache (committed whole; the last one's last row is the carry).
    Prefill { last: bool },
    /// A chunk of a long canvas into the step's scratch cache (recompute policy; committed whole).
    Scratch,
    /// The step's window; the frontier then moves to `commit_end` (the exact policy commits up to it); with
    /// `suffix`, the window rows from that position on are kept after them (the dual cache). `fused`: the
    /// prompt's last positions forwarded with it (its last prefill chunk, `FUSE_ROWS` at most).
    Window { commit_end: usize, suffix: Option<usize>, fused: usize },
    /// S2D2's verification of the span (its ids are the window's `step_ids`).
    Verify { span: (usize, usize) },
    /// An ISD step from the frontier (its ids are the window's `step_ids`; rows: the pending token's on).
    Strided,
}

pub struct Window {
    policy: CachePolicy,
    grid: BlockGrid,
    /// Logits are shifted: the row of position p - 1 predicts position p.
    shift: bool,
    cache: KvCache,
    /// Logits row of the last committed position (shifted profiles with a cache), (1, V).
    carry: Option<Tensor>,
    prompt_len: usize,
    prefilled: bool,
    /// Prompt positions whose K/V the forwards have computed so far (prefill or recompute chunks; all of them once
    /// a step's window has run).
    prompt_done: usize,
    /// The current step's remaining forwards, its positions, and its scratch cache (recompute policy).
    pieces: VecDeque<Piece>,
    positions: Vec<usize>,
    scratch: Option<KvCache>,
    /// End of the positions whose K/V are final (the exact policy's cache length; tracked by both policies).
    frontier: usize,
    /// Positions whose final K/V are causal (committed from a verification), as ascending ranges.
    causal: Vec<Range<usize>>,
    /// The verification's or ISD step's input ids; the verification's logits until `commit_verified` (first
    /// row's position, rows).
    step_ids: Vec<u32>,
    verify_rows: Option<(usize, Tensor)>,
    /// Prefix policy: per schedule block (the prompt, then the decoder's blocks), the step at which it was first
    /// seen complete, and whether it is cached.
    completed_at: Vec<Option<usize>>,
    cached: Vec<bool>,
    /// Dual policy: the region (start, end) the cached prefix and suffix were computed for.
    dual: Option<(usize, usize)>,
    prefill_started: Option<Instant>,
    /// The prefix cache this generation starts from and offers its K/V to (None where it would not be exact).
    prefix: Option<PrefixUse>,
    /// Token positions run through the model by decode steps (prefill excluded).
    pub positions_forwarded: usize,
    pub prefill_ms: f64,
    /// Prompt positions whose K/V came from the prefix cache.
    pub cached_tokens: usize,
    /// The head's time (final norm and vocabulary product) of the forwards consumed so far, summed.
    pub head_ms: f64,
    /// A hybrid's recurrent states at page boundaries it committed (position, states): every `SNAPSHOT_STRIDE`-th,
    /// then the latest other one.
    snapshots: Vec<(usize, Snapshot)>,
}

/// A generation's place in the prefix cache: the cache, its tree (grid and salt) and page size.
struct PrefixUse {
    cache: Arc<PrefixCache>,
    root: String,
    page: usize,
}

impl Window {
    /// `policy` as the request's plan resolved it for this grid ([`generate::plan`](crate::generate::plan)); with
    /// `prefix` (the engine's prefix cache and the request's salt), the window uses it where that is exact.
    pub fn new(
        model: &Model,
        grid: BlockGrid,
        prompt_len: usize,
        policy: CachePolicy,
        prefix: Option<(Arc<PrefixCache>, &str)>,
    ) -> Result<Window> {
        let cache = model.new_cache()?;
        let exact = policy == CachePolicy::Exact && grid.prefix_stable().is_ok();
        let prefix = prefix.filter(|(c, _)| exact && c.capacity() > 0).map(|(cache, salt)| PrefixUse {
            cache,
            root: root_key(&grid, salt),
            page: page_size(&grid),
        });
        Ok(Window {
            policy,
            grid,
            shift: model.profile.logits_shift,
            cache,
            carry: None,
            prompt_len,
            prefilled: false,
            prompt_done: 0,
            pieces: VecDeque::new(),
            positions: vec![],
            scratch: None,
            frontier: 0,
            causal: vec![],
            step_ids: vec![],
            verify_rows: None,
            completed_at: vec![Some(0)],
            cached: vec![false],
            dual: None,
            prefill_started: None,
            prefix,
            positions_forwarded: 0,
            prefill_ms: 0.0,
            cached_tokens: 0,
            head_ms: 0.0,
            snapshots: vec![],
        })
    }

    /// A hybrid using the prefix cache: note its recurrent states when the committed positions end on a page
    /// boundary (kept at every `SNAPSHOT_STRIDE`-th position; otherwise only the latest).
    fn note_snapshot(&mut self) {
        let Some(u) = &self.prefix else { return };
        let n = self.cache.len();
        if !self.cache.has_recurrent()
            || n == 0
            || !n.is_multiple_of(u.page)
            || self.snapshots.last().is_some_and(|s| s.0 == n)
        {
            return;
        }
        if self.snapshots.last().is_some_and(|s| !s.0.is_multiple_of(SNAPSHOT_STRIDE)) {
            self.snapshots.pop();
        }
        self.snapshots.push((n, self.cache.recurrent_snapshot()));
    }

    /// Start the cache from the longest cached prefix of `canvas[..limit]` that ends on a grid boundary; returns
    /// its length (0 without a prefix cache or a hit).
    fn seed(&mut self, canvas: &[u32], limit: usize) -> Result<usize> {
        let Some(u) = &self.prefix else { return Ok(0) };
        let mut pages = u.cache.lookup(&u.root, canvas, u.page, limit);
        let h = if self.cache.has_recurrent() {
            // whole pages, up to the last one that kept the recurrent states at its end
            let k = pages.iter().rposition(|p| p.snapshot.is_some()).map_or(0, |i| i + 1);
            pages.truncate(k);
            let rows: Vec<_> = pages.iter().map(|p| p.rows.clone()).collect();
            if let Some(last) = pages.last() {
                self.cache.start_from(&rows, k * u.page, last.snapshot.as_ref())?;
            }
            k * u.page
        } else {
            let mut h = (pages.len() * u.page).min(limit);
            while h > 0 && !self.grid.is_boundary(h) {
                h -= 1;
            }
            let rows: Vec<_> = pages.into_iter().map(|p| p.rows).collect();
            self.cache.start_from(&rows, h, None)?;
            h
        };
        u.cache.record_hit(h);
        self.cached_tokens = h;
        Ok(h)
    }

    /// Offer the committed K/V of `tokens` (the canvas's final tokens, in order from position 0) to the prefix
    /// cache: the positions whose K/V the grid made (before any causal commit of a verification, and before a
    /// TCCF switch), in whole pages.
    pub fn offer_prefix(&self, tokens: &[u32]) -> Result<()> {
        let Some(u) = &self.prefix else { return Ok(()) };
        let mut n = self.cache.len().min(tokens.len());
        if self.grid.kind != AttentionKind::Causal {
            if let Some(r) = self.causal.first() {
                n = n.min(r.start);
            }
        }
        if let Some(t) = self.grid.then {
            n = n.min(t.at);
        }
        u.cache.insert(&u.root, tokens, u.page, &self.cache, n, &self.snapshots)
    }

    pub fn policy(&self) -> CachePolicy {
        self.policy
    }

    /// Cut the next forward, when it is a prompt or recompute chunk, so that its rows times their cost stay within
    /// `budget_rows` rows over no keys: a row over k keys counts 1 + k / `key_equivalent`
    /// ([`Model::key_equivalent`](crate::model::Model::key_equivalent)). The cut lands on a grid boundary (a block's
    /// positions see each other), one block at the least; the rest stays queued as the next forward. The same positions
    /// are forwarded, in more forwards: the caller cuts only where a row's result does not depend on the rows beside it
    /// ([`Model::rows_independent`](crate::model::Model::rows_independent)).
    pub fn limit_next(&mut self, budget_rows: usize, key_equivalent: usize) {
        let Some(front) = self.pieces.front() else { return };
        if !matches!(front.kind, PieceKind::Prefill { .. } | PieceKind::Scratch) {
            return;
        }
        let (s, e, keys) = (front.start, front.end, front.keys);
        let e_k = key_equivalent.max(1);
        let max_rows = (budget_rows.saturating_mul(e_k) / (e_k + keys)).max(1);
        if e - s <= max_rows {
            return;
        }
        let mut b = s + max_rows;
        while b > s && !self.grid.is_boundary(b) {
            b -= 1;
        }
        if b == s {
            b = s + 1;
            while b < e && !self.grid.is_boundary(b) {
                b += 1;
            }
        }
        if b >= e {
            return;
        }
        let Some(piece) = self.pieces.pop_front() else { return };
        let (head_rows, tail_rows): (Vec<usize>, Vec<usize>) = piece.rows.iter().partition(|&&r| s + r < b);
        let head_kind = match piece.kind {
            PieceKind::Prefill { .. } => PieceKind::Prefill { last: false },
            k => k,
        };
        let tail =
            Piece { start: b, end: e, keys: b, rows: tail_rows.iter().map(|r| s + r - b).collect(), kind: piece.kind };
        self.pieces.push_front(tail);
        self.pieces.push_front(Piece { start: s, end: b, keys: piece.keys, rows: head_rows, kind: head_kind });
    }

    /// Queue the prompt's prefill [start, end) into the cache (holding [0, start)), in chunks; with `carry`, the
    /// last chunk's last row gives the logits of the position after it (shifted profiles).
    fn queue_prefill(&mut self, start: usize, end: usize, carry: bool) {
        let mut cs = chunks(&self.grid, start, end);
        if let Some(u) = self.prefix.as_ref().filter(|_| self.cache.has_recurrent()) {
            // a hybrid's chunks also end where its recurrent states are kept: every SNAPSHOT_STRIDE-th position
            // and the prompt's last page boundary
            let last = end / u.page * u.page;
            let cuts: Vec<usize> =
                (start + 1..end).filter(|&p| p.is_multiple_of(SNAPSHOT_STRIDE) || p == last).collect();
            cs = cs
                .into_iter()
                .flat_map(|(s, e)| {
                    let inner: Vec<usize> = cuts.iter().copied().filter(|&c| c > s && c < e).collect();
                    let bounds: Vec<usize> = std::iter::once(s).chain(inner).chain(std::iter::once(e)).collect();
                    bounds.windows(2).map(|w| (w[0], w[1])).collect::<Vec<_>>()
                })
                .collect();
        }
        let n = cs.len();
        for (i, (s, e)) in cs.into_iter().enumerate() {
            let last = i + 1 == n;
            let rows = if last && carry { vec![e - s - 1] } else { vec![] };
            self.pieces.push_back(Piece { start: s, end: e, keys: s, rows, kind: PieceKind::Prefill { last } });
        }
    }

    /// Without a cache: a long prefix [0, b) (b a boundary) is recomputed into the step's scratch cache in
    /// prefill-sized chunks, so that no forward spans all of it. Returns where the step's own forward starts: b,
    /// or 0 when the prefix is short enough to go with it.
    fn queue_recompute(&mut self, b: usize) -> usize {
        if b < PREFILL_CHUNK {
            return 0;
        }
        for (s, e) in chunks(&self.grid, 0, b) {
            self.pieces.push_back(Piece { start: s, end: e, keys: s, rows: vec![], kind: PieceKind::Scratch });
        }
        b
    }

    /// How far the prompt's forwards have come: (positions done, the prompt's length); positions read from the
    /// prefix cache count as done.
    pub fn prompt_progress(&self) -> (usize, usize) {
        (self.prompt_done.max(self.cached_tokens).min(self.prompt_len), self.prompt_len)
    }

    /// Whether a step is under way (planned, some of its forwards still to run).
    pub fn in_step(&self) -> bool {
        !self.pieces.is_empty()
    }

    fn src(&self, p: usize) -> usize {
        if self.shift {
            p - 1
        } else {
            p
        }
    }

    /// Plan the forwards of a step predicting `positions` (ascending) of `dec`'s canvas: the prompt's prefill
    /// chunks first (exact policy, first step), or a long canvas's recompute chunks, then the window.
    pub fn begin_step(&mut self, dec: &Decoder, canvas: &[u32], positions: Vec<usize>) -> Result<()> {
        if self.in_step() {
            return Err(Error::Internal("a step is already under way".into()));
        }
        let exact = self.policy == CachePolicy::Exact;
        if !self.prefilled {
            self.prefilled = true;
            // the prompt up to its last grid boundary goes into the cache, chunk by chunk
            let lp = self.prompt_len;
            let pe = if self.grid.kind == AttentionKind::BlockCausal && self.grid.alignment == Alignment::Absolute {
                (lp / self.grid.block_size) * self.grid.block_size
            } else {
                lp
            };
            self.frontier = pe;
            // the cache's room for the whole canvas at once: no copy of the K/V as it grows under a long prompt's
            // prefill (or a cached prefix's pages) and the answer, no fresh pages beyond what the canvas needs
            self.cache.reserve(canvas.len())?;
            if exact {
                // a shifted model's carry row (pe - 1) comes from the prefill: a cached prefix stops a block short
                let h = self.seed(canvas, if self.shift { pe.saturating_sub(1) } else { pe })?;
                self.queue_prefill(h, pe, self.shift);
            }
        }
        let mut commit_end = None;
        let (mut keys, mut suffix) = (None, None);
        let (mut ws, we) = match (self.grid.kind, self.policy) {
            (_, CachePolicy::Dual) => {
                let (a, b) = (dec.active_start(), dec.created_end());
                if self.dual == Some((a, b)) {
                    // the region over the cached prefix and suffix
                    keys = Some(self.cache.len());
                    commit_end = Some(a);
                    (a, b)
                } else {
                    // the region changed (or first step): recompute everything, keep [0, a) and [b, end)
                    self.cache.truncate(0)?;
                    self.carry = None;
                    self.dual = Some((a, b));
                    commit_end = Some(a);
                    suffix = Some(b);
                    (0, dec.canvas_end())
                }
            }
            (_, CachePolicy::Prefix { delay, refresh, window }) => {
                let (start, commit) = self.prefix_schedule(dec, delay, refresh)?;
                commit_end = Some(commit);
                let end = match window {
                    PrefixWindow::Canvas => dec.canvas_end(),
                    PrefixWindow::Created => dec.created_end(),
                };
                (start, end)
            }
            (AttentionKind::Full, _) => (0, dec.canvas_end()),
            (_, CachePolicy::Exact) => {
                let base = self.pieces.back().map_or(self.cache.len(), |p| p.end);
                (base, dec.created_end())
            }
            (_, CachePolicy::Recompute) => {
                // A long canvas is recomputed in prefill-sized chunks up to the last block boundary before the
                // first row whose logits are needed, so that no forward spans all of it (short ones: one forward).
                let first = positions.iter().map(|&p| self.src(p)).min().unwrap_or(0);
                let mut b = first;
                while b > 0 && !self.grid.is_boundary(b) {
                    b -= 1;
                }
                (self.queue_recompute(b), dec.created_end())
            }
        };
        let commit_end = commit_end.unwrap_or_else(|| dec.complete_run_end(self.frontier).max(self.frontier));
        // the prompt's last prefill chunk, when short, goes with the first window: one forward for both (its K/V
        // do not depend on the window's rows, which lie in later blocks), committed from it
        let mut fused = 0;
        if self.policy == CachePolicy::Exact
            && suffix.is_none()
            && keys.is_none()
            && self.pieces.back().is_some_and(|p| {
                matches!(p.kind, PieceKind::Prefill { last: true }) && p.end == ws && p.end - p.start <= FUSE_ROWS
            })
        {
            let p = self.pieces.pop_back().ok_or_else(|| Error::Internal("no prefill chunk".into()))?;
            fused = ws - p.start;
            ws = p.start;
        }
        // rows of the window whose logits are needed (and the new carry row)
        let mut rows: Vec<usize> =
            positions.iter().map(|&p| self.src(p)).filter(|&r| r >= ws).map(|r| r - ws).collect();
        if self.policy.keeps() && self.shift && commit_end > ws {
            rows.push(commit_end - 1 - ws);
        }
        rows.sort_unstable();
        rows.dedup();
        let we = if self.policy == CachePolicy::Exact && self.grid.kind != AttentionKind::Full {
            self.trimmed_end(ws, we, &rows, commit_end)
        } else {
            we
        };
        let kind = PieceKind::Window { commit_end, suffix, fused };
        self.pieces.push_back(Piece { start: ws, end: we, keys: keys.unwrap_or(ws), rows, kind });
        self.positions = positions;
        Ok(())
    }

    /// The exact policy's window [ws, we) cut after the last position it has a use for: its last wanted logits row
    /// and the end of what it commits, rounded up to a grid boundary (a position sees nothing past its block's end,
    /// so the rows cut off change none that are kept). A window with no use at all ends at `ws`: a shifted model's
    /// step that predicts only the position after the last committed one (from the carry row; the first step of AR
    /// decoding, a one-token answer) runs no forward.
    fn trimmed_end(&self, ws: usize, we: usize, rows: &[usize], commit_end: usize) -> usize {
        let need = rows.last().map_or(0, |&r| r + 1).max(commit_end.saturating_sub(ws));
        if need == 0 {
            let carried = self.carry.is_some() || self.pieces.back().is_some_and(|p| !p.rows.is_empty());
            return if self.shift && carried { ws } else { we };
        }
        let mut end = (ws + need).min(we);
        while end < we && !self.grid.is_boundary(end) {
            end += 1;
        }
        end
    }

    /// The step's window when it needs no forward (`trimmed_end`: no logits row wanted, nothing to commit): the
    /// step's positions, each predicted by the carry row. None when the next forward is not such a window.
    pub fn take_free(&mut self) -> Result<Option<(Vec<usize>, Tensor)>> {
        if !self.pieces.front().is_some_and(|p| matches!(p.kind, PieceKind::Window { .. }) && p.start == p.end) {
            return Ok(None);
        }
        let Some(piece) = self.pieces.pop_front() else { return Ok(None) };
        self.prompt_done = self.prompt_len;
        self.scratch = None;
        let carry = self
            .carry
            .clone()
            .ok_or_else(|| Error::Internal("a window without a forward needs the carry row".into()))?;
        if let Some(&p) = self.positions.iter().find(|&&p| self.src(p) + 1 != piece.start) {
            return Err(Error::Internal(format!("no logits for position {p} (window starts at {})", piece.start)));
        }
        let out = match self.positions.len() {
            1 => carry,
            n => carry.index_select(&Tensor::new(vec![0u32; n], carry.device())?, 0)?,
        };
        self.note_snapshot();
        Ok(Some((std::mem::take(&mut self.positions), out)))
    }

    /// The prefix policy's plan for the step about to run (d3LLM's `_sample_multi_block_kv_cache` schedule):
    /// returns (window start, commit end) and truncates the cache for a recompute. Schedule blocks are the prompt,
    /// then the decoder's created blocks; scanning from the cache's end, a complete block is stamped with the step
    /// it is first seen complete at, and cached once `delay` steps have passed (the scan stops at the first
    /// incomplete block). Then: a block to cache -> forward [cache end, canvas end) and commit through it; else a
    /// cache and no complete block waiting and no periodic refresh due -> forward [cache end, canvas end); else a
    /// cache -> refresh: recompute [0, canvas end) and rebuild the cached K/V from it; else (no cache yet) ->
    /// recompute [0, canvas end). (The caller ends each forward at the window's end instead of the canvas end when
    /// `prefix_window` is "created".) d3LLM's refresh extends its cache to the latest waiting block's start without
    /// advancing its length counter (its next forwards see those positions twice); here a refresh rebuilds the
    /// cached region only.
    fn prefix_schedule(&mut self, dec: &Decoder, delay: usize, refresh: Option<usize>) -> Result<(usize, usize)> {
        let step = dec.forward_passes + 1;
        let spans: Vec<(usize, usize)> = std::iter::once((0, dec.prompt_len))
            .chain(dec.blocks.iter().filter(|b| b.created).map(|b| (b.start, b.end)))
            .collect();
        self.completed_at.resize(spans.len(), None);
        self.cached.resize(spans.len(), false);
        let complete = |(s, e): (usize, usize)| (s.max(dec.prompt_len)..e).all(|p| dec.decoded[p - dec.prompt_len]);
        let cache_end = self.cache.len();
        let mut to = None;
        for (k, &sp) in spans.iter().enumerate() {
            if sp.1 <= cache_end {
                continue;
            }
            if !complete(sp) {
                break;
            }
            let at = *self.completed_at[k].get_or_insert(step);
            if step - at >= delay && !self.cached[k] {
                self.cached[k] = true;
                to = Some(sp.1);
            }
        }
        let waiting = (0..spans.len()).any(|k| self.completed_at[k].is_some() && !self.cached[k] && complete(spans[k]));
        let periodic = refresh.is_some_and(|r| step.is_multiple_of(r));
        Ok(match to {
            Some(end) => (cache_end, end),
            None if cache_end > 0 && !waiting && !periodic => (cache_end, cache_end),
            None => {
                // recompute everything; a cache is rebuilt from this forward
                self.cache.truncate(0)?;
                self.carry = None;
                (0, cache_end)
            }
        })
    }

    /// The next forward of the step under way, as a segment over `canvas`.
    pub fn segment<'a>(&'a mut self, canvas: &'a [u32]) -> Result<Segment<'a>> {
        let piece = self.pieces.front().ok_or_else(|| Error::Internal("no step under way".into()))?;
        let prompt = matches!(piece.kind, PieceKind::Prefill { .. } | PieceKind::Window { fused: 1.., .. });
        if prompt && self.prefill_started.is_none() {
            self.prefill_started = Some(Instant::now());
        }
        let (start, end, keys, kind, rows) = (piece.start, piece.end, piece.keys, piece.kind, piece.rows.clone());
        // the keys [0, row_end(p)) a final position p saw when its K/V were computed
        let row_end = |p: usize| -> usize {
            if self.causal.iter().any(|r| r.contains(&p)) {
                p + 1
            } else {
                self.grid.block_end(p).min(end)
            }
        };
        let (ids, positions, mask) = match kind {
            PieceKind::Verify { span: (s, e) } => {
                // first half [start, end): final rows keep their visibility, the others are causal; second half
                // (unshifted models): one row per span position, seeing the first half before it and itself
                let mut mask: Vec<Vec<Range<usize>>> = (start..end)
                    .map(|p| std::iter::once(0..if p < self.frontier { row_end(p) } else { p + 1 }).collect())
                    .collect();
                let mut positions: Vec<usize> = (start..end).collect();
                if !self.shift {
                    for (j, i) in (s..e).enumerate() {
                        mask.push(vec![0..i, end + j..end + j + 1]);
                        positions.push(i);
                    }
                }
                (&self.step_ids[..], positions, MaskSpec::Custom(mask))
            }
            PieceKind::Strided => (&self.step_ids[..], (start..end).collect(), MaskSpec::Grid(self.grid)),
            // the grid rule, unless some positions have causal K/V (recompute policy after a verification)
            _ if self.causal.is_empty() || self.policy == CachePolicy::Exact => {
                (&canvas[start..end], (start..end).collect(), MaskSpec::Grid(self.grid))
            }
            _ => (
                &canvas[start..end],
                (start..end).collect(),
                MaskSpec::Custom((start..end).map(|p| std::iter::once(0..row_end(p)).collect()).collect()),
            ),
        };
        // prefill chunks, and every window of a policy that keeps K/V, run over the generation's cache; the
        // recompute policy's pieces over the step's scratch cache
        let own = match kind {
            PieceKind::Prefill { .. } => true,
            PieceKind::Scratch => false,
            PieceKind::Window { .. } | PieceKind::Verify { .. } | PieceKind::Strided => self.policy.keeps(),
        };
        if !own && self.scratch.is_none() {
            self.scratch = Some(self.cache.fresh()?);
        }
        let cache = match &mut self.scratch {
            Some(scratch) if !own => scratch,
            _ => &mut self.cache,
        };
        if cache.len() != keys {
            return Err(Error::Internal(format!("the cache holds {} positions, the piece needs {keys}", cache.len())));
        }
        Ok(Segment { cache, ids, positions, mask, rows, cancel: None })
    }

    /// Queue S2D2's verification of the span [s, e) (positions of the step just consumed, all masked in the
    /// canvas) with these draft tokens. Its `consume` returns the verifier's logits for the span's positions.
    pub fn begin_verify(&mut self, canvas: &[u32], span: (usize, usize), drafts: &[u32]) -> Result<()> {
        let (s, e) = span;
        if self.in_step() || s >= e || drafts.len() != e - s || s < self.frontier {
            return Err(Error::Internal(format!("cannot verify span {s}..{e} (frontier {})", self.frontier)));
        }
        let start = if self.policy == CachePolicy::Exact { self.frontier } else { 0 };
        self.step_ids.clear();
        self.step_ids.extend_from_slice(&canvas[start..s]);
        self.step_ids.extend_from_slice(drafts);
        let rows: Vec<usize> = if self.shift {
            // the row of p - 1 predicts p; the row of e - 1 is the carry when every draft is accepted
            (s.saturating_sub(1).max(start)..e).map(|p| p - start).collect()
        } else {
            let mask = canvas[s];
            self.step_ids.extend(std::iter::repeat_n(mask, e - s));
            (0..e - s).map(|j| e - start + j).collect()
        };
        self.pieces.push_back(Piece { start, end: e, keys: start, rows, kind: PieceKind::Verify { span } });
        Ok(())
    }

    /// TCCF: the grid switches at `at` (a boundary at or after the final K/V's end) to blocks of `block_size`
    /// aligned there. Nothing committed changes.
    pub fn switch_grid(&mut self, at: usize, block_size: usize) -> Result<()> {
        if self.in_step() || at < self.frontier {
            return Err(Error::Internal(format!("cannot switch the grid at {at} (frontier {})", self.frontier)));
        }
        self.grid = self.grid.then(at, block_size)?;
        Ok(())
    }

    /// ISD: the position of the pending token (the last written one, whose K/V are not final yet): the frontier,
    /// or the prompt's last position before the first step.
    pub fn pending(&self) -> usize {
        if self.prefilled {
            self.frontier
        } else {
            self.prompt_len - 1
        }
    }

    /// ISD: queue a step's forward over the pending token of `canvas` and `ids` after it (drafts, masks), strictly
    /// causal (the window's grid is causal); its `consume` gives one logits row per position, the pending one's
    /// first. The first step prefills the prompt up to its last token (exact policy); without a cache a long
    /// prefix is recomputed in prefill-sized chunks first.
    pub fn begin_strided(&mut self, canvas: &[u32], ids: &[u32]) -> Result<()> {
        if self.in_step() || self.grid.kind != AttentionKind::Causal {
            return Err(Error::Internal("an ISD step needs a causal grid and no step under way".into()));
        }
        let exact = self.policy == CachePolicy::Exact;
        if !self.prefilled {
            self.prefilled = true;
            self.frontier = self.prompt_len - 1;
            if exact {
                let h = self.seed(canvas, self.frontier)?;
                self.queue_prefill(h, self.frontier, false);
            }
        }
        let f = self.frontier;
        let start = if exact { f } else { self.queue_recompute(f) };
        self.step_ids.clear();
        self.step_ids.extend_from_slice(&canvas[start..=f]);
        self.step_ids.extend_from_slice(ids);
        let end = f + 1 + ids.len();
        let rows = (f - start..end - start).collect();
        self.pieces.push_back(Piece { start, end, keys: start, rows, kind: PieceKind::Strided });
        Ok(())
    }

    /// ISD: the first `n` positions of the step just consumed (the pending token and the accepted drafts) hold
    /// final tokens over final K/V: commit them (exact policy) and move the frontier past them.
    pub fn commit_strided(&mut self, n: usize) -> Result<()> {
        if self.policy == CachePolicy::Exact {
            self.cache.commit(n)?;
        }
        self.frontier += n;
        Ok(())
    }

    /// After a verification: the positions [frontier, commit_end) hold final tokens that the verification's
    /// first half saw, so their (causal) K/V are final: commit them from that forward.
    pub fn commit_verified(&mut self, commit_end: usize) -> Result<()> {
        let (first, rows) =
            self.verify_rows.take().ok_or_else(|| Error::Internal("no verification to commit".into()))?;
        if commit_end <= self.frontier {
            return Ok(());
        }
        let f = self.frontier;
        if self.policy == CachePolicy::Exact {
            self.cache.commit(commit_end - f)?;
            if self.shift {
                self.carry = Some(rows.narrow(0, commit_end - 1 - first, 1)?);
            }
        }
        match self.causal.last_mut() {
            Some(r) if r.end == f => r.end = commit_end,
            _ => self.causal.push(f..commit_end),
        }
        self.frontier = commit_end;
        Ok(())
    }

    /// Take the logits of the forward `segment` described. Returns the step's positions and their (C, V) logits,
    /// in order, once its window has run (None while forwards remain); commits what the policy keeps.
    pub fn consume(&mut self, logits: Logits) -> Result<Option<(Vec<usize>, Tensor)>> {
        self.head_ms += logits.head_ms;
        let logits = logits.rows;
        let piece = self.pieces.pop_front().ok_or_else(|| Error::Internal("no step under way".into()))?;
        let len = piece.end - piece.start;
        if !matches!(piece.kind, PieceKind::Prefill { .. } | PieceKind::Scratch) {
            self.prompt_done = self.prompt_len; // a step's own forward runs over (or past) the whole prompt
        }
        match piece.kind {
            PieceKind::Prefill { last } => {
                self.prompt_done = self.prompt_done.max(piece.end);
                self.cache.commit(len)?;
                self.note_snapshot();
                if last {
                    if self.shift && !piece.rows.is_empty() {
                        self.carry = Some(logits);
                    }
                    self.prefill_ms = self.prefill_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                }
                Ok(None)
            }
            PieceKind::Scratch => {
                self.prompt_done = self.prompt_done.max(piece.end);
                self.scratch.as_mut().ok_or_else(|| Error::Internal("no scratch cache".into()))?.commit(len)?;
                self.positions_forwarded += len;
                Ok(None)
            }
            PieceKind::Window { commit_end, suffix, fused } => {
                self.positions_forwarded += len - fused;
                if fused > 0 {
                    self.prefill_ms = self.prefill_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                }
                self.scratch = None;
                let out = self.finish_window(piece, commit_end, suffix, logits)?;
                self.frontier = commit_end;
                self.note_snapshot();
                Ok(Some((std::mem::take(&mut self.positions), out)))
            }
            PieceKind::Strided => {
                self.positions_forwarded += len;
                self.scratch = None;
                let first = piece.end - piece.rows.len();
                Ok(Some(((first..piece.end).collect(), logits)))
            }
            PieceKind::Verify { span: (s, e) } => {
                self.positions_forwarded += len + if self.shift { 0 } else { e - s };
                self.scratch = None;
                let out = if self.shift {
                    // rows are positions first..e; position p's prediction is row p - 1, or the carry
                    let first = s.saturating_sub(1).max(piece.start);
                    let table = match &self.carry {
                        Some(c) if s == piece.start && self.policy == CachePolicy::Exact => {
                            Tensor::cat(&[c, &logits], 0)?
                        }
                        _ => logits.clone(),
                    };
                    let off = usize::from(table.dim(0)? > logits.dim(0)?);
                    let pick: Vec<u32> = (s..e).map(|p| (p - 1 + off - first) as u32).collect();
                    self.verify_rows = Some((first, logits));
                    table.index_select(&Tensor::new(pick.as_slice(), table.device())?, 0)?
                } else {
                    self.verify_rows = Some((e, logits.clone()));
                    logits
                };
                Ok(Some(((s..e).collect(), out)))
            }
        }
    }

    /// Gather the step's positions' rows from the window's logits (the carry row sits after them) and commit.
    fn finish_window(
        &mut self,
        piece: Piece,
        commit_end: usize,
        suffix: Option<usize>,
        logits: Tensor,
    ) -> Result<Tensor> {
        let exact = self.policy.keeps();
        let (ws, rows) = (piece.start, &piece.rows);
        let n_rows = rows.len();
        let table = match &self.carry {
            Some(c) if exact && self.shift => Tensor::cat(&[&logits, c], 0)?,
            _ => logits.clone(),
        };
        let mut pick = Vec::with_capacity(self.positions.len());
        for &p in &self.positions {
            let r = self.src(p);
            if r >= ws {
                pick.push(
                    rows.binary_search(&(r - ws)).map_err(|_| Error::Internal("missing logits row".into()))? as u32
                );
            } else if self.carry.is_some() && r + 1 == ws {
                pick.push(n_rows as u32);
            } else {
                return Err(Error::Internal(format!("no logits for position {p} (window starts at {ws})")));
            }
        }
        // rows in order (a step predicting every row it forwards, the full-canvas steps): a view, not a copy
        let run =
            pick.first().map(|&a| a as usize).filter(|&a| pick.iter().enumerate().all(|(i, &r)| r as usize == a + i));
        let out = match run {
            Some(a) if a + pick.len() <= table.dim(0)? => table.narrow(0, a, pick.len())?,
            _ => table.index_select(&Tensor::new(pick.as_slice(), table.device())?, 0)?,
        };
        if let Some(b) = suffix {
            self.cache.commit_split(commit_end - ws, b - ws, piece.end - b)?;
        }
        if exact && commit_end > ws {
            if suffix.is_none() {
                self.cache.commit(commit_end - ws)?;
            }
            if self.shift {
                let i = rows
                    .binary_search(&(commit_end - 1 - ws))
                    .map_err(|_| Error::Internal("missing carry row".into()))?;
                self.carry = Some(logits.narrow(0, i, 1)?);
            }
        }
        Ok(out)
    }
}

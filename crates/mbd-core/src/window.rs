//! The cache/window policy of one generation: which positions a step forwards, over which K/V, and which K/V
//! it keeps. With block-causal or causal attention the K/V of completed blocks never change, so they are
//! cached exactly: after forward s, the leading window blocks that were already complete when forward s
//! started are committed from forward s itself — no extra forward. Without a cache (or with full attention,
//! where no K/V is ever final) every step recomputes from position 0.
//!
//! A step is a short queue of forwards (`begin_step`): the prompt's prefill chunks on the first step, a long
//! canvas's recompute chunks, then the window. Each is handed out as a `Segment` (`segment`) and its logits are
//! taken back (`consume`), so that a scheduler can run the forwards of many generations together.

use crate::decoder::Decoder;
use crate::engine::{chunks, Model, PREFILL_CHUNK};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::mask::{Alignment, AttentionKind, BlockGrid, MaskSpec};
use crate::models::qwen::Segment;
use candle_core::Tensor;
use std::collections::VecDeque;
use std::time::Instant;

/// How K/V survive between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    /// Completed blocks are committed exactly; each step forwards from the first uncommitted position.
    Exact,
    /// Nothing is kept; each step forwards from position 0 (the reference semantics).
    Recompute,
}

/// One forward of a step: canvas[start..end) into the generation's cache (or the step's scratch cache).
#[derive(Debug)]
struct Piece {
    start: usize,
    end: usize,
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
    /// The step's window; the exact policy then commits up to `commit_end`.
    Window { commit_end: usize },
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
    /// The current step's remaining forwards, its positions, and its scratch cache (recompute policy).
    pieces: VecDeque<Piece>,
    positions: Vec<usize>,
    scratch: Option<KvCache>,
    prefill_started: Option<Instant>,
    /// Token positions run through the model by decode steps (prefill excluded).
    pub positions_forwarded: usize,
    pub prefill_ms: f64,
}

impl Window {
    /// `use_cache` is the request's wish; full attention always recomputes (no K/V is ever final).
    pub fn new(model: &Model, grid: BlockGrid, prompt_len: usize, use_cache: bool) -> Window {
        let exact = use_cache && grid.kind != AttentionKind::Full;
        Window {
            policy: if exact { CachePolicy::Exact } else { CachePolicy::Recompute },
            grid,
            shift: model.profile.logits_shift,
            cache: model.new_cache(),
            carry: None,
            prompt_len,
            prefilled: false,
            pieces: VecDeque::new(),
            positions: vec![],
            scratch: None,
            prefill_started: None,
            positions_forwarded: 0,
            prefill_ms: 0.0,
        }
    }

    pub fn policy(&self) -> CachePolicy {
        self.policy
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
    pub fn begin_step(&mut self, dec: &Decoder, positions: Vec<usize>) -> Result<()> {
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
            if exact && pe > 0 {
                let cs = chunks(&self.grid, 0, pe);
                let n = cs.len();
                for (i, (s, e)) in cs.into_iter().enumerate() {
                    let last = i + 1 == n;
                    let rows = if last && self.shift { vec![e - s - 1] } else { vec![] };
                    self.pieces.push_back(Piece { start: s, end: e, rows, kind: PieceKind::Prefill { last } });
                }
            }
        }
        let (ws, we) = match (self.grid.kind, self.policy) {
            (AttentionKind::Full, _) => (0, dec.prompt_len + dec.n),
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
                if b >= PREFILL_CHUNK {
                    for (s, e) in chunks(&self.grid, 0, b) {
                        self.pieces.push_back(Piece { start: s, end: e, rows: vec![], kind: PieceKind::Scratch });
                    }
                } else {
                    b = 0;
                }
                (b, dec.created_end())
            }
        };
        let commit_end = if exact { dec.complete_run_end(ws).max(ws) } else { ws };
        // rows of the window whose logits are needed (and the new carry row)
        let mut rows: Vec<usize> =
            positions.iter().map(|&p| self.src(p)).filter(|&r| r >= ws).map(|r| r - ws).collect();
        if exact && self.shift && commit_end > ws {
            rows.push(commit_end - 1 - ws);
        }
        rows.sort_unstable();
        rows.dedup();
        self.pieces.push_back(Piece { start: ws, end: we, rows, kind: PieceKind::Window { commit_end } });
        self.positions = positions;
        Ok(())
    }

    /// The next forward of the step under way, as a segment over `canvas`.
    pub fn segment<'a>(&'a mut self, canvas: &'a [u32]) -> Result<Segment<'a>> {
        let piece = self.pieces.front().ok_or_else(|| Error::Internal("no step under way".into()))?;
        if matches!(piece.kind, PieceKind::Prefill { .. }) && self.prefill_started.is_none() {
            self.prefill_started = Some(Instant::now());
        }
        let cache = match (piece.kind, self.policy) {
            (PieceKind::Window { .. }, CachePolicy::Exact) | (PieceKind::Prefill { .. }, _) => &mut self.cache,
            _ => self.scratch.get_or_insert_with(|| self.cache.fresh()),
        };
        if cache.len() != piece.start {
            return Err(Error::Internal(format!(
                "the cache holds {} positions, the piece starts at {}",
                cache.len(),
                piece.start
            )));
        }
        Ok(Segment {
            cache,
            ids: &canvas[piece.start..piece.end],
            positions: (piece.start..piece.end).collect(),
            mask: MaskSpec::Grid(self.grid),
            rows: piece.rows.clone(),
        })
    }

    /// Take the logits of the forward `segment` described. Returns the step's positions and their (C, V) logits,
    /// in order, once its window has run (None while forwards remain); commits what the policy keeps.
    pub fn consume(&mut self, logits: Tensor) -> Result<Option<(Vec<usize>, Tensor)>> {
        let piece = self.pieces.pop_front().ok_or_else(|| Error::Internal("no step under way".into()))?;
        let len = piece.end - piece.start;
        match piece.kind {
            PieceKind::Prefill { last } => {
                self.cache.commit(len)?;
                if last {
                    if self.shift {
                        self.carry = Some(logits);
                    }
                    self.prefill_ms = self.prefill_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                }
                Ok(None)
            }
            PieceKind::Scratch => {
                self.scratch.as_mut().ok_or_else(|| Error::Internal("no scratch cache".into()))?.commit(len)?;
                self.positions_forwarded += len;
                Ok(None)
            }
            PieceKind::Window { commit_end } => {
                self.positions_forwarded += len;
                self.scratch = None;
                let out = self.finish_window(piece, commit_end, logits)?;
                Ok(Some((std::mem::take(&mut self.positions), out)))
            }
        }
    }

    /// Gather the step's positions' rows from the window's logits (the carry row sits after them) and commit.
    fn finish_window(&mut self, piece: Piece, commit_end: usize, logits: Tensor) -> Result<Tensor> {
        let exact = self.policy == CachePolicy::Exact;
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
        let out = table.index_select(&Tensor::new(pick.as_slice(), table.device())?, 0)?;
        if exact && commit_end > ws {
            self.cache.commit(commit_end - ws)?;
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

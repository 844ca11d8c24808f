//! The cache/window policy of one generation: which positions a step forwards, over which K/V, and which K/V
//! it keeps. With block-causal or causal attention the K/V of completed blocks never change, so they are
//! cached exactly: after forward s, the leading window blocks that were already complete when forward s
//! started are committed from forward s itself — no extra forward. Without a cache (or with full attention,
//! where no K/V is ever final) every step recomputes from position 0.

use crate::decoder::Decoder;
use crate::engine::{Model, PREFILL_CHUNK};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::mask::{Alignment, AttentionKind, BlockGrid};
use candle_core::Tensor;
use std::time::Instant;

/// How K/V survive between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    /// Completed blocks are committed exactly; each step forwards from the first uncommitted position.
    Exact,
    /// Nothing is kept; each step forwards from position 0 (the reference semantics).
    Recompute,
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
            positions_forwarded: 0,
            prefill_ms: 0.0,
        }
    }

    pub fn policy(&self) -> CachePolicy {
        self.policy
    }

    /// Fill the cache with the prompt up to its last grid boundary (once, before the first step).
    fn prefill(&mut self, model: &Model, canvas: &[u32]) -> Result<()> {
        self.prefilled = true;
        if self.policy == CachePolicy::Recompute {
            return Ok(());
        }
        let lp = self.prompt_len;
        let pe = if self.grid.kind == AttentionKind::BlockCausal && self.grid.alignment == Alignment::Absolute {
            (lp / self.grid.block_size) * self.grid.block_size
        } else {
            lp
        };
        if pe == 0 {
            return Ok(());
        }
        let t = Instant::now();
        let logits = model.fill_cache(&mut self.cache, &canvas[..pe], &self.grid)?;
        if self.shift {
            self.carry = Some(logits);
        }
        self.prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// One forward of `canvas` for the planned `positions`; returns their (C, V) logits, in order. Commits the
    /// leading blocks that were complete before this forward (exact policy).
    pub fn forward(&mut self, model: &Model, canvas: &[u32], dec: &Decoder, positions: &[usize]) -> Result<Tensor> {
        if !self.prefilled {
            self.prefill(model, canvas)?;
        }
        let exact = self.policy == CachePolicy::Exact;
        let src = |p: usize| if self.shift { p - 1 } else { p };
        let mut fresh = model.new_cache();
        let (ws, we) = match (self.grid.kind, self.policy) {
            (AttentionKind::Full, _) => (0, canvas.len()),
            (_, CachePolicy::Exact) => (self.cache.len(), dec.created_end()),
            (_, CachePolicy::Recompute) => {
                // A long canvas is recomputed in prefill-sized chunks up to the last block boundary before the
                // first row whose logits are needed, so that no forward spans all of it (short ones: one forward).
                let first = positions.iter().map(|&p| src(p)).min().unwrap_or(0);
                let mut b = first;
                while b > 0 && !self.grid.is_boundary(b) {
                    b -= 1;
                }
                if b >= PREFILL_CHUNK {
                    model.fill_cache(&mut fresh, &canvas[..b], &self.grid)?;
                    self.positions_forwarded += b;
                } else {
                    b = 0;
                }
                (b, dec.created_end())
            }
        };
        let commit_end = if exact { dec.complete_run_end(ws).max(ws) } else { ws };
        // rows of the window whose logits are needed
        let mut rows: Vec<usize> = positions.iter().map(|&p| src(p)).filter(|&r| r >= ws).map(|r| r - ws).collect();
        if exact && self.shift && commit_end > ws {
            rows.push(commit_end - 1 - ws);
        }
        rows.sort_unstable();
        rows.dedup();
        let cache = if exact { &mut self.cache } else { &mut fresh };
        let logits = model.net.forward(cache, &canvas[ws..we], &self.grid, Some(&rows))?;
        self.positions_forwarded += we - ws;
        // gather the positions' rows (the carry row sits after the window rows)
        let n_rows = rows.len();
        let table = match &self.carry {
            Some(c) if exact && self.shift => Tensor::cat(&[&logits, c], 0)?,
            _ => logits.clone(),
        };
        let mut pick = Vec::with_capacity(positions.len());
        for &p in positions {
            let r = src(p);
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

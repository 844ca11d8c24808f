//! Logits and scores outside a generation: [`Model::logits`] (one forward under a grid), `prompt_logprobs` (each
//! token scored given the tokens before it), and `bench_forward` (a timed forward for benchmarks).

use crate::cpu_pool::on_device_pool;
use crate::decode::sampling::{token_logprobs, TokenLogprob};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::net::mask::{chunks, Alignment, AttentionKind, BlockGrid, MaskSpec};
use crate::net::segment::Segment;
use crate::params::request::{LogitsRequest, Params, ScoreRequest};
use crate::util::Cancel;
use candle_core::Tensor;

/// Positions scored per forward by [`Model::prompt_logprobs`] (bounds the logits it holds: 128 rows of a 152K
/// vocabulary are 78 MB of float32).
pub const SCORE_CHUNK: usize = 128;

impl Model {
    /// The attention grid of a logits call: the request's choices over the profile's defaults.
    pub fn grid_for(&self, req: &LogitsRequest, len: usize) -> Result<BlockGrid> {
        let p = &self.profile;
        let kind = req.attention.unwrap_or(p.attention);
        let align = req.alignment.unwrap_or(p.alignment);
        let plen = match (align, kind, req.prompt_len) {
            (_, _, Some(l)) if l > len => {
                return Err(Error::invalid(format!("prompt_len must be between 0 and len(ids) = {len}, got {l}")))
            }
            (Alignment::Prompt, AttentionKind::BlockCausal, None) => {
                return Err(Error::invalid("prompt_len is required with alignment='prompt'"))
            }
            (_, _, l) => l.unwrap_or(0),
        };
        BlockGrid::new(kind, req.block_size.unwrap_or(p.block_size), align, plen)
    }

    /// Logits for every position of `ids` under the request's attention grid. With `prefix_len > 0` the first
    /// `prefix_len` tokens go through the cache (forward + commit) and the rest are forwarded as a window
    /// over the cached prefix; the result equals the no-cache one. Returns row-major (len, vocab) f32.
    /// `cancel` stops the call between chunks and between a forward's layers ([`Error::Cancelled`]).
    pub fn logits(&self, ids: &[u32], req: &LogitsRequest, cancel: &Cancel) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::invalid("ids is empty: need at least one token"));
        }
        self.check_ids("ids", ids)?;
        let max_ctx = self.config.max_position_embeddings;
        if ids.len() > max_ctx {
            return Err(Error::ContextLength(format!("maximum context is {max_ctx} tokens; ids has {}", ids.len())));
        }
        let grid = self.grid_for(req, ids.len())?;
        let prefix_len = req.prefix_len.unwrap_or(0);
        if prefix_len > ids.len() {
            return Err(Error::invalid(format!("prefix_len {prefix_len} is longer than ids ({} tokens)", ids.len())));
        }
        if prefix_len > 0 && prefix_len < ids.len() && !grid.is_boundary(prefix_len) {
            return Err(Error::invalid(format!(
                "prefix_len {prefix_len} splits an attention block ({} attention, block_size {}): cached keys would need \
                 to see later tokens; use a block boundary",
                grid.kind.name(),
                grid.block_size
            )));
        }
        let v = self.config.vocab_size;
        let n = ids.len().checked_mul(v).ok_or_else(|| Error::invalid("logits: too many positions"))?;
        let mut out: Vec<f32> = Vec::new();
        out.try_reserve_exact(n).map_err(|_| {
            Error::invalid(format!(
                "logits for {} positions x {v} tokens ({:.1} GB of float32) cannot be allocated; ask for fewer positions",
                ids.len(),
                n as f64 * 4e-9
            ))
        })?;
        on_device_pool(self.device(), || {
            let mut cache = self.new_cache()?;
            let pieces = chunks(&grid, 0, prefix_len).into_iter().chain(chunks(&grid, prefix_len, ids.len()));
            for (start, end) in pieces {
                cancel.check("logits")?;
                let l = self.forward(&mut cache, &ids[start..end], &grid, None, Some(cancel))?;
                out.extend(l.flatten_all()?.to_vec1::<f32>()?);
                cache.commit(end - start)?;
            }
            Ok(out)
        })
    }

    /// Each token of `ids` scored given the tokens before it, in autoregressive mode (block size 1: what S2D2's
    /// verifier computes, and what block-causal models are trained to do at block size 1): for shifted models the
    /// logits row of the previous position under causal attention; for unshifted ones (SDAR) a mask token at the
    /// position that sees the tokens before it and itself (two rows per position in one forward, the first half
    /// causal, as S2D2's verification window). The first token has no context and gets None. Full-attention
    /// models (Dream) have no left-to-right likelihood and are refused.
    pub fn prompt_logprobs(
        &self,
        ids: &[u32],
        req: &ScoreRequest,
        cancel: &Cancel,
    ) -> Result<Vec<Option<TokenLogprob>>> {
        req.validate()?;
        let k = req.logprobs.unwrap_or(0);
        if ids.is_empty() {
            return Err(Error::invalid("the prompt is empty (0 tokens); give at least one token to score"));
        }
        self.check_ids("prompt", ids)?;
        let max_ctx = self.config.max_position_embeddings;
        if ids.len() > max_ctx {
            return Err(Error::ContextLength(format!(
                "maximum context is {max_ctx} tokens; the prompt to score has {}",
                ids.len()
            )));
        }
        let p = &self.profile;
        if p.attention == AttentionKind::Full {
            return Err(Error::invalid(format!(
                "prompt log-probabilities are left-to-right (block size 1), which needs block-causal or causal \
                 attention; this model ({}) uses full attention",
                p.architecture
            )));
        }
        if !p.logits_shift && self.is_hybrid() {
            return Err(Error::invalid(format!(
                "prompt log-probabilities of this model ({}) need a mask row beside each token (two rows per \
                 position), which its Gated DeltaNet layers (a recurrence over positions in order) cannot run",
                p.architecture
            )));
        }
        let mask_id = match (p.logits_shift, p.mask_token_id) {
            (false, None) => {
                return Err(Error::invalid(format!(
                    "this model ({}) predicts a position from a mask token there, and has no mask token id; pass \
                     mask_token_id=... to Engine.load",
                    p.architecture
                )))
            }
            (_, m) => m.unwrap_or(0),
        };
        let causal = BlockGrid::causal();
        let mut out: Vec<Option<TokenLogprob>> = vec![None; ids.len()];
        on_device_pool(self.device(), || {
            let mut cache = self.new_cache()?;
            cache.reserve(ids.len() + SCORE_CHUNK)?;
            for s in (0..ids.len()).step_by(SCORE_CHUNK) {
                cancel.check("prompt_logprobs")?;
                let e = (s + SCORE_CHUNK).min(ids.len());
                let w = e - s;
                // (window row whose logits predict position q, q) for the positions q >= 1 of this chunk
                let (logits, scored): (Tensor, Vec<usize>) = if p.logits_shift {
                    // row j (position s + j) predicts s + j + 1
                    let rows: Vec<usize> = (0..w).filter(|j| s + j + 1 < ids.len()).collect();
                    if rows.is_empty() {
                        break;
                    }
                    let l = self.forward(&mut cache, &ids[s..e], &causal, Some(&rows), Some(cancel))?;
                    (l, rows.iter().map(|j| s + j + 1).collect())
                } else {
                    // rows [0, w): the tokens, causal; rows [w, 2w): a mask at each position, seeing the tokens
                    // before it and itself
                    let mut win = ids[s..e].to_vec();
                    win.extend(std::iter::repeat_n(mask_id, w));
                    let visible: Vec<Vec<std::ops::Range<usize>>> = (0..w)
                        .map(|j| std::iter::once(0..s + j + 1).collect())
                        .chain((0..w).map(|j| vec![0..s + j, s + w + j..s + w + j + 1]))
                        .collect();
                    let first = usize::from(s == 0);
                    let rows: Vec<usize> = (w + first..2 * w).collect();
                    if rows.is_empty() {
                        break; // a one-token prompt
                    }
                    let seg = Segment {
                        cache: &mut cache,
                        ids: &win,
                        positions: (s..e).chain(s..e).collect(),
                        mask: MaskSpec::Custom(visible),
                        rows: rows.clone(),
                        cancel: Some(cancel.clone()),
                    };
                    let l = self
                        .forward_segments(&mut [seg])?
                        .pop()
                        .ok_or_else(|| Error::Internal("no logits".into()))?
                        .rows;
                    (l, rows.iter().map(|r| s + r - w).collect())
                };
                cache.commit(w)?;
                let tokens: Vec<u32> = scored.iter().map(|&q| ids[q]).collect();
                for (q, t) in scored.into_iter().zip(token_logprobs(&logits, None, &tokens, k)?) {
                    out[q] = Some(t);
                }
            }
            Ok::<(), Error>(())
        })?;
        Ok(out)
    }

    /// Time `reps` decode forwards of a `window`-token block over a committed prefix of `prefix` tokens
    /// (block-causal: one block, no mask; logits for every window row, or only the last with `last_row`, as a
    /// prefill that continues into decoding needs). Returns seconds per forward.
    /// Used by the benchmarks to compare with other engines on the same computation.
    pub fn bench_forward(&self, prefix: usize, window: usize, reps: usize, last_row: bool) -> Result<Vec<f64>> {
        let v = self.config.vocab_size as u64;
        let mut x: u64 = 0x9E3779B97F4A7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % v) as u32
        };
        let pre: Vec<u32> = (0..prefix).map(|_| next()).collect();
        let win: Vec<u32> = (0..window).map(|_| next()).collect();
        // the window is one block over the prefix: every query sees every key
        let one_block = BlockGrid::new(AttentionKind::Full, 1, Alignment::Absolute, 0)?;
        on_device_pool(self.device(), || {
            let mut cache = self.new_cache()?;
            cache.reserve(prefix + window)?;
            if prefix > 0 {
                self.fill_cache(&mut cache, &pre, &BlockGrid::causal())?;
            }
            let last = [window.saturating_sub(1)];
            let rows = last_row.then_some(&last[..]);
            let mut out = Vec::with_capacity(reps);
            // the repetitions replay a CUDA graph where the model keeps them (`Kernels::cuda_graphs`), as the
            // scheduler's forwards do
            crate::net::graph::on_lasting_thread(|| {
                for _ in 0..reps {
                    let t = std::time::Instant::now();
                    let l = self.forward(&mut cache, &win, &one_block, rows, None)?;
                    // wait for the device's work before stopping the clock (not by reading a logit back: candle
                    // copies a narrowed CUDA tensor's whole buffer to the host, 39 MB for 64 rows of a 152k vocabulary)
                    self.device().synchronize()?;
                    drop(l);
                    out.push(t.elapsed().as_secs_f64());
                }
                Ok(out)
            })
        })
    }
}

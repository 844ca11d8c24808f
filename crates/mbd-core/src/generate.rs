//! Drives the decoding state machine (`decoder`) with the model: prefill, one forward per step over
//! the window the created blocks need, and the exact KV cache of completed blocks (block-causal and
//! causal attention): after forward s, the leading window blocks that were already complete when
//! forward s started are committed from forward s itself — no extra forward.

use crate::config::Family;
use crate::decoder::{block_layout, Acceptance, BlockState, DecodeParams, Decoder, ForcedProgress, StopCause};
use crate::engine::Model;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::mask::{Alignment, AttentionKind, BlockGrid};
use crate::sampling::{Sampler, SamplingParams};
use crate::text::{Detok, TextStream};
use candle_core::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// A request's parameters; `None` = the model profile's default.
#[derive(Debug, Clone, Default)]
pub struct GenRequest {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub block_size: Option<usize>,
    pub threshold: Option<f64>,
    pub acceptance: Option<Acceptance>,
    pub block_add_threshold: Option<f64>,
    pub decoded_token_threshold: Option<f64>,
    pub forced_progress: Option<ForcedProgress>,
    pub early_stop: Option<bool>,
    pub use_cache: Option<bool>,
    pub max_forward_passes: Option<usize>,
    pub trace: bool,
    pub trace_canvas: bool,
}

/// Per-family defaults from the authors' scripts: (acceptance, threshold, alpha, beta, forced).
fn family_defaults(family: Family, attention: AttentionKind) -> (Acceptance, f64, f64, f64, ForcedProgress) {
    match family {
        // Single-block semi-AR with a confidence threshold (SDAR/TraDo: 0.9; Fast-dLLM v2: 0.9).
        Family::Sdar | Family::SdarMoe | Family::FastDllmV2 => (Acceptance::Confidence, 0.9, 1.0, 0.95, ForcedProgress::First),
        _ if attention == AttentionKind::Causal => (Acceptance::Confidence, 0.9, 1.0, 0.95, ForcedProgress::First),
        // d3LLM multi-block: entropy 0.5, alpha 0.1, beta 0.95, forced progress in the first block.
        _ => (Acceptance::Entropy, 0.5, 0.1, 0.95, ForcedProgress::First),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
}

impl FinishReason {
    pub fn name(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub forward_passes: usize,
    pub tokens_per_forward: f64,
    pub ttft_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub tokens_per_second: f64,
    /// Token positions run through the model by decode steps (window lengths summed; excludes prefill).
    pub positions_forwarded: usize,
}

#[derive(Debug, Clone)]
pub struct StepEvent {
    pub index: usize,
    /// Offsets from the prompt's end decoded by this step.
    pub decoded: Vec<usize>,
    pub tokens: Vec<u32>,
    /// (start offset, end offset, state) per generation block.
    pub blocks: Vec<(usize, usize, BlockState)>,
    pub tokens_per_forward: f64,
    /// Generated region, -1 for masks (only with trace_canvas).
    pub canvas: Option<Vec<i64>>,
}

#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    pub event: Option<StepEvent>,
    pub usage: Option<Usage>,
}

pub struct Generation {
    model: Arc<Model>,
    dec: Decoder,
    prompt_len: usize,
    canvas: Vec<u32>,
    mask_id: u32,
    grid: BlockGrid,
    use_cache: bool,
    full: bool,
    shift: bool,
    cache: KvCache,
    /// Logits row of the last committed position (shifted profiles only), (1, V).
    carry: Option<Tensor>,
    prefilled: bool,
    sampler: Sampler,
    text: TextStream,
    detok: Detok,
    stop_ids: Vec<u32>,
    early_stop: bool,
    completion: Vec<u32>,
    finish: Option<FinishReason>,
    trace: bool,
    trace_canvas: bool,
    t0: Instant,
    prefill_ms: f64,
    ttft_ms: Option<f64>,
    positions_forwarded: usize,
}

impl Generation {
    pub fn new(model: Arc<Model>, prompt: Vec<u32>, req: &GenRequest) -> Result<Generation> {
        let p = &model.profile;
        if prompt.is_empty() {
            return Err(Error::invalid("prompt is empty (0 tokens); give at least one token"));
        }
        model.check_ids(&prompt)?;
        let mask_id = p.mask_token_id.ok_or_else(|| {
            Error::invalid(format!(
                "this model ({}) has no mask token id; pass mask_token_id=... to Engine.load",
                p.architecture
            ))
        })?;
        let lp = prompt.len();
        let max_ctx = model.config.max_position_embeddings;
        // Default: 256 tokens, or what is left of the context.
        let n = req.max_tokens.unwrap_or_else(|| 256.min(max_ctx.saturating_sub(lp)).max(1));
        if n < 1 {
            return Err(Error::invalid(format!("max_tokens must be >= 1, got {n}")));
        }
        let b = req.block_size.unwrap_or(if p.attention == AttentionKind::Causal { 1 } else { p.block_size });
        if b < 1 {
            return Err(Error::invalid(format!("block_size must be >= 1, got {b}")));
        }
        if lp + n > max_ctx {
            return Err(Error::ContextLength(format!(
                "maximum context is {max_ctx} tokens; requested {} ({lp} prompt + {n} completion)",
                lp + n
            )));
        }
        for &t in &req.stop_token_ids {
            if t as usize >= model.config.vocab_size {
                return Err(Error::invalid(format!("stop_token_ids: {t} is outside the vocabulary of {}", model.config.vocab_size)));
            }
        }
        let (acc, tau, alpha, beta, forced) = family_defaults(p.family, p.attention);
        let mut stop_ids = p.eos_token_ids.clone();
        for &t in &req.stop_token_ids {
            if !stop_ids.contains(&t) {
                stop_ids.push(t);
            }
        }
        let early_stop = req.early_stop.unwrap_or(true);
        let params = DecodeParams {
            threshold: req.threshold.unwrap_or(tau),
            acceptance: req.acceptance.unwrap_or(acc),
            block_add_threshold: req.block_add_threshold.unwrap_or(alpha),
            decoded_token_threshold: req.decoded_token_threshold.unwrap_or(beta),
            forced_progress: req.forced_progress.unwrap_or(forced),
            early_stop,
            max_forward_passes: req.max_forward_passes.unwrap_or(10_000),
            eos_ids: stop_ids.clone(),
        };
        let sampler = Sampler::new(SamplingParams {
            temperature: req.temperature.unwrap_or(0.0),
            top_k: req.top_k.unwrap_or(0),
            top_p: req.top_p.unwrap_or(1.0),
            seed: req.seed,
        })?;
        let (grid, absolute) = match p.attention {
            AttentionKind::BlockCausal => {
                (BlockGrid::new(AttentionKind::BlockCausal, b, p.alignment, lp)?, p.alignment == Alignment::Absolute)
            }
            AttentionKind::Causal => (BlockGrid::causal(), false),
            AttentionKind::Full => (BlockGrid::new(AttentionKind::Full, b, Alignment::Prompt, lp)?, false),
        };
        let dec = Decoder::new(lp, n, block_layout(lp, n, b, absolute), params)?;
        let mut canvas = prompt;
        canvas.extend(std::iter::repeat(mask_id).take(n));
        let full = p.attention == AttentionKind::Full;
        Ok(Generation {
            cache: model.new_cache(),
            shift: p.logits_shift,
            model,
            dec,
            prompt_len: lp,
            canvas,
            mask_id,
            grid,
            use_cache: req.use_cache.unwrap_or(true) && !full,
            full,
            carry: None,
            prefilled: false,
            sampler,
            text: TextStream::new(req.stop.clone()),
            detok: Detok::default(),
            stop_ids,
            early_stop,
            completion: vec![],
            finish: None,
            trace: req.trace || req.trace_canvas,
            trace_canvas: req.trace_canvas,
            t0: Instant::now(),
            prefill_ms: 0.0,
            ttft_ms: None,
            positions_forwarded: 0,
        })
    }

    fn prefill(&mut self) -> Result<()> {
        self.prefilled = true;
        if !self.use_cache {
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
        let logits = self.model.fill_cache(&mut self.cache, &self.canvas[..pe], &self.grid)?;
        if self.shift {
            self.carry = Some(logits);
        }
        self.prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// One forward for the planned positions; returns their (C, V) logits.
    fn forward(&mut self, positions: &[usize]) -> Result<Tensor> {
        // The model reads the decoder's current canvas (decoded tokens and the EOS fill; masks elsewhere).
        let lp = self.prompt_len;
        for i in 0..self.dec.n {
            self.canvas[lp + i] = if self.dec.decoded[i] { self.dec.tokens[i] } else { self.mask_id };
        }
        let (ws, we) = if self.full {
            (0, self.canvas.len())
        } else if self.use_cache {
            (self.cache.len(), self.dec.created_end())
        } else {
            (0, self.dec.created_end())
        };
        let commit_end = if self.use_cache { self.dec.complete_run_end(ws).max(ws) } else { ws };
        // rows of the window whose logits are needed
        let src = |p: usize| if self.shift { p - 1 } else { p };
        let mut rows: Vec<usize> = positions.iter().map(|&p| src(p)).filter(|&r| r >= ws).map(|r| r - ws).collect();
        if self.use_cache && self.shift && commit_end > ws {
            rows.push(commit_end - 1 - ws);
        }
        rows.sort_unstable();
        rows.dedup();
        let mut fresh = None;
        let cache = if self.use_cache {
            &mut self.cache
        } else {
            fresh = Some(self.model.new_cache());
            fresh.as_mut().unwrap()
        };
        let mask = self.grid.additive_mask(ws, we - ws);
        let logits = self.model.net.forward(cache, &self.canvas[ws..we], mask.as_deref(), Some(&rows))?;
        self.positions_forwarded += we - ws;
        drop(fresh);
        // gather candidates' rows (the carry row sits after the window rows)
        let n_rows = rows.len();
        let table = match &self.carry {
            Some(c) if self.use_cache && self.shift => Tensor::cat(&[&logits, c], 0)?,
            _ => logits.clone(),
        };
        let mut pick = Vec::with_capacity(positions.len());
        for &p in positions {
            let r = src(p);
            if r >= ws {
                pick.push(rows.binary_search(&(r - ws)).map_err(|_| Error::Internal("missing logits row".into()))? as u32);
            } else if self.carry.is_some() && r + 1 == ws {
                pick.push(n_rows as u32);
            } else {
                return Err(Error::Internal(format!("no logits for position {p} (window starts at {ws})")));
            }
        }
        let out = table.index_select(&Tensor::new(pick.as_slice(), table.device())?, 0)?;
        if self.use_cache && commit_end > ws {
            self.cache.commit(commit_end - ws)?;
            if self.shift {
                let i = rows.binary_search(&(commit_end - 1 - ws)).unwrap();
                self.carry = Some(logits.narrow(0, i, 1)?);
            }
        }
        Ok(out)
    }

    fn usage(&self) -> Usage {
        let total_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        let fp = self.dec.forward_passes;
        let ct = self.completion.len();
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: ct,
            forward_passes: fp,
            tokens_per_forward: if fp > 0 { ct as f64 / fp as f64 } else { 0.0 },
            ttft_ms: self.ttft_ms.unwrap_or(total_ms),
            prefill_ms: self.prefill_ms,
            decode_ms: total_ms,
            tokens_per_second: if total_ms > 0.0 { ct as f64 * 1e3 / total_ms } else { 0.0 },
            positions_forwarded: self.positions_forwarded,
        }
    }

    /// The completion's text so far (incrementally; exact one-shot decoding when `is_final`).
    fn detok(&mut self, is_final: bool) -> Result<String> {
        let tok = &self.model.tokenizer;
        self.detok.text(&self.completion, is_final, |ids| tok.decode(ids, true))
            .map_err(|e| Error::Internal(format!("detokenize: {e}")))
    }

    /// Move newly stable tokens to the completion and text; returns (new ids, new text, finish).
    fn collect(&mut self, is_final: bool) -> Result<(Vec<u32>, String, Option<FinishReason>)> {
        let stable = self.dec.stable_len();
        let mut new_ids = vec![];
        let mut hit_eos = false;
        let already = self.completion.len();
        for i in already..stable {
            let t = self.dec.tokens[i];
            if self.stop_ids.contains(&t) {
                hit_eos = true;
                break;
            }
            new_ids.push(t);
        }
        // a previously reached EOS stays reached
        if !hit_eos && stable > already + new_ids.len() {
            hit_eos = true;
        }
        self.completion.extend_from_slice(&new_ids);
        if !new_ids.is_empty() && self.ttft_ms.is_none() {
            self.ttft_ms = Some(self.t0.elapsed().as_secs_f64() * 1e3);
        }
        // With early_stop, an EOS in the stable prefix means the loop stops at its next iteration without
        // another forward, so finish now. Without it, the loop decodes every position (the output is final).
        let eos_final = hit_eos && (self.early_stop || is_final);
        let done = is_final || eos_final;
        if new_ids.is_empty() && !done {
            return Ok((new_ids, String::new(), None));
        }
        let text = self.detok(done)?;
        let upd = self.text.update(text, done);
        let finish = if upd.stopped.is_some() || eos_final {
            Some(FinishReason::Stop)
        } else if is_final {
            Some(FinishReason::Length)
        } else {
            None
        };
        Ok((new_ids, upd.new_text, finish))
    }

    fn event(&self) -> StepEvent {
        let lp = self.prompt_len;
        StepEvent {
            index: self.dec.forward_passes,
            decoded: self.dec.last_decoded.iter().map(|p| p - lp).collect(),
            tokens: self.dec.last_decoded.iter().map(|p| self.dec.tokens[p - lp]).collect(),
            blocks: (0..self.dec.blocks.len())
                .map(|k| (self.dec.blocks[k].start - lp, self.dec.blocks[k].end - lp, self.dec.block_state(k)))
                .collect(),
            tokens_per_forward: if self.dec.forward_passes > 0 {
                self.dec.accepted as f64 / self.dec.forward_passes as f64
            } else {
                0.0
            },
            canvas: if self.trace_canvas {
                Some((0..self.dec.n).map(|i| if self.dec.decoded[i] { self.dec.tokens[i] as i64 } else { -1 }).collect())
            } else {
                None
            },
        }
    }

    /// Cancel: the next output is the final one, with finish_reason "cancelled".
    pub fn cancel(&mut self) -> StepOutput {
        if self.finish.is_some() {
            return StepOutput::default();
        }
        self.finish = Some(FinishReason::Cancelled);
        StepOutput { finish_reason: self.finish, usage: Some(self.usage()), ..Default::default() }
    }

    /// One decoding step (one forward). Returns None once the generation has finished.
    pub fn step(&mut self) -> Result<Option<StepOutput>> {
        if self.model.net.device().is_cpu() {
            crate::on_cpu_pool(|| self.step_impl())
        } else {
            self.step_impl()
        }
    }

    fn step_impl(&mut self) -> Result<Option<StepOutput>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        if !self.prefilled {
            self.prefill()?;
        }
        let positions = match self.dec.plan() {
            Some(p) => p,
            None => {
                let (ids, text, fin) = self.collect(true)?;
                self.finish = fin;
                return Ok(Some(StepOutput { token_ids: ids, text, finish_reason: fin, event: None, usage: Some(self.usage()) }));
            }
        };
        let logits = self.forward(&positions)?;
        let preds = self.sampler.predict(&logits)?;
        self.dec.apply(&positions, &preds)?;
        let capped = self.dec.stopped == Some(StopCause::ForwardCap);
        let all_done = self.dec.masks_left() == 0;
        let (ids, text, fin) = self.collect(capped || all_done)?;
        let event = if self.trace { Some(self.event()) } else { None };
        self.finish = fin;
        let usage = fin.map(|_| self.usage());
        Ok(Some(StepOutput { token_ids: ids, text, finish_reason: fin, event, usage }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn defaults_follow_family() {
        assert_eq!(family_defaults(Family::Sdar, AttentionKind::BlockCausal).0, Acceptance::Confidence);
        assert_eq!(family_defaults(Family::Dream, AttentionKind::Full).0, Acceptance::Entropy);
        let _ = Usage::default();
    }
}

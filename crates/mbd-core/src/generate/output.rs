//! What a generation emits: the stable left-to-right prefix of decoded tokens as completion tokens and
//! streamed text (stop strings, EOS), the finish reason, per-step trace events and the usage numbers.

use crate::decode::decoder::{BlockState, Decoder};
use crate::decode::sampling::{token_logprobs, TokenLogprob};
use crate::decode::speculative::SpecStats;
use crate::error::{Error, Result};
use crate::generate::text::{Detok, TextStream};
use crate::model::Model;
use crate::params::request::TraceMode;
use candle_core::Tensor;
use std::time::Instant;

crate::util::string_enum! {
    /// Why a generation ended.
    pub enum FinishReason ("finish_reason") { Stop = "stop", Length = "length", Cancelled = "cancelled" }
}

/// A generation's counters outside the decoder, for the usage.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub positions_forwarded: usize,
    pub prefill_ms: f64,
    /// Prompt positions whose K/V came from the prefix cache.
    pub cached_tokens: usize,
    /// The head's time: the vocabulary product (the forwards' share) and the rows' statistics, summed over steps.
    pub head_ms: f64,
    /// The speculative counters (speculative="s2d2" or "isd")
    pub speculative: Option<SpecStats>,
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
    /// Speculation (zero without): verifications (S2D2: verification forwards; ISD: steps that verified drafts),
    /// drafts put to the verifier, drafts accepted.
    pub verifications: usize,
    pub drafts_proposed: usize,
    pub drafts_accepted: usize,
    /// Completion tokens a grammar forced (the only token it allowed), written without a forward.
    pub forced_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache (not prefilled).
    pub cached_tokens: usize,
    /// Milliseconds of the head over the generation's logits rows, summed over its forwards and steps: the final norm
    /// and vocabulary product (its share by rows of a batched forward) and the per-row statistics and tokens
    /// (argmax, entropy, max probability, a sampled token). Part of `decode_ms`, prefill's head included.
    pub head_ms: f64,
}

#[derive(Debug, Clone)]
pub struct StepEvent {
    pub index: usize,
    /// Offsets from the prompt's end decoded by this step.
    pub decoded: Vec<usize>,
    pub tokens: Vec<u32>,
    /// (start offset, end offset, state) per generation block.
    pub blocks: Vec<(usize, usize, BlockState)>,
    /// Completion tokens so far per forward so far: usage's number (equal to it at the last step).
    pub tokens_per_forward: f64,
    /// Canvas positions decoded so far per forward so far: the decoder's parallelism, the end of text and the fill
    /// after it included (what the step's acceptance and forced progress wrote).
    pub positions_per_forward: f64,
    /// Generated region, -1 for masks (only with trace "canvas").
    pub canvas: Option<Vec<i64>>,
    /// Offset of the first decoded end-of-text token ([`Decoder::first_eos`]), None while there is none.
    pub end: Option<usize>,
}

#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    pub event: Option<StepEvent>,
    pub usage: Option<Usage>,
    /// With `logprobs`: each of `token_ids`' log-probability under the step that decided it, then, on the
    /// output that ends the generation at an EOS token, that EOS's (which `token_ids` never holds).
    pub logprobs: Vec<TokenLogprob>,
}

impl StepOutput {
    /// Join the next output (without a trace event) to this one, as if one step had emitted both.
    pub fn absorb(&mut self, next: StepOutput) {
        let StepOutput { token_ids, text, finish_reason, event, usage, logprobs } = next;
        debug_assert!(event.is_none(), "trace events are never joined");
        self.token_ids.extend(token_ids);
        self.text.push_str(&text);
        self.finish_reason = finish_reason;
        self.usage = usage;
        self.logprobs.extend(logprobs);
    }
}

/// The output side of a generation: completion tokens, text, finish, trace, and its clock.
pub struct Output {
    prompt_len: usize,
    text: TextStream,
    detok: Detok,
    completion: Vec<u32>,
    finish: Option<FinishReason>,
    trace: TraceMode,
    t0: Instant,
    ttft_ms: Option<f64>,
    /// With `logprobs` (alternatives per token): each generated position's log-probability, recorded by the
    /// step that wrote it.
    logprobs: Option<(usize, Vec<Option<TokenLogprob>>)>,
}

impl Output {
    /// `logprobs`: alternatives per token when log-probabilities are wanted for the `n` generated positions.
    pub fn new(prompt_len: usize, n: usize, stop: Vec<String>, trace: TraceMode, logprobs: Option<usize>) -> Output {
        Output {
            logprobs: logprobs.map(|k| (k, vec![None; n])),
            prompt_len,
            text: TextStream::new(stop),
            detok: Detok::default(),
            completion: vec![],
            finish: None,
            trace,
            t0: Instant::now(),
            ttft_ms: None,
        }
    }

    pub fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Emit what the last step made stable (`is_final`: the decoder has stopped), with the trace event and,
    /// on the last output, the usage.
    pub fn emit(
        &mut self,
        model: &Model,
        dec: &Decoder,
        is_final: bool,
        step: bool,
        window: Counters,
    ) -> Result<StepOutput> {
        let already = self.completion.len();
        let (token_ids, text, finish, eos_end) = self.collect(model, dec, is_final)?;
        let logprobs = match &mut self.logprobs {
            None => vec![],
            Some((_, lps)) => {
                // the completion's new tokens, and the EOS that ends it now (as OpenAI-style APIs list it)
                let end = already + token_ids.len() + usize::from(eos_end);
                lps[already..end]
                    .iter_mut()
                    .map(|l| {
                        l.take().ok_or_else(|| Error::Internal("a decided token without its log-probability".into()))
                    })
                    .collect::<Result<_>>()?
            }
        };
        let event = if step && self.trace != TraceMode::Off { Some(self.event(dec)) } else { None };
        self.finish = finish;
        let usage = finish.map(|_| self.usage(dec, window));
        Ok(StepOutput { token_ids, text, finish_reason: finish, event, usage, logprobs })
    }

    /// With `logprobs`: record the log-probabilities of the positions the last step wrote (`dec.last_decoded`)
    /// from the step's logits (`logits` row i predicts `positions[i]`).
    pub fn record_logprobs(&mut self, dec: &Decoder, positions: &[usize], logits: &Tensor) -> Result<()> {
        let Some((k, lps)) = &mut self.logprobs else { return Ok(()) };
        let lp = self.prompt_len;
        let rows = dec
            .last_decoded
            .iter()
            .map(|p| positions.iter().position(|q| q == p))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| Error::Internal("a written position has no logits row".into()))?;
        let tokens: Vec<u32> = dec.last_decoded.iter().map(|&p| dec.tokens[p - lp]).collect();
        for (&p, t) in dec.last_decoded.iter().zip(token_logprobs(logits, Some(&rows), &tokens, *k)?) {
            lps[p - lp] = Some(t);
        }
        Ok(())
    }

    /// Cancel: the final output, with finish_reason "cancelled" (nothing when already finished).
    pub fn cancel(&mut self, dec: &Decoder, window: Counters) -> StepOutput {
        if self.finish.is_some() {
            return StepOutput::default();
        }
        self.finish = Some(FinishReason::Cancelled);
        StepOutput { finish_reason: self.finish, usage: Some(self.usage(dec, window)), ..Default::default() }
    }

    fn usage(&self, dec: &Decoder, c: Counters) -> Usage {
        let spec = c.speculative.unwrap_or_default();
        let total_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        let fp = dec.forward_passes;
        let ct = self.completion.len();
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: ct,
            forward_passes: fp,
            tokens_per_forward: if fp > 0 { ct as f64 / fp as f64 } else { 0.0 },
            ttft_ms: self.ttft_ms.unwrap_or(total_ms),
            prefill_ms: c.prefill_ms,
            decode_ms: total_ms,
            tokens_per_second: if total_ms > 0.0 { ct as f64 * 1e3 / total_ms } else { 0.0 },
            positions_forwarded: c.positions_forwarded,
            verifications: spec.verifications,
            drafts_proposed: spec.drafts_proposed,
            drafts_accepted: spec.drafts_accepted,
            forced_tokens: dec.forced,
            cached_tokens: c.cached_tokens,
            head_ms: c.head_ms,
        }
    }

    /// The completion's text so far (incrementally; exact one-shot decoding when `is_final`).
    fn detok(&mut self, model: &Model, is_final: bool) -> Result<String> {
        let tok = &model.tokenizer;
        self.detok
            .text(&self.completion, is_final, |ids| tok.decode(ids, true))
            .map_err(|e| Error::Internal(format!("detokenize: {e}")))
    }

    /// Move newly stable tokens to the completion and text; returns (new ids, new text, finish, whether an EOS
    /// right after the completion ends it now).
    fn collect(
        &mut self,
        model: &Model,
        dec: &Decoder,
        is_final: bool,
    ) -> Result<(Vec<u32>, String, Option<FinishReason>, bool)> {
        let stable = dec.stable_len();
        let stop_ids = &dec.params.eos_ids;
        let mut new_ids = vec![];
        let mut hit_eos = false;
        let already = self.completion.len();
        for &t in &dec.tokens[already..stable] {
            if stop_ids.contains(&t) {
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
        let eos_final = hit_eos && (dec.params.early_stop || is_final);
        let done = is_final || eos_final;
        if new_ids.is_empty() && !done {
            return Ok((new_ids, String::new(), None, false));
        }
        let text = self.detok(model, done)?;
        let upd = self.text.update(text, done);
        let finish = if upd.stopped.is_some() || eos_final {
            Some(FinishReason::Stop)
        } else if is_final {
            Some(FinishReason::Length)
        } else {
            None
        };
        Ok((new_ids, upd.new_text, finish, eos_final))
    }

    fn event(&self, dec: &Decoder) -> StepEvent {
        let lp = self.prompt_len;
        StepEvent {
            index: dec.forward_passes,
            decoded: dec.last_decoded.iter().map(|p| p - lp).collect(),
            tokens: dec.last_decoded.iter().map(|p| dec.tokens[p - lp]).collect(),
            blocks: (0..dec.blocks.len())
                .map(|k| (dec.blocks[k].start - lp, dec.blocks[k].end - lp, dec.block_state(k)))
                .collect(),
            tokens_per_forward: per(self.completion.len(), dec.forward_passes),
            positions_per_forward: per(dec.accepted, dec.forward_passes),
            canvas: (self.trace == TraceMode::Canvas)
                .then(|| (0..dec.n).map(|i| if dec.decoded[i] { dec.tokens[i] as i64 } else { -1 }).collect()),
            end: dec.first_eos(),
        }
    }
}

/// `n` per forward (0 before any forward).
fn per(n: usize, forwards: usize) -> f64 {
    if forwards > 0 {
        n as f64 / forwards as f64
    } else {
        0.0
    }
}

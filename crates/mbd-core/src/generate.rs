//! One generation, step by step: plan (the decoder says which positions to predict) → window (the cache
//! policy says what to forward and keep) → forward → predict (sampling) → [S2D2: verify the span's drafts with
//! a second forward] → apply (the decoder accepts and writes tokens) → emit (the stable prefix becomes
//! completion text).

use crate::decoder::{block_layout, DecodeParams, Decoder, Prediction, StopCause};
use crate::engine::Model;
use crate::error::{Error, Result};
use crate::mask::{Alignment, AttentionKind, BlockGrid};
use crate::models::qwen::Segment;
use crate::output::{Counters, Output};
pub use crate::output::{FinishReason, StepEvent, StepOutput, Usage};
use crate::request::{GenRequest, Params, TraceMode};
use crate::sampling::{Sampler, SamplingParams};
use crate::speculative::{Router, SpecParams, Speculative};
use crate::window::{CachePolicy, Window};
use candle_core::{DType, Tensor};
use std::sync::Arc;

/// Default completion length: 256 tokens, or what is left of the context.
const DEFAULT_MAX_TOKENS: usize = 256;
/// Default cap on forward passes.
const DEFAULT_MAX_FORWARD_PASSES: usize = 10_000;

pub struct Generation {
    model: Arc<Model>,
    dec: Decoder,
    /// prompt ++ generated region: decoded tokens, the EOS fill, masks elsewhere (what the model reads).
    canvas: Vec<u32>,
    mask_id: u32,
    window: Window,
    sampler: Sampler,
    out: Output,
    /// S2D2's routing state and counters (speculative="s2d2").
    spec: Option<Router>,
    /// A drafted step waiting for its verification forward.
    pending: Option<Drafted>,
}

/// A step's span, held while it is verified.
struct Drafted {
    /// the span's first position
    start: usize,
    /// the span's draft predictions
    preds: Vec<Prediction>,
    /// the span's draft logits rows (sampling only: the residual distribution at a rejection needs them)
    rows: Option<Tensor>,
}

impl Generation {
    /// Resolve `req` over the model's profile and family defaults and set up the decoder, the cache/window
    /// policy and the output. Parameter ranges are checked by `req.validate()` (`request::PARAMS`).
    pub fn new(model: Arc<Model>, prompt: Vec<u32>, req: &GenRequest) -> Result<Generation> {
        req.validate()?;
        let p = &model.profile;
        if prompt.is_empty() {
            return Err(Error::invalid("prompt is empty (0 tokens); give at least one token"));
        }
        model.check_ids("prompt", &prompt)?;
        let mask_id = p.mask_token_id.ok_or_else(|| {
            Error::invalid(format!(
                "this model ({}) has no mask token id; pass mask_token_id=... to Engine.load",
                p.architecture
            ))
        })?;
        let lp = prompt.len();
        let max_ctx = model.config.max_position_embeddings;
        let n = req.max_tokens.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(max_ctx.saturating_sub(lp)).max(1));
        if n > max_ctx.saturating_sub(lp) {
            return Err(Error::ContextLength(format!(
                "maximum context is {max_ctx} tokens; requested {} ({lp} prompt + {n} completion)",
                lp as u128 + n as u128
            )));
        }
        let stop_token_ids = req.stop_token_ids.clone().unwrap_or_default();
        model.check_ids("stop_token_ids", &stop_token_ids)?;
        let mut eos_ids = p.eos_token_ids.clone();
        for t in stop_token_ids {
            if !eos_ids.contains(&t) {
                eos_ids.push(t);
            }
        }
        let d = p.decode_defaults();
        let spec = resolve_speculative(req, p.attention)?;
        let sub_block_size = req.sub_block_size.or(d.sub_block_size);
        let params = DecodeParams {
            threshold: req.threshold.unwrap_or(d.threshold),
            acceptance: req.acceptance.unwrap_or(d.acceptance),
            block_add_threshold: req.block_add_threshold.unwrap_or(d.block_add_threshold),
            decoded_token_threshold: req.decoded_token_threshold.unwrap_or(d.decoded_token_threshold),
            forced_progress: req.forced_progress.unwrap_or(d.forced_progress),
            early_stop: req.early_stop.unwrap_or(true),
            max_forward_passes: req.max_forward_passes.unwrap_or(DEFAULT_MAX_FORWARD_PASSES),
            eos_ids,
            sub_block_size,
            ar_block_start: sub_block_size.is_some() && p.logits_shift,
        };
        let sampler = Sampler::new(SamplingParams {
            temperature: req.temperature.unwrap_or(0.0),
            top_k: req.top_k.unwrap_or(0),
            top_p: req.top_p.unwrap_or(1.0),
            seed: req.seed,
        });
        let b = req.block_size.unwrap_or(if p.attention == AttentionKind::Causal { 1 } else { p.block_size });
        let (grid, absolute) = match p.attention {
            AttentionKind::BlockCausal => {
                (BlockGrid::new(AttentionKind::BlockCausal, b, p.alignment, lp)?, p.alignment == Alignment::Absolute)
            }
            AttentionKind::Causal => (BlockGrid::causal(), false),
            AttentionKind::Full => (BlockGrid::new(AttentionKind::Full, b, Alignment::Prompt, lp)?, false),
        };
        let dec = Decoder::new(lp, n, block_layout(lp, n, b, absolute), params)?;
        let mut canvas = prompt;
        canvas.resize(lp + n, mask_id);
        let policy = CachePolicy::resolve(grid.kind, req)?;
        let window = Window::new(&model, grid, lp, policy);
        let trace = req.trace.unwrap_or(TraceMode::Off);
        let out = Output::new(lp, n, req.stop.clone().unwrap_or_default(), trace, req.logprobs);
        Ok(Generation { model, dec, canvas, mask_id, window, sampler, out, spec, pending: None })
    }

    /// Cancel: the next output is the final one, with finish_reason "cancelled".
    pub fn cancel(&mut self) -> StepOutput {
        self.out.cancel(&self.dec, self.counters())
    }

    fn counters(&self) -> Counters {
        Counters {
            positions_forwarded: self.window.positions_forwarded,
            prefill_ms: self.window.prefill_ms,
            speculative: self.spec.as_ref().map(|r| r.stats),
        }
    }

    /// One decoding step, on the engine's CPU pool on the CPU: the step's forwards run alone (a batch of one
    /// segment each; the first step's forwards include the prompt's prefill chunks). Returns None once the
    /// generation has finished.
    pub fn step(&mut self) -> Result<Option<StepOutput>> {
        let model = self.model.clone();
        crate::cpu_pool::on_device_pool(model.net.device(), || loop {
            let logits = match self.prepare()? {
                Next::Forward(seg) => model.net.forward_segments(&mut [seg])?.pop().expect("one segment"),
                Next::Output(o) => return Ok(Some(o)),
                Next::Finished => return Ok(None),
            };
            if let Some(o) = self.consume(logits)? {
                return Ok(Some(o));
            }
        })
    }

    /// The generation's next forward as a segment (plan a step first when none is under way), or its output
    /// when it needs no forward (decoding has stopped), or `Finished`. A scheduler runs the segments of many
    /// generations in one forward (`QwenModel::forward_segments`) and hands each its logits (`consume`).
    pub fn prepare(&mut self) -> Result<Next<'_>> {
        if self.out.finished() {
            return Ok(Next::Finished);
        }
        if !self.window.in_step() {
            // plan
            let Some(positions) = self.dec.plan() else {
                let usage = self.counters();
                return self.out.emit(&self.model, &self.dec, true, false, usage).map(Next::Output);
            };
            // the model reads the decoder's current canvas
            let lp = self.dec.prompt_len;
            for i in 0..self.dec.n {
                self.canvas[lp + i] = if self.dec.decoded[i] { self.dec.tokens[i] } else { self.mask_id };
            }
            self.window.begin_step(&self.dec, positions)?;
        }
        Ok(Next::Forward(self.window.segment(&self.canvas)?))
    }

    /// The logits of the segment `prepare` gave. Returns the step's output once its last forward has run
    /// (predict → apply → emit), None while forwards remain.
    pub fn consume(&mut self, logits: Tensor) -> Result<Option<StepOutput>> {
        let Some((positions, logits)) = self.window.consume(logits)? else { return Ok(None) };
        if let Some(d) = self.pending.take() {
            self.verified(d, &logits)?;
        } else {
            // predict
            let preds = self.sampler.predict(&logits)?;
            if self.verify_span(&positions, &preds, &logits)? {
                return Ok(None);
            }
            // apply
            self.dec.apply(&positions, &preds)?;
        }
        // the written tokens' log-probabilities under this step's logits (the verifier's, for a verified step)
        self.out.record_logprobs(&self.dec, &positions, &logits)?;
        // emit
        let is_final = self.dec.stopped == Some(StopCause::ForwardCap) || self.dec.masks_left() == 0;
        let usage = self.counters();
        self.out.emit(&self.model, &self.dec, is_final, true, usage).map(Some)
    }

    /// S2D2: whether to verify this draft's span (the routing policy, within the forward cap); if so, queue
    /// the verification and hold the draft.
    fn verify_span(&mut self, positions: &[usize], preds: &[Prediction], logits: &Tensor) -> Result<bool> {
        let Some(router) = self.spec.as_mut() else { return Ok(false) };
        if self.dec.ar_step() || self.dec.forward_passes + 2 > self.dec.params.max_forward_passes {
            return Ok(false);
        }
        let span = self.dec.span_len(positions);
        let confident = self.dec.confident_in_first_block(positions, preds);
        if !router.decide(&preds[..span], confident, logits.dim(1)?) {
            return Ok(false);
        }
        let drafts: Vec<u32> = preds[..span].iter().map(|p| p.token).collect();
        self.window.begin_verify(&self.canvas, (positions[0], positions[0] + span), &drafts)?;
        let rows = (self.sampler.params().temperature > 0.0).then(|| logits.narrow(0, 0, span)).transpose()?;
        self.pending = Some(Drafted { start: positions[0], preds: preds[..span].to_vec(), rows });
        Ok(true)
    }

    /// S2D2: accept drafts by the verifier's logits `q` (one row per span position), commit the verified K/V
    /// and write the step's tokens (two forwards).
    fn verified(&mut self, d: Drafted, q: &Tensor) -> Result<()> {
        let router = self.spec.as_mut().ok_or_else(|| Error::Internal("verification without S2D2".into()))?;
        let drafts: Vec<u32> = d.preds.iter().map(|p| p.token).collect();
        let (tokens, accepted) = match &d.rows {
            None => {
                let q_argmax: Vec<u32> = self.sampler.predict(q)?.iter().map(|p| p.token).collect();
                router.accept_greedy(&drafts, &q_argmax)
            }
            Some(p_rows) => {
                let (p_rows, q_rows): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                    (p_rows.to_dtype(DType::F32)?.to_vec2()?, q.to_dtype(DType::F32)?.to_vec2()?);
                if q_rows.iter().flatten().any(|x| x.is_nan()) {
                    return Err(Error::load("the model computed non-finite logits (NaN) in a verification"));
                }
                let sp = self.sampler.params().clone();
                let probs: Vec<f64> = d.preds.iter().map(|p| p.prob).collect();
                router.accept_sampled(
                    &mut self.sampler,
                    &drafts,
                    &probs,
                    |i| sp.dist(&p_rows[i]),
                    |i| sp.dist(&q_rows[i]),
                )
            }
        };
        let s = d.start;
        self.window.commit_verified(s + accepted)?;
        let decided: Vec<(usize, u32)> = tokens.into_iter().enumerate().map(|(i, t)| (s + i, t)).collect();
        self.dec.write(&decided, 2)
    }

    /// Whether the generation has emitted its final output.
    pub fn finished(&self) -> bool {
        self.out.finished()
    }
}

/// S2D2's routing parameters of a request (None: no speculation). The verify_* parameters need
/// speculative="s2d2", and verification needs block-causal or causal attention.
fn resolve_speculative(req: &GenRequest, attention: AttentionKind) -> Result<Option<Router>> {
    let set = req.given(&[
        "verify_policy",
        "verify_min_span",
        "verify_score_threshold",
        "verify_penalty",
        "verify_penalty_kind",
        "verify_hysteresis",
    ]);
    if req.speculative.unwrap_or(Speculative::Off) == Speculative::Off {
        if !set.is_empty() {
            let verb = if set.len() == 1 { "applies" } else { "apply" };
            return Err(Error::invalid(format!("{} only {verb} with speculative='s2d2'", set.join(", "))));
        }
        return Ok(None);
    }
    if attention == AttentionKind::Full {
        return Err(Error::invalid(
            "speculative='s2d2' verifies at block size 1, which needs block-causal or causal attention; this \
             model uses full attention",
        ));
    }
    let hysteresis = match &req.verify_hysteresis {
        Some(v) => SpecParams::hysteresis_pair(v)?,
        None => SpecParams::DEFAULT_HYSTERESIS,
    };
    Ok(Some(Router::new(SpecParams {
        policy: req.verify_policy.unwrap_or(SpecParams::DEFAULT_POLICY),
        min_span: req.verify_min_span.unwrap_or(SpecParams::DEFAULT_MIN_SPAN),
        score_threshold: req.verify_score_threshold.unwrap_or(SpecParams::DEFAULT_SCORE_THRESHOLD),
        penalty: req.verify_penalty.unwrap_or(SpecParams::DEFAULT_PENALTY),
        penalty_kind: req.verify_penalty_kind.unwrap_or(crate::speculative::PenaltyKind::Static),
        hysteresis,
    })))
}

/// What a generation needs next (`Generation::prepare`).
pub enum Next<'a> {
    /// Run this segment and pass its logits to `consume`.
    Forward(Segment<'a>),
    /// An output that needed no forward (the final one, when decoding stopped).
    Output(StepOutput),
    /// Nothing more.
    Finished,
}

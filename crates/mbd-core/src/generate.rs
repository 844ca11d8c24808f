//! One generation, step by step: plan (the decoder says which positions to predict) → window (the cache
//! policy says what to forward and keep) → forward → predict (sampling) → apply (the decoder accepts and
//! writes tokens) → emit (the stable prefix becomes completion text).

use crate::decoder::{block_layout, DecodeParams, Decoder, StopCause};
use crate::engine::Model;
use crate::error::{Error, Result};
use crate::mask::{Alignment, AttentionKind, BlockGrid};
use crate::models::qwen::Segment;
use crate::output::Output;
pub use crate::output::{FinishReason, StepEvent, StepOutput, Usage};
use crate::request::{GenRequest, Params, TraceMode};
use crate::sampling::{Sampler, SamplingParams};
use crate::window::Window;
use candle_core::Tensor;
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
        let params = DecodeParams {
            threshold: req.threshold.unwrap_or(d.threshold),
            acceptance: req.acceptance.unwrap_or(d.acceptance),
            block_add_threshold: req.block_add_threshold.unwrap_or(d.block_add_threshold),
            decoded_token_threshold: req.decoded_token_threshold.unwrap_or(d.decoded_token_threshold),
            forced_progress: req.forced_progress.unwrap_or(d.forced_progress),
            early_stop: req.early_stop.unwrap_or(true),
            max_forward_passes: req.max_forward_passes.unwrap_or(DEFAULT_MAX_FORWARD_PASSES),
            eos_ids,
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
        let window = Window::new(&model, grid, lp, req.use_cache.unwrap_or(true));
        let out = Output::new(lp, req.stop.clone().unwrap_or_default(), req.trace.unwrap_or(TraceMode::Off));
        Ok(Generation { model, dec, canvas, mask_id, window, sampler, out })
    }

    /// Cancel: the next output is the final one, with finish_reason "cancelled".
    pub fn cancel(&mut self) -> StepOutput {
        self.out.cancel(&self.dec, self.window_usage())
    }

    fn window_usage(&self) -> (usize, f64) {
        (self.window.positions_forwarded, self.window.prefill_ms)
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
                let usage = self.window_usage();
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
        // predict
        let preds = self.sampler.predict(&logits)?;
        // apply
        self.dec.apply(&positions, &preds)?;
        // emit
        let is_final = self.dec.stopped == Some(StopCause::ForwardCap) || self.dec.masks_left() == 0;
        let usage = self.window_usage();
        self.out.emit(&self.model, &self.dec, is_final, true, usage).map(Some)
    }

    /// Whether the generation has emitted its final output.
    pub fn finished(&self) -> bool {
        self.out.finished()
    }
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

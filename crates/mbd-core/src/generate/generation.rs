//! One generation, step by step: plan (the decoder says which positions to predict) → window (the cache
//! policy says what to forward and keep) → forward → predict (sampling) → [S2D2: verify the span's drafts with
//! a second forward] → apply (the decoder accepts and writes tokens) → emit (the stable prefix becomes
//! completion text). With ISD (speculative="isd") a step is one causal forward over the pending token, the
//! drafts and masks ([`decode::strided`](crate::decode::strided)), which writes the accepted drafts and one more token.

use crate::decode::credit::Credit;
use crate::decode::decoder::{Decoder, Prediction, StopCause};
use crate::decode::grammar::constraint::{Constraint, CHAIN};
use crate::decode::penalties::Penalties;
use crate::decode::sampling::Sampler;
use crate::decode::speculative::{accept_greedy, accept_sampled, Router};
use crate::decode::strided::Strided;
use crate::error::{Error, Result};
use crate::generate::output::{Counters, Output};
pub use crate::generate::output::{FinishReason, StepEvent, StepOutput, Usage};
use crate::generate::plan::{plan, Tccf};
use crate::generate::prefix::PrefixCache;
use crate::generate::window::Window;
use crate::model::Model;
use crate::net::segment::{Logits, Segment};
use crate::params::request::GenRequest;
use candle_core::{DType, Tensor};
use std::sync::Arc;

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
    /// ISD's drafts and counters (speculative="isd").
    isd: Option<Strided>,
    /// CreditDecoding's credit (acceptance="credit").
    credit: Option<Credit>,
    /// TCCF's switch, until it has happened (tccf=True).
    tccf: Option<Tccf>,
    /// The grammar the output keeps to (`response_format`, `grammar`, `regex`).
    constraint: Option<Constraint>,
    /// The logits controls (penalties, logit_bias), applied to a step's rows before its predictions.
    penalties: Option<Penalties>,
    /// The committed K/V went to the prefix cache: done with the final output, before it is sent, so a caller that
    /// has the output finds the cache holding it (and a `clear` after it is not undone).
    offered: bool,
    /// The prompt's K/V went to the prefix cache after the first step (so that a request arriving while this one
    /// decodes finds it).
    prompt_offered: bool,
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
    /// A generation of `prompt` under `req`, as planned ([`plan::plan`](crate::generate::plan::plan): every default and
    /// rule resolved): the decoder, the cache/window policy, the sampler and the output set up.
    pub fn new(model: Arc<Model>, prompt: Vec<u32>, req: &GenRequest) -> Result<Generation> {
        Generation::with_prefix(model, prompt, req, None)
    }

    /// `new`, starting from (and offering its K/V to, when it ends) `prefix`, the engine's prefix cache, where that
    /// is exact ([`Window::new`]); the request's `cache_salt` picks the cache's tree.
    pub fn with_prefix(
        model: Arc<Model>,
        prompt: Vec<u32>,
        req: &GenRequest,
        prefix: Option<Arc<PrefixCache>>,
    ) -> Result<Generation> {
        let plan = plan(&model, &prompt, req)?;
        let (lp, n) = (plan.prompt_len, plan.max_tokens);
        let dec = Decoder::new(lp, n, plan.blocks, plan.decode)?;
        let mut canvas = prompt;
        canvas.resize(lp + n, plan.mask_id);
        let salt = req.cache_salt.as_deref().unwrap_or("");
        let window = Window::new(&model, plan.grid, lp, plan.cache, prefix.map(|c| (c, salt)))?;
        let out = Output::new(lp, n, plan.stop, plan.trace, plan.logprobs);
        let (sampler, spec, isd) =
            (Sampler::new(plan.sampling), plan.spec.map(Router::new), plan.isd.map(Strided::new));
        let (credit, tccf) = (plan.credit.map(Credit::new), plan.tccf);
        let mut g = Generation {
            model,
            dec,
            canvas,
            mask_id: plan.mask_id,
            window,
            sampler,
            out,
            spec,
            pending: None,
            isd,
            credit,
            tccf,
            constraint: plan.constraint,
            penalties: plan.penalties,
            offered: false,
            prompt_offered: false,
        };
        // what the grammar forces before anything is predicted (a JSON object's `{`)
        g.write_forced()?;
        Ok(g)
    }

    /// Cancel: the next output is the final one, with finish_reason "cancelled".
    pub fn cancel(&mut self) -> StepOutput {
        let o = self.out.cancel(&self.dec, self.counters());
        self.offer_prefix();
        o
    }

    /// The step's output (`is_final`: decoding has stopped; `stepped`: a forward ran), and with the final one the
    /// offer to the prefix cache.
    fn emit(&mut self, is_final: bool, stepped: bool) -> Result<StepOutput> {
        let usage = self.counters();
        let o = self.out.emit(&self.model, &self.dec, is_final, stepped, usage)?;
        if self.out.finished() {
            self.offer_prefix();
        }
        Ok(o)
    }

    /// Offer the committed K/V to the prefix cache, once: the prompt, then the answer's tokens as decoded (a later
    /// turn that repeats them starts from them).
    fn offer_prefix(&mut self) {
        if std::mem::replace(&mut self.offered, true) {
            return;
        }
        let lp = self.dec.prompt_len;
        let answer = (0..self.dec.n).take_while(|&i| self.dec.decoded[i]).map(|i| self.dec.tokens[i]);
        let tokens: Vec<u32> = self.canvas[..lp].iter().copied().chain(answer).collect();
        // the cache is an optimisation: a failed copy leaves it as it was
        let _ = self.window.offer_prefix(&tokens);
    }

    /// After the first step's forward, offer the prompt's committed K/V to the prefix cache, once: concurrent
    /// requests that begin as this one does (a shared system prompt) start from it while this one still decodes.
    /// The pages are the ones the final offer would insert first (a committed block's K/V never change), so that
    /// offer then adds only the answer's.
    fn offer_prompt(&mut self) {
        if std::mem::replace(&mut self.prompt_offered, true) || self.offered {
            return;
        }
        let lp = self.dec.prompt_len;
        // the cache is an optimisation: a failed copy leaves it as it was
        let _ = self.window.offer_prefix(&self.canvas[..lp]);
    }

    fn counters(&self) -> Counters {
        Counters {
            positions_forwarded: self.window.positions_forwarded,
            prefill_ms: self.window.prefill_ms,
            cached_tokens: self.window.cached_tokens,
            head_ms: self.window.head_ms + self.sampler.stats_ms(),
            speculative: self.spec.as_ref().map(|r| r.stats).or(self.isd.as_ref().map(|s| s.stats)),
        }
    }

    /// One decoding step, on the engine's CPU pool on the CPU: the step's forwards run alone (a batch of one
    /// segment each; the first step's forwards include the prompt's prefill chunks). Returns None once the
    /// generation has finished.
    pub fn step(&mut self) -> Result<Option<StepOutput>> {
        let model = self.model.clone();
        crate::cpu_pool::on_device_pool(model.device(), || loop {
            let logits = match self.prepare()? {
                Next::Forward(seg) => model.forward_segments(&mut [seg])?.pop().expect("one segment"),
                Next::Output(o) => return Ok(Some(o)),
                Next::Finished => return Ok(None),
            };
            if let Some(o) = self.consume(logits)? {
                return Ok(Some(o));
            }
        })
    }

    /// The generation's next forward as a segment (plan a step first when none is under way), or its output when it
    /// needs no forward (decoding has stopped), or `Finished`. A scheduler runs the segments of many generations in one
    /// forward ([`Model::forward_segments`](crate::model::Model::forward_segments)) and hands each its logits
    /// (`consume`).
    pub fn prepare(&mut self) -> Result<Next<'_>> {
        self.prepare_within(None)
    }

    /// `prepare`, with a long prompt or recompute chunk cut to `limit` = (budget rows, key equivalent): see
    /// [`Window::limit_next`] (the scheduler's fairness beside other streams).
    pub fn prepare_within(&mut self, limit: Option<(usize, usize)>) -> Result<Next<'_>> {
        if self.out.finished() {
            return Ok(Next::Finished);
        }
        if !self.window.in_step() {
            // plan
            let Some(positions) = self.dec.plan() else {
                return self.emit(true, false).map(Next::Output);
            };
            // the model reads the decoder's current canvas
            let lp = self.dec.prompt_len;
            for i in 0..self.dec.n {
                self.canvas[lp + i] = if self.dec.decoded[i] { self.dec.tokens[i] } else { self.mask_id };
            }
            match &mut self.isd {
                Some(isd) => {
                    let f = self.window.pending();
                    // the tokens a grammar forced after the pending one, forwarded ahead of the drafts
                    let end = self.dec.canvas_end();
                    let given: Vec<u32> =
                        (f + 1..end).take_while(|&p| self.dec.is_decoded(p)).map(|p| self.canvas[p]).collect();
                    let ids = isd.layout(end - f - 1, self.mask_id, &given);
                    self.window.begin_strided(&self.canvas, &ids)?;
                }
                None => self.window.begin_step(&self.dec, &self.canvas, positions)?,
            }
        }
        // a window with no use for a forward (its one position predicted by the carry row) ends the step here
        if let Some((positions, logits)) = self.window.take_free()? {
            if let Some(o) = self.stepped(&positions, &logits)? {
                return Ok(Next::Output(o));
            }
        }
        if let Some((budget, key_equivalent)) = limit {
            self.window.limit_next(budget, key_equivalent);
        }
        Ok(Next::Forward(self.window.segment(&self.canvas)?))
    }

    /// The logits of the segment `prepare` gave. Returns the step's output once its last forward has run
    /// (predict → apply → emit), None while forwards remain.
    pub fn consume(&mut self, logits: Logits) -> Result<Option<StepOutput>> {
        let Some((positions, logits)) = self.window.consume(logits)? else { return Ok(None) };
        self.stepped(&positions, &logits)
    }

    /// The step's logits for its positions, its forwards done: predict → apply → emit (None when S2D2 queued a
    /// verification).
    fn stepped(&mut self, positions: &[usize], logits: &Tensor) -> Result<Option<StepOutput>> {
        self.offer_prompt();
        if self.isd.is_some() {
            return self.strided(positions, logits).map(Some);
        }
        if let Some(d) = self.pending.take() {
            self.verified(d, logits)?;
        } else {
            // predict (after the logits controls; CreditDecoding: from the logits fused with the credit)
            let controlled = self.controlled(logits)?;
            let base = controlled.as_ref().unwrap_or(logits);
            let fused = match &mut self.credit {
                Some(c) => Some(c.fuse(&self.dec, positions, base)?),
                None => None,
            };
            let rows = fused.as_ref().unwrap_or(base);
            let mut preds = self.sampler.predict(rows)?;
            // under a grammar the chain from the frontier is predicted again, from the grammar's distribution
            let chain = self.predict_chain(positions, &mut preds, rows)?;
            if self.verify_span(positions, &preds, rows, chain)? {
                return Ok(None);
            }
            // apply
            match self.constraint.is_some() {
                false => self.dec.apply(positions, &preds)?,
                true => self.apply_constrained(positions, &preds)?,
            }
            self.switch_phase()?;
        }
        // the written tokens' log-probabilities under this step's logits (the verifier's, for a verified step)
        self.out.record_logprobs(&self.dec, positions, logits)?;
        // emit
        let is_final = self.dec.stopped == Some(StopCause::ForwardCap) || self.dec.masks_left() == 0;
        self.emit(is_final, true).map(Some)
    }

    /// The step's logits rows after the logits controls ([`decode::penalties`](crate::decode::penalties)), None
    /// without any: "already generated" is the completion committed before this step, up to its first end of text.
    fn controlled(&self, logits: &Tensor) -> Result<Option<Tensor>> {
        let Some(p) = &self.penalties else { return Ok(None) };
        let (r, v) = logits.dims2()?;
        let end = self.dec.first_eos().unwrap_or(self.dec.n);
        let generated: Vec<u32> = (0..end).filter(|&i| self.dec.decoded[i]).map(|i| self.dec.tokens[i]).collect();
        let mut flat = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        p.apply(&mut flat, v, &generated);
        Ok(Some(Tensor::from_vec(flat, (r, v), logits.device())?))
    }

    /// Under the grammar ([`decode::grammar::constraint`](crate::decode::grammar::constraint)): the chain (the
    /// predicted positions contiguous from the frontier, at most [`CHAIN`]) predicted again, each from the grammar's
    /// distribution given the predictions before it (stopping after an end of text). Returns the chain's length when
    /// it starts at the step's first position (S2D2 verifies no further), `Some(0)` when it does not, None without a
    /// grammar.
    fn predict_chain(&mut self, positions: &[usize], preds: &mut [Prediction], rows: &Tensor) -> Result<Option<usize>> {
        let Some(c) = self.constraint.as_mut() else { return Ok(None) };
        let front = self.dec.prompt_len + c.frontier();
        let Some(i0) = positions.iter().position(|&p| p == front) else { return Ok(Some(0)) };
        let (mut walked, mut len) = (0, 0);
        for (k, i) in (i0..positions.len()).enumerate() {
            if k == CHAIN || positions[i] != front + k {
                break;
            }
            // a position the grammar forces is certain: its token (constrained AR writes it without a forward)
            let here = c.here()?;
            preds[i] = match here.1 {
                Some(token) => Prediction::certain(token),
                None => {
                    let row = rows.get(i)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    self.sampler.predict_among(&row, &here)?
                }
            };
            len += 1;
            if !c.advance(preds[i].token)? {
                break;
            }
            walked += 1;
        }
        c.retreat(walked)?;
        Ok(Some(if i0 == 0 { len } else { 0 }))
    }

    /// A step under the grammar, its chain predicted ([`Generation::predict_chain`]): the accepted run from the
    /// frontier as far as the grammar takes it (the frontier forced when the rule took nothing there), committed;
    /// then the tokens the grammar forces next.
    fn apply_constrained(&mut self, positions: &[usize], preds: &[Prediction]) -> Result<()> {
        let c =
            self.constraint.as_mut().ok_or_else(|| Error::Internal("a constrained step without a grammar".into()))?;
        let front = self.dec.prompt_len + c.frontier();
        let at_frontier = positions.iter().position(|&p| p == front).map(|i| preds[i].token);
        self.dec.apply_with(positions, preds, |decided| c.keep(front, decided, at_frontier))?;
        self.commit_written()
    }

    /// Commit the tokens the decoder wrote this step to the grammar, then write the tokens it forces next.
    fn commit_written(&mut self) -> Result<()> {
        let Some(c) = self.constraint.as_mut() else { return Ok(()) };
        let written: Vec<u32> =
            self.dec.last_decoded.iter().map(|&p| self.dec.tokens[p - self.dec.prompt_len]).collect();
        c.commit(&written)?;
        self.write_forced()
    }

    /// Write the tokens the grammar forces at the frontier (as far as the output has room), without a forward.
    fn write_forced(&mut self) -> Result<()> {
        let Some(c) = self.constraint.as_mut() else { return Ok(()) };
        loop {
            let forced = c.forced();
            c.check()?;
            let room = self.dec.n - c.frontier();
            if forced.is_empty() || room == 0 {
                return Ok(());
            }
            let take = &forced[..forced.len().min(room)];
            let front = self.dec.prompt_len + c.frontier();
            let given: Vec<(usize, u32)> = take.iter().enumerate().map(|(i, &t)| (front + i, t)).collect();
            self.dec.force(&given)?;
            c.commit(take)?;
            if take.len() < forced.len() {
                return Ok(());
            }
        }
    }

    /// TCCF: once every position up to the first decoded trigger is decoded, thinking ends there: the check text
    /// follows it, and from the trigger's block origin on blocks (of the decoder and of the attention grid) are of
    /// the answer's size (the K/V committed before it stay).
    fn switch_phase(&mut self) -> Result<()> {
        let Some(tc) = &self.tccf else { return Ok(()) };
        let Some(e) = self.dec.first_eos() else { return Ok(()) };
        if self.dec.tokens[e] != tc.trigger || self.dec.stable_len() <= e || self.dec.stopped.is_some() {
            return Ok(());
        }
        let at = self.dec.switch(self.dec.prompt_len + e, &tc.check, tc.answer_block, tc.trigger)?;
        self.window.switch_grid(at, tc.answer_block)?;
        self.tccf = None;
        Ok(())
    }

    /// ISD: accept the step's drafts by the rows of the pending token and the drafts, write them and the next
    /// token, keep their K/V and the next drafts ([`Strided::step`]), then emit.
    fn strided(&mut self, positions: &[usize], logits: &Tensor) -> Result<StepOutput> {
        let isd = self.isd.as_mut().ok_or_else(|| Error::Internal("an ISD step without ISD".into()))?;
        // after the pending token at f: the given tokens (a grammar's, written already), then the step's
        let (f, k) = (positions[0], isd.given());
        let (tokens, accepted) = isd.step(&mut self.sampler, logits, self.constraint.as_mut())?;
        self.window.commit_strided(1 + k + accepted)?;
        let decided: Vec<(usize, u32)> = tokens.iter().enumerate().map(|(i, &t)| (f + 1 + k + i, t)).collect();
        self.dec.write(&decided, 1)?;
        // the row of position f + i predicts f + i + 1: the verifier's log-probabilities
        let n = decided.len();
        let written: Vec<usize> = (f + 1 + k..=f + k + n).collect();
        self.out.record_logprobs(&self.dec, &written, &logits.narrow(0, k, n)?)?;
        // the grammar took the step's tokens (ISD's verification commits them): what it forces next is written
        self.write_forced()?;
        let is_final = self.dec.stopped == Some(StopCause::ForwardCap) || self.dec.masks_left() == 0;
        self.emit(is_final, true)
    }

    /// S2D2: whether to verify this draft's span (the routing policy, within the forward cap); if so, queue
    /// the verification and hold the draft.
    /// Under a grammar (`chain`: the length of the chain its distribution predicted) the span is at most the chain.
    fn verify_span(
        &mut self,
        positions: &[usize],
        preds: &[Prediction],
        logits: &Tensor,
        chain: Option<usize>,
    ) -> Result<bool> {
        let Some(router) = self.spec.as_mut() else { return Ok(false) };
        if self.dec.ar_step() || self.dec.forward_passes + 2 > self.dec.params.max_forward_passes {
            return Ok(false);
        }
        let span = self.dec.span_len(positions).min(chain.unwrap_or(usize::MAX));
        if span == 0 {
            return Ok(false);
        }
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
        // under a grammar the drafts are its chain (each drawn among the tokens it allows after those before it):
        // both distributions are read under the same masks
        // (a position it forces is a point mass on its token in both)
        let along = self.constraint.as_mut().map(|c| c.along(&drafts)).transpose()?;
        if along.as_ref().is_some_and(|a| a.len() < drafts.len()) {
            return Err(Error::Internal("S2D2 drafts outside the grammar's chain".into()));
        }
        let (tokens, accepted) = match &d.rows {
            None => {
                let q_argmax: Vec<u32> = match &along {
                    None => self.sampler.predict(q)?.iter().map(|p| p.token).collect(),
                    Some(a) => {
                        let q_rows: Vec<Vec<f32>> = q.to_dtype(DType::F32)?.to_vec2()?;
                        let mut best = Vec::with_capacity(q_rows.len());
                        for (row, here) in q_rows.iter().zip(a) {
                            best.push(self.sampler.predict_among(row, here)?.token);
                        }
                        best
                    }
                };
                accept_greedy(&drafts, &q_argmax)
            }
            Some(p_rows) => {
                let (p_rows, q_rows): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                    (p_rows.to_dtype(DType::F32)?.to_vec2()?, q.to_dtype(DType::F32)?.to_vec2()?);
                if q_rows.iter().flatten().any(|x| x.is_nan()) {
                    return Err(Error::load("the model computed non-finite logits (NaN) in a verification"));
                }
                let sp = self.sampler.params().clone();
                let probs: Vec<f64> = d.preds.iter().map(|p| p.prob).collect();
                let dist = |row: &[f32], i: usize| match &along {
                    Some(a) => sp.dist_among(row, &a[i]),
                    None => sp.dist(row),
                };
                let (p_dist, q_dist) = (|i: usize| dist(&p_rows[i], i), |i: usize| dist(&q_rows[i], i));
                accept_sampled(&mut self.sampler, &drafts, &probs, p_dist, q_dist)
            }
        };
        router.stats.count(drafts.len(), accepted);
        let s = d.start;
        self.window.commit_verified(s + accepted)?;
        let decided: Vec<(usize, u32)> = tokens.into_iter().enumerate().map(|(i, t)| (s + i, t)).collect();
        self.dec.write(&decided, 2)?;
        self.commit_written()
    }

    /// How far the prompt's forwards have come: (positions done, the prompt's length).
    pub fn prompt_progress(&self) -> (usize, usize) {
        self.window.prompt_progress()
    }

    /// Whether the generation has emitted its final output.
    pub fn finished(&self) -> bool {
        self.out.finished()
    }
}

impl Drop for Generation {
    /// A generation dropped before its final output (a closed stream, an error) still offers its committed K/V.
    fn drop(&mut self) {
        self.offer_prefix();
    }
}

/// What a generation needs next ([`Generation::prepare`]). One is made per step and matched at once, so the
/// output is not boxed.
#[allow(clippy::large_enum_variant)]
pub enum Next<'a> {
    /// Run this segment and pass its logits to `consume`.
    Forward(Segment<'a>),
    /// An output that needed no forward (the final one, when decoding stopped).
    Output(StepOutput),
    /// Nothing more.
    Finished,
}

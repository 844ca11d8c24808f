//! The multi-block decoding state machine (D2F / d3LLM / Open-dLLM), as pure logic: no tensors.
//!
//! Canvas = prompt (Lp) ++ N masked positions, split into generation blocks. Each iteration:
//!   1. EOS fill (early_stop): after the first decoded EOS e, every position becomes that EOS.
//!   2. stop when no masks remain;
//!   3. block k >= 2 becomes fully active once progress(k-1) >= beta;
//!   4. add at most one block when progress(last) >= alpha (or last complete) and no EOS fill happened;
//!   5. one forward pass (done by the caller between `plan` and `apply`);
//!   6. (with 7) accept predictions by the acceptance policy;
//!   8. forced progress in fully-active blocks that accepted nothing;
//!   9. write accepted tokens; stop at the forward-pass cap.

use crate::error::{Error, Result};
use crate::util::by_score_then_index;

crate::util::string_enum! {
    /// Which predictions a step accepts.
    pub enum Acceptance ("acceptance") {
        /// accept H < tau
        Entropy = "entropy",
        /// accept max-probability > tau
        Confidence = "confidence",
        /// EB-sampler per block: sort by H ascending, accept the i-th while the sum of the earlier ones <= gamma
        Eb = "eb",
        /// TDAR's bounded adaptive confidence (BACD): per block, accept confidence >= tau, tau = the block's first
        /// step's max confidence, then the mean confidence of its accepted tokens, clipped to the bounds
        Bacd = "bacd",
        /// dInfer's CreditDecoding: per block, confidence >= min(tau, the best one - 1e-5), over logits fused with
        /// each position's decaying credit
        Credit = "credit",
        /// DUS, dilated unmasking: per block, the next level of a dilated schedule (strides B/2, B/4, .., 1),
        /// whatever the confidence
        Dus = "dus",
    }
}

crate::util::string_enum! {
    /// Which fully active blocks must decode at least one token per step.
    pub enum ForcedProgress ("forced_progress") {
        /// only the lowest fully-active block with masks (d3LLM)
        First = "first",
        /// every fully-active block with masks (D2F)
        Every = "every",
    }
}

#[derive(Debug, Clone)]
pub struct DecodeParams {
    pub threshold: f64,
    pub acceptance: Acceptance,
    /// alpha: add a block when the last one is at least this decoded
    pub block_add_threshold: f64,
    /// beta: a block becomes fully active when its predecessor is at least this decoded
    pub decoded_token_threshold: f64,
    pub forced_progress: ForcedProgress,
    pub early_stop: bool,
    pub max_forward_passes: usize,
    /// EOS ids for the EOS fill (the profile's plus any stop token ids)
    pub eos_ids: Vec<u32>,
    /// Fast-dLLM v2 sub-blocks: each step predicts only the first sub-block (of this size, aligned to the
    /// block's grid start) with masks in every created block. None: whole blocks.
    pub sub_block_size: Option<usize>,
    /// Fast-dLLM v2's block start: when the first position to predict starts a grid block and its predecessor
    /// is decoded, the step decodes that one position from the previous block's last logit (shifted models).
    pub ar_block_start: bool,
    /// BACD's bounds on tau (lower, upper), lower <= upper.
    pub bacd_bounds: (f64, f64),
}

/// BACD's default bounds (TDAR's `confidence_lower_threshold`, `confidence_upper_threshold`).
pub const DEFAULT_BACD_BOUNDS: (f64, f64) = (0.6, 0.9);

/// DUS's schedule of a block of `b` positions (offsets from its grid origin), as the DUS authors' code builds it:
/// strides b/2, b/4, .., 1; each level takes the offsets divisible by the stride not taken yet; a last level
/// smaller than the one before joins it.
pub fn dus_levels(b: usize) -> Vec<Vec<usize>> {
    let mut levels: Vec<Vec<usize>> = vec![];
    let mut taken = vec![false; b];
    let mut stride = b / 2;
    while stride >= 1 {
        let level: Vec<usize> = (0..b).filter(|&o| o % stride == 0 && !taken[o]).collect();
        for &o in &level {
            taken[o] = true;
        }
        if !level.is_empty() {
            levels.push(level);
        }
        stride /= 2;
    }
    let rest: Vec<usize> = (0..b).filter(|&o| !taken[o]).collect();
    if !rest.is_empty() {
        levels.push(rest);
    }
    if levels.len() >= 2 && levels[levels.len() - 1].len() < levels[levels.len() - 2].len() {
        let last = levels.pop().unwrap_or_default();
        let prev = levels.last_mut().expect("two levels");
        prev.extend(last);
        prev.sort_unstable();
    }
    levels
}

/// A generation block: absolute positions [start, end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Start of the grid block this block lies in (== start except for a first block holding a prompt tail).
    pub origin: usize,
    pub start: usize,
    pub end: usize,
    pub created: bool,
    pub fully_active: bool,
}

crate::util::string_enum! {
    /// The state of a block, as reported to visualisers.
    pub enum BlockState ("block state") {
        Inactive = "inactive",
        Activated = "activated",
        FullyActivated = "fully_activated",
        Completed = "completed",
    }
}

/// What the model predicted for one masked position.
#[derive(Debug, Clone, Copy)]
pub struct Prediction {
    pub token: u32,
    pub entropy: f64,
    pub max_prob: f64,
    /// Probability of `token` under the distribution it was drawn from (== max_prob when greedy).
    pub prob: f64,
}

impl Prediction {
    /// A token that is certain (a grammar forces it): probability 1, entropy 0.
    pub fn certain(token: u32) -> Prediction {
        Prediction { token, entropy: 0.0, max_prob: 1.0, prob: 1.0 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// no masks left
    Complete,
    /// the forward-pass cap was reached with masks left
    ForwardCap,
}

/// Generation block layout as (grid origin, start, end). `absolute_grid`: blocks follow floor(p / B) (the first
/// one is the rest of the prompt's last grid block); otherwise blocks of B start at the prompt's end.
pub fn block_layout(prompt_len: usize, n: usize, b: usize, absolute_grid: bool) -> Vec<(usize, usize, usize)> {
    let end = prompt_len + n;
    let mut out = Vec::new();
    let mut s = prompt_len;
    while s < end {
        let (o, e) = if absolute_grid { (s / b * b, (s / b + 1) * b) } else { (s, s + b) };
        out.push((o, s, e.min(end)));
        s = e.min(end);
    }
    out
}

pub struct Decoder {
    pub params: DecodeParams,
    pub prompt_len: usize,
    pub n: usize,
    /// Generated tokens (index i = absolute position prompt_len + i); meaningful where decoded.
    pub tokens: Vec<u32>,
    pub decoded: Vec<bool>,
    pub blocks: Vec<Block>,
    pub forward_passes: usize,
    pub eos_filled: bool,
    pub stopped: Option<StopCause>,
    /// Positions (absolute) decoded by the last `apply`.
    pub last_decoded: Vec<usize>,
    /// Positions decoded by acceptance or forced progress so far (EOS fill not counted).
    pub accepted: usize,
    /// Positions a grammar forced, written without a forward ([`Decoder::force`]).
    pub forced: usize,
    planned: bool,
    /// The planned step is Fast-dLLM v2's block-start step (its one position is accepted as predicted).
    ar_step: bool,
    /// BACD: per block, (sum, count) of the confidences of its accepted tokens.
    bacd: Vec<(f64, usize)>,
}

impl Decoder {
    pub fn new(prompt_len: usize, n: usize, layout: Vec<(usize, usize, usize)>, params: DecodeParams) -> Result<Self> {
        if n == 0 || layout.is_empty() {
            return Err(Error::Internal("the decoder needs at least one generated position".into()));
        }
        let mut blocks: Vec<Block> = layout
            .into_iter()
            .map(|(origin, start, end)| Block { origin, start, end, created: false, fully_active: false })
            .collect();
        blocks[0].created = true;
        blocks[0].fully_active = true;
        let nb = blocks.len();
        Ok(Decoder {
            params,
            prompt_len,
            n,
            tokens: vec![0; n],
            decoded: vec![false; n],
            blocks,
            forward_passes: 0,
            eos_filled: false,
            stopped: None,
            last_decoded: vec![],
            accepted: 0,
            forced: 0,
            planned: false,
            ar_step: false,
            bacd: vec![(0.0, 0); nb],
        })
    }

    pub fn is_decoded(&self, p: usize) -> bool {
        self.decoded[p - self.prompt_len]
    }

    pub fn decoded_in(&self, k: usize) -> usize {
        let b = &self.blocks[k];
        (b.start..b.end).filter(|&p| self.is_decoded(p)).count()
    }

    pub fn progress(&self, k: usize) -> f64 {
        let b = &self.blocks[k];
        self.decoded_in(k) as f64 / (b.end - b.start) as f64
    }

    pub fn is_complete(&self, k: usize) -> bool {
        let b = &self.blocks[k];
        (b.start..b.end).all(|p| self.is_decoded(p))
    }

    pub fn num_created(&self) -> usize {
        self.blocks.iter().filter(|b| b.created).count()
    }

    /// Start of the first created block with masks (the end of the last created block when there is none).
    pub fn active_start(&self) -> usize {
        (0..self.blocks.len())
            .find(|&k| self.blocks[k].created && !self.is_complete(k))
            .map_or_else(|| self.created_end(), |k| self.blocks[k].start)
    }

    /// End (exclusive, absolute) of the canvas: the prompt and every generated position.
    pub fn canvas_end(&self) -> usize {
        self.prompt_len + self.n
    }

    /// End (exclusive, absolute) of the last created block.
    pub fn created_end(&self) -> usize {
        self.blocks.iter().filter(|b| b.created).map(|b| b.end).max().unwrap_or(self.prompt_len)
    }

    pub fn block_state(&self, k: usize) -> BlockState {
        let b = &self.blocks[k];
        if self.is_complete(k) {
            BlockState::Completed
        } else if !b.created {
            BlockState::Inactive
        } else if b.fully_active {
            BlockState::FullyActivated
        } else {
            BlockState::Activated
        }
    }

    /// Number of leading generated positions that are decoded (the stable prefix).
    pub fn stable_len(&self) -> usize {
        self.decoded.iter().take_while(|&&d| d).count()
    }

    pub fn masks_left(&self) -> usize {
        self.decoded.iter().filter(|&&d| !d).count()
    }

    /// The first decoded end-of-text token (one of `eos_ids`: the model's EOS and the request's stop token ids), as
    /// an offset from the prompt's end: where the text ends.
    pub fn first_eos(&self) -> Option<usize> {
        (0..self.n).find(|&i| self.decoded[i] && self.params.eos_ids.contains(&self.tokens[i]))
    }

    /// Steps 1-4. Returns the masked positions (absolute, ascending) of created blocks that the next
    /// forward must predict, or None when decoding has stopped.
    pub fn plan(&mut self) -> Option<Vec<usize>> {
        if self.stopped.is_some() {
            return None;
        }
        // 1. EOS fill
        if self.params.early_stop {
            if let Some(e) = self.first_eos() {
                self.eos_filled = true;
                let t = self.tokens[e];
                for i in e + 1..self.n {
                    self.tokens[i] = t;
                    self.decoded[i] = true;
                }
            }
        }
        // 2. stop when nothing is masked
        if self.masks_left() == 0 {
            self.stopped = Some(StopCause::Complete);
            return None;
        }
        // 3. activation
        for k in 1..self.blocks.len() {
            if self.blocks[k].created && self.progress(k - 1) >= self.params.decoded_token_threshold {
                self.blocks[k].fully_active = true;
            }
        }
        // 4. add at most one block (with masks: blocks a grammar forced whole before they were created are added
        // on the way to it, as they hold nothing to predict)
        let created = self.num_created();
        if created < self.blocks.len() && !self.eos_filled {
            let last = created - 1;
            if self.progress(last) >= self.params.block_add_threshold || self.is_complete(last) {
                let mut k = created;
                loop {
                    let fa = self.progress(k - 1) >= self.params.decoded_token_threshold;
                    self.blocks[k].created = true;
                    self.blocks[k].fully_active = fa;
                    if !self.is_complete(k) || k + 1 == self.blocks.len() {
                        break;
                    }
                    k += 1;
                }
            }
        }
        self.planned = true;
        let mut c = self.candidates();
        // Fast-dLLM v2: a block's first token comes from the previous block's last logit, alone
        let first = c[0];
        self.ar_step = self.params.ar_block_start
            && self.blocks.iter().any(|b| b.origin == first && b.start == first)
            && (first == self.prompt_len || self.is_decoded(first - 1));
        if self.ar_step {
            c.truncate(1);
        }
        Some(c)
    }

    /// Masked positions of created blocks (with sub-blocks: of each created block's first sub-block with masks).
    fn candidates(&self) -> Vec<usize> {
        let mut c = Vec::new();
        for b in self.blocks.iter().filter(|b| b.created) {
            let masked = (b.start..b.end).filter(|&p| !self.is_decoded(p));
            match self.params.sub_block_size {
                None => c.extend(masked),
                Some(s) => {
                    let mut sub = None;
                    for p in masked {
                        let k = (p - b.origin) / s;
                        if *sub.get_or_insert(k) != k {
                            break;
                        }
                        c.push(p);
                    }
                }
            }
        }
        c
    }

    /// Whether the planned step is Fast-dLLM v2's block-start step.
    pub fn ar_step(&self) -> bool {
        self.ar_step
    }

    /// How many of `positions` in the first one's block the acceptance rule takes (S2D2's dynamic penalty).
    pub fn confident_in_first_block(&self, positions: &[usize], preds: &[Prediction]) -> usize {
        let Some(&first) = positions.first() else { return 0 };
        let end = self.blocks[self.block_of(first)].end;
        let acc = self.accepted_by_rule(positions, preds);
        positions.iter().zip(acc).filter(|&(&p, a)| a && p < end).count()
    }

    /// The S2D2 span of a planned step: the number of leading `positions` (as `plan` returned them) that form
    /// the first contiguous run of masked positions, within one block.
    pub fn span_len(&self, positions: &[usize]) -> usize {
        let Some(&first) = positions.first() else { return 0 };
        let end = self.blocks[self.block_of(first)].end;
        positions.iter().enumerate().take_while(|&(i, &p)| p == first + i && p < end).count()
    }

    /// Step 7 alone: which predictions the acceptance rule takes (no forced progress), e.g. the confident
    /// positions that S2D2's dynamic penalty counts.
    pub fn accepted_by_rule(&self, positions: &[usize], preds: &[Prediction]) -> Vec<bool> {
        let tau = self.params.threshold;
        let mut accept = vec![false; positions.len()];
        match self.params.acceptance {
            Acceptance::Entropy => {
                for (i, pr) in preds.iter().enumerate() {
                    accept[i] = pr.entropy < tau;
                }
            }
            Acceptance::Confidence => {
                for (i, pr) in preds.iter().enumerate() {
                    accept[i] = pr.max_prob > tau;
                }
            }
            Acceptance::Credit => {
                // dInfer's threshold rule, per block: confidence >= min(tau, the block's best - 1e-5)
                for (_, idx) in self.groups(positions) {
                    let best = idx.iter().map(|&i| preds[i].prob).fold(f64::NEG_INFINITY, f64::max);
                    let t = tau.min(best - 1e-5);
                    for i in idx {
                        accept[i] = preds[i].prob >= t;
                    }
                }
            }
            Acceptance::Bacd => {
                let (lo, hi) = self.params.bacd_bounds;
                for (k, idx) in self.groups(positions) {
                    let t = match self.bacd[k] {
                        (_, 0) => idx.iter().map(|&i| preds[i].prob).fold(f64::NEG_INFINITY, f64::max),
                        (sum, n) => sum / n as f64,
                    }
                    .clamp(lo, hi);
                    for i in idx {
                        accept[i] = preds[i].prob >= t;
                    }
                }
            }
            Acceptance::Dus => {
                for (k, idx) in self.groups(positions) {
                    let b = &self.blocks[k];
                    // the first level with a position to predict: all of its positions to predict
                    for level in dus_levels(b.end - b.origin) {
                        let hit: Vec<usize> =
                            idx.iter().copied().filter(|&i| level.contains(&(positions[i] - b.origin))).collect();
                        if !hit.is_empty() {
                            hit.into_iter().for_each(|i| accept[i] = true);
                            break;
                        }
                    }
                }
            }
            Acceptance::Eb => {
                for (_, idx) in self.groups(positions) {
                    let mut order = idx.clone();
                    order.sort_by(|&a, &b| by_score_then_index(preds[a].entropy, preds[b].entropy, a, b));
                    let mut sum = 0.0;
                    for &i in &order {
                        if sum <= tau {
                            accept[i] = true;
                            sum += preds[i].entropy;
                        } else {
                            break;
                        }
                    }
                }
            }
        }
        accept
    }

    /// Index of the generation block holding generated position `p` (blocks tile [prompt_len, prompt_len + n)).
    pub fn block_of(&self, p: usize) -> usize {
        self.blocks.partition_point(|b| b.end <= p)
    }

    /// Candidate indices grouped by block, in order: (block, indices into `positions`).
    fn groups(&self, positions: &[usize]) -> Vec<(usize, Vec<usize>)> {
        let mut g: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, &p) in positions.iter().enumerate() {
            let k = self.block_of(p);
            match g.last_mut() {
                Some((kk, v)) if *kk == k => v.push(i),
                _ => g.push((k, vec![i])),
            }
        }
        g
    }

    /// Steps 7-8: the acceptance rule, then forced progress in fully active blocks that accepted nothing: the
    /// most confident position by the rule's own score (lowest entropy; highest probability for `confidence`, of
    /// the drawn token for `bacd` and `credit`), ties to the lowest position. A block-start step (`ar_block_start`)
    /// accepts its one position.
    fn decide(&self, positions: &[usize], preds: &[Prediction]) -> Vec<bool> {
        if self.ar_step {
            return vec![true; positions.len()];
        }
        let mut accept = self.accepted_by_rule(positions, preds);
        let conf = |p: &Prediction| match self.params.acceptance {
            Acceptance::Confidence => Some(p.max_prob),
            Acceptance::Bacd | Acceptance::Credit => Some(p.prob),
            Acceptance::Entropy | Acceptance::Eb | Acceptance::Dus => None,
        };
        let mut forced_done = false;
        for (k, idx) in self.groups(positions) {
            if !self.blocks[k].fully_active {
                continue;
            }
            if self.params.forced_progress == ForcedProgress::First && forced_done {
                break;
            }
            forced_done = true;
            if !idx.iter().any(|&i| accept[i]) {
                let best = idx
                    .iter()
                    .copied()
                    .min_by(|&a, &b| match (conf(&preds[a]), conf(&preds[b])) {
                        (Some(ca), Some(cb)) => by_score_then_index(-ca, -cb, a, b),
                        _ => by_score_then_index(preds[a].entropy, preds[b].entropy, a, b),
                    })
                    .unwrap();
                accept[best] = true;
            }
        }
        accept
    }

    /// Steps 6-9, given one prediction per position returned by `plan` (same order).
    pub fn apply(&mut self, positions: &[usize], preds: &[Prediction]) -> Result<()> {
        self.apply_with(positions, preds, |decided| Ok(decided.to_vec()))
    }

    /// [`Decoder::apply`] with a phase between acceptance and writing (a grammar's,
    /// [`crate::decode::grammar::constraint::Constraint::keep`]): `keep` gets the accepted positions (absolute, ascending) with
    /// their tokens and returns those to write, each one a position the step predicted.
    pub fn apply_with(
        &mut self,
        positions: &[usize],
        preds: &[Prediction],
        keep: impl FnOnce(&[(usize, u32)]) -> Result<Vec<(usize, u32)>>,
    ) -> Result<()> {
        if positions.len() != preds.len() {
            return Err(Error::Internal(format!("{} predictions for {} positions", preds.len(), positions.len())));
        }
        let accept = self.decide(positions, preds);
        let decided: Vec<(usize, u32)> =
            positions.iter().zip(preds).zip(accept).filter(|x| x.1).map(|((&p, pr), _)| (p, pr.token)).collect();
        let kept = keep(&decided)?;
        if self.params.acceptance == Acceptance::Bacd {
            // the block's history: the confidences of every token it accepted (forced ones too)
            for &(p, _) in &kept {
                let i = positions
                    .iter()
                    .position(|&q| q == p)
                    .ok_or_else(|| Error::Internal(format!("position {p} was not predicted")))?;
                let k = self.block_of(p);
                self.bacd[k].0 += preds[i].prob;
                self.bacd[k].1 += 1;
            }
        }
        self.write(&kept, 1)
    }

    /// Tokens that need no forward (a grammar forces them), written after a step at absolute positions as decoded:
    /// they are part of the step's output, counted in `forced` (not in `accepted`).
    pub fn force(&mut self, given: &[(usize, u32)]) -> Result<()> {
        for &(p, t) in given {
            let j = p
                .checked_sub(self.prompt_len)
                .filter(|&j| j < self.n && !self.decoded[j])
                .ok_or_else(|| Error::Internal(format!("cannot force position {p}")))?;
            self.tokens[j] = t;
            self.decoded[j] = true;
            self.last_decoded.push(p);
        }
        self.forced += given.len();
        Ok(())
    }

    /// Write the step's decided tokens (absolute position, token), taking `forwards` forward passes (a verified
    /// S2D2 step takes two: the draft and the verification).
    pub fn write(&mut self, decided: &[(usize, u32)], forwards: usize) -> Result<()> {
        if !self.planned {
            return Err(Error::Internal("Decoder::write called without plan".into()));
        }
        self.planned = false;
        self.forward_passes += forwards;
        self.last_decoded.clear();
        for &(p, t) in decided {
            let j = p - self.prompt_len;
            if self.decoded[j] {
                return Err(Error::Internal(format!("position {p} is decoded already")));
            }
            self.tokens[j] = t;
            self.decoded[j] = true;
            self.last_decoded.push(p);
        }
        self.accepted += self.last_decoded.len();
        if self.forward_passes >= self.params.max_forward_passes && self.masks_left() > 0 {
            self.stopped = Some(StopCause::ForwardCap);
        }
        Ok(())
    }

    /// TCCF's switch from thinking to answering, at the decoded trigger at absolute position `t` (every position
    /// before it decoded): the trigger and whatever follows it are dropped, `given` (the check text) is written
    /// from `t` (as much as fits), and from the grid origin of `t`'s block on the positions are laid out again in
    /// blocks of `answer_block` aligned there; those up to the first one with a mask are created. `trigger` leaves
    /// the EOS ids. Returns the grid origin of `t`'s block: the attention grid switches there.
    pub fn switch(&mut self, t: usize, given: &[u32], answer_block: usize, trigger: u32) -> Result<usize> {
        let end = self.canvas_end();
        if t < self.prompt_len || t >= end || (self.prompt_len..t).any(|p| !self.is_decoded(p)) || answer_block == 0 {
            return Err(Error::Internal(format!("cannot switch at {t}")));
        }
        let k = self.block_of(t);
        let (at, start) = (self.blocks[k].origin, self.blocks[k].start);
        let c = given.len().min(end - t);
        let answer = t + c;
        for (i, p) in (t..end).enumerate() {
            let j = p - self.prompt_len;
            self.decoded[j] = i < c;
            if i < c {
                self.tokens[j] = given[i];
            }
        }
        self.blocks.truncate(k);
        let mut s = start;
        while s < end {
            let origin = at + (s - at) / answer_block * answer_block;
            let e = (origin + answer_block).min(end);
            // created up to the block holding the first position to decode
            let created = s <= answer;
            self.blocks.push(Block { origin, start: s, end: e, created, fully_active: created });
            s = e;
        }
        self.bacd.truncate(k);
        self.bacd.resize(self.blocks.len(), (0.0, 0));
        self.params.eos_ids.retain(|&e| e != trigger);
        self.eos_filled = false;
        self.last_decoded.retain(|&p| p < t);
        Ok(at)
    }

    /// Generation blocks from the first uncommitted one whose positions are all decoded, contiguous from
    /// `from` (absolute). Returns the end of that run (== `from` when none).
    pub fn complete_run_end(&self, from: usize) -> usize {
        let mut end = from;
        for (k, b) in self.blocks.iter().enumerate() {
            if b.end <= from {
                continue;
            }
            if b.created && self.is_complete(k) {
                end = b.end;
            } else {
                break;
            }
        }
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn params(acc: Acceptance, forced: ForcedProgress, tau: f64, alpha: f64, beta: f64, eos: Vec<u32>) -> DecodeParams {
        DecodeParams {
            threshold: tau,
            acceptance: acc,
            block_add_threshold: alpha,
            decoded_token_threshold: beta,
            forced_progress: forced,
            early_stop: true,
            max_forward_passes: 10_000,
            eos_ids: eos,
            sub_block_size: None,
            ar_block_start: false,
            bacd_bounds: DEFAULT_BACD_BOUNDS,
        }
    }

    #[test]
    fn layouts() {
        assert_eq!(block_layout(5, 10, 4, true), vec![(4, 5, 8), (8, 8, 12), (12, 12, 15)]);
        assert_eq!(block_layout(8, 8, 4, true), vec![(8, 8, 12), (12, 12, 16)]);
        assert_eq!(block_layout(5, 10, 4, false), vec![(5, 5, 9), (9, 9, 13), (13, 13, 15)]);
    }

    /// Random predictions drive the state machine; invariants checked at every step.
    #[test]
    fn property_invariants_under_random_predictions() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for trial in 0..400 {
            let lp = rng.random_range(1..20);
            let n = rng.random_range(1..40);
            let b = rng.random_range(1..9);
            let abs = rng.random_bool(0.5);
            let acc = [
                Acceptance::Entropy,
                Acceptance::Confidence,
                Acceptance::Eb,
                Acceptance::Bacd,
                Acceptance::Credit,
                Acceptance::Dus,
            ][trial % 6];
            let forced = if rng.random_bool(0.5) { ForcedProgress::First } else { ForcedProgress::Every };
            let p = params(
                acc,
                forced,
                rng.random_range(0.0..1.5),
                rng.random_range(0.0..1.0),
                rng.random_range(0.0..1.0),
                vec![1],
            );
            let mut d = Decoder::new(lp, n, block_layout(lp, n, b, abs), p).unwrap();
            let mut steps = 0;
            while let Some(pos) = d.plan() {
                steps += 1;
                assert!(steps <= n, "must terminate within n forwards (one forced token per step)");
                let before: Vec<(bool, u32)> = d.decoded.iter().copied().zip(d.tokens.iter().copied()).collect();
                let fully: Vec<usize> = (0..d.blocks.len())
                    .filter(|&k| d.blocks[k].created && d.blocks[k].fully_active && !d.is_complete(k))
                    .collect();
                let preds: Vec<Prediction> = pos
                    .iter()
                    .map(|_| Prediction {
                        token: rng.random_range(0..6),
                        entropy: rng.random_range(0.0..3.0),
                        max_prob: rng.random_range(0.0..1.0),
                        prob: rng.random_range(0.0..1.0),
                    })
                    .collect();
                let eos_before = d.eos_filled;
                d.apply(&pos, &preds).unwrap();
                // never un-decodes a token, never changes a decoded one
                for (i, &(dec, tok)) in before.iter().enumerate() {
                    if dec {
                        assert!(d.decoded[i] && d.tokens[i] == tok);
                    }
                }
                // only planned positions change
                for (i, &(was, _)) in before.iter().enumerate() {
                    if !was && d.decoded[i] {
                        assert!(pos.contains(&(lp + i)));
                    }
                }
                // a fully active block with masks gains >= 1 token (the first one at least, for `first`)
                let gained = |k: usize| (d.blocks[k].start..d.blocks[k].end).any(|p| d.last_decoded.contains(&p));
                match forced {
                    ForcedProgress::Every => assert!(fully.iter().all(|&k| gained(k))),
                    ForcedProgress::First => assert!(fully.first().is_none_or(|&k| gained(k))),
                }
                // no block is created after the EOS fill
                if eos_before {
                    assert!(d.eos_filled);
                }
            }
            // EOS invariants: after the first EOS every position is that EOS
            if let Some(e) = (0..n).find(|&i| d.tokens[i] == 1 && d.decoded[i]) {
                assert!((e..n).all(|i| d.decoded[i] && d.tokens[i] == 1));
            }
            assert_eq!(d.stopped, Some(StopCause::Complete));
            assert_eq!(d.masks_left(), 0);
        }
    }

    #[test]
    fn forward_cap_stops() {
        let mut p = params(Acceptance::Entropy, ForcedProgress::First, 0.0, 0.1, 0.95, vec![]);
        p.max_forward_passes = 3;
        let mut d = Decoder::new(4, 16, block_layout(4, 16, 4, false), p).unwrap();
        while let Some(pos) = d.plan() {
            let preds: Vec<_> =
                pos.iter().map(|_| Prediction { token: 5, entropy: 1.0, max_prob: 0.5, prob: 0.5 }).collect();
            d.apply(&pos, &preds).unwrap();
        }
        assert_eq!(d.forward_passes, 3);
        assert_eq!(d.stopped, Some(StopCause::ForwardCap));
        assert_eq!(d.stable_len(), 3);
    }

    #[test]
    fn eb_accepts_by_cumulative_entropy() {
        let p = params(Acceptance::Eb, ForcedProgress::First, 0.5, 1.0, 1.0, vec![]);
        let mut d = Decoder::new(1, 4, block_layout(1, 4, 4, false), p).unwrap();
        let pos = d.plan().unwrap();
        let ent = [0.3, 0.1, 0.4, 0.05];
        let preds: Vec<_> =
            ent.iter().map(|&e| Prediction { token: 9, entropy: e, max_prob: 0.5, prob: 0.5 }).collect();
        d.apply(&pos, &preds).unwrap();
        // sorted: .05 (sum before 0), .1 (0.05), .3 (0.15), .4 (0.45 <= .5) -> all four accepted
        assert_eq!(d.last_decoded.len(), 4);
    }

    #[test]
    fn dus_levels_are_the_dilated_schedule() {
        let sizes = |b: usize| dus_levels(b).iter().map(|l| l.len()).collect::<Vec<_>>();
        assert_eq!(dus_levels(16)[..3], [vec![0, 8], vec![4, 12], vec![2, 6, 10, 14]]);
        assert_eq!(dus_levels(16)[3], (1..16).step_by(2).collect::<Vec<_>>());
        assert_eq!(dus_levels(12)[..2], [vec![0, 6], vec![3, 9]]);
        let table: [(usize, &[usize]); 11] = [
            (1, &[1]),
            (2, &[2]),
            (3, &[3]),
            (4, &[2, 2]),
            (5, &[5]),
            (6, &[2, 4]),
            (7, &[3, 4]),
            (8, &[2, 2, 4]),
            (10, &[2, 4, 4]),
            (24, &[2, 2, 4, 16]),
            (32, &[2, 2, 4, 8, 16]),
        ];
        for (b, want) in table {
            assert_eq!(sizes(b), want, "B = {b}");
            let mut all: Vec<usize> = dus_levels(b).concat();
            all.sort_unstable();
            assert_eq!(all, (0..b).collect::<Vec<_>>());
        }
    }

    #[test]
    fn dus_walks_its_levels_and_skips_prompt_offsets() {
        // absolute grid of 4 over a prompt of 5: the first block is offsets 1..3 of grid block [4, 8)
        let mut d = Decoder::new(
            5,
            7,
            block_layout(5, 7, 4, true),
            params(Acceptance::Dus, ForcedProgress::First, 0.0, 1.0, 1.0, vec![]),
        )
        .unwrap();
        let mut steps = vec![];
        while let Some(pos) = d.plan() {
            let preds: Vec<_> =
                pos.iter().map(|_| Prediction { token: 9, entropy: 9.0, max_prob: 0.01, prob: 0.01 }).collect();
            d.apply(&pos, &preds).unwrap();
            steps.push(d.last_decoded.clone());
        }
        // levels of 4: [0, 2], [1, 3]; offset 0 is the prompt's: then [8, 10], [9, 11]
        assert_eq!(steps, vec![vec![6], vec![5, 7], vec![8, 10], vec![9, 11]]);
    }

    #[test]
    fn bacd_threshold_is_the_first_max_then_the_running_mean_within_bounds() {
        let mut d = Decoder::new(
            1,
            4,
            block_layout(1, 4, 4, false),
            params(Acceptance::Bacd, ForcedProgress::First, 0.0, 1.0, 1.0, vec![]),
        )
        .unwrap();
        let step = |d: &mut Decoder, conf: &[f64]| {
            let pos = d.plan().unwrap();
            let preds: Vec<_> =
                conf.iter().map(|&c| Prediction { token: 9, entropy: 1.0, max_prob: c, prob: c }).collect();
            d.apply(&pos, &preds).unwrap();
            d.last_decoded.clone()
        };
        // first step: tau = clamp(max 0.95) = 0.9: both >= 0.9
        assert_eq!(step(&mut d, &[0.95, 0.2, 0.91, 0.5]), vec![1, 3]);
        // then tau = clamp(mean(0.95, 0.91) = 0.93) = 0.9: nothing reaches it, the most confident is forced
        assert_eq!(step(&mut d, &[0.3, 0.8]), vec![4]);
        // mean(0.95, 0.91, 0.8) = 0.887: 0.89 passes
        assert_eq!(step(&mut d, &[0.89]), vec![2]);
        // a first step under the lower bound: tau = 0.6, nothing passes, the argmax is forced
        let mut e = Decoder::new(
            1,
            2,
            block_layout(1, 2, 2, false),
            params(Acceptance::Bacd, ForcedProgress::First, 0.0, 1.0, 1.0, vec![]),
        )
        .unwrap();
        assert_eq!(step(&mut e, &[0.3, 0.5]), vec![2]);
    }

    #[test]
    fn tccf_switch_keeps_the_thinking_writes_the_check_and_lays_out_the_answer() {
        // prompt 5, 11 positions, absolute grid of 4: blocks [5, 8) (origin 4), [8, 12), [12, 16)
        let mut d = Decoder::new(
            5,
            11,
            block_layout(5, 11, 4, true),
            params(Acceptance::Entropy, ForcedProgress::First, 9.0, 0.0, 0.0, vec![0, 7]),
        )
        .unwrap();
        let pos = d.plan().unwrap();
        // everything decoded at once; the trigger 7 at 9, more thinking after it
        let toks = [1, 2, 3, 4, 7, 5, 5, 5, 5, 5, 5];
        let preds: Vec<_> =
            pos.iter().map(|&p| Prediction { token: toks[p - 5], entropy: 0.1, max_prob: 0.9, prob: 0.9 }).collect();
        d.apply(&pos, &preds).unwrap();
        assert_eq!(d.first_eos(), Some(4));
        let at = d.switch(9, &[20, 21], 2, 7).unwrap();
        assert_eq!(at, 8);
        assert_eq!(d.params.eos_ids, vec![0]);
        // 5..9 kept, check at 9, 10, masks from 11
        assert_eq!(&d.tokens[..6], &[1, 2, 3, 4, 20, 21]);
        assert_eq!(d.decoded, [vec![true; 6], vec![false; 5]].concat());
        let b: Vec<(usize, usize, usize, bool)> =
            d.blocks.iter().map(|b| (b.origin, b.start, b.end, b.created)).collect();
        assert_eq!(
            b,
            vec![(4, 5, 8, true), (8, 8, 10, true), (10, 10, 12, true), (12, 12, 14, false), (14, 14, 16, false)]
        );
        // the next step predicts the answer's first block's mask, and (alpha 0) the next block's
        assert_eq!(d.plan().unwrap(), vec![11, 12, 13]);
    }
}

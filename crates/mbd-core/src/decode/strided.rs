//! I-DLM's introspective strided decoding (ISD, arXiv 2604.11035) as policy over logits rows: the drafts a step
//! carries, the layout of its forward, and what a forward's rows commit. With stride N, a step forwards, strictly
//! causally and with shifted logits (the row of position i predicts i + 1):
//!
//! `[pending, d_1 .. d_s, M x m]` at positions F, F+1, .., F+s+m
//!
//! where `pending` is the last written token (position F, the end of the final K/V), d_1..d_s (s <= N - 1) the
//! previous step's drafts for F+1..F+s, and M the mask token. The rows of `pending` and the drafts are the
//! verifier p for F+1..F+s+1; the drafts are accepted left to right by speculative sampling (greedy: while they
//! equal p's argmax), the first rejected one is replaced from the residual; when every draft is accepted the row
//! of d_s gives one more token (the bonus, at F+s+1), and the mask rows, which sit from the bonus's slot on, are
//! the next step's drafts for F+s+2..F+s+m+1 (drawn from their distribution q, kept for the next acceptance).
//! After a rejection those drafts were conditioned on a rejected token and are dropped: the next step is a cold
//! start `[pending, M x m]` (s = 0), which writes one token and drafts N - 1. A step writes 1..N tokens; the K/V
//! of `pending` and of the accepted drafts are final (causal, over final tokens) and are kept.

use crate::decode::grammar::constraint::Constraint;
use crate::decode::sampling::Sampler;
use crate::decode::speculative::{accept_greedy, accept_sampled, SpecStats};
use crate::error::{Error, Result};
use candle_core::{DType, Tensor};

/// ISD's default stride: I-DLM's `idlm_blockN4` configuration (N = 4, a block of 2N - 1 = 7 positions).
pub const DEFAULT_STRIDE: usize = 4;

/// One generation's ISD state: the drafts for the positions after the pending token, and the counters.
#[derive(Debug, Clone)]
pub struct Strided {
    stride: usize,
    drafts: Vec<u32>,
    /// Sampling: each draft's distribution q (as
    /// [`SamplingParams::dist`](crate::decode::sampling::SamplingParams::dist) gives it) and its probability there.
    draft_dists: Vec<Vec<(u32, f64)>>,
    draft_probs: Vec<f64>,
    /// The undecoded positions after the pending token and the given ones when the step under way was laid out.
    room: usize,
    /// Tokens written after the pending token before the step (a grammar forced them): forwarded ahead of the
    /// drafts, their K/V kept, never verified.
    given: usize,
    pub stats: SpecStats,
}

impl Strided {
    /// `stride` >= 1 (N: the most tokens a step writes; 1 is AR decoding).
    pub fn new(stride: usize) -> Strided {
        Strided {
            stride: stride.max(1),
            drafts: vec![],
            draft_dists: vec![],
            draft_probs: vec![],
            room: 0,
            given: 0,
            stats: SpecStats::default(),
        }
    }

    /// The ids of the step's forward after the pending token, for `room` undecoded positions after it of which the
    /// first hold `given` (tokens written already, a grammar's forced ones): those, the drafts for the positions
    /// after them, then as many masks as give drafts inside the room (a mask row predicts the position after it).
    pub fn layout(&mut self, room: usize, mask: u32, given: &[u32]) -> Vec<u32> {
        let k = given.len().min(room);
        (self.given, self.room) = (k, room - k);
        // the drafts for the given positions give way to them
        self.drafts.drain(..k.min(self.drafts.len()));
        self.draft_dists.drain(..k.min(self.draft_dists.len()));
        self.draft_probs.drain(..k.min(self.draft_probs.len()));
        self.drafts.truncate(self.room);
        self.draft_dists.truncate(self.room);
        self.draft_probs.truncate(self.room);
        let s = self.drafts.len();
        let m = (self.stride - 1).min(self.room.saturating_sub(s + 1));
        let mut ids = given[..k].to_vec();
        ids.extend_from_slice(&self.drafts);
        ids.extend(std::iter::repeat_n(mask, m));
        ids
    }

    /// How many given tokens the step under way forwards after the pending token ([`Strided::layout`]).
    pub fn given(&self) -> usize {
        self.given
    }

    /// Take the step's logits (one row per forwarded id: the pending token's, then the `layout` ids'). Returns the
    /// tokens to write after the pending token and the given ones, and how many of them are accepted drafts (the
    /// K/V to keep: the pending token's, the given ones' and theirs), and keeps the next step's drafts.
    ///
    /// Under a grammar (`constraint`, at the frontier after the given tokens) every row is read among the tokens the
    /// grammar allows after the tokens before it (where it forces a token, as a point mass on that token): a draft is
    /// accepted while it equals the verifier's masked argmax (greedy) or by speculative sampling against the verifier's masked distribution (a draft the grammar refuses
    /// has probability 0 there, so it is rejected and the residual drawn), the correction and the bonus come from
    /// the masked rows, and the next drafts from the mask rows masked along the tokens before them. So constrained
    /// greedy ISD writes what constrained greedy AR writes. The written tokens are committed to the grammar.
    pub fn step(
        &mut self,
        sampler: &mut Sampler,
        logits: &Tensor,
        constraint: Option<&mut Constraint>,
    ) -> Result<(Vec<u32>, usize)> {
        let (s, room, k) = (self.drafts.len(), self.room, self.given);
        let rows = logits.dim(0)?;
        let m = rows
            .checked_sub(k + s + 1)
            .ok_or_else(|| Error::Internal(format!("{rows} ISD rows for {k} given tokens and {s} drafts")))?;
        // the rows from the last given token's (or the pending one's) on: the verifier of F+k+1.., then the masks
        let logits = logits.narrow(0, k, rows - k)?;
        let mut drafts = std::mem::take(&mut self.drafts);
        let (mut dists, mut probs) = (std::mem::take(&mut self.draft_dists), std::mem::take(&mut self.draft_probs));
        if let Some(c) = constraint.as_deref() {
            // nothing after an end of text is verified: the drafts stop at the first one
            if let Some(e) = drafts.iter().position(|&t| c.is_end(t)) {
                drafts.truncate(e + 1);
                dists.truncate(e + 1);
                probs.truncate(e + 1);
            }
        }
        // verifier rows: one per position F+k+1..F+k+s_v+1 inside the room
        let s_v = drafts.len();
        let v = (s_v + 1).min(room);
        let greedy = sampler.params().temperature == 0.0;
        let host: Option<Vec<Vec<f32>>> =
            (!greedy || constraint.is_some()).then(|| logits.to_dtype(DType::F32)?.to_vec2()).transpose()?;
        if let Some(h) = host.as_ref().filter(|_| !greedy) {
            if h.iter().flatten().any(|x| x.is_nan()) {
                return Err(Error::load("the model computed non-finite logits (NaN) in an ISD step"));
            }
        }
        let sp = sampler.params().clone();
        let (mut tokens, accepted) = match (constraint, &host) {
            (None, _) if greedy => {
                let best: Vec<u32> = sampler.predict(&logits)?.iter().map(|p| p.token).collect();
                let (mut tokens, a) = accept_greedy(&drafts, &best[..s_v]);
                if a == s_v && v > s_v {
                    tokens.push(best[s_v]);
                    self.drafts = best[s_v + 1..s_v + 1 + m].to_vec();
                }
                (tokens, a)
            }
            (None, Some(host)) => {
                let p: Vec<Vec<(u32, f64)>> = host[..v].iter().map(|r| sp.dist(r)).collect();
                let (mut tokens, a) = accept_sampled(sampler, &drafts, &probs, |i| dists[i].clone(), |i| p[i].clone());
                if a == s_v && v > s_v {
                    tokens.push(sampler.draw(&p[s_v]));
                    self.draw_drafts(sampler, &host[s_v + 1..s_v + 1 + m], None)?;
                }
                (tokens, a)
            }
            (Some(c), Some(host)) => {
                // at a position the grammar forces, its token (constrained AR writes it without a forward)
                let along = c.along(&drafts)?;
                let (mut tokens, mut a) = (Vec::with_capacity(v), 0);
                if greedy {
                    for i in 0..v {
                        let best = sampler.predict_among(&host[i], &along[i])?.token;
                        tokens.push(best);
                        let hit = i < s_v && drafts[i] == best;
                        a += hit as usize;
                        if !hit || c.is_end(best) {
                            break;
                        }
                    }
                } else {
                    let p = |i: usize| sp.dist_among(&host[i], &along[i]);
                    (tokens, a) = accept_sampled(sampler, &drafts, &probs, |i| dists[i].clone(), p);
                    if a == s_v && v > s_v && !drafts.last().is_some_and(|&t| c.is_end(t)) {
                        tokens.push(sampler.draw(&p(s_v)));
                    }
                }
                tokens.truncate(room);
                c.commit(&tokens)?;
                if tokens.len() == s_v + 1 && !c.ended() && !tokens.last().is_some_and(|&t| c.is_end(t)) {
                    self.draw_drafts(sampler, &host[s_v + 1..s_v + 1 + m], Some(c))?;
                }
                (tokens, a)
            }
            _ => return Err(Error::Internal("sampled ISD without host rows".into())),
        };
        tokens.truncate(room);
        if s > 0 {
            self.stats.count(s, accepted);
        }
        Ok((tokens, accepted))
    }

    /// The next step's drafts from the mask `rows`: the sampler's prediction of each (greedy: the argmax; sampling:
    /// a draw, its distribution kept for the acceptance), under a grammar among the tokens it allows after the
    /// drafts before it (stopping at an end of text).
    fn draw_drafts(&mut self, sampler: &mut Sampler, rows: &[Vec<f32>], c: Option<&mut Constraint>) -> Result<()> {
        let sp = sampler.params().clone();
        let greedy = sp.temperature == 0.0;
        let Some(c) = c else {
            for row in rows {
                self.draw_draft(sampler, sp.dist(row));
            }
            return Ok(());
        };
        let mut walked = 0;
        for row in rows {
            let here = c.here()?;
            let t = match greedy {
                true => {
                    let t = sampler.predict_among(row, &here)?.token;
                    self.drafts.push(t);
                    t
                }
                false => self.draw_draft(sampler, sp.dist_among(row, &here)),
            };
            if !c.advance(t)? {
                break;
            }
            walked += 1;
        }
        c.retreat(walked)
    }

    /// Draw a draft from `q` and keep it with its distribution and probability (for the next acceptance).
    fn draw_draft(&mut self, sampler: &mut Sampler, q: Vec<(u32, f64)>) -> u32 {
        let t = sampler.draw(&q);
        self.draft_probs.push(q.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1));
        self.draft_dists.push(q);
        self.drafts.push(t);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::sampling::SamplingParams;
    use candle_core::Device;

    /// Rows whose argmax is the given token (vocabulary 8).
    fn rows(argmax: &[u32]) -> Tensor {
        let v: Vec<f32> = argmax.iter().flat_map(|&t| (0..8).map(move |i| if i == t { 5.0 } else { 0.0 })).collect();
        Tensor::from_vec(v, (argmax.len(), 8), &Device::Cpu).unwrap()
    }

    fn greedy() -> Sampler {
        Sampler::new(SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(0) })
    }

    #[test]
    fn greedy_steps_walk_cold_start_accept_and_reject() {
        let (mut isd, mut s) = (Strided::new(3), greedy());
        // cold start: [pending, M, M]: one token from the pending row, drafts from the two mask rows
        assert_eq!(isd.layout(10, 7, &[]), vec![7, 7]);
        assert_eq!(isd.step(&mut s, &rows(&[1, 2, 3]), None).unwrap(), (vec![1], 0));
        // [pending=1, 2, 3, M, M]: both drafts agree with p, the bonus 4, then drafts 5, 6
        assert_eq!(isd.layout(9, 7, &[]), vec![2, 3, 7, 7]);
        assert_eq!(isd.step(&mut s, &rows(&[2, 3, 4, 5, 6]), None).unwrap(), (vec![2, 3, 4], 2));
        // [pending=4, 5, 6, M, M]: the second draft is rejected: 5 then p's 0; the drafts are dropped
        assert_eq!(isd.layout(6, 7, &[]), vec![5, 6, 7, 7]);
        assert_eq!(isd.step(&mut s, &rows(&[5, 0, 1, 1, 1]), None).unwrap(), (vec![5, 0], 1));
        assert_eq!(isd.layout(4, 7, &[]), vec![7, 7]);
        assert_eq!(isd.stats, SpecStats { verifications: 2, drafts_proposed: 4, drafts_accepted: 3 });
    }

    #[test]
    fn the_room_bounds_drafts_masks_and_tokens() {
        let (mut isd, mut s) = (Strided::new(4), greedy());
        // two positions left: one mask (its row drafts the last one)
        assert_eq!(isd.layout(2, 7, &[]), vec![7]);
        assert_eq!(isd.step(&mut s, &rows(&[1, 2]), None).unwrap(), (vec![1], 0));
        // one position left: the draft, no bonus, no masks
        assert_eq!(isd.layout(1, 7, &[]), vec![2]);
        assert_eq!(isd.step(&mut s, &rows(&[2, 3]), None).unwrap(), (vec![2], 1));
        // stride 1 is AR decoding: no drafts, no masks
        let mut ar = Strided::new(1);
        assert_eq!(ar.layout(5, 7, &[]), Vec::<u32>::new());
        assert_eq!(ar.step(&mut s, &rows(&[6]), None).unwrap(), (vec![6], 0));
        assert_eq!(ar.stats.verifications, 0);
    }
}

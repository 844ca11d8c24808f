//! S2D2 self-speculative verification (arXiv 2603.25702): a block-diffusion model at block size 1 is an
//! autoregressive model, so the same weights verify their own drafts. After a step's draft forward, the span
//! (the first contiguous run of masked positions, within one block) may be verified by a second forward whose
//! rows give each span position's block-size-1 prediction q (`window` builds it); drafts are accepted left to
//! right while they agree with q, and the first rejected position takes the verifier's token, so a verified
//! step decodes at least one token. This module holds the routing rule (when to verify), the acceptance rule
//! and the counters; the decoder, the window and the generation stay one path.

use crate::decode::decoder::Prediction;
use crate::decode::sampling::Sampler;
use crate::error::{Error, Result};

crate::util::string_enum! {
    /// Speculative decoding of a generation.
    pub enum Speculative ("speculative") {
        /// none (the default)
        Off = "off",
        /// S2D2: verify the drafts with the same weights at block size 1
        S2d2 = "s2d2",
        /// I-DLM's introspective strided decoding: one causal forward verifies the last step's drafts and drafts
        /// the next ones from mask positions ([`decode::strided`](crate::decode::strided))
        Isd = "isd",
    }
}

crate::util::string_enum! {
    /// When S2D2 verifies a step's span.
    pub enum VerifyPolicy ("verify_policy") {
        /// every step
        Always = "always",
        /// iff the span has at least `verify_min_span` positions
        MinSpan = "min_span",
        /// iff `E[K]` - penalty >= `verify_score_threshold`
        Score = "score",
        /// score with hysteresis: turn on when score > on, stay on until score < off
        Hysteresis = "hysteresis",
    }
}

crate::util::string_enum! {
    /// The penalty term of the verification score.
    pub enum PenaltyKind ("verify_penalty_kind") {
        /// c
        Static = "static",
        /// c x (positions of the span's block the acceptance rule takes without verifying)
        Dynamic = "dynamic",
    }
}

/// S2D2's routing parameters (defaults: the paper's SDAR configuration, score >= 0 with a static penalty 1).
#[derive(Debug, Clone, PartialEq)]
pub struct SpecParams {
    pub policy: VerifyPolicy,
    pub min_span: usize,
    pub score_threshold: f64,
    pub penalty: f64,
    pub penalty_kind: PenaltyKind,
    /// (on, off), on > off
    pub hysteresis: (f64, f64),
}

impl SpecParams {
    pub const DEFAULT_POLICY: VerifyPolicy = VerifyPolicy::Score;
    /// The paper's Fast-dLLM v2 configuration with 32-token sub-blocks.
    pub const DEFAULT_MIN_SPAN: usize = 8;
    pub const DEFAULT_SCORE_THRESHOLD: f64 = 0.0;
    pub const DEFAULT_PENALTY: f64 = 1.0;
    /// The paper's Fast-dLLM v2 configuration with 4- and 16-token sub-blocks.
    pub const DEFAULT_HYSTERESIS: (f64, f64) = (1.0, -5.0);

    /// Check the hysteresis pair (the one rule that spans two numbers).
    pub fn hysteresis_pair(v: &[f64]) -> Result<(f64, f64)> {
        match v {
            [on, off] if on > off => Ok((*on, *off)),
            [on, off] => Err(Error::invalid(format!("verify_hysteresis: on ({on}) must be greater than off ({off})"))),
            _ => {
                Err(Error::invalid(format!("verify_hysteresis must be two numbers (on, off), got {} numbers", v.len())))
            }
        }
    }
}

/// Per-generation S2D2 counters, reported in the usage.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecStats {
    /// verification forwards run
    pub verifications: usize,
    /// draft tokens put to a verifier (span lengths summed)
    pub drafts_proposed: usize,
    /// draft tokens the verifier accepted (the verifier's own tokens at rejections not counted)
    pub drafts_accepted: usize,
}

/// The routing rule and its state (hysteresis), and the counters.
#[derive(Debug, Clone)]
pub struct Router {
    params: SpecParams,
    on: bool,
    pub stats: SpecStats,
}

impl Router {
    pub fn new(params: SpecParams) -> Router {
        Router { params, on: false, stats: SpecStats::default() }
    }

    /// The score `E[K]` - penalty: with per-token acceptance estimates a_i = exp(-H_i / ln V) (H_i the draft's
    /// entropy), `E[K]` = sum_k prod_{i<=k} a_i; the penalty is c, or c x `confident` (dynamic).
    pub fn score(&self, span: &[Prediction], confident: usize, vocab: usize) -> f64 {
        let ln_v = (vocab.max(2) as f64).ln();
        let (mut prod, mut expected) = (1.0, 0.0);
        for p in span {
            prod *= (-p.entropy / ln_v).exp().clamp(0.0, 1.0);
            expected += prod;
        }
        let c = self.params.penalty;
        expected
            - match self.params.penalty_kind {
                PenaltyKind::Static => c,
                PenaltyKind::Dynamic => c * confident as f64,
            }
    }

    /// Whether to verify a span with these draft predictions; `confident`: positions of the span's block that
    /// the acceptance rule would take without verifying.
    pub fn decide(&mut self, span: &[Prediction], confident: usize, vocab: usize) -> bool {
        if span.is_empty() {
            return false;
        }
        let p = &self.params;
        match p.policy {
            VerifyPolicy::Always => true,
            VerifyPolicy::MinSpan => span.len() >= p.min_span,
            VerifyPolicy::Score => self.score(span, confident, vocab) >= p.score_threshold,
            VerifyPolicy::Hysteresis => {
                let s = self.score(span, confident, vocab);
                let (on, off) = p.hysteresis;
                self.on = if self.on { s >= off } else { s > on };
                self.on
            }
        }
    }
}

/// Greedy acceptance: drafts are taken left to right while they equal the verifier's argmax; at the first
/// disagreement the verifier's token is taken. Returns the tokens to write from the drafts' start and how
/// many of them are accepted drafts. (S2D2 and ISD.)
pub fn accept_greedy(drafts: &[u32], q_argmax: &[u32]) -> (Vec<u32>, usize) {
    let k = drafts.iter().zip(q_argmax).take_while(|(d, q)| d == q).count();
    let mut out = drafts[..k].to_vec();
    if k < drafts.len() {
        out.push(q_argmax[k]);
    }
    (out, k)
}

/// Sampled acceptance (speculative sampling): draft i is accepted with probability min(1, q_i(x_i) / p_i(x_i));
/// at the first rejection a token is drawn from normalize(max(0, q - p)) (from q when that is empty).
/// `p_prob`: each draft's probability under its draft distribution; `p_dist(i)`, `q_dist(i)`: the draft and
/// verifier distributions of draft i as (id, probability) pairs. With drafts drawn from p, each written token
/// is distributed as q. (S2D2 and ISD.)
pub fn accept_sampled(
    sampler: &mut Sampler,
    drafts: &[u32],
    p_prob: &[f64],
    p_dist: impl Fn(usize) -> Vec<(u32, f64)>,
    q_dist: impl Fn(usize) -> Vec<(u32, f64)>,
) -> (Vec<u32>, usize) {
    let mut out = Vec::with_capacity(drafts.len());
    let mut accepted = 0;
    for (i, &d) in drafts.iter().enumerate() {
        let q = q_dist(i);
        let qd = q.iter().find(|x| x.0 == d).map_or(0.0, |x| x.1);
        let ratio = (qd / p_prob[i].max(1e-12)).min(1.0);
        if sampler.uniform() < ratio {
            out.push(d);
            accepted += 1;
            continue;
        }
        let p: std::collections::HashMap<u32, f64> = p_dist(i).into_iter().collect();
        let residual: Vec<(u32, f64)> = q
            .iter()
            .map(|&(id, qp)| (id, (qp - p.get(&id).copied().unwrap_or(0.0)).max(0.0)))
            .filter(|x| x.1 > 0.0)
            .collect();
        let t = if residual.is_empty() { sampler.draw(&q) } else { sampler.draw(&residual) };
        out.push(t);
        break;
    }
    (out, accepted)
}

impl SpecStats {
    /// One verification of `proposed` drafts, `accepted` of them taken.
    pub fn count(&mut self, proposed: usize, accepted: usize) {
        self.verifications += 1;
        self.drafts_proposed += proposed;
        self.drafts_accepted += accepted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::sampling::SamplingParams;

    fn pred(h: f64) -> Prediction {
        Prediction { token: 1, entropy: h, max_prob: 0.5, prob: 0.5 }
    }

    fn router(policy: VerifyPolicy, kind: PenaltyKind) -> Router {
        Router::new(SpecParams {
            policy,
            min_span: 3,
            score_threshold: 0.0,
            penalty: 1.0,
            penalty_kind: kind,
            hysteresis: (1.0, -5.0),
        })
    }

    #[test]
    fn score_is_expected_accepted_minus_penalty() {
        let r = router(VerifyPolicy::Score, PenaltyKind::Static);
        let v = 100usize;
        let h = [0.5, 1.0, 0.0];
        let a: Vec<f64> = h.iter().map(|x: &f64| (-x / (v as f64).ln()).exp()).collect();
        let ek = a[0] + a[0] * a[1] + a[0] * a[1] * a[2];
        let s = r.score(&h.map(pred), 7, v);
        assert!((s - (ek - 1.0)).abs() < 1e-12);
        let d = router(VerifyPolicy::Score, PenaltyKind::Dynamic).score(&h.map(pred), 2, v);
        assert!((d - (ek - 2.0)).abs() < 1e-12);
    }

    #[test]
    fn policies_decide() {
        let span = [pred(0.1), pred(0.1)];
        assert!(router(VerifyPolicy::Always, PenaltyKind::Static).decide(&span, 0, 50));
        assert!(!router(VerifyPolicy::MinSpan, PenaltyKind::Static).decide(&span, 0, 50));
        assert!(router(VerifyPolicy::MinSpan, PenaltyKind::Static).decide(&[pred(9.0); 3], 0, 50));
        // two confident drafts: `E[K]` ~ 1.95 >= 1
        assert!(router(VerifyPolicy::Score, PenaltyKind::Static).decide(&span, 0, 50));
        // dynamic penalty with 2 confident positions: 1.95 - 2 < 0
        assert!(!router(VerifyPolicy::Score, PenaltyKind::Dynamic).decide(&span, 2, 50));
        // hysteresis: off until score > 1, then on until score < -5
        let mut h = router(VerifyPolicy::Hysteresis, PenaltyKind::Dynamic);
        assert!(!h.decide(&span, 1, 50)); // 0.95 <= 1
        assert!(h.decide(&span, 0, 50)); // 1.95 > 1
        assert!(h.decide(&span, 6, 50)); // -4.05 >= -5 stays on
        assert!(!h.decide(&span, 8, 50)); // -6.05 < -5 turns off
        assert!(!h.decide(&span, 1, 50)); // off: 0.95 does not turn it on again
    }

    #[test]
    fn greedy_acceptance_takes_agreeing_prefix_and_the_correction() {
        assert_eq!(accept_greedy(&[5, 6, 7, 8], &[5, 6, 9, 8]), (vec![5, 6, 9], 2));
        assert_eq!(accept_greedy(&[5, 6], &[5, 6]), (vec![5, 6], 2));
        assert_eq!(accept_greedy(&[5], &[4]), (vec![4], 0));
    }

    #[test]
    fn sampled_acceptance_preserves_the_verifier_distribution() {
        // One position, vocabulary {0, 1, 2}: drafts drawn from p, accepted by min(1, q/p), residual otherwise.
        // The committed token must be distributed as q (the speculative sampling theorem).
        let p = vec![(0u32, 0.6), (1, 0.3), (2, 0.1)];
        let q = vec![(0u32, 0.2), (1, 0.3), (2, 0.5)];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(3) });
        let mut stats = SpecStats::default();
        let n = 40_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            let d = s.draw(&p);
            let pp = p.iter().find(|x| x.0 == d).unwrap().1;
            let (out, k) = accept_sampled(&mut s, &[d], &[pp], |_| p.clone(), |_| q.clone());
            stats.count(1, k);
            assert_eq!(out.len(), 1);
            counts[out[0] as usize] += 1;
        }
        for (i, &(_, qi)) in q.iter().enumerate() {
            let f = counts[i] as f64 / n as f64;
            assert!((f - qi).abs() < 0.015, "token {i}: {f} vs {qi}");
        }
        // acceptance rate = sum min(p, q) = 0.2 + 0.3 + 0.1 = 0.6
        let rate = stats.drafts_accepted as f64 / stats.drafts_proposed as f64;
        assert!((rate - 0.6).abs() < 0.015, "{rate}");
    }

    #[test]
    fn hysteresis_pair_is_checked() {
        assert_eq!(SpecParams::hysteresis_pair(&[1.0, -5.0]).unwrap(), (1.0, -5.0));
        assert!(SpecParams::hysteresis_pair(&[1.0, 1.0]).unwrap_err().to_string().contains("greater than off"));
        assert!(SpecParams::hysteresis_pair(&[1.0]).unwrap_err().to_string().contains("two numbers"));
    }
}

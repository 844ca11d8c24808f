//! From logits rows to per-position predictions: entropy and max-probability of softmax(raw logits)
//! (temperature does not change them), and the token: argmax (temperature 0; ties -> lowest id) or a
//! seeded sample from softmax(logits / T) restricted by top-k / top-p.

use crate::decode::decoder::Prediction;
use crate::decode::grammar::constraint::{masked_row, Here};
use crate::error::{Error, Result};
use crate::kernels::stats;
use crate::util::by_score_then_index;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f64,
    /// 0 = off
    pub top_k: usize,
    pub top_p: f64,
    /// 0 = off
    pub min_p: f64,
    pub seed: Option<u64>,
}

/// A token's log-probability under softmax(raw logits) (temperature and top-k/top-p do not change it), with
/// the most likely tokens' log-probabilities when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// (id, log-probability) of the most likely tokens, most likely first (ties -> lowest id).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-softmax in `row` and the `k` most likely tokens' (the normaliser as in [`stats::row_stats`]: exponent
/// terms in f32 around the max, their sum in f64).
pub fn token_logprob(row: &[f32], token: u32, k: usize) -> TokenLogprob {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = row.iter().map(|&x| (x - m).exp() as f64).sum();
    let lse = m as f64 + z.ln();
    let lp = |i: usize| (row[i] as f64 - lse) as f32;
    let k = k.min(row.len());
    let top = if k == 0 {
        vec![]
    } else {
        let by_logit =
            |a: &u32, b: &u32| by_score_then_index(row[*b as usize], row[*a as usize], *a as usize, *b as usize);
        let mut idx: Vec<u32> = (0..row.len() as u32).collect();
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
        idx.sort_by(by_logit);
        idx.into_iter().map(|i| (i, lp(i as usize))).collect()
    };
    TokenLogprob { token, logprob: lp(token as usize), top }
}

/// `token_logprob` for rows `rows[i]` of `logits` (R, V) (None: every row, in order) and their tokens
/// (`tokens[i]`): the rows come to the host (on a GPU only these rows), and are scored in parallel on the calling
/// pool.
pub fn token_logprobs(logits: &Tensor, rows: Option<&[usize]>, tokens: &[u32], k: usize) -> Result<Vec<TokenLogprob>> {
    if tokens.is_empty() {
        return Ok(vec![]);
    }
    let sel = match rows {
        Some(rows) => {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            logits.index_select(&Tensor::new(idx.as_slice(), logits.device())?, 0)?
        }
        None => logits.clone(),
    }
    .to_dtype(DType::F32)?;
    let v = sel.dim(1)?;
    let flat = sel.flatten_all()?.to_vec1::<f32>()?;
    let out: Vec<TokenLogprob> =
        flat.par_chunks_exact(v.max(1)).zip(tokens.par_iter()).map(|(row, &t)| token_logprob(row, t, k)).collect();
    if out.iter().any(|t| !t.logprob.is_finite() && t.logprob != f32::NEG_INFINITY) {
        return Err(Error::load("the model computed non-finite logits (NaN or infinity) for a log-probability"));
    }
    Ok(out)
}

impl SamplingParams {
    /// The distribution tokens are drawn from: softmax(row / T) restricted by top-k, then top-p, then min-p (the
    /// tokens at least min_p times as likely as the most likely one) and renormalised (temperature 0: softmax(row)),
    /// as (id, probability) pairs, most likely first (ties -> lowest id).
    pub fn dist(&self, row: &[f32]) -> Vec<(u32, f64)> {
        let t = if self.temperature == 0.0 { 1.0 } else { self.temperature };
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| by_score_then_index(row[b], row[a], a, b));
        let sampling = self.temperature > 0.0;
        if sampling && self.top_k > 0 && self.top_k < idx.len() {
            idx.truncate(self.top_k);
        }
        let m = row[idx[0]] as f64;
        let mut probs: Vec<f64> = idx.iter().map(|&i| ((row[i] as f64 - m) / t).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        if sampling && self.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (j, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= self.top_p {
                    keep = j + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= z);
        }
        if sampling && self.min_p > 0.0 {
            let floor = probs[0] * self.min_p;
            let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
            probs.truncate(keep);
            idx.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= z);
        }
        idx.into_iter().map(|i| i as u32).zip(probs).collect()
    }

    /// [`SamplingParams::dist`] where a grammar stands (`here`): a point mass on the token it forces, else the
    /// distribution of the row restricted to the tokens it allows.
    pub fn dist_among(&self, row: &[f32], here: &Here) -> Vec<(u32, f64)> {
        match here {
            (_, Some(f)) => vec![(*f, 1.0)],
            (mask, None) => self.dist(&masked_row(row, mask)),
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
    /// Time spent in `predict_any`, for the usage's `head_ms`.
    stats_ms: f64,
}

impl Sampler {
    /// `params` are in range ([`request::PARAMS`](crate::params::request::PARAMS) owns the rules).
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => rand::rngs::StdRng::seed_from_u64(s),
            None => rand::rngs::StdRng::from_os_rng(),
        };
        Sampler { params, rng, stats_ms: 0.0 }
    }

    /// `logits`: (R, V) f32 on any device. On a GPU only R * 3 scalars come back to the host when greedy.
    /// Non-finite logits (a broken checkpoint: NaN weights, a bad rms_norm_eps or rope_theta) are an error,
    /// not garbage tokens.
    pub fn predict(&mut self, logits: &Tensor) -> Result<Vec<Prediction>> {
        let preds = self.predict_any(logits)?;
        if preds.iter().any(|p| !p.entropy.is_finite() || !p.max_prob.is_finite()) {
            return Err(Error::load(
                "the model computed non-finite logits (NaN or infinity): its weights or config.json are broken \
                 (NaN/Inf weights, rms_norm_eps <= 0, rope_theta <= 0, ...)",
            ));
        }
        Ok(preds)
    }

    /// The prediction of a logits row (host f32) where a grammar stands (`here`): the token it forces, certain; else
    /// among the tokens it allows, greedy the masked argmax, sampling a draw from the masked distribution, with the
    /// masked distribution's statistics.
    pub fn predict_among(&mut self, row: &[f32], here: &Here) -> Result<Prediction> {
        match here {
            (_, Some(f)) => Ok(Prediction::certain(*f)),
            (mask, None) => {
                let masked = Tensor::from_vec(masked_row(row, mask), (1, row.len()), &Device::Cpu)?;
                Ok(self.predict(&masked)?[0])
            }
        }
    }

    /// On the CPU the rows are read in place, without a copy (two passes per row for the statistics, rows split
    /// across the pool; a sampled token from the same rows). On a GPU the statistics are one kernel launch over the
    /// rows ([`stats::rows`]), and only a sampled token (temperature > 0) copies its rows to the host.
    fn predict_any(&mut self, logits: &Tensor) -> Result<Vec<Prediction>> {
        let t0 = Instant::now();
        let greedy = self.params.temperature == 0.0;
        let v = logits.dims2()?.1;
        let out = if logits.device().is_cpu() {
            stats::with_host_f32(logits, |flat| {
                let stats = stats::host_rows(flat, v);
                self.predictions(stats, (!greedy).then_some(flat), v)
            })?
        } else {
            let stats = stats::rows(logits)?;
            match greedy {
                true => self.predictions(stats, None, v),
                false => stats::with_host_f32(logits, |flat| self.predictions(stats, Some(flat), v))?,
            }
        };
        self.stats_ms += t0.elapsed().as_secs_f64() * 1e3;
        Ok(out)
    }

    /// Each row's prediction from its statistics: greedy the argmax, else a draw from the row in `host`.
    fn predictions(&mut self, stats: Vec<stats::RowStats>, host: Option<&[f32]>, v: usize) -> Vec<Prediction> {
        let mut out = Vec::with_capacity(stats.len());
        for (i, (argmax, entropy, max_prob)) in stats.into_iter().enumerate() {
            let (token, prob) = match host {
                Some(flat) => self.sample_row(&flat[i * v..(i + 1) * v]),
                None => (argmax, max_prob),
            };
            out.push(Prediction { token, entropy, max_prob, prob });
        }
        out
    }

    /// Milliseconds this sampler spent on its rows' statistics and tokens (`predict`, `predict_among`), summed.
    pub fn stats_ms(&self) -> f64 {
        self.stats_ms
    }

    /// The distribution tokens are drawn from ([`SamplingParams::dist`]).
    pub fn dist(&self, row: &[f32]) -> Vec<(u32, f64)> {
        self.params.dist(row)
    }

    /// A seeded draw from a distribution given as (id, weight) pairs (weights need not sum to 1; at least one
    /// must be positive).
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> u32 {
        let z: f64 = dist.iter().map(|d| d.1).sum();
        let u: f64 = self.rng.random::<f64>() * z;
        let mut cum = 0.0;
        for &(id, p) in dist {
            cum += p;
            if u < cum {
                return id;
            }
        }
        dist.iter().rev().find(|d| d.1 > 0.0).map_or(dist[0].0, |d| d.0)
    }

    /// A seeded uniform number in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random()
    }

    /// A seeded draw from `dist(row)`, with the drawn token's probability.
    fn sample_row(&mut self, row: &[f32]) -> (u32, f64) {
        let d = self.dist(row);
        let token = self.draw(&d);
        (token, d.iter().find(|x| x.0 == token).map_or(0.0, |x| x.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_logprob_is_log_softmax_with_the_top_in_order() {
        let row = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        let t = token_logprob(&row, 4, 3);
        assert!((t.logprob as f64 - (0.5 - z.ln())).abs() < 1e-6);
        // ties -> lowest id first
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert!((t.top[2].1 as f64 - (1.0 - z.ln())).abs() < 1e-6);
        assert_eq!(token_logprob(&row, 0, 0).top, vec![]);
        assert_eq!(token_logprob(&row, 0, 9).top.len(), 5);
    }

    #[test]
    fn nan_logits_are_an_error() {
        let mut s = Sampler::new(SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(0) });
        let l = Tensor::new(&[[0.5f32, f32::NAN, 1.0], [0.0, 1.0, 2.0]], &candle_core::Device::Cpu).unwrap();
        let e = s.predict(&l).unwrap_err().to_string();
        assert!(e.contains("non-finite logits"), "{e}");
    }

    #[test]
    fn greedy_predictions_are_the_rows_stats() {
        // through the sampler: greedy rows of a (2, 3) tensor
        let t = Tensor::new(&[[1f32, 3.0, 2.0], [0.0, 0.0, 0.0]], &candle_core::Device::Cpu).unwrap();
        let mut s = Sampler::new(SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(0) });
        let p = s.predict(&t).unwrap();
        assert_eq!((p[0].token, p[1].token), (1, 0));
        assert!((p[1].entropy - 3f64.ln()).abs() < 1e-6 && (p[1].max_prob - 1.0 / 3.0).abs() < 1e-6);
    }
}

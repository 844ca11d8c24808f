//! From logits rows to per-position predictions: entropy and max-probability of softmax(raw logits)
//! (temperature does not change them), and the token: argmax (temperature 0; ties -> lowest id) or a
//! seeded sample from softmax(logits / T) restricted by top-k / top-p.

use crate::decoder::Prediction;
use crate::error::{Error, Result};
use candle_core::{DType, Tensor, D};
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f64,
    /// 0 = off
    pub top_k: usize,
    pub top_p: f64,
    pub seed: Option<u64>,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0) || !self.temperature.is_finite() {
            return Err(Error::invalid(format!("temperature must be a finite number >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(s) => rand::rngs::StdRng::seed_from_u64(s),
            None => rand::rngs::StdRng::from_os_rng(),
        };
        Ok(Sampler { params, rng })
    }

    /// `logits`: (R, V) f32 on any device. Only R * 3 scalars come back to the host when greedy.
    pub fn predict(&mut self, logits: &Tensor) -> Result<Vec<Prediction>> {
        let logits = logits.to_dtype(DType::F32)?;
        let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let entropy = (lsm.exp()? * &lsm)?.sum(D::Minus1)?.neg()?.to_vec1::<f32>()?;
        let max_lp = lsm.max(D::Minus1)?.to_vec1::<f32>()?;
        let tokens: Vec<u32> = if self.params.temperature == 0.0 {
            logits.argmax(D::Minus1)?.to_vec1::<u32>()?
        } else {
            let rows: Vec<Vec<f32>> = logits.to_vec2()?;
            rows.iter().map(|r| self.sample_row(r)).collect()
        };
        Ok(tokens
            .into_iter()
            .zip(entropy)
            .zip(max_lp)
            .map(|((token, h), m)| Prediction { token, entropy: h as f64, max_prob: (m as f64).exp() })
            .collect())
    }

    fn sample_row(&mut self, row: &[f32]) -> u32 {
        let t = self.params.temperature;
        let mut idx: Vec<usize> = (0..row.len()).collect();
        // Highest logit first; ties -> lowest id.
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
        if self.params.top_k > 0 && self.params.top_k < idx.len() {
            idx.truncate(self.params.top_k);
        }
        let m = row[idx[0]] as f64;
        let mut probs: Vec<f64> = idx.iter().map(|&i| ((row[i] as f64 - m) / t).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        if self.params.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (j, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= self.params.top_p {
                    keep = j + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= z);
        }
        let u: f64 = self.rng.random();
        let mut cum = 0.0;
        for (j, p) in probs.iter().enumerate() {
            cum += p;
            if u < cum {
                return idx[j] as u32;
            }
        }
        idx[idx.len() - 1] as u32
    }
}

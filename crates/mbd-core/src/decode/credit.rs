//! dInfer's CreditDecoding (arXiv 2510.06133; `CreditThresholdParallelDecoder`): each masked position keeps a
//! credit per token that decays by beta at every step of its block after the block's first, and gains
//! (max p)^gamma for the step's argmax of the raw probabilities p. The step predicts from the fused logits
//! `logits + alpha * ln(1 + credit)`: the token is their argmax (or a draw), the confidence their probability,
//! which the `credit` acceptance compares with tau. Credit lives per block, keyed as dInfer keys it by the
//! block's range: a new block (or a position laid out in another block, after TCCF's switch) starts from none.

use crate::decode::decoder::Decoder;
use crate::error::{Error, Result};
use crate::kernels::stats::row_stats;
use candle_core::{DType, Tensor};
use std::collections::HashMap;

/// CreditDecoding's parameters (defaults: dInfer's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CreditParams {
    /// fusion strength
    pub alpha: f64,
    /// the concave exponent on the argmax's probability
    pub gamma: f64,
    /// the decay per step
    pub beta: f64,
}

impl CreditParams {
    pub const DEFAULT: CreditParams = CreditParams { alpha: 0.7, gamma: 0.2, beta: 0.8 };
}

/// A block as dInfer keys its credit: its range [start, end).
type BlockKey = (usize, usize);

/// One generation's credit: per masked position, (its block, that block's step count when last decayed,
/// token -> credit); per block, the steps it has had.
#[derive(Debug, Clone)]
pub struct Credit {
    params: CreditParams,
    positions: HashMap<usize, (BlockKey, usize, HashMap<u32, f64>)>,
    block_steps: HashMap<BlockKey, usize>,
}

impl Credit {
    pub fn new(params: CreditParams) -> Credit {
        Credit { params, positions: HashMap::new(), block_steps: HashMap::new() }
    }

    /// The step's fused logits for `positions` (one raw row each, in order): credit decayed to this step of each
    /// position's block, then raised by the row's argmax probability, then fused. Call once per forward.
    pub fn fuse(&mut self, dec: &Decoder, positions: &[usize], logits: &Tensor) -> Result<Tensor> {
        let (r, v) = logits.dims2()?;
        let rows = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let CreditParams { alpha, gamma, beta } = self.params;
        let mut out = Vec::with_capacity(r * v);
        let mut seen = vec![];
        for (&p, row) in positions.iter().zip(rows.chunks_exact(v.max(1))) {
            let b = &dec.blocks[dec.block_of(p)];
            let k = (b.start, b.end);
            let t = *self.block_steps.get(&k).unwrap_or(&0);
            if !seen.contains(&k) {
                seen.push(k);
            }
            let entry = self.positions.entry(p).or_insert_with(|| (k, t, HashMap::new()));
            if entry.0 != k {
                *entry = (k, t, HashMap::new());
            }
            let (_, at, credit) = entry;
            let decay = beta.powi((t - *at) as i32);
            credit.values_mut().for_each(|c| *c *= decay);
            *at = t;
            // the raw argmax (ties -> lowest id) and its probability
            let (best, _, max_prob) = row_stats(row);
            *credit.entry(best).or_insert(0.0) += max_prob.powf(gamma);
            let start = out.len();
            out.extend_from_slice(row);
            for (&id, &c) in credit.iter() {
                let raw = out[start + id as usize];
                let fused = raw + (alpha * c.ln_1p()) as f32;
                if raw.is_finite() && !fused.is_finite() {
                    // the request's numbers, not the model's (whose non-finite logits sampling reports): say which
                    return Err(Error::invalid(format!(
                        "credit_alpha ({alpha}) and credit_gamma ({gamma}) make the fused logits non-finite; use \
                         smaller values"
                    )));
                }
                out[start + id as usize] = fused;
            }
        }
        for k in seen {
            *self.block_steps.entry(k).or_insert(0) += 1;
        }
        Ok(Tensor::from_vec(out, (r, v), logits.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::decoder::{block_layout, Acceptance, DecodeParams, ForcedProgress, DEFAULT_BACD_BOUNDS};
    use candle_core::Device;

    fn decoder() -> Decoder {
        let p = DecodeParams {
            threshold: 0.9,
            acceptance: Acceptance::Credit,
            block_add_threshold: 1.0,
            decoded_token_threshold: 1.0,
            forced_progress: ForcedProgress::First,
            early_stop: false,
            max_forward_passes: 100,
            eos_ids: vec![],
            sub_block_size: None,
            ar_block_start: false,
            bacd_bounds: DEFAULT_BACD_BOUNDS,
        };
        Decoder::new(2, 8, block_layout(2, 8, 4, false), p).unwrap()
    }

    #[test]
    fn credit_decays_per_block_step_and_fuses_by_its_definition() {
        let dec = decoder();
        let cp = CreditParams::DEFAULT;
        let mut c = Credit::new(cp);
        let rows = [[2.0f32, 1.0, 0.0], [0.0, 0.5, 1.0]];
        let t = Tensor::new(&rows, &Device::Cpu).unwrap();
        let pmax = |r: &[f32; 3]| {
            let m = r.iter().cloned().fold(f32::MIN, f32::max) as f64;
            1.0 / r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>()
        };
        // step 0 of block 0 at positions 2, 3: credit = pmax^gamma on each argmax
        let f0: Vec<Vec<f32>> = c.fuse(&dec, &[2, 3], &t).unwrap().to_vec2().unwrap();
        let c0 = pmax(&rows[0]).powf(cp.gamma);
        assert!((f0[0][0] as f64 - (2.0 + cp.alpha * c0.ln_1p())).abs() < 1e-5 && f0[0][1] == 1.0);
        // step 1, position 2 only: decayed once, then raised again (same argmax)
        let f1: Vec<Vec<f32>> = c.fuse(&dec, &[2], &t.narrow(0, 0, 1).unwrap()).unwrap().to_vec2().unwrap();
        let c1 = cp.beta * c0 + c0;
        assert!((f1[0][0] as f64 - (2.0 + cp.alpha * c1.ln_1p())).abs() < 1e-5);
        // step 2 (position 3 again, skipped at step 1): decayed twice, then raised
        let f2: Vec<Vec<f32>> = c.fuse(&dec, &[3], &t.narrow(0, 1, 1).unwrap()).unwrap().to_vec2().unwrap();
        let c3 = pmax(&rows[1]).powf(cp.gamma);
        let c3 = cp.beta * cp.beta * c3 + c3;
        assert!((f2[0][2] as f64 - (1.0 + cp.alpha * c3.ln_1p())).abs() < 1e-5);
        // a new block (position 6, block 1) starts with no decay history
        let f3: Vec<Vec<f32>> = c.fuse(&dec, &[6], &t.narrow(0, 0, 1).unwrap()).unwrap().to_vec2().unwrap();
        assert!((f3[0][0] as f64 - (2.0 + cp.alpha * c0.ln_1p())).abs() < 1e-5);
    }
}

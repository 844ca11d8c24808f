//! The sampling controls that change the logits before a prediction: OpenAI's `logit_bias`, `presence_penalty` and
//! `frequency_penalty`, and the CTRL / transformers `repetition_penalty`.
//!
//! What counts as "already generated" when a forward predicts many positions: the completion tokens **committed
//! before the step** (decoded at any position of the canvas, left or right of the one predicted), the same set for
//! every position the step predicts; a step's own predictions never penalise each other. At one position per forward
//! (autoregressive decoding) that is every token to the left, so greedy AR with these controls equals transformers'
//! `generate` with the same logits processors; in multi-block decoding each stream's set is its own, so batching
//! does not change it.
//!
//! Per row, in this order: `logit_bias[t]` is added; for each token t of the prompt or the completion so far,
//! `repetition_penalty` r divides a positive logit by r and multiplies a negative one by r (transformers'
//! `RepetitionPenaltyLogitsProcessor`, which counts the prompt); for each token t generated c(t) > 0 times,
//! `frequency_penalty` x c(t) + `presence_penalty` is subtracted (OpenAI's definition, over the completion only).

use crate::error::{Error, Result};
use std::collections::HashMap;

/// One generation's logits controls (None of them set: no `Penalties` at all).
#[derive(Debug, Clone, Default)]
pub struct Penalties {
    pub presence: f64,
    pub frequency: f64,
    /// 1 = off
    pub repetition: f64,
    /// (token, bias) pairs, ids checked against the vocabulary.
    pub bias: Vec<(u32, f32)>,
    /// The prompt's distinct tokens (what repetition_penalty counts besides the completion).
    pub prompt: Vec<u32>,
}

/// The most entries a `logit_bias` may have (OpenAI allows 300; a few thousand keeps a row's work small).
pub const MAX_BIAS_ENTRIES: usize = 4096;

/// `logit_bias` as OpenAI sends it: a JSON object from token ids (as strings, or numbers) to biases in [-100, 100].
pub fn parse_bias(json: &str, vocab: usize) -> Result<Vec<(u32, f32)>> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| Error::invalid(format!("logit_bias must be a JSON object: {e}")))?;
    let obj = v.as_object().ok_or_else(|| {
        Error::invalid("logit_bias must be an object from token ids to biases, like {\"50256\": -100}")
    })?;
    if obj.len() > MAX_BIAS_ENTRIES {
        return Err(Error::invalid(format!(
            "logit_bias has {} entries; at most {MAX_BIAS_ENTRIES} are allowed",
            obj.len()
        )));
    }
    let mut out = Vec::with_capacity(obj.len());
    for (k, b) in obj {
        let shown: String = k.chars().take(24).collect();
        let id: u64 = k
            .trim()
            .parse()
            .map_err(|_| Error::invalid(format!("logit_bias: key {shown:?} is not a token id (a whole number)")))?;
        if id >= vocab as u64 {
            return Err(Error::invalid(format!(
                "logit_bias: token id {id} is out of range: the vocabulary has {vocab} tokens (ids 0..{})",
                vocab.saturating_sub(1)
            )));
        }
        let x = b
            .as_f64()
            .filter(|x| x.is_finite() && (-100.0..=100.0).contains(x))
            .ok_or_else(|| Error::invalid(format!("logit_bias[{shown:?}] must be a number in [-100, 100], got {b}")))?;
        out.push((id as u32, x as f32));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

impl Penalties {
    /// Whether any control changes a logit.
    pub fn is_active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0 || !self.bias.is_empty()
    }

    /// Apply the controls to every row of `rows` (R rows of `v` logits, host f32), `generated` the completion tokens
    /// committed before this step.
    pub fn apply(&self, rows: &mut [f32], v: usize, generated: &[u32]) {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        let mut seen: Vec<u32> = self.prompt.iter().copied().chain(counts.keys().copied()).collect();
        seen.sort_unstable();
        seen.dedup();
        let r = self.repetition as f32;
        for row in rows.chunks_exact_mut(v.max(1)) {
            for &(t, b) in &self.bias {
                row[t as usize] += b;
            }
            if r != 1.0 {
                for &t in &seen {
                    let x = &mut row[t as usize];
                    *x = if *x > 0.0 { *x / r } else { *x * r };
                }
            }
            if self.presence != 0.0 || self.frequency != 0.0 {
                for (&t, &c) in &counts {
                    row[t as usize] -= (self.frequency * c as f64 + self.presence) as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_controls_follow_their_definitions() {
        let p = Penalties { presence: 0.5, frequency: 0.25, repetition: 2.0, bias: vec![(3, 1.0)], prompt: vec![0] };
        // two rows of 4: tokens 1 (twice) and 2 generated; token 0 in the prompt
        let mut rows = vec![4.0, 4.0, -4.0, 0.0, 1.0, 2.0, 3.0, 4.0];
        p.apply(&mut rows, 4, &[1, 2, 1]);
        // 0: prompt only: 4 / 2; 1: 4 / 2 - (0.25 * 2 + 0.5); 2: -4 * 2 - 0.75; 3: biased
        assert_eq!(&rows[..4], &[2.0, 1.0, -8.75, 1.0]);
        assert_eq!(&rows[4..], &[0.5, 0.0, 0.75, 5.0]);
    }

    #[test]
    fn logit_bias_is_checked() {
        assert_eq!(parse_bias(r#"{"2": -100, "0": 5.5}"#, 4).unwrap(), vec![(0, 5.5), (2, -100.0)]);
        let e = |j: &str| parse_bias(j, 4).unwrap_err().to_string();
        assert!(e(r#"{"4": 1}"#).contains("token id 4 is out of range"));
        assert!(e(r#"{"a": 1}"#).contains("key \"a\" is not a token id"));
        assert!(e(r#"{"1": 101}"#).contains("must be a number in [-100, 100]"));
        assert!(e("[1]").contains("must be an object"));
    }
}

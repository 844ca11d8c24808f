//! A generation under a grammar (a JSON schema, a Lark grammar, a regex): every output it finishes is a word of the
//! grammar, and an output cut short is a prefix the grammar can still complete. The one policy, over llguidance's
//! matcher (its parser kept at the committed frontier), that the decoding loop consults each step.
//!
//! Block diffusion accepts tokens anywhere in the blocks in flight; a grammar reads left to right. The rule that
//! joins them (a decoder phase between acceptance and writing, [`Constraint::keep`]):
//! - the frontier is the first position the output has not committed; everything before it is a valid prefix;
//! - a step commits only the accepted positions that run contiguously from the frontier, and only as far as the
//!   grammar takes them (`validate_tokens` on the run): an accepted token past a gap, or past the first token the
//!   grammar refuses, is not written (its position stays masked and is predicted again with more context). So no
//!   committed token can ever make the output impossible to finish: there is no out-of-order commit to regret;
//! - the predictions of the chain (the predicted positions contiguous from the frontier, at most [`CHAIN`]) come from
//!   the grammar's distribution: position k's row masked to the tokens the grammar takes after the chain's
//!   predictions before it ([`Constraint::advance`], undone by [`Constraint::retreat`]), then predicted as any row
//!   is (greedy: the masked argmax; sampling: a draw from the masked softmax(logits / T), top-k / top-p truncating
//!   the allowed tokens). Their entropy and confidence are the masked distribution's, so the acceptance rule sees
//!   how sure the model is among the texts the grammar allows, and a run it accepts is one the grammar takes. If
//!   the rule took nothing at the frontier, the frontier is forced, so every step commits at least one token;
//! - after a commit, the tokens the grammar forces next (`{"name": "` and the like) are written at once, without a
//!   forward ([`Constraint::forced`]): the model then reads them on both sides of the positions it predicts.
//!
//! End of text: any of the request's end-of-text ids stands for the grammar's end; it is allowed exactly where the
//! grammar accepts the output as it is.

use crate::error::{Error, Result};
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

/// The grammar at one position ([`Constraint::here`]): the tokens it allows, and the token it forces, if any.
pub type Here = (SimpleVob, Option<u32>);

/// One generation's grammar, at its committed frontier.
pub struct Constraint {
    matcher: Matcher,
    /// The request field the grammar came from (`response_format`, `grammar`, `regex`), named in errors.
    field: &'static str,
    /// The token the grammar's token environment calls end of text.
    env_eos: u32,
    /// The request's end-of-text ids (the profile's and the stop token ids), each the grammar's end.
    eos_ids: Vec<u32>,
    /// The vocabulary's size (the masks' length).
    vocab: usize,
    /// Generated tokens committed so far (the frontier, counted from the prompt's end).
    consumed: usize,
}

impl Constraint {
    /// `matcher`: the request's grammar (from request field `field`) compiled over the model's vocabulary of
    /// `vocab` tokens, whose token environment ends text with `env_eos`. The grammar's first step is taken here (its
    /// first mask and forced tokens), so that a grammar that admits no text, or that is too complex for the step's
    /// budgets, is refused before the generation starts.
    pub fn new(
        matcher: Matcher,
        field: &'static str,
        env_eos: u32,
        eos_ids: Vec<u32>,
        vocab: usize,
    ) -> Result<Constraint> {
        let mut c = Constraint { matcher, field, env_eos, eos_ids, vocab, consumed: 0 };
        if c.matcher.is_error() {
            return Err(c.failed("compiling it"));
        }
        c.mask()?;
        let _ = c.forced();
        if c.matcher.is_error() {
            return Err(c.failed("at its first token"));
        }
        Ok(c)
    }

    /// The frontier: generated positions committed so far (an offset from the prompt's end).
    pub fn frontier(&self) -> usize {
        self.consumed
    }

    /// Whether the grammar has ended (its end of text committed, or no more text possible and committed so).
    pub fn ended(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn grammar_token(&self, t: u32) -> u32 {
        if self.eos_ids.contains(&t) {
            self.env_eos
        } else {
            t
        }
    }

    /// The grammar's parser stopped (an error, a budget spent, a language with no word): the request's grammar is at
    /// fault, so the error is the request's, naming its field, with llguidance's reason (its first line).
    fn failed(&self, what: &str) -> Error {
        let why = match self.matcher.get_error() {
            Some(e) => e,
            None => format!("{:?}", self.matcher.stop_reason()),
        };
        let why = why.lines().next().unwrap_or("").trim_start_matches("parser error: ").to_string();
        Error::invalid(format!("{}: the grammar's parser gave up {what}: {why}", self.field))
    }

    /// How many of `tokens`, placed at the frontier, the grammar takes (without committing them).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> Result<usize> {
        if self.ended() {
            // after the grammar's end only the end of text is text: the output ends there
            return Ok(tokens.iter().take_while(|t| self.eos_ids.contains(t)).count());
        }
        let mapped: Vec<u32> = tokens.iter().map(|&t| self.grammar_token(t)).collect();
        self.matcher.validate_tokens(&mapped).map_err(|_| self.failed("checking tokens"))
    }

    /// The tokens the grammar takes at the frontier (the end-of-text ids where it accepts the output as it is).
    pub fn mask(&mut self) -> Result<SimpleVob> {
        let accepting = self.matcher.is_accepting().map_err(|_| self.failed("at an end of text"))?;
        let mut m = if self.ended() {
            SimpleVob::alloc(self.vocab)
        } else {
            self.matcher.compute_mask().map_err(|_| self.failed("computing a mask"))?
        };
        for &e in &self.eos_ids {
            if (e as usize) < m.len() {
                m.set(e as usize, accepting || self.ended());
            }
        }
        if m.is_zero() {
            return Err(Error::invalid(format!(
                "{}: the grammar admits no token here (its language may have no word)",
                self.field
            )));
        }
        Ok(m)
    }

    /// Commit `tokens` at the frontier (a run [`Constraint::valid_prefix`] took).
    pub fn commit(&mut self, tokens: &[u32]) -> Result<()> {
        if !self.ended() {
            let mapped: Vec<u32> = tokens.iter().map(|&t| self.grammar_token(t)).collect();
            self.matcher.consume_tokens(&mapped).map_err(|_| self.failed("committing tokens"))?;
        }
        self.consumed += tokens.len();
        Ok(())
    }

    /// The decoder phase: of the step's `decided` positions (absolute, ascending, with their tokens), those it may
    /// write: the run contiguous from the frontier at absolute position `front`, as far as the grammar takes it. An
    /// empty run forces the frontier (`at_frontier`: its masked prediction, when the step predicted it), so a step
    /// always writes a token.
    pub fn keep(
        &mut self,
        front: usize,
        decided: &[(usize, u32)],
        at_frontier: Option<u32>,
    ) -> Result<Vec<(usize, u32)>> {
        let mut run: Vec<(usize, u32)> =
            decided.iter().enumerate().take_while(|&(i, &(p, _))| p == front + i).map(|(_, &d)| d).collect();
        if run.is_empty() {
            match at_frontier {
                Some(t) => run.push((front, t)),
                None => return Ok(vec![]),
            }
        }
        let tokens: Vec<u32> = run.iter().map(|&(_, t)| t).collect();
        let n = self.valid_prefix(&tokens)?;
        run.truncate(n);
        if run.is_empty() {
            // the frontier's prediction came from the masked distribution: the grammar takes it
            return Err(Error::Internal("the grammar refused the frontier's masked prediction".into()));
        }
        Ok(run)
    }

    /// Take `t` after the frontier (and the tokens advanced before it), for the next position's mask: false (nothing
    /// taken) for an end of text, or once the grammar has ended. [`Constraint::retreat`] undoes it.
    pub fn advance(&mut self, t: u32) -> Result<bool> {
        if self.ended() || self.eos_ids.contains(&t) {
            return Ok(false);
        }
        self.matcher.consume_token(t).map_err(|_| self.failed("taking a predicted token"))?;
        Ok(true)
    }

    /// Whether `t` is one of the request's end-of-text ids (the grammar's end).
    pub fn is_end(&self, t: u32) -> bool {
        self.eos_ids.contains(&t)
    }

    /// The grammar where it stands (the frontier and the tokens advanced after it): the tokens it allows and the token
    /// it forces there (the first of its forced tokens, which constrained AR writes without a forward).
    pub fn here(&mut self) -> Result<Here> {
        let here = (self.mask()?, self.forced().first().copied());
        self.check()?;
        Ok(here)
    }

    /// The grammar at each position of `tokens` placed at the frontier, as far as it takes them: at position i, the
    /// grammar [`Constraint::here`] after `tokens[..i]`, for i up to the first token it refuses (or that is not the
    /// one it forces) or the first end of text (both included), else up to `tokens.len()` (the position after them).
    /// The grammar stays at the frontier.
    pub fn along(&mut self, tokens: &[u32]) -> Result<Vec<Here>> {
        let mut out = Vec::with_capacity(tokens.len() + 1);
        let mut walked = 0;
        for i in 0..=tokens.len() {
            let (m, f) = self.here()?;
            let taken = i < tokens.len() && m.get(tokens[i] as usize) && f.is_none_or(|f| f == tokens[i]);
            out.push((m, f));
            if !taken || !self.advance(tokens[i])? {
                break;
            }
            walked += 1;
        }
        self.retreat(walked)?;
        Ok(out)
    }

    /// Undo the last `n` [`Constraint::advance`]s: the grammar back at the frontier.
    pub fn retreat(&mut self, n: usize) -> Result<()> {
        self.matcher.rollback(n).map_err(|_| self.failed("stepping back"))
    }

    /// The tokens the grammar forces after the frontier (none once it has ended).
    pub fn forced(&mut self) -> Vec<u32> {
        if self.ended() {
            return vec![];
        }
        self.matcher.compute_ff_tokens()
    }

    /// An error the grammar's parser met since the last check (a budget spent while computing forced tokens).
    pub fn check(&self) -> Result<()> {
        match self.matcher.is_error() {
            true => Err(self.failed("on the way")),
            false => Ok(()),
        }
    }
}

/// The most positions after the frontier a step predicts under the grammar (each takes a mask: about a millisecond
/// at a 150k vocabulary); the positions past them keep the model's own predictions, which the grammar rarely takes.
pub const CHAIN: usize = 16;

/// The logit a masked-out token gets: its probability underflows to exactly 0, while the row's statistics stay finite
/// (an infinite logit would make the entropy's terms 0 · ∞).
pub const MASKED_LOGIT: f32 = -1e30;

/// A logits row restricted to `mask`: every token it does not allow at [`MASKED_LOGIT`].
pub fn masked_row(row: &[f32], mask: &SimpleVob) -> Vec<f32> {
    row.iter().enumerate().map(|(i, &x)| if i < mask.len() && mask.get(i) { x } else { MASKED_LOGIT }).collect()
}

//! A model's grammar compiler: its vocabulary handed to [`Grammars`] once, on the first constrained request.

use crate::decode::grammar::compile::{GrammarSpec, Grammars, Vocabulary};
use crate::decode::grammar::constraint::Constraint;
use crate::error::Result;
use crate::model::Model;

impl Model {
    /// The request's grammar (`spec`, from request field `field`) compiled over this model's vocabulary, for an
    /// output whose end-of-text ids are `eos_ids`. The token environment is made on the first call.
    pub fn constraint(&self, field: &'static str, spec: &GrammarSpec, eos_ids: &[u32]) -> Result<Constraint> {
        let g = match self.grammars.get() {
            Some(g) => g,
            None => {
                let made = Grammars::new(self.vocabulary()?)?;
                self.grammars.get_or_init(|| made)
            }
        };
        g.constraint(field, spec, eos_ids)
    }

    /// Every token's bytes, which are control tokens (the special added tokens the model names as such), the first
    /// end-of-text id, and the tokenizer.
    fn vocabulary(&self) -> Result<Vocabulary> {
        let ids: Vec<i64> = (0..self.config.vocab_size as i64).collect();
        let specials: std::collections::HashSet<&str> = self.special_tokens.iter().map(String::as_str).collect();
        let added = self.tokenizer.get_added_tokens_decoder();
        let control = (0..ids.len() as u32)
            .map(|id| added.get(&id).is_some_and(|t| t.special && specials.contains(t.content.as_str())))
            .collect();
        Ok(Vocabulary {
            words: self.token_bytes(&ids)?,
            control,
            eos: self.profile.eos_token_ids.first().copied().unwrap_or(0),
            tokenizer: self.tokenizer.clone(),
        })
    }
}

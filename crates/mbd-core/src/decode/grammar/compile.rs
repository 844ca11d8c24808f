//! Grammars compiled over a vocabulary (llguidance): the token environment (every token's bytes, control tokens
//! marked so that no grammar's text can spell them, and a tokenizer for the text a grammar forces), and a request's
//! grammar compiled under budgets ([`GrammarLimits`]) into a [`Constraint`], its errors the request's.

use super::constraint::Constraint;
use crate::error::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON value matching this schema (`response_format` `json_schema`).
    JsonSchema(Value),
    /// Any JSON object (`response_format` `json_object`).
    JsonObject,
    /// A Lark grammar, or llguidance's grammar JSON (`grammar`).
    Grammar(String),
    /// A regular expression (`regex`).
    Regex(String),
}

/// The budgets of a grammar's compilation and of each step's mask: llguidance's fuel and sizes, so that no schema or
/// grammar can hold a step for long or take much memory (a request that needs more gets an error naming its field).
pub struct GrammarLimits;

impl GrammarLimits {
    /// Lexer work to build a grammar's regexes (about 50 units per µs: some 20 ms).
    const INITIAL_LEXER_FUEL: u64 = 1_000_000;
    /// Lexer work per token mask (about 14 units per µs: some 15 ms).
    const STEP_LEXER_FUEL: u64 = 200_000;
    /// Earley items per token mask.
    const STEP_MAX_ITEMS: usize = 50_000;
    /// Lexer states (each 1-2 kB).
    const MAX_LEXER_STATES: usize = 100_000;
    /// Symbols in a grammar's productions (a few megabytes of JSON at llguidance's default of 500k).
    const MAX_GRAMMAR_SIZE: usize = 200_000;
}

/// The model's vocabulary as llguidance reads it.
struct Env {
    trie: TokTrie,
    /// The tokenizer, control-token spellings read as text (forced text is text).
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            // a part of a character: no tokenizer takes it as text
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// A model's grammar compiler (made once per model, on the first constrained request).
pub struct Grammars {
    factory: ParserFactory,
    eos: u32,
    vocab: usize,
}

/// A vocabulary as the grammar compiler reads it.
pub struct Vocabulary {
    /// Every token's bytes, by id.
    pub words: Vec<Vec<u8>>,
    /// Which ids are control tokens (never a piece of a grammar's text).
    pub control: Vec<bool>,
    /// The end-of-text id the grammar's end stands for.
    pub eos: u32,
    /// The tokenizer, for the text a grammar forces (its control-token spellings are read as text here).
    pub tokenizer: tokenizers::Tokenizer,
}

impl Grammars {
    /// The compiler over `v` (made once per model: the token trie takes some 100 ms at a 150k vocabulary).
    pub fn new(v: Vocabulary) -> Result<Grammars> {
        let Vocabulary { mut words, control, eos, mut tokenizer } = v;
        let vocab = words.len();
        for (w, _) in words.iter_mut().zip(&control).filter(|(_, c)| **c) {
            w.insert(0, TokTrie::SPECIAL_TOKEN_MARKER); // llguidance's marker of a control token
        }
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        tokenizer.set_encode_special_tokens(true);
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let caps =
            InferenceCapabilities { ff_tokens: true, conditional_ff_tokens: false, backtrack: false, fork: false };
        let mut factory = ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
            .map_err(|e| Error::Internal(format!("the grammar compiler cannot read this vocabulary: {e}")))?;
        factory.quiet();
        let l = factory.limits_mut();
        l.initial_lexer_fuel = GrammarLimits::INITIAL_LEXER_FUEL;
        l.step_lexer_fuel = GrammarLimits::STEP_LEXER_FUEL;
        l.step_max_items = GrammarLimits::STEP_MAX_ITEMS;
        l.max_lexer_states = GrammarLimits::MAX_LEXER_STATES;
        l.max_grammar_size = GrammarLimits::MAX_GRAMMAR_SIZE;
        Ok(Grammars { factory, eos, vocab })
    }

    /// `spec` compiled (`field`: the request field it came from, named in errors), at the start of an output whose
    /// end-of-text ids are `eos_ids`.
    pub fn constraint(&self, field: &'static str, spec: &GrammarSpec, eos_ids: &[u32]) -> Result<Constraint> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(json_layout(s.clone())),
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(json_layout(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::Grammar(g) => TopLevelGrammar::from_lark_or_grammar_list(g)
                .map_err(|e| Error::invalid(format!("{field}: not a grammar llguidance reads: {e}")))?,
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| Error::invalid(format!("{field}: {e}")))?;
        Constraint::new(Matcher::new(Ok(parser)), field, self.eos, eos_ids.to_vec(), self.vocab)
    }
}

/// A JSON schema with the output's layout unless it sets its own (llguidance's `x-guidance`): one line, items and
/// keys separated as Python's `json.dumps` separates them (`", "`, `": "`), no other whitespace. Free whitespace
/// would let a model spend its tokens on spaces and newlines that no parser needs.
fn json_layout(schema: Value) -> Value {
    let layout = serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    match schema {
        Value::Object(mut m) => {
            m.entry("x-guidance").or_insert(layout);
            Value::Object(m)
        }
        // `true`: any JSON value
        Value::Bool(true) => serde_json::json!({"x-guidance": layout}),
        other => other,
    }
}

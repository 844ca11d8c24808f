//! A model's tokenizer: tokenizer.json (or a GGUF file's vocabulary as that JSON) into the tokenizers library's
//! `Tokenizer`, and the mask token its added tokens name.

use crate::error::{Error, Result};
use std::path::Path;

/// tokenizer.json, with any padding or truncation it configures switched off: transformers switches them off
/// for a plain call too, and a fixed padding length taken from the file would size every encoding (a hostile
/// `"Fixed": 2^40` aborts on the first prompt) while truncation would silently cut prompts.
/// The tokenizers library panics on some malformed files (a syntax error inside `decoder`, a BPE merge shorter
/// than `continuing_subword_prefix`): the JSON syntax is checked first, and a panic while building is caught
/// here and reported as this file's error.
/// tokenizer.json must be a regular file of at most this many bytes (Gemma 3's 262K-token one is 33 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

pub fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let p = dir.join("tokenizer.json");
    let bytes = crate::util::read_model_file(&p, MAX_TOKENIZER_BYTES, "the tokenizer (tokenizer.json)")?;
    let text = String::from_utf8(bytes)
        .map_err(|_| Error::load(format!("{}: not a valid tokenizer: not UTF-8 text", p.display())))?;
    tokenizer_from_json(&text, &p.display().to_string())
}

/// The longest added token accepted, in bytes. Real ones are a few dozen (`<|im_start|>`,
/// `<|reserved_special_token_250|>`, runs of spaces). The tokenizers library matches added tokens with an
/// Aho-Corasick automaton, built as a DFA when there are at most 100 of them, in time that grows with the square of
/// their length for some texts: one 47 KB control token held a load for a minute, 96 periodic ones of 1 KB for 27 s
/// (of 256 bytes: 1.3 s).
pub const MAX_ADDED_TOKEN_BYTES: usize = 256;

/// The added tokens of a tokenizer.json, read for their length only (the tokenizers library checks the rest).
#[derive(serde::Deserialize)]
struct AddedTokens {
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
}

#[derive(serde::Deserialize)]
struct AddedToken {
    id: Option<u64>,
    content: Option<String>,
}

/// A tokenizer from the text of a tokenizer.json (`label`: where it came from, for messages).
pub fn tokenizer_from_json(text: &str, label: &str) -> Result<tokenizers::Tokenizer> {
    let bad = |why: String| Error::load(format!("{label}: not a valid tokenizer: {why}"));
    let malformed = |e: serde_json::Error| {
        bad(format!("malformed JSON ({:?} error at line {} column {})", e.classify(), e.line(), e.column()))
    };
    // one pass reads the added tokens and checks the syntax of the whole text; where the added tokens are not of
    // the expected shape (the tokenizers library names that), the syntax is checked alone
    let added = match serde_json::from_str::<AddedTokens>(text) {
        Ok(a) => Some(a),
        Err(e) if e.is_data() => {
            serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(malformed)?;
            None
        }
        Err(e) => return Err(malformed(e)),
    };
    if let Some(a) = added {
        for (i, t) in a.added_tokens.iter().enumerate() {
            let n = t.content.as_ref().map_or(0, |c| c.len());
            if n > MAX_ADDED_TOKEN_BYTES {
                let id = t.id.map(|x| format!(" (id {x})")).unwrap_or_default();
                return Err(bad(format!(
                    "added token {i}{id} is {n} bytes long; at most {MAX_ADDED_TOKEN_BYTES} are accepted (control \
                     and added tokens are short markers)"
                )));
            }
        }
    }
    let built = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>());
    let mut tok = match built {
        Ok(r) => r.map_err(|e| bad(e.to_string()))?,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            return Err(bad(format!("the tokenizers library failed on it ({msg})")));
        }
    };
    tok.with_padding(None);
    tok.with_truncation(None).map_err(|e| Error::load(format!("{label}: {e}")))?;
    Ok(tok)
}

/// A mask token named in the tokenizer's added tokens (spellings differ between families' files).
pub fn tokenizer_mask_id(tok: &tokenizers::Tokenizer) -> Option<u32> {
    ["<|mask|>", "<|MASK|>", "|<MASK>|", "<MASK>", "<mask>"].iter().find_map(|s| tok.token_to_id(s))
}

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
pub fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let p = dir.join("tokenizer.json");
    if !p.exists() {
        return Err(Error::FileNotFound { path: p, what: "the tokenizer (tokenizer.json)".into() });
    }
    let bad = |why: String| Error::load(format!("{}: not a valid tokenizer: {why}", p.display()));
    let text = std::fs::read_to_string(&p).map_err(|e| bad(e.to_string()))?;
    tokenizer_from_json(&text, &p.display().to_string())
}

/// A tokenizer from the text of a tokenizer.json (`label`: where it came from, for messages).
pub fn tokenizer_from_json(text: &str, label: &str) -> Result<tokenizers::Tokenizer> {
    let bad = |why: String| Error::load(format!("{label}: not a valid tokenizer: {why}"));
    serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| {
        bad(format!("malformed JSON ({:?} error at line {} column {})", e.classify(), e.line(), e.column()))
    })?;
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

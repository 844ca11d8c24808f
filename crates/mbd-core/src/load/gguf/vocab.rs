//! A GGUF file's vocabulary as a Hugging Face tokenizer.json (`tokenizer_json`: the byte-level BPE, its merges, the
//! pre-tokenizer, the control and added tokens), and its chat template.

use super::container::GgufFile;
use crate::error::{Error, Result};
use serde_json::{json, Map, Value};

impl GgufFile {
    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.get(key)? {
            None => Ok(None),
            Some(Value::Array(a)) => {
                a.iter().map(|v| v.as_str()).collect::<Option<Vec<_>>>().map(Some).ok_or_else(|| {
                    Error::load(format!("{}: metadata '{key}' must be a list of strings", self.where_()))
                })
            }
            Some(v) => Err(Error::load(format!(
                "{}: metadata '{key}' must be a list of strings, found {}",
                self.where_(),
                crate::load::json::type_name(v)
            ))),
        }
    }

    /// The Hugging Face tokenizer.json of the file's vocabulary: a byte-level BPE (`tokenizer.ggml.model` =
    /// `gpt2`) with the vocabulary and merges of the file, the pre-tokenizer its `tokenizer.ggml.pre` names
    /// (`qwen2`, or the GPT-2 split for `default`/`gpt2`/unset), control tokens as special added tokens, other
    /// user-defined tokens as added tokens. The `[PAD<n>]` entries llama.cpp's converter writes to fill the
    /// embedding up to the model's vocab_size are not tokens and are left out.
    pub fn tokenizer_json(&self) -> Result<Value> {
        let w = self.where_();
        match self.get("tokenizer.ggml.model")? {
            Some(Value::String(m)) if m == "gpt2" => {}
            Some(Value::String(m)) => {
                return Err(Error::Unsupported(format!(
                    "{w}: tokenizer.ggml.model '{m}' is not supported (only byte-level BPE, 'gpt2', as Qwen models use)"
                )))
            }
            _ => return Err(Error::load(format!("{w}: metadata 'tokenizer.ggml.model' is missing: no tokenizer"))),
        }
        let tokens = self
            .strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| Error::load(format!("{w}: metadata 'tokenizer.ggml.tokens' is missing")))?;
        let types: Vec<u64> = match self.get("tokenizer.ggml.token_type")? {
            None => vec![1; tokens.len()],
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(0)).collect(),
            Some(_) => return Err(Error::load(format!("{w}: metadata 'tokenizer.ggml.token_type' must be a list"))),
        };
        if types.len() != tokens.len() {
            return Err(Error::load(format!(
                "{w}: {} tokens but {} token types (tokenizer.ggml.token_type)",
                tokens.len(),
                types.len()
            )));
        }
        let merges = self.strings("tokenizer.ggml.merges")?.unwrap_or_default();
        let is_pad = |t: &str| {
            t.strip_prefix("[PAD")
                .and_then(|r| r.strip_suffix(']'))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        };
        // Every token at its own id in the BPE vocabulary, control and user-defined ones too: the tokenizers library
        // gives an added token the id its text has in the vocabulary, and numbers one whose text is not there after
        // the vocabulary, whatever id tokenizer.json says (HF's tokenizer.json files list them in both places).
        let mut vocab = Map::new();
        let (mut added, mut unused) = (vec![], vec![]);
        for (i, (&t, &ty)) in tokens.iter().zip(&types).enumerate() {
            let special = match ty {
                // normal, unknown, byte
                1 | 2 | 6 => None,
                // control: special added tokens; user-defined: added tokens
                3 => Some(true),
                4 if is_pad(t) => continue,
                4 => Some(false),
                // unused: in the vocabulary where its text is free, after the others (it is never produced)
                5 => {
                    unused.push(i);
                    continue;
                }
                other => return Err(Error::load(format!("{w}: token {i} {t:?} has unknown token type {other}"))),
            };
            if let Some(prev) = vocab.insert(t.to_string(), json!(i)) {
                return Err(Error::load(format!(
                    "{w}: token {i} {t:?} appears twice in the vocabulary (also token {prev}, tokenizer.ggml.tokens)"
                )));
            }
            if let Some(special) = special {
                added.push(json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special}));
            }
        }
        for i in unused {
            if !vocab.contains_key(tokens[i]) {
                vocab.insert(tokens[i].to_string(), json!(i));
            }
        }
        for m in &merges {
            let ok = m
                .split_once(' ')
                .is_some_and(|(a, b)| !b.contains(' ') && vocab.contains_key(a) && vocab.contains_key(b));
            if !ok {
                return Err(Error::load(format!(
                    "{w}: merge {m:?} (tokenizer.ggml.merges) is not two vocabulary tokens separated by a space"
                )));
            }
        }
        let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": regex});
        let (normalizer, pre) = match self.get("tokenizer.ggml.pre")?.and_then(|v| v.as_str()) {
            // Qwen2's tokenizer.json normalises to NFC; Qwen3.5's has no normaliser (llama.cpp's golden vectors for
            // it keep a decomposed "e" + U+0301 as two tokens)
            Some(name @ ("qwen2" | "qwen35")) => (
                if name == "qwen2" { json!({"type": "NFC"}) } else { Value::Null },
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": if name == "qwen2" { QWEN2_SPLIT } else { QWEN35_SPLIT }},
                     "behavior": "Isolated", "invert": false},
                    byte_level(false)]}),
            ),
            None | Some("default") | Some("gpt2") => (Value::Null, byte_level(true)),
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{w}: tokenizer.ggml.pre '{other}' (the pre-tokenizer) is not supported; supported: qwen2, \
                     qwen35, default, gpt2"
                )))
            }
        };
        let add_bos = self.get("tokenizer.ggml.add_bos_token")?.and_then(|v| v.as_bool()).unwrap_or(false);
        let post = match (add_bos, self.get("tokenizer.ggml.bos_token_id")?.and_then(|v| v.as_u64())) {
            (true, Some(b)) => {
                let bos = tokens.get(b as usize).ok_or_else(|| {
                    Error::load(format!("{w}: tokenizer.ggml.bos_token_id {b} is outside the vocabulary"))
                })?;
                json!({"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {*bos: {"id": bos, "ids": [b], "tokens": [bos]}}})
            }
            _ => Value::Null,
        };
        let merges: Vec<Value> = merges.iter().map(|m| json!(m)).collect();
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre,
            "post_processor": post,
            "decoder": byte_level(true),
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges},
        }))
    }

    /// `tokenizer.chat_template`, and the bos/eos token strings a template may use.
    pub fn chat_template(&self) -> Result<Option<(String, String, String)>> {
        let Some(v) = self.get("tokenizer.chat_template")? else { return Ok(None) };
        let Some(src) = v.as_str() else {
            return Err(Error::config(format!(
                "{}: metadata 'tokenizer.chat_template' must be a string",
                self.where_()
            )));
        };
        let tokens = self.strings("tokenizer.ggml.tokens")?.unwrap_or_default();
        let tok = |k: &str| -> Result<String> {
            Ok(self
                .get(&format!("tokenizer.ggml.{k}"))?
                .and_then(|v| v.as_u64())
                .and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string())
                .unwrap_or_default())
        };
        Ok(Some((src.to_string(), tok("bos_token_id")?, tok("eos_token_id")?)))
    }
}

/// Qwen2's pre-tokenizer split (llama.cpp's `qwen2` pre-tokenizer; the regex of Qwen2's tokenizer.json).
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's (llama.cpp's `qwen35` pre-tokenizer, the regex of Qwen3.5's tokenizer.json): Qwen2's with combining
/// marks (`\p{M}`) counted as letters.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

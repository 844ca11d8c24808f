//! Text in and out of a model: token ids checked against its vocabulary, tokenization, chat prompts rendered with
//! its template (contents kept as text), detokenization.
//!
//! One rule for text that enters the model's context: it is text. A chat message's content and every request field
//! of kind [`ParamKind::Text`] (`tccf_check`, `tccf_trigger`, and any
//! field added later) is tokenized by [`Model::literal_ids`], with control-token spellings (`<|im_end|>`) as plain
//! text, after its length was checked against its bound. Control tokens act only where the caller asks: a chat's
//! `special_tokens_in_content`, a raw prompt (the caller's own canvas, as llama.cpp's and vLLM's completions take
//! it), or token ids.

use crate::error::{Error, Result};
use crate::model::Model;
use crate::params::request::{spec, token_ids, ParamKind, Rule};

/// Private-use characters around a message's index while a chat template renders ([`Model::chat_prompt_ids`]).
const PLACEHOLDER_OPEN: char = '\u{E000}';
const PLACEHOLDER_CLOSE: char = '\u{E001}';

impl Model {
    /// Token ids from a caller, checked against the vocabulary
    /// ([`request::token_ids`](crate::params::request::token_ids) owns the rule).
    pub fn token_ids(&self, name: &str, ids: &[i64]) -> Result<Vec<u32>> {
        token_ids(name, ids, self.config.vocab_size)
    }

    /// Check ids that are already u32 (e.g. from a Rust caller) against the vocabulary.
    pub fn check_ids(&self, name: &str, ids: &[u32]) -> Result<()> {
        let wide: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        self.token_ids(name, &wide).map(|_| ())
    }

    /// The ids of request field `name`'s text ([`ParamKind::Text`]): its length checked against its bounds
    /// (characters before tokenizing, then tokens), tokenized as plain text ([`Model::literal_ids`]).
    pub fn text_ids(&self, name: &str, text: &str) -> Result<Vec<u32>> {
        let s = spec(name).filter(|s| s.kind == ParamKind::Text).ok_or_else(|| {
            Error::Internal(format!("'{name}' is not a text field of the registry: it cannot enter the context"))
        })?;
        s.rule.check_text(name, text)?;
        let ids = self.literal_ids(text)?;
        if let Rule::Text { tokens, .. } = s.rule {
            if ids.len() > tokens {
                return Err(Error::invalid(if tokens == 1 {
                    format!("{name} must be one token of this model's vocabulary; {text:?} is {} tokens", ids.len())
                } else {
                    format!("{name} is {} tokens of this model's vocabulary; at most {tokens} are allowed", ids.len())
                }));
            }
        }
        Ok(ids)
    }

    /// `text` tokenized with control-token spellings as plain text (`<|im_end|>` becomes the tokens of its
    /// characters), the other added tokens as themselves.
    pub fn literal_ids(&self, text: &str) -> Result<Vec<u32>> {
        let tokenizer = if self.special_tokens.iter().any(|s| text.contains(s.as_str())) {
            // a second tokenizer that reads special tokens as text, made once, when a text first spells one
            self.literal_tokenizer.get_or_init(|| {
                let mut t = self.tokenizer.clone();
                t.set_encode_special_tokens(true);
                t
            })
        } else {
            &self.tokenizer
        };
        let enc = tokenizer.encode(text, false).map_err(|e| Error::invalid(format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| Error::invalid(format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// A prompt's token ids. A text longer than any prompt that fits the context (every token covers at most
    /// `max_token_bytes` bytes; with a margin of 4 for normalisers) is refused before it is tokenized.
    pub fn prompt_ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.check_prompt_bytes(text.len())?;
        self.tokenize(text, add_special_tokens)
    }

    fn check_prompt_bytes(&self, bytes: usize) -> Result<()> {
        let ctx = self.config.max_position_embeddings;
        let limit = ctx.saturating_mul(4 * self.max_token_bytes.max(16));
        if bytes > limit {
            return Err(Error::ContextLength(format!(
                "the prompt has {bytes} bytes of text; no prompt over {limit} bytes fits the maximum context of {ctx} tokens"
            )));
        }
        Ok(())
    }

    /// Token ids of a chat prompt (the template's rendering of `messages`, plus a generation prompt where
    /// `add_generation_prompt`): what a chat generation runs on, and what a tokenizer route must report. The
    /// template's own markup is tokenized with its control tokens; message contents stay text: a content that
    /// spells a control token (`<|im_end|><|im_start|>system`) is tokenized as plain text, unless
    /// `special_in_content`; roles are OpenAI's ([`load::chat::ROLES`](crate::load::chat::ROLES)).
    pub fn chat_prompt_ids(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
        special_in_content: bool,
    ) -> Result<Vec<u32>> {
        let texts = crate::load::chat::text_messages(messages)?;
        let messages = &*texts;
        if !special_in_content {
            self.check_unspelled(messages, extra)?;
        }
        // the messages' contents (None: an assistant message with tool calls and no content)
        let contents: Vec<Option<&str>> = match messages.as_array() {
            Some(list) => list.iter().map(|m| m.get("content").and_then(|c| c.as_str())).collect(),
            None => vec![],
        };
        let spelled = contents.iter().flatten().any(|c| self.special_tokens.iter().any(|s| c.contains(s.as_str())));
        if special_in_content || !spelled {
            return self.prompt_ids(&self.render_chat(messages, add_generation_prompt, extra)?, false);
        }
        // Render with a placeholder per content, then tokenize the markup between them with control tokens and
        // each content with control-token parsing off.
        let mut masked = messages.clone();
        let mut kept: Vec<&str> = vec![];
        for (m, c) in masked.as_array_mut().into_iter().flatten().zip(&contents) {
            if let Some(c) = c {
                m["content"] =
                    serde_json::Value::String(format!("{PLACEHOLDER_OPEN}{}{PLACEHOLDER_CLOSE}", kept.len()));
                kept.push(c);
            }
        }
        let text = self.render_chat(&masked, add_generation_prompt, extra)?;
        self.check_prompt_bytes(text.len() + kept.iter().map(|c| c.len()).sum::<usize>())?;
        let mut ids = vec![];
        let mut next = 0;
        let mut rest = text.as_str();
        while let Some(a) = rest.find(PLACEHOLDER_OPEN) {
            let after = &rest[a + PLACEHOLDER_OPEN.len_utf8()..];
            let b = after.find(PLACEHOLDER_CLOSE).ok_or_else(|| self.content_kept_error())?;
            let i: usize = after[..b].parse().map_err(|_| self.content_kept_error())?;
            if i != next {
                return Err(self.content_kept_error());
            }
            ids.extend(self.tokenize(&rest[..a], false)?);
            ids.extend(self.literal_ids(kept[i])?);
            next += 1;
            rest = &after[b + PLACEHOLDER_CLOSE.len_utf8()..];
        }
        if next != kept.len() {
            return Err(self.content_kept_error());
        }
        ids.extend(self.tokenize(rest, false)?);
        Ok(ids)
    }

    /// The text a chat renders besides its contents (tool calls, tool call ids, names, the tool definitions in
    /// `extra`) is text too; the template writes it into its markup, where no placeholder can keep it apart, so a
    /// control token's spelling there is refused, naming the field.
    fn check_unspelled(&self, messages: &serde_json::Value, extra: &serde_json::Value) -> Result<()> {
        fn walk<'a>(v: &'a serde_json::Value, path: String, out: &mut Vec<(String, &'a str)>) {
            match v {
                serde_json::Value::String(s) => out.push((path, s)),
                serde_json::Value::Array(a) => {
                    a.iter().enumerate().for_each(|(i, x)| walk(x, format!("{path}[{i}]"), out))
                }
                serde_json::Value::Object(o) => o.iter().for_each(|(k, x)| walk(x, format!("{path}.{k}"), out)),
                _ => {}
            }
        }
        let mut strings = vec![];
        for (i, m) in messages.as_array().into_iter().flatten().enumerate() {
            for (k, v) in m.as_object().into_iter().flatten().filter(|(k, _)| *k != "content" && *k != "role") {
                walk(v, format!("messages[{i}].{k}"), &mut strings);
            }
        }
        for (k, v) in extra.as_object().into_iter().flatten() {
            walk(v, k.clone(), &mut strings);
        }
        for (path, s) in strings {
            if let Some(t) = self.special_tokens.iter().find(|t| s.contains(t.as_str())) {
                return Err(Error::invalid(format!(
                    "{path} spells the control token {t:?}: tool calls and tool definitions are text, and the chat \
                     template writes them into its markup; remove it, or pass special_tokens_in_content=True to let \
                     it act as one"
                )));
            }
        }
        Ok(())
    }

    fn content_kept_error(&self) -> Error {
        Error::invalid(format!(
            "a message content spells a control token (one of {:?}) and this chat template changes contents, so they \
             cannot be kept as plain text; remove it, or pass special_tokens_in_content=True to let it act as one",
            self.special_tokens
        ))
    }

    /// The bytes each token stands for, before UTF-8 decoding: a token that holds part of a character (byte-level
    /// BPE splits multi-byte characters; byte-fallback tokens are single bytes) gives its bytes, where its decoded
    /// text alone would be U+FFFD. Added tokens give their text's bytes.
    pub fn token_bytes(&self, ids: &[i64]) -> Result<Vec<Vec<u8>>> {
        let ids = self.token_ids("ids", ids)?;
        let byte_level = matches!(self.tokenizer.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        let added = self.tokenizer.get_added_tokens_decoder();
        ids.iter()
            .map(|&id| {
                if let Some(t) = added.get(&id) {
                    return Ok(t.content.clone().into_bytes());
                }
                let piece = self.tokenizer.id_to_token(id).unwrap_or_default();
                if let Some(b) = byte_fallback(&piece) {
                    return Ok(vec![b]);
                }
                if byte_level {
                    if let Some(bytes) = byte_level_bytes(&piece) {
                        return Ok(bytes);
                    }
                }
                let text = self
                    .tokenizer
                    .decode(&[id], false)
                    .map_err(|e| Error::invalid(format!("cannot detokenize: {e}")))?;
                Ok(text.into_bytes())
            })
            .collect()
    }

    pub fn detokenize(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids = self.token_ids("ids", ids)?;
        self.tokenizer.decode(&ids, skip_special_tokens).map_err(|e| Error::invalid(format!("cannot detokenize: {e}")))
    }

    /// Render chat `messages` (a JSON list of {role, content}) with the model's template; `extra` are more
    /// template variables (a JSON object or null).
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let tmpl = self.chat_template.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "{}: this model has no chat template (no chat_template.jinja and no 'chat_template' in tokenizer_config.json)",
                self.dir.display()
            ))
        })?;
        tmpl.render(&*crate::load::chat::text_messages(messages)?, add_generation_prompt, extra)
    }
}

/// A byte-fallback token's byte (SentencePiece's `<0xE2>`).
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The bytes GPT-2's byte-level alphabet spells as themselves.
const fn printable(b: u8) -> bool {
    (b >= b'!' && b <= b'~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE
}

/// The other 68 bytes, in byte order: the alphabet spells the i-th as U+0100 + i.
const SHIFTED: [u8; 68] = {
    let mut shifted = [0u8; 68];
    let (mut b, mut n) = (0usize, 0usize);
    while b < 256 {
        if !printable(b as u8) {
            shifted[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    shifted
};

/// The bytes of a byte-level BPE token (GPT-2's alphabet: each byte is one character, the printable ones as
/// themselves, the other 68 as U+0100 onwards in byte order); None when a character is outside that alphabet.
fn byte_level_bytes(piece: &str) -> Option<Vec<u8>> {
    piece
        .chars()
        .map(|c| {
            let u = c as u32;
            if u < 256 && printable(u as u8) {
                Some(u as u8)
            } else if (256..256 + 68).contains(&u) {
                Some(SHIFTED[(u - 256) as usize])
            } else {
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_round_trips_every_byte() {
        // GPT-2's bytes_to_unicode, written out: printable bytes map to themselves, the rest to 256 + rank
        let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut next = 256u32;
        for b in 0..=255u8 {
            let c = if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            };
            assert_eq!(byte_level_bytes(&c.to_string()), Some(vec![b]), "byte {b}");
        }
        assert_eq!(next, 256 + 68);
        // "Ġ" is the space, "âĢ" the first two bytes of U+2019 (E2 80 99)
        assert_eq!(byte_level_bytes("Ġhi"), Some(b" hi".to_vec()));
        assert_eq!(byte_level_bytes("âĢ"), Some(vec![0xE2, 0x80]));
        assert_eq!(byte_level_bytes("漢"), None);
        assert_eq!(byte_fallback("<0xE2>"), Some(0xE2));
        assert_eq!(byte_fallback("<0xE>"), None);
    }
}

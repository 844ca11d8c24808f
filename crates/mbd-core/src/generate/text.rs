//! Incremental detokenisation of the stable prefix: emits text left to right, holding back an incomplete
//! UTF-8 sequence and any suffix that could be the start of a stop string.

/// Incremental detokenisation of a growing token list: each call decodes only the tokens since the last
/// point where the text was complete (plus the previous step's tokens for context), instead of the whole list,
/// so a stream of n tokens costs O(n) decoding in all rather than O(n²). Same scheme as the usual
/// "prefix offset / read offset" streamers: the new text is decode(ids[prefix..]) minus decode(ids[prefix..read]).
#[derive(Default)]
pub struct Detok {
    prefix: usize,
    read: usize,
    text: String,
}

impl Detok {
    /// The text of `ids` (all tokens so far; only ever appended to between calls). A trailing incomplete
    /// character shows as U+FFFD (TextStream holds it back). With `is_final` the whole list is decoded once,
    /// so the final text is exactly the one-shot decoding.
    pub fn text<E>(
        &mut self,
        ids: &[u32],
        is_final: bool,
        decode: impl Fn(&[u32]) -> Result<String, E>,
    ) -> Result<String, E> {
        if is_final {
            return decode(ids);
        }
        let prev = decode(&ids[self.prefix..self.read])?;
        let cur = decode(&ids[self.prefix..])?;
        let Some(new) = cur.strip_prefix(prev.as_str()) else {
            // the tail re-rendered earlier text (rare): decode it all; resume from here
            let all = decode(ids)?;
            if !all.ends_with('\u{FFFD}') {
                self.text = all.clone();
                self.prefix = ids.len();
                self.read = ids.len();
            }
            return Ok(all);
        };
        if new.is_empty() || new.ends_with('\u{FFFD}') {
            return Ok(format!("{}{new}", self.text));
        }
        self.text.push_str(new);
        self.prefix = self.read;
        self.read = ids.len();
        Ok(self.text.clone())
    }
}

pub struct TextStream {
    stop: Vec<String>,
    emitted: usize,
    text: String,
}

pub struct TextUpdate {
    pub new_text: String,
    /// A stop string was found; `new_text` ends right before it.
    pub stopped: Option<String>,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        TextStream { stop: stop.into_iter().filter(|s| !s.is_empty()).collect(), emitted: 0, text: String::new() }
    }

    /// All text emitted so far (tests).
    #[cfg(test)]
    fn emitted_text(&self) -> &str {
        &self.text[..self.emitted]
    }

    /// `text`: the decoding of every stable completion token so far; `is_final`: no more tokens will come.
    pub fn update(&mut self, text: String, is_final: bool) -> TextUpdate {
        if !text.starts_with(&self.text[..self.emitted]) {
            // The tokenizer re-rendered earlier text (rare); wait for the final flush to emit the rest.
            if !is_final {
                return TextUpdate { new_text: String::new(), stopped: None };
            }
        }
        self.text = text;
        let start = self.emitted.min(self.text.len());
        // Incomplete UTF-8 at the end (a character still arriving) decodes to U+FFFD: until the final update that
        // tail is not text yet, so it is neither searched for stop strings nor emitted.
        let mut settled = self.text.len();
        if !is_final {
            while self.text[..settled].ends_with('\u{FFFD}') {
                settled -= '\u{FFFD}'.len_utf8();
            }
        }
        let settled = settled.max(start);
        // Stop strings may straddle what was already emitted: search from the earliest place they could begin.
        let max_stop = self.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut search_from = start.saturating_sub(max_stop.saturating_sub(1));
        while !self.text.is_char_boundary(search_from) {
            search_from -= 1;
        }
        let hit = self
            .stop
            .iter()
            .filter_map(|s| self.text[search_from..settled].find(s.as_str()).map(|i| (search_from + i, s.clone())))
            .min_by_key(|(i, _)| *i);
        if let Some((at, s)) = hit {
            let at = at.max(start);
            let new_text = self.text[start..at].to_string();
            self.emitted = at;
            return TextUpdate { new_text, stopped: Some(s) };
        }
        let mut end = settled;
        if !is_final {
            // a possible stop-string prefix
            let mut hold = end;
            for s in &self.stop {
                for (k, _) in s.char_indices().skip(1) {
                    let pre = &s[..k];
                    if self.text[..end].ends_with(pre) {
                        hold = hold.min(end - pre.len());
                    }
                }
            }
            end = hold;
        }
        let end = end.max(start);
        let new_text = self.text[start..end].to_string();
        self.emitted = end;
        TextUpdate { new_text, stopped: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_still_arriving_is_not_searched_for_stop_strings() {
        // "\u{FFFD}" stands for the first byte of "ü" until its second byte arrives.
        let mut t = TextStream::new(vec!["Gr\u{FFFD}".into(), "\u{FFFD}".into()]);
        let u = t.update("Gr\u{FFFD}".into(), false);
        assert_eq!((u.new_text.as_str(), u.stopped), ("", None)); // "Gr" may begin the first stop string
        let u = t.update("Grün".into(), false);
        assert_eq!((u.new_text.as_str(), u.stopped), ("Grün", None));
        // a replacement character that is really in the text (invalid bytes followed by more text) still stops
        let u = t.update("Grün\u{FFFD}x".into(), false);
        assert_eq!((u.new_text.as_str(), u.stopped.as_deref()), ("", Some("\u{FFFD}")));
    }

    #[test]
    fn holds_back_stop_prefix_and_stops() {
        let mut t = TextStream::new(vec!["END".into()]);
        assert_eq!(t.update("hello E".into(), false).new_text, "hello ");
        assert_eq!(t.update("hello EN".into(), false).new_text, "");
        let u = t.update("hello ENDx".into(), false);
        assert_eq!((u.new_text.as_str(), u.stopped.as_deref()), ("", Some("END")));
        assert_eq!(t.emitted_text(), "hello ");
    }

    #[test]
    fn false_alarm_is_released() {
        let mut t = TextStream::new(vec!["END".into()]);
        assert_eq!(t.update("a E".into(), false).new_text, "a ");
        assert_eq!(t.update("a Ex".into(), false).new_text, "Ex");
    }

    /// Byte-level "tokenizer": token = one byte; decoding is lossy UTF-8, like byte-level BPE.
    fn bytes(ids: &[u32]) -> Result<String, ()> {
        Ok(String::from_utf8_lossy(&ids.iter().map(|&t| t as u8).collect::<Vec<u8>>()).into_owned())
    }

    #[test]
    fn incremental_matches_one_shot_decoding() {
        let s = "héllo → wörld 🎉 ok";
        let ids: Vec<u32> = s.bytes().map(|b| b as u32).collect();
        // tokens arrive one, two or three at a time
        for chunk in 1..=3 {
            let mut d = Detok::default();
            let mut n = 0;
            while n < ids.len() {
                n = (n + chunk).min(ids.len());
                let t = d.text(&ids[..n], false, bytes).unwrap();
                let full = bytes(&ids[..n]).unwrap();
                assert_eq!(
                    t.trim_end_matches('\u{FFFD}'),
                    full.trim_end_matches('\u{FFFD}'),
                    "chunk {chunk}, {n} tokens"
                );
            }
            assert_eq!(d.text(&ids, true, bytes).unwrap(), s);
        }
    }

    #[test]
    fn incremental_decodes_a_short_tail() {
        // each call may decode only the tokens since the last complete point, not the whole list
        let ids: Vec<u32> = "abcdefghijklmnopqrstuvwxyz".bytes().map(|b| b as u32).collect();
        let longest = std::cell::Cell::new(0);
        let spy = |x: &[u32]| {
            longest.set(longest.get().max(x.len()));
            bytes(x)
        };
        let mut d = Detok::default();
        for n in 1..=ids.len() {
            assert_eq!(d.text(&ids[..n], false, spy).unwrap(), "abcdefghijklmnopqrstuvwxyz"[..n]);
        }
        assert!(longest.get() <= 2, "decoded {} tokens at once", longest.get());
    }

    #[test]
    fn holds_incomplete_utf8() {
        let mut t = TextStream::new(vec![]);
        assert_eq!(t.update("ab\u{FFFD}".into(), false).new_text, "ab");
        assert_eq!(t.update("abé".into(), false).new_text, "é");
    }
}

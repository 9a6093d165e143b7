//! A completion's text as its tokens arrive, for the endpoint (`gen --serve`): each token's
//! new text, stop strings found where they end, and text that could still become a stop
//! string held back until it cannot.
//!
//! Decoding a growing id list from the start at every token costs O(n²); decoding only a
//! window of the last ids is not exact for every tokenizer. [`TextStream`] decodes from a
//! prefix offset that moves forward once a piece of text is complete (no trailing U+FFFD,
//! which is what a tokenizer gives for a UTF-8 sequence split between tokens): the
//! concatenated pieces equal the decoding of all ids at once for byte-level BPE (Qwen,
//! Llama 3) and for the built-in character tokenizer.

use crate::model::ModelError;
use crate::model::tokenizer::Tokenizer;

/// One completion's text so far.
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Ids from `prefix` decode to text already taken up to `read`.
    prefix: usize,
    read: usize,
    text: String,
    /// Bytes of `text` handed out.
    sent: usize,
    stops: Vec<String>,
    /// Whether a stop string ended the text.
    stopped: bool,
}

/// The byte index at or below `i` that starts a character of `s`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl TextStream {
    /// A stream that ends at the first of `stops` (none: it never does).
    pub fn new(stops: Vec<String>) -> Self {
        TextStream {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..TextStream::default()
        }
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The text so far (up to a stop string, which is left out).
    #[cfg(test)]
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Takes token `id`: the text that can be handed out now.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, ModelError> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = tokenizer.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let searched = self.text.len();
            match now.strip_prefix(before.as_str()) {
                Some(piece) => self.text.push_str(piece),
                // A tokenizer whose window decodes differently: take the whole window anew.
                None => {
                    let start = self.text.len() - before.len().min(self.text.len());
                    self.text.truncate(floor_boundary(&self.text, start));
                    self.text.push_str(&now);
                }
            }
            self.prefix = self.read;
            self.read = self.ids.len();
            self.find_stop(searched);
        }
        Ok(self.take(false))
    }

    /// The text held back (a possible start of a stop string, an unfinished character),
    /// once the completion has ended.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, ModelError> {
        if !self.stopped && self.read < self.ids.len() {
            let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
            let now = tokenizer.decode(&self.ids[self.prefix..])?;
            let searched = self.text.len();
            if let Some(piece) = now.strip_prefix(before.as_str()) {
                self.text.push_str(piece);
            }
            self.read = self.ids.len();
            self.find_stop(searched);
        }
        Ok(self.take(true))
    }

    /// Ends the text before the first stop string that ends after byte `searched`.
    fn find_stop(&mut self, searched: usize) {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = floor_boundary(
            &self.text,
            searched.saturating_sub(longest.saturating_sub(1)),
        );
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|at| from + at))
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            self.stopped = true;
        }
    }

    /// The text not yet handed out, less (unless `all`) what could begin a stop string.
    fn take(&mut self, all: bool) -> String {
        let hold = if all || self.stopped {
            0
        } else {
            self.stops
                .iter()
                .map(|s| {
                    // The longest proper prefix of `s` the text ends with.
                    (1..s.len())
                        .rev()
                        .filter(|&n| s.is_char_boundary(n))
                        .find(|&n| self.text.ends_with(&s[..n]))
                        .unwrap_or(0)
                })
                .max()
                .unwrap_or(0)
        };
        let end = floor_boundary(&self.text, self.text.len() - hold).max(self.sent);
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tokenizer::CharTokenizer;

    fn chars() -> Tokenizer {
        Tokenizer::Char(CharTokenizer::new(
            "abcdefghijklmnopqrstuvwxyz =+0123456789",
        ))
    }

    fn run(tok: &Tokenizer, stops: &[&str], text: &str) -> (Vec<String>, String, bool) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let ids = tok.encode(text).expect("encode");
        let mut pieces: Vec<String> = ids
            .iter()
            .map(|&id| s.push(tok, id).expect("push"))
            .collect();
        pieces.push(s.finish(tok).expect("finish"));
        (pieces, s.text().to_string(), s.stopped())
    }

    #[test]
    fn pieces_add_up_to_the_text_and_a_stop_string_ends_it_unsent() {
        let tok = chars();
        let (pieces, text, stopped) = run(&tok, &[], "abc de");
        assert_eq!(pieces.concat(), "abc de");
        assert_eq!(text, "abc de");
        assert!(!stopped);

        let (pieces, text, stopped) = run(&tok, &["= 4"], "2+2 = 4 and");
        assert!(stopped);
        assert_eq!(text, "2+2 ");
        assert_eq!(
            pieces.concat(),
            "2+2 ",
            "nothing of the stop string is ever sent"
        );
        // "=" and " " could begin "= 4": they were held back, then dropped with it.
        assert!(pieces.iter().all(|p| !p.contains('=')), "{pieces:?}");

        // A held-back prefix that does not become the stop string is sent after all.
        let (pieces, text, stopped) = run(&tok, &["= 4"], "a = 5");
        assert!(!stopped);
        assert_eq!(pieces.concat(), "a = 5");
        assert_eq!(text, "a = 5");
    }

    #[test]
    fn multibyte_text_split_across_byte_level_tokens_decodes_whole() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/qwen3");
        let tok = Tokenizer::load(&dir).expect("the Qwen3 tokenizer fixture");
        let text = "Größe: 3×4 = 12 — 東京 🚀 done.";
        let ids = tok.encode(text).expect("encode");
        assert!(ids.len() > 10);
        let mut s = TextStream::new(vec!["done".into()]);
        let mut pieces: Vec<String> = ids
            .iter()
            .map(|&id| s.push(&tok, id).expect("push"))
            .collect();
        pieces.push(s.finish(&tok).expect("finish"));
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat(), "Größe: 3×4 = 12 — 東京 🚀 ");
        assert!(s.stopped());
    }
}

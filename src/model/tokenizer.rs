//! Tokenizers: Hugging Face `tokenizer.json` (through the `tokenizers` crate) and a small
//! built-in character tokenizer for built-in tasks.

use super::ModelError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// File name of the built-in character tokenizer inside a model directory.
pub const CHAR_TOKENIZER_FILE: &str = "rlstream_tokenizer.json";

/// Character-level vocabulary: id 0 is end-of-sequence, id 1 padding/unknown, then one id
/// per character.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CharTokenizer {
    pub chars: Vec<char>,
}

impl CharTokenizer {
    pub const EOS: u32 = 0;
    pub const UNK: u32 = 1;

    pub fn new(alphabet: &str) -> Self {
        let mut chars: Vec<char> = alphabet.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharTokenizer { chars }
    }

    pub fn vocab_size(&self) -> usize {
        self.chars.len() + 2
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.chars()
            .map(|c| match self.chars.binary_search(&c) {
                Ok(i) => i as u32 + 2,
                Err(_) => Self::UNK,
            })
            .collect()
    }

    /// The text of `ids` (the end-of-sequence id is dropped); an id past the vocabulary is
    /// an error, not a character left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        ids.iter()
            .filter(|&&id| id != Self::EOS)
            .map(|&id| match id {
                Self::UNK => Ok('\u{fffd}'),
                i => self.chars.get(i as usize - 2).copied().ok_or_else(|| {
                    ModelError::Tokenizer(format!(
                        "token id {i} is past the {}-id character vocabulary",
                        self.vocab_size()
                    ))
                }),
            })
            .collect()
    }
}

/// Whichever tokenizer a model directory has.
pub enum Tokenizer {
    Char(CharTokenizer),
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// `tokenizer.json` (Hugging Face) or `rlstream_tokenizer.json` (built-in).
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let dir = &super::model_dir(dir);
        let hf = dir.join("tokenizer.json");
        let own = dir.join(CHAR_TOKENIZER_FILE);
        if hf.exists() {
            let t = tokenizers::Tokenizer::from_file(&hf)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", hf.display())))?;
            Ok(Tokenizer::Hf(Box::new(t)))
        } else if own.exists() {
            let text = std::fs::read_to_string(&own).map_err(|source| ModelError::Io {
                path: own.display().to_string(),
                source,
            })?;
            let t = serde_json::from_str(&text)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", own.display())))?;
            Ok(Tokenizer::Char(t))
        } else {
            Err(ModelError::MissingFile {
                path: hf.display().to_string(),
                reason: format!(
                    "no tokenizer.json or {CHAR_TOKENIZER_FILE} in {}",
                    dir.display()
                ),
            })
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        match self {
            Tokenizer::Char(t) => Ok(t.encode(text)),
            Tokenizer::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ModelError::Tokenizer(e.to_string())),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        match self {
            Tokenizer::Char(t) => t.decode(ids),
            Tokenizer::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| ModelError::Tokenizer(e.to_string())),
        }
    }

    /// The text of `ids` with special tokens written out, as a chat template renders them
    /// (the character tokenizer has none to write: its end-of-sequence id has no text).
    pub fn decode_special(&self, ids: &[u32]) -> Result<String, ModelError> {
        match self {
            Tokenizer::Char(t) => t.decode(ids),
            Tokenizer::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| ModelError::Tokenizer(e.to_string())),
        }
    }

    /// Whether `other` maps every id to the same token as `self`: `Err` says how they differ.
    /// Two tokenizers agree when they are of one kind with the same vocabulary (characters,
    /// or Hugging Face tokens with their added tokens, id for id).
    pub fn same_as(&self, other: &Tokenizer) -> Result<(), String> {
        match (self, other) {
            (Tokenizer::Char(a), Tokenizer::Char(b)) if a == b => Ok(()),
            (Tokenizer::Char(a), Tokenizer::Char(b)) => Err(format!(
                "character vocabularies differ ({} and {} ids)",
                a.vocab_size(),
                b.vocab_size()
            )),
            (Tokenizer::Hf(a), Tokenizer::Hf(b)) => {
                let (va, vb) = (a.get_vocab(true), b.get_vocab(true));
                if va.len() != vb.len() {
                    return Err(format!(
                        "vocabularies of {} and {} tokens",
                        va.len(),
                        vb.len()
                    ));
                }
                let mut differ: Vec<(&u32, &String)> = va
                    .iter()
                    .filter(|(tok, id)| vb.get(*tok) != Some(id))
                    .map(|(tok, id)| (id, tok))
                    .collect();
                differ.sort();
                match differ.first() {
                    None => Ok(()),
                    Some((id, tok)) => Err(format!(
                        "{} of {} tokens differ (id {id} is {tok:?} in one only)",
                        differ.len(),
                        va.len()
                    )),
                }
            }
            _ => Err(
                "one is the built-in character tokenizer, the other a Hugging Face tokenizer"
                    .into(),
            ),
        }
    }

    /// Writes the built-in tokenizer next to a checkpoint (HF tokenizers are copied as is).
    pub fn save_char(t: &CharTokenizer, dir: &Path) -> Result<(), ModelError> {
        let path = dir.join(CHAR_TOKENIZER_FILE);
        let text =
            serde_json::to_string_pretty(t).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        std::fs::write(&path, text).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_tokenizer_round_trips() {
        let t = CharTokenizer::new("0123456789+=");
        assert_eq!(t.vocab_size(), 14);
        let ids = t.encode("12+30=");
        assert_eq!(t.decode(&ids).unwrap(), "12+30=");
        assert_eq!(t.encode("x"), vec![CharTokenizer::UNK]);
        assert_eq!(t.decode(&[2, CharTokenizer::EOS]).unwrap(), "+");
        let past = t.vocab_size() as u32;
        let e = t.decode(&[2, past]).unwrap_err().to_string();
        assert!(e.contains(&format!("token id {past} is past")), "{e}");
    }
}

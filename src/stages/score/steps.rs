//! Rewards an external scorer places on tokens: by token index, or per step.
//!
//! **By token index** (`token_rewards`): for each completion, a list of `[index, reward]`
//! pairs. An index counts the completion's token ids as the request's `tokens` lists them
//! (from 0, the stop token included); each index at most once; tokens not named get 0.
//!
//! **Per step** (`step_rewards`, with `--step-separator SEP`): the completion's text (without
//! its stop token) is split after every occurrence of `SEP`, the separator staying at the
//! end of the step it closes; a text that does not end with `SEP` has a last step that ends
//! with the text, and a text that does ends with that step (no empty step follows). The
//! request's `steps` lists each completion's step texts, and the answer gives one reward per
//! step. A step's reward sits on its **last token**: the token whose text holds the step's
//! last character (the separator's last character, or the text's), found by decoding each
//! prefix of the completion's tokens. Two steps that end inside one token both put their
//! reward on it, and they add up. A completion whose text is empty has one empty step,
//! whose reward sits on its last token (the stop token).
//!
//! Either way every value is checked: one list per completion, indices in range, finite
//! rewards, one reward per step; a bad answer is a scorer error, retried and then
//! dead-lettered like any other.

use crate::model::ModelError;
use crate::model::tokenizer::Tokenizer;
use crate::schema::Floats;

/// A completion's steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Steps {
    /// Each step's text, the separator kept at its end.
    pub texts: Vec<String>,
    /// The index of each step's last token.
    pub last_tokens: Vec<usize>,
}

/// `tokens` split into steps after each `sep` in the text of its first `text_len` tokens.
pub fn split(
    tok: &Tokenizer,
    tokens: &[u32],
    text_len: usize,
    sep: &str,
) -> Result<Steps, ModelError> {
    let text = tok.decode(&tokens[..text_len])?;
    if text.is_empty() {
        return Ok(Steps {
            texts: if tokens.is_empty() {
                Vec::new()
            } else {
                vec![String::new()]
            },
            last_tokens: tokens.len().checked_sub(1).into_iter().collect(),
        });
    }
    // ends[j]: bytes of text the first j + 1 tokens decode to (never decreasing).
    let mut ends = Vec::with_capacity(text_len);
    let mut most = 0;
    for j in 0..text_len {
        most = most.max(tok.decode(&tokens[..=j])?.len());
        ends.push(most);
    }
    let last_token_of = |end: usize| {
        ends.iter()
            .position(|&e| e >= end)
            .unwrap_or(text_len.saturating_sub(1))
    };
    let mut out = Steps {
        texts: Vec::new(),
        last_tokens: Vec::new(),
    };
    let mut start = 0;
    for (at, m) in text.match_indices(sep) {
        let end = at + m.len();
        if end <= start {
            continue;
        }
        out.texts.push(text[start..end].to_string());
        out.last_tokens.push(last_token_of(end));
        start = end;
    }
    if start < text.len() {
        out.texts.push(text[start..].to_string());
        out.last_tokens.push(last_token_of(text.len()));
    }
    Ok(out)
}

/// A scorer's placed rewards that do not fit the completions: what is wrong, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRewards(pub String);

fn bad(msg: String) -> BadRewards {
    BadRewards(msg)
}

fn check_count<T>(field: &str, given: &[T], lens: &[usize]) -> Result<(), BadRewards> {
    if given.len() != lens.len() {
        return Err(bad(format!(
            "{} lists in {field} for {} completions",
            given.len(),
            lens.len()
        )));
    }
    Ok(())
}

fn check_finite(field: &str, i: usize, r: f32) -> Result<(), BadRewards> {
    if !r.is_finite() {
        return Err(bad(format!("{field}[{i}] holds the non-finite reward {r}")));
    }
    Ok(())
}

/// Dense per-token rewards from `[index, reward]` pairs; `lens[i]`: completion `i`'s tokens.
pub fn placed(pairs: &[Vec<(usize, f32)>], lens: &[usize]) -> Result<Vec<Floats>, BadRewards> {
    check_count("token_rewards", pairs, lens)?;
    pairs
        .iter()
        .zip(lens)
        .enumerate()
        .map(|(i, (ps, &n))| {
            let mut dense = vec![0f32; n];
            let mut seen = vec![false; n];
            for &(t, r) in ps {
                if t >= n {
                    return Err(bad(format!(
                        "token_rewards[{i}] names token {t}, but completion {i} has {n} tokens"
                    )));
                }
                if std::mem::replace(&mut seen[t], true) {
                    return Err(bad(format!("token_rewards[{i}] names token {t} twice")));
                }
                check_finite("token_rewards", i, r)?;
                dense[t] = r;
            }
            Ok(dense.into())
        })
        .collect()
}

/// Dense per-token rewards from one reward per step, each on its step's last token.
pub fn step_rewards(
    per_step: &[Vec<f32>],
    last_tokens: &[Vec<usize>],
    lens: &[usize],
) -> Result<Vec<Floats>, BadRewards> {
    check_count("step_rewards", per_step, lens)?;
    per_step
        .iter()
        .zip(last_tokens)
        .zip(lens)
        .enumerate()
        .map(|(i, ((rs, ends), &n))| {
            if rs.len() != ends.len() {
                return Err(bad(format!(
                    "step_rewards[{i}] has {} rewards for {} steps",
                    rs.len(),
                    ends.len()
                )));
            }
            let mut dense = vec![0f32; n];
            for (&r, &t) in rs.iter().zip(ends) {
                check_finite("step_rewards", i, r)?;
                dense[t] += r;
            }
            Ok(dense.into())
        })
        .collect()
}

/// `a + b`, token by token (both per sample, of the same lengths).
pub fn add(a: &[Floats], b: &[Floats]) -> Vec<Floats> {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            x.iter()
                .zip(y.iter())
                .map(|(p, q)| p + q)
                .collect::<Vec<f32>>()
                .into()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tokenizer::CharTokenizer;

    fn chars() -> Tokenizer {
        Tokenizer::Char(CharTokenizer::new("abc;"))
    }

    #[test]
    fn steps_end_on_the_separators_last_token() {
        let t = chars();
        // "ab;c;a" then the stop token (id 0).
        let mut ids = t.encode("ab;c;a").unwrap();
        ids.push(CharTokenizer::EOS);
        let s = split(&t, &ids, ids.len() - 1, ";").unwrap();
        assert_eq!(s.texts, vec!["ab;", "c;", "a"]);
        assert_eq!(s.last_tokens, vec![2, 4, 5]);
        // A text that ends with the separator has no empty last step.
        let ids = t.encode("ab;").unwrap();
        let s = split(&t, &ids, 3, ";").unwrap();
        assert_eq!((s.texts, s.last_tokens), (vec!["ab;".to_string()], vec![2]));
        // An empty text: one empty step on the stop token.
        let s = split(&t, &[CharTokenizer::EOS], 0, ";").unwrap();
        assert_eq!((s.texts, s.last_tokens), (vec![String::new()], vec![0]));
        // A two-character separator ends on the token of its last character.
        let ids = t.encode("a;;b;;").unwrap();
        let s = split(&t, &ids, ids.len(), ";;").unwrap();
        assert_eq!(s.last_tokens, vec![2, 5]);
    }

    #[test]
    fn step_and_index_rewards_are_placed_and_checked() {
        let dense = step_rewards(&[vec![1.0, 0.5, -1.0]], &[vec![2, 4, 5]], &[7]).unwrap();
        assert_eq!(dense[0].as_slice(), &[0.0, 0.0, 1.0, 0.0, 0.5, -1.0, 0.0]);
        // Two steps ending in one token add up.
        let dense = step_rewards(&[vec![1.0, 2.0]], &[vec![1, 1]], &[2]).unwrap();
        assert_eq!(dense[0].as_slice(), &[0.0, 3.0]);
        let e = step_rewards(&[vec![1.0]], &[vec![2, 4]], &[7]).unwrap_err();
        assert!(e.to_string().contains("1 rewards for 2 steps"), "{e}");

        let dense = placed(&[vec![(0, 0.5), (3, -2.0)], vec![]], &[4, 2]).unwrap();
        assert_eq!(dense[0].as_slice(), &[0.5, 0.0, 0.0, -2.0]);
        assert_eq!(dense[1].as_slice(), &[0.0, 0.0]);
        for (pairs, want) in [
            (
                vec![vec![(4, 1.0)], vec![]],
                "names token 4, but completion 0 has 4 tokens",
            ),
            (
                vec![vec![(1, 1.0), (1, 2.0)], vec![]],
                "names token 1 twice",
            ),
            (vec![vec![(1, f32::NAN)], vec![]], "non-finite"),
            (vec![vec![]], "1 lists in token_rewards for 2 completions"),
        ] {
            let e = placed(&pairs, &[4, 2]).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}

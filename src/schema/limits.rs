//! The second line of checks: a message that decodes is checked against the model a stage
//! runs before any tensor is built. Token ids must lie inside the vocabulary, and prompt +
//! completion must fit the context (the positions the model has rotary entries for).
//!
//! Each refusal names the field and the limit; its `reason` is the dead-letter reason and
//! the `reason` label of `rlstream_dead_letters_total`.

use super::{RolloutGroup, RoutingShape, ScoredGroup};
use std::fmt;

/// What the model a stage runs can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Token ids must be below this.
    pub vocab: usize,
    /// Prompt + completion tokens of one sample may be at most this many.
    pub context: usize,
    /// The model's MoE layers; `None` for a dense model, which takes no routing.
    pub routing: Option<RoutingShape>,
}

/// Why a message that decodes cannot run on the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `vocabulary`, `context`, `shape` or `routing`.
    pub reason: &'static str,
    pub detail: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

impl std::error::Error for Refusal {}

impl Refusal {
    pub const VOCABULARY: &'static str = "vocabulary";
    pub const CONTEXT: &'static str = "context";
    pub const SHAPE: &'static str = "shape";
    pub const ROUTING: &'static str = "routing";
}

impl Limits {
    /// The first id in `ids` at or past the vocabulary, as a refusal naming `field`.
    pub fn ids(&self, field: &str, ids: &[u32]) -> Result<(), Refusal> {
        match ids.iter().position(|&t| t as usize >= self.vocab) {
            None => Ok(()),
            Some(i) => Err(Refusal {
                reason: Refusal::VOCABULARY,
                detail: format!(
                    "{field}[{i}] = {} is outside the model's vocabulary of {} (ids 0..={})",
                    ids[i],
                    self.vocab,
                    self.vocab.saturating_sub(1)
                ),
            }),
        }
    }

    /// A prompt to generate from: ids in the vocabulary, and shorter than the context so at
    /// least one token can follow it.
    pub fn prompt(&self, field: &str, tokens: &[u32]) -> Result<(), Refusal> {
        self.ids(field, tokens)?;
        if tokens.len() >= self.context {
            return Err(Refusal {
                reason: Refusal::CONTEXT,
                detail: format!(
                    "{field} has {} tokens; the model's context of {} leaves no room to \
                     generate (give gen --truncate-prompt left to keep the prompt's end)",
                    tokens.len(),
                    self.context
                ),
            });
        }
        Ok(())
    }

    /// A generated group as the trainer will run it: a non-empty prompt, every id (prompt,
    /// completions, kept sets of the sampling masks) in the vocabulary, each sample's
    /// prompt + completion within the context, and routing (when there is any) for the
    /// model's MoE layers.
    pub fn rollout(&self, g: &RolloutGroup) -> Result<(), Refusal> {
        if let Some(r) = &g.prompt_routing
            && self.routing != Some(r.shape())
        {
            return Err(Refusal {
                reason: Refusal::ROUTING,
                detail: match self.routing {
                    Some(model) => {
                        format!("prompt_routing is for {}; the model has {model}", r.shape())
                    }
                    None => format!(
                        "prompt_routing is for {}; the model is dense (routing comes from \
                         a mixture-of-experts generator of another model)",
                        r.shape()
                    ),
                },
            });
        }
        let prompt = g.prompt_tokens.as_slice();
        if prompt.is_empty() {
            return Err(Refusal {
                reason: Refusal::SHAPE,
                detail: "prompt_tokens is empty: the first completion token has nothing to \
                         be predicted from"
                    .into(),
            });
        }
        self.ids("prompt_tokens", prompt)?;
        for (i, s) in g.samples.iter().enumerate() {
            self.ids(&format!("samples[{i}].tokens"), s.tokens.as_slice())?;
            if let Some(m) = &s.mask {
                self.ids(&format!("samples[{i}].mask.ids"), m.ids.as_slice())?;
            }
            let len = prompt.len() + s.tokens.len();
            if len > self.context {
                return Err(Refusal {
                    reason: Refusal::CONTEXT,
                    detail: format!(
                        "samples[{i}]: {} prompt + {} completion = {len} tokens, over the \
                         model's context of {}",
                        prompt.len(),
                        s.tokens.len(),
                        self.context
                    ),
                });
            }
        }
        Ok(())
    }

    pub fn scored(&self, g: &ScoredGroup) -> Result<(), Refusal> {
        self.rollout(&g.rollout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::examples;

    const LIMITS: Limits = Limits {
        vocab: 16,
        context: 10,
        routing: None,
    };

    fn group(prompt: Vec<u32>, completion: Vec<u32>) -> RolloutGroup {
        let mut g = examples::rollout_group(2, 1, 16, 0);
        g.prompt_tokens = prompt.into();
        let n = completion.len();
        for s in &mut g.samples {
            s.tokens = completion.clone().into();
            s.logprobs = vec![-0.5; n].into();
            s.versions = vec![crate::schema::VersionRun {
                start: 0,
                version: 0,
            }];
            s.mask = None;
        }
        g
    }

    #[test]
    fn the_last_id_of_the_vocabulary_is_accepted_and_the_next_refused() {
        assert!(LIMITS.ids("prompt_tokens", &[0, 15]).is_ok());
        let r = LIMITS
            .ids("prompt_tokens", &[0, 16])
            .expect_err("past the vocabulary");
        assert_eq!(r.reason, "vocabulary");
        assert!(r.detail.contains("prompt_tokens[1] = 16"), "{r}");
        assert!(r.detail.contains("vocabulary of 16"), "{r}");
        assert!(LIMITS.rollout(&group(vec![1], vec![15, 2])).is_ok());
        let r = LIMITS
            .rollout(&group(vec![1], vec![2, 16]))
            .expect_err("completion id");
        assert!(r.detail.starts_with("samples[0].tokens[1] = 16"), "{r}");
        let r = LIMITS
            .rollout(&group(vec![16], vec![2]))
            .expect_err("prompt id");
        assert_eq!(r.reason, "vocabulary");
    }

    #[test]
    fn a_sample_of_exactly_the_context_is_accepted_and_one_more_refused() {
        assert!(LIMITS.rollout(&group(vec![1; 4], vec![2; 6])).is_ok());
        let r = LIMITS
            .rollout(&group(vec![1; 4], vec![2; 7]))
            .expect_err("context + 1");
        assert_eq!(r.reason, "context");
        assert!(
            r.detail.contains("4 prompt + 7 completion = 11 tokens"),
            "{r}"
        );
        assert!(r.detail.contains("context of 10"), "{r}");
        // A prompt to generate from must leave room for one token.
        assert!(LIMITS.prompt("prompt_tokens", &[1; 9]).is_ok());
        let r = LIMITS
            .prompt("prompt_tokens", &[1; 10])
            .expect_err("prompt at the context");
        assert_eq!(r.reason, "context");
        assert!(r.detail.contains("--truncate-prompt left"), "{r}");
    }

    #[test]
    fn an_empty_prompt_and_mask_ids_past_the_vocabulary_are_refused() {
        let r = LIMITS.rollout(&group(vec![], vec![2])).expect_err("empty");
        assert_eq!(r.reason, "shape");
        let mut g = group(vec![1], vec![2]);
        g.samples[0].mask = Some(crate::schema::SamplingMask {
            offsets: vec![0, 2].into(),
            ids: vec![2, 40].into(),
        });
        let r = LIMITS.rollout(&g).expect_err("mask id");
        assert!(r.detail.starts_with("samples[0].mask.ids[1] = 40"), "{r}");
    }
}

//! A recorded call as the generator keeps it (`X-Rlstream-Episode`), and its JSON for
//! `GET /v1/rlstream/episodes/{id}`.

use crate::model::sampler::Completion;
use crate::schema::{FinishReason, SamplingParams, VersionRun};
use serde_json::{Value, json};

/// One recorded call.
#[derive(Debug, Clone)]
pub struct RecordedCall {
    pub endpoint: &'static str,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// One completion per choice, in choice order.
    pub choices: Vec<Completion>,
}

impl RecordedCall {
    pub(super) fn json(&self, call: usize) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|c| {
                json!({
                    "index": c.index,
                    "token_ids": c.tokens,
                    "logprobs": c.logprobs,
                    "versions": per_token(&c.versions, c.tokens.len()),
                    "finish_reason": finish_reason(c.finish),
                    "truncated": c.mask.is_some(),
                })
            })
            .collect();
        json!({
            "call": call,
            "endpoint": self.endpoint,
            "prompt_token_ids": self.prompt,
            "sampling": {
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p,
                "top_k": self.sampling.top_k,
                "max_tokens": self.sampling.max_new_tokens,
                "seed": self.sampling.seed,
            },
            "choices": choices,
        })
    }
}

/// Each of `n` tokens' version, from version runs.
pub fn per_token(runs: &[VersionRun], n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let at = runs.partition_point(|r| r.start as usize <= i);
            runs.get(at.saturating_sub(1)).map_or(0, |r| r.version)
        })
        .collect()
}

/// OpenAI's name of a finish reason.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

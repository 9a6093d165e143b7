//! Calls from the endpoint (`gen --serve`) as the decode thread takes them: a prompt's ids,
//! how to sample it, and a channel back on which each token is reported as it is drawn.
//!
//! A call's rows are decoded in the same batch as the stream's prompts, on the same model
//! and under the same weight swaps, so every token carries the version that drew it. A call
//! whose channel is closed (its client went away) is dropped with its KV rows before the
//! next forward pass.

use crate::model::sampler::Completion;
use crate::schema::{FinishReason, SamplingParams};
use tokio::sync::mpsc::UnboundedSender;

/// One call: `n` completions of `prompt`.
pub struct Call {
    pub prompt: Vec<u32>,
    pub n: usize,
    pub params: SamplingParams,
    /// Strings that end a completion (the text before the first one is kept; the token that
    /// completed it is the completion's last).
    pub stop: Vec<String>,
    pub events: UnboundedSender<CallEvent>,
}

/// What the decode thread reports about a call.
#[derive(Debug)]
pub enum CallEvent {
    /// Row `index` drew `token` with the weights of `version`; `text` is the completion's
    /// new text that can be shown (text that could begin a stop string is held back).
    Token {
        index: usize,
        token: u32,
        logprob: f32,
        version: u64,
        text: String,
    },
    /// Row `index` ended: the generator's record of it (every token with its log-prob and
    /// version runs, the kept sets when sampling truncated), and the rest of its text.
    Finished {
        index: usize,
        finish: FinishReason,
        completion: Box<Completion>,
        text: String,
    },
    /// The model cannot run the prompt (ids past the vocabulary, no room in the context).
    Refused {
        reason: &'static str,
        detail: String,
    },
    /// A forward pass failed on this call's rows; they are gone.
    Failed(String),
}

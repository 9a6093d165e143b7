//! What goes into the [`Generator`](super::Generator) and what comes out: a request, a
//! finished completion, an episode's turns, a token as it was drawn.

use crate::schema::{
    FinishReason, Routing, SamplingMask, SamplingParams, Span, TurnReward, VersionRun,
};
use std::sync::Arc;

/// One prompt to complete `n` times.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller's id, returned with each completion.
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Completions to sample (the group size G).
    pub n: usize,
    pub params: SamplingParams,
}

/// A finished completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub request_id: u64,
    /// Which of the request's `n` samples.
    pub index: usize,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<VersionRun>,
    pub finish: FinishReason,
    pub mask: Option<SamplingMask>,
    /// Episodes: the spans of `tokens` the environment wrote.
    pub env: Vec<Span>,
    /// Episodes: the environment's reward of each turn, on the turn's last model token.
    pub turn_rewards: Vec<TurnReward>,
    /// Episodes: model turns taken.
    pub turns: u32,
    /// MoE models: the experts of every completion token the model read (all but the
    /// last), and of the prompt's tokens (shared by the request's completions).
    pub routing: Option<Routing>,
    pub prompt_routing: Option<Arc<Routing>>,
}

impl From<Completion> for crate::schema::Sample {
    fn from(c: Completion) -> Self {
        crate::schema::Sample {
            tokens: c.tokens.into(),
            logprobs: c.logprobs.into(),
            versions: c.versions,
            finish: c.finish,
            mask: c.mask,
            env: c.env,
            turn_rewards: c.turn_rewards,
            routing: c.routing,
        }
    }
}

/// How long an episode's turns may run (see [`Generator::admit_episode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnLimits {
    /// Most tokens of one model turn.
    pub turn_tokens: usize,
    /// Most tokens of the whole episode after the prompt (model and environment), besides
    /// what the context leaves.
    pub episode_tokens: usize,
}

/// A model turn that ended, waiting for the environment: which row, and its tokens (the
/// stop token included when one ended it).
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub request_id: u64,
    pub index: usize,
    pub tokens: Vec<u32>,
    /// Whether the turn ended on a stop token (not on its token budget).
    pub stopped: bool,
    /// Which turn of the episode, from 1.
    pub number: u32,
}

/// What became of a row after [`Generator::resume`].
#[derive(Debug, Clone, PartialEq)]
pub enum Resumed {
    /// Back in the batch.
    Decoding,
    /// Its next turn ended at once (a stop token first): see [`Generator::take_turns`].
    Parked,
    /// The observation left no room for another token: the episode ended (finish
    /// `length`) without it.
    Finished(Box<Completion>),
}

/// One token as it was drawn, for a caller that streams tokens ([`Generator::admit_watched`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub request_id: u64,
    pub index: usize,
    pub token: u32,
    pub logprob: f32,
    pub version: u64,
    /// The likeliest ids of the distribution the token was drawn from, with their
    /// log-probs, as many as the row asked for ([`alternatives`](crate::model::draw::alternatives)).
    pub alternatives: Vec<(u32, f32)>,
}

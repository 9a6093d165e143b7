//! Recorded calls: a call whose request names an episode (`X-Rlstream-Episode`) is kept,
//! as ids, under that episode, in the order the calls ended: its prompt's ids and, per
//! choice, the generator's own record of the completion (token ids, behaviour log-probs,
//! version runs, the kept sets when sampling truncated). `GET /v1/rlstream/episodes/{id}`
//! returns them.
//!
//! Records live in the generator's memory: an episode idle for `serve_episode_ttl_s` is
//! forgotten, and so is everything when the generator stops.

use crate::model::sampler::Completion;
use crate::schema::{FinishReason, SamplingParams};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most bytes of an episode id.
pub const MAX_EPISODE_ID: usize = 200;

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
    fn json(&self, call: usize) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|c| {
                let versions: Vec<u64> = (0..c.tokens.len())
                    .map(|i| {
                        let at = c.versions.partition_point(|r| r.start as usize <= i);
                        c.versions[at.saturating_sub(1)].version
                    })
                    .collect();
                json!({
                    "index": c.index,
                    "token_ids": c.tokens,
                    "logprobs": c.logprobs,
                    "versions": versions,
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

/// OpenAI's name of a finish reason.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

struct Episode {
    calls: Vec<RecordedCall>,
    used: Instant,
}

/// The recorded episodes of one generator.
pub struct Episodes {
    ttl: Duration,
    map: Mutex<HashMap<String, Episode>>,
}

impl Episodes {
    pub fn new(ttl: Duration) -> Self {
        Episodes {
            ttl,
            map: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Episode>> {
        // A panic while holding the lock left whole records: keep using them.
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends `call` to `episode` (forgetting episodes idle past the TTL); the call's
    /// number within its episode, from 0.
    pub fn record(&self, episode: &str, call: RecordedCall) -> usize {
        let now = Instant::now();
        let mut map = self.lock();
        map.retain(|_, e| now.duration_since(e.used) < self.ttl);
        let e = map.entry(episode.to_string()).or_insert_with(|| Episode {
            calls: Vec::new(),
            used: now,
        });
        e.used = now;
        e.calls.push(call);
        crate::metrics::recorded_call();
        e.calls.len() - 1
    }

    /// The episode's calls as JSON, or `None` when none is recorded under `episode`.
    pub fn json(&self, episode: &str) -> Option<Value> {
        let map = self.lock();
        let e = map.get(episode)?;
        let calls: Vec<Value> = e.calls.iter().enumerate().map(|(i, c)| c.json(i)).collect();
        Some(json!({"episode": episode, "calls": calls}))
    }
}

//! `RolloutGroup`: the G completions of one prompt, with everything the trainer needs to
//! correct for off-policy data (behaviour log-probs, per-token versions, sampling masks).
//!
//! A sample may be an episode (schema 2.0): model turns and environment turns in one token
//! sequence, exactly as the sampler saw it. The spans the environment wrote are listed in
//! `env`; those tokens are context, never actions: the trainer computes no loss on them, and
//! their log-probs, versions, kept sets and token rewards are ignored. A group with an
//! episode is written as 2.0, since a 1.x trainer would train environment tokens as the
//! model's own.
//!
//! A mixture-of-experts policy's group also carries its routing (schema 2.2, see
//! [`super::routing`]): the experts chosen for the prompt's tokens once in
//! `prompt_routing`, and for each sample's tokens in its `routing`. A 2.1 reader ignores
//! both and trains with live routing, which is what it did before.

use super::error::check_finite;
use super::{CodecError, Floats, Message, Routing, SamplingMask, SchemaVersion, Tokens};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Log-probs may come out a hair above zero through float rounding; anything beyond this
/// is a producer bug, not rounding.
const LOGPROB_TOLERANCE: f32 = 1e-4;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutGroup {
    pub schema: SchemaVersion,
    /// Unique id of this group (`{gen_id}-{counter}`).
    pub group_id: String,
    pub prompt_id: String,
    pub task: String,
    pub prompt_tokens: Tokens,
    /// The completions; the group is the atomic unit (GRPO needs all of them together).
    pub samples: Vec<Sample>,
    pub sampling: SamplingParams,
    /// Which generator produced the group (consumer name).
    pub gen_id: String,
    /// When generation of the group started and finished, microseconds since the epoch.
    pub started_us: u64,
    pub finished_us: u64,
    /// Task data passed through from the prompt (e.g. the reference answer).
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// Mixture-of-experts policies (schema 2.2): the experts the router chose for each
    /// prompt token, recorded once for the group (the prompt is prefilled once). Present
    /// exactly when every sample has its `routing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_routing: Option<Routing>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Completion token ids (the prompt is not repeated).
    pub tokens: Tokens,
    /// Behaviour log-prob of each sampled token under the exact distribution it was drawn
    /// from: after temperature, top-k and top-p.
    pub logprobs: Floats,
    /// Run-length policy versions: `[start_index, version]` pairs, first start 0, starts
    /// increasing, versions non-decreasing. Token `i` was sampled by the version of the last
    /// run starting at or before `i`.
    pub versions: Vec<VersionRun>,
    pub finish: FinishReason,
    /// Token ids that survived top-k/top-p at each step, when sampling truncated the
    /// distribution; lets the trainer renormalise over the same support (Keep Sampling Mask).
    /// Packed kept sets since 3.0, CSR before (see [`super::mask`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<SamplingMask>,
    /// Episodes (schema 2.0): the spans of `tokens` the environment wrote, in order and not
    /// overlapping. Empty for a single-turn completion.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<Span>,
    /// Episodes (schema 2.1): the environment's reward for each turn it judged, on the
    /// turn's last model token, as `[index, reward]` pairs in increasing index order. The
    /// scorer places them in `token_rewards`. Empty for a single-turn completion.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turn_rewards: Vec<TurnReward>,
    /// Mixture-of-experts policies (schema 2.2): the experts the router chose for each
    /// token the model read, that is every token but the last (no forward pass reads the
    /// last token: nothing is sampled after it). A token's routing is the one computed when
    /// it was first fed, by the version that fed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Routing>,
}

/// `[index, reward]` on the wire: the environment's reward for the turn whose last model
/// token is `index`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(from = "(u32, f32)", into = "(u32, f32)")]
pub struct TurnReward {
    pub index: u32,
    pub reward: f32,
}

impl From<(u32, f32)> for TurnReward {
    fn from((index, reward): (u32, f32)) -> Self {
        TurnReward { index, reward }
    }
}
impl From<TurnReward> for (u32, f32) {
    fn from(r: TurnReward) -> Self {
        (r.index, r.reward)
    }
}

/// `[start, len]` on the wire: tokens `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(u32, u32)", into = "(u32, u32)")]
pub struct Span {
    pub start: u32,
    pub len: u32,
}

impl From<(u32, u32)> for Span {
    fn from((start, len): (u32, u32)) -> Self {
        Span { start, len }
    }
}
impl From<Span> for (u32, u32) {
    fn from(s: Span) -> Self {
        (s.start, s.len)
    }
}

impl Span {
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// A completion of `len` tokens whose environment wrote `env` (sorted, apart), cut into
/// its turns in order: each range with whether the environment wrote it. A single-turn
/// completion is one model range.
pub fn turn_ranges(len: usize, env: &[Span]) -> Vec<(std::ops::Range<usize>, bool)> {
    let mut out = Vec::new();
    let mut at = 0;
    for span in env {
        let r = span.range();
        let r = r.start.min(len)..r.end.min(len);
        if r.start > at {
            out.push((at..r.start, false));
        }
        if !r.is_empty() {
            at = r.end;
            out.push((r, true));
        }
    }
    if at < len {
        out.push((at..len, false));
    }
    out
}

/// `[start_index, version]` on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(u32, u64)", into = "(u32, u64)")]
pub struct VersionRun {
    pub start: u32,
    pub version: u64,
}

impl From<(u32, u64)> for VersionRun {
    fn from((start, version): (u32, u64)) -> Self {
        VersionRun { start, version }
    }
}
impl From<VersionRun> for (u32, u64) {
    fn from(r: VersionRun) -> Self {
        (r.start, r.version)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token was sampled (it is the last token).
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: u32,
    /// Keep the smallest set whose probability reaches p; 1.0 disables.
    pub top_p: f32,
    pub max_new_tokens: u32,
    #[serde(default)]
    pub stop_tokens: Vec<u32>,
    /// Seed of the generator's RNG for this group, for reproduction.
    #[serde(default)]
    pub seed: u64,
}

impl Sample {
    /// Version that produced token `i`.
    pub fn version_at(&self, i: usize) -> u64 {
        let idx = self.versions.partition_point(|r| r.start as usize <= i);
        self.versions[idx.saturating_sub(1)].version
    }

    /// Whether the sample is an episode: it has environment tokens or turn rewards.
    pub fn is_episode(&self) -> bool {
        !self.env.is_empty() || !self.turn_rewards.is_empty()
    }

    /// The sample's turns in order: each range of tokens with whether the environment
    /// wrote it (see [`turn_ranges`]).
    pub fn turns(&self) -> Vec<(std::ops::Range<usize>, bool)> {
        turn_ranges(self.tokens.len(), &self.env)
    }

    /// Whether each token is the model's own (an action, 1) or the environment's (0).
    pub fn model_tokens(&self) -> Vec<bool> {
        let mut own = vec![true; self.tokens.len()];
        for span in &self.env {
            for t in span.range() {
                if let Some(o) = own.get_mut(t) {
                    *o = false;
                }
            }
        }
        own
    }

    /// The oldest version in the sample: what staleness is measured by.
    pub fn oldest_version(&self) -> Option<u64> {
        self.versions.first().map(|r| r.version)
    }

    pub(crate) fn validate(&self, kind: &'static str, idx: usize) -> Result<(), CodecError> {
        let n = self.tokens.len();
        let field = |name: &str| format!("samples[{idx}].{name}");
        if self.logprobs.len() != n {
            return Err(CodecError::length(
                kind,
                field("logprobs"),
                n,
                self.logprobs.len(),
            ));
        }
        check_finite(kind, &field("logprobs"), &self.logprobs)?;
        if let Some(i) = self.logprobs.iter().position(|&l| l > LOGPROB_TOLERANCE) {
            return Err(CodecError::invalid(
                kind,
                format!("{}[{i}]", field("logprobs")),
                format!("log-prob {} is positive", self.logprobs[i]),
            ));
        }
        self.validate_versions(kind, idx)?;
        self.validate_turns(kind, idx)?;
        self.validate_mask(kind, idx)
    }

    /// The version runs: present for a non-empty sample, from token 0, starts increasing
    /// and versions never decreasing, all within the tokens.
    fn validate_versions(&self, kind: &'static str, idx: usize) -> Result<(), CodecError> {
        let n = self.tokens.len();
        let field = |name: &str| format!("samples[{idx}].{name}");
        if n > 0 && self.versions.is_empty() {
            return Err(CodecError::invalid(
                kind,
                field("versions"),
                "empty for a non-empty sample",
            ));
        }
        if let Some(first) = self.versions.first()
            && first.start != 0
        {
            return Err(CodecError::invalid(
                kind,
                field("versions"),
                "first run must start at 0",
            ));
        }
        for (j, pair) in self.versions.windows(2).enumerate() {
            if pair[1].start <= pair[0].start || pair[1].version < pair[0].version {
                return Err(CodecError::invalid(
                    kind,
                    format!("{}[{}]", field("versions"), j + 1),
                    "starts must increase and versions must not decrease",
                ));
            }
        }
        if let Some(last) = self.versions.last()
            && n > 0
            && last.start as usize >= n
        {
            return Err(CodecError::invalid(
                kind,
                field("versions"),
                format!("run starts at {} past the last token {}", last.start, n - 1),
            ));
        }
        Ok(())
    }

    /// An episode's environment spans (ordered, non-empty, within the tokens) and turn
    /// rewards (finite, on model tokens, in order).
    fn validate_turns(&self, kind: &'static str, idx: usize) -> Result<(), CodecError> {
        let n = self.tokens.len();
        let field = |name: &str| format!("samples[{idx}].{name}");
        let mut end = 0u64;
        for (j, span) in self.env.iter().enumerate() {
            let at = format!("{}[{j}]", field("env"));
            let (start, stop) = (
                u64::from(span.start),
                u64::from(span.start) + u64::from(span.len),
            );
            if span.len == 0 || start < end || stop > n as u64 {
                return Err(CodecError::invalid(
                    kind,
                    at,
                    format!(
                        "span [{}, {}) must be non-empty, after the span before it and within the {n} tokens",
                        start, stop
                    ),
                ));
            }
            end = stop;
        }
        let own = self.model_tokens();
        let mut after = None;
        for (j, r) in self.turn_rewards.iter().enumerate() {
            let i = r.index as usize;
            let problem = if !r.reward.is_finite() {
                Some(format!("reward {} is not finite", r.reward))
            } else if i >= n || !own[i] {
                Some(format!(
                    "index {i} is not one of the {n} tokens' model tokens"
                ))
            } else if after.is_some_and(|a| i <= a) {
                Some("indices must increase".to_string())
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(CodecError::invalid(
                    kind,
                    format!("{}[{j}]", field("turn_rewards")),
                    problem,
                ));
            }
            after = Some(i);
        }
        Ok(())
    }

    /// The sampling mask: one kept set per token, well-formed offsets, and every sampled
    /// model token in its kept set.
    fn validate_mask(&self, kind: &'static str, idx: usize) -> Result<(), CodecError> {
        let n = self.tokens.len();
        let field = |name: &str| format!("samples[{idx}].{name}");
        let own = self.model_tokens();
        if let Some(mask) = &self.mask {
            if mask.offsets.len() != n + 1 {
                return Err(CodecError::length(
                    kind,
                    field("mask.offsets"),
                    n + 1,
                    mask.offsets.len(),
                ));
            }
            if mask.offsets.first() != Some(&0)
                || mask.offsets.windows(2).any(|w| w[1] < w[0])
                || mask.offsets.last().map(|&o| o as usize) != Some(mask.ids.len())
            {
                return Err(CodecError::invalid(
                    kind,
                    field("mask.offsets"),
                    "must start at 0, not decrease, and end at the number of ids",
                ));
            }
            for i in (0..n).filter(|&i| own[i]) {
                if !mask.step(i).contains(&self.tokens[i]) {
                    return Err(CodecError::invalid(
                        kind,
                        format!("{}[{i}]", field("mask")),
                        format!("sampled token {} is not in the kept set", self.tokens[i]),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl SamplingParams {
    fn validate(&self, kind: &'static str) -> Result<(), CodecError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(CodecError::invalid(
                kind,
                "sampling.temperature",
                "must be finite and >= 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(CodecError::invalid(
                kind,
                "sampling.top_p",
                "must be in (0, 1]",
            ));
        }
        Ok(())
    }
}

impl RolloutGroup {
    /// The oldest token version across all samples.
    pub fn oldest_version(&self) -> Option<u64> {
        self.samples.iter().filter_map(Sample::oldest_version).min()
    }

    /// Whether any sample is an episode (environment turns, or an environment's turn
    /// rewards: an episode solved in one turn has no environment tokens).
    pub fn has_episodes(&self) -> bool {
        self.samples.iter().any(Sample::is_episode)
    }

    /// The version a group is written as: 3.0 when it carries sampling masks (packed kept
    /// sets, which a 2.x reader cannot read), 2.2 when it carries routing, 2.1 when it
    /// holds an episode (a 1.x trainer would train the environment's tokens; 2.1 added
    /// `turn_rewards`, which a 2.0 scorer ignores and then finds no answer to score
    /// against), 1.0 otherwise.
    pub fn version_for(samples: &[Sample]) -> SchemaVersion {
        if samples.iter().any(|s| s.mask.is_some()) {
            Self::SCHEMA
        } else if samples.iter().any(|s| s.routing.is_some()) {
            SchemaVersion { major: 2, minor: 2 }
        } else if samples.iter().any(Sample::is_episode) {
            SchemaVersion { major: 2, minor: 1 }
        } else {
            SchemaVersion::CURRENT
        }
    }

    /// Completion tokens across all samples.
    pub fn completion_tokens(&self) -> usize {
        self.samples.iter().map(|s| s.tokens.len()).sum()
    }

    pub(crate) fn validate_as(&self, kind: &'static str) -> Result<(), CodecError> {
        if self.samples.is_empty() {
            return Err(CodecError::invalid(
                kind,
                "samples",
                "a group needs at least one sample",
            ));
        }
        self.sampling.validate(kind)?;
        for (i, s) in self.samples.iter().enumerate() {
            s.validate(kind, i)?;
        }
        self.validate_routing(kind)
    }

    /// Routing is all or nothing: the prompt's and every sample's, one shape, each the
    /// right length with ids in range.
    fn validate_routing(&self, kind: &'static str) -> Result<(), CodecError> {
        let Some(prompt) = &self.prompt_routing else {
            return match self.samples.iter().position(|s| s.routing.is_some()) {
                Some(i) => Err(CodecError::invalid(
                    kind,
                    format!("samples[{i}].routing"),
                    "a sample has routing but the group has no prompt_routing",
                )),
                None => Ok(()),
            };
        };
        prompt.validate(kind, "prompt_routing", self.prompt_tokens.len())?;
        for (i, s) in self.samples.iter().enumerate() {
            let field = format!("samples[{i}].routing");
            let Some(r) = &s.routing else {
                return Err(CodecError::invalid(
                    kind,
                    field,
                    "missing while the group has prompt_routing",
                ));
            };
            if r.shape() != prompt.shape() {
                return Err(CodecError::invalid(
                    kind,
                    field,
                    format!(
                        "shape ({}) differs from prompt_routing's ({})",
                        r.shape(),
                        prompt.shape()
                    ),
                ));
            }
            r.validate(kind, &field, s.tokens.len().saturating_sub(1))?;
        }
        Ok(())
    }
}

impl Message for RolloutGroup {
    const KIND: &'static str = "RolloutGroup";
    const SCHEMA: SchemaVersion = SchemaVersion { major: 3, minor: 0 };
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
    fn validate(&self) -> Result<(), CodecError> {
        self.validate_as(Self::KIND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_lookup_follows_runs() {
        let s = Sample {
            tokens: vec![1, 2, 3, 4, 5].into(),
            logprobs: vec![0.0; 5].into(),
            versions: vec![(0, 3).into(), (2, 4).into(), (4, 6).into()],
            finish: FinishReason::Length,
            mask: None,
            env: Vec::new(),
            turn_rewards: Vec::new(),
            routing: None,
        };
        let got: Vec<u64> = (0..5).map(|i| s.version_at(i)).collect();
        assert_eq!(got, vec![3, 3, 4, 4, 6]);
        assert_eq!(s.oldest_version(), Some(3));
        assert_eq!(s.turns(), vec![(0..5, false)]);
    }

    #[test]
    fn a_completion_cuts_into_its_turns() {
        let span = |start, len| Span { start, len };
        assert_eq!(
            turn_ranges(9, &[span(3, 2), span(7, 1)]),
            vec![
                (0..3, false),
                (3..5, true),
                (5..7, false),
                (7..8, true),
                (8..9, false)
            ]
        );
        // Ending on an environment span (a truncated episode), and spans past the end.
        assert_eq!(
            turn_ranges(5, &[span(3, 2)]),
            vec![(0..3, false), (3..5, true)]
        );
        assert_eq!(
            turn_ranges(4, &[span(3, 9)]),
            vec![(0..3, false), (3..4, true)]
        );
        assert!(turn_ranges(0, &[]).is_empty());
    }
}

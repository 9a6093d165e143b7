//! `Event`: heartbeats and step summaries every stage writes to the events stream, read by
//! `rlstream status` and by anyone tailing the run.

use super::{Message, SchemaVersion};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub schema: SchemaVersion,
    /// `heartbeat`, `step`, `weights`, `start`, `stop`.
    pub kind: String,
    /// Stage (`gen`, `score`, `train`, `feed`).
    pub stage: String,
    /// Consumer / process name within the stage.
    pub source: String,
    /// Policy version the source holds.
    pub version: u64,
    /// Named numbers (`loss`, `reward_mean`, `tokens_per_s`, ...).
    #[serde(default)]
    pub fields: BTreeMap<String, f64>,
    /// Free-form text (a reason for a stop, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub time_us: u64,
    /// Schema 1.1, kind `outcomes`: how the prompts of the groups a scorer just scored
    /// fared, one entry per group, for a difficulty-aware feed. Empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outcomes: Vec<PromptOutcome>,
}

/// How one prompt fared in one scored group: its completions, and those whose verifier
/// reward was full marks (≥ 1, as the step record's `accuracy` counts), before any reward
/// shaping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptOutcome {
    pub prompt_id: String,
    pub passed: u32,
    pub samples: u32,
}

impl PromptOutcome {
    /// Whether a verifier reward is a pass: full marks (≥ 1). The step record's `accuracy`
    /// counts the same.
    pub fn passes(reward: f32) -> bool {
        reward >= 1.0
    }

    /// The share of the completions that passed.
    pub fn pass_rate(&self) -> f64 {
        f64::from(self.passed) / f64::from(self.samples.max(1))
    }
}

impl Event {
    /// The `kind` of an event that carries outcomes.
    pub const OUTCOMES: &'static str = "outcomes";

    /// An event of `kind` from `source` of `stage`, now, with no fields (schema 1.0).
    pub fn new(kind: &str, stage: &str, source: &str, version: u64) -> Self {
        Event {
            schema: SchemaVersion::CURRENT,
            kind: kind.into(),
            stage: stage.into(),
            source: source.into(),
            version,
            fields: BTreeMap::new(),
            text: None,
            time_us: crate::time::now_us(),
            outcomes: Vec::new(),
        }
    }

    /// A scorer's `outcomes` event (schema 1.1: a 1.0 reader ignores the outcomes).
    pub fn outcomes(stage: &str, source: &str, outcomes: Vec<PromptOutcome>) -> Self {
        Event {
            schema: Self::SCHEMA,
            outcomes,
            ..Event::new(Self::OUTCOMES, stage, source, 0)
        }
    }
}

impl Message for Event {
    const KIND: &'static str = "Event";
    const SCHEMA: SchemaVersion = SchemaVersion { major: 1, minor: 1 };
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
    fn validate(&self) -> Result<(), super::CodecError> {
        if let Some(o) = self.outcomes.iter().find(|o| o.passed > o.samples) {
            return Err(super::CodecError::invalid(
                Self::KIND,
                "outcomes",
                format!(
                    "{}: {} passed of {} samples",
                    o.prompt_id, o.passed, o.samples
                ),
            ));
        }
        Ok(())
    }
}

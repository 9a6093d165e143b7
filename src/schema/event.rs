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
}

impl Message for Event {
    const KIND: &'static str = "Event";
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
}

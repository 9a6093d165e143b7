//! The messages that flow between stages, and their MessagePack codec.
//!
//! One file per message type. Each is a MessagePack map with named fields and a `schema`
//! version `[major, minor]`; the language-neutral description of each lives in `schemas/`
//! at the repository root, with golden fixtures that tests in both Rust and Python check.

mod codec;
mod dead;
mod error;
mod event;
pub mod examples;
pub mod json;
mod limits;
mod mask;
mod packed;
mod prompt;
mod rollout;
mod routing;
mod scored;
mod step;
mod weights;

pub use codec::{DEFAULT_MAX_MESSAGE_BYTES, Message, decode, decode_limited, encode};
pub use dead::DeadLetter;
pub use error::CodecError;
pub use event::{Event, PromptOutcome};
pub use limits::{Limits, Refusal};
pub use mask::{CsrMask, SamplingMask};
pub use packed::{Floats, Packable, Packed, Tokens};
pub use prompt::Prompt;
pub use rollout::{
    FinishReason, RolloutGroup, Sample, SamplingParams, Span, TurnReward, VersionRun, turn_ranges,
};
pub use routing::{Routing, RoutingShape};
pub use scored::ScoredGroup;
pub use step::{StepFieldError, StepRecord};
pub use weights::{AdapterInfo, DELTA_FORMAT, LORA_FORMAT_PREFIX, WeightsAnnounce, WeightsKind};

use serde::{Deserialize, Serialize};
use std::fmt;

/// `[major, minor]` on the wire. A reader accepts any minor of its major (new fields are
/// ignored) and refuses a newer major, whose meaning it cannot know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(from = "(u16, u16)", into = "(u16, u16)")]
pub struct SchemaVersion {
    pub major: u16,
    pub minor: u16,
}

impl SchemaVersion {
    /// What this build writes.
    pub const CURRENT: SchemaVersion = SchemaVersion { major: 1, minor: 0 };
}

impl From<(u16, u16)> for SchemaVersion {
    fn from((major, minor): (u16, u16)) -> Self {
        SchemaVersion { major, minor }
    }
}

impl From<SchemaVersion> for (u16, u16) {
    fn from(v: SchemaVersion) -> Self {
        (v.major, v.minor)
    }
}

impl Default for SchemaVersion {
    fn default() -> Self {
        SchemaVersion::CURRENT
    }
}

impl fmt::Display for SchemaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Microseconds since the Unix epoch: the unit of every `*_us` timestamp field.
pub use crate::time::now_us;

pub(crate) fn check_finite(
    kind: &'static str,
    field: &str,
    values: &[f32],
) -> Result<(), CodecError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(CodecError::invalid(
            kind,
            format!("{field}[{i}]"),
            format!("{} is not finite", values[i]),
        )),
    }
}

#[cfg(test)]
mod tests;

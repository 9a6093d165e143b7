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
mod version;
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
pub use version::SchemaVersion;
pub use weights::{AdapterInfo, DELTA_FORMAT, LORA_FORMAT_PREFIX, WeightsAnnounce, WeightsKind};

/// Microseconds since the Unix epoch: the unit of every `*_us` timestamp field.
pub use crate::time::now_us;

#[cfg(test)]
mod tests;

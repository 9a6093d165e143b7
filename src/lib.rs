//! rlstream: asynchronous reinforcement learning for language-model policies as a stream
//! pipeline.
//!
//! Map of the crate:
//! - [`schema`]: the messages stages exchange (MessagePack maps, versioned, validated).
//! - [`bus`]: streams with consumer groups, on Redis or in memory, and the typed
//!   [`bus::Consumer`] that applies the delivery policy (claim, dead-letter).
//!
//! - [`model`]: the policy (Llama/Qwen2-family decoder in burn), Hugging Face checkpoints,
//!   the KV-cache sampler and the trainer's log-probs.
//! - [`commands`]: user commands other than the stages (`rlstream generate`).

pub mod bus;
pub mod commands;
pub mod config;
pub mod model;
pub mod schema;
pub mod stages;
pub mod tasks;
pub mod weights;

//! rlstream: asynchronous reinforcement learning for language-model policies as a stream
//! pipeline.
//!
//! Map of the crate:
//! - [`schema`]: the messages stages exchange (MessagePack maps, versioned, validated).
//! - [`bus`]: streams with consumer groups, on Redis or in memory, and the typed
//!   [`bus::Consumer`] that applies the delivery policy (claim, dead-letter).
//!
//! The stages (`gen`, `score`, `train`) and the model build on these two.

pub mod bus;
pub mod schema;

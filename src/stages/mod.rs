//! The pipeline stages. Every stage is `run(job, ctx) -> Result<Summary, StageError>`: `job`
//! is what the stage does (its settings; for `gen` and `train` also the model and weights
//! hand-over they start from, and for `train` its ranks), `ctx` a [`StageContext`] (bus,
//! topology, role and consumer name, shutdown). The same code runs as a separate process
//! (`rlstream gen|score|train|feed`) or as a task of `rlstream run`. When the shutdown
//! completes the stage finishes the batch in hand, acks what is done, leaves the rest pending
//! for others, and returns its summary. Stages meet only on the bus: none imports another,
//! and what they share ([`runtime`]) names none of their types.

pub mod feed;
pub mod generator;
pub mod policy;
pub mod runtime;
pub mod score;
pub mod train;

pub use runtime::{
    HEARTBEAT_EVERY, Heartbeat, Shutdown, StageContext, StageError, held_version, waiting,
};

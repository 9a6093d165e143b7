//! rlstream: asynchronous reinforcement learning for language-model policies as a stream
//! pipeline.
//!
//! Map of the crate:
//! - [`schema`]: the messages stages exchange (MessagePack maps, versioned, validated).
//! - [`bus`]: streams with consumer groups, on Redis or in memory, and the typed
//!   [`bus::Consumer`] that applies the delivery policy (claim, dead-letter).
//! - [`model`]: the policy (Llama/Qwen2-family decoder in burn), Hugging Face checkpoints,
//!   the KV-cache sampler and the trainer's log-probs.
//! - [`tasks`]: built-in tasks, verifiers and JSONL datasets.
//! - [`env`]: environments of multi-turn episodes (the built-in `guess` game).
//! - [`stages`]: `feed`, `gen`, `score`, `train`, each `run(config, bus, topology, shutdown)`.
//! - [`weights`]: weight publication and the generator's follower.
//! - [`config`]: the config file / environment / flag precedence.
//! - [`metrics`]: every metric name and the Prometheus exporter.
//! - [`archive`] and [`retention`]: stream archives (dump, load) and safe trimming.
//! - [`commands`]: user commands other than the stages (`run`, `status`, `replay`,
//!   `generate`, `sft`).
//! - [`seed`]: seeds derived from the run seed and a prompt's identity.
//! - [`cpu`]: OpenBLAS kernel selection for the `blas` feature.
//! - [`display`] and [`report`]: progress bars or log lines, and the run report.

pub mod archive;
pub mod bus;
pub mod cli;
pub mod commands;
pub mod config;
pub mod cpu;
pub mod display;
pub mod env;
pub mod metrics;
pub mod model;
pub mod report;
pub mod retention;
pub mod roles;
pub mod schema;
pub mod seed;
pub mod settings;
pub mod stages;
pub mod tasks;
pub mod time;
pub mod weights;

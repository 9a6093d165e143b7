//! rlstream: asynchronous reinforcement learning for language-model policies as a stream
//! pipeline.
//!
//! Map of the crate:
//! - [`schema`]: the messages stages exchange (MessagePack maps, versioned, validated).
//! - [`bus`]: streams with consumer groups, on Redis or in memory, and the typed
//!   [`bus::Consumer`] that applies the delivery policy (claim, dead-letter).
//! - [`model`]: the policy (Llama/Qwen2-family and mixture-of-experts decoders in burn),
//!   Hugging Face checkpoints, LoRA adapters, the KV-cache sampler and the trainer's
//!   log-probs.
//! - [`tasks`]: built-in tasks, verifiers and datasets (JSONL, Parquet).
//! - [`env`]: environments of multi-turn episodes (the built-in `guess` game and `calc`
//!   tool, environment processes speaking JSON lines) and playing them to the end.
//! - [`child`]: a child process speaking JSON lines (external scorers, environment
//!   processes).
//! - [`stages`]: `feed`, `gen`, `score`, `train`, each `run(job, ctx)` with a
//!   [`stages::StageContext`] (bus, topology, role, shutdown).
//! - [`collective`]: all-reduce, broadcast and all-gather among data-parallel trainer
//!   ranks (MPI behind the `mpi` feature, NCCL behind `cuda`).
//! - [`weights`]: weight publication and the generator's follower.
//! - [`config`]: the config file / environment / flag precedence.
//! - [`metrics`]: every metric name and the Prometheus exporter.
//! - [`archive`] and [`retention`]: stream archives (dump, load) and safe trimming.
//! - [`commands`]: what commands do beyond a stage (`run`, `eval`, `status`, `replay`,
//!   `sft`, `generate`).
//! - [`cli`]: the command line, one module per command.
//! - [`settings`]: the one-definition settings macro; [`roles`]: stage and stream names;
//!   [`time`]: durations as people write them.
//! - [`seed`]: seeds derived from the run seed and a prompt's identity.
//! - [`cpu`]: OpenBLAS kernel selection for the `blas` feature.
//! - [`display`] and [`report`]: progress bars or log lines, and the run report.

pub mod archive;
pub mod bus;
pub mod child;
pub mod cli;
pub mod collective;
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

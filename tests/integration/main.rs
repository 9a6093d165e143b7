//! The integration tests, in one binary: each module is one area, and every test runs the
//! real thing (a real Redis on loopback, the `rlstream` binary for stage processes, real
//! burn tensors). One binary links the crate once instead of once per file.

// A test states its scenario end to end, set-up and checks together: the function-length
// limit the library keeps does not apply here.
#![allow(clippy::too_many_lines)]

mod agent_episodes;
mod bad_input;
mod bitwise;
mod bus_conformance;
mod chaos;
mod chat_pipeline;
mod chat_template;
mod common;
mod decode_kernels;
mod difficulty_feed;
mod distill;
mod docs;
mod empty_launches;
mod endpoint_abuse;
mod episodes;
mod full_disk;
mod generate_cli;
mod grad_parity;
mod head_memory;
mod layering;
mod lora;
mod model_parity;
mod model_sampling;
mod nccl_ranks;
mod newcomer;
mod observability;
mod openai_endpoint;
mod pipeline_processes;
mod poison;
mod python_interop;
mod redis_auth;
mod redis_failures;
mod redis_restart;
mod redis_tls;
mod replay;
mod reproducible;
mod routing;
mod run_command;
mod run_dataset;
mod schema_bad_input;
mod schema_fixtures;
mod score_stage;
mod settings;
mod smollm2;
mod stage_boundaries;
mod stream_budget;
mod train_resume;
mod train_step;
#[cfg(feature = "mpi")]
mod trainer_ranks;
mod transfers;
mod weights_store;
mod weights_transfer;

//! What the commands do beyond running one stage, each a folder or file of its own:
//! `run` (the pipeline in one process), `eval` (held-out results), `status` (a pipeline at a
//! glance), `replay` (reading recorded streams and re-training), `sft` (the warm start) and
//! `generate` (sampling from a checkpoint). Each takes plain options built by its `cli`
//! module and returns its result, so tests call them directly; archive moves and trimming
//! live below, in [`crate::archive`] and [`crate::retention`].

pub mod eval;
pub mod generate;
pub mod replay;
pub mod run;
pub mod sft;
pub mod status;

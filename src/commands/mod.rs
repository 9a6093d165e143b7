//! User commands that are not pipeline stages. Each takes plain options (built by the CLI in
//! `main.rs`) and writes its result to a writer, so tests call them directly.

pub mod eval;
pub mod generate;
pub mod replay;
pub mod run;
pub mod sft;
pub mod status;

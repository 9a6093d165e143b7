//! The `rlstream` command line: one module per command, each with its clap struct
//! (`RunCommand`, `FeedCommand`, …) and an `exec`. Stage settings come from their one definition (see [`crate::settings`]); a
//! command's flags are the last layer over its defaults, the file and the environment.

mod command;
mod common;
mod dump;
mod errors;
mod eval;
mod feed;
mod generate;
mod inspect;
mod load;
pub mod reference;
mod replay;
mod run;
mod score;
mod sft;
mod stage_gen;
mod status;
mod streams;
mod train;
mod trim;

pub use command::{Cli, Command};
pub use common::{StageArgs, shutdown_signal};
pub use errors::{one_line, report};

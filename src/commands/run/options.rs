//! What a run is asked to do: its task or model, warm start, directories and schedule.

use crate::commands::sft::SftOptions;
use crate::display::DisplayMode;
use crate::tasks::BuiltinTask;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub task: BuiltinTask,
    /// Start from this Hugging Face model (with the rlstream character tokenizer) instead
    /// of a warm start.
    pub model: Option<PathBuf>,
    /// Warm start when no model is given.
    pub sft: SftOptions,
    /// Run directory: warm-start model, checkpoints, report.
    pub out: PathBuf,
    /// Report directory (default `OUT/report`).
    pub report: Option<PathBuf>,
    pub sync: bool,
    pub seed: u64,
    pub display: DisplayMode,
}

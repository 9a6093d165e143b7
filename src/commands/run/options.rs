//! What a run is asked to do: its prompts (a built-in task or a dataset), its model or warm
//! start, directories and schedule.

use crate::commands::sft::SftOptions;
use crate::display::DisplayMode;
use crate::tasks::{BuiltinTask, Columns};
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Where the prompts come from.
    pub prompts: RunPrompts,
    /// Start from this Hugging Face model instead of a warm start: for a built-in task one
    /// with the rlstream character tokenizer, for a dataset any supported model.
    pub model: Option<PathBuf>,
    /// Warm start when no model is given (built-in tasks only).
    pub sft: SftOptions,
    /// Run directory: warm-start model, checkpoints, report.
    pub out: PathBuf,
    /// Report directory (default `OUT/report`).
    pub report: Option<PathBuf>,
    pub sync: bool,
    pub seed: u64,
    pub display: DisplayMode,
}

/// Where a run's prompts come from.
#[derive(Debug, Clone)]
pub enum RunPrompts {
    /// A built-in task's endless stream, its held-out split evaluated.
    Task(BuiltinTask),
    /// A dataset's rows, epoch after epoch (shuffled by the seed), with a held-out split.
    Dataset(DatasetSource),
}

/// A dataset to learn: JSONL or Parquet, as `rlstream feed --dataset` reads it.
#[derive(Debug, Clone)]
pub struct DatasetSource {
    pub path: PathBuf,
    pub columns: Columns,
    /// The held-out file; when absent, `held_out_share` of `path`'s rows, chosen by a hash
    /// of each row's prompt, are held out of training.
    pub eval: Option<PathBuf>,
    pub held_out_share: f64,
}

impl RunPrompts {
    /// The task's name, or the dataset's file stem.
    pub fn name(&self) -> String {
        match self {
            RunPrompts::Task(t) => t.name().to_string(),
            RunPrompts::Dataset(d) => d
                .path
                .file_stem()
                .map_or_else(|| "dataset".into(), |s| s.to_string_lossy().into_owned()),
        }
    }
}

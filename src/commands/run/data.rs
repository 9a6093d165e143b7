//! A dataset run's prompts: the training rows and the held-out rows, from `--eval-dataset`
//! or the held-out share of the file, chat rows rendered with the model's chat template.

use super::options::DatasetSource;
use crate::commands::eval::EvalSet;
use crate::model::ModelConfig;
use crate::model::tokenizer::Tokenizer;
use crate::stages::{StageError, feed};
use crate::tasks::Dataset;
use std::path::Path;

/// A dataset run's rows, chat rows rendered.
pub(super) struct DatasetRows {
    pub(super) train: Dataset,
    pub(super) held_out: Dataset,
}

impl DatasetRows {
    /// Loads `src` for the model in `model_dir` (whose chat template renders chat rows) and
    /// splits off its held-out rows. A split that leaves nothing to train on is refused;
    /// one that leaves nothing to evaluate is refused when `evaluate`.
    pub(super) fn load(
        src: &DatasetSource,
        model_dir: &Path,
        evaluate: bool,
    ) -> Result<Self, StageError> {
        let d = Dataset::load_reported(&src.path, &src.columns)?;
        let rows = d.items.len();
        let (mut train, mut held_out) = match &src.eval {
            Some(eval) => (d, Dataset::load_reported(eval, &src.columns)?),
            None => d.split(src.held_out_share),
        };
        let file = src.path.display();
        let share = src.held_out_share;
        if train.items.is_empty() {
            return Err(StageError::Other(format!(
                "all {rows} rows of {file} fall in the held-out share {share}: lower \
                 --held-out-share or give the held-out rows as --eval-dataset FILE"
            )));
        }
        if evaluate && held_out.items.is_empty() {
            return Err(StageError::Other(format!(
                "no row of {file} ({rows} rows) falls in the held-out share {share}: give \
                 --eval-dataset FILE, a larger --held-out-share, or --eval-prompts 0"
            )));
        }
        for (d, path) in [
            (&mut train, src.path.as_path()),
            (&mut held_out, src.eval.as_deref().unwrap_or(&src.path)),
        ] {
            if d.has_chat() {
                feed::render_chat(d, path, Some(model_dir))?;
            }
        }
        Ok(DatasetRows { train, held_out })
    }

    /// The first `n` held-out rows as `rlstream eval`'s set for the model in `model_dir`
    /// (its tokenizer and stop tokens), at most `max_new_tokens` each.
    pub(super) fn eval_set(
        &self,
        model_dir: &Path,
        config: &ModelConfig,
        n: usize,
        max_new_tokens: u32,
    ) -> Result<EvalSet, StageError> {
        let usage = |e: crate::commands::eval::EvalError| StageError::Other(e.to_string());
        let mut set = EvalSet::of_items(
            self.held_out.name.clone(),
            self.held_out.items.iter().map(|it| it.item.clone()),
            Tokenizer::load(model_dir)?,
            crate::model::hf::stop_tokens(model_dir, config),
            n,
        )
        .map_err(usage)?;
        set.max_new_tokens = max_new_tokens;
        set.check_fits(&config.limits()).map_err(usage)?;
        Ok(set)
    }
}

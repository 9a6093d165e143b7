//! The run's held-out evaluations: `rlstream eval`'s set and metrics on the policy before
//! RL, at the checkpoint nearest halfway and after.

use super::options::RunOptions;
use super::summary::HeldOut;
use crate::commands::eval::{self, EvalSampling, EvalSet};
use crate::config::Config;
use crate::display::DisplayMode;
use crate::model::{InferBackend, Policy};
use crate::stages::{StageError, train};
use std::path::{Path, PathBuf};

/// The run's held-out evaluations: `rlstream eval`'s set and metrics at the run's
/// temperature and seed.
pub(super) struct HeldOutEval {
    set: Option<EvalSet>,
    sampling: EvalSampling,
    display: DisplayMode,
}

impl HeldOutEval {
    /// Evaluations on `set` (none when `None`).
    pub(super) fn new(set: Option<EvalSet>, opts: &RunOptions, cfg: &Config) -> Self {
        HeldOutEval {
            set,
            sampling: EvalSampling {
                samples: cfg.run.eval_samples,
                ..EvalSampling::run(cfg.policy.temperature, opts.seed)
            },
            display: opts.display,
        }
    }

    /// The evaluation of `policy` after `step` steps, shown as `eval {when}` (`before`,
    /// `halfway`, `after`).
    pub(super) fn of(
        &self,
        step: u64,
        when: &str,
        policy: &Policy<InferBackend>,
    ) -> Result<Option<HeldOut>, StageError> {
        let Some(set) = &self.set else {
            return Ok(None);
        };
        let label = format!("eval {when}");
        let eval = tokio::task::block_in_place(|| {
            eval::evaluate(policy, set, &self.sampling, self.display, &label)
        })?;
        Ok(Some(HeldOut { step, eval }))
    }
}

/// The checkpoints to evaluate after a run: the one nearest halfway (when there is one
/// between the start and the end), then the last.
pub(super) fn held_out_checkpoints(root: &Path) -> Vec<(u64, PathBuf)> {
    let Some(last) = train::checkpoint::latest(root) else {
        return Vec::new();
    };
    let step_of = train::checkpoint::step_of;
    let Some(end) = step_of(&last) else {
        return Vec::new();
    };
    let middle = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| d.join(train::checkpoint::STATE_FILE).exists())
        .filter_map(|d| step_of(&d).map(|s| (s, d)))
        .filter(|(s, _)| *s > 0 && *s < end)
        .min_by_key(|(s, _)| s.abs_diff(end / 2));
    middle.into_iter().chain([(end, last)]).collect()
}

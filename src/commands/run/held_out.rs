//! The run's held-out evaluations: `rlstream eval`'s set and metrics on the policy before
//! RL, at the checkpoint nearest halfway (or at every `run.eval_every` steps) and after.

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

    /// The evaluation of `policy` after `step` steps, finished `time_s` seconds into RL,
    /// shown as `eval {when}` (`before`, `halfway`, `step N`, `after`).
    pub(super) fn of(
        &self,
        step: u64,
        time_s: f64,
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
        Ok(Some(HeldOut { step, time_s, eval }))
    }
}

/// The checkpoints to evaluate after a run, by step: those at multiples of `every` before
/// the end, or with `every` 0 the one nearest halfway (when there is one between the start
/// and the end); then the last.
pub(super) fn held_out_checkpoints(root: &Path, every: u64) -> Vec<(u64, PathBuf)> {
    let Some(last) = train::checkpoint::latest(root) else {
        return Vec::new();
    };
    let step_of = train::checkpoint::step_of;
    let Some(end) = step_of(&last) else {
        return Vec::new();
    };
    let mut inner: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| d.join(train::checkpoint::STATE_FILE).exists())
        .filter_map(|d| step_of(&d).map(|s| (s, d)))
        .filter(|(s, _)| *s > 0 && *s < end)
        .collect();
    if every == 0 {
        inner = inner
            .into_iter()
            .min_by_key(|(s, _)| s.abs_diff(end / 2))
            .into_iter()
            .collect();
    } else {
        inner.retain(|(s, _)| s % every == 0);
        inner.sort_by_key(|(s, _)| *s);
    }
    inner.into_iter().chain([(end, last)]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checkpoint folders at `steps` under a new temporary root.
    fn checkpoints(steps: &[u64]) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("a temporary directory");
        for s in steps {
            let d = train::checkpoint::dir_for(root.path(), *s);
            std::fs::create_dir_all(&d).expect("a checkpoint folder");
            std::fs::write(d.join(train::checkpoint::STATE_FILE), b"{}").expect("a state file");
            let name = d.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            std::fs::write(root.path().join(train::checkpoint::LATEST), name).expect("latest");
        }
        root
    }

    fn steps(picked: &[(u64, PathBuf)]) -> Vec<u64> {
        picked.iter().map(|(s, _)| *s).collect()
    }

    #[test]
    fn halfway_or_every_multiple_then_the_last() {
        let root = checkpoints(&[10, 20, 30, 40, 50, 60]);
        assert_eq!(steps(&held_out_checkpoints(root.path(), 0)), [30, 60]);
        assert_eq!(steps(&held_out_checkpoints(root.path(), 20)), [20, 40, 60]);
        assert_eq!(
            steps(&held_out_checkpoints(root.path(), 10)),
            [10, 20, 30, 40, 50, 60]
        );
        let empty = checkpoints(&[]);
        assert!(held_out_checkpoints(empty.path(), 10).is_empty());
    }
}

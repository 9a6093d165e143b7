//! One step over every trainer rank, as its optimizer updates.
//!
//! A step's groups split into mini-batches of `ppo_mini_batch_size` groups, run
//! `ppo_epochs` times in order (verl's `ppo_mini_batch_size`, `ppo_epochs`): one update
//! each, whose loss is divided by that mini-batch's tokens or sequences. Each update is
//! shared among the ranks by tokens ([`collective::shares`]), its gradients summed and the
//! same clipped update applied on every rank. The step publishes one version however many
//! updates it takes. The first update's policy is the one before the step, so under
//! `--sync` its ratios are exactly 1; PPO's clip binds from the second on.
//!
//! Decoupled PPO (`use_decoupled_loss`) takes the ratio against the proximal policy, the
//! one before the step: with one update that is the policy the forward runs; with several,
//! its log-probs are recomputed before the first update (each rank its share of the
//! groups, all-gathered) or interpolated per token (`prox_logp_method = loglinear`).
//!
//! A group whose pass panics is found as one trainer finds it (each group of that rank's
//! share alone) and rejected; the update is taken again on the rest and the later updates
//! skip it. An update that panics changes no weight.

use super::loss::{self, Pass, Prox, Proximal};
use super::sums::TokenSums;
use super::{ProxMethod, TrainConfig, TrainOn, TrainerOn};
use crate::collective::{self, Collective};
use crate::model::fault;
use crate::schema::{ScoredGroup, StepRecord};
use crate::stages::StageError;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// A rank's outcome of its share of an update.
#[derive(Debug, Serialize, Deserialize)]
enum Status {
    Done(TokenSums),
    /// The share's pass panicked (`panic`); `alone` are the step's groups (indices into
    /// the step's groups) that panic alone.
    Panicked {
        alone: Vec<usize>,
        panic: String,
    },
    Failed(String),
}

/// The result of a step over all ranks.
pub struct Outcome {
    /// `None` when no group was left to step on.
    pub record: Option<StepRecord>,
    /// The groups the step was taken on (indices into the step's groups).
    pub kept: Vec<usize>,
    /// Groups whose pass panicked alone, or that were in an update that panicked again,
    /// with the reason: dead-lettered by rank 0.
    pub rejected: Vec<(usize, String)>,
}

/// The step's updates: the indices of the groups each one trains, mini-batch by
/// mini-batch, epoch after epoch.
pub fn plan(groups: usize, cfg: &TrainConfig) -> Vec<Vec<usize>> {
    let size = match cfg.ppo_mini_batch_size {
        0 => groups.max(1),
        n => n,
    };
    let batches: Vec<Vec<usize>> = (0..groups)
        .collect::<Vec<_>>()
        .chunks(size)
        .map(<[usize]>::to_vec)
        .collect();
    (0..cfg.ppo_epochs.max(1))
        .flat_map(|_| batches.iter().cloned())
        .collect()
}

/// What a step of `updates` updates takes its ratios against, the trainer at `version`.
fn prox(cfg: &TrainConfig, updates: usize, version: u64) -> Prox {
    match (cfg.use_decoupled_loss, updates > 1, cfg.prox_logp_method) {
        (false, ..) => Prox::Behaviour,
        (true, false, _) => Prox::Current,
        (true, true, ProxMethod::Loglinear) => Prox::Loglinear { version },
        (true, true, ProxMethod::Recompute) => Prox::Recomputed,
    }
}

/// One step on `groups` over every rank of `c`, from rank 0's loop or a following rank
/// alike (see the module).
pub fn step<B: TrainOn>(
    trainer: &mut TrainerOn<B>,
    c: &mut dyn Collective,
    groups: &[&ScoredGroup],
) -> Result<Outcome, StageError> {
    let started = Instant::now();
    let number = trainer.state.step + 1;
    let cfg = trainer.settings().train.clone();
    let plan = plan(groups.len(), &cfg);
    let prox = prox(&cfg, plan.len(), trainer.state.version);
    let mut out = vec![false; groups.len()];
    let mut rejected = Vec::new();
    let proximal = match prox {
        Prox::Recomputed => {
            let (map, bad) = proximal(trainer, c, groups, number)?;
            for (i, detail) in bad {
                out[i] = true;
                rejected.push((i, detail));
            }
            Some(map)
        }
        _ => None,
    };
    let (mut applied, mut taken, mut norms) = (TokenSums::default(), 0usize, Vec::new());
    let mut skipped = TokenSums::default();
    for (u, members) in plan.iter().enumerate() {
        let pick: Vec<usize> = members.iter().copied().filter(|&i| !out[i]).collect();
        if pick.is_empty() {
            continue;
        }
        let what = if plan.len() == 1 {
            format!("step {number}")
        } else {
            format!("step {number} update {}", u + 1)
        };
        let first = taken == 0;
        let done = update(
            trainer,
            c,
            groups,
            pick,
            &what,
            first,
            prox,
            proximal.as_ref(),
        )?;
        for (i, detail) in done.rejected {
            out[i] = true;
            rejected.push((i, detail));
        }
        let Some((sums, norm, ok)) = done.sums else {
            continue;
        };
        norms.push(norm);
        if ok {
            applied.add(&sums);
            taken += 1;
        } else {
            skipped.add(&sums);
        }
    }
    let kept: Vec<usize> = (0..groups.len()).filter(|&i| !out[i]).collect();
    if kept.is_empty() || norms.is_empty() {
        return Ok(Outcome {
            record: None,
            kept,
            rejected,
        });
    }
    let trained: Vec<&ScoredGroup> = kept.iter().map(|&i| groups[i]).collect();
    let mut record = match taken {
        0 => skipped.record(&trained, norms.len()),
        n => applied.record(&trained, n),
    };
    record.skipped = taken == 0;
    record.grad_norm = norms.iter().sum::<f64>() / norms.len() as f64;
    let record = trainer.finish(record, &trained, started);
    Ok(Outcome {
        record: Some(record),
        kept,
        rejected,
    })
}

impl<B: TrainOn> TrainerOn<B> {
    /// One step on `groups` in this process: its updates ([`super::steps`]) with the
    /// same containment as the stage's. A non-finite loss or gradient skips an update and
    /// leaves the weights untouched.
    pub fn step(&mut self, groups: &[&ScoredGroup]) -> Result<StepRecord, StageError> {
        let outcome = step(self, &mut collective::Solo::default(), groups)?;
        match (outcome.record, outcome.rejected.first()) {
            (Some(record), _) => Ok(record),
            (None, Some((_, why))) => Err(StageError::Other(format!(
                "no group of the step was left to train: {why}"
            ))),
            (None, None) => Err(StageError::Other("a step of no groups".into())),
        }
    }
}

/// One update's outcome: the token sums over every rank, the gradient norm and whether
/// the update was applied (`None` when every group of it was rejected), and the groups
/// rejected on the way.
struct Update {
    sums: Option<(TokenSums, f64, bool)>,
    rejected: Vec<(usize, String)>,
}

/// One optimizer update on the groups `pick` (indices into `groups`) over every rank. An
/// update whose pass panics changes no weight: each group of the panicking share is run
/// alone, those that panic alone are rejected, and the update is taken on the rest; if that
/// panics too, the rest are rejected.
#[allow(clippy::too_many_arguments)]
fn update<B: TrainOn>(
    trainer: &mut TrainerOn<B>,
    c: &mut dyn Collective,
    groups: &[&ScoredGroup],
    mut kept: Vec<usize>,
    what: &str,
    first: bool,
    prox: Prox,
    proximal: Option<&Proximal>,
) -> Result<Update, StageError> {
    let mut rejected = Vec::new();
    let mut first_panic: Option<String> = None;
    loop {
        let subset: Vec<&ScoredGroup> = kept.iter().map(|&i| groups[i]).collect();
        let tokens: Vec<usize> = subset.iter().map(|g| loss::tokens(&[*g])).collect();
        let pass = Pass {
            norm: loss::norm(&subset, trainer.settings()),
            prox,
            first,
        };
        let mut shares = collective::shares(&tokens, c.world());
        let mine = std::mem::take(&mut shares[c.rank()]);
        let share: Vec<&ScoredGroup> = mine.iter().map(|&i| subset[i]).collect();
        let pass_of = |g: &[&ScoredGroup]| trainer.gradients_over(g, &pass, proximal);
        let (status, grads) = match contained(&share, pass_of) {
            Ok(Ok((g, sums))) => (Status::Done(sums), Some(g)),
            Ok(Err(e)) => (Status::Failed(e.to_string()), None),
            Err(panic) if first_panic.is_none() => {
                (alone(trainer, &subset, &mine, &kept, panic), None)
            }
            Err(panic) => (
                Status::Panicked {
                    alone: Vec::new(),
                    panic,
                },
                None,
            ),
        };
        let (total, mut bad, panics) = gather(c, what, &status)?;
        if panics.is_empty() {
            let grads = grads.unwrap_or_default();
            let name = format!("{what}'s gradients");
            let (norm, ok) = trainer.apply(grads, c, &name, total.loss())?;
            return Ok(Update {
                sums: Some((total, norm, ok)),
                rejected,
            });
        }
        let panic = panics.join("; ");
        if let Some(first) = &first_panic {
            let detail = format!(
                "a step over its batch panicked ({first}, then {panic}) and no group panicked alone"
            );
            rejected.extend(kept.iter().map(|&i| (i, detail.clone())));
            kept.clear();
        } else {
            bad.sort_unstable();
            let detail = format!("its training pass panicked alone: {panic}");
            rejected.extend(bad.iter().map(|&i| (i, detail.clone())));
            kept.retain(|i| bad.binary_search(i).is_err());
            first_panic = Some(panic);
        }
        if kept.is_empty() {
            return Ok(Update {
                sums: None,
                rejected,
            });
        }
    }
}

/// Decoupled PPO's proximal log-probs of every group of the step, on every rank: each rank
/// runs the policy before the step over its share of the groups and all ranks gather
/// them. A group whose pass panics is rejected (index into `groups`, with the reason).
fn proximal<B: TrainOn>(
    trainer: &TrainerOn<B>,
    c: &mut dyn Collective,
    groups: &[&ScoredGroup],
    number: u64,
) -> Result<(Proximal, Vec<(usize, String)>), StageError> {
    type Share = (
        Vec<(usize, Vec<Vec<f32>>)>,
        Vec<(usize, String)>,
        Option<String>,
    );
    let tokens: Vec<usize> = groups.iter().map(|g| loss::tokens(&[*g])).collect();
    let mut shares = collective::shares(&tokens, c.world());
    let mine = std::mem::take(&mut shares[c.rank()]);
    let mut share: Share = (Vec::new(), Vec::new(), None);
    for i in mine {
        match contained(&groups[i..=i], |g| trainer.proximal_logprobs(g[0])) {
            Ok(Ok(lps)) => share.0.push((i, lps)),
            Ok(Err(e)) => share.2 = Some(e.to_string()),
            Err(panic) => share
                .1
                .push((i, format!("its proximal log-prob pass panicked: {panic}"))),
        }
    }
    let bytes = rmp_serde::to_vec(&share).map_err(|e| StageError::Other(e.to_string()))?;
    let all = c.all_gather(&format!("step {number}'s proximal log-probs"), &bytes);
    let (mut map, mut bad, mut failures) = (Proximal::new(), Vec::new(), Vec::new());
    for (r, b) in all.iter().enumerate() {
        let (lps, panicked, failed): Share =
            rmp_serde::from_slice(b).map_err(|e| garbled(r, "proximal", e))?;
        for (i, lp) in lps {
            let g = groups
                .get(i)
                .ok_or_else(|| garbled(r, "proximal", format!("no group {i} in the step")))?;
            map.insert(g.rollout.group_id.clone(), lp);
        }
        bad.extend(panicked);
        failures.extend(failed.map(|e| format!("rank {r}: {e}")));
    }
    if !failures.is_empty() {
        return Err(StageError::Ranks(failures.join("; ")));
    }
    bad.sort_unstable();
    Ok((map, bad))
}

/// A rank's message that does not decode.
pub(super) fn garbled(rank: usize, what: &'static str, e: impl std::fmt::Display) -> StageError {
    StageError::Other(
        collective::CollectiveError::Garbled {
            rank,
            what,
            detail: e.to_string(),
        }
        .to_string(),
    )
}

/// `pass` on `groups` with a panic caught as its message; the fault hook fires for the
/// groups' group and prompt ids.
fn contained<T>(
    groups: &[&ScoredGroup],
    pass: impl FnOnce(&[&ScoredGroup]) -> T,
) -> Result<T, String> {
    fault::contain(|| {
        fault::inject(
            groups
                .iter()
                .flat_map(|g| [g.rollout.group_id.as_str(), g.rollout.prompt_id.as_str()]),
        );
        pass(groups)
    })
}

/// Every rank's outcome of update `what`: the token sums of the ranks that finished, the
/// groups that panicked alone and the panics; an error when any rank failed.
fn gather(
    c: &mut dyn Collective,
    what: &str,
    status: &Status,
) -> Result<(TokenSums, Vec<usize>, Vec<String>), StageError> {
    let bytes = rmp_serde::to_vec(status).map_err(|e| StageError::Other(e.to_string()))?;
    let all = c.all_gather(&format!("{what}'s outcomes"), &bytes);
    let name = |r: usize, m: String| {
        if all.len() == 1 {
            m
        } else {
            format!("rank {r}: {m}")
        }
    };
    let mut total = TokenSums::default();
    let (mut bad, mut panics, mut failures) = (Vec::new(), Vec::new(), Vec::new());
    for (r, b) in all.iter().enumerate() {
        let status: Status = rmp_serde::from_slice(b).map_err(|e| garbled(r, "step outcome", e))?;
        match status {
            Status::Done(sums) => total.add(&sums),
            Status::Panicked { alone, panic } => {
                bad.extend(alone);
                panics.push(name(r, panic));
            }
            Status::Failed(e) => failures.push(name(r, e)),
        }
    }
    if !failures.is_empty() {
        return Err(StageError::Ranks(failures.join("; ")));
    }
    Ok((total, bad, panics))
}

/// After this rank's share panicked: which of its groups (`mine`, indices into `subset`,
/// whose groups are the update's `kept`) panic alone.
fn alone<B: TrainOn>(
    trainer: &TrainerOn<B>,
    subset: &[&ScoredGroup],
    mine: &[usize],
    kept: &[usize],
    panic: String,
) -> Status {
    let mut alone = Vec::new();
    for &i in mine {
        match contained(&[subset[i]], |g| trainer.probe(g)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Status::Failed(e.to_string()),
            Err(_) => alone.push(kept[i]),
        }
    }
    Status::Panicked { alone, panic }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Five groups in mini-batches of two, over two epochs: six updates, the last
    /// mini-batch short; 0 is the whole step in one update.
    #[test]
    fn the_plan_by_hand() {
        let cfg = |size, epochs| TrainConfig {
            ppo_mini_batch_size: size,
            ppo_epochs: epochs,
            ..TrainConfig::default()
        };
        let one = vec![vec![0, 1, 2, 3, 4]];
        assert_eq!(plan(5, &cfg(0, 1)), one);
        assert_eq!(plan(5, &cfg(8, 1)), one);
        let batches = vec![vec![0, 1], vec![2, 3], vec![4]];
        let twice: Vec<Vec<usize>> = batches.iter().chain(&batches).cloned().collect();
        assert_eq!(plan(5, &cfg(2, 2)), twice);
    }
}

//! Data-parallel trainer ranks (`mpirun -n N rlstream train`), with one trainer's
//! guarantees.
//!
//! Rank 0 is the trainer stage as it runs alone: it alone reads the scored stream (so
//! intake, staleness, duplicate detection and dead letters are one trainer's), publishes
//! weights, writes checkpoints and acks, after each checkpoint, what that checkpoint holds.
//! The other ranks touch no stream: they hold a replica of the model and the optimizer and
//! do what rank 0 broadcasts ([`RankCommand`]):
//!
//! - **Step**: the step's groups (in group-id order, as one trainer takes them) go to
//!   every rank, and every rank takes the step's updates ([`super::steps`]): in each, it
//!   trains its share ([`crate::collective::shares`]: by tokens, deterministic), with each
//!   token's loss divided by the update's global token count; every rank reports its
//!   outcome and token sums (all-gather), the gradients are summed (bucketed all-reduce)
//!   and every rank applies the same clipped update. N ranks make one trainer's updates
//!   from the same groups.
//! - **Idle**: sent while rank 0 waits for groups, so that the others' wait has a deadline.
//! - **Verify**: after rank 0 wrote a checkpoint, every rank writes its optimizer shard
//!   into it (`train.shard`) and every rank's weights checksum is compared; rank 0 marks
//!   it the latest only then.
//! - **Stop**: the stage stopped (with its error, if any); every rank exits with it.
//!
//! A group whose pass panics on its rank is found as one trainer finds it (each group of
//! that rank's share alone), dead-lettered by rank 0, and the step taken again on the rest.
//! At start every rank compares the settings rank 0 broadcasts, its build, its checkpoint
//! and its model with rank 0's and refuses to start on a difference, naming it.

use super::checkpoint::{self, CheckpointError};
use super::steps::garbled;
use super::{Trainer, TrainerSettings};
use crate::collective::Collective;
use crate::schema::{self, ScoredGroup};
use crate::stages::StageError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Marks a rank's answer to the weights check that says its shard was not written.
const UNWRITTEN: &str = "unwritten: ";

/// What rank 0 tells the other ranks to do next.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RankCommand {
    Step {
        step: u64,
        version: u64,
        /// The step's groups as their stream messages, in the order they are trained.
        groups: Vec<serde_bytes::ByteBuf>,
    },
    Idle,
    Verify {
        step: u64,
    },
    Stop {
        error: Option<String>,
    },
}

/// What each rank says of itself at start.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    build: String,
    /// Settings that differ from rank 0's.
    differences: Vec<String>,
    /// Why this rank could not start its trainer.
    error: Option<String>,
    step: u64,
    version: u64,
    /// Checksum of the model's weights.
    model: String,
}

/// How long start-up calls wait: ten times a step's calls (loading a model, a warm start).
fn start_timeout(cfg: &TrainerSettings) -> Duration {
    Duration::from_secs_f64(cfg.train.collective_timeout_s * 10.0)
}

fn step_timeout(cfg: &TrainerSettings) -> Duration {
    Duration::from_secs_f64(cfg.train.collective_timeout_s)
}

fn build() -> String {
    format!("rlstream {}", env!("CARGO_PKG_VERSION"))
}

/// Rank 0's trainer: the settings broadcast, the trainer started, every rank agreeing.
pub(super) fn lead(cfg: &TrainerSettings, c: &mut dyn Collective) -> Result<Trainer, StageError> {
    if c.world() == 1 {
        return Ok(start(cfg, c)?);
    }
    c.set_timeout(start_timeout(cfg));
    let mut settings = toml::to_string(cfg)
        .map_err(|e| StageError::Other(format!("cannot write the settings: {e}")))?
        .into_bytes();
    c.broadcast("the trainer settings from rank 0", 0, &mut settings);
    let trainer = start(cfg, c);
    let hello = hello(
        Some(trainer.as_ref().map_err(ToString::to_string)),
        Vec::new(),
    );
    let agreed = agree(c, &hello);
    let trainer = trainer?;
    agreed?;
    c.set_timeout(step_timeout(cfg));
    tracing::info!(
        ranks = c.world(),
        "trainer ranks agree; rank 0 reads, publishes and checkpoints"
    );
    Ok(trainer)
}

/// This rank's trainer, its optimizer sharded over the ranks when `train.shard` says so.
fn start(cfg: &TrainerSettings, c: &dyn Collective) -> Result<Trainer, CheckpointError> {
    let mut trainer = Trainer::start(cfg)?;
    trainer.shard_over(c.rank(), c.world())?;
    Ok(trainer)
}

/// What this rank says of itself: its trainer, or why it could not start it; `None` when
/// it did not try (its settings differ).
fn hello(trainer: Option<Result<&Trainer, String>>, differences: Vec<String>) -> Hello {
    let mut h = Hello {
        build: build(),
        differences,
        error: None,
        step: 0,
        version: 0,
        model: String::new(),
    };
    match trainer {
        None => {}
        Some(Ok(t)) => {
            h.step = t.state.step;
            h.version = t.state.version;
            match t.weights_checksum() {
                Ok(sum) => h.model = sum,
                Err(e) => h.error = Some(e.to_string()),
            }
        }
        Some(Err(e)) => h.error = Some(e),
    }
    h
}

/// Every rank's [`Hello`] against rank 0's: `Ok` on every rank, or on every rank the
/// same error naming each difference.
fn agree(c: &mut dyn Collective, mine: &Hello) -> Result<(), StageError> {
    let bytes = rmp_serde::to_vec(mine).map_err(|e| StageError::Other(e.to_string()))?;
    let all = c.all_gather("the ranks' start-up check", &bytes);
    let mut hellos = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        hellos
            .push(rmp_serde::from_slice::<Hello>(b).map_err(|e| garbled(r, "start-up check", e))?);
    }
    let problems = problems(&hellos);
    if problems.is_empty() {
        return Ok(());
    }
    Err(StageError::Ranks(format!(
        "the {} trainer ranks refuse to start: {}",
        c.world(),
        problems.join("; ")
    )))
}

/// What keeps ranks that said `hellos` (in rank order) from training together.
fn problems(hellos: &[Hello]) -> Vec<String> {
    let Some(lead) = hellos.first() else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    for (r, h) in hellos.iter().enumerate() {
        if let Some(e) = &h.error {
            problems.push(format!("rank {r} cannot start its trainer: {e}"));
            continue;
        }
        for d in &h.differences {
            problems.push(format!("rank {r}'s settings differ: {d}"));
        }
        if r == 0 || lead.error.is_some() || !h.differences.is_empty() {
            continue;
        }
        if h.build != lead.build {
            problems.push(format!(
                "rank {r} runs {} and rank 0 {}",
                h.build, lead.build
            ));
        }
        if (h.step, h.version) != (lead.step, lead.version) {
            problems.push(format!(
                "rank {r} resumes at step {} (version {}) and rank 0 at step {} (version {}): \
                 every rank must see the same checkpoint directory",
                h.step, h.version, lead.step, lead.version
            ));
        } else if h.model != lead.model {
            problems.push(format!(
                "rank {r}'s model weights differ from rank 0's (checksum {} against {}): \
                 every rank must load the same model",
                h.model, lead.model
            ));
        }
    }
    problems
}

/// The settings that differ between `mine` and rank 0's, as `key: value here, value on
/// rank 0`.
fn differences(mine: &TrainerSettings, lead: &TrainerSettings) -> Vec<String> {
    fn flat(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flat(&key, v, out);
                }
            }
            v => out.push((prefix.to_string(), v.to_string())),
        }
    }
    let table = |s: &TrainerSettings| {
        let mut out = Vec::new();
        if let Ok(v) = toml::Value::try_from(s) {
            flat("", &v, &mut out);
        }
        out.into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (a, b) = (table(mine), table(lead));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        // Each rank has its own.
        .filter(|k| k.as_str() != "train.rank")
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "unset".into());
            format!(
                "{k} is {} here and {} on rank 0",
                show(a.get(k)),
                show(b.get(k))
            )
        })
        .collect()
}

/// Broadcasts rank 0's next command.
pub(super) fn send(c: &mut dyn Collective, cmd: &RankCommand) -> Result<(), StageError> {
    let mut bytes = rmp_serde::to_vec(cmd).map_err(|e| StageError::Other(e.to_string()))?;
    c.broadcast("rank 0's next command", 0, &mut bytes);
    Ok(())
}

fn receive(c: &mut dyn Collective) -> Result<RankCommand, StageError> {
    let mut bytes = Vec::new();
    c.broadcast("rank 0's next command", 0, &mut bytes);
    rmp_serde::from_slice(&bytes).map_err(|e| garbled(0, "command", e))
}

/// After a checkpoint: every rank wrote its optimizer shard (`unwritten` says why this
/// one did not), and every rank's weights are rank 0's.
pub(super) fn verify(
    trainer: &Trainer,
    c: &mut dyn Collective,
    unwritten: Option<CheckpointError>,
) -> Result<(), StageError> {
    let sum = match unwritten {
        Some(e) => format!("{UNWRITTEN}{e}"),
        None => trainer
            .weights_checksum()
            .unwrap_or_else(|e| format!("unreadable: {e}")),
    };
    let all = c.all_gather("the weights check after a checkpoint", sum.as_bytes());
    let failed: Vec<String> = all
        .iter()
        .enumerate()
        .filter_map(|(r, s)| {
            let s = String::from_utf8_lossy(s);
            let why = s.strip_prefix(UNWRITTEN)?;
            Some(format!(
                "rank {r} could not write its optimizer shard ({why})"
            ))
        })
        .collect();
    if !failed.is_empty() {
        return Err(StageError::Ranks(format!(
            "the checkpoint of step {} is incomplete and was not marked as the latest: {}; \
             restart every rank (they resume from the last complete checkpoint)",
            trainer.state.step,
            failed.join("; ")
        )));
    }
    let differ: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, s)| *s != &all[0])
        .map(|(r, s)| format!("rank {r} ({})", String::from_utf8_lossy(s)))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(StageError::Ranks(format!(
        "after step {} the weights of {} differ from rank 0's ({}): the ranks' updates \
         diverged; restart every rank (they resume from rank 0's checkpoint) and report it",
        trainer.state.step,
        differ.join(", "),
        String::from_utf8_lossy(&all[0])
    )))
}

/// A rank other than 0: takes rank 0's settings (comparing them with `own`, its own, when
/// it has any), starts its trainer and does what rank 0 says until it says stop.
pub fn follow(mut c: Box<dyn Collective>, own: Option<&TrainerSettings>) -> Result<(), StageError> {
    let rank = c.rank();
    let first = own.map_or(Duration::from_secs(3000), start_timeout);
    c.set_timeout(first);
    let mut bytes = Vec::new();
    c.broadcast("the trainer settings from rank 0", 0, &mut bytes);
    let text = String::from_utf8(bytes).map_err(|e| garbled(0, "settings", e))?;
    let cfg: TrainerSettings = toml::from_str(&text).map_err(|e| garbled(0, "settings", e))?;
    c.set_timeout(start_timeout(&cfg));
    let differences = own.map(|o| differences(o, &cfg)).unwrap_or_default();
    let trainer = differences
        .is_empty()
        .then(|| start(&cfg, c.as_ref()).map_err(|e| e.to_string()));
    let mine = hello(
        trainer.as_ref().map(|t| t.as_ref().map_err(Clone::clone)),
        differences,
    );
    agree(c.as_mut(), &mine)?;
    // `agree` refused a rank whose settings differ or whose trainer did not start.
    let mut trainer = trainer
        .ok_or_else(|| StageError::Other("its settings differ from rank 0's".into()))?
        .map_err(StageError::Other)?;
    c.set_timeout(step_timeout(&cfg));
    tracing::info!(rank, ranks = c.world(), "following rank 0");
    loop {
        match receive(c.as_mut())? {
            RankCommand::Step {
                step: number,
                version,
                groups,
            } => {
                let groups: Vec<ScoredGroup> = groups
                    .iter()
                    .map(|b| schema::decode(b))
                    .collect::<Result<_, _>>()
                    .map_err(|e| garbled(0, "scored group", e))?;
                let refs: Vec<&ScoredGroup> = groups.iter().collect();
                trainer.state.step = number;
                trainer.state.version = version;
                let o = super::steps::step(&mut trainer, c.as_mut(), &refs)?;
                tracing::debug!(rank, step = trainer.state.step, kept = o.kept.len(), "step");
            }
            RankCommand::Idle => {}
            RankCommand::Verify { step } => {
                trainer.state.step = step;
                let dir = checkpoint::dir_for(&cfg.train.checkpoint_dir, step);
                let written = trainer.write_shard(&dir);
                verify(&trainer, c.as_mut(), written.err())?;
            }
            RankCommand::Stop { error: None } => {
                tracing::info!(rank, step = trainer.state.step, "rank 0 stopped; stopping");
                return Ok(());
            }
            RankCommand::Stop { error: Some(e) } => {
                return Err(StageError::Other(format!(
                    "rank 0 stopped with an error: {e}"
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_each_key_with_both_values() {
        let lead = TrainerSettings::default();
        let mut mine = lead.clone();
        mine.train.lr = 2e-3;
        mine.policy.groups_per_step = 3;
        let d = differences(&mine, &lead);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(
            d.iter()
                .any(|s| s.starts_with("train.lr is 0.002 here and 0.0001 on rank 0")),
            "{d:?}"
        );
        assert!(
            d.iter()
                .any(|s| s.starts_with("policy.groups_per_step is 3 here")),
            "{d:?}"
        );
        assert!(differences(&lead, &lead).is_empty());
    }

    fn said(step: u64, model: &str) -> Hello {
        Hello {
            build: build(),
            differences: Vec::new(),
            error: None,
            step,
            version: step,
            model: model.into(),
        }
    }

    #[test]
    fn ranks_that_disagree_are_named_with_the_difference() {
        assert!(problems(&[said(4, "a"), said(4, "a"), said(4, "a")]).is_empty());
        let p = problems(&[said(4, "a"), said(2, "a"), said(4, "b")]);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].starts_with("rank 1 resumes at step 2 (version 2) and rank 0 at step 4"),
            "{p:?}"
        );
        assert!(
            p[1].starts_with("rank 2's model weights differ from rank 0's (checksum b against a)"),
            "{p:?}"
        );
        let other = Hello {
            build: "rlstream 0.0.9".into(),
            ..said(4, "a")
        };
        let failed = Hello {
            error: Some("no such model".into()),
            ..said(0, "")
        };
        let differs = Hello {
            differences: vec!["train.lr is 0.002 here and 0.001 on rank 0".into()],
            ..said(0, "")
        };
        let p = problems(&[said(4, "a"), other, failed, differs]);
        assert_eq!(
            p[0],
            format!("rank 1 runs rlstream 0.0.9 and rank 0 {}", build())
        );
        assert_eq!(p[1], "rank 2 cannot start its trainer: no such model");
        assert_eq!(
            p[2],
            "rank 3's settings differ: train.lr is 0.002 here and 0.001 on rank 0"
        );
    }
}

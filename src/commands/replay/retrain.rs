//! `replay --train`: re-run the trainer from a checkpoint over recorded scored entries, with
//! the trainer's own code and batching, and compare every step with the recorded run.

use super::source::{ReplayError, Source};
use crate::archive::ArchiveError;
use crate::bus::{EntryId, MemoryBus, RangeBound, SharedBus, Topology};
use crate::roles::{Stage, Stream};
use crate::schema::{self, Event, StepRecord};
use crate::stages::train::{self, TrainJob};
use crate::stages::{StageContext, StageError};
use crate::weights::{LocalWeights, Transport};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What `replay --train` re-runs.
pub struct RetrainOptions {
    /// One checkpoint directory (`step-*`, as the trainer writes under --checkpoint-dir).
    pub checkpoint: PathBuf,
    pub from: RangeBound,
    pub to: RangeBound,
    /// Stop after this many steps past the checkpoint (default: until the entries run out).
    pub steps: Option<u64>,
}

/// The header of the step table `replay --train` prints, over [`RetrainStep::row`]s.
pub fn retrain_header() -> String {
    format!(
        "{:>6} {:>12} {:>12} {:>8} {:>7}  recorded run",
        "step", "loss", "grad_norm", "reward", "groups"
    )
}

/// One re-run step beside the recorded one.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RetrainStep {
    pub step: u64,
    pub version: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub reward_mean: f64,
    pub groups: usize,
    /// The recorded (loss, grad_norm, reward_mean) of this step, if the source has it.
    pub recorded: Option<(f64, f64, f64)>,
    /// All three bit-identical to the recording.
    pub identical: Option<bool>,
}

impl RetrainStep {
    /// The step as a row under [`RETRAIN_HEADER`].
    pub fn row(&self) -> String {
        let rec = match (self.recorded, self.identical) {
            (Some(_), Some(true)) => "identical".to_string(),
            (Some((l, g, r)), _) => format!("DIFFERS: loss {l:.6} grad_norm {g:.6} reward {r:.4}"),
            (None, _) => "not recorded".to_string(),
        };
        format!(
            "{:>6} {:>12.6} {:>12.6} {:>8.4} {:>7}  {rec}",
            self.step, self.loss, self.grad_norm, self.reward_mean, self.groups
        )
    }
}

#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RetrainSummary {
    pub start_step: u64,
    pub steps: Vec<RetrainStep>,
    pub compared: u64,
    pub identical: u64,
    /// The first step that differs from the recording.
    pub first_divergence: Option<u64>,
    pub dropped: BTreeMap<String, u64>,
}

impl RetrainSummary {
    /// The one-line summary of a re-run.
    pub fn line(&self) -> String {
        let mut line = format!(
            "re-ran {} steps from checkpoint step {}; {} of {} recorded steps bit-identical",
            self.steps.len(),
            self.start_step,
            self.identical,
            self.compared
        );
        if let Some(d) = self.first_divergence {
            line += &format!("; first divergence at step {d}");
        }
        if !self.dropped.is_empty() {
            line += &format!("; dropped {:?}", self.dropped);
        }
        line
    }
}

/// The (loss, grad_norm, reward_mean) of each step the source's events recorded.
async fn recorded_steps(source: &Source) -> Result<BTreeMap<u64, (f64, f64, f64)>, ReplayError> {
    let mut recorded: BTreeMap<u64, (f64, f64, f64)> = BTreeMap::new();
    let events = source
        .each(
            Stream::Events.as_str(),
            RangeBound::Open,
            RangeBound::Open,
            |_, p| {
                if let Ok(e) = schema::decode::<Event>(p)
                    && e.kind == "step"
                    && e.stage == Stage::Train.as_str()
                    && let Ok(r) = StepRecord::from_fields(&e.fields)
                {
                    recorded.insert(r.step, (r.loss, r.grad_norm, r.reward_mean));
                }
                true
            },
        )
        .await;
    if let Err(ReplayError::Archive(ArchiveError::NoStream(_))) = events {
        tracing::warn!("the archive has no events stream: nothing to compare with");
    } else {
        events?;
    }

    Ok(recorded)
}

/// The scored entries of the range, on an embedded bus of their own (ids kept).
async fn scored_on_a_bus(
    source: &Source,
    opts: &RetrainOptions,
) -> Result<(SharedBus, Topology), ReplayError> {
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology {
        block_ms: 20,
        ..Topology::default()
    };
    let key = topo.key(Stream::Scored);
    let mut batch: Vec<(EntryId, bytes::Bytes)> = Vec::new();
    source
        .each(Stream::Scored.as_str(), opts.from, opts.to, |id, p| {
            batch.push((id, bytes::Bytes::copy_from_slice(p)));
            true
        })
        .await?;
    if batch.is_empty() {
        return Err(ReplayError::Usage(
            "no scored entries in the range: nothing to train on".into(),
        ));
    }
    bus.append(&key, &batch).await?;

    Ok((bus, topo))
}

/// Completes once the trainer has been handed every entry: the steps those make possible
/// are taken before it looks at the stop signal again.
async fn all_handed_over(bus: SharedBus, topo: Topology) {
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let s = bus.stats(&topo.key(Stream::Scored)).await;
        if let Ok(s) = s
            && s.groups
                .iter()
                .any(|g| g.name == topo.group(Stream::Scored) && g.lag == Some(0))
        {
            return;
        }
    }
}

/// Re-runs training from `opts.checkpoint` over the scored entries of `source` between the
/// bounds, with the trainer's own code and batching (the same drop rules, the same
/// `groups_per_step`, the config the checkpoint was written with), and compares each step
/// with the step events recorded in the source.
pub async fn retrain(
    source: &Source,
    opts: &RetrainOptions,
    mut on_step: impl FnMut(&RetrainStep),
) -> Result<RetrainSummary, ReplayError> {
    // The replaying trainer keeps its own checkpoints in a directory removed afterwards.
    let scratch = tempfile::Builder::new()
        .prefix("rlstream-replay-")
        .tempdir()
        .map_err(|e| ReplayError::Usage(format!("cannot create a scratch directory: {e}")))?;
    let (mut cfg, state) =
        train::checkpoint::stage(&opts.checkpoint, scratch.path()).map_err(StageError::from)?;
    let start_step = state.step;
    cfg.train.steps = opts.steps.map_or(0, |n| start_step + n);
    // Checkpoints of the re-run are not needed; the final one still lands in the scratch dir.
    cfg.train.checkpoint_every = u64::MAX;
    cfg.train.name = "replay".into();

    let recorded = recorded_steps(source).await?;
    let (bus, topo) = scored_on_a_bus(source, opts).await?;
    let done = all_handed_over(bus.clone(), topo.clone());
    let mut summary = RetrainSummary {
        start_step,
        ..RetrainSummary::default()
    };
    let job = TrainJob::new(&cfg)
        .transport(Transport::InProcess(LocalWeights::default()))
        .on_step(|s: &StepRecord| {
            let rec = recorded.get(&s.step).copied();
            let identical = rec.map(|(l, g, r)| {
                l.to_bits() == s.loss.to_bits()
                    && g.to_bits() == s.grad_norm.to_bits()
                    && r.to_bits() == s.reward_mean.to_bits()
            });
            let step = RetrainStep {
                step: s.step,
                version: s.version,
                loss: s.loss,
                grad_norm: s.grad_norm,
                reward_mean: s.reward_mean,
                groups: s.groups as usize,
                recorded: rec,
                identical,
            };
            on_step(&step);
            summary.steps.push(step);
        });
    let ctx = StageContext::new((Stage::Train, "replay"), bus, &topo, done);
    let outcome = train::run(job, ctx).await?;
    summary.dropped = outcome.dropped;
    for s in &summary.steps {
        if let Some(same) = s.identical {
            summary.compared += 1;
            if same {
                summary.identical += 1;
            } else if summary.first_divergence.is_none() {
                summary.first_divergence = Some(s.step);
            }
        }
    }
    Ok(summary)
}

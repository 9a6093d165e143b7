//! Batches in flight. The score stage keeps polling while earlier batches are scored, up to
//! what the scorer scores at once ([`Scorer::capacity`]): a slow external scorer (a
//! sandbox) then has groups that arrived during a batch's scoring started at once, not
//! after the whole batch. Each batch publishes its scored groups and acks their rollouts
//! itself as soon as it is done; what failed goes back to the stage, whose consumer retries
//! or dead-letters it.

use super::{ScoreConfig, ScoreError, ScoreSummary, Scorer, finish};
use crate::bus::{Delivery, EntryId, SharedBus};
use crate::schema::RolloutGroup;
use crate::stages::StageError;
use std::sync::Arc;
use std::time::Instant;

/// Where a batch publishes its scored groups.
#[derive(Clone)]
pub(super) struct Outlet {
    pub bus: SharedBus,
    /// The scored stream's key, and its length bound.
    pub stream: String,
    pub max_len: Option<u64>,
    /// The rollouts stream and the `score` group, where rollouts are acked.
    pub rollouts: String,
    pub group: String,
}

/// What became of one batch.
pub(super) struct Settled {
    /// Groups in the batch.
    pub groups: usize,
    /// Rollouts whose scored groups were published and acked.
    pub acked: Vec<EntryId>,
    /// Groups that could not be scored, with why.
    pub failed: Vec<(Delivery<RolloutGroup>, ScoreError)>,
    /// The batch's scored groups, rewards and samples (its failures are counted by the
    /// stage, which settles them).
    pub summary: ScoreSummary,
}

/// Scores `batch`, publishes what was scored and acks its rollouts.
pub(super) async fn score_batch(
    scorer: Arc<Scorer>,
    cfg: Arc<ScoreConfig>,
    out: Outlet,
    batch: Vec<Delivery<RolloutGroup>>,
) -> Result<Settled, StageError> {
    let began = Instant::now();
    let groups: Vec<&RolloutGroup> = batch.iter().map(|d| &d.message).collect();
    let rewards = scorer.rewards(&groups).await;
    let seconds = began.elapsed().as_secs_f64() / batch.len().max(1) as f64;
    let mut summary = ScoreSummary::default();
    let (mut payloads, mut acked, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    let n = batch.len();
    for (d, r) in batch.into_iter().zip(rewards) {
        match r.and_then(|r| finish(&cfg, &d, r, seconds, &mut summary)) {
            Ok(scored) => {
                payloads.push(scored);
                acked.push(d.id);
            }
            Err(e) => failed.push((d, e)),
        }
    }
    if !payloads.is_empty() {
        out.bus.publish(&out.stream, &payloads, out.max_len).await?;
        out.bus.ack(&out.rollouts, &out.group, &acked).await?;
        summary.scored += acked.len() as u64;
    }
    Ok(Settled {
        groups: n,
        acked,
        failed,
        summary,
    })
}

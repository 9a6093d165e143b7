//! `rlstream score`: reads rollout groups through the `score` group, rewards each completion
//! with the task's verifier (or an external program), computes group advantages, and
//! publishes scored groups. A rollout is acked only after its scored group is published.
//!
//! Beside the outcome reward a group may carry rewards placed on tokens (`token_rewards`):
//! an external scorer's per-token or per-step rewards ([`steps`]), and a teacher's per-token
//! signal ([`teacher`]); where both are present they add up. The trainer turns them into
//! per-token advantages (`stages::train::credit`).

mod advantages;
mod batches;
mod config;
mod error;
mod external;
mod scorer;
mod scores;
pub mod shaping;
pub mod steps;
pub mod teacher;
pub use advantages::advantages;
pub use batches::ScoreSummary;
pub use config::*;
pub use error::{DETOKENIZE, NO_ANSWER, ScoreError};
pub use external::ScorerError;
pub use scorer::Scorer;
pub use scores::{Scores, episode_scores};

use super::{StageContext, StageError};
use crate::roles::{Stage, Stream};
use crate::schema::RolloutGroup;
use std::sync::Arc;

/// Scores rollouts until shutdown (see the [stage docs](crate::stages)): polls while the
/// batches being scored hold fewer groups than the scorer scores at once (see
/// [`batches`]), and finishes the batches started before stopping.
pub async fn run(cfg: &ScoreConfig, mut ctx: StageContext<'_>) -> Result<ScoreSummary, StageError> {
    let scorer = Arc::new(Scorer::new(cfg)?);
    let capacity = scorer.capacity();
    let cfg = Arc::new(cfg.clone());
    let mut consumer = ctx
        .consumer::<RolloutGroup>(Stream::Rollouts, ctx.topo.consumer_options())
        .await?;
    let outlet = batches::Outlet {
        bus: ctx.bus.clone(),
        stream: ctx.topo.key(Stream::Scored),
        max_len: ctx.topo.max_len(Stream::Scored),
        rollouts: ctx.topo.key(Stream::Rollouts),
        group: ctx.topo.group(Stream::Rollouts).to_string(),
        events: ctx.topo.key(Stream::Events),
        events_max_len: ctx.topo.max_len(Stream::Events),
    };
    let mut flight = InFlight::default();
    let retention = ctx.start(&[Stream::Rollouts.as_str()]);
    let mut heartbeat = ctx.heartbeat();
    loop {
        let s = &flight.summary;
        let fields = [
            ("groups", s.scored as f64),
            ("samples", s.samples as f64),
            ("failed", s.failed as f64),
        ];
        heartbeat.beat(0, &fields).await;
        while let Some(done) = flight.tasks.try_join_next() {
            flight.settle(done, &mut consumer).await?;
        }
        if flight.groups >= capacity {
            tokio::select! {
                biased;
                _ = ctx.shutdown() => break,
                Some(done) = flight.tasks.join_next() => flight.settle(done, &mut consumer).await?,
            }
            continue;
        }
        let batch = tokio::select! {
            biased;
            _ = ctx.shutdown() => break,
            b = consumer.poll() => b?,
        };
        if batch.is_empty() {
            continue;
        }
        flight.groups += batch.len();
        let task = batches::score_batch(scorer.clone(), cfg.clone(), outlet.clone(), batch);
        flight.tasks.spawn(task);
    }
    while let Some(done) = flight.tasks.join_next().await {
        flight.settle(done, &mut consumer).await?;
    }
    let summary = flight.summary;
    tracing::info!(
        scored = summary.scored,
        failed = summary.failed,
        "score stopped"
    );
    if let Some(r) = retention {
        r.finish().await;
    }
    Ok(summary)
}

/// The batches being scored, and what the finished ones added up to.
#[derive(Default)]
struct InFlight {
    tasks: tokio::task::JoinSet<Result<batches::BatchDone, StageError>>,
    /// Groups in the batches being scored.
    groups: usize,
    summary: ScoreSummary,
}

impl InFlight {
    /// Takes in a finished batch: releases its acked rollouts from the consumer, retries or
    /// dead-letters its failures, and counts it.
    async fn settle(
        &mut self,
        done: Result<Result<batches::BatchDone, StageError>, tokio::task::JoinError>,
        consumer: &mut crate::bus::Consumer<RolloutGroup>,
    ) -> Result<(), StageError> {
        let settled =
            done.map_err(|e| StageError::Other(format!("a scoring task failed: {e}")))??;
        self.groups = self.groups.saturating_sub(settled.groups);
        consumer.release(&settled.acked);
        self.summary.add(&settled.summary);
        for (d, e) in settled.failed {
            self.summary.failed += 1;
            if let Some(reason) = e.dead_letter_reason() {
                consumer.reject(&d, reason, &e.to_string()).await?;
            } else {
                crate::metrics::error(Stage::Score, "scorer");
                consumer.fail(&d, &e.to_string()).await?;
            }
        }
        Ok(())
    }
}

//! Batches in flight. The score stage keeps polling while earlier batches are scored, up to
//! what the scorer scores at once ([`Scorer::capacity`]): a slow external scorer (a
//! sandbox) then has groups that arrived during a batch's scoring started at once, not
//! after the whole batch. Each batch publishes its scored groups and acks their rollouts
//! itself as soon as it is done; what failed goes back to the stage, whose consumer retries
//! or dead-letters it.

use super::{ScoreConfig, ScoreError, Scorer, Scores, advantages};
use crate::bus::{Delivery, EntryId, SharedBus};
use crate::schema::{self, RolloutGroup, ScoredGroup};
use crate::stages::StageError;
use bytes::Bytes;
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
    /// The events stream, where each batch's outcomes go, and its length bound.
    pub events: String,
    pub events_max_len: Option<u64>,
}

/// What became of one batch.
pub(super) struct BatchDone {
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
) -> Result<BatchDone, StageError> {
    let began = Instant::now();
    let groups: Vec<&RolloutGroup> = batch.iter().map(|d| &d.message).collect();
    let rewards = scorer.rewards(&groups).await;
    let seconds = began.elapsed().as_secs_f64() / batch.len().max(1) as f64;
    let mut summary = ScoreSummary::default();
    let (mut payloads, mut acked, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    let mut outcomes = Vec::new();
    let n = batch.len();
    for (d, r) in batch.into_iter().zip(rewards) {
        let outcome = r.as_ref().ok().map(|r| outcome(&d.message, &r.rewards));
        match r.and_then(|r| finish(&cfg, &d, r, seconds, &mut summary)) {
            Ok(scored) => {
                payloads.push(scored);
                acked.push(d.id);
                outcomes.extend(outcome);
            }
            Err(e) => failed.push((d, e)),
        }
    }
    if !payloads.is_empty() {
        out.bus.publish(&out.stream, &payloads, out.max_len).await?;
        out.bus.ack(&out.rollouts, &out.group, &acked).await?;
        summary.scored += acked.len() as u64;
        let event =
            schema::Event::outcomes(crate::roles::Stage::Score.as_str(), &cfg.name, outcomes);
        let event = Bytes::from(schema::encode(&event)?);
        out.bus
            .publish(&out.events, &[event], out.events_max_len)
            .await?;
    }
    Ok(BatchDone {
        groups: n,
        acked,
        failed,
        summary,
    })
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScoreSummary {
    pub scored: u64,
    pub failed: u64,
    pub reward_sum: f64,
    pub samples: u64,
    /// Completions the overlong penalty and the length penalty lowered.
    pub overlong: u64,
    pub length_penalized: u64,
}

impl ScoreSummary {
    pub(super) fn add(&mut self, other: &ScoreSummary) {
        self.scored += other.scored;
        self.failed += other.failed;
        self.reward_sum += other.reward_sum;
        self.samples += other.samples;
        self.overlong += other.overlong;
        self.length_penalized += other.length_penalized;
    }
}

/// How `g`'s prompt fared: its completions whose verifier reward (before shaping) was
/// full marks.
fn outcome(g: &RolloutGroup, rewards: &[f32]) -> schema::PromptOutcome {
    schema::PromptOutcome {
        prompt_id: g.prompt_id.clone(),
        passed: rewards
            .iter()
            .filter(|&&r| schema::PromptOutcome::passes(r))
            .count() as u32,
        samples: rewards.len() as u32,
    }
}

/// The scored message of a group with `rewards`, encoded; counted in `summary` and the
/// metrics (`seconds`: its share of the batch's scoring time).
fn finish(
    cfg: &ScoreConfig,
    d: &Delivery<RolloutGroup>,
    scores: Scores,
    seconds: f64,
    summary: &mut ScoreSummary,
) -> Result<Bytes, ScoreError> {
    let Scores {
        mut rewards,
        token_rewards,
        teacher,
        from_env,
    } = scores;
    let shaped = super::shaping::shape(cfg, &d.message, &mut rewards);
    summary.overlong += shaped.overlong;
    summary.length_penalized += shaped.length;
    crate::metrics::shaped(shaped.overlong, shaped.length);
    let mut adv = advantages(&rewards, cfg.advantage);
    let coef = if from_env { 0.0 } else { cfg.outcome_coef };
    adv.iter_mut().for_each(|a| *a *= coef);
    summary.reward_sum += rewards.iter().map(|&r| f64::from(r)).sum::<f64>();
    summary.samples += rewards.len() as u64;
    crate::metrics::scored(
        rewards.len() as u64,
        d.message.completion_tokens() as u64,
        seconds,
    );
    let scored = ScoredGroup {
        schema: ScoredGroup::version_for(&d.message, &token_rewards),
        rollout: d.message.clone(),
        rewards,
        advantages: adv,
        token_rewards,
        ref_logprobs: teacher,
        scorer_id: cfg.name.clone(),
        scored_us: schema::now_us(),
    };
    Ok(Bytes::from(schema::encode(&scored)?))
}

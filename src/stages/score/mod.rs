//! `rlstream score`: reads rollout groups through the `score` group, rewards each completion
//! with the task's verifier (or an external program), computes group advantages, and
//! publishes scored groups. A rollout is acked only after its scored group is published.
//!
//! Beside the outcome reward a group may carry rewards placed on tokens (`token_rewards`):
//! an external scorer's per-token or per-step rewards ([`steps`]), and a teacher's per-token
//! signal ([`teacher`]); where both are present they add up. The trainer turns them into
//! per-token advantages (`stages::train::credit`).

mod batches;
mod config;
mod error;
mod external;
mod scores;
pub mod steps;
pub mod teacher;
pub use config::*;
pub use error::{DETOKENIZE, NO_ANSWER, ScoreError};
pub use external::ScorerError;
pub use scores::{Scores, episode_scores};

use super::{StageContext, StageError};
use crate::bus::Delivery;
use crate::model::tokenizer::Tokenizer;
use crate::roles::{Stage, Stream};
use crate::schema::{self, RolloutGroup, ScoredGroup};
use crate::tasks;
use bytes::Bytes;
use external::{ExternalRequest, Pool};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Tokens of a completion that make its text: all but a final stop token.
fn text_len(tokens: &[u32], stop: &[u32]) -> usize {
    match tokens.last() {
        Some(t) if stop.contains(t) => tokens.len() - 1,
        _ => tokens.len(),
    }
}

/// Added to the standard deviation so uniform groups get zero advantage, not NaN.
const STD_EPS: f32 = 1e-6;

pub fn advantages(rewards: &[f32], kind: AdvantageKind) -> Vec<f32> {
    let n = rewards.len() as f32;
    if rewards.is_empty() {
        return Vec::new();
    }
    let mean = rewards.iter().sum::<f32>() / n;
    match kind {
        AdvantageKind::Grpo => {
            let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / n;
            rewards
                .iter()
                .map(|r| (r - mean) / (var.sqrt() + STD_EPS))
                .collect()
        }
        AdvantageKind::Loo => {
            if rewards.len() == 1 {
                return vec![0.0];
            }
            let sum: f32 = rewards.iter().sum();
            rewards.iter().map(|r| r - (sum - r) / (n - 1.0)).collect()
        }
        AdvantageKind::Nostd => rewards.iter().map(|r| r - mean).collect(),
    }
}

/// The built-in verifier's rewards of a group's completion texts.
fn builtin_scores(g: &RolloutGroup, texts: &[String]) -> Result<Scores, ScoreError> {
    let rewards = texts
        .iter()
        .map(|t| tasks::score(t, &g.meta).ok_or_else(|| ScoreError::NoAnswer(g.group_id.clone())))
        .collect::<Result<Vec<f32>, ScoreError>>()?;
    Ok(Scores {
        rewards,
        token_rewards: None,
        teacher: None,
        from_env: false,
    })
}

/// Rewards groups: built-in verifiers, or a pool of external programs each scoring up to
/// `scorer_in_flight` groups at a time.
pub struct Scorer {
    tokenizer: Tokenizer,
    /// None for the built-in verifiers.
    pool: Option<Pool>,
    /// Requests sent to the pool so far (each one's `request_id`).
    requests: AtomicU64,
    step_separator: Option<String>,
    teacher: Option<teacher::Teacher>,
    distill: DistillKind,
    distill_coef: f32,
}

impl Scorer {
    pub fn new(cfg: &ScoreConfig) -> Result<Self, StageError> {
        let tokenizer = match &cfg.tokenizer {
            Some(dir) => Tokenizer::load(dir)?,
            None => Tokenizer::Char(tasks::char_tokenizer()),
        };
        let timeout = Duration::from_secs_f64(cfg.scorer_timeout_s);
        let pool = match &cfg.scorer_cmd {
            Some(cmd) => Some(Pool::start(
                cmd,
                cfg.scorers,
                cfg.scorer_in_flight,
                timeout,
            )?),
            None => None,
        };
        if cfg.distill != DistillKind::None && cfg.teacher.is_none() {
            return Err(crate::settings::invalid(
                "score.distill",
                "distilling needs a teacher: give --teacher DIR",
            )
            .into());
        }
        if cfg.step_separator.is_some() && pool.is_none() {
            return Err(crate::settings::invalid(
                "score.step_separator",
                "steps are scored by an external scorer: give --scorer-cmd",
            )
            .into());
        }
        let teacher = match &cfg.teacher {
            Some(dir) => Some(
                teacher::Teacher::load(dir, &tokenizer)
                    .map_err(|e| StageError::Other(e.to_string()))?,
            ),
            None => None,
        };
        Ok(Scorer {
            tokenizer,
            pool,
            requests: AtomicU64::new(0),
            step_separator: cfg.step_separator.clone(),
            teacher,
            distill: cfg.distill,
            distill_coef: cfg.distill_coef,
        })
    }

    /// Groups scored at once: the external pool's places; one batch at a time for the
    /// built-in verifiers and a teacher (which score as fast as the stage polls, or take
    /// the cores).
    pub fn capacity(&self) -> usize {
        match &self.pool {
            Some(pool) if self.teacher.is_none() => pool.places(),
            _ => 1,
        }
    }

    /// Completion text without its stop token.
    fn text(&self, tokens: &[u32], stop: &[u32], what: String) -> Result<String, ScoreError> {
        self.tokenizer
            .decode(&tokens[..text_len(tokens, stop)])
            .map_err(|source| ScoreError::Detokenize { what, source })
    }

    /// Each completion's steps (texts, and the last token of each) with a separator.
    fn steps(&self, g: &RolloutGroup) -> Result<Option<Vec<steps::Steps>>, ScoreError> {
        let Some(sep) = &self.step_separator else {
            return Ok(None);
        };
        g.samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = text_len(&s.tokens, &g.sampling.stop_tokens);
                steps::split(&self.tokenizer, &s.tokens, n, sep).map_err(|source| {
                    ScoreError::Detokenize {
                        what: format!("completion {i}"),
                        source,
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// The completions' texts, and the prompt's when an external scorer needs it.
    fn texts(&self, g: &RolloutGroup) -> Result<(Vec<String>, String), ScoreError> {
        let texts = g
            .samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                self.text(
                    &s.tokens,
                    &g.sampling.stop_tokens,
                    format!("completion {i}"),
                )
            })
            .collect::<Result<Vec<String>, ScoreError>>()?;
        if self.pool.is_none() {
            return Ok((texts, String::new()));
        }
        let prompt =
            self.tokenizer
                .decode(&g.prompt_tokens)
                .map_err(|source| ScoreError::Detokenize {
                    what: "the prompt".into(),
                    source,
                })?;
        Ok((texts, prompt))
    }

    /// Rewards of each group, in order. A batch's groups are scored as places in the
    /// external scorers' pool free up (`scorers` × `scorer_in_flight` at once).
    pub async fn rewards(&self, groups: &[&RolloutGroup]) -> Vec<Result<Scores, ScoreError>> {
        let prepared: Vec<Result<(Vec<String>, String), ScoreError>> =
            groups.iter().map(|g| self.texts(g)).collect();
        let mut out: Vec<Option<Result<Scores, ScoreError>>> = Vec::with_capacity(groups.len());
        let mut waiting = Vec::new();
        for (i, (g, p)) in groups.iter().zip(prepared).enumerate() {
            // Episodes are scored by their environment, turn by turn, in the generator.
            if crate::env::is_episode(&g.meta) {
                out.push(Some(Ok(episode_scores(g))));
                continue;
            }
            let steps = match self.steps(g) {
                Ok(s) => s,
                Err(e) => {
                    out.push(Some(Err(e)));
                    continue;
                }
            };
            match p {
                Err(e) => out.push(Some(Err(e))),
                Ok((texts, _)) if self.pool.is_none() => out.push(Some(builtin_scores(g, &texts))),
                Ok((completions, prompt)) => {
                    out.push(None);
                    let id = (self.requests.fetch_add(1, Ordering::Relaxed) + 1).to_string();
                    let (req, ends) = ExternalRequest::new(id, g, prompt, completions, steps);
                    waiting.push((i, req, ends));
                }
            }
        }
        if let Some(pool) = &self.pool {
            let calls = waiting
                .iter()
                .map(|(i, req, ends)| async move { (*i, pool.score(req, ends.as_deref()).await) });
            for (i, r) in futures_util::future::join_all(calls).await {
                out[i] = Some(r.map_err(ScoreError::from));
            }
        }
        let mut out: Vec<Result<Scores, ScoreError>> = out
            .into_iter()
            .map(|r| r.unwrap_or(Err(ScoreError::External(ScorerError::Unscored))))
            .collect();
        if let Some(teacher) = &self.teacher {
            self.add_teacher(teacher, groups, &mut out).await;
        }
        out
    }

    /// The teacher's log-probs of the groups scored so far, kept as each group's
    /// `ref_logprobs` (returned beside the scores) and, when distilling, added to its token
    /// rewards.
    async fn add_teacher(
        &self,
        teacher: &teacher::Teacher,
        groups: &[&RolloutGroup],
        out: &mut [Result<Scores, ScoreError>],
    ) {
        let todo: Vec<usize> = (0..groups.len()).filter(|&i| out[i].is_ok()).collect();
        let picked: Vec<&RolloutGroup> = todo.iter().map(|&i| groups[i]).collect();
        let logprobs = teacher.logprobs(&picked).await;
        for (i, lp) in todo.into_iter().zip(logprobs) {
            let (Ok(scores), g) = (&mut out[i], groups[i]) else {
                continue;
            };
            let lp = match lp {
                Ok(lp) => lp,
                Err(e) => {
                    out[i] = Err(e);
                    continue;
                }
            };
            if self.distill == DistillKind::ReverseKl {
                let kl = teacher::reverse_kl_rewards(g, &lp, self.distill_coef);
                scores.token_rewards = Some(match scores.token_rewards.take() {
                    None => kl,
                    Some(given) => steps::add(&given, &kl),
                });
            }
            scores.teacher = Some(lp);
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScoreSummary {
    pub scored: u64,
    pub failed: u64,
    pub reward_sum: f64,
    pub samples: u64,
}

impl ScoreSummary {
    fn add(&mut self, other: &ScoreSummary) {
        self.scored += other.scored;
        self.failed += other.failed;
        self.reward_sum += other.reward_sum;
        self.samples += other.samples;
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
        rewards,
        token_rewards,
        teacher,
        from_env,
    } = scores;
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
    tasks: tokio::task::JoinSet<Result<batches::Settled, StageError>>,
    /// Groups in the batches being scored.
    groups: usize,
    summary: ScoreSummary,
}

impl InFlight {
    /// Takes in a finished batch: releases its acked rollouts from the consumer, retries or
    /// dead-letters its failures, and counts it.
    async fn settle(
        &mut self,
        done: Result<Result<batches::Settled, StageError>, tokio::task::JoinError>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantage_variants() {
        let r = [1.0, 0.0, 0.0, 1.0];
        let g = advantages(&r, AdvantageKind::Grpo);
        assert!(
            (g[0] - 1.0).abs() < 1e-4 && (g[1] + 1.0).abs() < 1e-4,
            "{g:?}"
        );
        assert_eq!(
            advantages(&r, AdvantageKind::Nostd),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        let l = advantages(&r, AdvantageKind::Loo);
        assert!((l[0] - (1.0 - 1.0 / 3.0)).abs() < 1e-6, "{l:?}");
        assert_eq!(advantages(&[0.3, 0.3], AdvantageKind::Grpo), vec![0.0, 0.0]);
    }
}

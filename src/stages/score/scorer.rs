//! The scorer: rewards of a batch of groups from the built-in verifiers, or from the
//! external scorers' pool, plus a teacher's log-probs where one is loaded.

use super::external::{ExternalRequest, Pool};
use super::{
    DistillKind, ScoreConfig, ScoreError, ScorerError, Scores, episode_scores, steps, teacher,
};
use crate::model::tokenizer::Tokenizer;
use crate::schema::RolloutGroup;
use crate::stages::StageError;
use crate::tasks;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Tokens of a completion that make its text: all but a final stop token.
fn text_len(tokens: &[u32], stop: &[u32]) -> usize {
    match tokens.last() {
        Some(t) if stop.contains(t) => tokens.len() - 1,
        _ => tokens.len(),
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

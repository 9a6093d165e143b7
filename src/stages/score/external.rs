//! External scorers (`--scorer-cmd`): a program that reads one JSON line per group on its
//! stdin and answers one JSON line of rewards on its stdout (docs/stages.md, "Scoring").
//! Each process of the [`Pool`] is a [`JsonLinesChild`] holding up to `scorer_in_flight`
//! groups at once: one, matched in order, or several, matched by the `request_id` each
//! answer echoes (a sandbox service answers in any order). The answer is checked (a reward
//! per completion, finite, token or step rewards that land on real tokens) before anything
//! is published.

use super::{Scores, steps};
use crate::child::{ChildError, ChildSpec, JsonLinesChild, Matching};
use crate::schema::RolloutGroup;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

/// The field that names a request, and that each answer echoes when a process holds
/// several groups at once.
pub const REQUEST_ID: &str = "request_id";

/// One request to an external scorer (a JSON line on its stdin).
#[derive(Debug, Serialize)]
pub(super) struct ExternalRequest<'a> {
    /// Unique per request of this stage; echoed in the answer when a process holds several
    /// groups at once.
    request_id: String,
    group_id: &'a str,
    task: &'a str,
    prompt: String,
    completions: Vec<String>,
    /// Each completion's token ids (the stop token included): what `token_rewards`
    /// indices count.
    tokens: Vec<&'a [u32]>,
    /// Each completion split into steps (with `--step-separator`).
    #[serde(skip_serializing_if = "Option::is_none")]
    steps: Option<Vec<Vec<String>>>,
    meta: &'a std::collections::BTreeMap<String, String>,
}

impl<'a> ExternalRequest<'a> {
    /// The request `request_id` for `g`, with its prompt and completions as text and, with
    /// a step separator, each completion's steps; and the last token of each step.
    pub(super) fn new(
        request_id: String,
        g: &'a RolloutGroup,
        prompt: String,
        completions: Vec<String>,
        steps: Option<Vec<steps::Steps>>,
    ) -> (Self, Option<Vec<Vec<usize>>>) {
        let (step_texts, ends) = match steps {
            Some(st) => {
                let (t, e): (Vec<Vec<String>>, Vec<Vec<usize>>) =
                    st.into_iter().map(|s| (s.texts, s.last_tokens)).unzip();
                (Some(t), Some(e))
            }
            None => (None, None),
        };
        let req = ExternalRequest {
            request_id,
            group_id: &g.group_id,
            task: &g.task,
            prompt,
            completions,
            tokens: g.samples.iter().map(|s| s.tokens.as_slice()).collect(),
            steps: step_texts,
            meta: &g.meta,
        };
        (req, ends)
    }
}

/// Its answer (a JSON line on its stdout).
#[derive(Debug, Deserialize)]
struct ExternalResponse {
    #[serde(default)]
    rewards: Option<Vec<f32>>,
    /// Per completion, `[token index, reward]` pairs.
    #[serde(default)]
    token_rewards: Option<Vec<Vec<(usize, f32)>>>,
    /// Per completion, one reward per step.
    #[serde(default)]
    step_rewards: Option<Vec<Vec<f32>>>,
    #[serde(default)]
    error: Option<String>,
}

/// What went wrong with an external scorer. Each is worth a retry: the group goes back to
/// pending and is dead-lettered once it has used its deliveries.
#[derive(Debug, thiserror::Error)]
pub enum ScorerError {
    /// The process could not be started, exited, hung or broke the protocol.
    #[error(transparent)]
    Process(#[from] ChildError),
    #[error("the scorer's answer does not have the fields of one ({error}): {answer}")]
    BadAnswer { error: String, answer: String },
    #[error("the scorer's request could not be written: {0}")]
    Request(String),
    #[error("scorer error: {0}")]
    Reported(String),
    #[error("scorer answer has no `rewards`")]
    NoRewards,
    #[error("scorer returned {got} rewards for {want} completions")]
    Count { got: usize, want: usize },
    #[error("scorer returned a non-finite reward {0}")]
    NonFinite(f32),
    #[error("scorer answer: {0}")]
    BadTokenRewards(String),
    #[error("scorer answer: {0}")]
    BadPlacement(#[from] steps::BadRewards),
    /// No process of the pool took the group (cannot happen while the pool is not empty).
    #[error("no scorer process took the group")]
    Unscored,
}

impl From<ScorerError> for crate::stages::StageError {
    fn from(e: ScorerError) -> Self {
        crate::stages::StageError::Own(Box::new(e))
    }
}

/// The external scorer processes, each holding up to `in_flight` groups at once. A group
/// waits for a free place anywhere in the pool and goes to the process holding the fewest.
pub(super) struct Pool {
    procs: Vec<ScorerProcess>,
    /// Groups each process may hold.
    in_flight: usize,
    /// Groups each process holds now.
    held: Mutex<Vec<usize>>,
    /// Free places in the whole pool.
    places: Semaphore,
}

impl Pool {
    /// Starts `processes` scorers running `cmd`, each holding up to `in_flight` groups;
    /// answers are awaited for `timeout` each.
    pub(super) fn start(
        cmd: &str,
        processes: usize,
        in_flight: usize,
        timeout: Duration,
    ) -> Result<Self, ScorerError> {
        let in_flight = in_flight.max(1);
        let procs = (0..processes.max(1))
            .map(|_| ScorerProcess::start(cmd, in_flight, timeout))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pool {
            held: Mutex::new(vec![0; procs.len()]),
            places: Semaphore::new(procs.len() * in_flight),
            in_flight,
            procs,
        })
    }

    /// Groups the pool scores at once.
    pub(super) fn places(&self) -> usize {
        self.procs.len() * self.in_flight
    }

    /// Scores one group once a place is free (see [`ScorerProcess::score`]).
    pub(super) async fn score(
        &self,
        req: &ExternalRequest<'_>,
        step_ends: Option<&[Vec<usize>]>,
    ) -> Result<Scores, ScorerError> {
        let Ok(_place) = self.places.acquire().await else {
            return Err(ScorerError::Unscored);
        };
        let taken = Taken::least_held(&self.held);
        self.procs[taken.0].score(req, step_ends).await
    }
}

/// A place taken on one process of the pool, given back when dropped (also when the
/// scoring future is dropped).
struct Taken<'a>(usize, &'a Mutex<Vec<usize>>);

impl<'a> Taken<'a> {
    /// A place on the process holding the fewest groups (the pool's semaphore guarantees
    /// one is below its limit).
    fn least_held(held: &'a Mutex<Vec<usize>>) -> Self {
        let mut h = held.lock().unwrap_or_else(|p| p.into_inner());
        let k = (0..h.len()).min_by_key(|&k| h[k]).unwrap_or(0);
        if let Some(n) = h.get_mut(k) {
            *n += 1;
        }
        Taken(k, held)
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut h = self.1.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = h.get_mut(self.0) {
            *n = n.saturating_sub(1);
        }
    }
}

/// One external scorer process, started at once and restarted if it dies.
struct ScorerProcess {
    child: Arc<JsonLinesChild>,
}

impl ScorerProcess {
    /// Starts `cmd` holding up to `in_flight` groups at once (several are matched by
    /// [`REQUEST_ID`]); its answers are awaited for `timeout` each.
    fn start(cmd: &str, in_flight: usize, timeout: Duration) -> Result<Self, ScorerError> {
        let spec = ChildSpec {
            what: "scorer",
            command: cmd.to_string(),
            matching: if in_flight > 1 {
                Matching::ByKey(REQUEST_ID)
            } else {
                Matching::InOrder
            },
            timeout,
        };
        Ok(ScorerProcess {
            child: JsonLinesChild::start(spec, |_| {})?,
        })
    }

    /// Scores one group. `step_ends[i][k]`: the last token of completion `i`'s step `k`
    /// (with a separator).
    async fn score(
        &self,
        req: &ExternalRequest<'_>,
        step_ends: Option<&[Vec<usize>]>,
    ) -> Result<Scores, ScorerError> {
        let msg = serde_json::to_value(req).map_err(|e| ScorerError::Request(e.to_string()))?;
        let child = self.child.clone();
        let key = req.request_id.clone();
        let answer = tokio::task::spawn_blocking(move || child.request(&key, None, &msg))
            .await
            .map_err(|e| ScorerError::Request(format!("the request's thread failed: {e}")))??;
        let fields = serde_json::Value::Object(answer.fields);
        let resp: ExternalResponse =
            serde_json::from_value(fields.clone()).map_err(|e| ScorerError::BadAnswer {
                error: e.to_string(),
                answer: crate::child::shown(&fields.to_string()),
            })?;
        checked(resp, &req.tokens, step_ends)
    }
}

/// The scores of an answer, checked against the request's completions.
fn checked(
    resp: ExternalResponse,
    tokens: &[&[u32]],
    step_ends: Option<&[Vec<usize>]>,
) -> Result<Scores, ScorerError> {
    if let Some(e) = resp.error {
        return Err(ScorerError::Reported(e));
    }
    let rewards = resp.rewards.ok_or(ScorerError::NoRewards)?;
    if rewards.len() != tokens.len() {
        return Err(ScorerError::Count {
            got: rewards.len(),
            want: tokens.len(),
        });
    }
    if let Some(&bad) = rewards.iter().find(|r| !r.is_finite()) {
        return Err(ScorerError::NonFinite(bad));
    }
    let lens: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
    let token_rewards = match (resp.token_rewards, resp.step_rewards) {
        (Some(_), Some(_)) => {
            return Err(ScorerError::BadTokenRewards(
                "give token_rewards or step_rewards, not both".into(),
            ));
        }
        (Some(pairs), None) => Some(steps::placed(&pairs, &lens)?),
        (None, Some(per_step)) => {
            let Some(ends) = step_ends else {
                return Err(ScorerError::BadTokenRewards(
                    "step_rewards need steps: start score with --step-separator".into(),
                ));
            };
            Some(steps::step_rewards(&per_step, ends, &lens)?)
        }
        (None, None) => None,
    };
    Ok(Scores {
        rewards,
        token_rewards,
        teacher: None,
        from_env: false,
    })
}

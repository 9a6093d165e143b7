//! Episodes as a row source: a prompt whose meta names an environment (see [`crate::env`]).
//! Each of its G rows plays its own copy of the environment. A row whose model turn ended
//! is parked with its KV cache; its environment step runs on a thread of its own, so the
//! batch keeps decoding; the answer (which rings the decode loop's doorbell) is picked up
//! before the next forward pass and the row resumes (or ends). A step that fails, panics or
//! outlives `env_timeout_ms` ends its episode, which is counted
//! (`rlstream_env_failures_total`) and left out of the group; a group whose every episode
//! failed is dead-lettered with the first failure's reason.

use super::group::{Admit, FromReader, Groups, Queue, RowEnd};
use super::inbox::{self, Doorbell, Inbox, Sender};
use super::source::{Panicked, RowSource, Rows, Waiting};
use crate::env::play::{Answer, EpisodeLimits, into_answer, turn_text};
use crate::env::{self, EnvError, Environment, Environments};
use crate::model::ModelError;
use crate::model::fault;
use crate::model::sampler::{Completion, Resumed, Turn};
use crate::model::tokenizer::Tokenizer;
use crate::schema::FinishReason;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An environment's answer, back from its step thread.
struct EnvReply {
    turn: Turn,
    env: Box<dyn Environment>,
    step: Result<env::Step, EnvError>,
    /// How long the step took, on its thread (a stand-in latency included).
    seconds: f64,
}

/// How episodes are played.
pub struct EpisodeRules {
    pub limits: EpisodeLimits,
    /// A stand-in latency added to every environment step.
    pub latency: Duration,
    /// How long a step may take before its episode ends.
    pub timeout: Duration,
    /// The model's end-of-sequence ids, cut from a turn's text.
    pub stop_tokens: Vec<u32>,
}

/// A row's key: (request, index).
type RowKey = (u64, usize);

pub struct EpisodeSource {
    queue: Queue,
    groups: Groups,
    rules: EpisodeRules,
    /// Where new episodes' environments come from.
    make: Environments,
    /// The model's tokenizer: turns to text for the environment, observations to tokens.
    tokenizer: Arc<Tokenizer>,
    /// Each row's environment (absent while it is out on a step).
    envs: HashMap<RowKey, Box<dyn Environment>>,
    /// When each step out was sent.
    out: HashMap<RowKey, Instant>,
    replies: (Sender<EnvReply>, Inbox<EnvReply>),
}

impl EpisodeSource {
    pub fn new(
        inbox: Inbox<FromReader>,
        groups: Groups,
        (rules, make): (EpisodeRules, Environments),
        tokenizer: Arc<Tokenizer>,
        bell: &Arc<Doorbell>,
    ) -> Self {
        EpisodeSource {
            queue: Queue::new(inbox),
            groups,
            rules,
            make,
            tokenizer,
            envs: HashMap::new(),
            out: HashMap::new(),
            replies: inbox::inbox(bell),
        }
    }

    /// Runs `env`'s step on `turn` (text `action`) on a thread of its own.
    fn send(&mut self, turn: Turn, mut env: Box<dyn Environment>, action: String) {
        self.out
            .insert((turn.request_id, turn.index), Instant::now());
        let (tx, latency) = (self.replies.0.clone(), self.rules.latency);
        let spawned = std::thread::Builder::new()
            .name("env-step".into())
            .spawn(move || {
                let started = Instant::now();
                if !latency.is_zero() {
                    std::thread::sleep(latency);
                }
                let step = match fault::contain(|| env.step(&action)) {
                    Ok(step) => step,
                    Err(panic) => Err(EnvError::Panic(panic)),
                };
                let seconds = started.elapsed().as_secs_f64();
                let _ = tx.send(EnvReply {
                    turn,
                    env,
                    step,
                    seconds,
                });
            });
        if let Err(e) = spawned {
            // No thread: the deadline passes and the episode ends as timed out.
            tracing::error!(error = %e, "cannot start an environment step thread");
        }
    }

    /// The G environments of `a`'s episodes, or why there are none.
    fn environments(&self, a: &Admit) -> Result<Vec<Box<dyn Environment>>, EnvError> {
        (0..self.groups.group_size())
            .map(|_| {
                self.make
                    .make(&a.prompt.prompt_id, &a.prompt.text, &a.prompt.meta)?
                    .ok_or_else(|| EnvError::Setup("the prompt names no environment".into()))
            })
            .collect()
    }

    /// Starts G episodes of `a` (their prefill runs now).
    fn start(&mut self, rows: &mut Rows<'_>, a: Admit) -> Result<(), ModelError> {
        let envs = match self.environments(&a) {
            Ok(envs) => envs,
            Err(e) => {
                crate::metrics::env_failed(e.reason());
                self.groups
                    .refuse(a.source, &a.prompt.prompt_id, e.reason(), e.to_string());
                return Ok(());
            }
        };
        let turn = self.rules.limits.turn;
        let started = self.groups.start(rows, a, |g, model, version, req| {
            g.admit_episode(model, version, req, turn)
        })?;
        if let Some(id) = started {
            for (i, e) in envs.into_iter().enumerate() {
                self.envs.insert((id, i), e);
            }
        }
        Ok(())
    }

    /// Ends an episode its environment failed: counted, left out of its group.
    fn fail(&mut self, rows: &mut Rows<'_>, (rid, idx): RowKey, e: EnvError) {
        tracing::warn!(request = rid, episode = idx, error = %e, "episode ended by its environment");
        crate::metrics::env_failed(e.reason());
        self.envs.remove(&(rid, idx));
        self.out.remove(&(rid, idx));
        rows.generator().end(rid, idx, None, FinishReason::Length);
        self.groups.settle(rid, idx, RowEnd::Failed(e));
    }

    /// Files a finished episode with its group, counted by how it ended.
    fn done(&mut self, rows: &mut Rows<'_>, ended: &'static str, c: Completion) {
        crate::metrics::episode(ended, c.turns);
        rows.count(&c);
        let (rid, idx) = (c.request_id, c.index);
        self.groups.settle(rid, idx, RowEnd::Done(Box::new(c)));
    }

    /// Resumes or ends the episode of `turn` as the environment answered.
    fn apply(
        &mut self,
        rows: &mut Rows<'_>,
        turn: Turn,
        env: Box<dyn Environment>,
        answer: Result<Answer, EnvError>,
    ) -> Result<(), ModelError> {
        let key = (turn.request_id, turn.index);
        let (reward, observation) = match answer {
            Err(e) => {
                self.fail(rows, key, e);
                return Ok(());
            }
            Ok(Answer::End { reward, finish, .. }) => {
                if let Some(c) = rows.generator().end(key.0, key.1, reward, finish) {
                    let ended = if finish == FinishReason::Stop {
                        "done"
                    } else {
                        "turns"
                    };
                    self.done(rows, ended, c);
                }
                return Ok(());
            }
            Ok(Answer::Continue {
                reward,
                observation,
            }) => (reward, observation),
        };
        let resumed = rows.prefill(|g, model, version| {
            g.resume(key.0, key.1, Some(reward), &observation, model, version)
        });
        match resumed {
            Ok(Ok(Some(Resumed::Finished(c)))) => self.done(rows, "tokens", *c),
            Ok(Ok(Some(_))) => {
                self.envs.insert(key, env);
            }
            Ok(Ok(None)) => {}
            Ok(Err(ModelError::Refused(r))) => {
                self.fail(rows, key, EnvError::Observation(r.detail));
            }
            Ok(Err(e)) => return Err(e),
            Err(panic) => self.fail(
                rows,
                key,
                EnvError::Observation(format!("prefilling the observation panicked: {panic}")),
            ),
        }
        Ok(())
    }
}

impl RowSource for EpisodeSource {
    fn receive(&mut self) {
        self.queue.receive();
    }

    fn waiting(&self) -> Waiting {
        self.queue.waiting()
    }

    fn busy(&self) -> bool {
        self.groups.busy()
    }

    /// Takes the environments' answers that are in, resumes or ends their episodes, and
    /// ends those whose step is overdue.
    fn prepare(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError> {
        if self.out.is_empty() {
            return Ok(());
        }
        let replies: Vec<EnvReply> = self.replies.1.drain().collect();
        for r in replies {
            let key = (r.turn.request_id, r.turn.index);
            // An answer after the deadline: its episode has already ended.
            if self.out.remove(&key).is_none() {
                continue;
            }
            crate::metrics::env_step(r.seconds);
            let answer = r
                .step
                .and_then(|s| into_answer(s, &r.turn, &self.tokenizer, &self.rules.limits));
            self.apply(rows, r.turn, r.env, answer)?;
        }
        let now = Instant::now();
        let timeout = self.rules.timeout;
        let overdue: Vec<RowKey> = self
            .out
            .iter()
            .filter(|(_, sent)| now.duration_since(**sent) >= timeout)
            .map(|(&k, _)| k)
            .collect();
        for key in overdue {
            self.fail(rows, key, EnvError::Timeout(timeout.as_millis() as u64));
        }
        Ok(())
    }

    fn admit(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError> {
        while let Some(a) = self.queue.next(rows, self.groups.group_size()) {
            self.start(rows, a)?;
        }
        Ok(())
    }

    fn owns(&self, request: u64) -> bool {
        self.groups.owns(request)
    }

    fn label(&self, request: u64) -> Option<&str> {
        self.groups.label(request)
    }

    /// An episode that ran out of tokens while decoding.
    fn finished(&mut self, _rows: &mut Rows<'_>, c: Completion) {
        let key = (c.request_id, c.index);
        if self.envs.remove(&key).is_some() {
            crate::metrics::episode("tokens", c.turns.max(1));
        }
        self.groups.settle(key.0, key.1, RowEnd::Done(Box::new(c)));
    }

    /// Sends the ended turn to its environment.
    fn turn_ended(&mut self, rows: &mut Rows<'_>, turn: Turn) {
        let key = (turn.request_id, turn.index);
        let action = turn_text(&turn, &self.rules.stop_tokens, &self.tokenizer);
        match (action, self.envs.remove(&key)) {
            (Ok(action), Some(env)) => self.send(turn, env, action),
            (Err(e), _) => self.fail(rows, key, e),
            (Ok(_), None) => self.fail(
                rows,
                key,
                EnvError::Step("the episode has no environment".into()),
            ),
        }
    }

    fn panicked(&mut self, request: u64, how: &Panicked<'_>) {
        self.envs.retain(|k, _| k.0 != request);
        self.out.retain(|k, _| k.0 != request);
        self.groups.panicked(request, how);
    }

    fn closed(&self) -> bool {
        self.groups.closed()
    }
}

//! The decode thread: owns the [`Generator`], loads the current model from the slot before
//! every forward pass (one atomic load, timed as the swap stall), admits waiting prompts
//! while rows are free, and hands each finished group to the publisher.
//!
//! Episodes (a prompt whose meta names an environment, see [`crate::env`]): each of the G
//! rows plays its own copy of the environment. A row whose model turn ended is parked with
//! its KV cache; its environment step runs on a thread of its own, so the batch keeps
//! decoding; the answer is picked up before the next forward pass and the row resumes (or
//! ends). A step that fails, panics or outlives `env_timeout_ms` ends its episode, which is
//! counted (`rlstream_env_failures_total`) and left out of the group; a group whose every
//! episode failed is dead-lettered with the first failure's reason.

use super::GenConfig;
use super::calls::{Call, CallEvent};
use super::text::TextStream;
use crate::bus::{Entry, EntryId};
use crate::env::play::{Answer, EpisodeLimits, into_answer, turn_text};
use crate::env::{self, EnvError, Environment, Environments};
use crate::model::fault;
use crate::model::sampler::{Completion, Drawn, Generator, Request, Resumed, Turn, TurnLimits};
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, ModelError};
use crate::schema::{self, FinishReason, Prompt, RolloutGroup, Sample, SamplingParams};
use crate::stages::StageError;
use crate::stages::policy::PolicySettings;
use crate::weights::{ModelSlot, Versioned};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long the idle decode thread waits for a prompt before checking for shutdown.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// How long an idle decoder that got a prompt waits for the rest of that prompt's read
/// before its first forward pass. The reader hands a read's prompts over one by one, with
/// admission checks between them; waiting for the read's end makes a batch that starts
/// from idle (every step of a `--sync` run) the same whatever the threads' timing, so its
/// bits repeat. A reader held up inside a read (the in-flight bound) ends the wait.
const READ_WAIT: Duration = Duration::from_millis(500);

/// What the reader and the endpoint hand the decoder.
pub enum ToDecoder {
    /// An admitted prompt.
    Prompt(Box<Admit>),
    /// The prompts of one read have all been handed over.
    ReadEnd,
    /// A call from the endpoint.
    Call(Box<Call>),
}

/// A prompt on its way to the decode thread: its entry as read (for a dead letter), the
/// message and the ids to decode from.
pub struct Admit {
    pub source: Entry,
    pub prompt: Prompt,
    pub tokens: Vec<u32>,
}

/// A finished group on its way to the publisher.
pub struct Finished {
    pub entry: EntryId,
    pub group: RolloutGroup,
}

/// A prompt the model could not run, to be dead-lettered by the reader.
pub struct Failed {
    pub source: Entry,
    pub reason: &'static str,
    pub detail: String,
}

/// What the decode thread hands the publisher.
pub enum Decoded {
    Group(Finished),
    Failed(Failed),
}

/// What the decode thread measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeStats {
    pub steps: u64,
    pub tokens: u64,
    /// Forward passes that ran on a newer model than the previous pass.
    pub swaps: u64,
    /// Time to pick up the current model before each pass, per swap (seconds).
    pub swap_stalls: Vec<f64>,
    /// Seconds waiting for a prompt with no row to decode, and seconds in forward passes
    /// (prefill and decode).
    pub idle_s: f64,
    pub busy_s: f64,
}

/// What became of one of a prompt's G rows.
enum Slot {
    Done(Box<Completion>),
    /// An episode its environment failed: left out of the group.
    Failed(EnvError),
}

/// A prompt being decoded: its G completions as they finish.
struct Pending {
    source: Entry,
    prompt: Prompt,
    tokens: Vec<u32>,
    params: SamplingParams,
    started_us: u64,
    done: Vec<Option<Slot>>,
}

impl Pending {
    /// The group of the rows that finished, or the first failure when every one failed.
    fn into_group(self, gen_id: &str) -> Result<RolloutGroup, (Entry, EnvError)> {
        let mut failure = None;
        let mut samples = Vec::new();
        let mut prompt_routing = None;
        for slot in self.done.into_iter().flatten() {
            match slot {
                Slot::Done(mut c) => {
                    if let Some(r) = c.prompt_routing.take() {
                        prompt_routing.get_or_insert(r);
                    }
                    samples.push(Sample::from(*c));
                }
                Slot::Failed(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if samples.is_empty() {
            let e = failure.unwrap_or_else(|| EnvError::Step("no episode finished".into()));
            return Err((self.source, e));
        }
        Ok(RolloutGroup {
            schema: RolloutGroup::version_for(&samples),
            // Stable per prompt entry: a prompt generated twice (after a crash) yields the
            // same group id, and the trainer trains it once.
            group_id: format!("{}@{}", self.prompt.prompt_id, self.source.id),
            prompt_id: self.prompt.prompt_id,
            task: self.prompt.task,
            prompt_tokens: self.tokens.into(),
            samples,
            sampling: self.params,
            gen_id: gen_id.to_string(),
            started_us: self.started_us,
            finished_us: schema::now_us(),
            meta: self.prompt.meta,
            prompt_routing: prompt_routing.map(std::sync::Arc::unwrap_or_clone),
        })
    }
}

/// An environment's answer, back from its step thread.
struct EnvReply {
    turn: Turn,
    env: Box<dyn Environment>,
    step: Result<env::Step, EnvError>,
    /// How long the step took, on its thread (a stand-in latency included).
    seconds: f64,
}

/// The episodes in play: each row's environment (absent while it is out on a step) and
/// the deadlines of the steps out.
struct Episodes {
    limits: EpisodeLimits,
    latency: Duration,
    timeout: Duration,
    /// Where new episodes' environments come from.
    make: Environments,
    envs: HashMap<(u64, usize), Box<dyn Environment>>,
    /// When each step out was sent.
    out: HashMap<(u64, usize), Instant>,
    replies: (mpsc::Sender<EnvReply>, mpsc::Receiver<EnvReply>),
}

impl Episodes {
    /// Runs `env`'s step on `turn` (text `action`) on a thread of its own.
    fn send(&mut self, turn: Turn, mut env: Box<dyn Environment>, action: String) {
        let key = (turn.request_id, turn.index);
        self.out.insert(key, Instant::now());
        let (tx, latency) = (self.replies.0.clone(), self.latency);
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

    /// Forgets every episode of `request`.
    fn drop_request(&mut self, request: u64) {
        self.envs.retain(|k, _| k.0 != request);
        self.out.retain(|k, _| k.0 != request);
    }
}

/// The ids that end a completion: the model's end-of-sequence ids (its config and
/// generation config).
pub fn stop_tokens(
    policy: &PolicySettings,
    model: &crate::model::config::PolicyConfig,
) -> Vec<u32> {
    match &policy.model {
        Some(dir) => crate::model::hf::stop_tokens(dir, model),
        None => model.eos_token_id.into_iter().collect(),
    }
}

/// A call being decoded: where its tokens go, each row's text, the rows not yet ended.
struct Serving {
    events: tokio::sync::mpsc::UnboundedSender<CallEvent>,
    texts: Vec<TextStream>,
    open: usize,
}

/// The decode loop's state.
pub struct Decoder {
    /// End-of-sequence ids of the model (config and generation config).
    stop_tokens: Vec<u32>,
    policy: PolicySettings,
    cfg: GenConfig,
    slot: ModelSlot<InferBackend>,
    generator: Generator<InferBackend>,
    pending: HashMap<u64, Pending>,
    /// Calls being decoded, and calls waiting for rows (first come, first admitted, before
    /// any waiting prompt).
    calls: HashMap<u64, Serving>,
    queued: VecDeque<Call>,
    /// Rows the calls hold, as last reported.
    served_rows: usize,
    episodes: Episodes,
    /// The model's tokenizer: turns to text for the environment, observations to tokens.
    tokenizer: Tokenizer,
    next_id: u64,
    last_version: u64,
    stats: DecodeStats,
}

impl Decoder {
    pub fn new(
        policy: PolicySettings,
        cfg: GenConfig,
        slot: ModelSlot<InferBackend>,
        tokenizer: Tokenizer,
        environments: Environments,
    ) -> Self {
        let last_version = slot.load().version;
        let model_config = slot.load().policy.config().clone();
        let stop_tokens = stop_tokens(&policy, &model_config);
        let context = model_config.max_position;
        let episodes = Episodes {
            limits: EpisodeLimits {
                turn: TurnLimits {
                    turn_tokens: cfg.max_new_tokens as usize,
                    episode_tokens: match cfg.max_episode_tokens {
                        0 => context,
                        n => n as usize,
                    },
                },
                turns: cfg.max_turns,
            },
            latency: Duration::from_millis(cfg.env_latency_ms),
            timeout: Duration::from_millis(cfg.env_timeout_ms),
            make: environments,
            envs: HashMap::new(),
            out: HashMap::new(),
            replies: mpsc::channel(),
        };
        Decoder {
            stop_tokens,
            policy,
            cfg,
            slot,
            generator: Generator::new(),
            pending: HashMap::new(),
            calls: HashMap::new(),
            queued: VecDeque::new(),
            served_rows: 0,
            episodes,
            tokenizer,
            next_id: 0,
            last_version,
            stats: DecodeStats::default(),
        }
    }

    /// Runs the loop on a thread of its own (named after the generator).
    pub fn spawn(
        self,
        admit: mpsc::Receiver<ToDecoder>,
        finished: tokio::sync::mpsc::UnboundedSender<Decoded>,
        stop: Arc<AtomicBool>,
    ) -> Result<std::thread::JoinHandle<Result<DecodeStats, ModelError>>, StageError> {
        std::thread::Builder::new()
            .name(format!("{}-decode", self.cfg.name))
            .spawn(move || self.run(admit, finished, stop))
            .map_err(|source| StageError::Thread {
                what: "decode",
                source,
            })
    }

    /// Runs until `stop` is set or the publisher is gone. A prompt the model cannot run is
    /// handed back as [`Decoded::Failed`]; only a failure that no one prompt explains (a
    /// tensor that cannot reach the host) stops the loop.
    pub fn run(
        mut self,
        admit: mpsc::Receiver<ToDecoder>,
        out: tokio::sync::mpsc::UnboundedSender<Decoded>,
        stop: Arc<AtomicBool>,
    ) -> Result<DecodeStats, ModelError> {
        // Prompts received and not yet admitted (more than fit the batch).
        let mut waiting: VecDeque<Admit> = VecDeque::new();
        while !stop.load(Ordering::Relaxed) {
            // With nothing to decode, wait for a prompt *before* loading the model, so the
            // first prompt after a pause starts on the newest weights; then for the rest of
            // its read (READ_WAIT).
            if self.is_idle() && waiting.is_empty() {
                let idle = Instant::now();
                match admit.recv_timeout(IDLE_WAIT) {
                    Ok(ToDecoder::Prompt(a)) => {
                        waiting.push_back(*a);
                        loop {
                            match admit.recv_timeout(READ_WAIT) {
                                Ok(ToDecoder::Prompt(a)) => waiting.push_back(*a),
                                // A call starts now, not after the read.
                                Ok(ToDecoder::Call(c)) => {
                                    self.queued.push_back(*c);
                                    break;
                                }
                                _ => break,
                            }
                        }
                    }
                    Ok(ToDecoder::Call(c)) => self.queued.push_back(*c),
                    _ => {}
                }
                self.stats.idle_s += idle.elapsed().as_secs_f64();
                if waiting.is_empty() && self.queued.is_empty() {
                    continue;
                }
            }
            for m in admit.try_iter() {
                match m {
                    ToDecoder::Prompt(a) => waiting.push_back(*a),
                    ToDecoder::Call(c) => self.queued.push_back(*c),
                    ToDecoder::ReadEnd => {}
                }
            }
            self.drop_abandoned();
            let current = self.current_model();
            let mut decoded = Vec::new();
            // With only parked episodes, wait here (briefly) for an environment's answer.
            let wait = (self.generator.active() == 0 && waiting.is_empty()).then_some(IDLE_WAIT);
            decoded.extend(self.answers(&current, wait)?);
            while let Some(c) = self.queued.front()
                && self.generator.active() + c.n <= self.cfg.max_batch
            {
                if let Some(c) = self.queued.pop_front() {
                    self.admit_call(&current, c)?;
                }
            }
            while self.generator.active() + self.cfg.group_size <= self.cfg.max_batch {
                let Some(a) = waiting.pop_front() else {
                    break;
                };
                decoded.extend(self.admit(&current, a)?.map(Decoded::Failed));
            }
            if self.generator.active() > 0 {
                decoded.extend(self.step(&current)?);
            } else {
                let done = self.generator.take_done();
                decoded.extend(self.finished(done));
            }
            decoded.extend(self.dispatch());
            self.report_rows();
            for d in decoded {
                if out.send(d).is_err() {
                    return Ok(self.stats);
                }
            }
        }
        Ok(self.stats)
    }

    /// The model for the next pass; a newer one than the last pass counts as a swap.
    fn current_model(&mut self) -> Arc<Versioned<InferBackend>> {
        let t0 = Instant::now();
        let current = self.slot.load();
        let stall = t0.elapsed().as_secs_f64();
        if current.version != self.last_version {
            self.stats.swaps += 1;
            self.stats.swap_stalls.push(stall);
            self.last_version = current.version;
            crate::metrics::swapped(current.version, stall);
        }
        current
    }

    /// Nothing decoding, parked, finished or waiting.
    fn is_idle(&self) -> bool {
        self.generator.is_idle()
            && self.pending.is_empty()
            && self.calls.is_empty()
            && self.queued.is_empty()
    }

    /// Drops the calls whose client went away, with their rows.
    fn drop_abandoned(&mut self) {
        self.queued.retain(|c| !c.events.is_closed());
        let gone: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, c)| c.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.generator.drop_request(id);
            self.calls.remove(&id);
            tracing::debug!(call = id, "a call's client went away: its rows are dropped");
        }
    }

    /// Reports the rows the calls hold when that changed.
    fn report_rows(&mut self) {
        let rows: usize = self.calls.values().map(|c| c.open).sum();
        if rows != self.served_rows {
            self.served_rows = rows;
            crate::metrics::serving_rows(rows);
        }
    }

    /// Starts decoding a call (its prefill runs now); the call hears why when the model
    /// refuses it.
    fn admit_call(
        &mut self,
        current: &Versioned<InferBackend>,
        call: Call,
    ) -> Result<(), ModelError> {
        if call.events.is_closed() {
            return Ok(());
        }
        let id = self.next_id;
        self.next_id += 1;
        let req = Request {
            id,
            prompt: call.prompt,
            n: call.n,
            params: call.params,
        };
        let prefill = Instant::now();
        let admitted = fault::contain(|| {
            self.generator
                .admit_watched(&current.policy, current.version, &req)
        });
        self.stats.busy_s += prefill.elapsed().as_secs_f64();
        let refused = match admitted {
            Ok(Ok(())) => {
                let texts = (0..call.n).map(|_| TextStream::new(call.stop.clone()));
                self.calls.insert(
                    id,
                    Serving {
                        events: call.events,
                        texts: texts.collect(),
                        open: call.n,
                    },
                );
                return Ok(());
            }
            Ok(Err(ModelError::Refused(r))) => CallEvent::Refused {
                reason: r.reason,
                detail: r.detail,
            },
            Ok(Err(e)) => return Err(e),
            Err(panic) => CallEvent::Failed(format!("the prefill panicked: {panic}")),
        };
        let _ = call.events.send(refused);
        Ok(())
    }

    /// Hands the calls the tokens drawn since the last call; ends the rows whose text
    /// reached a stop string.
    fn report_drawn(&mut self) {
        for Drawn {
            request_id,
            index,
            token,
            logprob,
            version,
        } in self.generator.take_drawn()
        {
            let Some(call) = self.calls.get_mut(&request_id) else {
                continue;
            };
            let Some(text) = call.texts.get_mut(index) else {
                continue;
            };
            if text.stopped() {
                continue;
            }
            let piece = text.push(&self.tokenizer, token).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "a served token has no text");
                String::new()
            });
            let _ = call.events.send(CallEvent::Token {
                index,
                token,
                logprob,
                version,
                text: piece,
            });
            if text.stopped()
                && let Some(c) = self
                    .generator
                    .finish_row(request_id, index, FinishReason::Stop)
            {
                self.call_finished(c);
            }
        }
    }

    /// Hands a call one of its finished rows (its text up to a stop string).
    fn call_finished(&mut self, c: Completion) {
        let Some(call) = self.calls.get_mut(&c.request_id) else {
            return;
        };
        let Some(text) = call.texts.get_mut(c.index) else {
            return;
        };
        let finish = if text.stopped() {
            FinishReason::Stop
        } else {
            c.finish
        };
        let rest = text.finish(&self.tokenizer).unwrap_or_default();
        self.stats.tokens += c.tokens.len() as u64;
        let id = c.request_id;
        let _ = call.events.send(CallEvent::Finished {
            index: c.index,
            finish,
            completion: Box::new(c),
            text: rest,
        });
        call.open = call.open.saturating_sub(1);
        if call.open == 0 {
            self.calls.remove(&id);
        }
    }

    /// Starts decoding G completions of `a` (its prefill runs now, for this prompt alone):
    /// the prompt back as failed when the model refuses it or its prefill panics.
    fn admit(
        &mut self,
        current: &Versioned<InferBackend>,
        a: Admit,
    ) -> Result<Option<Failed>, ModelError> {
        let params = SamplingParams {
            temperature: self.policy.temperature,
            top_k: self.cfg.sampling_top_k(),
            top_p: self.cfg.top_p,
            max_new_tokens: self.cfg.max_new_tokens,
            stop_tokens: self.stop_tokens.clone(),
            // From the prompt's identity, not its entry id: a rerun with the same seed
            // samples the same completions (see `crate::seed`).
            seed: crate::seed::derive(self.policy.seed, &a.prompt.prompt_id),
        };
        let id = self.next_id;
        self.next_id += 1;
        let g = self.cfg.group_size;
        let req = Request {
            id,
            prompt: a.tokens.clone(),
            n: g,
            params: params.clone(),
        };
        let envs = if env::is_episode(&a.prompt.meta) {
            match (0..g)
                .map(|_| {
                    self.episodes
                        .make
                        .make(&a.prompt.prompt_id, &a.prompt.text, &a.prompt.meta)?
                        .ok_or_else(|| EnvError::Setup("the prompt names no environment".into()))
                })
                .collect::<Result<Vec<_>, EnvError>>()
            {
                Ok(envs) => Some(envs),
                Err(e) => {
                    tracing::warn!(prompt = %a.prompt.prompt_id, error = %e, "prompt refused");
                    crate::metrics::env_failed(e.reason());
                    return Ok(Some(Failed {
                        source: a.source,
                        reason: e.reason(),
                        detail: e.to_string(),
                    }));
                }
            }
        } else {
            None
        };
        let prefill = Instant::now();
        let turn = self.episodes.limits.turn;
        let admitted = fault::contain(|| match envs {
            Some(_) => self
                .generator
                .admit_episode(&current.policy, current.version, &req, turn),
            None => self.generator.admit(&current.policy, current.version, &req),
        });
        self.stats.busy_s += prefill.elapsed().as_secs_f64();
        let (reason, detail) = match admitted {
            Ok(Ok(())) => {
                for (i, e) in envs.into_iter().flatten().enumerate() {
                    self.episodes.envs.insert((id, i), e);
                }
                self.pending.insert(
                    id,
                    Pending {
                        source: a.source,
                        prompt: a.prompt,
                        tokens: a.tokens,
                        params,
                        started_us: schema::now_us(),
                        done: (0..g).map(|_| None).collect(),
                    },
                );
                return Ok(None);
            }
            Ok(Err(ModelError::Refused(r))) => (r.reason, r.detail),
            Ok(Err(e)) => return Err(e),
            Err(panic) => (fault::PANIC, format!("the prefill panicked: {panic}")),
        };
        tracing::warn!(prompt = %a.prompt.prompt_id, reason, %detail, "prompt refused");
        Ok(Some(Failed {
            source: a.source,
            reason,
            detail,
        }))
    }

    /// One forward pass over every active row; the groups it completed. A pass that panics
    /// is discarded and its rows are re-run one at a time: the prompts whose rows panic
    /// alone fail, the others go on (see [`fault`]).
    fn step(&mut self, current: &Versioned<InferBackend>) -> Result<Vec<Decoded>, ModelError> {
        let busy = Instant::now();
        let before = self.generator.snapshot();
        let requests = self.generator.row_requests();
        let pass = fault::contain(|| {
            fault::inject(self.prompt_ids(&requests));
            self.generator.forward(&current.policy)
        });
        self.stats.steps += 1;
        let host = match pass {
            Ok(host) => host?,
            Err(panic) => {
                self.generator.restore(before);
                let failed = self.culprits(current, &requests, &panic);
                self.stats.busy_s += busy.elapsed().as_secs_f64();
                return Ok(failed);
            }
        };
        let vocab = current.policy.config().vocab_size;
        let done = self
            .generator
            .sample(host.as_deref().unwrap_or(&[]), current.version, vocab);
        self.stats.busy_s += busy.elapsed().as_secs_f64();
        Ok(self.finished(done))
    }

    /// Files finished completions with their prompts: the groups this completed.
    fn finished(&mut self, done: Vec<Completion>) -> Vec<Decoded> {
        // A call's tokens reach it before its rows' ends.
        self.report_drawn();
        let mut out = Vec::new();
        for c in done {
            if self.calls.contains_key(&c.request_id) {
                self.call_finished(c);
                continue;
            }
            self.stats.tokens += c.tokens.len() as u64;
            let (rid, idx) = (c.request_id, c.index);
            if self.episodes.envs.remove(&(rid, idx)).is_some() {
                // An episode that ran out of tokens while decoding.
                crate::metrics::episode("tokens", c.turns.max(1));
            }
            out.extend(self.settle(rid, idx, Slot::Done(Box::new(c))));
        }
        out
    }

    /// Records what became of row `idx` of request `rid`: its group once every row is in.
    fn settle(&mut self, rid: u64, idx: usize, slot: Slot) -> Option<Decoded> {
        let p = self.pending.get_mut(&rid)?;
        *p.done.get_mut(idx)? = Some(slot);
        if !p.done.iter().all(Option::is_some) {
            return None;
        }
        let p = self.pending.remove(&rid)?;
        let entry = p.source.id;
        Some(match p.into_group(&self.cfg.name) {
            Ok(group) => Decoded::Group(Finished { entry, group }),
            Err((source, e)) => Decoded::Failed(Failed {
                source,
                reason: e.reason(),
                detail: format!("every episode of the group failed; the first: {e}"),
            }),
        })
    }

    /// Ends an episode its environment failed: counted, left out of its group.
    fn fail_episode(&mut self, rid: u64, idx: usize, e: EnvError) -> Option<Decoded> {
        tracing::warn!(request = rid, episode = idx, error = %e, "episode ended by its environment");
        crate::metrics::env_failed(e.reason());
        self.episodes.envs.remove(&(rid, idx));
        self.episodes.out.remove(&(rid, idx));
        self.generator.end(rid, idx, None, FinishReason::Length);
        self.settle(rid, idx, Slot::Failed(e))
    }

    /// Sends every ended turn to its environment.
    fn dispatch(&mut self) -> Vec<Decoded> {
        let mut out = Vec::new();
        for turn in self.generator.take_turns() {
            let key = (turn.request_id, turn.index);
            let action = turn_text(&turn, &self.stop_tokens, &self.tokenizer);
            match (action, self.episodes.envs.remove(&key)) {
                (Ok(action), Some(env)) => self.episodes.send(turn, env, action),
                (Err(e), _) => out.extend(self.fail_episode(key.0, key.1, e)),
                (Ok(_), None) => out.extend(self.fail_episode(
                    key.0,
                    key.1,
                    EnvError::Step("the episode has no environment".into()),
                )),
            }
        }
        out
    }

    /// Takes the environments' answers that are in (waiting up to `wait` for the first
    /// when given), resumes or ends their episodes, and ends those whose step is overdue.
    fn answers(
        &mut self,
        current: &Versioned<InferBackend>,
        wait: Option<Duration>,
    ) -> Result<Vec<Decoded>, ModelError> {
        let mut out = Vec::new();
        if self.episodes.out.is_empty() {
            return Ok(out);
        }
        let mut replies = Vec::new();
        if let Some(wait) = wait {
            let idle = Instant::now();
            if let Ok(r) = self.episodes.replies.1.recv_timeout(wait) {
                replies.push(r);
            }
            self.stats.idle_s += idle.elapsed().as_secs_f64();
        }
        replies.extend(self.episodes.replies.1.try_iter());
        for r in replies {
            let key = (r.turn.request_id, r.turn.index);
            // An answer after the deadline: its episode has already ended.
            if self.episodes.out.remove(&key).is_none() {
                continue;
            }
            crate::metrics::env_step(r.seconds);
            let answer = r
                .step
                .and_then(|s| into_answer(s, &r.turn, &self.tokenizer, &self.episodes.limits));
            out.extend(self.apply(current, r.turn, r.env, answer)?);
        }
        let now = Instant::now();
        let overdue: Vec<(u64, usize)> = self
            .episodes
            .out
            .iter()
            .filter(|(_, sent)| now.duration_since(**sent) >= self.episodes.timeout)
            .map(|(&k, _)| k)
            .collect();
        let ms = self.episodes.timeout.as_millis() as u64;
        for (rid, idx) in overdue {
            out.extend(self.fail_episode(rid, idx, EnvError::Timeout(ms)));
        }
        Ok(out)
    }

    /// Resumes or ends the episode of `turn` as the environment answered.
    fn apply(
        &mut self,
        current: &Versioned<InferBackend>,
        turn: Turn,
        env: Box<dyn Environment>,
        answer: Result<Answer, EnvError>,
    ) -> Result<Option<Decoded>, ModelError> {
        let (rid, idx) = (turn.request_id, turn.index);
        match answer {
            Err(e) => Ok(self.fail_episode(rid, idx, e)),
            Ok(Answer::End {
                reward,
                finish,
                success: _,
            }) => {
                let Some(c) = self.generator.end(rid, idx, reward, finish) else {
                    return Ok(None);
                };
                let ended = if finish == FinishReason::Stop {
                    "done"
                } else {
                    "turns"
                };
                crate::metrics::episode(ended, c.turns);
                self.stats.tokens += c.tokens.len() as u64;
                Ok(self.settle(rid, idx, Slot::Done(Box::new(c))))
            }
            Ok(Answer::Continue {
                reward,
                observation,
            }) => {
                let busy = Instant::now();
                let resumed = fault::contain(|| {
                    self.generator.resume(
                        rid,
                        idx,
                        Some(reward),
                        &observation,
                        &current.policy,
                        current.version,
                    )
                });
                self.stats.busy_s += busy.elapsed().as_secs_f64();
                match resumed {
                    Ok(Ok(Some(Resumed::Finished(c)))) => {
                        crate::metrics::episode("tokens", c.turns);
                        self.stats.tokens += c.tokens.len() as u64;
                        Ok(self.settle(rid, idx, Slot::Done(c)))
                    }
                    Ok(Ok(Some(_))) => {
                        self.episodes.envs.insert((rid, idx), env);
                        Ok(None)
                    }
                    Ok(Ok(None)) => Ok(None),
                    Ok(Err(ModelError::Refused(r))) => {
                        Ok(self.fail_episode(rid, idx, EnvError::Observation(r.detail)))
                    }
                    Ok(Err(e)) => Err(e),
                    Err(panic) => Ok(self.fail_episode(
                        rid,
                        idx,
                        EnvError::Observation(format!(
                            "prefilling the observation panicked: {panic}"
                        )),
                    )),
                }
            }
        }
    }

    /// The prompt ids of `requests`.
    fn prompt_ids<'a>(&'a self, requests: &'a [u64]) -> impl Iterator<Item = &'a str> + 'a {
        requests
            .iter()
            .filter_map(|r| self.pending.get(r).map(|p| p.prompt.prompt_id.as_str()))
    }

    /// After a batched pass panicked with `panic`: re-runs each row alone and fails the
    /// prompts whose rows panic. When no row panics alone, the batch as a whole is the
    /// culprit and every prompt in it fails, so the same pass cannot panic forever.
    fn culprits(
        &mut self,
        current: &Versioned<InferBackend>,
        requests: &[u64],
        panic: &str,
    ) -> Vec<Decoded> {
        let mut bad: Vec<u64> = Vec::new();
        for (i, &r) in requests.iter().enumerate() {
            if bad.contains(&r) {
                continue;
            }
            let alone = fault::contain(|| {
                fault::inject(self.prompt_ids(std::slice::from_ref(&r)));
                self.generator.probe_row(&current.policy, i)
            });
            if alone.is_err() {
                bad.push(r);
            }
        }
        let alone = !bad.is_empty();
        if !alone {
            bad = requests.to_vec();
            bad.dedup();
        }
        tracing::error!(
            panic,
            prompts = bad.len(),
            alone,
            "a forward pass panicked; failing the prompts that caused it"
        );
        let mut failed = Vec::new();
        for r in bad {
            self.generator.drop_request(r);
            self.episodes.drop_request(r);
            if let Some(call) = self.calls.remove(&r) {
                let _ = call.events.send(CallEvent::Failed(format!(
                    "a forward pass over this call's rows panicked: {panic}"
                )));
            }
            if let Some(p) = self.pending.remove(&r) {
                let detail = if alone {
                    format!("its forward pass panicked, alone as in its batch: {panic}")
                } else {
                    format!("a batched forward pass panicked and no row panicked alone: {panic}")
                };
                failed.push(Decoded::Failed(Failed {
                    source: p.source,
                    reason: fault::PANIC,
                    detail,
                }));
            }
        }
        failed
    }
}

//! The decode thread: owns the [`Generator`], loads the current model from the slot before
//! every forward pass (one atomic load, timed as the swap stall), admits waiting prompts
//! while rows are free, and hands each finished group to the publisher.

use super::GenConfig;
use crate::bus::{Entry, EntryId};
use crate::model::fault;
use crate::model::sampler::{Completion, Generator, Request};
use crate::model::{InferBackend, ModelError};
use crate::schema::{self, Prompt, RolloutGroup, Sample, SamplingParams, SchemaVersion};
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

/// What the reader hands the decoder.
pub enum ToDecoder {
    /// An admitted prompt.
    Prompt(Box<Admit>),
    /// The prompts of one read have all been handed over.
    ReadEnd,
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

/// A prompt being decoded: its G completions as they finish.
struct Pending {
    source: Entry,
    prompt: Prompt,
    tokens: Vec<u32>,
    params: SamplingParams,
    started_us: u64,
    done: Vec<Option<Completion>>,
}

impl Pending {
    fn into_group(self, gen_id: &str) -> RolloutGroup {
        let samples = self.done.into_iter().flatten().map(Sample::from).collect();
        RolloutGroup {
            schema: SchemaVersion::CURRENT,
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
        }
    }
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
    next_id: u64,
    last_version: u64,
    stats: DecodeStats,
}

impl Decoder {
    pub fn new(policy: PolicySettings, cfg: GenConfig, slot: ModelSlot<InferBackend>) -> Self {
        let last_version = slot.load().version;
        let model_config = slot.load().policy.config().clone();
        let stop_tokens = match &policy.model {
            Some(dir) => crate::model::hf::stop_tokens(dir, &model_config),
            None => model_config.eos_token_id.into_iter().collect(),
        };
        Decoder {
            stop_tokens,
            policy,
            cfg,
            slot,
            generator: Generator::new(),
            pending: HashMap::new(),
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
            if self.generator.is_idle() && self.pending.is_empty() && waiting.is_empty() {
                let idle = Instant::now();
                if let Ok(ToDecoder::Prompt(a)) = admit.recv_timeout(IDLE_WAIT) {
                    waiting.push_back(*a);
                    while let Ok(ToDecoder::Prompt(a)) = admit.recv_timeout(READ_WAIT) {
                        waiting.push_back(*a);
                    }
                }
                self.stats.idle_s += idle.elapsed().as_secs_f64();
                if waiting.is_empty() {
                    continue;
                }
            }
            let current = self.current_model();
            let mut decoded = Vec::new();
            while self.generator.active() + self.cfg.group_size <= self.cfg.max_batch {
                let next = waiting.pop_front().or_else(|| {
                    std::iter::from_fn(|| admit.try_recv().ok()).find_map(|m| match m {
                        ToDecoder::Prompt(a) => Some(*a),
                        ToDecoder::ReadEnd => None,
                    })
                });
                let Some(a) = next else {
                    break;
                };
                decoded.extend(self.admit(&current, a)?.map(Decoded::Failed));
            }
            if !self.generator.is_idle() {
                decoded.extend(self.step(&current)?);
            }
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

    /// Starts decoding G completions of `a` (its prefill runs now, for this prompt alone):
    /// the prompt back as failed when the model refuses it or its prefill panics.
    fn admit(
        &mut self,
        current: &Versioned<InferBackend>,
        a: Admit,
    ) -> Result<Option<Failed>, ModelError> {
        let params = SamplingParams {
            temperature: self.policy.temperature,
            top_k: self.cfg.top_k,
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
        let prefill = Instant::now();
        let admitted =
            fault::contain(|| self.generator.admit(&current.policy, current.version, &req));
        self.stats.busy_s += prefill.elapsed().as_secs_f64();
        let (reason, detail) = match admitted {
            Ok(Ok(())) => {
                self.pending.insert(
                    id,
                    Pending {
                        source: a.source,
                        prompt: a.prompt,
                        tokens: a.tokens,
                        params,
                        started_us: schema::now_us(),
                        done: vec![None; g],
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
        let mut finished = Vec::new();
        for c in done {
            self.stats.tokens += c.tokens.len() as u64;
            let Some(p) = self.pending.get_mut(&c.request_id) else {
                continue;
            };
            let (rid, idx) = (c.request_id, c.index);
            p.done[idx] = Some(c);
            if p.done.iter().all(Option::is_some)
                && let Some(p) = self.pending.remove(&rid)
            {
                let entry = p.source.id;
                let group = p.into_group(&self.cfg.name);
                finished.push(Decoded::Group(Finished { entry, group }));
            }
        }
        Ok(finished)
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

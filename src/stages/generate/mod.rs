//! `rlstream gen`: the generator. Reads prompts through the `gen` group, samples G
//! completions per prompt with continuous batching, and publishes one RolloutGroup per
//! prompt with per-token behaviour log-probs, version run-lengths and sampling masks.
//!
//! Three parts run at once:
//! - the **decode thread** owns the [`Generator`]; before every forward pass it loads the
//!   current model from the [`ModelSlot`] (one atomic load, timed as the swap stall), admits
//!   waiting prompts while rows are free, and hands finished groups on;
//! - the **weights follower** task fetches, verifies and builds new versions and swaps them
//!   into the slot, so the decode loop never waits for weights and keeps its KV cache;
//! - the **reader** task polls prompts while the in-flight bound allows, and the main task
//!   publishes finished groups and acks their prompts.
//!
//! In-flight bound: a prompt is admitted only while the work started but not yet trained
//! stays under `max_lag × groups_per_step` groups (at least one step's): groups decoding here, plus the
//! rollouts not yet scored (pending and lag of the `score` group) and the scored groups not
//! yet delivered to the trainer (lag of the `train` group), from XINFO. Scored groups the
//! trainer has taken are not counted: it holds them unacked until its next checkpoint even
//! after training on them, and it takes at most `groups_per_step` it has not trained. The
//! trainer drops groups older than `max_lag` versions; this bound keeps it from having to.

mod config;
pub use config::*;

use super::StageError;
use super::policy::PolicySettings;
use crate::bus::{Bus, Consumer, ConsumerOptions, Delivery, EntryId, SharedBus, Topology};
use crate::model::hf::load_hf;
use crate::model::sampler::{Completion, Generator, Request};
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, Policy};
use crate::roles::{Stage, Stream};
use crate::schema::{self, Prompt, RolloutGroup, Sample, SamplingParams, SchemaVersion};
use crate::tasks;
use crate::weights::{Follower, ModelSlot, Transport, Versioned};
use arc_swap::ArcSwap;
use bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How often the reader refreshes the backlog of the downstream streams.
const BACKLOG_REFRESH: Duration = Duration::from_millis(250);
/// How long the idle decode thread waits for a prompt before checking for shutdown.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// A prompt on its way to the decode thread.
struct Admit {
    entry: EntryId,
    prompt: Prompt,
    tokens: Vec<u32>,
}

/// A finished group on its way to the publisher.
struct Finished {
    entry: EntryId,
    group: RolloutGroup,
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

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenSummary {
    pub groups: u64,
    pub tokens: u64,
    pub rejected: u64,
    pub decode: DecodeStats,
    pub final_version: u64,
}

/// The model slot of a generator started from `model_dir`, at version 0.
pub fn initial_slot(model_dir: &std::path::Path) -> Result<ModelSlot<InferBackend>, StageError> {
    let policy: Policy<InferBackend> = load_hf(model_dir, &Default::default())?;
    Ok(Arc::new(ArcSwap::from_pointee(Versioned {
        version: 0,
        policy,
    })))
}

struct Pending {
    entry: EntryId,
    prompt: Prompt,
    tokens: Vec<u32>,
    params: SamplingParams,
    started_us: u64,
    done: Vec<Option<Completion>>,
}

fn assemble(gen_id: &str, p: Pending) -> RolloutGroup {
    let samples = p.done.into_iter().flatten().map(Sample::from).collect();
    RolloutGroup {
        schema: SchemaVersion::CURRENT,
        // Stable per prompt entry: a prompt generated twice (after a crash) yields the same
        // group id, and the trainer trains it once.
        group_id: format!("{}@{}", p.prompt.prompt_id, p.entry),
        prompt_id: p.prompt.prompt_id,
        task: p.prompt.task,
        prompt_tokens: p.tokens.into(),
        samples,
        sampling: p.params,
        gen_id: gen_id.to_string(),
        started_us: p.started_us,
        finished_us: schema::now_us(),
        meta: p.prompt.meta,
    }
}

/// The decode loop; runs on its own thread until `stop` is set and nothing is admitted.
fn decode_loop(
    policy: PolicySettings,
    cfg: GenConfig,
    slot: ModelSlot<InferBackend>,
    admit: mpsc::Receiver<Admit>,
    finished: tokio::sync::mpsc::UnboundedSender<Finished>,
    stop: Arc<AtomicBool>,
) -> DecodeStats {
    let mut stats = DecodeStats::default();
    let mut generator = Generator::<InferBackend>::new();
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let mut next_id = 0u64;
    let mut last_version = slot.load().version;
    let g = cfg.group_size;
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        // With nothing to decode, wait for a prompt *before* loading the model, so the first
        // prompt after a pause starts on the newest weights.
        let mut first = None;
        if generator.is_idle() && pending.is_empty() {
            let idle = Instant::now();
            first = admit.recv_timeout(IDLE_WAIT).ok();
            stats.idle_s += idle.elapsed().as_secs_f64();
            if first.is_none() {
                continue;
            }
        }
        let t0 = Instant::now();
        let current = slot.load_full();
        let stall = t0.elapsed().as_secs_f64();
        if current.version != last_version {
            stats.swaps += 1;
            stats.swap_stalls.push(stall);
            last_version = current.version;
            crate::metrics::swapped(current.version, stall);
        }
        // Admit while rows are free.
        while generator.active() + g <= cfg.max_batch {
            let Some(a) = first.take().or_else(|| admit.try_recv().ok()) else {
                break;
            };
            let params = SamplingParams {
                temperature: policy.temperature,
                top_k: cfg.top_k,
                top_p: cfg.top_p,
                max_new_tokens: cfg.max_new_tokens,
                stop_tokens: current.policy.config().eos_token_id.into_iter().collect(),
                seed: policy.seed ^ a.entry.ms.rotate_left(17) ^ a.entry.seq,
            };
            let id = next_id;
            next_id += 1;
            let req = Request {
                id,
                prompt: a.tokens.clone(),
                n: g,
                params: params.clone(),
            };
            pending.insert(
                id,
                Pending {
                    entry: a.entry,
                    prompt: a.prompt,
                    tokens: a.tokens,
                    params,
                    started_us: schema::now_us(),
                    done: vec![None; g],
                },
            );
            let prefill = Instant::now();
            generator.admit(&current.policy, current.version, &req);
            stats.busy_s += prefill.elapsed().as_secs_f64();
        }
        if generator.is_idle() {
            continue;
        }
        let busy = Instant::now();
        let done = generator.step(&current.policy, current.version);
        stats.busy_s += busy.elapsed().as_secs_f64();
        stats.steps += 1;
        for c in done {
            stats.tokens += c.tokens.len() as u64;
            let Some(p) = pending.get_mut(&c.request_id) else {
                continue;
            };
            let (rid, idx) = (c.request_id, c.index);
            p.done[idx] = Some(c);
            if p.done.iter().all(Option::is_some)
                && let Some(p) = pending.remove(&rid)
            {
                let entry = p.entry;
                let group = assemble(&cfg.name, p);
                if finished.send(Finished { entry, group }).is_err() {
                    return stats;
                }
            }
        }
    }
    stats
}

/// Work started but not trained, in groups, from the downstream streams' XINFO (see the
/// module doc for what is counted).
async fn downstream_backlog(bus: &dyn Bus, topo: &Topology) -> u64 {
    super::waiting(bus, topo, Stream::Rollouts, true).await
        + super::waiting(bus, topo, Stream::Scored, false).await
}

/// Runs the generator on the model in `slot` until `shutdown`; new versions arrive through
/// `transport` ([`Transport::Bus`] unless the trainer shares this process).
pub async fn run(
    policy: &PolicySettings,
    cfg: &GenConfig,
    bus: SharedBus,
    topo: &Topology,
    slot: ModelSlot<InferBackend>,
    transport: Transport,
    shutdown: impl Future<Output = ()>,
) -> Result<GenSummary, StageError> {
    // Text prompts are encoded with the model's own tokenizer: one that cannot be loaded
    // stops the generator (encoding with another would feed the model wrong ids).
    let tokenizer = match &policy.model {
        Some(dir) => Tokenizer::load(dir)?,
        None => Tokenizer::Char(tasks::char_tokenizer()),
    };
    let vocab = slot.load().policy.config().vocab_size;
    let model_config = slot.load().policy.config().clone();
    let stop = Arc::new(AtomicBool::new(false));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (admit_tx, admit_rx) = mpsc::channel::<Admit>();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Finished>();
    // Prompt entries acked by the publisher, so the reader's consumer stops holding them.
    let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel::<Vec<EntryId>>();
    let decode = {
        let (policy, cfg, slot, stop) = (policy.clone(), cfg.clone(), slot.clone(), stop.clone());
        std::thread::Builder::new()
            .name(format!("{}-decode", cfg.name))
            .spawn(move || decode_loop(policy, cfg, slot, admit_rx, done_tx, stop))
            .map_err(|e| StageError::Other(format!("cannot start the decode thread: {e}")))?
    };
    let follower = {
        let mut follower = Follower::new(bus.clone(), topo.clone(), model_config, slot.clone())
            .with_transport(transport);
        let stop = stop.clone();
        let block = Duration::from_millis(topo.block_ms);
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            while !stop.load(Ordering::Relaxed) {
                match follower.poll(block).await {
                    Ok(Some(v)) => tracing::info!(version = v, "new weights swapped in"),
                    Ok(None) => backoff = Duration::from_millis(100),
                    Err(e) => {
                        tracing::warn!(error = %e, "weights follower: retrying");
                        crate::metrics::error(Stage::Gen, "bus");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            follower.rejected
        })
    };
    let (max_lag, groups_per_step) = (policy.max_lag, policy.groups_per_step);
    let reader = {
        let (bus, topo, cfg, stop, in_flight) = (
            bus.clone(),
            topo.clone(),
            cfg.clone(),
            stop.clone(),
            in_flight.clone(),
        );
        tokio::spawn(async move {
            let opts = ConsumerOptions {
                batch: (cfg.max_batch / cfg.group_size).max(1),
                ..topo.consumer_options()
            };
            let mut consumer = Consumer::<Prompt>::join(
                bus.clone(),
                topo.key(Stream::Prompts),
                topo.group(Stream::Prompts),
                &cfg.name,
                topo.dead_key(),
                opts,
            )
            .await?;
            let bound = (max_lag.max(1) * groups_per_step as u64) as usize;
            let local_cap = (cfg.max_batch / cfg.group_size).max(1) * 2;
            let mut backlog = 0u64;
            let mut refreshed = Instant::now() - BACKLOG_REFRESH;
            let mut backoff = Duration::from_millis(100);
            while !stop.load(Ordering::Relaxed) {
                while let Ok(ids) = acked_rx.try_recv() {
                    consumer.release(&ids);
                }
                if refreshed.elapsed() >= BACKLOG_REFRESH {
                    backlog = downstream_backlog(bus.as_ref(), &topo).await;
                    refreshed = Instant::now();
                }
                let local = in_flight.load(Ordering::Relaxed);
                if local >= local_cap || backlog as usize + local >= bound {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                let batch: Vec<Delivery<Prompt>> = match consumer.poll().await {
                    Ok(b) => {
                        backoff = Duration::from_millis(100);
                        b
                    }
                    Err(e) if e.is_retryable() => {
                        tracing::warn!(error = %e, "reading prompts: retrying");
                        crate::metrics::error(Stage::Gen, "bus");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                    Err(e) => return Err(StageError::from(e)),
                };
                for d in batch {
                    let tokens = match &d.message.prompt_tokens {
                        Some(t) => t.0.clone(),
                        None => match tokenizer.encode(&d.message.text) {
                            Ok(t) => t,
                            Err(e) => {
                                crate::metrics::error(Stage::Gen, "tokenize");
                                consumer.reject(&d, "tokenize", &e.to_string()).await?;
                                continue;
                            }
                        },
                    };
                    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
                        let why = format!(
                            "prompt token {bad} is outside the model's vocabulary of {vocab}"
                        );
                        consumer.reject(&d, "vocabulary", &why).await?;
                        continue;
                    }
                    in_flight.fetch_add(1, Ordering::Relaxed);
                    backlog += 1;
                    let admit = Admit {
                        entry: d.id,
                        prompt: d.message,
                        tokens,
                    };
                    if admit_tx.send(admit).is_err() {
                        return Ok(());
                    }
                }
            }
            Ok::<(), StageError>(())
        })
    };

    let out_stream = topo.key(Stream::Rollouts);
    let prompts = topo.key(Stream::Prompts);
    let max_len = topo.max_len(Stream::Rollouts);
    let mut summary = GenSummary::default();
    tokio::pin!(shutdown);
    let mut stopping = false;
    let mut reader = reader;
    let mut reader_result: Option<Result<(), StageError>> = None;
    // The publishing loop; on any error the decode thread and the reader are still stopped
    // below, so nothing keeps running after the stage returns.
    let mut heartbeat = super::Heartbeat::new(bus.clone(), topo, Stage::Gen, &cfg.name);
    let mut tick = tokio::time::interval(super::HEARTBEAT_EVERY);
    crate::metrics::started(Stage::Gen);
    let _retention = crate::retention::spawn_standing(bus.clone(), topo, &["prompts"], Stage::Gen);
    crate::metrics::holds(Stage::Gen, slot.load().version);
    let outcome: Result<(), StageError> = async {
        loop {
            let first = tokio::select! {
                biased;
                _ = &mut shutdown, if !stopping => {
                    stopping = true;
                    stop.store(true, Ordering::Relaxed);
                    continue;
                }
                r = &mut reader, if reader_result.is_none() => {
                    // The reader only ends early on an error it cannot retry: stop too.
                    let r = r.unwrap_or_else(|e| Err(StageError::Other(format!("prompt reader: {e}"))));
                    reader_result = Some(r);
                    stop.store(true, Ordering::Relaxed);
                    continue;
                }
                _ = tick.tick() => {
                    let fields = [
                        ("groups", summary.groups as f64),
                        ("tokens", summary.tokens as f64),
                        ("in_flight", in_flight.load(Ordering::Relaxed) as f64),
                    ];
                    heartbeat.beat(slot.load().version, &fields).await;
                    continue;
                }
                f = done_rx.recv() => f,
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            while let Ok(f) = done_rx.try_recv() {
                batch.push(f);
            }
            let payloads = batch
                .iter()
                .map(|f| schema::encode(&f.group).map(Bytes::from))
                .collect::<Result<Vec<_>, _>>()?;
            let entries: Vec<EntryId> = batch.iter().map(|f| f.entry).collect();
            bus.publish(&out_stream, &payloads, max_len).await?;
            bus.ack(&prompts, topo.group(Stream::Prompts), &entries).await?;
            let _ = acked_tx.send(entries);
            in_flight.fetch_sub(batch.len(), Ordering::Relaxed);
            let tokens: u64 = batch
                .iter()
                .map(|f| f.group.completion_tokens() as u64)
                .sum();
            let samples: u64 = batch.iter().map(|f| f.group.samples.len() as u64).sum();
            crate::metrics::generated(samples, tokens);
            summary.groups += batch.len() as u64;
            summary.tokens += tokens;
        }
        Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    summary.decode = tokio::task::spawn_blocking(move || decode.join())
        .await
        .map_err(|e| StageError::Other(format!("decode thread: {e}")))?
        .map_err(|_| StageError::Other("the decode thread panicked".into()))?;
    outcome?;
    match reader_result {
        Some(Err(e)) => return Err(e),
        Some(Ok(())) => {}
        None => {
            reader.abort();
            // An aborted reader (the normal end) is fine; a reader that failed is the error.
            if let Ok(Err(e)) = reader.await {
                return Err(e);
            }
        }
    }
    summary.rejected = follower.await.unwrap_or(0);
    summary.final_version = slot.load().version;
    tracing::info!(
        groups = summary.groups,
        tokens = summary.tokens,
        swaps = summary.decode.swaps,
        "gen stopped"
    );
    Ok(summary)
}

//! `rlstream gen`: the generator. Reads prompts through the generators' consumer group, samples G
//! completions per prompt with continuous batching, and publishes one RolloutGroup per
//! prompt with per-token behaviour log-probs, version run-lengths and sampling masks.
//!
//! Three parts run at once:
//! - the **decode thread** ([`decode`]) owns the batch; before every forward pass it loads
//!   the current model from the [`ModelSlot`] (one atomic load, timed as the swap stall) and
//!   admits work from its row sources while rows are free: the endpoint's calls
//!   ([`serve`], `gen --serve`), the stream's plain prompts, and episodes (prompts whose meta
//!   names an environment); finished groups go on to be published;
//! - the **weights follower** task fetches, verifies and builds new versions and swaps them
//!   into the slot, so the decode loop never waits for weights and keeps its KV cache;
//! - the **reader** task polls prompts while the in-flight bound allows, and the main task
//!   publishes finished groups and acks their prompts.
//!
//! [`reader`] is the prompt reader and `writer.rs` the publisher; this module starts the
//! parts with their row sources, publishes, and stops them together.
//!
//! What the model cannot run never reaches it: the reader checks each prompt's ids against
//! the vocabulary and its length against the context (`--truncate-prompt left` cuts its
//! start instead), and dead-letters what fails. A completion ends at `max_new_tokens` or
//! where the context ends. A forward pass that panics anyway is contained to the prompts
//! that caused it (see [`crate::model::fault`]).
//!
//! In-flight bound: a prompt is admitted only while the work started but not yet trained
//! stays under `(max_lag − behind) × groups_per_step` groups, where `behind` is how many
//! versions the model being decoded with trails the newest announced one (a prompt started
//! on older weights is that much staler when trained): groups decoding here, plus the
//! rollouts not yet scored (pending and lag of the `score` group) and the scored groups not
//! yet delivered to the trainer (lag of the `train` group), from XINFO. Scored groups the
//! trainer has taken are not counted: it holds them unacked until its next checkpoint even
//! after training on them, and it takes at most `groups_per_step` it has not trained. The
//! trainer drops groups older than `max_lag` versions; this bound keeps it from having to.

mod config;
pub mod decode;
mod reader;
pub mod serve;
mod writer;

pub use config::*;
pub use decode::DecodeStats;
pub use writer::GenSummary;

use super::policy::PolicySettings;
use super::{Shutdown, StageContext, StageError};
use crate::bus::{Consumer, SharedBus, Topology};
use crate::env::Environments;
use crate::env::play::EpisodeLimits;
use crate::model::hf::load_hf;
use crate::model::sampler::TurnLimits;
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, Policy};
use crate::roles::{Stage, Stream};
use crate::schema::{Prompt, SamplingParams};
use crate::tasks;
use crate::weights::{Follower, ModelSlot, Transport, Versioned};
use decode::calls::{CallSender, CallSource};
use decode::episodes::{EpisodeRules, EpisodeSource};
use decode::group::{Decoded, GroupSampling, Groups, PromptSender};
use decode::kept::EpisodeCaches;
use decode::prompts::PromptSource;
use decode::{Decoder, Doorbell, RowSource};
use reader::Settled;
use reader::{PromptReader, Shared};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use writer::RolloutWriter;

/// The model slot of a generator started from `model_dir`, at version 0, with the PEFT
/// adapter in `adapter` merged in when there is one (adapter versions then still apply to
/// the pristine base).
pub fn initial_slot(
    model_dir: &std::path::Path,
    adapter: Option<&std::path::Path>,
) -> Result<ModelSlot<InferBackend>, StageError> {
    let base: Policy<InferBackend> = load_hf(model_dir, &Default::default())?;
    Ok(match adapter {
        None => ModelSlot::new(Versioned {
            version: 0,
            policy: base,
        }),
        Some(dir) => {
            let (spec, tensors) = crate::model::lora::read_adapter(dir)?;
            let policy = base.clone().with_adapter(&spec, &tensors)?.merged();
            tracing::info!(adapter = %dir.display(), rank = spec.rank, "starting from an adapter");
            ModelSlot::with_base(Versioned { version: 0, policy }, base)
        }
    })
}

/// The weights follower: fetches, verifies and builds new versions off the decode thread
/// and swaps them into the slot, until `stop`; retries the bus with backoff. Returns the
/// versions it rejected.
fn spawn_follower(
    bus: SharedBus,
    topo: &Topology,
    slot: ModelSlot<InferBackend>,
    transport: Transport,
    stop: Arc<AtomicBool>,
) -> (JoinHandle<u64>, Arc<AtomicU64>) {
    let model_config = slot.load().policy.config().clone();
    let mut follower =
        Follower::new(bus, topo.clone(), model_config, slot).with_transport(transport);
    let announced = follower.announced();
    let block = Duration::from_millis(topo.block_ms);
    let task = tokio::spawn(async move {
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
    });
    (task, announced)
}

/// The policy's own tokenizer. Text prompts are encoded with it: one that cannot be loaded
/// stops the generator (encoding with another would feed the model wrong ids).
fn policy_tokenizer(policy: &PolicySettings) -> Result<Tokenizer, StageError> {
    Ok(match &policy.model {
        Some(dir) => Tokenizer::load(dir)?,
        None => Tokenizer::Char(tasks::char_tokenizer()),
    })
}

/// The ids that end a completion: the model's end-of-sequence ids (its config and
/// generation config).
fn stop_tokens(policy: &PolicySettings, model: &crate::model::config::ModelConfig) -> Vec<u32> {
    match &policy.model {
        Some(dir) => crate::model::hf::stop_tokens(dir, model),
        None => model.eos_token_id.into_iter().collect(),
    }
}

/// Starts the OpenAI-compatible endpoint on `addr`, handing its calls to the decode thread
/// through `calls`.
async fn start_endpoint(
    policy: &PolicySettings,
    cfg: &GenConfig,
    (bus, topo): (SharedBus, &Topology),
    addr: &str,
    slot: &ModelSlot<InferBackend>,
    calls: CallSender,
) -> Result<JoinHandle<()>, StageError> {
    let addr = crate::metrics::parse_addr(addr)
        .map_err(|e| crate::settings::invalid("gen.serve", e.to_string()))?;
    let model = slot.load().policy.config().clone();
    let template = match &policy.model {
        Some(dir) => crate::model::chat::ChatTemplate::load(dir)?,
        None => None,
    };
    let model_id = policy
        .model
        .as_ref()
        .and_then(|d| d.file_name())
        .map_or_else(
            || "rlstream".to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
    let setup = serve::Setup {
        addr,
        key: serve::read_key(cfg.serve_key_file.as_deref())?,
        model_id,
        tokenizer: policy_tokenizer(policy)?,
        template,
        vocab: model.vocab_size,
        context: model.max_position,
        stop_tokens: stop_tokens(policy, &model),
        temperature: policy.temperature,
        mask_cap: cfg.mask_cap,
        max_batch: cfg.max_batch,
        max_requests: cfg.serve_max_requests,
        seed: policy.seed,
        episode_ttl: Duration::from_secs(cfg.serve_episode_ttl_s),
        group_size: cfg.group_size,
        group_timeout: Duration::from_secs(cfg.serve_group_timeout_s),
        bus,
        topo: topo.clone(),
        gen_id: cfg.name.clone(),
        limits: serve::listen::ClientLimits {
            max_body: cfg.serve_max_body_bytes,
            read_timeout: Duration::from_secs(cfg.serve_read_timeout_s),
            max_connections: cfg.serve_max_connections,
        },
    };
    let (bound, task) = serve::start(setup, calls).await?;
    eprintln!("serving the OpenAI-compatible endpoint on http://{bound}/v1");
    Ok(task)
}

/// The decode thread, and where its work comes from: the endpoint's calls and the
/// reader's prompts.
struct DecodeThread {
    handle: std::thread::JoinHandle<Result<DecodeStats, crate::model::ModelError>>,
    calls: CallSender,
    prompts: PromptSender,
}

impl DecodeThread {
    /// Waits for the thread to end; what it measured.
    async fn join(self) -> Result<DecodeStats, StageError> {
        let handle = self.handle;
        Ok(tokio::task::spawn_blocking(move || handle.join())
            .await
            .map_err(|e| StageError::Panic(format!("decode thread: {e}")))?
            .map_err(|_| StageError::Panic("the decode thread panicked".into()))??)
    }
}

/// Starts the prompt reader on `consumer`, handing prompts to the decode thread.
fn spawn_reader(
    (policy, cfg): (&PolicySettings, &GenConfig),
    consumer: Consumer<Prompt>,
    on: (SharedBus, &Topology),
    shared: Shared,
    (prompts, settled): (PromptSender, tokio::sync::mpsc::UnboundedReceiver<Settled>),
) -> Result<JoinHandle<Result<(), StageError>>, StageError> {
    let tokenizer = policy_tokenizer(policy)?;
    let model = shared.slot.load().policy.config().clone();
    let reader = PromptReader::new(policy, cfg, consumer, on, tokenizer, &model, shared);
    Ok(tokio::spawn(reader.run(prompts, settled)))
}

/// How episodes are played, from the stage's settings.
fn episode_rules(cfg: &GenConfig, context: usize, stop_tokens: Vec<u32>) -> EpisodeRules {
    EpisodeRules {
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
        stop_tokens,
    }
}

/// Starts the decode thread on the model in `slot` with its three row sources (calls
/// first, then plain prompts, then episodes); finished groups go to `out`.
fn spawn_decoder(
    policy: &PolicySettings,
    cfg: &GenConfig,
    slot: &ModelSlot<InferBackend>,
    out: tokio::sync::mpsc::UnboundedSender<Decoded>,
    stop: Arc<AtomicBool>,
) -> Result<DecodeThread, StageError> {
    let environments = match &cfg.env_cmd {
        Some(cmd) => Environments::external(cmd, Duration::from_millis(cfg.env_timeout_ms))
            .map_err(|e| crate::settings::invalid("gen.env_cmd", e.to_string()))?,
        None => Environments::builtin(),
    };
    let model = slot.load().policy.config().clone();
    let stops = stop_tokens(policy, &model);
    let tokenizer = Arc::new(policy_tokenizer(policy)?);
    let sampling = GroupSampling {
        params: SamplingParams {
            temperature: policy.temperature,
            top_k: cfg.sampling_top_k(),
            top_p: cfg.top_p,
            max_new_tokens: cfg.max_new_tokens,
            stop_tokens: stops.clone(),
            seed: policy.seed,
        },
        group_size: cfg.group_size,
    };
    let groups = || Groups::new(&cfg.name, sampling.clone(), out.clone());
    let bell = Doorbell::new();
    let (prompts, plain, played) = PromptSender::new(&bell);
    let idle = cfg.serve_episode_ttl_s.max(cfg.serve_group_timeout_s);
    let kept = EpisodeCaches::new(cfg.serve_episode_cache_mb << 20, Duration::from_secs(idle));
    let (calls, call_source) = CallSource::new(&bell, tokenizer.clone(), kept);
    let rules = episode_rules(cfg, model.max_position, stops);
    let episodes = EpisodeSource::new(played, groups(), (rules, environments), tokenizer, &bell);
    let sources: Vec<Box<dyn RowSource>> = vec![
        Box::new(call_source),
        Box::new(PromptSource::new(plain, groups())),
        Box::new(episodes),
    ];
    let decoder = Decoder::new(&cfg.name, cfg.max_batch, slot.clone(), sources, bell);
    let handle = decoder.spawn(stop).map_err(|source| StageError::Thread {
        what: "decode",
        source,
    })?;
    Ok(DecodeThread {
        handle,
        calls,
        prompts,
    })
}

/// What the generator stage does: its settings, the model it starts from, and how new
/// versions arrive ([`Transport::Bus`] unless the trainer shares this process).
pub struct GenJob<'a> {
    pub policy: &'a PolicySettings,
    pub cfg: &'a GenConfig,
    pub slot: ModelSlot<InferBackend>,
    pub transport: Transport,
}

/// Runs the generator until shutdown.
pub async fn run(job: GenJob<'_>, mut ctx: StageContext<'_>) -> Result<GenSummary, StageError> {
    let GenJob {
        policy,
        cfg,
        slot,
        transport,
    } = job;
    let (bus, topo) = (ctx.bus.clone(), ctx.topo);
    let stop = Arc::new(AtomicBool::new(false));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = tokio::sync::mpsc::unbounded_channel::<Decoded>();
    let (settled_tx, settled_rx) = tokio::sync::mpsc::unbounded_channel::<Settled>();
    let decode = spawn_decoder(policy, cfg, &slot, done_tx, stop.clone())?;
    let endpoint = match &cfg.serve {
        Some(addr) => {
            let on = (bus.clone(), topo);
            Some(start_endpoint(policy, cfg, on, addr, &slot, decode.calls.clone()).await?)
        }
        None => None,
    };
    let (follower, announced) =
        spawn_follower(bus.clone(), topo, slot.clone(), transport, stop.clone());
    let released = Arc::new(Notify::new());
    let shared = Shared {
        stop: stop.clone(),
        in_flight: in_flight.clone(),
        released: released.clone(),
        announced,
        slot: slot.clone(),
    };
    let consumer = ctx.consumer(Stream::Prompts, reader::consumer_options(cfg, topo));
    let reader = spawn_reader(
        (policy, cfg),
        consumer.await?,
        (bus.clone(), topo),
        shared,
        (decode.prompts.clone(), settled_rx),
    )?;
    let mut publisher = RolloutWriter {
        bus: bus.clone(),
        topo,
        settled: settled_tx,
        in_flight,
        released,
        summary: GenSummary::default(),
    };
    let retention = ctx.start(&[Stream::Prompts.as_str()]);
    crate::metrics::holds(Stage::Gen, slot.load().version);
    let mut heartbeat = ctx.heartbeat();
    let (outcome, reader_result) = publish_until_stopped(
        &mut publisher,
        &mut heartbeat,
        &slot,
        done_rx,
        reader,
        &stop,
        ctx.shutdown(),
    )
    .await;
    // Whatever ended the loop, the decode thread and the reader stop with it.
    stop.store(true, Ordering::Relaxed);
    let mut summary = publisher.summary;
    summary.decode = decode.join().await?;
    if let Some(task) = endpoint {
        task.abort();
    }
    outcome?;
    reader_result?;
    summary.rejected = follower.await.unwrap_or(0);
    summary.final_version = slot.load().version;
    if let Some(r) = retention {
        r.finish().await;
    }
    tracing::info!(
        groups = summary.groups,
        tokens = summary.tokens,
        swaps = summary.decode.swaps,
        "gen stopped"
    );
    Ok(summary)
}

/// The publishing loop, with heartbeats, until shutdown (then until the decode thread has
/// handed on what it finished) or a failure; the publisher's outcome and the reader's.
async fn publish_until_stopped(
    publisher: &mut RolloutWriter<'_>,
    heartbeat: &mut super::Heartbeat,
    slot: &ModelSlot<InferBackend>,
    mut done_rx: tokio::sync::mpsc::UnboundedReceiver<Decoded>,
    mut reader: JoinHandle<Result<(), StageError>>,
    stop: &AtomicBool,
    shutdown: &mut Shutdown<'_>,
) -> (Result<(), StageError>, Result<(), StageError>) {
    let mut tick = tokio::time::interval(super::HEARTBEAT_EVERY);
    let (mut stopping, mut reader_result) = (false, None);
    let outcome = loop {
        let first = tokio::select! {
            biased;
            _ = &mut *shutdown, if !stopping => {
                stopping = true;
                stop.store(true, Ordering::Relaxed);
                continue;
            }
            r = &mut reader, if reader_result.is_none() => {
                // The reader only ends early on an error it cannot retry: stop too.
                reader_result = Some(r.unwrap_or_else(|e| Err(StageError::Panic(format!("prompt reader: {e}")))));
                stop.store(true, Ordering::Relaxed);
                continue;
            }
            _ = tick.tick() => {
                let fields = [
                    ("groups", publisher.summary.groups as f64),
                    ("tokens", publisher.summary.tokens as f64),
                    ("in_flight", publisher.in_flight.load(Ordering::Relaxed) as f64),
                ];
                heartbeat.beat(slot.load().version, &fields).await;
                continue;
            }
            f = done_rx.recv() => f,
        };
        let Some(first) = first else { break Ok(()) };
        let mut batch = vec![first];
        while let Ok(f) = done_rx.try_recv() {
            batch.push(f);
        }
        if let Err(e) = publisher.publish(batch).await {
            break Err(e);
        }
    };
    let reader_result = match reader_result {
        Some(r) => r,
        None => {
            reader.abort();
            // An aborted reader (the normal end) is fine; a reader that failed is the error.
            match reader.await {
                Ok(Err(e)) => Err(e),
                _ => Ok(()),
            }
        }
    };
    (outcome, reader_result)
}

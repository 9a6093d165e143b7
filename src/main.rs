//! The `rlstream` command line: parse, build config, dispatch. No pipeline logic lives here.

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use rlstream::bus::{
    MemoryBus, RangeBound, RedisBus, RedisOptions, Resilient, SharedBus, TlsFiles, Topology,
};
use rlstream::commands::generate::{self, GenerateOptions};
use rlstream::commands::run::{self, RunOptions};
use rlstream::commands::sft::{self, SftOptions};
use rlstream::config::Config;
use rlstream::display::DisplayMode;
use rlstream::schema::{self, json::msgpack_to_json};
use rlstream::stages::score::AdvantageKind;
use rlstream::stages::train::LossKind;
use rlstream::stages::{feed, generate as gen_stage, score, train};
use rlstream::tasks::BuiltinTask;
use rlstream::weights::Transport;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "rlstream",
    version,
    about = "Asynchronous RL for language-model policies over Redis streams"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Flags every stage takes. Precedence: --config file, then RLSTREAM__* environment, then these.
#[derive(Args, Clone)]
struct Common {
    /// TOML config file (sections [feed], [gen], [score], [train]).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Redis URL [default: redis://127.0.0.1:6379; `run` uses its embedded bus unless given].
    #[arg(long)]
    redis: Option<String>,
    /// PEM CA certificate of a `rediss://` server [default: the system's trusted roots].
    #[arg(long, value_name = "FILE")]
    redis_tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a Redis with `tls-auth-clients yes` (with --redis-tls-key).
    #[arg(long, value_name = "FILE")]
    redis_tls_cert: Option<PathBuf>,
    /// PEM private key of --redis-tls-cert.
    #[arg(long, value_name = "FILE")]
    redis_tls_key: Option<PathBuf>,
    /// Key prefix of every stream [default: the topology's, `rl`].
    #[arg(long)]
    namespace: Option<String>,
    /// Stream topology file [default: the shipped streams/default.toml].
    #[arg(long)]
    topology: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics: a port (loopback, e.g. 9101) or
    /// HOST:PORT (e.g. 0.0.0.0:9101 for a Prometheus on another machine). Off unless given.
    #[arg(long)]
    metrics_addr: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// The whole pipeline in one process: warm start, then feed, gen, score and train on the
    /// embedded bus (or Redis with --redis), with a live display and a report.
    Run(RunArgs),
    /// Push prompts from a built-in task or a JSONL dataset to the prompts stream.
    Feed {
        #[command(flatten)]
        common: Common,
        #[arg(long, value_enum)]
        task: Option<BuiltinTask>,
        /// JSONL file: {"prompt": ..., "answer": ..., "verifier": exact|numeric|contains|positional}.
        #[arg(long)]
        dataset: Option<PathBuf>,
        /// Prompts to generate from a built-in task.
        #[arg(long)]
        count: Option<u64>,
        #[arg(long)]
        epochs: Option<u32>,
        #[arg(long)]
        shuffle: bool,
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Generator: sample G completions per prompt, follow new weights without stopping.
    Gen {
        #[command(flatten)]
        common: Common,
        /// Initial policy (Hugging Face model directory).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long)]
        group_size: Option<usize>,
        #[arg(long)]
        max_new_tokens: Option<u32>,
        #[arg(long)]
        temperature: Option<f32>,
        #[arg(long)]
        top_k: Option<u32>,
        #[arg(long)]
        top_p: Option<f32>,
        /// Most sequences decoded together.
        #[arg(long)]
        max_batch: Option<usize>,
        #[arg(long)]
        max_lag: Option<u64>,
        #[arg(long)]
        groups_per_step: Option<usize>,
        #[arg(long)]
        seed: Option<u64>,
        /// Consumer name, unique per generator.
        #[arg(long)]
        name: Option<String>,
    },
    /// Scorer: reward completions, compute group advantages.
    Score {
        #[command(flatten)]
        common: Common,
        #[arg(long, value_enum)]
        advantage: Option<AdvantageKind>,
        /// External scorer speaking JSON lines on stdin/stdout (see examples/verifier.py).
        #[arg(long)]
        scorer_cmd: Option<String>,
        /// Model directory whose tokenizer decodes completions.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        #[arg(long)]
        name: Option<String>,
    },
    /// Trainer: importance-weighted policy gradient, weight publication, checkpoints.
    Train(TrainArgs),
    /// Warm start: supervised training on a built-in task's answers; writes a HF checkpoint.
    Sft {
        #[arg(long, value_enum, default_value_t = BuiltinTask::Add)]
        task: BuiltinTask,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 300)]
        steps: u64,
        #[arg(long, default_value_t = 32)]
        batch: usize,
        #[arg(long, default_value_t = 3e-3)]
        lr: f64,
        #[arg(long, default_value_t = 64)]
        hidden: usize,
        #[arg(long, default_value_t = 2)]
        layers: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Sample from a Hugging Face checkpoint (Llama/Qwen2 family).
    Generate(GenerateArgs),
    /// A running pipeline at a glance, from Redis alone: each stream's length, pending and
    /// lag per group, consumers and their idle time, every process's version and
    /// throughput, the trainer's last step, the newest weights and dead letters.
    Status {
        #[command(flatten)]
        common: Common,
        /// Redraw every SECS seconds (default 2) until Ctrl-C.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
        /// Seconds of events that throughput and the process list cover.
        #[arg(long, default_value_t = 30.0)]
        window: f64,
        /// Print the snapshot as JSON (one object per refresh with --watch).
        #[arg(long)]
        json: bool,
    },
    /// Read any range of a stream, from Redis or an archive, as JSON lines, a table or
    /// text with per-token versions and log-probs; with --train, re-run training from a
    /// checkpoint over the recorded scored entries and compare each step with the run.
    Replay(ReplayArgs),
    /// Write stream ranges to an archive file (gzip; keeps entry ids and message bytes).
    Dump {
        #[command(flatten)]
        common: Common,
        /// Stream to archive (repeatable) [default: every stream of the topology].
        #[arg(long = "stream")]
        streams: Vec<String>,
        /// First entry: an id (MS-SEQ), epoch ms, a UTC time (2026-11-29T16:30:00Z) or a
        /// time ago (-10m) [default: the start].
        #[arg(long, allow_hyphen_values = true)]
        from: Option<String>,
        /// Last entry (inclusive), in the same forms [default: the end].
        #[arg(long, allow_hyphen_values = true)]
        to: Option<String>,
        /// The archive to write (refused if it exists).
        #[arg(long)]
        out: PathBuf,
    },
    /// Write an archive back into Redis under --namespace, keeping entry ids. Refuses
    /// streams that already hold newer entries.
    Load {
        #[command(flatten)]
        common: Common,
        /// The archive (written by `rlstream dump` or `rlstream trim --archive`).
        file: PathBuf,
        /// Load only this stream (repeatable) [default: all in the archive].
        #[arg(long = "stream")]
        streams: Vec<String>,
    },
    /// Remove old entries from a stream, never one a consumer group has not finished;
    /// with --archive, write them to a file first.
    Trim {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        stream: String,
        /// Keep the newest N entries.
        #[arg(
            long,
            conflicts_with = "older_than",
            required_unless_present = "older_than"
        )]
        keep_last: Option<u64>,
        /// Remove entries older than this (90s, 30m, 12h, 7d).
        #[arg(long)]
        older_than: Option<String>,
        /// Archive the removed entries here first (nothing is removed if that fails).
        #[arg(long)]
        archive: Option<PathBuf>,
    },
    /// Check a stream topology file and print the keys, groups and policy it resolves to.
    Streams {
        #[arg(long, env = "RLSTREAM_TOPOLOGY")]
        topology: Option<PathBuf>,
        #[arg(long)]
        namespace: Option<String>,
    },
    /// Decode and validate a MessagePack message file, print it as JSON (bin as base64).
    Inspect {
        #[arg(long, value_enum)]
        kind: Kind,
        file: PathBuf,
    },
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    common: Common,
    /// Initial policy (Hugging Face model directory); also the KL reference.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum)]
    loss: Option<LossKind>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    groups_per_step: Option<usize>,
    #[arg(long)]
    max_lag: Option<u64>,
    #[arg(long)]
    publish_every: Option<u64>,
    #[arg(long)]
    keep_versions: Option<usize>,
    #[arg(long)]
    checkpoint_every: Option<u64>,
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Stop after this many steps (0: until stopped).
    #[arg(long)]
    steps: Option<u64>,
    #[arg(long)]
    kl_coef: Option<f32>,
    #[arg(long)]
    clip_eps: Option<f32>,
    #[arg(long)]
    clip_eps_high: Option<f32>,
    #[arg(long)]
    is_cap: Option<f32>,
    #[arg(long)]
    max_grad_norm: Option<f32>,
    /// Sampling temperature of the generators.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    name: Option<String>,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, value_enum, default_value_t = BuiltinTask::Sort)]
    task: BuiltinTask,
    /// RL steps [default: 200].
    #[arg(long)]
    steps: Option<u64>,
    /// The synchronous baseline: generate a batch, score it, train on it, publish, repeat.
    #[arg(long)]
    sync: bool,
    /// Start from this model (written by `rlstream sft` or an earlier run) instead of a
    /// warm start.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Run directory for the warm-start model, checkpoints and report
    /// [default: runs/TASK-UNIXTIME].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where the learning curve and per-step metrics go [default: OUT/report].
    #[arg(long)]
    report: Option<PathBuf>,
    /// Warm-start (supervised) steps: enough to learn the answer format, little enough to
    /// leave RL something to learn.
    #[arg(long, default_value_t = 100)]
    sft_steps: u64,
    /// Width of the warm-start model.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Trainer learning rate [default: 5e-4].
    #[arg(long)]
    lr: Option<f64>,
    /// Completions per prompt [default: 8].
    #[arg(long)]
    group_size: Option<usize>,
    /// Groups per optimizer step [default: 8].
    #[arg(long)]
    groups_per_step: Option<usize>,
    /// Groups more than this many versions old are dropped; the generator runs at most this
    /// many steps ahead [default: 4].
    #[arg(long)]
    max_lag: Option<u64>,
    /// Most sequences decoded together [default: 64].
    #[arg(long)]
    max_batch: Option<usize>,
    /// Most tokens per completion [default: the task's longest answer + 2].
    #[arg(long)]
    max_new_tokens: Option<u32>,
    /// Sampling temperature [default: 1].
    #[arg(long)]
    temperature: Option<f32>,
    /// Objective [default: ppo].
    #[arg(long, value_enum)]
    loss: Option<LossKind>,
    /// Progress as log lines even on a terminal.
    #[arg(long)]
    plain: bool,
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    common: Common,
    /// Read this archive instead of Redis.
    #[arg(long)]
    archive: Option<PathBuf>,
    /// prompts | rollouts | scored | weights | dead | events.
    #[arg(long, default_value = "scored")]
    stream: String,
    /// First entry: an id (MS-SEQ), epoch ms, a UTC time (2026-11-29T16:30:00Z) or a time
    /// ago (-10m) [default: the start].
    #[arg(long, allow_hyphen_values = true)]
    from: Option<String>,
    /// Last entry (inclusive), in the same forms [default: the end].
    #[arg(long, allow_hyphen_values = true)]
    to: Option<String>,
    /// Print at most N entries.
    #[arg(long)]
    count: Option<usize>,
    /// Only groups (and their prompts and dead letters) whose id contains this.
    #[arg(long)]
    group_id: Option<String>,
    /// Only rollouts/scored groups at least this many versions behind the newest weights
    /// announced when they were written.
    #[arg(long)]
    min_staleness: Option<u64>,
    /// Only scored groups whose mean reward passes this test: <0.5, <=0.2, >0.9, =1.
    #[arg(long, allow_hyphen_values = true)]
    reward: Option<rlstream::commands::replay::RewardFilter>,
    /// json (one object per line), table, or text (detokenised, per-token version and
    /// log-prob).
    #[arg(long, value_enum, default_value_t = rlstream::commands::replay::Format::Json)]
    format: rlstream::commands::replay::Format,
    /// Model directory whose tokenizer decodes `text` [default: the built-in characters].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Re-run training from --checkpoint over the scored entries in the range and compare
    /// each step's loss, grad norm and reward with the recorded run.
    #[arg(long, requires = "checkpoint")]
    train: bool,
    /// A trainer checkpoint directory (step-*) to start the re-run from.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// With --train: stop after this many steps.
    #[arg(long)]
    steps: Option<u64>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Model directory: config.json, model.safetensors (or a sharded index), tokenizer.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (encoded with the model's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: u32,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Keep the smallest set of tokens with this much probability; 1 disables.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Completions to sample.
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Print token ids and log-probs as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Prompt,
    RolloutGroup,
    ScoredGroup,
    WeightsAnnounce,
    DeadLetter,
    Event,
}

/// Sets `$target` from `$flag` when the flag was given.
macro_rules! apply {
    ($($target:expr => $flag:expr),* $(,)?) => {
        $( if let Some(v) = $flag { $target = v.into(); } )*
    };
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // `run` shows its own progress, and `replay` prints entries and steps on stdout: stage
    // logs below warnings would flood them.
    let default_filter = match cli.command {
        Command::Run(_) | Command::Replay(_) => "warn",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(dispatch(cli.command))
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("stopping: finishing the work in hand");
}

/// The config over `base` (then file, environment, common flags), the metrics listener if
/// asked for, and the topology (before any namespace is applied).
fn load_common(common: &Common, base: &Config) -> Result<(Config, Topology)> {
    let mut cfg = Config::load_over(base, common.config.as_deref())?;
    apply!(cfg.redis => common.redis.clone().map(Some::<String>),
           cfg.redis_tls_ca => common.redis_tls_ca.clone().map(Some::<PathBuf>),
           cfg.redis_tls_cert => common.redis_tls_cert.clone().map(Some::<PathBuf>),
           cfg.redis_tls_key => common.redis_tls_key.clone().map(Some::<PathBuf>),
           cfg.namespace => common.namespace.clone().map(Some::<String>),
           cfg.topology => common.topology.clone().map(Some::<PathBuf>),
           cfg.metrics_addr => common.metrics_addr.clone().map(Some::<String>));
    if let Some(addr) = &cfg.metrics_addr {
        let served = rlstream::metrics::install(addr)?;
        tracing::info!("serving metrics at http://{served}/metrics");
    }
    let topo = match &cfg.topology {
        Some(p) => Topology::load(p)?,
        None => Topology::default(),
    };
    Ok((cfg, topo))
}

/// Redis, with retries through outages for `redis_patience_s` (see [`Resilient`]). A
/// Redis that cannot be reached at start is an error at once.
async fn connect_redis(url: &str, cfg: &Config) -> Result<SharedBus> {
    let patience = std::time::Duration::from_secs(cfg.redis_patience_s.unwrap_or(300));
    let opts = RedisOptions {
        tls: TlsFiles {
            ca: cfg.redis_tls_ca.clone(),
            cert: cfg.redis_tls_cert.clone(),
            key: cfg.redis_tls_key.clone(),
        },
        ..RedisOptions::default()
    };
    let redis: SharedBus = Arc::new(RedisBus::connect_with(url, opts).await?);
    Ok(Arc::new(Resilient::new(redis, patience)))
}

/// Loads the config (file, environment, common flags), the topology and the bus; with
/// metrics on, `stage` also exports the streams' length, pending and lag.
async fn setup(common: &Common, stage: &'static str) -> Result<(Config, Topology, SharedBus)> {
    let (cfg, mut topo) = load_common(common, &Config::default())?;
    if let Some(ns) = &cfg.namespace {
        topo = topo.with_namespace(ns)?;
    }
    let url = cfg
        .redis
        .clone()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let bus = connect_redis(&url, &cfg).await?;
    if cfg.metrics_addr.is_some() {
        rlstream::metrics::watch_streams(bus.clone(), topo.clone(), stage);
    }
    Ok((cfg, topo, bus))
}

async fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Run(a) => run_command(a).await?,
        Command::Feed {
            common,
            task,
            dataset,
            count,
            epochs,
            shuffle,
            seed,
        } => {
            let (mut cfg, topo, bus) = setup(&common, "feed").await?;
            apply!(cfg.feed.task => task.map(Some), cfg.feed.dataset => dataset.map(Some),
                   cfg.feed.count => count, cfg.feed.epochs => epochs, cfg.feed.seed => seed);
            cfg.feed.shuffle |= shuffle;
            let s = feed::run(&cfg.feed, bus, &topo, shutdown_signal()).await?;
            println!("fed {} prompts to {}", s.fed, topo.key("prompts"));
        }
        Command::Gen {
            common,
            model,
            group_size,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            max_batch,
            max_lag,
            groups_per_step,
            seed,
            name,
        } => {
            let (mut cfg, topo, bus) = setup(&common, "gen").await?;
            let g = &mut cfg.generator;
            apply!(g.model => model.map(Some), g.group_size => group_size, g.max_new_tokens => max_new_tokens,
                   g.temperature => temperature, g.top_k => top_k, g.top_p => top_p, g.max_batch => max_batch,
                   g.max_lag => max_lag, g.groups_per_step => groups_per_step, g.seed => seed, g.name => name);
            cfg.validate()?;
            let Some(dir) = cfg.generator.model.clone() else {
                bail!(
                    "gen needs --model DIR (a Hugging Face checkpoint, e.g. from `rlstream sft`)"
                );
            };
            let slot = gen_stage::initial_slot(&dir)?;
            let s = gen_stage::run(
                &cfg.generator,
                bus,
                &topo,
                slot,
                Transport::Bus,
                shutdown_signal(),
            )
            .await?;
            println!(
                "generated {} groups, {} tokens; {} weight swaps, final version {}",
                s.groups, s.tokens, s.decode.swaps, s.final_version
            );
        }
        Command::Score {
            common,
            advantage,
            scorer_cmd,
            tokenizer,
            name,
        } => {
            let (mut cfg, topo, bus) = setup(&common, "score").await?;
            let c = &mut cfg.score;
            apply!(c.advantage => advantage, c.scorer_cmd => scorer_cmd.map(Some),
                   c.tokenizer => tokenizer.map(Some), c.name => name);
            cfg.validate()?;
            let s = score::run(&cfg.score, bus, &topo, shutdown_signal()).await?;
            let mean = if s.samples > 0 {
                s.reward_sum / s.samples as f64
            } else {
                0.0
            };
            println!(
                "scored {} groups (reward mean {mean:.3}), {} failed",
                s.scored, s.failed
            );
        }
        Command::Train(a) => {
            let (mut cfg, topo, bus) = setup(&a.common, "train").await?;
            let t = &mut cfg.train;
            apply!(t.model => a.model.map(Some), t.loss => a.loss, t.lr => a.lr, t.groups_per_step => a.groups_per_step,
                   t.max_lag => a.max_lag, t.publish_every => a.publish_every, t.keep_versions => a.keep_versions,
                   t.checkpoint_every => a.checkpoint_every, t.checkpoint_dir => a.checkpoint_dir, t.steps => a.steps,
                   t.kl_coef => a.kl_coef, t.clip_eps => a.clip_eps, t.clip_eps_high => a.clip_eps_high,
                   t.is_cap => a.is_cap, t.max_grad_norm => a.max_grad_norm, t.temperature => a.temperature,
                   t.name => a.name);
            cfg.validate()?;
            let s = train::run(
                &cfg.train,
                bus,
                &topo,
                Transport::Bus,
                shutdown_signal(),
                |_| {},
            )
            .await?;
            let first = s.history.first().map_or(0.0, |h| h.reward_mean);
            let last = s.history.last().map_or(0.0, |h| h.reward_mean);
            println!(
                "trained {} steps to version {} on {} groups; reward {first:.3} -> {last:.3}; dropped {:?}",
                s.steps, s.version, s.trained_groups, s.dropped
            );
        }
        Command::Status {
            common,
            watch,
            window,
            json,
        } => status_command(&common, watch, window, json).await?,
        Command::Replay(a) => replay_command(a).await?,
        Command::Dump {
            common,
            streams,
            from,
            to,
            out,
        } => {
            if out.exists() {
                bail!("{} exists: dump never overwrites an archive", out.display());
            }
            let (_, topo, bus) = setup(&common, "dump").await?;
            let streams = if streams.is_empty() {
                topo.streams.keys().cloned().collect()
            } else {
                streams
            };
            for s in &streams {
                if !topo.streams.contains_key(s) {
                    bail!(
                        "--stream {s} is not in the topology ({})",
                        topo.streams.keys().cloned().collect::<Vec<_>>().join(", ")
                    );
                }
            }
            let from = point_bound(from.as_deref())?;
            let to = point_bound(to.as_deref())?;
            let bar = counter_bar("dumping");
            let moved =
                rlstream::archive::dump(bus.as_ref(), &topo, &streams, from, to, &out, |s, n| {
                    bar.set_message(s.to_string());
                    bar.set_position(n);
                })
                .await?;
            bar.finish_and_clear();
            println!("{}", moved_line("dumped", &moved, &out));
        }
        Command::Load {
            common,
            file,
            streams,
        } => {
            let (_, topo, bus) = setup(&common, "load").await?;
            let only = (!streams.is_empty()).then_some(streams.as_slice());
            let bar = counter_bar("loading");
            let moved = rlstream::archive::load(bus.as_ref(), &topo, &file, only, |s, n| {
                bar.set_message(s.to_string());
                bar.set_position(n);
            })
            .await?;
            bar.finish_and_clear();
            println!(
                "{} into namespace {}",
                moved_line("loaded", &moved, &file),
                topo.namespace
            );
        }
        Command::Trim {
            common,
            stream,
            keep_last,
            older_than,
            archive,
        } => {
            use rlstream::retention::{self, Keep};
            let keep = match (keep_last, older_than) {
                (Some(0), _) => bail!("--keep-last 0 would remove everything; use a positive N"),
                (Some(n), _) => Keep::Last(n),
                (None, Some(d)) => Keep::Newer(parse_duration(&d)?),
                (None, None) => bail!("trim needs --keep-last N or --older-than DURATION"),
            };
            if let Some(a) = &archive
                && a.exists()
            {
                bail!("{} exists: trim never overwrites an archive", a.display());
            }
            let (_, topo, bus) = setup(&common, "trim").await?;
            if !topo.streams.contains_key(&stream) {
                bail!("--stream {stream} is not in the topology");
            }
            let r = retention::trim(bus.as_ref(), &topo, &stream, keep, archive.as_deref()).await?;
            let mut line = format!("removed {} entries from {}", r.removed, r.stream);
            if let Some(cut) = &r.cut {
                line += &format!(" (below {cut})");
            }
            if let Some(a) = &archive {
                line += &format!("; archived {} to {}", r.archived, a.display());
            }
            if let Some((group, id)) = &r.held_back_by {
                line += &format!("; stopped at {id}, which group `{group}` has not finished");
            }
            println!("{line}");
        }
        Command::Sft {
            task,
            out,
            steps,
            batch,
            lr,
            hidden,
            layers,
            seed,
        } => {
            let opts = SftOptions {
                task,
                out,
                steps,
                batch,
                lr,
                seed,
                hidden,
                layers,
                ..SftOptions::default()
            };
            let every = (steps / 10).max(1);
            let s = tokio::task::block_in_place(|| {
                sft::run(&opts, |step, loss| {
                    if step % every == 0 || step == steps {
                        tracing::info!(step, loss = format!("{loss:.4}"), "sft");
                    }
                })
            })?;
            println!(
                "sft {}: {} params, {} steps in {:.1} s, loss {:.4}; held-out greedy accuracy {:.1}%, reward {:.3}; wrote {}",
                task.name(),
                s.params,
                s.steps,
                s.seconds,
                s.final_loss,
                100.0 * s.accuracy,
                s.reward,
                opts.out.display()
            );
        }
        Command::Generate(a) => {
            let opts = GenerateOptions {
                model: a.model,
                prompt: a.prompt,
                prompt_ids: a.prompt_ids,
                max_new_tokens: a.max_new_tokens,
                temperature: a.temperature,
                top_k: a.top_k,
                top_p: a.top_p,
                seed: a.seed,
                n: a.n,
                json: a.json,
            };
            tokio::task::block_in_place(|| generate::run(&opts, &mut std::io::stdout().lock()))?;
        }
        Command::Streams {
            topology,
            namespace,
        } => streams(topology, namespace)?,
        Command::Inspect { kind, file } => inspect(kind, file)?,
    }
    Ok(())
}

async fn run_command(a: RunArgs) -> Result<()> {
    let (mut cfg, mut topo) = load_common(&a.common, &run::defaults(a.task))?;
    apply!(cfg.train.steps => a.steps, cfg.train.lr => a.lr, cfg.train.groups_per_step => a.groups_per_step,
           cfg.train.max_lag => a.max_lag, cfg.train.loss => a.loss,
           cfg.generator.group_size => a.group_size, cfg.generator.max_batch => a.max_batch,
           cfg.generator.max_new_tokens => a.max_new_tokens, cfg.generator.temperature => a.temperature);
    let bus: SharedBus = match &cfg.redis {
        Some(url) => {
            // A fresh namespace per run unless one is given: a run never mixes with
            // another's streams.
            let ns = cfg.namespace.clone().unwrap_or_else(|| {
                format!(
                    "run-{}",
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis())
                )
            });
            topo = topo.with_namespace(&ns)?;
            eprintln!("using Redis at {url}, namespace {ns}");
            connect_redis(url, &cfg).await?
        }
        None => {
            if let Some(ns) = &cfg.namespace {
                topo = topo.with_namespace(ns)?;
            }
            Arc::new(MemoryBus::new())
        }
    };
    if cfg.metrics_addr.is_some() {
        rlstream::metrics::watch_streams(bus.clone(), topo.clone(), "run");
    }
    let out = a.out.clone().unwrap_or_else(|| run::default_out(a.task));
    let opts = RunOptions {
        task: a.task,
        model: a.model,
        sft: SftOptions {
            task: a.task,
            out: out.join("sft"),
            steps: a.sft_steps,
            hidden: a.hidden,
            layers: a.layers,
            seed: a.seed,
            ..SftOptions::default()
        },
        out,
        report: a.report,
        sync: a.sync,
        seed: a.seed,
        display: if a.plain {
            DisplayMode::Log {
                every: std::time::Duration::from_secs(5),
            }
        } else {
            DisplayMode::auto()
        },
    };
    eprintln!("run directory {}", opts.out.display());
    let outcome = run::run(&opts, cfg, bus, topo, shutdown_signal()).await?;
    println!("{}", outcome.summary.paragraph());
    println!(
        "learning curve: {}\nper-step metrics: {} and {}\nsummary: {}",
        outcome.report.svg.display(),
        outcome.report.jsonl.display(),
        outcome.report.csv.display(),
        outcome.report.summary.display()
    );
    Ok(())
}

fn streams(path: Option<PathBuf>, namespace: Option<String>) -> Result<()> {
    let mut topo = match &path {
        Some(p) => Topology::load(p)?,
        None => Topology::default(),
    };
    if let Some(ns) = namespace {
        topo = topo.with_namespace(&ns)?;
    }
    println!(
        "namespace {}: claim_idle {} ms, max_deliveries {}, max_message_bytes {}, dead letters to {}",
        topo.namespace,
        topo.claim_idle_ms,
        topo.max_deliveries,
        topo.max_message_bytes,
        topo.dead_key()
    );
    for (name, spec) in &topo.streams {
        let retention = spec
            .max_len
            .map_or("unbounded".to_string(), |n| format!("~{n} entries"));
        println!(
            "  {:<16} groups [{}], {retention}  {}",
            topo.key(name),
            spec.groups.join(", "),
            spec.description
        );
    }
    Ok(())
}

fn inspect(kind: Kind, file: PathBuf) -> Result<()> {
    let bytes = std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
    let checked = match kind {
        Kind::Prompt => schema::decode::<schema::Prompt>(&bytes).map(drop),
        Kind::RolloutGroup => schema::decode::<schema::RolloutGroup>(&bytes).map(drop),
        Kind::ScoredGroup => schema::decode::<schema::ScoredGroup>(&bytes).map(drop),
        Kind::WeightsAnnounce => schema::decode::<schema::WeightsAnnounce>(&bytes).map(drop),
        Kind::DeadLetter => schema::decode::<schema::DeadLetter>(&bytes).map(drop),
        Kind::Event => schema::decode::<schema::Event>(&bytes).map(drop),
    };
    checked.with_context(|| format!("{} is not a valid message", file.display()))?;
    let json = msgpack_to_json(&bytes).map_err(anyhow::Error::msg)?;
    println!("{}", serde_json::to_string_pretty(&json)?);
    Ok(())
}

async fn status_command(
    common: &Common,
    watch: Option<f64>,
    window: f64,
    json: bool,
) -> Result<()> {
    use rlstream::commands::status;
    use std::io::IsTerminal;
    if !(window.is_finite() && window > 0.0) {
        bail!("--window must be a positive number of seconds, got {window}");
    }
    if let Some(every) = watch
        && !(every.is_finite() && every >= 0.1)
    {
        bail!("--watch takes a refresh interval of at least 0.1 s, got {every}");
    }
    let (cfg, topo, bus) = setup(common, "status").await?;
    let name = rlstream::bus::redact_url(cfg.redis.as_deref().unwrap_or("redis://127.0.0.1:6379"));
    let window = std::time::Duration::from_secs_f64(window);
    let clear = watch.is_some() && !json && std::io::stdout().is_terminal();
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        let snapshot = status::collect(bus.as_ref(), &topo, &name, window).await?;
        if json {
            println!("{}", serde_json::to_string(&snapshot)?);
        } else {
            if clear {
                // Clear the screen and home the cursor: a live view, not a scroll.
                print!("\x1b[2J\x1b[H");
            }
            print!("{}", status::render(&snapshot));
            if watch.is_some() && !clear {
                println!();
            }
        }
        let Some(every) = watch else { break };
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(std::time::Duration::from_secs_f64(every)) => {}
        }
    }
    Ok(())
}

/// A spinner with a running count on a terminal (hidden otherwise).
fn counter_bar(verb: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new_spinner();
    if let Ok(style) = indicatif::ProgressStyle::with_template(&format!(
        "{{spinner}} {verb} {{msg}}: {{pos}} entries"
    )) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

fn moved_line(verb: &str, m: &rlstream::archive::Moved, path: &std::path::Path) -> String {
    let per: Vec<String> = m.streams.iter().map(|(s, n)| format!("{s} {n}")).collect();
    format!(
        "{verb} {} entries ({}) {} {}",
        m.entries,
        per.join(", "),
        if verb == "dumped" { "to" } else { "from" },
        path.display()
    )
}

/// `--older-than`: `90s`, `30m`, `12h`, `7d`, positive.
fn parse_duration(s: &str) -> Result<std::time::Duration> {
    match rlstream::commands::replay::parse_duration(s) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => bail!("`{s}` is not a positive duration like 90s, 30m, 12h or 7d"),
    }
}

async fn replay_command(a: ReplayArgs) -> Result<()> {
    use rlstream::commands::replay::{self, ReadOptions, RetrainOptions, Source};
    let source = match &a.archive {
        Some(path) => Source::Archive(path.clone()),
        None => {
            let (_, topo, bus) = setup(&a.common, "replay").await?;
            Source::Bus { bus, topo }
        }
    };
    let from = point_bound(a.from.as_deref())?;
    let to = point_bound(a.to.as_deref())?;
    if a.train {
        let Some(checkpoint) = a.checkpoint.clone() else {
            bail!("--train needs --checkpoint DIR (a step-* directory the trainer wrote)");
        };
        let scratch = tempfile_dir()?;
        let opts = RetrainOptions {
            checkpoint,
            from,
            to,
            steps: a.steps,
            scratch: scratch.clone(),
        };
        println!(
            "{:>6} {:>12} {:>12} {:>8} {:>7}  recorded run",
            "step", "loss", "grad_norm", "reward", "groups"
        );
        let result = replay::retrain(&source, &opts, |s| {
            let rec = match (s.recorded, s.identical) {
                (Some(_), Some(true)) => "identical".to_string(),
                (Some((l, g, r)), _) => {
                    format!("DIFFERS: loss {l:.6} grad_norm {g:.6} reward {r:.4}")
                }
                (None, _) => "not recorded".to_string(),
            };
            println!(
                "{:>6} {:>12.6} {:>12.6} {:>8.4} {:>7}  {rec}",
                s.step, s.loss, s.grad_norm, s.reward_mean, s.groups
            );
        })
        .await;
        let _ = std::fs::remove_dir_all(&scratch);
        let s = result?;
        let mut line = format!(
            "re-ran {} steps from checkpoint step {}; {} of {} recorded steps bit-identical",
            s.steps.len(),
            s.start_step,
            s.identical,
            s.compared
        );
        if let Some(d) = s.first_divergence {
            line += &format!("; first divergence at step {d}");
        }
        if !s.dropped.is_empty() {
            line += &format!("; dropped {:?}", s.dropped);
        }
        println!("{line}");
        return Ok(());
    }
    let tokenizer = match &a.tokenizer {
        Some(dir) => Some(rlstream::model::tokenizer::Tokenizer::load(dir)?),
        None => None,
    };
    let opts = ReadOptions {
        stream: a.stream,
        from,
        to,
        count: a.count,
        group_id: a.group_id,
        min_staleness: a.min_staleness,
        reward: a.reward,
        format: a.format,
        tokenizer,
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    replay::read(&source, &opts, &mut out).await?;
    use std::io::Write as _;
    let _ = out.flush();
    Ok(())
}

/// A fresh scratch directory under the system temp dir (removed by the caller).
fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "rlstream-replay-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

/// `--from` / `--to`: an inclusive bound at an id or time (see `replay::parse_point`), or
/// open when not given.
fn point_bound(point: Option<&str>) -> Result<RangeBound> {
    Ok(point
        .map(rlstream::commands::replay::parse_point)
        .transpose()?
        .map_or(RangeBound::Open, RangeBound::Inclusive))
}

//! `rlstream run`: the whole pipeline in one process.
//!
//! Warm start (or `--model`), then feed, gen, score and train run as tasks of one runtime
//! over one bus: the embedded [`MemoryBus`](crate::bus::MemoryBus) unless `--redis` is given.
//! The stages are the same `stages::*::run` functions the separate processes call; only the
//! weight handoff differs ([`Transport::InProcess`]: host tensors by reference, announced on
//! the weights stream like any other version).
//!
//! Two schedules:
//! - **async** (default): the feeder keeps a few steps of prompts queued, the generator
//!   decodes continuously under its in-flight bound and swaps weights between forward
//!   passes, the trainer trains on whatever is scored.
//! - **sync** (`--sync`): the baseline with no overlap. The feeder releases one step's
//!   prompts, waits until the trainer has stepped on them and the generator holds the new
//!   version, then releases the next. The generator waits for the trainer and the trainer
//!   for the generator; every batch waits for its longest completion.

use crate::bus::{SharedBus, Topology};
use crate::commands::eval::{self, Estimate, EvalResult, EvalSampling, EvalSet};
use crate::commands::sft::{self, SftOptions};
use crate::config::Config;
use crate::display::{DisplayMode, Phase};
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, Policy};
use crate::report::{self, ReportFiles, RunProgress, StepRow};
use crate::roles::{Stage, Stream};
use crate::schema::StepRecord;
use crate::stages::generate::{self as gen_stage, GenSummary};
use crate::stages::train::{self, TrainSummary};
use crate::stages::{StageError, feed, score, waiting};
use crate::tasks::{self, BuiltinTask};
use crate::weights::{LocalWeights, ModelSlot, Transport};
use serde::Serialize;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// Salt of the RL prompt stream, so RL prompts differ from the warm start's.
const RL_PROMPT_SALT: u64 = 0x0005_eed0_fa11;
/// How often the async feeder checks the prompt backlog.
const FEED_POLL: Duration = Duration::from_millis(10);
/// Most entries read to count a queue whose lag Redis cannot report (see
/// [`waiting`]); the report's queue columns stop there.
const QUEUE_SCAN_CAP: u64 = 1000;

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub task: BuiltinTask,
    /// Start from this Hugging Face model (with the rlstream character tokenizer) instead
    /// of a warm start.
    pub model: Option<PathBuf>,
    /// Warm start when no model is given.
    pub sft: SftOptions,
    /// Run directory: warm-start model, checkpoints, report.
    pub out: PathBuf,
    /// Report directory (default `OUT/report`).
    pub report: Option<PathBuf>,
    pub sync: bool,
    pub seed: u64,
    pub display: DisplayMode,
}

/// What a run did, as printed at the end and saved as `summary.json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunSummary {
    /// `async` or `sync`.
    pub mode: String,
    pub task: String,
    /// `memory` or `redis`.
    pub bus: String,
    pub model_params: usize,
    pub warm_start_s: f64,
    pub steps: u64,
    /// Seconds of the RL phase (stages started to trainer done).
    pub wall_s: f64,
    pub trained_groups: u64,
    pub trained_tokens: u64,
    pub trained_tokens_per_s: f64,
    pub generated_groups: u64,
    pub generated_tokens: u64,
    /// Mean over the first and the last tenth of the steps (at most 10 steps each).
    pub reward_start: f64,
    pub reward_end: f64,
    pub accuracy_start: f64,
    pub accuracy_end: f64,
    /// `rlstream eval` of the policy before RL, at the checkpoint nearest halfway and after
    /// (empty with `run.eval_prompts = 0`).
    pub held_out: Vec<HeldOut>,
    /// Held-out pass@1 after RL minus before, with its standard error.
    pub pass_at_1_gain: Option<Estimate>,
    /// Generator time waiting for prompts with nothing to decode, over the RL phase.
    pub gen_idle_fraction: f64,
    pub gen_busy_s: f64,
    pub gen_idle_s: f64,
    /// Sum of optimizer step times, and of the trainer's waits for data.
    pub train_busy_s: f64,
    pub train_wait_s: f64,
    pub swaps: u64,
    pub swap_stall_p50_s: f64,
    pub swap_stall_p99_s: f64,
    pub swap_stall_max_s: f64,
    /// Trained groups by staleness (versions behind the trainer).
    pub staleness: BTreeMap<u64, u64>,
    pub dropped: BTreeMap<String, u64>,
    pub config: Config,
}

impl RunSummary {
    /// The one-paragraph summary printed at the end.
    pub fn paragraph(&self) -> String {
        format!(
            "{mode} run of `{task}` on the {bus} bus: {steps} steps in {wall:.1} s after a {warm:.1} s \
             warm start. Training reward {r0:.3} -> {r1:.3}, sample accuracy {a0:.1}% -> {a1:.1}%. \
             {held}Trained {tt} tokens ({tps:.0}/s) from \
             {tg} groups; generated {gt} tokens in {gg} groups. Generator idle {idle:.0}% of \
             the time; {swaps} weight swaps, stall p50 {p50:.1} us, p99 {p99:.1} us.",
            mode = self.mode,
            task = self.task,
            bus = self.bus,
            steps = self.steps,
            wall = self.wall_s,
            warm = self.warm_start_s,
            r0 = self.reward_start,
            r1 = self.reward_end,
            a0 = 100.0 * self.accuracy_start,
            a1 = 100.0 * self.accuracy_end,
            held = self.held_out_sentence(),
            tt = self.trained_tokens,
            tps = self.trained_tokens_per_s,
            tg = self.trained_groups,
            gt = self.generated_tokens,
            gg = self.generated_groups,
            idle = 100.0 * self.gen_idle_fraction,
            swaps = self.swaps,
            p50 = 1e6 * self.swap_stall_p50_s,
            p99 = 1e6 * self.swap_stall_p99_s,
        )
    }
}

/// A held-out evaluation at a point of the run.
#[derive(Debug, Clone, Serialize)]
pub struct HeldOut {
    /// Trainer steps taken by the evaluated weights (0: before RL).
    pub step: u64,
    #[serde(flatten)]
    pub eval: EvalResult,
}

impl RunSummary {
    /// Held-out results before and after RL, pass@1 first, as one sentence (empty when the
    /// run did not evaluate).
    pub fn held_out_sentence(&self) -> String {
        let (Some(before), Some(after), Some(gain)) = (
            self.held_out.first(),
            self.held_out.last(),
            self.pass_at_1_gain,
        ) else {
            return String::new();
        };
        let (b, a) = (&before.eval, &after.eval);
        // An episode task's pass@1 is its success rate, its reward the episode's return.
        let tools = match (
            (&b.tool_call_rate, &a.tool_call_rate),
            (&b.tool_call_validity, &a.tool_call_validity),
        ) {
            ((Some(rb), Some(ra)), (Some(vb), Some(va))) => format!(
                ", tool called in {} -> {} of episodes, {} -> {} of calls valid",
                rb.percent(),
                ra.percent(),
                vb.percent(),
                va.percent()
            ),
            _ => String::new(),
        };
        let (unit, pass, reward, turns, greedy) = match (&b.turns, &a.turns) {
            (Some(tb), Some(ta)) => (
                "games",
                "success",
                "return",
                format!(
                    ", {} -> {} turns per episode{tools}",
                    tb.value(),
                    ta.value()
                ),
                "greedy success",
            ),
            _ => (
                "prompts",
                "pass@1",
                "reward",
                String::new(),
                "greedy accuracy",
            ),
        };
        format!(
            "Held-out ({} {unit}): {pass} at temperature {} {} -> {} (gain {:+.1} points, \
             standard error {:.1}), {reward} {} -> {}{turns}; {greedy} {} -> {}. ",
            a.prompts,
            a.temperature,
            b.pass_at_1.percent(),
            a.pass_at_1.percent(),
            100.0 * gain.mean,
            100.0 * gain.se,
            b.reward.value(),
            a.reward.value(),
            b.greedy_accuracy.percent(),
            a.greedy_accuracy.percent(),
        )
    }
}

/// The result of [`run`].
pub struct RunOutcome {
    pub summary: RunSummary,
    pub rows: Vec<StepRow>,
    pub report: ReportFiles,
}

/// The defaults `rlstream run` puts under the config file: a small model that learns a
/// built-in task in minutes on a CPU.
pub fn defaults(task: BuiltinTask) -> Config {
    // The layer is made of known keys and values, so it always resolves.
    Config::resolve(
        defaults_layer(task),
        None,
        std::iter::empty(),
        toml::Table::new(),
    )
    .unwrap_or_default()
}

/// `run`'s own defaults, as a config layer under the file, the environment and the flags:
/// a quick run that learns in a couple of minutes on two cores.
pub fn defaults_layer(task: BuiltinTask) -> toml::Table {
    let mut layer: toml::Table = RUN_DEFAULTS
        .parse()
        .expect("the shipped run defaults are valid TOML");
    let gen_section = toml::Table::from_iter([(
        "max_new_tokens".to_string(),
        toml::Value::Integer(i64::from(task.max_answer_tokens() + 2)),
    )]);
    layer.insert("gen".into(), toml::Value::Table(gen_section));
    let run_section = toml::Table::from_iter([(
        "sft_steps".to_string(),
        toml::Value::Integer(sft_steps(task) as i64),
    )]);
    layer.insert("run".into(), toml::Value::Table(run_section));
    layer
}

/// Warm-start steps by default: 100 leaves RL most of a task to learn; `longer`'s warm start
/// imitates `sort` until it sorts well (400 steps, about 94% greedy accuracy on `sort`), so
/// that what RL adds, longer inputs, is what the demonstrations lack.
pub fn sft_steps(task: BuiltinTask) -> u64 {
    match task {
        BuiltinTask::Longer => 400,
        // 300 steps: about half the games won greedily, so RL has turns to save.
        BuiltinTask::Guess => 300,
        // 1,500 steps: the player's habits are learned, copying included (about 35% of
        // episodes succeed at temperature 1: the half that call the tool, less garbled
        // calls); at 300 the model cannot yet copy the tool's result, and RL sees no reward.
        BuiltinTask::Calc => 1500,
        _ => 100,
    }
}

/// `run`'s defaults that do not depend on the task (`gen.max_new_tokens` is the task's
/// longest answer + 2).
pub const RUN_DEFAULTS: &str = "[train]\nlr = 5e-4\nsteps = 200\ncheckpoint_every = 50\n";

/// Work waiting for each stage: prompts and rollouts not yet finished (lag + pending), scored
/// groups not yet delivered to the trainer (lag; the trainer keeps what it trained pending
/// until its checkpoint).
async fn queue_depths(bus: &SharedBus, topo: &Topology) -> [u64; 3] {
    let bus = bus.as_ref();
    [
        waiting(bus, topo, Stream::Prompts, true, QUEUE_SCAN_CAP).await,
        waiting(bus, topo, Stream::Rollouts, true, QUEUE_SCAN_CAP).await,
        waiting(bus, topo, Stream::Scored, false, QUEUE_SCAN_CAP).await,
    ]
}

/// Completes once `stop` is set (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Trainer progress the sync feeder waits on: steps attempted and the version reached.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    steps: u64,
    version: u64,
}

/// Keeps prompts flowing: in async mode a backlog of about two steps; in sync mode one
/// step's worth at a time, released when the previous step's weights are in the generator.
struct Feeder {
    task: BuiltinTask,
    seed: u64,
    per_step: usize,
    sync: bool,
    bus: SharedBus,
    topo: Topology,
    slot: ModelSlot<InferBackend>,
    next: u64,
}

impl Feeder {
    /// Prompts `from..from + n` of the RL prompt stream.
    fn prompts(&self, n: usize) -> Vec<(String, tasks::TaskItem)> {
        let seed = self.seed ^ RL_PROMPT_SALT;
        (self.next..self.next + n as u64)
            .map(|i| {
                (
                    format!("{}-{i:06}", self.task.name()),
                    self.task.item(seed, i),
                )
            })
            .collect()
    }

    async fn publish(&mut self, n: usize) -> Result<(), StageError> {
        let items = self.prompts(n);
        self.next += feed::publish(&self.bus, &self.topo, self.task.name(), &items, true).await?;
        Ok(())
    }

    /// Feeds until `stop`; returns the prompts fed.
    async fn run(
        mut self,
        mut progress: watch::Receiver<Progress>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<u64, StageError> {
        let target = (2 * self.per_step) as u64;
        let mut released = 0u64;
        while !*stop.borrow() {
            if self.sync {
                // One step's prompts, then wait for the trainer's step and the generator's swap.
                self.publish(self.per_step).await?;
                released += 1;
                let version = tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    p = progress.wait_for(|p| p.steps >= released) => match p {
                        Ok(p) => p.version,
                        Err(_) => break,
                    },
                };
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    () = self.slot.reached(version) => {}
                }
            } else {
                // The backlog is read from the bus's stream stats, which signal nothing when
                // the generator takes prompts: looked at every FEED_POLL.
                let [waiting, _, _] = queue_depths(&self.bus, &self.topo).await;
                if waiting < target {
                    self.publish((target - waiting) as usize).await?;
                }
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    () = tokio::time::sleep(FEED_POLL) => {}
                }
            }
        }
        Ok(self.next)
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Mean of `f` over the first and the last tenth of `rows` (1 to 10 rows each).
fn start_end(rows: &[StepRow], f: impl Fn(&StepRow) -> f64) -> (f64, f64) {
    if rows.is_empty() {
        return (0.0, 0.0);
    }
    let k = (rows.len() / 10).clamp(1, 10);
    let mean = |r: &[StepRow]| r.iter().map(&f).sum::<f64>() / r.len() as f64;
    (mean(&rows[..k]), mean(&rows[rows.len() - k..]))
}

/// The run's held-out evaluations: `rlstream eval`'s set and metrics at the run's
/// temperature and seed.
struct HeldOutEval {
    set: Option<EvalSet>,
    sampling: EvalSampling,
    display: DisplayMode,
}

impl HeldOutEval {
    fn new(opts: &RunOptions, cfg: &Config) -> Self {
        let r = &cfg.run;
        HeldOutEval {
            set: (r.eval_prompts > 0).then(|| EvalSet::task(opts.task, r.eval_prompts)),
            sampling: EvalSampling {
                samples: r.eval_samples,
                ..EvalSampling::run(cfg.policy.temperature, opts.seed)
            },
            display: opts.display,
        }
    }

    /// The evaluation of `policy` as the point at `step`; `None` when the run does not
    /// evaluate.
    fn of(&self, step: u64, policy: &Policy<InferBackend>) -> Result<Option<HeldOut>, StageError> {
        let Some(set) = &self.set else {
            return Ok(None);
        };
        let eval = tokio::task::block_in_place(|| {
            eval::evaluate(policy, set, &self.sampling, self.display)
        })?;
        Ok(Some(HeldOut { step, eval }))
    }
}

/// The checkpoints to evaluate after a run: the one nearest halfway (when there is one
/// between the start and the end), then the last.
fn held_out_checkpoints(root: &Path) -> Vec<(u64, PathBuf)> {
    let Some(last) = train::checkpoint::latest(root) else {
        return Vec::new();
    };
    let step_of = train::checkpoint::step_of;
    let Some(end) = step_of(&last) else {
        return Vec::new();
    };
    let middle = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| d.join(train::checkpoint::STATE_FILE).exists())
        .filter_map(|d| step_of(&d).map(|s| (s, d)))
        .filter(|(s, _)| *s > 0 && *s < end)
        .min_by_key(|(s, _)| s.abs_diff(end / 2));
    middle.into_iter().chain([(end, last)]).collect()
}

/// A model for the run: `--model` (checked against the task tokenizer) or a warm start.
fn prepare_model(opts: &RunOptions) -> Result<(PathBuf, f64), StageError> {
    if let Some(dir) = &opts.model {
        match Tokenizer::load(dir)? {
            Tokenizer::Char(t) if t.vocab_size() == tasks::char_tokenizer().vocab_size() => {}
            _ => {
                return Err(StageError::Other(format!(
                    "{} does not use the built-in tasks' character tokenizer; give a model \
                     written by `rlstream sft` or `rlstream run`, or leave out --model",
                    dir.display()
                )));
            }
        }
        return Ok((dir.clone(), 0.0));
    }
    let out = opts.out.join("sft");
    let sft_opts = SftOptions {
        task: opts.task.demonstrations(),
        out: out.clone(),
        seed: opts.seed,
        ..opts.sft.clone()
    };
    let mut phase = Phase::new(opts.display, "warm start", sft_opts.steps);
    let s = tokio::task::block_in_place(|| {
        sft::run(&sft_opts, |step, loss| {
            phase.update(step, &format!("loss {loss:.4}"))
        })
    })?;
    phase.finish(&format!(
        "{} params, loss {:.4}, held-out greedy accuracy {:.1}% on `{}`",
        s.params,
        s.final_loss,
        100.0 * s.accuracy,
        sft_opts.task.name()
    ));
    Ok((out, s.seconds))
}

/// Runs warm start and the pipeline until `cfg.train.steps` steps or `shutdown`, then writes
/// the report. `cfg` is the resolved config (over [`defaults`]); its model and checkpoint
/// paths are set here.
pub async fn run(
    opts: &RunOptions,
    cfg: Config,
    bus: SharedBus,
    topo: Topology,
    shutdown: impl Future<Output = ()>,
) -> Result<RunOutcome, StageError> {
    let (cfg, model_dir, warm_start_s) = prepare(opts, cfg)?;
    let slot = gen_stage::initial_slot(&model_dir, cfg.generator.adapter.as_deref())?;
    let params = slot.load().policy.config().num_params();
    let held = HeldOutEval::new(opts, &cfg);
    let mut held_out: Vec<HeldOut> = held.of(0, &slot.load().policy)?.into_iter().collect();
    let (step_tx, step_rx) = mpsc::unbounded_channel::<StepRecord>();
    let started = Instant::now();
    let stages = Stages::spawn(opts, &cfg, &bus, &topo, &slot, step_tx);
    let monitor = Monitor {
        phase: Phase::new(
            opts.display,
            if opts.sync { "RL (sync)" } else { "RL" },
            cfg.train.steps,
        ),
        total: cfg.train.steps,
        rows: Vec::new(),
        trained_tokens: 0,
        started,
    };
    let (rows, train_summary, gen_summary, wall_s) = monitor
        .watch(stages, step_rx, &bus, &topo, &slot, shutdown)
        .await?;

    // The checkpoint nearest halfway, then the trainer's final weights (its last checkpoint).
    for (step, dir) in held_out_checkpoints(&cfg.train.checkpoint_dir) {
        let policy: Policy<InferBackend> = train::checkpoint::load_policy(&dir, &model_dir)?;
        held_out.extend(held.of(step, &policy)?);
    }
    let facts = RunFacts {
        bus: bus.backend(),
        params,
        warm_start_s,
        wall_s,
        rows: &rows,
        train: &train_summary,
        generator: &gen_summary,
        held_out,
    };
    let summary = summarize(opts, cfg, &facts);
    let dir = opts
        .report
        .clone()
        .unwrap_or_else(|| opts.out.join("report"));
    let title = format!(
        "rlstream run: {} ({}), {} steps, {:.0} s",
        opts.task.name(),
        summary.mode,
        summary.steps,
        summary.wall_s
    );
    let markers: Vec<report::Marker> = summary
        .held_out
        .iter()
        .map(|h| report::Marker {
            step: h.step,
            reward: h.eval.reward,
            pass_at_1: h.eval.pass_at_1,
        })
        .collect();
    let report = report::write_report(&dir, &rows, &markers, &summary, &title)
        .map_err(|e| StageError::Other(e.to_string()))?;
    Ok(RunOutcome {
        summary,
        rows,
        report,
    })
}

/// Checks the run directory, makes the model (warm start or `--model`) and fixes the
/// settings every stage must share: the model, the task, the checkpoint directory.
fn prepare(opts: &RunOptions, mut cfg: Config) -> Result<(Config, PathBuf, f64), StageError> {
    let checkpoints = opts.out.join("checkpoints");
    if train::checkpoint::latest(&checkpoints).is_some() {
        return Err(StageError::Other(format!(
            "{} already holds a run; choose another --out",
            opts.out.display()
        )));
    }
    if cfg.train.steps == 0 {
        return Err(StageError::Other("run needs --steps of at least 1".into()));
    }
    std::fs::create_dir_all(&opts.out)
        .map_err(|e| StageError::Other(format!("cannot create {}: {e}", opts.out.display())))?;
    let (model_dir, warm_start_s) = prepare_model(opts)?;
    cfg.policy.model = Some(model_dir.clone());
    cfg.policy.seed = opts.seed;
    cfg.train.checkpoint_dir = checkpoints;
    cfg.feed.task = Some(opts.task);
    cfg.feed.seed = opts.seed;
    if opts.sync {
        // The sync feeder waits for each step's weights in the generator.
        cfg.train.publish_every = 1;
    }
    cfg.validate()?;
    if cfg.score.distill != crate::stages::score::DistillKind::None
        && cfg.train.token_discount > 0.0
    {
        tracing::warn!(
            token_discount = cfg.train.token_discount,
            "distilling with --token-discount above 0 credits each token with the teacher's \
             signal on every later token, which learns far slower than --token-discount 0 \
             (README, \"Distillation\")"
        );
    }
    Ok((cfg, model_dir, warm_start_s))
}

type StageTask = tokio::task::JoinHandle<Result<StageResult, StageError>>;

/// The four stage tasks of a run, over one bus. Each stops the others when it fails, so an
/// error anywhere ends the run.
struct Stages {
    train: StageTask,
    score: StageTask,
    generator: StageTask,
    feed: StageTask,
    stop: Arc<watch::Sender<bool>>,
}

impl Stages {
    fn spawn(
        opts: &RunOptions,
        cfg: &Config,
        bus: &SharedBus,
        topo: &Topology,
        slot: &ModelSlot<InferBackend>,
        steps_out: mpsc::UnboundedSender<StepRecord>,
    ) -> Self {
        let transport = Transport::InProcess(LocalWeights::default());
        let stop = Arc::new(watch::channel(false).0);
        let (progress_tx, progress_rx) = watch::channel(Progress::default());
        let spawn = |fut: std::pin::Pin<
            Box<dyn Future<Output = Result<StageResult, StageError>> + Send>,
        >| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let r = fut.await;
                if r.is_err() {
                    stop.send_replace(true);
                }
                r
            })
        };
        let stopped = || stopped(stop.subscribe());
        let (c, b, t, tr) = (
            train::TrainerSettings {
                policy: cfg.policy.clone(),
                train: cfg.train.clone(),
            },
            bus.clone(),
            topo.clone(),
            transport.clone(),
        );
        let until = stopped();
        let train = spawn(Box::pin(async move {
            let mut steps = 0u64;
            train::run(&c, b, &t, tr, until, move |s| {
                steps += 1;
                progress_tx.send_replace(Progress {
                    steps,
                    version: s.version,
                });
                let _ = steps_out.send(s.clone());
            })
            .await
            .map(StageResult::Train)
        }));
        let (c, b, t, until) = (cfg.score.clone(), bus.clone(), topo.clone(), stopped());
        let score = spawn(Box::pin(async move {
            score::run(&c, b, &t, until)
                .await
                .map(|_| StageResult::Other)
        }));
        let (p, c, b, t, s, until) = (
            cfg.policy.clone(),
            cfg.generator.clone(),
            bus.clone(),
            topo.clone(),
            slot.clone(),
            stopped(),
        );
        let generator = spawn(Box::pin(async move {
            gen_stage::run(&p, &c, b, &t, s, transport, until)
                .await
                .map(StageResult::Gen)
        }));
        let feeder = Feeder {
            task: opts.task,
            seed: opts.seed,
            per_step: cfg.policy.groups_per_step,
            sync: opts.sync,
            bus: bus.clone(),
            topo: topo.clone(),
            slot: slot.clone(),
            next: 0,
        };
        let stop_rx = stop.subscribe();
        let feed = spawn(Box::pin(async move {
            feeder
                .run(progress_rx, stop_rx)
                .await
                .map(|_| StageResult::Other)
        }));
        Stages {
            train,
            score,
            generator,
            feed,
            stop,
        }
    }

    /// Stops the other stages once the trainer has ended with `train`, and returns the
    /// trainer's and the generator's summaries, or the first real failure (the other stages
    /// only stopped because of it).
    async fn join(
        self,
        train: Result<Result<StageResult, StageError>, tokio::task::JoinError>,
    ) -> Result<(TrainSummary, GenSummary), StageError> {
        self.stop.send_replace(true);
        let join = |r: Result<Result<StageResult, StageError>, tokio::task::JoinError>,
                    name: Stage| {
            r.map_err(|e| StageError::Other(format!("{name} task: {e}")))?
        };
        let train_r = join(train, Stage::Train);
        let gen_r = join(self.generator.await, Stage::Gen);
        let score_r = join(self.score.await, Stage::Score);
        let feed_r = join(self.feed.await, Stage::Feed);
        let train_summary = match train_r? {
            StageResult::Train(t) => t,
            _ => TrainSummary::default(),
        };
        let gen_summary = match gen_r? {
            StageResult::Gen(g) => g,
            _ => GenSummary::default(),
        };
        score_r?;
        feed_r?;
        Ok((train_summary, gen_summary))
    }
}

/// The run's view of its steps: one report row and a display update per trainer step.
struct Monitor {
    phase: Phase,
    total: u64,
    rows: Vec<StepRow>,
    trained_tokens: u64,
    started: Instant,
}

impl Monitor {
    fn record(
        &mut self,
        s: &StepRecord,
        time_s: f64,
        gen_version: u64,
        queues: [u64; 3],
    ) -> &StepRow {
        self.trained_tokens += s.tokens;
        self.rows.push(step_row(
            s,
            time_s,
            gen_version,
            self.trained_tokens,
            queues,
        ));
        &self.rows[self.rows.len() - 1]
    }

    /// Follows the steps until the trainer ends (a Ctrl-C asks it to checkpoint and stop);
    /// returns the rows, the summaries and the RL phase's wall time.
    async fn watch(
        mut self,
        mut stages: Stages,
        mut steps: mpsc::UnboundedReceiver<StepRecord>,
        bus: &SharedBus,
        topo: &Topology,
        slot: &ModelSlot<InferBackend>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(Vec<StepRow>, TrainSummary, GenSummary, f64), StageError> {
        tokio::pin!(shutdown);
        let mut stopping = false;
        let train_result = loop {
            tokio::select! {
                _ = &mut shutdown, if !stopping => {
                    stopping = true;
                    self.phase.println("stopping: the trainer checkpoints what it trained");
                    stages.stop.send_replace(true);
                }
                Some(s) = steps.recv() => {
                    let queues = queue_depths(bus, topo).await;
                    let time_s = self.started.elapsed().as_secs_f64();
                    let line = status_line(self.record(&s, time_s, slot.load().version, queues));
                    self.phase.update(s.step.min(self.total), &line);
                }
                r = &mut stages.train => break r,
            }
        };
        let wall_s = self.started.elapsed().as_secs_f64();
        let (t, g) = stages.join(train_result).await?;
        while let Ok(s) = steps.try_recv() {
            self.record(&s, wall_s, slot.load().version, [0; 3]);
        }
        self.phase
            .finish(&self.rows.last().map(status_line).unwrap_or_default());
        Ok((self.rows, t, g, wall_s))
    }
}

/// What a stage task returns to the run.
enum StageResult {
    Train(TrainSummary),
    Gen(GenSummary),
    Other,
}

fn step_row(s: &StepRecord, time_s: f64, gen_version: u64, trained: u64, q: [u64; 3]) -> StepRow {
    StepRow {
        record: s.clone(),
        run: RunProgress {
            time_s,
            gen_version,
            trained_tokens_per_s: trained as f64 / time_s.max(1e-9),
            queue_prompts: q[0],
            queue_rollouts: q[1],
            queue_scored: q[2],
        },
    }
}

fn status_line(r: &StepRow) -> String {
    let (s, run) = (&r.record, &r.run);
    format!(
        "v{} (gen v{}) reward {:.3} acc {:.0}% {:.0} tok/s stale {:.1}/{} queue {}/{}/{}",
        s.version,
        run.gen_version,
        s.reward_mean,
        100.0 * s.accuracy,
        run.trained_tokens_per_s,
        s.staleness_mean,
        s.staleness_max,
        run.queue_prompts,
        run.queue_rollouts,
        run.queue_scored
    )
}

/// What a finished run measured, for [`summarize`].
struct RunFacts<'a> {
    bus: &'static str,
    params: usize,
    warm_start_s: f64,
    wall_s: f64,
    rows: &'a [StepRow],
    train: &'a TrainSummary,
    generator: &'a GenSummary,
    /// Held-out evaluations, in step order.
    held_out: Vec<HeldOut>,
}

fn summarize(opts: &RunOptions, cfg: Config, f: &RunFacts) -> RunSummary {
    let RunFacts {
        bus,
        params,
        warm_start_s,
        wall_s,
        rows,
        train: t,
        generator: g,
        ref held_out,
    } = *f;
    let (reward_start, reward_end) = start_end(rows, |r| r.record.reward_mean);
    let (accuracy_start, accuracy_end) = start_end(rows, |r| r.record.accuracy);
    let mut stalls = g.decode.swap_stalls.clone();
    stalls.sort_by(f64::total_cmp);
    let mut staleness = BTreeMap::new();
    for h in &t.history {
        for &s in &h.staleness {
            *staleness.entry(s).or_default() += 1;
        }
    }
    let trained_tokens: u64 = t.history.iter().map(|h| h.tokens).sum();
    RunSummary {
        mode: if opts.sync { "sync" } else { "async" }.into(),
        task: opts.task.name().into(),
        bus: bus.into(),
        model_params: params,
        warm_start_s,
        steps: t.steps,
        wall_s,
        trained_groups: t.trained_groups,
        trained_tokens,
        trained_tokens_per_s: trained_tokens as f64 / wall_s.max(1e-9),
        generated_groups: g.groups,
        generated_tokens: g.tokens,
        reward_start,
        reward_end,
        accuracy_start,
        accuracy_end,
        pass_at_1_gain: match (held_out.first(), held_out.last()) {
            (Some(b), Some(a)) if held_out.len() > 1 => {
                Some(a.eval.pass_at_1.minus(&b.eval.pass_at_1))
            }
            _ => None,
        },
        held_out: held_out.clone(),
        gen_idle_fraction: (g.decode.idle_s / wall_s.max(1e-9)).min(1.0),
        gen_busy_s: g.decode.busy_s,
        gen_idle_s: g.decode.idle_s,
        train_busy_s: t.history.iter().map(|h| h.step_s).sum(),
        train_wait_s: t.history.iter().map(|h| h.wait_s).sum(),
        swaps: g.decode.swaps,
        swap_stall_p50_s: percentile(&stalls, 0.5),
        swap_stall_p99_s: percentile(&stalls, 0.99),
        swap_stall_max_s: stalls.last().copied().unwrap_or(0.0),
        staleness,
        dropped: t.dropped.clone(),
        config: cfg,
    }
}

/// The default run directory: `runs/{task}-{unix seconds}`.
pub fn default_out(task: BuiltinTask) -> PathBuf {
    let secs = crate::time::now_us() / 1_000_000;
    Path::new("runs").join(format!("{}-{secs}", task.name()))
}

/// A namespace of its own for a run on Redis, so that a run never mixes with another's
/// streams: `run-` and the time in milliseconds.
pub fn fresh_namespace() -> String {
    format!("run-{}", crate::time::now_ms())
}

//! `rlstream run`: the whole pipeline in one process.
//!
//! Warm start (or `--model`), then gen, score and train run as tasks of one runtime over one
//! bus: the embedded [`MemoryBus`](crate::bus::MemoryBus) unless `--redis` is given. Those
//! three are the same `stages::*::run` functions the separate processes call; only the
//! weight handoff differs ([`Transport::InProcess`]: host tensors by reference, announced on
//! the weights stream like any other version). Prompts come from the run's own feeder
//! (`feeder.rs`), not `stages::feed`: it paces them by the trainer's progress.
//!
//! Two schedules:
//! - **async** (default): the feeder keeps a few steps of prompts queued, the generator
//!   decodes continuously under its in-flight bound and swaps weights between forward
//!   passes, the trainer trains on whatever is scored.
//! - **sync** (`--sync`): the baseline with no overlap. The feeder releases one step's
//!   prompts, waits until the trainer has stepped on them and the generator holds the new
//!   version, then releases the next. The generator waits for the trainer and the trainer
//!   for the generator; every batch waits for its longest completion.

mod data;
mod feeder;
mod held_out;
mod monitor;
mod options;
mod queues;
mod stage_tasks;
mod summary;

pub use options::{DatasetSource, RunOptions, RunPrompts};
pub use summary::{HeldOut, RunSummary};

use crate::bus::{SharedBus, Topology};
use crate::commands::eval::EvalSet;
use crate::commands::sft::{self, SftOptions};
use crate::config::Config;
use crate::display::Phase;
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, Policy};
use crate::report::{self, ReportFiles, StepRow};
use crate::schema::StepRecord;
use crate::stages::generator as gen_stage;
use crate::stages::{StageError, train};
use crate::tasks::{self, BuiltinTask};
use data::DatasetRows;
use feeder::{FeedRows, Feeder};
use held_out::{HeldOutEval, held_out_checkpoints};
use monitor::Monitor;
use stage_tasks::Stages;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;
use summary::{RunFacts, summarize};
use tokio::sync::mpsc;

/// The result of [`run`].
pub struct RunOutcome {
    pub summary: RunSummary,
    pub rows: Vec<StepRow>,
    /// The report's files, or why they could not be written (the run itself finished:
    /// its summary and model are whole).
    pub report: Result<ReportFiles, report::ReportError>,
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
    if let Some(train) = layer.get_mut("train").and_then(toml::Value::as_table_mut) {
        train.insert("steps".into(), toml::Value::Integer(rl_steps(task) as i64));
    }
    layer
}

/// RL steps by default: [`RUN_DEFAULTS`]' 200, and 400 for `longer`, the default task, so
/// that the first run a newcomer makes learns every time. At 200 its held-out gain hung on
/// the async schedule (+3.0 to +10.4 points in three runs of the same command on two
/// cores, 0.0 to +7.2 on a slower machine); at 400 it gained +17.3 to +21.7 in ten, about
/// 12 s more on two cores (`benches/learning.py --repeat`, docs/run.md).
pub fn rl_steps(task: BuiltinTask) -> u64 {
    match task {
        BuiltinTask::Longer => 400,
        _ => 200,
    }
}

/// `run`'s defaults for a dataset (`--dataset`) on a pretrained model: the task-free
/// [`RUN_DEFAULTS`] at a learning rate for a pretrained model; `gen.max_new_tokens` stays
/// gen's own.
pub fn dataset_defaults_layer() -> toml::Table {
    let mut layer: toml::Table = RUN_DEFAULTS
        .parse()
        .expect("the shipped run defaults are valid TOML");
    if let Some(train) = layer.get_mut("train").and_then(toml::Value::as_table_mut) {
        train.insert("lr".into(), toml::Value::Float(DATASET_LR));
    }
    layer
}

/// The learning rate of a dataset run by default: a pretrained model moves far less than
/// the warm-started tiny one before it forgets what it knew.
pub const DATASET_LR: f64 = 1e-5;

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

/// A model for the run: `--model` (for a built-in task, checked against its tokenizer) or
/// a warm start.
fn prepare_model(opts: &RunOptions) -> Result<(PathBuf, f64), StageError> {
    let task = match (&opts.prompts, &opts.model) {
        (RunPrompts::Dataset(_), Some(dir)) => return Ok((dir.clone(), 0.0)),
        (RunPrompts::Dataset(d), None) => {
            return Err(StageError::Other(format!(
                "--dataset {} needs --model DIR: a Hugging Face model directory (config.json, \
                 model.safetensors, tokenizer.json) whose tokenizer and chat template the \
                 prompts are fed with",
                d.path.display()
            )));
        }
        (RunPrompts::Task(task), _) => *task,
    };
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
        task: task.demonstrations(),
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
/// paths are set here. `ranks` are the trainer ranks its trainer leads (one alone without
/// `mpirun`).
pub async fn run(
    opts: &RunOptions,
    cfg: Config,
    bus: SharedBus,
    topo: Topology,
    ranks: Box<dyn crate::collective::Collective>,
    shutdown: impl Future<Output = ()>,
) -> Result<RunOutcome, StageError> {
    let (cfg, model_dir, warm_start_s) = prepare(opts, cfg)?;
    let slot = gen_stage::initial_slot(&model_dir, cfg.generator.adapter.as_deref())?;
    let model_cfg = slot.load().policy.config().clone();
    let params = model_cfg.num_params();
    let (rows, set) = run_prompts(opts, &cfg, &model_dir, &model_cfg)?;
    let held = HeldOutEval::new(set, opts, &cfg);
    let feeder = Feeder {
        rows,
        seed: opts.seed,
        per_step: cfg.policy.groups_per_step,
        sync: opts.sync,
        bus: bus.clone(),
        topo: topo.clone(),
        slot: slot.clone(),
        filtered: Default::default(),
        pool: crate::stages::feed::DifficultyPool::new(&cfg.difficulty, opts.seed),
        counts: Default::default(),
    };
    let fed = feeder.counts.clone();
    let mut held_out: Vec<HeldOut> = held
        .of(0, 0.0, "before", &slot.load().policy)?
        .into_iter()
        .collect();
    let (step_tx, step_rx) = mpsc::unbounded_channel::<StepRecord>();
    let started = Instant::now();
    let stages = Stages::spawn(feeder, &cfg, &bus, &topo, &slot, ranks, step_tx);
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

    // The checkpoint nearest halfway (or every `eval_every` steps), then the trainer's final
    // weights (its last checkpoint).
    let every = cfg.run.eval_every;
    let after = held_out_checkpoints(&cfg.train.checkpoint_dir, every);
    for (i, (step, dir)) in after.iter().enumerate() {
        let policy: Policy<InferBackend> = train::checkpoint::load_policy(dir, &model_dir)?;
        let when = match (i + 1 == after.len(), every) {
            (true, _) => "after".to_string(),
            (false, 0) => "halfway".to_string(),
            (false, _) => format!("step {step}"),
        };
        let time_s = rows
            .iter()
            .find(|r| r.record.step >= *step)
            .map_or(wall_s, |r| r.run.time_s);
        held_out.extend(held.of(*step, time_s, &when, &policy)?);
    }
    let facts = RunFacts {
        bus: bus.backend(),
        namespace: &topo.namespace,
        params,
        warm_start_s,
        wall_s,
        rows: &rows,
        train: &train_summary,
        generator: &gen_summary,
        held_out,
        fed: (
            fed.fed.load(Ordering::Relaxed),
            fed.reoffered.load(Ordering::Relaxed),
        ),
    };
    let summary = summarize(opts, cfg, &facts);
    let report = write_report(opts, &rows, &summary);
    Ok(RunOutcome {
        summary,
        rows,
        report,
    })
}

/// The run's report: the learning curve with the held-out points, the per-step metrics and
/// the summary, in `--report` or `OUT/report`.
fn write_report(
    opts: &RunOptions,
    rows: &[StepRow],
    summary: &RunSummary,
) -> Result<ReportFiles, report::ReportError> {
    let dir = opts
        .report
        .clone()
        .unwrap_or_else(|| opts.out.join("report"));
    let title = format!(
        "rlstream run: {} ({}), {} steps, {:.0} s",
        opts.prompts.name(),
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
    report::write_report(&dir, rows, &markers, summary, &title)
}

/// What the feeder draws from, and the held-out set (none with `run.eval_prompts = 0`):
/// the task's streams, or the dataset's training and held-out rows.
fn run_prompts(
    opts: &RunOptions,
    cfg: &Config,
    model_dir: &Path,
    model_cfg: &crate::model::ModelConfig,
) -> Result<(FeedRows, Option<EvalSet>), StageError> {
    let n_eval = cfg.run.eval_prompts;
    Ok(match &opts.prompts {
        RunPrompts::Task(task) => (
            FeedRows::Task(*task),
            (n_eval > 0).then(|| EvalSet::task(*task, n_eval)),
        ),
        RunPrompts::Dataset(src) => {
            let rows = DatasetRows::load(src, model_dir, n_eval > 0)?;
            let max_new = cfg.generator.max_new_tokens;
            let set = match n_eval {
                0 => None,
                n => Some(rows.eval_set(model_dir, model_cfg, n, max_new)?),
            };
            (FeedRows::dataset(rows.train), set)
        }
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
    match &opts.prompts {
        RunPrompts::Task(task) => cfg.feed.task = Some(*task),
        RunPrompts::Dataset(d) => {
            cfg.feed.task = None;
            cfg.feed.dataset = Some(d.path.clone());
            cfg.feed.prompt_column = d.columns.prompt.clone();
            cfg.feed.answer_column = d.columns.answer.clone();
            cfg.feed.messages_column = d.columns.messages.clone();
            cfg.feed.chat_template = Some(model_dir.clone());
            // The scorer decodes completions with the model's tokenizer, not the tasks'.
            cfg.score.tokenizer.get_or_insert_with(|| model_dir.clone());
        }
    }
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
             (docs/distillation.md)"
        );
    }
    Ok((cfg, model_dir, warm_start_s))
}

/// The default run directory: `runs/{task or dataset}-{unix seconds}`.
pub fn default_out(name: &str) -> PathBuf {
    let secs = crate::time::now_us() / 1_000_000;
    Path::new("runs").join(format!("{name}-{secs}"))
}

/// A namespace of its own for a run on Redis, so that a run never mixes with another's
/// streams: `run-` and the time in milliseconds.
pub fn fresh_namespace() -> String {
    format!("run-{}", crate::time::now_ms())
}

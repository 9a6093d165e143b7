//! `rlstream eval`: held-out results of any checkpoint, with intervals.
//!
//! Two numbers per reward, on the same prompts:
//! - **pass@1** and **reward** at the sampling temperature (the training temperature by
//!   default): what RL optimises. Each prompt is sampled `--samples` times; its value is the
//!   mean over its samples, and the estimate is the mean over prompts with the standard
//!   error of that mean (prompts are the independent draws).
//! - **greedy** accuracy and reward: the deterministic answer.
//!
//! Built-in tasks are evaluated on their held-out split ([`tasks::held_out`]): prompts no
//! training stream of any seed produces, the same ones for every run. `--dataset` evaluates
//! a JSONL or Parquet file's items (keeping it apart from training data is then the user's
//! part); its bad rows are skipped and reported, as `feed` does.

use crate::display::{DisplayMode, Phase};
use crate::env::{
    self,
    play::{EpisodeLimits, play, without_stop},
};
use crate::model::hf::load_hf;
use crate::model::sampler::{Completion, Generator, Request, TurnLimits};
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, ModelError, Policy};
pub use crate::report::Estimate;
use crate::schema::SamplingParams;
use crate::tasks::{self, BuiltinTask, Dataset, TaskItem};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Sequences decoded together, by default.
pub const BATCH: usize = 512;
/// Most model turns of an evaluated episode (gen's default `max_turns`).
pub const MAX_TURNS: u32 = 8;

crate::settings! {
    /// What to evaluate and how: these are also the flags of `rlstream eval`.
    pub struct EvalOptions, flags EvalArgs, section "eval" {
        /// Model directory: a Hugging Face checkpoint (`OUT/sft`, `OUT/checkpoints/step-N`).
        #[arg(value_name = "DIR")]
        pub model: Option<PathBuf> = None,
        /// A PEFT adapter directory (a LoRA trainer's checkpoint) applied to --model, the base it was trained on.
        #[arg(value_name = "DIR")]
        pub adapter: Option<PathBuf> = None,
        /// Built-in task whose held-out prompts to evaluate on.
        pub task: Option<BuiltinTask> = None,
        /// Dataset (JSONL or Parquet) to evaluate on instead of a task (its first --prompts items).
        #[arg(value_name = "FILE")]
        pub dataset: Option<PathBuf> = None,
        /// The dataset's prompt column (Parquet) or field (JSONL).
        #[arg(value_name = "NAME")]
        pub prompt_column: String = "prompt".into(),
        /// The dataset's answer column or field.
        #[arg(value_name = "NAME")]
        pub answer_column: String = "answer".into(),
        /// The dataset's conversation column or field (a list of {role, content}), read when there is no prompt column.
        #[arg(value_name = "NAME")]
        pub messages_column: String = "messages".into(),
        /// Tokenizer directory for --dataset; the model's when absent.
        #[arg(value_name = "DIR")]
        pub tokenizer: Option<PathBuf> = None,
        /// Held-out prompts.
        pub prompts: usize = 1000,
        /// Samples per prompt for pass@1 (more samples, a narrower interval).
        pub samples: usize = 4,
        /// Sampling temperature of pass@1: the training temperature.
        pub temperature: f32 = 1.0,
        /// Seed of the sampled completions.
        pub seed: u64 = 0,
        /// Most tokens per completion; the task's longest answer + 2 when 0 (64 for --dataset).
        pub max_new_tokens: u32 = 0,
        /// Sequences decoded together.
        pub batch: usize = BATCH,
        /// Also write the result as JSON to this file.
        #[arg(value_name = "FILE")]
        pub json: Option<PathBuf> = None,
    }
}

/// One evaluation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EvalResult {
    /// Task or dataset name.
    pub task: String,
    pub prompts: usize,
    pub samples: usize,
    pub temperature: f32,
    /// Share of samples at `temperature` with full reward (the exact answer).
    pub pass_at_1: Estimate,
    /// Mean reward of a sample at `temperature`: what RL maximises.
    pub reward: Estimate,
    /// Share of greedy completions with full reward.
    pub greedy_accuracy: Estimate,
    pub greedy_reward: Estimate,
    /// Episode tasks: model turns per episode at `temperature`, and greedy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns: Option<Estimate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub greedy_turns: Option<Estimate>,
    /// Tool-use tasks (`calc`), at `temperature`: share of episodes that call the tool,
    /// and share of calls that are valid (prompts with no call left out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_rate: Option<Estimate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_validity: Option<Estimate>,
    pub seconds: f64,
}

impl EvalResult {
    /// One line: pass@1 first (an episode task's success rate, with its turns).
    pub fn line(&self) -> String {
        if let (Some(turns), Some(greedy_turns)) = (&self.turns, &self.greedy_turns) {
            let tools = match (&self.tool_call_rate, &self.tool_call_validity) {
                (Some(rate), Some(valid)) => format!(
                    "; tool called in {} of episodes, {} of calls valid",
                    rate.percent(),
                    valid.percent()
                ),
                _ => String::new(),
            };
            return format!(
                "success {} (return {}, {} turns) at temperature {}, greedy success {} (return {}, {} turns), {} games × {} episodes{tools}",
                self.pass_at_1.percent(),
                self.reward.value(),
                turns.value(),
                self.temperature,
                self.greedy_accuracy.percent(),
                self.greedy_reward.value(),
                greedy_turns.value(),
                self.prompts,
                self.samples
            );
        }
        format!(
            "pass@1 {} (reward {}) at temperature {}, greedy accuracy {} (reward {}), {} prompts × {} samples",
            self.pass_at_1.percent(),
            self.reward.value(),
            self.temperature,
            self.greedy_accuracy.percent(),
            self.greedy_reward.value(),
            self.prompts,
            self.samples
        )
    }
}

/// Prompts to evaluate on, tokenised, with what their completions are scored against.
pub struct EvalSet {
    pub name: String,
    pub items: Vec<(Vec<u32>, TaskItem)>,
    pub tokenizer: Tokenizer,
    pub stop_tokens: Vec<u32>,
    /// Most tokens per completion (per model turn for an episode task).
    pub max_new_tokens: u32,
    /// Episode tasks: most model turns.
    pub max_turns: u32,
}

impl EvalSet {
    /// The first `n` held-out prompts of `task` (the same for every seed and run).
    pub fn task(task: BuiltinTask, n: usize) -> Self {
        let tok = tasks::char_tokenizer();
        let items = (0..n as u64)
            .map(|i| {
                let it = task.held_out_item(i);
                (tok.encode(&it.prompt), it)
            })
            .collect();
        EvalSet {
            name: task.name().to_string(),
            items,
            tokenizer: Tokenizer::Char(tok),
            stop_tokens: vec![crate::model::tokenizer::CharTokenizer::EOS],
            max_new_tokens: task.max_answer_tokens() + 2,
            max_turns: MAX_TURNS,
        }
    }

    /// The first `n` items of a dataset (each has an answer) with `cols` naming its columns,
    /// chat rows rendered with `template`, tokenised with `tokenizer`. Bad rows are skipped
    /// and reported (a warning).
    pub fn dataset(
        path: &Path,
        cols: &tasks::Columns,
        tokenizer: Tokenizer,
        template: Option<&crate::model::chat::ChatTemplate>,
        stop_tokens: Vec<u32>,
        n: usize,
    ) -> Result<Self, EvalError> {
        let mut d =
            Dataset::load_reported(path, cols).map_err(|e| EvalError::Usage(e.to_string()))?;
        if d.has_chat() {
            let template = template.ok_or_else(|| {
                EvalError::Usage(format!(
                    "{} has `messages` rows and the model has no chat template \
                     (tokenizer_config.json) to render them",
                    path.display()
                ))
            })?;
            d.render(template)
                .map_err(|e| EvalError::Usage(format!("{}: {e}", path.display())))?;
        }
        let items = d.items.into_iter().map(|it| it.item);
        Self::of_items(d.name, items, tokenizer, stop_tokens, n)
    }

    /// The first `n` of `items` (rendered prompts with their answers), tokenised with
    /// `tokenizer`, at most 64 new tokens each.
    pub fn of_items(
        name: String,
        items: impl IntoIterator<Item = TaskItem>,
        tokenizer: Tokenizer,
        stop_tokens: Vec<u32>,
        n: usize,
    ) -> Result<Self, EvalError> {
        let mut encoded = Vec::new();
        for it in items.into_iter().take(n) {
            encoded.push((tokenizer.encode(&it.prompt)?, it));
        }
        Ok(EvalSet {
            name,
            items: encoded,
            tokenizer,
            stop_tokens,
            max_new_tokens: 64,
            max_turns: MAX_TURNS,
        })
    }

    /// Refuses a prompt the model cannot run (empty, or past its context or vocabulary),
    /// naming it.
    pub fn check_fits(&self, limits: &crate::schema::Limits) -> Result<(), EvalError> {
        for (tokens, it) in &self.items {
            let fits = match limits.prompt("prompt", tokens) {
                Ok(()) if tokens.is_empty() => Err("it is empty".to_string()),
                Ok(()) => Ok(()),
                Err(r) => Err(r.detail),
            };
            if let Err(why) = fits {
                return Err(EvalError::Usage(format!(
                    "cannot evaluate the prompt {:?}: {why}",
                    it.prompt
                )));
            }
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Usage(String),
    #[error("cannot write {path}: {source}")]
    Output {
        path: String,
        source: std::io::Error,
    },
}

/// Sampling of one evaluation pass.
#[derive(Debug, Clone, Copy)]
pub struct EvalSampling {
    pub samples: usize,
    pub temperature: f32,
    pub seed: u64,
    pub batch: usize,
}

impl EvalSampling {
    /// How `run` evaluates: 4 samples per prompt at the run's temperature.
    pub fn run(temperature: f32, seed: u64) -> Self {
        EvalSampling {
            samples: 4,
            temperature,
            seed,
            batch: BATCH,
        }
    }
}

/// Per-prompt means of `n` completions per prompt: reward (an episode's return), full
/// credit (an episode's success) and, for episodes, model turns.
#[derive(Debug, Default)]
struct PerPrompt {
    rewards: Vec<f64>,
    passes: Vec<f64>,
    turns: Vec<f64>,
    /// Tool-use tasks: per prompt, share of episodes calling the tool; share of calls
    /// valid (prompts with calls).
    calls: Vec<f64>,
    valid: Vec<f64>,
}

/// [`PerPrompt`] at `temperature` (greedy when 0), decoded `batch` sequences at a time;
/// `progress(done)` after each chunk.
fn per_prompt(
    model: &Policy<InferBackend>,
    set: &EvalSet,
    n: usize,
    temperature: f32,
    seed: u64,
    batch: usize,
    mut progress: impl FnMut(usize),
) -> Result<PerPrompt, ModelError> {
    let per_chunk = (batch / n).max(1);
    let mut out = PerPrompt::default();
    let episodes = set.items.iter().any(|(_, it)| env::is_episode(&it.meta));
    for (c, chunk) in set.items.chunks(per_chunk).enumerate() {
        let first = c * per_chunk;
        let requests: Vec<Request> = chunk
            .iter()
            .enumerate()
            .map(|(i, (tokens, _))| Request {
                id: i as u64,
                prompt: tokens.clone(),
                n,
                params: SamplingParams {
                    temperature,
                    top_k: 0,
                    top_p: 1.0,
                    max_new_tokens: set.max_new_tokens,
                    stop_tokens: set.stop_tokens.clone(),
                    // The prompt's place in the set: the same samples in every evaluation.
                    seed: crate::seed::derive(seed, &format!("eval/{}/{}", set.name, first + i)),
                },
            })
            .collect();
        if episodes {
            let sums = play_chunk(model, set, chunk, &requests)?;
            for s in sums {
                out.rewards.push(s.ret / n as f64);
                out.passes.push(s.success / n as f64);
                out.turns.push(s.turns / n as f64);
                if let Some(t) = s.tools {
                    out.calls.push(t.with_call / n as f64);
                    if t.calls > 0 {
                        out.valid.push(f64::from(t.valid) / f64::from(t.calls));
                    }
                }
            }
            progress(first + chunk.len());
            continue;
        }
        let done = Generator::generate(model, 0, &requests)?;
        let mut sums = vec![(0.0, 0.0); chunk.len()];
        for c in &done {
            let end = c
                .tokens
                .iter()
                .position(|t| set.stop_tokens.contains(t))
                .unwrap_or(c.tokens.len());
            // A completion that does not decode is a wrong answer and scores as one.
            let reward = set
                .tokenizer
                .decode(&c.tokens[..end])
                .ok()
                .and_then(|text| tasks::score(&text, &chunk[c.request_id as usize].1.meta))
                .map_or(0.0, f64::from);
            let s = &mut sums[c.request_id as usize];
            s.0 += reward;
            s.1 += f64::from(u8::from(reward >= 1.0));
        }
        for (r, p) in sums {
            out.rewards.push(r / n as f64);
            out.passes.push(p / n as f64);
        }
        progress(first + chunk.len());
    }
    Ok(out)
}

/// Sums over the episodes of one prompt.
#[derive(Debug, Default, Clone, Copy)]
struct EpisodeSums {
    ret: f64,
    success: f64,
    turns: f64,
    /// Tool-use tasks only.
    tools: Option<ToolSums>,
}

#[derive(Debug, Default, Clone, Copy)]
struct ToolSums {
    with_call: f64,
    calls: u32,
    valid: u32,
}

/// Plays the episodes of `requests` (one per item of `chunk`): per item the sums of
/// return, successes, turns and tool use. An episode whose environment fails counts as a
/// failure with return 0.
fn play_chunk(
    model: &Policy<InferBackend>,
    set: &EvalSet,
    chunk: &[(Vec<u32>, TaskItem)],
    requests: &[Request],
) -> Result<Vec<EpisodeSums>, ModelError> {
    type Maker = Box<dyn Fn() -> Result<Box<dyn env::Environment>, env::EnvError>>;
    let makers: Vec<Maker> = chunk
        .iter()
        .map(|(_, it)| {
            let meta = it.meta.clone();
            Box::new(move || {
                env::make(&meta)?
                    .ok_or_else(|| env::EnvError::Setup("the item names no environment".into()))
            }) as Maker
        })
        .collect();
    let games: Vec<_> = requests
        .iter()
        .cloned()
        .zip(makers.iter().map(|m| m.as_ref()))
        .collect();
    let limits = EpisodeLimits {
        turn: TurnLimits {
            turn_tokens: set.max_new_tokens as usize,
            episode_tokens: model.config().max_position,
        },
        turns: set.max_turns,
    };
    let (episodes, _failed) = play(model, 0, &games, &limits, &set.tokenizer)?;
    let mut sums: Vec<EpisodeSums> = chunk
        .iter()
        .map(|(_, it)| EpisodeSums {
            tools: (it.meta.get(env::ENV).map(String::as_str) == Some(env::calc::NAME))
                .then(ToolSums::default),
            ..EpisodeSums::default()
        })
        .collect();
    for e in &episodes {
        let s = &mut sums[e.completion.request_id as usize];
        s.ret += f64::from(e.ret());
        s.success += f64::from(u8::from(e.success));
        s.turns += f64::from(e.completion.turns);
        if let Some(t) = s.tools.as_mut() {
            let used = env::calc::ToolUse::of(
                model_turns(&e.completion, &set.stop_tokens, &set.tokenizer)
                    .iter()
                    .map(String::as_str),
            );
            t.with_call += f64::from(u8::from(used.calls > 0));
            t.calls += used.calls;
            t.valid += used.valid;
        }
    }
    Ok(sums)
}

/// The texts of an episode's model turns, stop tokens left out (a turn that does not
/// decode reads as empty).
fn model_turns(c: &Completion, stop_tokens: &[u32], tokenizer: &Tokenizer) -> Vec<String> {
    crate::schema::turn_ranges(c.tokens.len(), &c.env)
        .into_iter()
        .filter(|(_, env)| !env)
        .map(|(r, _)| {
            tokenizer
                .decode(without_stop(&c.tokens[r], stop_tokens))
                .unwrap_or_default()
        })
        .collect()
}

/// Greedy accuracy and reward of `model` on `set` (what `sft` reports), decoded `batch`
/// prompts at a time; `progress(done)` after each chunk.
pub fn greedy(
    model: &Policy<InferBackend>,
    set: &EvalSet,
    batch: usize,
    progress: impl FnMut(usize),
) -> Result<(Estimate, Estimate), ModelError> {
    let p = per_prompt(model, set, 1, 0.0, 0, batch, progress)?;
    Ok((Estimate::rate(&p.passes), Estimate::of(&p.rewards)))
}

/// Evaluates `model` on `set`: sampled (pass@1, reward) and greedy (accuracy, reward); the
/// progress shown as `label` (12 columns at most).
pub fn evaluate(
    model: &Policy<InferBackend>,
    set: &EvalSet,
    sampling: &EvalSampling,
    display: DisplayMode,
    label: &str,
) -> Result<EvalResult, ModelError> {
    let started = Instant::now();
    let total = set.items.len() as u64;
    let mut phase = Phase::new(display, label, 2 * total);
    let sampled = per_prompt(
        model,
        set,
        sampling.samples.max(1),
        sampling.temperature,
        sampling.seed,
        sampling.batch,
        |done| phase.update(done as u64, "sampled"),
    )?;
    let greedy = per_prompt(model, set, 1, 0.0, 0, sampling.batch, |done| {
        phase.update(total + done as u64, "greedy")
    })?;
    let turns = |p: &PerPrompt| (!p.turns.is_empty()).then(|| Estimate::of(&p.turns));
    let result = EvalResult {
        task: set.name.clone(),
        prompts: set.items.len(),
        samples: sampling.samples.max(1),
        temperature: sampling.temperature,
        pass_at_1: Estimate::rate(&sampled.passes),
        reward: Estimate::of(&sampled.rewards),
        greedy_accuracy: Estimate::rate(&greedy.passes),
        greedy_reward: Estimate::of(&greedy.rewards),
        turns: turns(&sampled),
        greedy_turns: turns(&greedy),
        tool_call_rate: (!sampled.calls.is_empty()).then(|| Estimate::rate(&sampled.calls)),
        tool_call_validity: (!sampled.calls.is_empty()).then(|| Estimate::rate(&sampled.valid)),
        seconds: started.elapsed().as_secs_f64(),
    };
    phase.finish(&result.line());
    Ok(result)
}

/// `model`, with `adapter` merged in when given. A LoRA checkpoint given as the model is
/// refused with the way to load it.
pub fn load_model(
    model: &Path,
    adapter: Option<&Path>,
) -> Result<Policy<InferBackend>, ModelError> {
    let device = Default::default();
    match adapter {
        Some(a) => Ok(crate::model::lora::load_with_adapter(model, a, &device)?.merged()),
        None if model.join(crate::model::lora::ADAPTER_CONFIG).exists()
            && !model.join("config.json").exists() =>
        {
            Err(ModelError::Unsupported(format!(
                "{} is a LoRA adapter, not a model: pass the base it was trained on as --model and this directory as --adapter",
                model.display()
            )))
        }
        None => load_hf(model, &device),
    }
}

/// `rlstream eval`: checks the options, loads the model, evaluates, writes `--json`.
pub fn run(opts: &EvalOptions, display: DisplayMode) -> Result<EvalResult, EvalError> {
    let usage = |m: &str| Err(EvalError::Usage(m.to_string()));
    let Some(dir) = &opts.model else {
        return usage("give --model DIR (a Hugging Face checkpoint)");
    };
    if opts.prompts == 0 || opts.samples == 0 || opts.batch == 0 {
        return usage("--prompts, --samples and --batch must be at least 1");
    }
    if !(opts.temperature.is_finite() && opts.temperature > 0.0) {
        return usage("--temperature must be > 0 (greedy results are always reported too)");
    }
    let model: Policy<InferBackend> = load_model(dir, opts.adapter.as_deref())?;
    let mut set = match (&opts.task, &opts.dataset) {
        (Some(_), Some(_)) => return usage("give --task or --dataset, not both"),
        (None, None) => {
            return usage(
                "give --task add|reverse|sort|longsort|longer|guess|calc or --dataset FILE \
                 (.jsonl or .parquet)",
            );
        }
        (Some(task), None) => {
            let vocab = tasks::char_tokenizer().vocab_size();
            if model.config().vocab_size != vocab {
                return Err(EvalError::Usage(format!(
                    "{} has a vocabulary of {} tokens, not the built-in tasks' {vocab}; built-in \
                     tasks evaluate models written by `rlstream sft` or `rlstream run`",
                    dir.display(),
                    model.config().vocab_size
                )));
            }
            EvalSet::task(*task, opts.prompts)
        }
        (None, Some(path)) => {
            let tok_dir = opts.tokenizer.as_deref().unwrap_or(dir);
            let tok = Tokenizer::load(tok_dir)?;
            let template = crate::model::chat::ChatTemplate::load(tok_dir)?;
            let stops = crate::model::hf::stop_tokens(dir, model.config());
            let cols = tasks::Columns {
                prompt: opts.prompt_column.clone(),
                answer: opts.answer_column.clone(),
                messages: opts.messages_column.clone(),
            };
            EvalSet::dataset(path, &cols, tok, template.as_ref(), stops, opts.prompts)?
        }
    };
    if opts.max_new_tokens > 0 {
        set.max_new_tokens = opts.max_new_tokens;
    }
    set.check_fits(&model.config().limits())?;
    let sampling = EvalSampling {
        samples: opts.samples,
        temperature: opts.temperature,
        seed: opts.seed,
        batch: opts.batch,
    };
    let result = evaluate(&model, &set, &sampling, display, "eval")?;
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(&result).unwrap_or_default();
        std::fs::write(path, text).map_err(|source| EvalError::Output {
            path: path.display().to_string(),
            source,
        })?;
    }
    Ok(result)
}

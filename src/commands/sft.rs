//! `rlstream sft`: a warm start. Trains a small policy on a built-in task's reference
//! answers (supervised, teacher-forced), so RL starts from a policy with a non-trivial
//! reward, and writes a Hugging Face checkpoint with the task tokenizer.

use crate::commands::eval::{self, EvalSet};
use crate::env::{calc, guess};
use crate::model::logprobs::{ScoredSeq, completion_logprobs};
use crate::model::tokenizer::{CharTokenizer, Tokenizer};
use crate::model::{Architecture, InferBackend, ModelConfig, ModelError, Policy, TrainBackend};
use crate::tasks::{self, BuiltinTask};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::path::PathBuf;
use std::time::Instant;

crate::settings! {
    /// A warm start: these are also the flags of `rlstream sft`.
    pub struct SftOptions, flags SftArgs, section "sft" {
        /// Built-in task whose answers to learn.
        pub task: BuiltinTask = BuiltinTask::Add,
        /// Directory the Hugging Face checkpoint is written to.
        #[arg(value_name = "DIR")]
        pub out: PathBuf = PathBuf::from("runs/sft"),
        /// Optimizer steps (at least 1).
        pub steps: u64 = 300,
        /// Sequences per step.
        pub batch: usize = 32,
        /// Learning rate (AdamW).
        pub lr: f64 = 3e-3,
        /// Seed of the model's initialisation and of the training prompts.
        pub seed: u64 = 0,
        /// Width of the model (hidden size); heads and MLP follow.
        pub hidden: usize = 64,
        /// Layers of the model.
        pub layers: usize = 2,
        /// Experts per layer: a Qwen3-MoE-shaped model whose every layer routes each token to 2 of this many experts (at least 2); 0 is a dense Qwen2-shaped model.
        pub experts: usize = 0,
        /// Prompts held out for the accuracy report.
        pub eval: usize = 64,
        /// Continue from this model (written by `rlstream sft` or `run`) instead of a random
        /// one, on fresh prompts: e.g. a warm start given more supervised training.
        #[arg(value_name = "DIR")]
        pub init: Option<PathBuf> = None,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SftSummary {
    pub params: usize,
    pub steps: u64,
    pub final_loss: f64,
    /// Greedy exact-answer rate / mean reward on held-out prompts.
    pub accuracy: f64,
    pub reward: f64,
    pub seconds: f64,
}

/// Experts each token of a built-in-task MoE model goes through.
pub const TASK_TOP_K: usize = 2;

/// The policy shape of a built-in-task model of width `hidden`: Qwen2-shaped, or with
/// `experts` > 0 Qwen3-MoE-shaped, every layer routing each token to [`TASK_TOP_K`]
/// experts of width `hidden` (so that two of them hold two thirds of the dense MLP's
/// weights).
pub fn task_config(hidden: usize, layers: usize, experts: usize) -> ModelConfig {
    let vocab = tasks::char_tokenizer().vocab_size();
    let arch = if experts > 0 {
        Architecture::Qwen3Moe
    } else {
        Architecture::Qwen2
    };
    ModelConfig::new(arch, vocab, hidden, hidden * 3, layers, 4, 2, hidden / 4)
        .with_qkv_bias(experts == 0)
        .with_qk_norm(experts > 0)
        .with_moe((experts > 0).then(|| crate::model::MoeConfig::new(experts, TASK_TOP_K, hidden)))
        .with_max_position(128)
        .with_eos_token_id(Some(CharTokenizer::EOS))
}

/// Salt of a continued run's prompts (`--init`), so it does not repeat the first run's.
const CONTINUE_SALT: u64 = 0xc047_150e;

/// The model `--init` names, which must speak the built-in tasks' tokenizer.
fn init_model(dir: &std::path::Path) -> Result<Policy<TrainBackend>, ModelError> {
    let model: Policy<TrainBackend> = crate::model::hf::load_hf(dir, &Default::default())?;
    let vocab = tasks::char_tokenizer().vocab_size();
    if model.config().vocab_size != vocab {
        return Err(ModelError::Config {
            field: "--init".into(),
            reason: format!(
                "{} has a vocabulary of {} tokens, not the built-in tasks' {vocab}",
                dir.display(),
                model.config().vocab_size
            ),
        });
    }
    Ok(model)
}

/// Demonstration `index` of `task`'s stream `seed`: prompt, completion and, per completion
/// token, whether it is the model's (an episode's environment tokens are not). A
/// single-turn task's is its reference answer and the stop token; `guess`'s is a game
/// played by a noisy bisection player, `calc`'s a question played by a player that calls
/// the calculator half the time.
fn demonstration(
    task: BuiltinTask,
    seed: u64,
    index: u64,
    tok: &CharTokenizer,
) -> (Vec<u32>, Vec<u32>, Vec<bool>) {
    let it = task.item(seed, index);
    let prompt = tok.encode(&it.prompt);
    let mut rng = StdRng::seed_from_u64(crate::seed::derive(seed, &format!("demo/{index}")));
    let encode = |t: &str| tok.encode(t);
    if task == BuiltinTask::Guess
        && let Ok(game) = guess::Guess::from_meta(&it.meta)
    {
        let (tokens, own) = guess::demonstration(
            &game,
            guess::DEMO_NOISE,
            &mut rng,
            encode,
            CharTokenizer::EOS,
        );
        return (prompt, tokens, own);
    }
    if task == BuiltinTask::Calc
        && let Ok(q) = calc::Calc::from_meta(&it.meta)
    {
        let (tokens, own) =
            calc::demonstration(&q, calc::DEMO_PLAYER, &mut rng, encode, CharTokenizer::EOS);
        return (prompt, tokens, own);
    }
    let mut answer = tok.encode(&it.answer);
    answer.push(CharTokenizer::EOS);
    let own = vec![true; answer.len()];
    (prompt, answer, own)
}

/// Trains and saves; `progress(step, loss)` is called after every step.
pub fn run(
    opts: &SftOptions,
    mut progress: impl FnMut(u64, f64),
) -> Result<SftSummary, ModelError> {
    if !opts.hidden.is_multiple_of(8) || opts.hidden == 0 {
        return Err(ModelError::Config {
            field: "--hidden".into(),
            reason: format!("{} must be a positive multiple of 8", opts.hidden),
        });
    }
    let started = Instant::now();
    let device = Default::default();
    let (mut model, prompt_seed) = match &opts.init {
        None => {
            if opts.experts == 1 {
                return Err(ModelError::Config {
                    field: "--experts".into(),
                    reason: format!(
                        "1 expert cannot route to {TASK_TOP_K}: give 0 (dense) or at least {TASK_TOP_K}"
                    ),
                });
            }
            let cfg = task_config(opts.hidden, opts.layers, opts.experts);
            (
                Policy::<TrainBackend>::random(&cfg, opts.seed, &device)?,
                opts.seed,
            )
        }
        Some(dir) => (init_model(dir)?, opts.seed ^ CONTINUE_SALT),
    };
    let cfg = model.config().clone();
    let mut optim = AdamWConfig::new().init();
    let tok = tasks::char_tokenizer();
    let mut final_loss = f64::NAN;
    for step in 0..opts.steps {
        let batch: Vec<(Vec<u32>, Vec<u32>, Vec<bool>)> = (0..opts.batch as u64)
            .map(|i| demonstration(opts.task, prompt_seed, step * opts.batch as u64 + i, &tok))
            .collect();
        let seqs: Vec<ScoredSeq<'_>> = batch
            .iter()
            .map(|(p, c, _)| ScoredSeq::plain(p, c))
            .collect();
        let (lp, valid) = completion_logprobs(&model, &seqs, 1.0);
        // Only the model's own tokens are learned: an episode's environment tokens are
        // context (zeros here).
        let [b, cmax] = lp.dims();
        let own: Vec<f32> = batch
            .iter()
            .flat_map(|(_, _, own)| {
                (0..cmax).map(move |j| f32::from(u8::from(own.get(j).copied().unwrap_or(false))))
            })
            .collect();
        let own = Tensor::<TrainBackend, 2>::from_data(TensorData::new(own, [b, cmax]), &device);
        let n: usize = batch
            .iter()
            .map(|(_, _, own)| own.iter().filter(|&&o| o).count())
            .sum();
        let loss = (lp * valid * own).sum().neg().div_scalar(n.max(1) as f32);
        final_loss = f64::from(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        // Linear decay to 10% keeps the end of training stable.
        let lr = opts.lr * (1.0 - 0.9 * step as f64 / opts.steps.max(1) as f64);
        model = optim.step(lr, model, grads);
        progress(step + 1, final_loss);
    }
    let trained = model.valid();
    trained.save_hf(&opts.out)?;
    Tokenizer::save_char(&tok, &opts.out)?;
    let infer =
        Policy::<InferBackend>::from_bytes(&cfg, &trained.to_bytes()?, &Default::default())?;
    // Greedy results on the held-out split (`rlstream eval` reports pass@1 too).
    let set = EvalSet::task(opts.task, opts.eval);
    let (accuracy, reward) = eval::greedy(&infer, &set, eval::BATCH, |_| {})?;
    let (accuracy, reward) = (accuracy.mean, reward.mean);
    Ok(SftSummary {
        params: cfg.num_params(),
        steps: opts.steps,
        final_loss,
        accuracy,
        reward,
        seconds: started.elapsed().as_secs_f64(),
    })
}

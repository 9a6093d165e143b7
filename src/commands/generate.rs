//! `rlstream generate`: load a checkpoint and sample from it, printing text or, with
//! `--json`, token ids and behaviour log-probs.

use crate::model::chat::ChatTemplate;
use crate::model::sampler::{Generator, Request};
use crate::model::tokenizer::Tokenizer;
use crate::model::{InferBackend, ModelError, Policy};
use crate::schema::{FinishReason, SamplingParams};
use std::io::Write;
use std::path::PathBuf;

/// What to sample: these are also the command's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateOptions {
    /// Model directory: config.json, model.safetensors (or a sharded index), tokenizer.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// A PEFT adapter directory (e.g. a LoRA trainer's checkpoint) applied to --model.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Prompt text (encoded with the model's tokenizer as is).
    #[arg(long, conflicts_with_all = ["prompt_ids", "chat"])]
    pub prompt: Option<String>,
    /// A user message, rendered with the model's chat template (tokenizer_config.json)
    /// and the assistant's opening.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: Option<String>,
    /// A system message before --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// The template's `enable_thinking` (Qwen3); the template's default when absent.
    #[arg(long, requires = "chat")]
    pub enable_thinking: Option<bool>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens per completion.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: u32,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Keep the smallest set of tokens with this much probability; 1 disables.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Completions to sample.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Print token ids and log-probs as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Usage(String),
    #[error("cannot write output: {0}")]
    Output(#[from] std::io::Error),
}

/// `--chat` (after `--system`) through the model's chat template, ready for the assistant.
fn render_chat(opts: &GenerateOptions, user: &str) -> Result<String, GenerateError> {
    let Some(template) = ChatTemplate::load(&opts.model)? else {
        return Err(GenerateError::Usage(format!(
            "{} has no chat template (tokenizer_config.json with chat_template); give --prompt",
            opts.model.display()
        )));
    };
    let mut messages = Vec::new();
    if let Some(system) = &opts.system {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    messages.push(serde_json::json!({"role": "user", "content": user}));
    let mut kwargs = serde_json::Map::new();
    if let Some(thinking) = opts.enable_thinking {
        kwargs.insert("enable_thinking".into(), thinking.into());
    }
    Ok(template.render(&messages, true, &kwargs)?)
}

/// The sampling flags, checked.
fn check_sampling(opts: &GenerateOptions) -> Result<(), GenerateError> {
    let usage = |m: String| Err(GenerateError::Usage(m));
    if !(opts.temperature.is_finite() && opts.temperature >= 0.0) {
        return usage(format!(
            "--temperature {} must be >= 0 (0 is greedy)",
            opts.temperature
        ));
    }
    if !(opts.top_p > 0.0 && opts.top_p <= 1.0) {
        return usage(format!("--top-p {} must be in (0, 1]", opts.top_p));
    }
    if opts.n == 0 || opts.max_new_tokens == 0 {
        return usage("--n and --max-new-tokens must be at least 1".into());
    }
    Ok(())
}

/// The prompt's ids: `--prompt-ids`, or `--prompt` / `--chat` encoded with the model's
/// tokenizer.
fn prompt_ids(
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
) -> Result<Vec<u32>, GenerateError> {
    let usage = |m: String| Err(GenerateError::Usage(m));
    let rendered = match &opts.chat {
        Some(user) => Some(render_chat(opts, user)?),
        None => opts.prompt.clone(),
    };
    match (&rendered, &opts.prompt_ids) {
        (Some(_), Some(_)) => usage("give --prompt or --prompt-ids, not both".into()),
        (None, None) => usage("give --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3".into()),
        (None, Some(ids)) => Ok(ids.clone()),
        (Some(text), None) => match tokenizer {
            Some(t) => Ok(t.encode(text)?),
            None => usage(format!(
                "{} has no tokenizer (tokenizer.json); pass --prompt-ids instead",
                opts.model.display()
            )),
        },
    }
}

pub fn run(opts: &GenerateOptions, out: &mut impl Write) -> Result<(), GenerateError> {
    let usage = |m: String| Err(GenerateError::Usage(m));
    check_sampling(opts)?;
    let model: Policy<InferBackend> =
        crate::commands::eval::load_model(&opts.model, opts.adapter.as_deref())?;
    let tokenizer = Tokenizer::load(&opts.model).ok();
    let prompt = prompt_ids(opts, tokenizer.as_ref())?;
    let vocab = model.config().vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return usage(format!(
            "prompt token {bad} is outside the vocabulary of {vocab}"
        ));
    }
    let params = SamplingParams {
        temperature: opts.temperature,
        top_k: opts.top_k,
        top_p: opts.top_p,
        max_new_tokens: opts.max_new_tokens,
        stop_tokens: crate::model::hf::stop_tokens(&opts.model, model.config()),
        seed: opts.seed,
    };
    let req = Request {
        id: 0,
        prompt: prompt.clone(),
        n: opts.n,
        params,
    };
    let started = std::time::Instant::now();
    let done = Generator::generate(&model, 0, &[req])?;
    let secs = started.elapsed().as_secs_f64();
    let text = |ids: &[u32]| tokenizer.as_ref().and_then(|t| t.decode(ids).ok());
    if opts.json {
        let completions: Vec<serde_json::Value> = done
            .iter()
            .map(|c| {
                serde_json::json!({
                    "ids": c.tokens,
                    "logprobs": c.logprobs,
                    "text": text(&c.tokens),
                    "finish": if c.finish == FinishReason::Stop { "stop" } else { "length" },
                })
            })
            .collect();
        let doc = serde_json::json!({ "prompt_ids": prompt, "completions": completions });
        writeln!(out, "{doc}")?;
    } else {
        for c in &done {
            match text(&c.tokens) {
                Some(t) => writeln!(out, "{t}")?,
                None => writeln!(out, "{:?}", c.tokens)?,
            }
        }
        let tokens: usize = done.iter().map(|c| c.tokens.len()).sum();
        tracing::info!(
            "{} completion(s), {tokens} tokens in {secs:.2} s",
            done.len()
        );
    }
    Ok(())
}

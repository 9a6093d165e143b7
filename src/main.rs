//! The `rlstream` command line: parse, build config, dispatch. No logic lives here.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use rlstream::bus::Topology;
use rlstream::commands::generate::{self, GenerateOptions};
use rlstream::schema::{self, json::msgpack_to_json};
use std::path::PathBuf;

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

#[derive(Subcommand)]
enum Command {
    /// Check a stream topology file and print the keys, groups and policy it resolves to.
    Streams {
        /// Topology file (default: the shipped streams/default.toml).
        #[arg(long, env = "RLSTREAM_TOPOLOGY")]
        topology: Option<PathBuf>,
        /// Override the namespace (key prefix).
        #[arg(long, env = "RLSTREAM_NAMESPACE")]
        namespace: Option<String>,
    },
    /// Sample from a Hugging Face checkpoint (Llama/Qwen2 family).
    Generate(GenerateArgs),
    /// Decode and validate a MessagePack message file, print it as JSON (bin as base64).
    Inspect {
        /// Message type.
        #[arg(long, value_enum)]
        kind: Kind,
        /// File holding one encoded message.
        file: PathBuf,
    },
}

#[derive(clap::Args)]
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

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Streams {
            topology,
            namespace,
        } => streams(topology, namespace),
        Command::Inspect { kind, file } => inspect(kind, file),
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
            Ok(generate::run(&opts, &mut std::io::stdout().lock())?)
        }
    }
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

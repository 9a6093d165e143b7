//! The command line's top: [`Cli`], the list of commands ([`Command`]), and how each is
//! configured and run.

use super::{
    dump, eval, feed, generate, inspect, load, replay, run, score, sft, stage_gen, status, streams,
    train, trim,
};
use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "rlstream",
    version,
    about = "Asynchronous RL for language-model policies over Redis streams"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// The whole pipeline in one process: warm start, then feed, gen, score and train on the
    /// embedded bus (or Redis with --redis), with a live display and a report.
    Run(Box<run::RunCommand>),
    /// Push prompts from a built-in task or a dataset (JSONL, Parquet) to the prompts stream.
    Feed(feed::FeedCommand),
    /// Generator: sample G completions per prompt, follow new weights without stopping.
    Gen(Box<stage_gen::GenCommand>),
    /// Scorer: reward completions, compute group advantages.
    Score(score::ScoreCommand),
    /// Trainer: importance-weighted policy gradient, weight publication, checkpoints.
    Train(Box<train::TrainCommand>),
    /// Warm start: supervised training on a built-in task's answers; writes a HF checkpoint.
    Sft(sft::SftCommand),
    /// Held-out results of a checkpoint: pass@1 and reward at the training temperature,
    /// greedy accuracy and reward, each with its 95% interval.
    Eval(eval::EvalCommand),
    /// Sample from a Hugging Face checkpoint (Llama, Qwen2, Qwen3 and their MoE variants).
    Generate(generate::GenerateCommand),
    /// A running pipeline at a glance, from Redis alone: each stream's length, pending and
    /// lag per group, consumers and their idle time, every process's version and
    /// throughput, the trainer's last step, the newest weights and dead letters.
    Status(status::StatusCommand),
    /// Read any range of a stream, from Redis or an archive, as JSON lines, a table or
    /// text with per-token versions and log-probs; with --train, re-run training from a
    /// checkpoint over the recorded scored entries and compare each step with the run.
    Replay(replay::ReplayCommand),
    /// Write stream ranges to an archive file (gzip; keeps entry ids and message bytes).
    Dump(dump::DumpCommand),
    /// Write an archive back into Redis under --namespace, keeping entry ids. Refuses
    /// streams that already hold newer entries.
    Load(load::LoadCommand),
    /// Remove old entries from a stream, never one a consumer group has not finished;
    /// with --archive, write them to a file first.
    Trim(trim::TrimCommand),
    /// Check a stream topology file and print the keys, groups and policy it resolves to.
    Streams(streams::StreamsCommand),
    /// Decode and validate a MessagePack message file, print it as JSON (bin as base64).
    Inspect(inspect::InspectCommand),
}

impl Cli {
    /// The command line with every command's help as it should read (a command whose
    /// defaults differ from the stages', `run`, shows its own).
    pub fn command_with_defaults() -> clap::Command {
        Cli::command().mut_subcommand("run", run::adjust)
    }

    /// Parses `args` (the program name first).
    pub fn try_parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Self::command_with_defaults().try_get_matches_from(args)?;
        Cli::from_arg_matches(&matches)
    }
}

impl Command {
    /// The settings the command would run with, from its defaults, the file, `env` and its
    /// flags (not yet validated: `exec` does that); `None` for a command without settings.
    pub fn config(
        &self,
        env: impl Iterator<Item = (String, String)>,
    ) -> Option<Result<crate::config::Config>> {
        Some(match self {
            Command::Run(a) => a.config(env),
            Command::Feed(a) => a.config(env),
            Command::Gen(a) => a.config(env),
            Command::Score(a) => a.config(env),
            Command::Train(a) => a.config(env),
            _ => return None,
        })
    }

    /// Runs the command.
    pub async fn exec(self) -> Result<()> {
        match self {
            Command::Run(a) => a.exec().await,
            Command::Feed(a) => a.exec().await,
            Command::Gen(a) => a.exec().await,
            Command::Score(a) => a.exec().await,
            Command::Train(a) => a.exec().await,
            Command::Sft(a) => a.exec(),
            Command::Eval(a) => a.exec(),
            Command::Generate(a) => a.exec(),
            Command::Status(a) => a.exec().await,
            Command::Replay(a) => a.exec().await,
            Command::Dump(a) => a.exec().await,
            Command::Load(a) => a.exec().await,
            Command::Trim(a) => a.exec().await,
            Command::Streams(a) => a.exec(),
            Command::Inspect(a) => a.exec(),
        }
    }

    /// The log level when `RUST_LOG` is not set: `run` shows its own progress and `replay`
    /// prints entries and steps on stdout, so stage logs below warnings would flood them.
    pub fn default_log_filter(&self) -> &'static str {
        match self {
            Command::Run(_) | Command::Replay(_) => "warn",
            // The GPU runtimes' own start-up lines (adapter, device features) are debugging
            // detail: warnings only.
            _ => "info,cubecl_wgpu=warn,cubecl_cuda=warn,wgpu_core=warn,wgpu_hal=warn,naga=warn",
        }
    }
}

//! `rlstream replay`.

use super::common::{StageArgs, plain_connect, point_bound};
use crate::commands::replay::{self, Format, ReadOptions, RetrainOptions, RewardFilter, Source};
use crate::roles::Stage;
use anyhow::{Result, bail};
use std::io::Write as _;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ReplayCommand {
    #[command(flatten)]
    stage: StageArgs,
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
    reward: Option<RewardFilter>,
    /// json (one object per line), table, or text (detokenised, per-token version and
    /// log-prob).
    #[arg(long, value_enum, default_value_t = Format::Json)]
    format: Format,
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

impl ReplayCommand {
    pub async fn exec(self) -> Result<()> {
        let (source, place) = match &self.archive {
            Some(path) => (
                Source::Archive(path.clone()),
                format!("the archive {}", path.display()),
            ),
            None => {
                let (cfg, topo, bus) = plain_connect(&self.stage, Stage::Replay).await?;
                let place = format!(
                    "namespace `{}` at {}",
                    topo.namespace,
                    crate::bus::redact_url(cfg.redis_url())
                );
                (Source::Bus { bus, topo }, place)
            }
        };
        let from = point_bound(self.from.as_deref())?;
        let to = point_bound(self.to.as_deref())?;
        if self.train {
            let Some(checkpoint) = self.checkpoint.clone() else {
                bail!("--train needs --checkpoint DIR (a step-* directory the trainer wrote)");
            };
            let opts = RetrainOptions {
                checkpoint,
                from,
                to,
                steps: self.steps,
            };
            println!("{}", replay::retrain_header());
            let s = replay::retrain(&source, &opts, |s| println!("{}", s.row())).await?;
            println!("{}", s.line());
            return Ok(());
        }
        let tokenizer = match &self.tokenizer {
            Some(dir) => Some(crate::model::tokenizer::Tokenizer::load(dir)?),
            None => None,
        };
        let opts = ReadOptions {
            stream: self.stream,
            from,
            to,
            count: self.count,
            group_id: self.group_id,
            min_staleness: self.min_staleness,
            reward: self.reward,
            format: self.format,
            tokenizer,
        };
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        let shown = replay::read(&source, &opts, &mut out).await?;
        let _ = out.flush();
        if shown == 0 && opts.count != Some(0) {
            bail!(
                "nothing to replay: no {} entries in {place} match the range and filters \
                 (`rlstream streams` lists what a namespace holds; `rlstream run` on the \
                 embedded bus keeps its streams only with --archive)",
                opts.stream
            );
        }
        Ok(())
    }
}

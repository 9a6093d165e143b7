//! `rlstream trim`.

use super::common::{StageArgs, plain_connect};
use crate::retention::{self, Keep};
use crate::roles::Stage;
use anyhow::{Result, bail};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct TrimCommand {
    #[command(flatten)]
    stage: StageArgs,
    /// The stream to trim (a name of the topology: prompts, rollouts, scored, ...).
    #[arg(long)]
    stream: String,
    /// Keep the newest N entries.
    #[arg(
        long,
        conflicts_with_all = ["older_than", "max_bytes"],
        required_unless_present_any = ["older_than", "max_bytes"]
    )]
    keep_last: Option<u64>,
    /// Remove entries older than this (90s, 30m, 12h, 7d).
    #[arg(long, conflicts_with = "max_bytes")]
    older_than: Option<String>,
    /// Keep what fits in this many bytes of Redis memory (`MEMORY USAGE`), the newest first.
    #[arg(long, value_name = "BYTES")]
    max_bytes: Option<u64>,
    /// Archive the removed entries here first (nothing is removed if that fails).
    #[arg(long)]
    archive: Option<PathBuf>,
}

impl TrimCommand {
    pub async fn exec(self) -> Result<()> {
        let keep = match self.max_bytes {
            Some(0) => bail!("--max-bytes 0 would remove everything; use a positive limit"),
            Some(b) => Keep::Bytes(b),
            None => Keep::from_flags(self.keep_last, self.older_than.as_deref())
                .map_err(anyhow::Error::msg)?,
        };
        if let Some(a) = &self.archive
            && a.exists()
        {
            bail!("{} exists: trim never overwrites an archive", a.display());
        }
        let (_, topo, bus) = plain_connect(&self.stage, Stage::Trim).await?;
        topo.select(std::slice::from_ref(&self.stream))?;
        let r = retention::trim(
            bus.as_ref(),
            &topo,
            &self.stream,
            keep,
            self.archive.as_deref(),
        )
        .await?;
        println!("{}", r.line(self.archive.as_deref()));
        Ok(())
    }
}

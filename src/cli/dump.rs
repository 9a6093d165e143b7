//! `rlstream dump`.

use super::common::{StageArgs, counter_bar, plain_connect, point_bound};
use crate::roles::Stage;
use anyhow::{Result, bail};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DumpCommand {
    #[command(flatten)]
    stage: StageArgs,
    /// Stream to archive (repeatable) [default: every stream of the topology].
    #[arg(long = "stream")]
    streams: Vec<String>,
    /// First entry: an id (MS-SEQ), epoch ms, a UTC time (2026-11-29T16:30:00Z) or a time
    /// ago (-10m) [default: the start].
    #[arg(long, allow_hyphen_values = true)]
    from: Option<String>,
    /// Last entry (inclusive), in the same forms [default: the end].
    #[arg(long, allow_hyphen_values = true)]
    to: Option<String>,
    /// The archive to write (refused if it exists).
    #[arg(long)]
    out: PathBuf,
}

impl DumpCommand {
    pub async fn exec(self) -> Result<()> {
        if self.out.exists() {
            bail!(
                "{} exists: dump never overwrites an archive",
                self.out.display()
            );
        }
        let (_, topo, bus) = plain_connect(&self.stage, Stage::Dump).await?;
        let streams = topo.select(&self.streams)?;
        let from = point_bound(self.from.as_deref())?;
        let to = point_bound(self.to.as_deref())?;
        let bar = counter_bar("dumping");
        let moved = crate::archive::dump(
            bus.as_ref(),
            &topo,
            &streams,
            from,
            to,
            &self.out,
            |s, n| {
                bar.set_message(s.to_string());
                bar.set_position(n);
            },
        )
        .await?;
        bar.finish_and_clear();
        println!("{}", moved.line("dumped", "to", &self.out));
        Ok(())
    }
}

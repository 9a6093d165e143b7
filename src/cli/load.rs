//! `rlstream load`.

use super::common::{StageArgs, counter_bar, plain_connect};
use crate::roles::Stage;
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct LoadCommand {
    #[command(flatten)]
    stage: StageArgs,
    /// The archive (written by `rlstream dump` or `rlstream trim --archive`).
    file: PathBuf,
    /// Load only this stream (repeatable) [default: all in the archive].
    #[arg(long = "stream")]
    streams: Vec<String>,
}

impl LoadCommand {
    pub async fn exec(self) -> Result<()> {
        let (_, topo, bus) = plain_connect(&self.stage, Stage::Load).await?;
        let only = (!self.streams.is_empty()).then_some(self.streams.as_slice());
        let bar = counter_bar("loading");
        let moved = crate::archive::load(bus.as_ref(), &topo, &self.file, only, |s, n| {
            bar.set_message(s.to_string());
            bar.set_position(n);
        })
        .await?;
        bar.finish_and_clear();
        println!(
            "{} into namespace {}",
            moved.line("loaded", "from", &self.file),
            topo.namespace
        );
        Ok(())
    }
}

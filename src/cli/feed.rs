//! `rlstream feed`.

use super::common::{StageArgs, connect, shutdown_signal};
use crate::config::{Config, DifficultyArgs, FeedArgs};
use crate::roles::{Stage, Stream};
use crate::stages::StageContext;
use anyhow::Result;

#[derive(clap::Args)]
pub struct FeedCommand {
    #[command(flatten)]
    stage: StageArgs,
    #[command(flatten)]
    feed: FeedArgs,
    #[command(flatten)]
    difficulty: DifficultyArgs,
}

impl FeedCommand {
    pub fn config(&self, env: impl Iterator<Item = (String, String)>) -> Result<Config> {
        self.stage.resolve(
            toml::Table::new(),
            env,
            [self.feed.layer(), self.difficulty.layer()],
        )
    }

    pub async fn exec(self) -> Result<()> {
        let cfg = self.config(std::env::vars())?;
        cfg.validate()?;
        let (topo, bus) = connect(&cfg, Stage::Feed).await?;
        let s = crate::stages::feed::run(
            &cfg.feed,
            &cfg.difficulty,
            StageContext::new((Stage::Feed, "feed"), bus, &topo, shutdown_signal()),
        )
        .await?;
        let mut skipped = match s.skipped {
            0 => String::new(),
            n => format!(" ({n} bad dataset rows skipped: listed above)"),
        };
        if cfg.difficulty.reoffer > 0.0 {
            skipped += &format!(", {} of them fed again by difficulty", s.reoffered);
        }
        println!(
            "fed {} prompts to {}{skipped}",
            s.fed,
            topo.key(Stream::Prompts)
        );
        Ok(())
    }
}

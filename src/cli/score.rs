//! `rlstream score`.

use super::common::{StageArgs, connect, shutdown_signal};
use crate::config::{Config, ScoreArgs};
use crate::roles::Stage;
use crate::stages::StageContext;
use anyhow::Result;

#[derive(clap::Args)]
pub struct ScoreCommand {
    #[command(flatten)]
    stage: StageArgs,
    #[command(flatten)]
    score: ScoreArgs,
}

impl ScoreCommand {
    pub fn config(&self, env: impl Iterator<Item = (String, String)>) -> Result<Config> {
        self.stage
            .resolve(toml::Table::new(), env, [self.score.layer()])
    }

    pub async fn exec(self) -> Result<()> {
        let cfg = self.config(std::env::vars())?;
        cfg.validate()?;
        let (topo, bus) = connect(&cfg, Stage::Score).await?;
        let s = crate::stages::score::run(
            &cfg.score,
            StageContext::new(
                (Stage::Score, &cfg.score.name),
                bus,
                &topo,
                shutdown_signal(),
            ),
        )
        .await?;
        let mean = if s.samples > 0 {
            s.reward_sum / s.samples as f64
        } else {
            0.0
        };
        println!(
            "scored {} groups (reward mean {mean:.3}), {} failed",
            s.scored, s.failed
        );
        Ok(())
    }
}

//! `rlstream train`.

use super::common::{StageArgs, connect, join_ranks, shutdown_signal};
use crate::config::{Config, PolicyArgs, TrainArgs, WeightsArgs};
use crate::roles::Stage;
use crate::stages::train::{self, TrainerSettings};
use crate::weights::Transport;
use anyhow::Result;

#[derive(clap::Args)]
pub struct TrainCommand {
    #[command(flatten)]
    stage: StageArgs,
    #[command(flatten)]
    policy: PolicyArgs,
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    weights: WeightsArgs,
}

impl TrainCommand {
    pub fn config(&self, env: impl Iterator<Item = (String, String)>) -> Result<Config> {
        self.stage.resolve(
            toml::Table::new(),
            env,
            [
                self.policy.layer(),
                self.train.layer(),
                self.weights.layer(),
            ],
        )
    }

    pub async fn exec(self) -> Result<()> {
        let cfg = self.config(std::env::vars())?;
        cfg.validate()?;
        let settings = TrainerSettings {
            policy: cfg.policy.clone(),
            train: cfg.train.clone(),
        };
        if join_ranks(&cfg, Some(&settings)).await? {
            return Ok(());
        }
        let (topo, bus) = connect(&cfg, Stage::Train).await?;
        let s = train::run(
            &settings,
            bus,
            &topo,
            Transport::Store(cfg.weights.clone()),
            shutdown_signal(),
            |_| {},
        )
        .await?;
        let first = s.history.first().map_or(0.0, |h| h.reward_mean);
        let last = s.history.last().map_or(0.0, |h| h.reward_mean);
        println!(
            "trained {} steps to version {} on {} groups; reward {first:.3} -> {last:.3}; dropped {:?}",
            s.steps, s.version, s.trained_groups, s.dropped
        );
        Ok(())
    }
}

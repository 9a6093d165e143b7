//! `rlstream train`.

use super::common::{StageArgs, connect, join_ranks, shutdown_signal};
use crate::config::{Config, PolicyArgs, TrainArgs, WeightsArgs};
use crate::roles::Stage;
use crate::stages::StageContext;
use crate::stages::train::{self, TrainJob, TrainerSettings};
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
        let Some(ranks) = join_ranks(&cfg, Some(&settings)).await? else {
            return Ok(());
        };
        let (topo, bus) = connect(&cfg, Stage::Train).await?;
        let job = TrainJob::new(&settings)
            .transport(Transport::Store(cfg.weights.clone()))
            .ranks(ranks);
        let role = (Stage::Train, cfg.train.name.as_str());
        let ctx = StageContext::new(role, bus, &topo, shutdown_signal());
        let s = train::run(job, ctx).await?;
        let first = s.history.first().map_or(0.0, |h| h.reward_mean);
        let last = s.history.last().map_or(0.0, |h| h.reward_mean);
        println!(
            "trained {} steps to version {} on {} groups; reward {first:.3} -> {last:.3}; dropped {:?}",
            s.steps, s.version, s.trained_groups, s.dropped
        );
        Ok(())
    }
}

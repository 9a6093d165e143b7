//! `rlstream gen`.

use super::common::{StageArgs, connect, shutdown_signal};
use crate::config::{Config, GenArgs, PolicyArgs, WeightsArgs};
use crate::roles::Stage;
use crate::stages::StageContext;
use crate::stages::generator as gen_stage;
use crate::weights::Transport;
use anyhow::{Result, bail};

#[derive(clap::Args)]
pub struct GenCommand {
    #[command(flatten)]
    stage: StageArgs,
    #[command(flatten)]
    policy: PolicyArgs,
    #[command(flatten)]
    generator: GenArgs,
    #[command(flatten)]
    weights: WeightsArgs,
}

impl GenCommand {
    pub fn config(&self, env: impl Iterator<Item = (String, String)>) -> Result<Config> {
        self.stage.resolve(
            toml::Table::new(),
            env,
            [
                self.policy.layer(),
                self.generator.layer(),
                self.weights.layer(),
            ],
        )
    }

    pub async fn exec(self) -> Result<()> {
        let cfg = self.config(std::env::vars())?;
        cfg.validate()?;
        let Some(dir) = cfg.policy.model.clone() else {
            bail!("gen needs --model DIR (a Hugging Face checkpoint, e.g. from `rlstream sft`)");
        };
        if cfg.generator.group_size == 1 {
            tracing::warn!(
                "--group-size 1: with the trainer's group-mean baseline every advantage is 0 \
                 and these groups train nothing (unless a teacher scores them); use 2 or more"
            );
        }
        let (topo, bus) = connect(&cfg, Stage::Gen).await?;
        let slot = gen_stage::initial_slot(&dir, cfg.generator.adapter.as_deref())?;
        let job = gen_stage::GenJob {
            policy: &cfg.policy,
            cfg: &cfg.generator,
            slot,
            transport: Transport::Store(cfg.weights.clone()),
        };
        let role = (Stage::Gen, cfg.generator.name.as_str());
        let s = gen_stage::run(job, StageContext::new(role, bus, &topo, shutdown_signal())).await?;
        println!(
            "generated {} groups, {} tokens; {} weight swaps, final version {}",
            s.groups, s.tokens, s.decode.swaps, s.final_version
        );
        Ok(())
    }
}

//! `rlstream sft`.

use crate::commands::sft::{self, SftArgs, SftOptions};
use anyhow::Result;

#[derive(clap::Args)]
pub struct SftCommand {
    #[command(flatten)]
    sft: SftArgs,
}

impl SftCommand {
    pub fn exec(self) -> Result<()> {
        let opts = self.sft.over(&SftOptions::default());
        if opts.steps == 0 {
            anyhow::bail!(
                "sft needs --steps of at least 1: with 0 it would write the initial model, untrained"
            );
        }
        let every = (opts.steps / 10).max(1);
        let s = sft::run(&opts, |step, loss| {
            if step % every == 0 || step == opts.steps {
                tracing::info!(step, loss = format!("{loss:.4}"), "sft");
            }
        })?;
        println!(
            "sft {}: {} params, {} steps in {:.1} s, loss {:.4}; held-out greedy accuracy {:.1}%, reward {:.3}; wrote {}",
            opts.task.name(),
            s.params,
            s.steps,
            s.seconds,
            s.final_loss,
            100.0 * s.accuracy,
            s.reward,
            opts.out.display()
        );
        Ok(())
    }
}

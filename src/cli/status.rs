//! `rlstream status`.

use super::common::{StageArgs, plain_connect, shutdown_signal};
use crate::commands::status;
use crate::roles::Stage;
use anyhow::{Result, bail};
use std::io::IsTerminal;

#[derive(clap::Args)]
pub struct StatusCommand {
    #[command(flatten)]
    stage: StageArgs,
    /// Redraw every SECS seconds (default 2) until Ctrl-C.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// Seconds of events that throughput and the process list cover.
    #[arg(long, default_value_t = 30.0)]
    window: f64,
    /// Print the snapshot as JSON (one object per refresh with --watch).
    #[arg(long)]
    json: bool,
}

impl StatusCommand {
    pub async fn exec(self) -> Result<()> {
        if !(self.window.is_finite() && self.window > 0.0) {
            bail!(
                "--window must be a positive number of seconds, got {}",
                self.window
            );
        }
        if let Some(every) = self.watch
            && !(every.is_finite() && every >= 0.1)
        {
            bail!("--watch takes a refresh interval of at least 0.1 s, got {every}");
        }
        let (cfg, topo, bus) = plain_connect(&self.stage, Stage::Status).await?;
        let name = crate::bus::redact_url(cfg.redis_url());
        let window = std::time::Duration::from_secs_f64(self.window);
        let clear = self.watch.is_some() && !self.json && std::io::stdout().is_terminal();
        let stop = shutdown_signal();
        tokio::pin!(stop);
        loop {
            let snapshot = status::collect(bus.as_ref(), &topo, &name, window).await?;
            if self.json {
                println!("{}", serde_json::to_string(&snapshot)?);
            } else {
                if clear {
                    // Clear the screen and home the cursor: a live view, not a scroll.
                    print!("\x1b[2J\x1b[H");
                }
                print!("{}", status::render(&snapshot));
                if self.watch.is_some() && !clear {
                    println!();
                }
            }
            let Some(every) = self.watch else { break };
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(std::time::Duration::from_secs_f64(every)) => {}
            }
        }
        Ok(())
    }
}

//! `rlstream generate`.

use crate::commands::generate::{self, GenerateOptions};
use anyhow::Result;

#[derive(clap::Args)]
pub struct GenerateCommand {
    #[command(flatten)]
    opts: GenerateOptions,
}

impl GenerateCommand {
    pub fn exec(self) -> Result<()> {
        generate::run(&self.opts, &mut std::io::stdout().lock())?;
        Ok(())
    }
}

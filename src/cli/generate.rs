//! `rlstream generate`.

use crate::commands::generate::{self, GenerateOptions};
use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    opts: GenerateOptions,
}

impl Args {
    pub fn exec(self) -> Result<()> {
        generate::run(&self.opts, &mut std::io::stdout().lock())?;
        Ok(())
    }
}

//! `rlstream eval`.

use crate::commands::eval::{self, EvalArgs, EvalOptions};
use crate::display::DisplayMode;
use anyhow::Result;

#[derive(clap::Args)]
pub struct EvalCommand {
    #[command(flatten)]
    eval: EvalArgs,
}

impl EvalCommand {
    pub fn exec(self) -> Result<()> {
        let opts = self.eval.over(&EvalOptions::default());
        let r = eval::run(&opts, DisplayMode::auto())?;
        println!("eval {}: {}", r.task, r.line());
        Ok(())
    }
}

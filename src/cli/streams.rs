//! `rlstream streams`.

use crate::bus::Topology;
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct StreamsCommand {
    /// Stream topology file [default: the shipped streams/default.toml].
    #[arg(long, env = "RLSTREAM_TOPOLOGY", value_name = "FILE")]
    topology: Option<PathBuf>,
    /// Key prefix to resolve the keys under [default: the topology's].
    #[arg(long)]
    namespace: Option<String>,
}

impl StreamsCommand {
    pub fn exec(self) -> Result<()> {
        let mut topo = match &self.topology {
            Some(p) => Topology::load(p)?,
            None => Topology::default(),
        };
        if let Some(ns) = &self.namespace {
            topo = topo.with_namespace(ns)?;
        }
        print!("{}", topo.describe());
        Ok(())
    }
}

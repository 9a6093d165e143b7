//! `rlstream inspect`.

use crate::schema::{self, json::msgpack_to_json};
use anyhow::{Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct InspectCommand {
    /// The message type the file holds.
    #[arg(long, value_enum)]
    kind: Kind,
    /// A MessagePack message file.
    file: PathBuf,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Kind {
    Prompt,
    RolloutGroup,
    ScoredGroup,
    WeightsAnnounce,
    DeadLetter,
    Event,
}

impl InspectCommand {
    pub fn exec(self) -> Result<()> {
        let file = &self.file;
        let bytes =
            std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
        let checked = match self.kind {
            Kind::Prompt => schema::decode::<schema::Prompt>(&bytes).map(drop),
            Kind::RolloutGroup => schema::decode::<schema::RolloutGroup>(&bytes).map(drop),
            Kind::ScoredGroup => schema::decode::<schema::ScoredGroup>(&bytes).map(drop),
            Kind::WeightsAnnounce => schema::decode::<schema::WeightsAnnounce>(&bytes).map(drop),
            Kind::DeadLetter => schema::decode::<schema::DeadLetter>(&bytes).map(drop),
            Kind::Event => schema::decode::<schema::Event>(&bytes).map(drop),
        };
        checked.with_context(|| format!("{} is not a valid message", file.display()))?;
        let json = msgpack_to_json(&bytes).map_err(anyhow::Error::msg)?;
        println!("{}", serde_json::to_string_pretty(&json)?);
        Ok(())
    }
}

//! The pipeline stages. Each is `run(config, bus, topology, shutdown)`: the same code runs as
//! a separate process (`rlstream gen|score|train|feed`) or as a task of `rlstream run`.
//! `shutdown` is any future; when it completes the stage finishes the batch in hand, acks
//! what is done, leaves the rest pending for others, and returns its summary.

pub mod feed;
pub mod generate;
pub mod score;
pub mod train;

use crate::bus::{Bus, BusError, Topology};
use crate::model::ModelError;
use crate::schema::CodecError;
use crate::weights::WeightsError;

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Dataset(#[from] crate::tasks::DatasetError),
    #[error("{0}")]
    Other(String),
}

/// Entries of `stream` that `group` has not finished, from XINFO: not yet delivered (lag),
/// plus delivered but unacked when `count_pending`; the whole stream while the group does
/// not exist yet. 0 when the stream cannot be read (the callers only pace with it).
pub async fn waiting(
    bus: &dyn Bus,
    topo: &Topology,
    stream: &str,
    group: &str,
    count_pending: bool,
) -> u64 {
    let Ok(s) = bus.stats(&topo.key(stream)).await else {
        return 0;
    };
    s.groups
        .iter()
        .find(|g| g.name == group)
        .map_or(s.length, |g| {
            g.lag.unwrap_or(0) + if count_pending { g.pending } else { 0 }
        })
}

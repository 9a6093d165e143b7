//! The pipeline stages. Each is `run(config, bus, topology, shutdown)`: the same code runs as
//! a separate process (`rlstream gen|score|train|feed`) or as a task of `rlstream run`.
//! `shutdown` is any future; when it completes the stage finishes the batch in hand, acks
//! what is done, leaves the rest pending for others, and returns its summary.

pub mod feed;
pub mod generate;
pub mod score;
pub mod train;

use crate::bus::BusError;
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

//! What can go wrong publishing, fetching and applying weights, and the limits a fetched
//! version must stay within.

use super::delta::DeltaError;
use crate::bus::BusError;
use crate::model::ModelError;
use crate::schema::CodecError;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("weights version {version}: chunk {chunk} is missing (trimmed before it was fetched?)")]
    MissingChunk { version: u64, chunk: u32 },
    #[error("weights version {version}: {found} bytes, announced {expected}")]
    Size {
        version: u64,
        expected: u64,
        found: u64,
    },
    #[error("weights version {version}: checksum {found}, announced {expected}; blob is corrupt")]
    Checksum {
        version: u64,
        expected: String,
        found: String,
    },
    #[error("weights version {version}: format `{format}` is not one this build reads")]
    Format { version: u64, format: String },
    #[error(
        "weights version {version}: announced {bytes} bytes in {chunks} chunks, which no real model has (limits: {MAX_WEIGHTS_BYTES} bytes, {MAX_CHUNKS} chunks); not fetched"
    )]
    Implausible {
        version: u64,
        bytes: u64,
        chunks: u32,
    },
    #[error("weights version {version}: delta does not apply: {source}")]
    Delta {
        version: u64,
        #[source]
        source: DeltaError,
    },
    #[error("weights version {version}: cannot be applied to the model in place: {source}")]
    Resident {
        version: u64,
        #[source]
        source: ResidentError,
    },
    #[error("weights version {version}: its base version {base} is not on the weights stream")]
    MissingBase { version: u64, base: u64 },
    #[error("weights store `{store}`: {reason}")]
    Store { store: &'static str, reason: String },
    #[error(
        "weights.max_bytes = {max} cannot hold a version of {full} bytes while the next one is written: it needs at least {need} (2 x the version); raise --max-bytes, or publish bf16 (--wire-dtype bf16)"
    )]
    Bound { max: u64, full: u64, need: u64 },
}

impl WeightsError {
    /// A fault of the version itself (corrupt, missing, not loadable) rather than of the
    /// connection: the follower rejects the version and keeps its weights.
    pub(crate) fn is_version_fault(&self) -> bool {
        !matches!(self, WeightsError::Bus(_) | WeightsError::Codec(_))
    }
}

/// Largest weights blob a follower fetches (1 TiB): an announce claiming more is refused
/// before anything is allocated, so a hostile or corrupt announce cannot exhaust memory.
pub const MAX_WEIGHTS_BYTES: u64 = 1 << 40;
/// Most chunks a follower fetches.
pub const MAX_CHUNKS: u32 = 1 << 20;

/// A version that cannot be applied to the values a generation model holds.
#[derive(Debug, thiserror::Error)]
pub enum ResidentError {
    #[error(transparent)]
    Delta(#[from] DeltaError),
    #[error("the model's parameters do not match the version's tensors: {0}")]
    Mismatch(String),
}

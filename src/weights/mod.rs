//! Weight publication and subscription.
//!
//! The trainer publishes each version as one object in a [`BlobStore`]: Redis chunks under
//! `{namespace}:weights:{version}:{chunk}` (the default) or a file in a shared directory;
//! then it appends a [`WeightsAnnounce`] with the size and xxh3 checksum of the whole
//! version to the weights stream, so readers never see an announce before its object.
//! Versions travel in the model's dtype (bf16 for a bf16 checkpoint; the trainer's master
//! weights stay f32). An object is the whole version (a keyframe) or, with deltas on, the
//! XOR of the version's bytes with the previous version's, compressed with zstd (see
//! [`delta`]): a keyframe every `keyframe_every` versions and whenever a generator asks for
//! one. The store keeps the newest `keep` versions with the chain each needs, within
//! `max_bytes`.
//!
//! Generators follow the stream with a [`Follower`]: a background task reads announces and
//! brings the newest version into the model slot off the decode thread. It holds two models,
//! the slot's and the one the last swap retired: a delta is XORed into the retired model's
//! own buffers ([`resident`]), which are checked against the announced checksum of the whole
//! version and swapped in, so no model is allocated per version. A keyframe is assembled as
//! bytes and written over them. The decode loop loads the slot once per forward pass. A
//! version that fails its checksum or does not fit is rejected (counted): the generator keeps
//! its weights.
//!
//! The publisher writes a version as it encodes it: segment by segment, each converted from
//! the trainer's tensors in the version's [`layout`], XORed and compressed, goes to the store
//! while the next is being made.
//!
//! In one process (`rlstream run`) a [`Transport::InProcess`] hands the trainer's host
//! tensors to the generator by reference instead of through a store. The version protocol
//! is the same: the announce still goes on the weights stream, with the format
//! [`IN_PROCESS_FORMAT`], and the follower still decides from it what to swap in.

mod config;
pub mod delta;
mod fetch;
mod follower;
mod format;
pub mod layout;
mod publisher;
pub mod resident;
mod slot;
pub mod store;
mod transport;

pub use config::{PublishDtype, StoreKind, WeightsArgs, WeightsConfig, checkpoint_dtype};
pub use fetch::{fetch, fetch_object, newest_announce};
pub use follower::Follower;
pub use format::{
    IN_PROCESS_FORMAT, LORA_IN_PROCESS_FORMAT, full_format, lora_format, params_bytes,
};
pub use publisher::Publisher;
pub use slot::{ModelSlot, Versioned};
pub use store::{BlobStore, DirStore, RedisStore};
pub use transport::{AdapterVersion, LocalWeights, Payload, Transport};

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
        source: delta::DeltaError,
    },
    #[error("weights version {version}: cannot be applied to the model in place: {source}")]
    Resident {
        version: u64,
        #[source]
        source: resident::ResidentError,
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

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
mod error;
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
pub use error::{MAX_CHUNKS, MAX_WEIGHTS_BYTES, WeightsError};
pub use fetch::{fetch, fetch_object, newest_announce};
pub use follower::Follower;
pub use format::{
    IN_PROCESS_FORMAT, LORA_IN_PROCESS_FORMAT, full_format, lora_format, params_bytes,
};
pub use publisher::Publisher;
pub use slot::{ModelSlot, Versioned};
pub use store::{BlobStore, DirStore, RedisStore};
pub use transport::{AdapterVersion, LocalWeights, Payload, Transport};

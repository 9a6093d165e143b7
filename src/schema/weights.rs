//! `WeightsAnnounce`: the trainer says a new policy version is ready to fetch.
//!
//! The weights themselves travel as `chunks` raw blobs under
//! `{namespace}:weights:{version}:{chunk}`; the announce goes on the weights stream only
//! after every chunk is written, so a reader never sees a version it cannot fetch.

use super::{CodecError, Message, SchemaVersion};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsAnnounce {
    pub schema: SchemaVersion,
    /// Policy version: optimizer steps taken by the weights.
    pub version: u64,
    /// Trainer step at publication (equal to `version` unless resumed from elsewhere).
    pub step: u64,
    pub kind: WeightsKind,
    /// Byte layout of the blob (`rlstream-params-v1`).
    pub format: String,
    /// Element type of the tensors in the blob (`f32`, `bf16`).
    pub dtype: String,
    /// Total blob size in bytes.
    pub bytes: u64,
    /// Number of chunks the blob is split into.
    pub chunks: u32,
    /// xxh3-64 of the whole blob, as 16 lowercase hex digits.
    pub checksum: String,
    /// When the trainer started and finished publishing, microseconds since the epoch.
    pub started_us: u64,
    pub published_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsKind {
    /// Every parameter of the policy.
    Full,
    /// Only adapter parameters.
    Lora,
}

impl Message for WeightsAnnounce {
    const KIND: &'static str = "WeightsAnnounce";
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
    fn validate(&self) -> Result<(), CodecError> {
        if self.format.is_empty() {
            return Err(CodecError::invalid(
                Self::KIND,
                "format",
                "must not be empty",
            ));
        }
        if self.chunks == 0 {
            return Err(CodecError::invalid(
                Self::KIND,
                "chunks",
                "must be at least 1",
            ));
        }
        if self.checksum.len() != 16 || !self.checksum.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CodecError::invalid(
                Self::KIND,
                "checksum",
                format!("`{}` is not 16 hex digits", self.checksum),
            ));
        }
        Ok(())
    }
}

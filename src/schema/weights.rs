//! `WeightsAnnounce`: the trainer says a new policy version is ready to fetch.
//!
//! The version's bytes are one object in a store (`store`): `chunks` raw blobs under
//! `{namespace}:weights:{version}:{chunk}` in Redis, or a file in a shared directory. The
//! object is the whole version (a safetensors blob) or a delta against an earlier one
//! (`base`): the XOR of the two blobs, compressed with zstd. `bytes` and `checksum` always
//! describe the whole version, which is what a generator loads and verifies; the object's
//! own size and checksum are `stored_bytes` and `stored_checksum`. The announce goes on the
//! weights stream only after the object is written, so a reader never sees a version it
//! cannot fetch.
//!
//! Schema 2.0: a 1.x reader would take a delta, or a version in a shared directory, for a
//! full blob in Redis chunks, so the major changed. 1.x announces still decode (full
//! versions in Redis).
//!
//! Schema 2.1 adds adapter versions (`kind` `lora`, format `lora-safetensors-f32` /
//! `lora-safetensors-bf16`): the whole adapter in PEFT's tensor names, never a delta, and
//! [`AdapterInfo`] (rank, alpha, target modules and the checksum of the base it applies
//! to). A 2.0 reader does not know the format and refuses the version rather than
//! misreading it, so the minor suffices.

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
    /// Byte layout of the stored object: `safetensors-f32` or `safetensors-bf16` for a whole
    /// version, [`DELTA_FORMAT`] for a delta.
    pub format: String,
    /// Element type of the tensors of the whole version (`f32`, `bf16`).
    pub dtype: String,
    /// Size of the whole version in bytes.
    pub bytes: u64,
    /// Number of chunks the stored object is split into (1 for a file).
    pub chunks: u32,
    /// xxh3-64 of the whole version, as 16 lowercase hex digits.
    pub checksum: String,
    /// Where the object is: `redis` (chunks beside the streams) or `dir` (a file in the
    /// shared directory). 1.x announces: `redis`.
    #[serde(default = "redis")]
    pub store: String,
    /// A delta's base: the version its XOR is against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    /// A delta's keyframe: the whole version its chain of deltas starts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyframe: Option<u64>,
    /// A delta's stored size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    /// xxh3-64 of a delta's stored bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_checksum: Option<String>,
    /// An adapter version's shape and base (schema 2.1; `kind` `lora` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<AdapterInfo>,
    /// When the trainer started and finished publishing, microseconds since the epoch.
    pub started_us: u64,
    pub published_us: u64,
}

/// What a generator needs besides the tensors to apply an adapter version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterInfo {
    /// LoRA rank r.
    pub rank: u32,
    /// Scaling numerator: the update is `(alpha / rank) · A · B`.
    pub alpha: f32,
    /// Target modules by Hugging Face name (`q_proj`, `down_proj`).
    pub targets: Vec<String>,
    /// xxh3-64 of the base weights the adapter applies to (every tensor by name and shape,
    /// f32 values, in name order), 16 hex digits. A generator whose base differs refuses
    /// the version.
    pub base_checksum: String,
}

/// `format` prefix of an adapter version (`lora-safetensors-bf16`).
pub const LORA_FORMAT_PREFIX: &str = "lora-";

/// `format` of a delta object: zstd of the XOR of the version's bytes with its base's.
pub const DELTA_FORMAT: &str = "xor-zstd";

fn redis() -> String {
    "redis".into()
}

impl WeightsAnnounce {
    /// Whether the stored object is a delta.
    pub fn is_delta(&self) -> bool {
        self.format == DELTA_FORMAT
    }

    /// The stored object's size: the delta's, or the whole version's.
    pub fn object_bytes(&self) -> u64 {
        self.stored_bytes.unwrap_or(self.bytes)
    }

    /// The stored object's checksum: the delta's, or the whole version's.
    pub fn object_checksum(&self) -> &str {
        self.stored_checksum.as_deref().unwrap_or(&self.checksum)
    }
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
    const SCHEMA: SchemaVersion = SchemaVersion { major: 2, minor: 1 };
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
        hex16("checksum", &self.checksum)?;
        self.validate_adapter()?;
        self.validate_delta()
    }
}

/// `v` as the 16 hex digits of an xxh3-64 checksum, or an error naming `field`.
fn hex16(field: &str, v: &str) -> Result<(), CodecError> {
    if v.len() != 16 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(CodecError::invalid(
            WeightsAnnounce::KIND,
            field,
            format!("`{v}` is not 16 hex digits"),
        ));
    }
    Ok(())
}

impl WeightsAnnounce {
    /// The adapter fields: present exactly for an adapter version, which is never a delta.
    fn validate_adapter(&self) -> Result<(), CodecError> {
        match (&self.kind, &self.lora) {
            (WeightsKind::Lora, Some(info)) => {
                hex16("lora.base_checksum", &info.base_checksum)?;
                if info.rank == 0 || !(info.alpha.is_finite() && info.alpha > 0.0) {
                    return Err(CodecError::invalid(
                        Self::KIND,
                        "lora",
                        format!("rank {} and alpha {} must be > 0", info.rank, info.alpha),
                    ));
                }
                if info.targets.is_empty() {
                    return Err(CodecError::invalid(
                        Self::KIND,
                        "lora.targets",
                        "must name at least one module",
                    ));
                }
                if self.is_delta() {
                    return Err(CodecError::invalid(
                        Self::KIND,
                        "format",
                        "an adapter version is always whole, never a delta",
                    ));
                }
            }
            (WeightsKind::Lora, None) => {
                return Err(CodecError::invalid(
                    Self::KIND,
                    "lora",
                    "an adapter version (kind lora) needs its rank, alpha, targets and base checksum",
                ));
            }
            (WeightsKind::Full, Some(_)) => {
                return Err(CodecError::invalid(
                    Self::KIND,
                    "lora",
                    "a full version (kind full) carries no adapter fields",
                ));
            }
            (WeightsKind::Full, None) => {}
        }
        Ok(())
    }

    /// A delta's base, keyframe and stored size and checksum: all there for a delta, none
    /// for a whole version.
    fn validate_delta(&self) -> Result<(), CodecError> {
        if let Some(c) = &self.stored_checksum {
            hex16("stored_checksum", c)?;
        }
        if !self.is_delta()
            && (self.base.is_some()
                || self.keyframe.is_some()
                || self.stored_bytes.is_some()
                || self.stored_checksum.is_some())
        {
            return Err(CodecError::invalid(
                Self::KIND,
                "base",
                format!(
                    "a whole version (format `{}`) has no base, keyframe or stored size",
                    self.format
                ),
            ));
        }
        if self.is_delta() {
            let (Some(base), Some(keyframe), Some(_), Some(_)) = (
                self.base,
                self.keyframe,
                self.stored_bytes,
                self.stored_checksum.as_ref(),
            ) else {
                return Err(CodecError::invalid(
                    Self::KIND,
                    "base",
                    "a delta needs base, keyframe, stored_bytes and stored_checksum",
                ));
            };
            if !(keyframe <= base && base < self.version) {
                return Err(CodecError::invalid(
                    Self::KIND,
                    "base",
                    format!(
                        "a delta of version {} needs keyframe <= base < version (keyframe {keyframe}, base {base})",
                        self.version
                    ),
                ));
            }
        }
        Ok(())
    }
}

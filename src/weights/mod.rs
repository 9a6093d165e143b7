//! Weight publication and subscription.
//!
//! The trainer publishes a version as a blob split into chunks under
//! `{namespace}:weights:{version}:{chunk}` (one pipelined batch of SETs), then appends a
//! [`WeightsAnnounce`] with the size and xxh3 checksum to the weights stream; readers never
//! see an announce before its chunks. Only the newest `keep` versions' chunks are kept.
//!
//! Generators follow the stream with a [`Follower`]: a background task reads announces,
//! fetches and verifies the newest blob, builds a fresh model off the decode thread, and
//! stores it in an `ArcSwap` that the decode loop loads once per forward pass. A blob that
//! fails its checksum or does not build is reported and skipped: the generator keeps its
//! current weights.

use crate::bus::{BusError, EntryId, SharedBus, Topology};
use crate::model::hf::{BLOB_FORMAT, checksum};
use crate::model::{ModelError, Policy, PolicyConfig};
use crate::schema::{self, CodecError, SchemaVersion, WeightsAnnounce, WeightsKind};
use arc_swap::ArcSwap;
use burn::tensor::backend::Backend;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Default chunk size: small enough for pipelined SETs to interleave with other traffic.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

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
    #[error("weights version {version}: format `{format}` is not {BLOB_FORMAT}")]
    Format { version: u64, format: String },
}

/// Writes versions to the bus.
pub struct Publisher {
    bus: SharedBus,
    topo: Topology,
    /// Versions whose chunks are kept.
    keep: usize,
    chunk_bytes: usize,
    published: Vec<(u64, u32)>,
}

impl Publisher {
    pub fn new(bus: SharedBus, topo: Topology, keep: usize) -> Self {
        Publisher {
            bus,
            topo,
            keep: keep.max(1),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            published: Vec::new(),
        }
    }

    pub fn with_chunk_bytes(mut self, n: usize) -> Self {
        self.chunk_bytes = n.max(1);
        self
    }

    /// Publishes `blob` as `version`, then deletes chunks of versions beyond `keep`.
    pub async fn publish(
        &mut self,
        version: u64,
        step: u64,
        blob: &[u8],
    ) -> Result<WeightsAnnounce, WeightsError> {
        let started_us = schema::now_us();
        let chunks: Vec<(String, Bytes)> = blob
            .chunks(self.chunk_bytes)
            .enumerate()
            .map(|(i, c)| {
                (
                    self.topo.weights_chunk_key(version, i as u32),
                    Bytes::copy_from_slice(c),
                )
            })
            .collect();
        let n = chunks.len().max(1) as u32;
        if chunks.is_empty() {
            self.bus
                .put_blobs(&[(self.topo.weights_chunk_key(version, 0), Bytes::new())])
                .await?;
        } else {
            self.bus.put_blobs(&chunks).await?;
        }
        let announce = WeightsAnnounce {
            schema: SchemaVersion::CURRENT,
            version,
            step,
            kind: WeightsKind::Full,
            format: BLOB_FORMAT.into(),
            dtype: "f32".into(),
            bytes: blob.len() as u64,
            chunks: n,
            checksum: checksum(blob),
            started_us,
            published_us: schema::now_us(),
        };
        let bytes = Bytes::from(schema::encode(&announce)?);
        let stream = self.topo.key("weights");
        self.bus
            .publish(&stream, &[bytes], self.topo.max_len("weights"))
            .await?;
        self.published.push((version, n));
        while self.published.len() > self.keep {
            let (old, chunks) = self.published.remove(0);
            let keys: Vec<String> = (0..chunks)
                .map(|c| self.topo.weights_chunk_key(old, c))
                .collect();
            self.bus.delete(&keys).await?;
        }
        Ok(announce)
    }
}

/// Fetches and verifies the blob of an announce.
pub async fn fetch(
    bus: &SharedBus,
    topo: &Topology,
    a: &WeightsAnnounce,
) -> Result<Vec<u8>, WeightsError> {
    if a.format != BLOB_FORMAT {
        return Err(WeightsError::Format {
            version: a.version,
            format: a.format.clone(),
        });
    }
    let keys: Vec<String> = (0..a.chunks)
        .map(|c| topo.weights_chunk_key(a.version, c))
        .collect();
    let parts = bus.get_blobs(&keys).await?;
    let mut blob = Vec::with_capacity(a.bytes as usize);
    for (i, p) in parts.into_iter().enumerate() {
        let p = p.ok_or(WeightsError::MissingChunk {
            version: a.version,
            chunk: i as u32,
        })?;
        blob.extend_from_slice(&p);
    }
    if blob.len() as u64 != a.bytes {
        return Err(WeightsError::Size {
            version: a.version,
            expected: a.bytes,
            found: blob.len() as u64,
        });
    }
    let found = checksum(&blob);
    if found != a.checksum {
        return Err(WeightsError::Checksum {
            version: a.version,
            expected: a.checksum.clone(),
            found,
        });
    }
    Ok(blob)
}

/// A model with the version it was built from.
pub struct Versioned<B: Backend> {
    pub version: u64,
    pub policy: Policy<B>,
}

/// The slot the decode loop reads its model from.
pub type ModelSlot<B> = Arc<ArcSwap<Versioned<B>>>;

/// Follows the weights stream and swaps new versions into a [`ModelSlot`].
pub struct Follower<B: Backend> {
    bus: SharedBus,
    topo: Topology,
    config: PolicyConfig,
    slot: ModelSlot<B>,
    last_id: EntryId,
    /// Versions rejected (bad checksum, bad shape), for reporting.
    pub rejected: u64,
}

impl<B: Backend> Follower<B>
where
    B::Device: Default,
{
    pub fn new(bus: SharedBus, topo: Topology, config: PolicyConfig, slot: ModelSlot<B>) -> Self {
        Follower {
            bus,
            topo,
            config,
            slot,
            last_id: EntryId::ZERO,
            rejected: 0,
        }
    }

    /// Reads announces for up to `block`; if one is newer than the current model, fetches,
    /// verifies, builds and swaps it in. Returns the version swapped in, if any.
    pub async fn poll(&mut self, block: Duration) -> Result<Option<u64>, WeightsError> {
        let stream = self.topo.key("weights");
        let entries = self
            .bus
            .read_after(&stream, self.last_id, 64, Some(block))
            .await?;
        let Some(last) = entries.last() else {
            return Ok(None);
        };
        self.last_id = last.id;
        // Only the newest announce matters: older ones are already superseded.
        let newest = entries
            .iter()
            .rev()
            .find_map(|e| match schema::decode::<WeightsAnnounce>(&e.payload) {
                Ok(a) => Some(a),
                Err(err) => {
                    tracing::warn!(id = %e.id, error = %err, "ignoring an undecodable weights announce");
                    None
                }
            });
        let Some(a) = newest else { return Ok(None) };
        let current = self.slot.load().version;
        if a.version <= current {
            return Ok(None);
        }
        let blob = match fetch(&self.bus, &self.topo, &a).await {
            Ok(b) => b,
            Err(
                e @ (WeightsError::Checksum { .. }
                | WeightsError::Size { .. }
                | WeightsError::MissingChunk { .. }
                | WeightsError::Format { .. }),
            ) => {
                self.rejected += 1;
                tracing::error!(version = a.version, error = %e, "rejected new weights; keeping version {current}");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let config = self.config.clone();
        let built = tokio::task::spawn_blocking(move || {
            Policy::<B>::from_bytes(&config, &blob, &B::Device::default())
        })
        .await
        .map_err(|e| ModelError::Unsupported(format!("weight build task failed: {e}")))?;
        match built {
            Ok(policy) => {
                self.slot.store(Arc::new(Versioned {
                    version: a.version,
                    policy,
                }));
                Ok(Some(a.version))
            }
            Err(e) => {
                self.rejected += 1;
                tracing::error!(version = a.version, error = %e, "new weights do not fit the model; keeping version {current}");
                Ok(None)
            }
        }
    }
}

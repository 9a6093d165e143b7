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
//!
//! In one process (`rlstream run`) a [`Transport::InProcess`] hands the trainer's host
//! tensors to the generator by reference instead of through a serialized blob. The version
//! protocol is the same: the announce still goes on the weights stream, with the format
//! [`IN_PROCESS_FORMAT`], and the follower still decides from it what to swap in.

use crate::bus::{BusError, EntryId, RangeBound, SharedBus, Topology};
use crate::model::hf::{BLOB_FORMAT, TensorMap, checksum, tensors_checksum};
use crate::model::{ModelError, Policy, PolicyConfig};
use crate::roles::{Stage, Stream};
use crate::schema::{self, CodecError, SchemaVersion, WeightsAnnounce, WeightsKind};
use arc_swap::ArcSwap;
use burn::tensor::backend::Backend;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Format tag of versions handed over in process (no blob: host tensors by reference).
pub const IN_PROCESS_FORMAT: &str = "in-process-f32";

/// How weights travel from the trainer to the generators.
#[derive(Clone, Default)]
pub enum Transport {
    /// Serialized, checksummed blobs in the bus (works across processes and machines).
    #[default]
    Bus,
    /// Host tensors shared in memory; trainer and generators must be in one process.
    InProcess(LocalWeights),
}

/// The versions a trainer handed over in process, newest `keep` kept.
#[derive(Clone, Default)]
pub struct LocalWeights(Arc<Mutex<BTreeMap<u64, Arc<TensorMap>>>>);

impl LocalWeights {
    fn put(&self, version: u64, tensors: Arc<TensorMap>, keep: usize) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(version, tensors);
        while m.len() > keep {
            m.pop_first();
        }
    }

    fn get(&self, version: u64) -> Option<Arc<TensorMap>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&version)
            .cloned()
    }
}

/// What the trainer hands to [`Publisher::publish`]: a serialized blob, or host tensors
/// for an in-process transport.
pub enum Payload {
    Blob(Vec<u8>),
    Tensors(TensorMap),
}

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
    #[error(
        "weights version {version}: announced {bytes} bytes in {chunks} chunks, which no real model has (limits: {MAX_WEIGHTS_BYTES} bytes, {MAX_CHUNKS} chunks); not fetched"
    )]
    Implausible {
        version: u64,
        bytes: u64,
        chunks: u32,
    },
}

/// Largest weights blob a follower fetches (1 TiB): an announce claiming more is refused
/// before anything is allocated, so a hostile or corrupt announce cannot exhaust memory.
pub const MAX_WEIGHTS_BYTES: u64 = 1 << 40;
/// Most chunks a follower fetches.
pub const MAX_CHUNKS: u32 = 1 << 20;
/// Most bytes reserved up front while assembling a blob (it grows past this as chunks
/// arrive).
const PREALLOC_LIMIT: u64 = 256 << 20;

/// Writes versions to the bus.
pub struct Publisher {
    bus: SharedBus,
    topo: Topology,
    /// Versions whose chunks are kept.
    keep: usize,
    chunk_bytes: usize,
    published: Vec<(u64, u32)>,
    transport: Transport,
}

impl Publisher {
    pub fn new(bus: SharedBus, topo: Topology, keep: usize) -> Self {
        Publisher {
            bus,
            topo,
            keep: keep.max(1),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            published: Vec::new(),
            transport: Transport::Bus,
        }
    }

    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Whether [`Publisher::publish_payload`] wants host tensors rather than a blob.
    pub fn in_process(&self) -> bool {
        matches!(self.transport, Transport::InProcess(_))
    }

    /// Publishes a version in the form the transport takes: tensors are handed over in
    /// process (announced with [`IN_PROCESS_FORMAT`]), a blob goes through the bus.
    pub async fn publish_payload(
        &mut self,
        version: u64,
        step: u64,
        payload: Payload,
    ) -> Result<WeightsAnnounce, WeightsError> {
        match (payload, &self.transport) {
            (Payload::Tensors(t), Transport::InProcess(local)) => {
                let started_us = schema::now_us();
                let bytes = t.values().map(|h| h.data.len() as u64 * 4).sum();
                let checksum = tensors_checksum(&t);
                local.put(version, Arc::new(t), self.keep);
                let announce = WeightsAnnounce {
                    schema: SchemaVersion::CURRENT,
                    version,
                    step,
                    kind: WeightsKind::Full,
                    format: IN_PROCESS_FORMAT.into(),
                    dtype: "f32".into(),
                    bytes,
                    // One in-memory object; the checksum covers names, shapes and values.
                    chunks: 1,
                    checksum,
                    started_us,
                    published_us: schema::now_us(),
                };
                self.announce(&announce).await?;
                Ok(announce)
            }
            (Payload::Blob(b), _) => self.publish(version, step, &b).await,
            (Payload::Tensors(t), Transport::Bus) => {
                let blob = crate::model::hf::tensors_to_safetensors(&t)?;
                self.publish(version, step, &blob).await
            }
        }
    }

    async fn announce(&self, announce: &WeightsAnnounce) -> Result<(), WeightsError> {
        let bytes = Bytes::from(schema::encode(announce)?);
        let stream = self.topo.key(Stream::Weights);
        self.bus
            .publish(&stream, &[bytes], self.topo.max_len(Stream::Weights))
            .await?;
        Ok(())
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
        self.announce(&announce).await?;
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

/// The newest weights announce on the weights stream, if any. The last entry is the newest:
/// versions only go up (see `stages::train::run` on resume).
pub async fn newest_announce(
    bus: &dyn crate::bus::Bus,
    topo: &Topology,
) -> Result<Option<WeightsAnnounce>, WeightsError> {
    let stream = topo.key(Stream::Weights);
    let Some(last) = bus.stats(&stream).await?.last_id else {
        return Ok(None);
    };
    let entries = bus
        .range(&stream, RangeBound::Inclusive(last), RangeBound::Open, 1)
        .await?;
    Ok(entries
        .first()
        .and_then(|e| schema::decode::<WeightsAnnounce>(&e.payload).ok()))
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
    if a.bytes > MAX_WEIGHTS_BYTES || a.chunks > MAX_CHUNKS || u64::from(a.chunks) > a.bytes.max(1)
    {
        return Err(WeightsError::Implausible {
            version: a.version,
            bytes: a.bytes,
            chunks: a.chunks,
        });
    }
    let keys: Vec<String> = (0..a.chunks)
        .map(|c| topo.weights_chunk_key(a.version, c))
        .collect();
    let parts = bus.get_blobs(&keys).await?;
    let mut blob = Vec::with_capacity(a.bytes.min(PREALLOC_LIMIT) as usize);
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

/// The slot the decode loop reads its model from: one atomic load per forward pass. Cloning
/// shares the slot. Waiters for a version ([`ModelSlot::reached`]) are woken by each swap.
pub struct ModelSlot<B: Backend> {
    model: Arc<ArcSwap<Versioned<B>>>,
    version: Arc<tokio::sync::watch::Sender<u64>>,
}

impl<B: Backend> Clone for ModelSlot<B> {
    fn clone(&self) -> Self {
        ModelSlot {
            model: self.model.clone(),
            version: self.version.clone(),
        }
    }
}

impl<B: Backend> ModelSlot<B> {
    pub fn new(model: Versioned<B>) -> Self {
        let version = tokio::sync::watch::Sender::new(model.version);
        ModelSlot {
            model: Arc::new(ArcSwap::from_pointee(model)),
            version: Arc::new(version),
        }
    }

    /// The current model.
    pub fn load(&self) -> Arc<Versioned<B>> {
        self.model.load_full()
    }

    /// Swaps `model` in and wakes the waiters.
    pub fn store(&self, model: Versioned<B>) {
        let version = model.version;
        self.model.store(Arc::new(model));
        self.version.send_replace(version);
    }

    /// Waits until the slot holds `version` or a newer one.
    pub async fn reached(&self, version: u64) {
        let mut rx = self.version.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = rx.wait_for(|v| *v >= version).await;
    }
}

/// Follows the weights stream and swaps new versions into a [`ModelSlot`].
pub struct Follower<B: Backend> {
    bus: SharedBus,
    topo: Topology,
    config: PolicyConfig,
    slot: ModelSlot<B>,
    last_id: EntryId,
    transport: Transport,
    /// Versions rejected (bad checksum, bad shape), for reporting.
    pub rejected: u64,
    /// The newest version announced and not rejected: how far the trainer is ahead of the
    /// slot, for the generator's in-flight bound.
    announced: Arc<AtomicU64>,
}

impl<B: Backend> Follower<B>
where
    B::Device: Default,
{
    pub fn new(bus: SharedBus, topo: Topology, config: PolicyConfig, slot: ModelSlot<B>) -> Self {
        let version = slot.load().version;
        Follower {
            bus,
            topo,
            config,
            slot,
            last_id: EntryId::ZERO,
            transport: Transport::Bus,
            rejected: 0,
            announced: Arc::new(AtomicU64::new(version)),
        }
    }

    /// The newest version announced on the weights stream and not rejected (the slot's
    /// version until one is read).
    pub fn announced(&self) -> Arc<AtomicU64> {
        self.announced.clone()
    }

    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Reads announces for up to `block`; if one is newer than the current model, fetches,
    /// verifies, builds and swaps it in. Returns the version swapped in, if any.
    pub async fn poll(&mut self, block: Duration) -> Result<Option<u64>, WeightsError> {
        let stream = self.topo.key(Stream::Weights);
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
        self.announced.fetch_max(a.version, Ordering::Relaxed);
        let began = std::time::Instant::now();
        let swapped = self.sync(a, current).await?;
        if swapped.is_some() {
            crate::metrics::weight_sync(Stage::Gen, began.elapsed().as_secs_f64());
        }
        Ok(swapped)
    }

    /// Fetches, verifies and builds the announced version and swaps it in; a corrupt or
    /// unreadable version is rejected (counted) and `current` kept.
    async fn sync(
        &mut self,
        a: WeightsAnnounce,
        current: u64,
    ) -> Result<Option<u64>, WeightsError> {
        if a.format == IN_PROCESS_FORMAT {
            let local = match &self.transport {
                Transport::InProcess(local) => local.get(a.version),
                Transport::Bus => None,
            };
            let Some(tensors) = local else {
                self.reject();
                tracing::error!(
                    version = a.version,
                    "weights were handed over in another process's memory and cannot be read \
                     here: run the trainer with the bus transport; keeping version {current}"
                );
                return Ok(None);
            };
            let found = tensors_checksum(&tensors);
            if found != a.checksum {
                self.reject();
                let e = WeightsError::Checksum {
                    version: a.version,
                    expected: a.checksum.clone(),
                    found,
                };
                tracing::error!(version = a.version, error = %e, "rejected new weights; keeping version {current}");
                return Ok(None);
            }
            return self
                .build(a.version, current, move |cfg, dev| {
                    Policy::<B>::from_tensors(cfg, &tensors, dev)
                })
                .await;
        }
        let blob = match fetch(&self.bus, &self.topo, &a).await {
            Ok(b) => b,
            Err(
                e @ (WeightsError::Checksum { .. }
                | WeightsError::Size { .. }
                | WeightsError::MissingChunk { .. }
                | WeightsError::Format { .. }
                | WeightsError::Implausible { .. }),
            ) => {
                self.reject();
                tracing::error!(version = a.version, error = %e, "rejected new weights; keeping version {current}");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.build(a.version, current, move |cfg, dev| {
            Policy::<B>::from_bytes(cfg, &blob, dev)
        })
        .await
    }

    fn reject(&mut self) {
        // A rejected version will not be swapped in: it no longer counts as the newest.
        self.announced
            .store(self.slot.load().version, Ordering::Relaxed);
        self.rejected += 1;
        crate::metrics::error(Stage::Gen, "weights_rejected");
    }

    /// Builds a version off the async threads and swaps it in; a version that does not fit
    /// the model is rejected and the current one kept.
    async fn build(
        &mut self,
        version: u64,
        current: u64,
        make: impl FnOnce(&PolicyConfig, &B::Device) -> Result<Policy<B>, ModelError> + Send + 'static,
    ) -> Result<Option<u64>, WeightsError> {
        let config = self.config.clone();
        let built = tokio::task::spawn_blocking(move || make(&config, &B::Device::default()))
            .await
            .map_err(|e| ModelError::Unsupported(format!("weight build task failed: {e}")))?;
        match built {
            Ok(policy) => {
                self.slot.store(Versioned { version, policy });
                Ok(Some(version))
            }
            Err(e) => {
                self.reject();
                tracing::error!(version, error = %e, "new weights do not fit the model; keeping version {current}");
                Ok(None)
            }
        }
    }
}

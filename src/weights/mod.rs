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
//! Generators follow the stream with a [`Follower`]: a background task reads announces,
//! assembles the newest version by the shortest path (deltas on top of the bytes it holds,
//! or the keyframe and the deltas after it), verifies it against the announced checksum of
//! the whole version, builds a fresh model off the decode thread, and stores it in an
//! `ArcSwap` that the decode loop loads once per forward pass. A version that fails its
//! checksum or does not build is rejected (counted): the generator keeps its weights.
//!
//! In one process (`rlstream run`) a [`Transport::InProcess`] hands the trainer's host
//! tensors to the generator by reference instead of through a store. The version protocol
//! is the same: the announce still goes on the weights stream, with the format
//! [`IN_PROCESS_FORMAT`], and the follower still decides from it what to swap in.

mod config;
pub mod delta;
pub mod store;

pub use config::{StoreKind, WeightsArgs, WeightsConfig, WireDtype, checkpoint_dtype};
pub use store::{BlobStore, DirStore, RedisStore};

use crate::bus::{BusError, EntryId, RangeBound, SharedBus, Topology};
use crate::model::hf::{
    TensorMap, WeightDtype, checksum, safetensors_to_tensors, tensors_checksum,
    tensors_to_safetensors_as,
};
use crate::model::lora::{LoraSpec, Target};
use crate::model::{ModelError, Policy, PolicyConfig};
use crate::roles::{Stage, Stream};
use crate::schema::{
    self, AdapterInfo, CodecError, DELTA_FORMAT, LORA_FORMAT_PREFIX, Message, WeightsAnnounce,
    WeightsKind,
};
use arc_swap::ArcSwap;
use burn::tensor::backend::Backend;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Format tag of versions handed over in process (no blob: host tensors by reference).
pub const IN_PROCESS_FORMAT: &str = "in-process-f32";

/// Format tag of a whole version in `dtype`: a safetensors blob.
pub fn full_format(dtype: WeightDtype) -> &'static str {
    match dtype {
        WeightDtype::F32 => "safetensors-f32",
        WeightDtype::Bf16 => "safetensors-bf16",
    }
}

/// The size of a whole version of a `cfg` model in `dtype` (the tensors; the safetensors
/// header adds a few kilobytes).
pub fn version_bytes(cfg: &PolicyConfig, dtype: WeightDtype) -> u64 {
    params_bytes(cfg.num_params(), dtype)
}

/// Whether `format` is a whole version a follower can load.
fn is_full_format(format: &str) -> bool {
    format == "safetensors-f32" || format == "safetensors-bf16"
}

/// Format tag of a whole adapter in `dtype`: a safetensors blob in PEFT's tensor names.
pub fn lora_format(dtype: WeightDtype) -> String {
    format!("{LORA_FORMAT_PREFIX}{}", full_format(dtype))
}

/// Format tag of an adapter handed over in process.
pub const LORA_IN_PROCESS_FORMAT: &str = "lora-in-process-f32";

/// Whether `format` is an object a follower reads whole (a full version or an adapter).
fn is_whole_format(format: &str) -> bool {
    is_full_format(format)
        || format
            .strip_prefix(LORA_FORMAT_PREFIX)
            .is_some_and(is_full_format)
}

/// The size of a version of `params` parameters in `dtype`.
pub fn params_bytes(params: usize, dtype: WeightDtype) -> u64 {
    let width = match dtype {
        WeightDtype::F32 => 4,
        WeightDtype::Bf16 => 2,
    };
    params as u64 * width
}

/// How weights travel from the trainer to the generators.
#[derive(Clone, Default)]
pub enum Transport {
    /// Serialized, checksummed versions in Redis chunks with the default `[weights]`
    /// settings (works across processes and machines).
    #[default]
    Bus,
    /// Serialized, checksummed versions in the store these settings name.
    Store(WeightsConfig),
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

/// What the trainer hands to [`Publisher::publish_payload`]: host tensors (encoded in the
/// publisher's dtype, or handed over in process), or an encoded whole version.
pub enum Payload {
    Blob(Vec<u8>),
    Tensors(TensorMap),
    /// A LoRA trainer's version: the whole adapter.
    Adapter(AdapterVersion),
}

/// An adapter version: its tensors (PEFT names and layout), shape, and the base it applies
/// to.
pub struct AdapterVersion {
    pub tensors: TensorMap,
    pub spec: LoraSpec,
    /// [`Policy::base_checksum`] of the trainer's frozen base.
    pub base_checksum: String,
}

impl AdapterVersion {
    fn info(&self) -> AdapterInfo {
        AdapterInfo {
            rank: self.spec.rank as u32,
            alpha: self.spec.alpha,
            targets: self
                .spec
                .targets
                .iter()
                .map(|t| t.module().to_string())
                .collect(),
            base_checksum: self.base_checksum.clone(),
        }
    }
}

/// The adapter an announce describes (dropout 0: generators do not train).
fn announced_spec(version: u64, info: &AdapterInfo) -> Result<LoraSpec, WeightsError> {
    let spec = LoraSpec {
        rank: info.rank as usize,
        alpha: info.alpha,
        dropout: 0.0,
        targets: Target::parse_list(&info.targets.join(",")).map_err(|reason| {
            WeightsError::Format {
                version,
                format: format!("adapter targets: {reason}"),
            }
        })?,
    };
    spec.validate().map_err(|reason| WeightsError::Format {
        version,
        format: format!("adapter: {reason}"),
    })?;
    Ok(spec)
}

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
    fn is_version_fault(&self) -> bool {
        !matches!(self, WeightsError::Bus(_) | WeightsError::Codec(_))
    }
}

/// Largest weights blob a follower fetches (1 TiB): an announce claiming more is refused
/// before anything is allocated, so a hostile or corrupt announce cannot exhaust memory.
pub const MAX_WEIGHTS_BYTES: u64 = 1 << 40;
/// Most chunks a follower fetches.
pub const MAX_CHUNKS: u32 = 1 << 20;

/// The key a generator sets to ask the trainer for a keyframe.
fn keyframe_request_key(topo: &Topology) -> String {
    format!("{}:weights:keyframe-request", topo.namespace)
}

/// A version object the publisher has in its store.
#[derive(Debug, Clone, Copy)]
struct Held {
    version: u64,
    /// The version a delta applies to; `None` for a keyframe.
    base: Option<u64>,
    chunks: u32,
    bytes: u64,
}

/// Writes versions to a store and announces them.
pub struct Publisher {
    bus: SharedBus,
    topo: Topology,
    /// Versions kept (each with the chain of deltas down to its keyframe).
    keep: usize,
    transport: Transport,
    store: Arc<dyn BlobStore>,
    cfg: WeightsConfig,
    dtype: WeightDtype,
    /// Objects in the store, oldest first.
    held: Vec<Held>,
    /// The previous version's whole bytes: the base of the next delta.
    prev: Option<(u64, Arc<Vec<u8>>)>,
    /// The newest keyframe, and the delta bytes published on top of it since.
    keyframe: Option<(u64, u64)>,
}

impl Publisher {
    /// A publisher to Redis chunks with the default settings, f32 on the wire.
    pub fn new(bus: SharedBus, topo: Topology, keep: usize) -> Self {
        let cfg = WeightsConfig::default();
        let store = Arc::new(RedisStore {
            bus: bus.clone(),
            topo: topo.clone(),
            chunk_bytes: cfg.chunk_bytes,
        });
        Publisher {
            bus,
            topo,
            keep: keep.max(1),
            transport: Transport::Bus,
            store,
            cfg,
            dtype: WeightDtype::F32,
            held: Vec::new(),
            prev: None,
            keyframe: None,
        }
    }

    /// Publishes as `cfg` says (store, deltas, bound) in `dtype`.
    pub fn with_config(
        mut self,
        cfg: &WeightsConfig,
        dtype: WeightDtype,
    ) -> Result<Self, WeightsError> {
        self.store = store::open(cfg, &self.bus, &self.topo)?;
        self.cfg = cfg.clone();
        self.dtype = dtype;
        Ok(self)
    }

    /// Writes objects to `store` (a wrapper that injects faults, in tests).
    pub fn with_store(mut self, store: Arc<dyn BlobStore>) -> Self {
        self.store = store;
        self
    }

    /// Hands versions over as `transport` says; for [`Transport::Store`], call
    /// [`Publisher::with_config`] as well.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    pub fn with_chunk_bytes(mut self, n: usize) -> Self {
        self.cfg.chunk_bytes = n.max(1);
        self.store = Arc::new(RedisStore {
            bus: self.bus.clone(),
            topo: self.topo.clone(),
            chunk_bytes: n.max(1),
        });
        self
    }

    /// Whether [`Publisher::publish_payload`] hands tensors over in process.
    pub fn in_process(&self) -> bool {
        matches!(self.transport, Transport::InProcess(_))
    }

    /// The dtype versions are published in.
    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    /// weights.max_bytes (0: no bound).
    pub fn max_bytes(&self) -> u64 {
        self.cfg.max_bytes
    }

    /// Bytes the published versions occupy in the store now.
    pub fn held_bytes(&self) -> u64 {
        self.held.iter().map(|h| h.bytes).sum()
    }

    /// Refuses a bound that cannot hold a version of `full` bytes while the next is written.
    pub fn check_fits(&self, full: u64) -> Result<(), WeightsError> {
        let max = self.cfg.max_bytes;
        if max > 0 && !self.in_process() && max < 2 * full {
            return Err(WeightsError::Bound {
                max,
                full,
                need: 2 * full,
            });
        }
        Ok(())
    }

    /// Takes over the objects an earlier trainer of this namespace left in the store (from
    /// the announces on the weights stream), so they are deleted as versions move on, and
    /// removes the temporary files of one killed while writing.
    pub async fn adopt(&mut self) -> Result<(), WeightsError> {
        if self.in_process() {
            return Ok(());
        }
        let n = self.store.clean_partial().await?;
        if n > 0 {
            tracing::warn!(
                objects = n,
                "removed partly written weight versions of a trainer that died while writing"
            );
        }
        let stream = self.topo.key(Stream::Weights);
        let mut scan = crate::bus::Pages::new(&stream, RangeBound::Open, RangeBound::Open);
        while let Some(entries) = scan.next(self.bus.as_ref()).await? {
            for e in entries {
                let Ok(a) = schema::decode::<WeightsAnnounce>(&e.payload) else {
                    continue;
                };
                if a.store == self.store.kind().as_str()
                    && a.format != IN_PROCESS_FORMAT
                    && !self.held.iter().any(|h| h.version == a.version)
                {
                    self.held.push(Held {
                        version: a.version,
                        base: a.base,
                        chunks: a.chunks,
                        bytes: a.object_bytes(),
                    });
                }
            }
        }
        self.held.sort_by_key(|h| h.version);
        self.collect().await?;
        crate::metrics::weights_store(self.held_bytes(), self.cfg.max_bytes);
        Ok(())
    }

    /// Publishes a version in the form the transport takes: tensors are handed over in
    /// process (announced with [`IN_PROCESS_FORMAT`]) or encoded in the publisher's dtype;
    /// a blob is published as given.
    pub async fn publish_payload(
        &mut self,
        version: u64,
        step: u64,
        payload: Payload,
    ) -> Result<WeightsAnnounce, WeightsError> {
        match (payload, &self.transport) {
            (Payload::Tensors(t), Transport::InProcess(local)) => {
                let local = local.clone();
                self.hand_over(&local, version, step, t, None).await
            }
            (Payload::Adapter(a), Transport::InProcess(local)) => {
                let (local, lora) = (local.clone(), a.info());
                self.hand_over(&local, version, step, a.tensors, Some(lora))
                    .await
            }
            (Payload::Adapter(a), Transport::Bus | Transport::Store(_)) => {
                let started_us = schema::now_us();
                let dtype = self.dtype;
                let lora = a.info();
                let tensors = a.tensors;
                let blob =
                    tokio::task::spawn_blocking(move || tensors_to_safetensors_as(&tensors, dtype))
                        .await
                        .map_err(|e| {
                            ModelError::Unsupported(format!("weights encoder failed: {e}"))
                        })??;
                self.publish_whole(version, step, blob, started_us, Some(lora))
                    .await
            }
            (Payload::Blob(b), _) => self.publish_blob(version, step, b, schema::now_us()).await,
            (Payload::Tensors(t), Transport::Bus | Transport::Store(_)) => {
                // Publication starts with the encoding: publish-to-swap counts it.
                let started_us = schema::now_us();
                let dtype = self.dtype;
                let blob =
                    tokio::task::spawn_blocking(move || tensors_to_safetensors_as(&t, dtype))
                        .await
                        .map_err(|e| {
                            ModelError::Unsupported(format!("weights encoder failed: {e}"))
                        })??;
                self.publish_blob(version, step, blob, started_us).await
            }
        }
    }

    /// Hands `tensors` over in process and announces them: a full version, or an adapter
    /// (`lora`).
    async fn hand_over(
        &mut self,
        local: &LocalWeights,
        version: u64,
        step: u64,
        tensors: TensorMap,
        lora: Option<AdapterInfo>,
    ) -> Result<WeightsAnnounce, WeightsError> {
        let started_us = schema::now_us();
        let bytes = tensors.values().map(|h| h.data.len() as u64 * 4).sum();
        let checksum = tensors_checksum(&tensors);
        local.put(version, Arc::new(tensors), self.keep);
        let (kind, format) = match lora {
            Some(_) => (WeightsKind::Lora, LORA_IN_PROCESS_FORMAT),
            None => (WeightsKind::Full, IN_PROCESS_FORMAT),
        };
        let announce = WeightsAnnounce {
            schema: WeightsAnnounce::SCHEMA,
            version,
            step,
            kind,
            format: format.into(),
            dtype: "f32".into(),
            bytes,
            // One in-memory object; the checksum covers names, shapes and values.
            chunks: 1,
            checksum,
            store: "memory".into(),
            base: None,
            keyframe: None,
            stored_bytes: None,
            stored_checksum: None,
            lora,
            started_us,
            published_us: schema::now_us(),
        };
        self.announce(&announce).await?;
        Ok(announce)
    }

    async fn announce(&self, announce: &WeightsAnnounce) -> Result<(), WeightsError> {
        let bytes = Bytes::from(schema::encode(announce)?);
        let stream = self.topo.key(Stream::Weights);
        self.bus
            .publish(&stream, &[bytes], self.topo.max_len(Stream::Weights))
            .await?;
        Ok(())
    }

    /// Publishes a copy of `blob` (a whole version in the publisher's dtype) as `version`.
    pub async fn publish(
        &mut self,
        version: u64,
        step: u64,
        blob: &[u8],
    ) -> Result<WeightsAnnounce, WeightsError> {
        self.publish_blob(version, step, blob.to_vec(), schema::now_us())
            .await
    }

    /// Whether a generator asked for a keyframe.
    async fn keyframe_requested(&self) -> Result<bool, WeightsError> {
        let key = keyframe_request_key(&self.topo);
        Ok(self
            .bus
            .get_blobs(&[key])
            .await?
            .first()
            .is_some_and(Option::is_some))
    }

    /// The versions `version`'s chain needs: itself and its bases down to the keyframe.
    fn closure(&self, version: u64) -> Vec<u64> {
        let mut out = vec![version];
        let mut at = version;
        while let Some(base) = self
            .held
            .iter()
            .find(|h| h.version == at)
            .and_then(|h| h.base)
        {
            out.push(base);
            at = base;
        }
        out
    }

    /// What must stay: the newest `keep` versions and their chains.
    fn needed(&self, keep: usize) -> Vec<u64> {
        let mut need: Vec<u64> = self
            .held
            .iter()
            .rev()
            .take(keep)
            .flat_map(|h| self.closure(h.version))
            .collect();
        need.sort_unstable();
        need.dedup();
        need
    }

    /// Deletes what the newest `keep` versions do not need.
    async fn collect(&mut self) -> Result<(), WeightsError> {
        self.collect_keeping(self.keep).await
    }

    async fn collect_keeping(&mut self, keep: usize) -> Result<(), WeightsError> {
        let need = self.needed(keep);
        let (stay, go): (Vec<Held>, Vec<Held>) = self
            .held
            .iter()
            .partition(|h| need.binary_search(&h.version).is_ok());
        for h in go {
            self.store.remove(h.version, h.chunks).await?;
        }
        self.held = stay;
        Ok(())
    }

    /// Publishes a whole version: a delta against the previous one when deltas are on, the
    /// chain since the keyframe is short and small, and the bound allows; a keyframe
    /// otherwise. Then deletes what the newest `keep` versions no longer need.
    async fn publish_blob(
        &mut self,
        version: u64,
        step: u64,
        blob: Vec<u8>,
        started_us: u64,
    ) -> Result<WeightsAnnounce, WeightsError> {
        self.publish_whole(version, step, blob, started_us, None)
            .await
    }

    /// [`Publisher::publish_blob`] for a full version (`lora` `None`) or a whole adapter
    /// (never a delta).
    async fn publish_whole(
        &mut self,
        version: u64,
        step: u64,
        blob: Vec<u8>,
        started_us: u64,
        lora: Option<AdapterInfo>,
    ) -> Result<WeightsAnnounce, WeightsError> {
        let began = Instant::now();
        let full = blob.len() as u64;
        self.check_fits(full)?;
        let blob = Arc::new(blob);
        // The checksum of the whole version runs beside the delta's encoding.
        let whole_checksum = {
            let b = blob.clone();
            tokio::task::spawn_blocking(move || checksum(&b))
        };
        let mut object: Option<(Arc<Vec<u8>>, u64, u64)> = None;
        if let (true, None, Some((base, prev)), Some((keyframe, chain))) =
            (self.cfg.delta, &lora, &self.prev, self.keyframe)
            && version > *base
            && version - keyframe < self.cfg.keyframe_every
            && !self.keyframe_requested().await?
        {
            let (prev, next) = (prev.clone(), blob.clone());
            let encoded = tokio::task::spawn_blocking(move || delta::encode(&prev, &next))
                .await
                .map_err(|e| ModelError::Unsupported(format!("delta encoder failed: {e}")))?;
            if let Some(d) = encoded {
                let n = d.len() as u64;
                let base = *base;
                // A chain longer in bytes than a keyframe costs a joining reader more.
                let small = chain + n <= full;
                if small && (self.cfg.max_bytes == 0 || self.fit_delta(n, full).await?) {
                    object = Some((Arc::new(d), base, keyframe));
                }
            }
        }
        let whole_checksum = whole_checksum
            .await
            .map_err(|e| ModelError::Unsupported(format!("checksum task failed: {e}")))?;
        let encode_s = began.elapsed().as_secs_f64();
        let (stored, base, keyframe) = match object {
            Some((d, base, keyframe)) => (d, Some(base), Some(keyframe)),
            None => {
                if self.cfg.max_bytes > 0 {
                    self.make_room(full).await?;
                }
                (blob.clone(), None, None)
            }
        };
        let stored_bytes = stored.len() as u64;
        let stored_checksum = base.map(|_| checksum(&stored));
        let chunks = self.store.put(version, stored).await?;
        let announce = WeightsAnnounce {
            schema: WeightsAnnounce::SCHEMA,
            version,
            step,
            kind: if lora.is_some() {
                WeightsKind::Lora
            } else {
                WeightsKind::Full
            },
            format: if base.is_some() {
                DELTA_FORMAT.into()
            } else if lora.is_some() {
                lora_format(self.dtype)
            } else {
                full_format(self.dtype).into()
            },
            dtype: match self.dtype {
                WeightDtype::F32 => "f32".into(),
                WeightDtype::Bf16 => "bf16".into(),
            },
            bytes: full,
            chunks,
            checksum: whole_checksum,
            store: self.store.kind().as_str().into(),
            base,
            keyframe,
            stored_bytes: base.map(|_| stored_bytes),
            stored_checksum,
            lora: lora.clone(),
            started_us,
            published_us: schema::now_us(),
        };
        self.announce(&announce).await?;
        self.held.retain(|h| h.version != version);
        self.held.push(Held {
            version,
            base,
            chunks,
            bytes: stored_bytes,
        });
        match keyframe {
            Some(k) => {
                let chain = self.keyframe.map_or(0, |(_, c)| c);
                self.keyframe = Some((k, chain + stored_bytes));
            }
            None => {
                self.keyframe = Some((version, 0));
                self.bus.delete(&[keyframe_request_key(&self.topo)]).await?;
            }
        }
        self.prev = (self.cfg.delta && lora.is_none()).then_some((version, blob));
        self.collect().await?;
        let kind = match (&lora, base) {
            (Some(_), _) => "lora",
            (None, Some(_)) => "delta",
            (None, None) => "full",
        };
        crate::metrics::weights_published(kind, stored_bytes, encode_s);
        crate::metrics::weights_store(self.held_bytes(), self.cfg.max_bytes);
        Ok(announce)
    }

    /// Whether a delta of `d` bytes fits the bound while leaving room for a keyframe of
    /// `full` bytes after it (deleting versions the newest does not need, if that helps).
    async fn fit_delta(&mut self, d: u64, full: u64) -> Result<bool, WeightsError> {
        let max = self.cfg.max_bytes;
        let newest_chain: u64 = match self.held.last() {
            Some(h) => {
                let c = self.closure(h.version);
                self.held
                    .iter()
                    .filter(|x| c.contains(&x.version))
                    .map(|x| x.bytes)
                    .sum()
            }
            None => 0,
        };
        if newest_chain + d + full > max {
            return Ok(false);
        }
        if self.held_bytes() + d > max {
            self.collect_keeping(1).await?;
        }
        Ok(self.held_bytes() + d <= max)
    }

    /// Deletes older versions until a keyframe of `full` bytes fits the bound; the newest
    /// version and its chain stay (generators may be fetching it).
    async fn make_room(&mut self, full: u64) -> Result<(), WeightsError> {
        if self.held_bytes() + full > self.cfg.max_bytes {
            self.collect_keeping(1).await?;
        }
        let held = self.held_bytes();
        if held + full > self.cfg.max_bytes {
            return Err(WeightsError::Store {
                store: self.store.kind().as_str(),
                reason: format!(
                    "the newest version holds {held} bytes and the next needs {full}: more than weights.max_bytes = {}",
                    self.cfg.max_bytes
                ),
            });
        }
        Ok(())
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

/// Refuses an announce whose object no real model has, before anything is allocated.
fn check_plausible(a: &WeightsAnnounce) -> Result<(), WeightsError> {
    let object = a.object_bytes();
    if a.bytes > MAX_WEIGHTS_BYTES
        || object > MAX_WEIGHTS_BYTES
        || a.chunks > MAX_CHUNKS
        || u64::from(a.chunks) > object.max(1)
    {
        return Err(WeightsError::Implausible {
            version: a.version,
            bytes: a.bytes.max(object),
            chunks: a.chunks,
        });
    }
    Ok(())
}

/// Fetches the object of an announce from `store` and checks its size and checksum.
pub async fn fetch_object(
    store: &dyn BlobStore,
    a: &WeightsAnnounce,
) -> Result<Vec<u8>, WeightsError> {
    check_plausible(a)?;
    let blob = store.get(a.version, a.chunks).await?;
    let expected = a.object_bytes();
    if blob.len() as u64 != expected {
        return Err(WeightsError::Size {
            version: a.version,
            expected,
            found: blob.len() as u64,
        });
    }
    let found = checksum(&blob);
    if found != a.object_checksum() {
        return Err(WeightsError::Checksum {
            version: a.version,
            expected: a.object_checksum().to_string(),
            found,
        });
    }
    Ok(blob)
}

/// Fetches and verifies a whole version kept in Redis chunks.
pub async fn fetch(
    bus: &SharedBus,
    topo: &Topology,
    a: &WeightsAnnounce,
) -> Result<Vec<u8>, WeightsError> {
    if !is_full_format(&a.format) {
        return Err(WeightsError::Format {
            version: a.version,
            format: a.format.clone(),
        });
    }
    let store = RedisStore {
        bus: bus.clone(),
        topo: topo.clone(),
        chunk_bytes: 1,
    };
    fetch_object(&store, a).await
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
    /// The pristine base adapter versions apply to, until a follower takes it.
    base: Arc<Mutex<Option<Policy<B>>>>,
}

impl<B: Backend> Clone for ModelSlot<B> {
    fn clone(&self) -> Self {
        ModelSlot {
            model: self.model.clone(),
            version: self.version.clone(),
            base: self.base.clone(),
        }
    }
}

impl<B: Backend> ModelSlot<B> {
    /// A slot starting at `model`, which is also the base adapter versions apply to.
    pub fn new(model: Versioned<B>) -> Self {
        let base = model.policy.without_adapter();
        Self::with_base(model, base)
    }

    /// A slot starting at `model` (e.g. a base with a starting adapter merged in) whose
    /// adapter versions apply to `base`.
    pub fn with_base(model: Versioned<B>, base: Policy<B>) -> Self {
        let version = tokio::sync::watch::Sender::new(model.version);
        ModelSlot {
            model: Arc::new(ArcSwap::from_pointee(model)),
            version: Arc::new(version),
            base: Arc::new(Mutex::new(Some(base))),
        }
    }

    /// Takes the base out of the slot (the follower keeps it).
    fn take_base(&self) -> Option<Policy<B>> {
        self.base.lock().unwrap_or_else(|p| p.into_inner()).take()
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
    redis: Arc<dyn BlobStore>,
    dir: Option<Arc<dyn BlobStore>>,
    /// Keep the bytes of the version assembled last, so the next delta applies to them.
    keep_bytes: bool,
    /// Announces read, by version (the chains deltas are assembled along).
    seen: BTreeMap<u64, WeightsAnnounce>,
    /// The bytes of the newest version assembled and verified.
    held: Option<(u64, Vec<u8>)>,
    /// Seconds per phase of the last version taken, in order.
    phases: Vec<(&'static str, f64)>,
    /// Versions rejected (bad checksum, bad shape), for reporting.
    pub rejected: u64,
    /// The newest version announced and not rejected: how far the trainer is ahead of the
    /// slot, for the generator's in-flight bound.
    announced: Arc<AtomicU64>,
    /// The pristine base adapter versions apply to (each is merged into a fresh copy of
    /// it, so versions never accumulate), and its checksum once computed. Dropped when a
    /// full version is swapped in: a full fine-tuning trainer sends no adapters.
    base: Option<Arc<Policy<B>>>,
    base_checksum: Option<String>,
}

/// How many announces a follower remembers (a chain is at most `keyframe_every` long).
const SEEN_LIMIT: usize = 4096;

impl<B: Backend> Follower<B>
where
    B::Device: Default,
{
    pub fn new(bus: SharedBus, topo: Topology, config: PolicyConfig, slot: ModelSlot<B>) -> Self {
        let version = slot.load().version;
        let base = slot.take_base().map(Arc::new);
        let redis = Arc::new(RedisStore {
            bus: bus.clone(),
            topo: topo.clone(),
            chunk_bytes: WeightsConfig::default().chunk_bytes,
        });
        Follower {
            bus,
            topo,
            config,
            slot,
            last_id: EntryId::ZERO,
            transport: Transport::Bus,
            redis,
            dir: None,
            keep_bytes: true,
            seen: BTreeMap::new(),
            held: None,
            phases: Vec::new(),
            rejected: 0,
            announced: Arc::new(AtomicU64::new(version)),
            base,
            base_checksum: None,
        }
    }

    /// The checksum of the base, computed once (off the async threads).
    async fn base_checksum(&mut self, base: &Arc<Policy<B>>) -> Result<String, WeightsError> {
        if let Some(c) = &self.base_checksum {
            return Ok(c.clone());
        }
        let b = base.clone();
        let c = tokio::task::spawn_blocking(move || b.base_checksum())
            .await
            .map_err(|e| ModelError::Unsupported(format!("checksum task failed: {e}")))??;
        self.base_checksum = Some(c.clone());
        Ok(c)
    }

    /// The tensors of version `a` handed over in process, verified against its checksum;
    /// `None` (the version rejected, and why logged) when this process does not hold them
    /// or they do not match.
    fn handed_over(&mut self, a: &WeightsAnnounce, current: u64) -> Option<Arc<TensorMap>> {
        let local = match &self.transport {
            Transport::InProcess(local) => local.get(a.version),
            Transport::Bus | Transport::Store(_) => None,
        };
        let Some(tensors) = local else {
            self.reject();
            tracing::error!(
                version = a.version,
                "weights were handed over in another process's memory and cannot be read \
                 here: run the trainer with the bus transport; keeping version {current}"
            );
            return None;
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
            return None;
        }
        Some(tensors)
    }

    /// Takes an adapter version: refused unless it names this generator's base; fetched
    /// whole, verified, and merged into a fresh copy of the base.
    async fn sync_adapter(
        &mut self,
        a: WeightsAnnounce,
        current: u64,
    ) -> Result<Option<u64>, WeightsError> {
        let version = a.version;
        let Some(info) = a.lora.clone() else {
            self.reject();
            tracing::error!(
                version,
                "an adapter version without its adapter fields; keeping version {current}"
            );
            return Ok(None);
        };
        let Some(base) = self.base.clone() else {
            self.reject();
            tracing::error!(
                version,
                "version {version} is a LoRA adapter and this generator holds no base model to apply it to: start gen with --model DIR, the trainer's base; keeping version {current}"
            );
            return Ok(None);
        };
        let mine = self.base_checksum(&base).await?;
        if mine != info.base_checksum {
            self.reject();
            tracing::error!(
                version,
                adapter_base = %info.base_checksum,
                generator_base = %mine,
                "refused adapter version {version}: it applies to base {} but this generator's base is {mine}; start gen with the --model the trainer trains on; keeping version {current}",
                info.base_checksum
            );
            return Ok(None);
        }
        let spec = match announced_spec(version, &info) {
            Ok(s) => s,
            Err(e) => {
                self.reject();
                tracing::error!(version, error = %e, "rejected adapter version; keeping version {current}");
                return Ok(None);
            }
        };
        let tensors = if a.format == LORA_IN_PROCESS_FORMAT {
            let Some(tensors) = self.handed_over(&a, current) else {
                return Ok(None);
            };
            tensors
        } else {
            let blob = match self.assemble(&a).await {
                Ok(b) => b,
                Err(e) if e.is_version_fault() => {
                    self.reject();
                    tracing::error!(version, error = %e, "rejected adapter version; keeping version {current}");
                    return Ok(None);
                }
                Err(e @ WeightsError::MissingChunk { .. }) => {
                    crate::metrics::error(Stage::Gen, "weights_unavailable");
                    tracing::warn!(version, error = %e, "adapter version no longer in the store; keeping version {current} until the next");
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            let t = Instant::now();
            let decoded = tokio::task::spawn_blocking(move || safetensors_to_tensors(&blob, None))
                .await
                .map_err(|e| ModelError::Unsupported(format!("decode task failed: {e}")))?;
            self.phase("decode", t.elapsed().as_secs_f64());
            match decoded {
                Ok(t) => Arc::new(t),
                Err(e) => {
                    self.reject();
                    tracing::error!(version, error = %e, "rejected adapter version; keeping version {current}");
                    return Ok(None);
                }
            }
        };
        self.build(version, current, move |_, _| {
            let adapted = base.as_ref().clone().with_adapter(&spec, &tensors)?;
            Ok((adapted.merged(), None))
        })
        .await
    }

    /// Reads versions from the stores `cfg` names; with `delta` off, keeps no copy of the
    /// current version's bytes (every delta is then assembled from its keyframe).
    pub fn with_config(mut self, cfg: &WeightsConfig) -> Self {
        if let Some(root) = &cfg.store_dir {
            self.dir = Some(Arc::new(DirStore::new(
                root,
                &self.topo.namespace,
                cfg.chunk_bytes,
            )));
        }
        self.keep_bytes = cfg.delta;
        self
    }

    /// Seconds spent in each phase (fetch, decode, verify, build) of the last version
    /// this follower took or tried to take.
    pub fn last_phases(&self) -> &[(&'static str, f64)] {
        &self.phases
    }

    fn phase(&mut self, name: &'static str, seconds: f64) {
        crate::metrics::weight_phase(name, seconds);
        self.phases.push((name, seconds));
    }

    /// The newest version announced on the weights stream and not rejected (the slot's
    /// version until one is read).
    pub fn announced(&self) -> Arc<AtomicU64> {
        self.announced.clone()
    }

    pub fn with_transport(mut self, transport: Transport) -> Self {
        if let Transport::Store(cfg) = &transport {
            self = self.with_config(cfg);
        }
        self.transport = transport;
        self
    }

    /// Reads announces for up to `block`; if one is newer than the current model, fetches,
    /// verifies, builds and swaps it in. Returns the version swapped in, if any.
    pub async fn poll(&mut self, block: Duration) -> Result<Option<u64>, WeightsError> {
        let stream = self.topo.key(Stream::Weights);
        let mut newest: Option<WeightsAnnounce> = None;
        let mut wait = Some(block);
        // Read everything there is (a late joiner reads the whole stream) before deciding.
        loop {
            let entries = self
                .bus
                .read_after(&stream, self.last_id, 1024, wait)
                .await?;
            let Some(last) = entries.last() else { break };
            self.last_id = last.id;
            for e in &entries {
                match schema::decode::<WeightsAnnounce>(&e.payload) {
                    Ok(a) => {
                        if newest.as_ref().is_none_or(|n| a.version >= n.version) {
                            newest = Some(a.clone());
                        }
                        self.seen.insert(a.version, a);
                    }
                    Err(err) => {
                        tracing::warn!(id = %e.id, error = %err, "ignoring an undecodable weights announce");
                    }
                }
            }
            if entries.len() < 1024 {
                break;
            }
            wait = None;
        }
        while self.seen.len() > SEEN_LIMIT {
            self.seen.pop_first();
        }
        let Some(a) = newest else { return Ok(None) };
        let current = self.slot.load().version;
        if a.version <= current {
            return Ok(None);
        }
        self.announced.fetch_max(a.version, Ordering::Relaxed);
        self.phases.clear();
        let began = Instant::now();
        let swapped = self.sync(a.clone(), current).await?;
        if swapped.is_some() {
            crate::metrics::weight_sync(Stage::Gen, began.elapsed().as_secs_f64());
            let latency = schema::now_us().saturating_sub(a.started_us) as f64 / 1e6;
            crate::metrics::publish_to_swap(latency);
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
        if a.kind == WeightsKind::Lora {
            return self.sync_adapter(a, current).await;
        }
        if a.format == IN_PROCESS_FORMAT {
            let Some(tensors) = self.handed_over(&a, current) else {
                return Ok(None);
            };
            let swapped = self
                .build(a.version, current, move |cfg, dev| {
                    Policy::<B>::from_tensors(cfg, &tensors, dev).map(|p| (p, None))
                })
                .await?;
            if swapped.is_some() {
                self.base = None;
            }
            return Ok(swapped);
        }
        let blob = match self.assemble(&a).await {
            Ok(b) => b,
            Err(e @ (WeightsError::MissingChunk { .. } | WeightsError::MissingBase { .. })) => {
                // The object is gone (deleted as newer versions arrived) or the chain
                // cannot be followed: not a corrupt version. Ask for a keyframe; the next
                // announce brings one.
                self.request_keyframe(a.version).await;
                crate::metrics::error(Stage::Gen, "weights_unavailable");
                tracing::warn!(version = a.version, error = %e, "cannot assemble new weights; asked the trainer for a keyframe, keeping version {current}");
                return Ok(None);
            }
            Err(e) if e.is_version_fault() => {
                self.reject();
                self.request_keyframe(a.version).await;
                tracing::error!(version = a.version, error = %e, "rejected new weights; keeping version {current}");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let keep = self.keep_bytes;
        let version = a.version;
        let swapped = self
            .build(version, current, move |cfg, dev| {
                let p = Policy::<B>::from_bytes(cfg, &blob, dev)?;
                Ok((p, keep.then_some((version, blob))))
            })
            .await?;
        if swapped.is_some() {
            self.base = None;
        }
        Ok(swapped)
    }

    fn store_for(&self, a: &WeightsAnnounce) -> Result<Arc<dyn BlobStore>, WeightsError> {
        match a.store.as_str() {
            "redis" => Ok(self.redis.clone()),
            "dir" => self.dir.clone().ok_or(WeightsError::Store {
                store: "dir",
                reason: format!(
                    "version {} is in a shared directory and this generator has none: set --store-dir DIR (weights.store_dir) to the trainer's",
                    a.version
                ),
            }),
            other => Err(WeightsError::Format {
                version: a.version,
                format: format!("store `{other}`"),
            }),
        }
    }

    /// The whole bytes of version `a`, verified against its checksum: by the shortest
    /// chain from the bytes this follower holds, or from the keyframe.
    async fn assemble(&mut self, a: &WeightsAnnounce) -> Result<Vec<u8>, WeightsError> {
        // Walk down the bases until a keyframe or the version held.
        let mut chain = Vec::new();
        let mut at = a.clone();
        let from_held = loop {
            if !at.is_delta() {
                if !is_whole_format(&at.format)
                    || (at.kind == WeightsKind::Lora) != (a.kind == WeightsKind::Lora)
                {
                    return Err(WeightsError::Format {
                        version: at.version,
                        format: at.format.clone(),
                    });
                }
                break false;
            }
            let base = at.base.unwrap_or_default();
            chain.push(at.clone());
            if self.held.as_ref().is_some_and(|(v, _)| *v == base) {
                break true;
            }
            at = match self.seen.get(&base) {
                Some(b) => b.clone(),
                None => {
                    return Err(WeightsError::MissingBase {
                        version: a.version,
                        base,
                    });
                }
            };
        };
        let began = Instant::now();
        let mut bytes = if from_held {
            self.held.take().map(|(_, b)| b).unwrap_or_default()
        } else {
            let store = self.store_for(&at)?;
            let full = fetch_object(store.as_ref(), &at).await?;
            self.phase("fetch", began.elapsed().as_secs_f64());
            // The keyframe replaces whatever was held.
            self.held = None;
            full
        };
        for d in chain.into_iter().rev() {
            let t = Instant::now();
            let store = self.store_for(&d)?;
            let object = fetch_object(store.as_ref(), &d).await?;
            self.phase("fetch", t.elapsed().as_secs_f64());
            if bytes.len() as u64 != d.bytes {
                return Err(WeightsError::Size {
                    version: d.version,
                    expected: d.bytes,
                    found: bytes.len() as u64,
                });
            }
            let t = Instant::now();
            let version = d.version;
            bytes = tokio::task::spawn_blocking(move || {
                delta::apply(&mut bytes, &object)
                    .map(|()| bytes)
                    .map_err(|source| WeightsError::Delta { version, source })
            })
            .await
            .map_err(|e| ModelError::Unsupported(format!("delta task failed: {e}")))??;
            self.phase("decode", t.elapsed().as_secs_f64());
            let t = Instant::now();
            bytes = verify(&d, bytes).await?;
            self.phase("verify", t.elapsed().as_secs_f64());
        }
        // A keyframe was checked against its checksum as it was fetched, each delta's result
        // after it was applied.
        Ok(bytes)
    }

    /// Asks the trainer to make its next version a keyframe.
    async fn request_keyframe(&self, version: u64) {
        let key = keyframe_request_key(&self.topo);
        let value = Bytes::from(version.to_string());
        if let Err(e) = self.bus.put_blobs(&[(key, value)]).await {
            tracing::warn!(error = %e, "could not ask the trainer for a keyframe");
        }
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
        make: impl FnOnce(
            &PolicyConfig,
            &B::Device,
        ) -> Result<(Policy<B>, Option<(u64, Vec<u8>)>), ModelError>
        + Send
        + 'static,
    ) -> Result<Option<u64>, WeightsError> {
        let config = self.config.clone();
        let began = Instant::now();
        let built = tokio::task::spawn_blocking(move || make(&config, &B::Device::default()))
            .await
            .map_err(|e| ModelError::Unsupported(format!("weight build task failed: {e}")))?;
        self.phase("build", began.elapsed().as_secs_f64());
        match built {
            Ok((policy, held)) => {
                self.held = held;
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

/// Checks assembled bytes against the whole-version checksum of their announce.
async fn verify(a: &WeightsAnnounce, bytes: Vec<u8>) -> Result<Vec<u8>, WeightsError> {
    let (version, expected) = (a.version, a.checksum.clone());
    tokio::task::spawn_blocking(move || {
        let found = checksum(&bytes);
        if found == expected {
            Ok(bytes)
        } else {
            Err(WeightsError::Checksum {
                version,
                expected,
                found,
            })
        }
    })
    .await
    .map_err(|e| ModelError::Unsupported(format!("checksum task failed: {e}")))?
}

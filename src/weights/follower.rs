//! The generator's side of the hand-over: [`Follower`] reads announces, assembles the newest
//! version by the shortest path (deltas on the bytes it holds, or a keyframe and the deltas
//! after it, or host tensors in process), verifies it, builds the model off the decode
//! thread and swaps it into the [`ModelSlot`]. A version that fails is rejected and counted;
//! the generator keeps its weights.

use super::fetch::{fetch_object, verify};
use super::format::{
    IN_PROCESS_FORMAT, LORA_IN_PROCESS_FORMAT, is_whole_format, keyframe_request_key,
};
use super::slot::{ModelSlot, Versioned};
use super::transport::{Transport, announced_spec};
use super::{BlobStore, DirStore, RedisStore, WeightsConfig, WeightsError, delta};
use crate::bus::{EntryId, SharedBus, Topology};
use crate::model::tensors::{TensorMap, safetensors_to_tensors, tensors_checksum};
use crate::model::{ModelError, Policy, PolicyConfig};
use crate::roles::{Stage, Stream};
use crate::schema::{self, WeightsAnnounce, WeightsKind};
use burn::tensor::backend::Backend;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

impl<B: crate::model::Kernels> Follower<B>
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

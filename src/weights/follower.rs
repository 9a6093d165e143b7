//! The generator's side of the hand-over: [`Follower`] reads announces and brings the newest
//! version into the [`ModelSlot`] off the decode thread. A version is rejected (counted, the
//! generator keeping its weights) unless its checksum matches before the swap.
//!
//! The follower holds two models, and never allocates one per version: the slot's and the
//! one the slot retired at the last swap (the spare). A delta on the slot's version is
//! XORed into the spare's own buffers, after the deltas the spare missed, and the spare is
//! checked against the version's checksum and swapped in; the model it replaces becomes the
//! next spare once the decode loop's last pass on it ends. A keyframe (a generator joining,
//! or after a rejected version) is assembled as bytes and written over the spare's values.
//! Peak memory is two models and one tensor, plus a keyframe's bytes while one is loaded.

use super::fetch::{fetch_object, verify};
use super::format::{
    IN_PROCESS_FORMAT, LORA_IN_PROCESS_FORMAT, is_whole_format, keyframe_request_key,
};
use super::layout::Layout;
use super::resident;
use super::slot::{ModelSlot, Versioned};
use super::transport::{Transport, announced_spec};
use super::{BlobStore, DirStore, RedisStore, WeightsConfig, WeightsError, delta};
use crate::bus::{EntryId, SharedBus, Topology};
use crate::model::tensors::{TensorMap, safetensors_to_tensors, tensors_checksum};
use crate::model::{ModelConfig, ModelError, Policy};
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
    config: ModelConfig,
    slot: ModelSlot<B>,
    last_id: EntryId,
    transport: Transport,
    redis: Arc<dyn BlobStore>,
    dir: Option<Arc<dyn BlobStore>>,
    /// Announces read, by version (the chains deltas are assembled along).
    seen: BTreeMap<u64, WeightsAnnounce>,
    /// Where each tensor lies in the version the slot's model was checked against (`None`
    /// until a published version is swapped in): what a delta on it is applied through.
    layout: Option<Arc<Layout>>,
    /// The model the slot retired at the last swap, to be brought to the next version in
    /// place.
    spare: Option<Spare<B>>,
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

/// How long the follower waits for the decode loop to finish its pass on the retired model
/// before it copies the slot's model instead.
const RECLAIM_WAIT: Duration = Duration::from_secs(10);

/// A model the slot retired.
struct Spare<B: Backend> {
    model: Arc<Versioned<B>>,
    /// The deltas that take it to the slot's version (`None` when the last swap was not a
    /// delta on it).
    trail: Option<Vec<Arc<Vec<u8>>>>,
}

/// How a version is reached: deltas on the slot's version, or a keyframe and the deltas
/// after it.
enum Route {
    OnLive(Vec<WeightsAnnounce>),
    FromKeyframe,
}

impl<B: crate::model::Kernels> Follower<B>
where
    B::Device: Default,
{
    pub fn new(bus: SharedBus, topo: Topology, config: ModelConfig, slot: ModelSlot<B>) -> Self {
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
            seen: BTreeMap::new(),
            layout: None,
            spare: None,
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
            Ok(adapted.merged())
        })
        .await
    }

    /// Reads versions from the stores `cfg` names.
    pub fn with_config(mut self, cfg: &WeightsConfig) -> Self {
        if let Some(root) = &cfg.store_dir {
            self.dir = Some(Arc::new(DirStore::new(
                root,
                &self.topo.namespace,
                cfg.chunk_bytes,
            )));
        }
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
                    Policy::<B>::from_tensors(cfg, &tensors, dev)
                })
                .await?;
            if swapped.is_some() {
                self.base = None;
            }
            return Ok(swapped);
        }
        let result = match self.route(&a) {
            Ok(Route::OnLive(chain)) => self.patch(&a, chain).await,
            Ok(Route::FromKeyframe) => match self.assemble(&a).await {
                Ok(bytes) => self.load_whole(&a, bytes).await,
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => Ok(Some(a.version)),
            Err(e @ (WeightsError::MissingChunk { .. } | WeightsError::MissingBase { .. })) => {
                // The object is gone (deleted as newer versions arrived) or the chain
                // cannot be followed: not a corrupt version. Ask for a keyframe; the next
                // announce brings one.
                self.request_keyframe(a.version).await;
                crate::metrics::error(Stage::Gen, "weights_unavailable");
                tracing::warn!(version = a.version, error = %e, "cannot assemble new weights; asked the trainer for a keyframe, keeping version {current}");
                Ok(None)
            }
            Err(e) if e.is_version_fault() => {
                self.reject();
                self.request_keyframe(a.version).await;
                tracing::error!(version = a.version, error = %e, "rejected new weights; keeping version {current}");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The announce of `base`, a version `a`'s chain passes through.
    fn base_of(&self, a: &WeightsAnnounce, base: u64) -> Result<WeightsAnnounce, WeightsError> {
        self.seen
            .get(&base)
            .cloned()
            .ok_or(WeightsError::MissingBase {
                version: a.version,
                base,
            })
    }

    /// Whether `a` is reached by deltas on the slot's version (they are returned, oldest
    /// first) or from a keyframe.
    fn route(&self, a: &WeightsAnnounce) -> Result<Route, WeightsError> {
        let live = self.slot.load().version;
        let mut chain = Vec::new();
        let mut at = a.clone();
        while at.is_delta() && self.layout.is_some() {
            let base = at.base.unwrap_or_default();
            chain.push(at.clone());
            if base == live {
                chain.reverse();
                return Ok(Route::OnLive(chain));
            }
            at = self.base_of(a, base)?;
        }
        Ok(Route::FromKeyframe)
    }

    /// The retired model once the decode loop no longer holds it, with the deltas that
    /// take it to the slot's version; `None` when there is none or it is not released in
    /// time.
    async fn reclaim(&mut self) -> Option<(Versioned<B>, Option<Vec<Arc<Vec<u8>>>>)> {
        let Spare { mut model, trail } = self.spare.take()?;
        let t = Instant::now();
        loop {
            match Arc::try_unwrap(model) {
                Ok(v) => {
                    self.phase("release", t.elapsed().as_secs_f64());
                    return Some((v, trail));
                }
                Err(m) if t.elapsed() < RECLAIM_WAIT => {
                    model = m;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(_) => {
                    tracing::warn!(
                        "the decode loop held the retired model for {RECLAIM_WAIT:?}: copying the current one instead"
                    );
                    return None;
                }
            }
        }
    }

    /// Applies the deltas of `chain` (on the slot's version, ending at `a`) in place to the
    /// spare, checks it against `a`'s checksum and swaps it in.
    async fn patch(
        &mut self,
        a: &WeightsAnnounce,
        chain: Vec<WeightsAnnounce>,
    ) -> Result<(), WeightsError> {
        let mut deltas = Vec::with_capacity(chain.len());
        for d in &chain {
            let t = Instant::now();
            let store = self.store_for(d)?;
            deltas.push(Arc::new(fetch_object(store.as_ref(), d).await?));
            self.phase("fetch", t.elapsed().as_secs_f64());
        }
        let layout = self
            .layout
            .clone()
            .ok_or_else(|| ModelError::Unsupported("no layout to apply a delta through".into()))?;
        let spare = self.reclaim().await;
        let live = self.slot.load();
        let (version, expected) = (a.version, a.checksum.clone());
        let applied = deltas.clone();
        let (policy, phases) = tokio::task::spawn_blocking(move || {
            let mut phases = Vec::new();
            let t = Instant::now();
            let delta_err =
                |source: resident::ResidentError| WeightsError::Resident { version, source };
            let (hollow, mut params) = match spare {
                Some((model, Some(trail))) => {
                    drop(live);
                    let (hollow, mut params) = model.policy.take_values()?;
                    for d in &trail {
                        resident::xor_delta(&mut params, &layout, d).map_err(delta_err)?;
                    }
                    (hollow, params)
                }
                Some((model, None)) => {
                    // The last swap was not a delta on the spare: it becomes a copy of
                    // the slot's model, in its own buffers.
                    let (hollow, mut params) = model.policy.take_values()?;
                    live.policy.copy_values_into(&mut params)?;
                    drop(live);
                    phases.push(("copy", t.elapsed().as_secs_f64()));
                    (hollow, params)
                }
                None => {
                    // No spare (the first delta, or one the decode loop kept): a new copy.
                    let copied = live.policy.clone().take_values()?;
                    drop(live);
                    phases.push(("copy", t.elapsed().as_secs_f64()));
                    copied
                }
            };
            let t = Instant::now();
            for d in &applied {
                resident::xor_delta(&mut params, &layout, d).map_err(delta_err)?;
            }
            phases.push(("decode", t.elapsed().as_secs_f64()));
            let t = Instant::now();
            let found = resident::checksum(&mut params, &layout).map_err(delta_err)?;
            phases.push(("verify", t.elapsed().as_secs_f64()));
            if found.as_ref() != Some(&expected) {
                return Err(WeightsError::Checksum {
                    version,
                    expected,
                    found: found.unwrap_or_else(|| "(values outside the version's dtype)".into()),
                });
            }
            let t = Instant::now();
            let policy = hollow.fill(params)?;
            phases.push(("build", t.elapsed().as_secs_f64()));
            Ok::<_, WeightsError>((policy, phases))
        })
        .await
        .map_err(|e| ModelError::Unsupported(format!("weight update task failed: {e}")))??;
        for (name, s) in phases {
            self.phase(name, s);
        }
        let retired = self.slot.swap(Versioned { version, policy });
        self.spare = Some(Spare {
            model: retired,
            trail: Some(deltas),
        });
        self.base = None;
        Ok(())
    }

    /// Loads a whole version's verified bytes: written over the spare's values when it has
    /// the same tensors, built as a new model otherwise; then swaps it in.
    async fn load_whole(
        &mut self,
        a: &WeightsAnnounce,
        bytes: Vec<u8>,
    ) -> Result<(), WeightsError> {
        let spare = self.reclaim().await;
        let config = self.config.clone();
        let t = Instant::now();
        let (policy, layout) = tokio::task::spawn_blocking(move || {
            let layout = Layout::parse(&bytes);
            if let (Some(layout), Some((model, _))) = (&layout, spare)
                && let Ok((hollow, mut params)) = model.policy.take_values()
                && resident::write_version(&mut params, layout, &bytes).is_ok()
            {
                return hollow.fill(params).map(|p| (p, Some(layout.clone())));
            }
            let p = Policy::<B>::from_bytes(&config, &bytes, &B::Device::default())?;
            Ok::<_, ModelError>((p, layout))
        })
        .await
        .map_err(|e| ModelError::Unsupported(format!("weight build task failed: {e}")))?
        .map_err(|e| {
            // A version that does not fit the model (names, shapes) is a fault of the version.
            WeightsError::Model(e)
        })?;
        self.phase("build", t.elapsed().as_secs_f64());
        let retired = self.slot.swap(Versioned {
            version: a.version,
            policy,
        });
        self.spare = Some(Spare {
            model: retired,
            trail: None,
        });
        self.layout = layout.map(Arc::new);
        self.base = None;
        Ok(())
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

    /// The whole bytes of version `a`, verified against its checksum: its keyframe and the
    /// deltas after it, applied to the bytes.
    async fn assemble(&mut self, a: &WeightsAnnounce) -> Result<Vec<u8>, WeightsError> {
        // Walk down the bases to the keyframe.
        let mut chain = Vec::new();
        let mut at = a.clone();
        while at.is_delta() {
            let base = at.base.unwrap_or_default();
            chain.push(at.clone());
            at = self.base_of(a, base)?;
        }
        if !is_whole_format(&at.format)
            || (at.kind == WeightsKind::Lora) != (a.kind == WeightsKind::Lora)
        {
            return Err(WeightsError::Format {
                version: at.version,
                format: at.format.clone(),
            });
        }
        let began = Instant::now();
        let store = self.store_for(&at)?;
        let mut bytes = fetch_object(store.as_ref(), &at).await?;
        self.phase("fetch", began.elapsed().as_secs_f64());
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

    /// Builds a version off the async threads and swaps it in (host tensors in process, an
    /// adapter merged into the base); a version that does not fit the model is rejected and
    /// the current one kept. The model it replaces is not kept: these versions are not
    /// applied in place.
    async fn build(
        &mut self,
        version: u64,
        current: u64,
        make: impl FnOnce(&ModelConfig, &B::Device) -> Result<Policy<B>, ModelError> + Send + 'static,
    ) -> Result<Option<u64>, WeightsError> {
        let config = self.config.clone();
        let began = Instant::now();
        let built = tokio::task::spawn_blocking(move || make(&config, &B::Device::default()))
            .await
            .map_err(|e| ModelError::Unsupported(format!("weight build task failed: {e}")))?;
        self.phase("build", began.elapsed().as_secs_f64());
        match built {
            Ok(policy) => {
                self.spare = None;
                self.layout = None;
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

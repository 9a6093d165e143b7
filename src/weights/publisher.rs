//! The trainer's side of the hand-over: [`Publisher`] writes each version to a store (a
//! keyframe or a delta on the previous version), announces it on the weights stream, keeps
//! the newest versions with the chains they need within the store's bound, and answers a
//! generator's request for a keyframe.

use super::format::{
    IN_PROCESS_FORMAT, LORA_IN_PROCESS_FORMAT, full_format, keyframe_request_key, lora_format,
};
use super::layout::Layout;
use super::store::Piece;
use super::transport::{LocalWeights, Payload, Transport};
use super::{BlobStore, RedisStore, WeightsConfig, WeightsError, delta, store};
use crate::bus::{RangeBound, SharedBus, Topology};
use crate::model::ModelError;
use crate::model::tensors::{
    TensorMap, WeightDtype, checksum, tensors_checksum, tensors_to_safetensors_as,
};
use crate::roles::Stream;
use crate::schema::{self, AdapterInfo, DELTA_FORMAT, Message, WeightsAnnounce, WeightsKind};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;
use xxhash_rust::xxh3::Xxh3;

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
                self.publish_tensors(version, step, t, started_us).await
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
        let object = match &lora {
            None => self.delta_object(version, &blob).await?,
            Some(_) => None,
        };
        let whole_checksum = whole_checksum
            .await
            .map_err(|e| ModelError::Unsupported(format!("checksum task failed: {e}")))?;
        let encode_s = began.elapsed().as_secs_f64();
        let (stored, base) = match object {
            Some((d, base, keyframe)) => (d, Some((base, keyframe))),
            None => {
                if self.cfg.max_bytes > 0 {
                    self.make_room(full).await?;
                }
                (blob.clone(), None)
            }
        };
        let object = Object {
            chunks: self.store.put(version, stored.clone()).await?,
            bytes: stored.len() as u64,
            checksum: base.map(|_| checksum(&stored)),
            base,
        };
        let stamp = Stamp {
            version,
            step,
            started_us,
            encode_s,
        };
        self.finish(stamp, lora, blob, whole_checksum, object).await
    }

    /// Announces a version whose object is in the store, records it, keeps its bytes as
    /// the next delta's base and deletes what the newest versions no longer need.
    async fn finish(
        &mut self,
        stamp: Stamp,
        lora: Option<AdapterInfo>,
        blob: Arc<Vec<u8>>,
        whole_checksum: String,
        object: Object,
    ) -> Result<WeightsAnnounce, WeightsError> {
        let base = object.base.map(|(b, _)| b);
        let announce = WeightsAnnounce {
            schema: WeightsAnnounce::SCHEMA,
            version: stamp.version,
            step: stamp.step,
            kind: if lora.is_some() {
                WeightsKind::Lora
            } else {
                WeightsKind::Full
            },
            format: self.format_of(base.is_some(), lora.is_some()),
            dtype: self.dtype.short_name().into(),
            bytes: blob.len() as u64,
            chunks: object.chunks,
            checksum: whole_checksum,
            store: self.store.kind().as_str().into(),
            base,
            keyframe: object.base.map(|(_, k)| k),
            stored_bytes: base.map(|_| object.bytes),
            stored_checksum: object.checksum.clone(),
            lora: lora.clone(),
            started_us: stamp.started_us,
            published_us: schema::now_us(),
        };
        self.announce(&announce).await?;
        self.hold(
            Held {
                version: stamp.version,
                base,
                chunks: object.chunks,
                bytes: object.bytes,
            },
            object.base.map(|(_, k)| k),
        )
        .await?;
        self.prev = (self.cfg.delta && lora.is_none()).then_some((stamp.version, blob));
        self.collect().await?;
        let kind = match (&lora, base) {
            (Some(_), _) => "lora",
            (None, Some(_)) => "delta",
            (None, None) => "full",
        };
        crate::metrics::weights_published(kind, object.bytes, stamp.encode_s);
        crate::metrics::weights_store(self.held_bytes(), self.cfg.max_bytes);
        Ok(announce)
    }

    /// Publishes the trainer's tensors as a whole version in the publisher's dtype, written
    /// to the store while it is encoded: each segment of the version is converted from the
    /// tensors, XORed with the previous version's and compressed (a delta) on its own core,
    /// and goes to the store while the next ones are made. The previous version's bytes
    /// become this version's in place, so publishing holds one version's bytes. A bounded
    /// store (`weights.max_bytes`) first makes room for a whole version (a delta is never
    /// kept larger), and keeps a delta only if a keyframe still fits after it.
    async fn publish_tensors(
        &mut self,
        version: u64,
        step: u64,
        tensors: TensorMap,
        started_us: u64,
    ) -> Result<WeightsAnnounce, WeightsError> {
        let began = Instant::now();
        let layout = Arc::new(Layout::of_tensors(&tensors, self.dtype));
        let full = layout.total as u64;
        self.check_fits(full)?;
        let max = self.cfg.max_bytes;
        if max > 0 {
            self.make_room(full).await?;
        }
        let newest_chain = self.newest_chain();
        let base = self.delta_base(version, full).await?;
        // The previous version's bytes, made into this version's as the encoder goes (a
        // failure on the way leaves no previous version: the next one is a keyframe).
        let buffer = self
            .prev
            .take()
            .map(|(_, b)| Arc::try_unwrap(b).unwrap_or_else(|b| b.as_ref().clone()))
            .filter(|b| b.len() == layout.total);
        let on_prev = base.is_some() && buffer.is_some();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let encoder = tokio::task::spawn_blocking(move || {
            encode_streaming(&layout, &tensors, buffer, on_prev, &tx)
        });
        let written = self.store.put_stream(version, rx).await;
        let encoded = encoder
            .await
            .map_err(|e| ModelError::Unsupported(format!("weights encoder failed: {e}")))?;
        let (chunks, stored_bytes, encoded) = match (written, encoded) {
            (Ok((chunks, n)), Ok(e)) => (chunks, n, e),
            (Ok((chunks, _)), Err(e)) => {
                self.store.remove(version, chunks).await?;
                return Err(e.unwrap_or_else(|| stopped("the encoder stopped early")));
            }
            // Whichever failed first is the cause: an encoder that failed on its own closed
            // the writer's channel; one the writer stopped has nothing to say.
            (Err(_), Err(Some(e))) | (Err(e), _) => return Err(e),
        };
        let blob = Arc::new(encoded.bytes);
        let mut object = Object {
            chunks,
            bytes: stored_bytes,
            checksum: encoded.object_checksum,
            base: base.filter(|_| on_prev),
        };
        // A chain longer in bytes than a keyframe costs a joining reader more, and a delta
        // after which no keyframe fits the bound blocks the next one: write the version
        // whole instead (the room made above holds it).
        let chain = self.keyframe.map_or(0, |(_, c)| c);
        let crowds = max > 0 && newest_chain + stored_bytes + full > max;
        if object.base.is_some() && (chain + stored_bytes > full || crowds) {
            self.store.remove(version, chunks).await?;
            object = Object {
                chunks: self.store.put(version, blob.clone()).await?,
                bytes: full,
                checksum: None,
                base: None,
            };
        }
        let stamp = Stamp {
            version,
            step,
            started_us,
            encode_s: began.elapsed().as_secs_f64(),
        };
        self.finish(stamp, None, blob, encoded.checksum, object)
            .await
    }

    /// The base and keyframe of a delta for `version` of `full` bytes, with the base's
    /// bytes: when deltas are on, the chain since the keyframe may grow, the layout is the
    /// same and no generator asked for a keyframe; `None` for a keyframe.
    async fn delta_base(
        &mut self,
        version: u64,
        full: u64,
    ) -> Result<Option<(u64, u64)>, WeightsError> {
        let (Some((base, prev)), Some((keyframe, _))) = (&self.prev, self.keyframe) else {
            return Ok(None);
        };
        let base = *base;
        if !self.cfg.delta
            || version <= base
            || version - keyframe >= self.cfg.keyframe_every
            || prev.len() as u64 != full
            || self.keyframe_requested().await?
        {
            return Ok(None);
        }
        Ok(Some((base, keyframe)))
    }

    /// The delta of `blob` on the previous version, with its base and keyframe, when
    /// [`Publisher::delta_base`] allows one and it fits (in bytes, against a keyframe and
    /// the store's bound); `None` for a keyframe.
    async fn delta_object(
        &mut self,
        version: u64,
        blob: &Arc<Vec<u8>>,
    ) -> Result<Option<(Arc<Vec<u8>>, u64, u64)>, WeightsError> {
        let full = blob.len() as u64;
        let Some((base, keyframe)) = self.delta_base(version, full).await? else {
            return Ok(None);
        };
        let Some((_, prev)) = &self.prev else {
            return Ok(None);
        };
        let (prev, next) = (prev.clone(), blob.clone());
        let encoded = tokio::task::spawn_blocking(move || delta::encode(&prev, &next))
            .await
            .map_err(|e| ModelError::Unsupported(format!("delta encoder failed: {e}")))?;
        let Some(d) = encoded else { return Ok(None) };
        let n = d.len() as u64;
        let chain = self.keyframe.map_or(0, |(_, c)| c);
        // A chain longer in bytes than a keyframe costs a joining reader more.
        let small = chain + n <= full;
        if small && (self.cfg.max_bytes == 0 || self.fit_delta(n, full).await?) {
            return Ok(Some((Arc::new(d), base, keyframe)));
        }
        Ok(None)
    }

    /// The format tag of a version: a delta, a whole adapter or a whole model.
    fn format_of(&self, delta: bool, adapter: bool) -> String {
        if delta {
            DELTA_FORMAT.into()
        } else if adapter {
            lora_format(self.dtype)
        } else {
            full_format(self.dtype).into()
        }
    }

    /// Records a published object; a keyframe (`keyframe` `None`) starts a new chain and
    /// answers a generator's request for one.
    async fn hold(&mut self, held: Held, keyframe: Option<u64>) -> Result<(), WeightsError> {
        self.held.retain(|h| h.version != held.version);
        self.held.push(held);
        match keyframe {
            Some(k) => {
                let chain = self.keyframe.map_or(0, |(_, c)| c);
                self.keyframe = Some((k, chain + held.bytes));
            }
            None => {
                self.keyframe = Some((held.version, 0));
                self.bus.delete(&[keyframe_request_key(&self.topo)]).await?;
            }
        }
        Ok(())
    }

    /// Whether a delta of `d` bytes fits the bound while leaving room for a keyframe of
    /// `full` bytes after it (deleting versions the newest does not need, if that helps).
    async fn fit_delta(&mut self, d: u64, full: u64) -> Result<bool, WeightsError> {
        let max = self.cfg.max_bytes;
        if self.newest_chain() + d + full > max {
            return Ok(false);
        }
        if self.held_bytes() + d > max {
            self.collect_keeping(1).await?;
        }
        Ok(self.held_bytes() + d <= max)
    }

    /// Bytes the newest version's chain holds (the newest version and its bases).
    fn newest_chain(&self) -> u64 {
        let Some(h) = self.held.last() else { return 0 };
        let c = self.closure(h.version);
        self.held
            .iter()
            .filter(|x| c.contains(&x.version))
            .map(|x| x.bytes)
            .sum()
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

/// When and what a version is, for its announce.
struct Stamp {
    version: u64,
    step: u64,
    started_us: u64,
    /// Seconds from the start of publishing to the object being in the store.
    encode_s: f64,
}

/// A version's object as written: its chunks, size, checksum (a delta's own) and, for a
/// delta, its base and keyframe.
struct Object {
    chunks: u32,
    bytes: u64,
    checksum: Option<String>,
    base: Option<(u64, u64)>,
}

/// What [`encode_streaming`] made: the version's bytes, their checksum, and the checksum
/// of the delta object when it wrote one.
struct Encoded {
    bytes: Vec<u8>,
    checksum: String,
    object_checksum: Option<String>,
}

fn stopped(why: &str) -> WeightsError {
    WeightsError::Store {
        store: "encoder",
        reason: why.into(),
    }
}

/// Encodes `tensors` in `layout` segment by segment into `buffer` (the previous version's
/// bytes when `on_prev`, whose delta is then what `tx` gets; otherwise any buffer of the
/// right size, or none) and sends each segment's object piece to `tx` as soon as its window
/// of segments (two per core) is made.
fn encode_streaming(
    layout: &Layout,
    tensors: &TensorMap,
    buffer: Option<Vec<u8>>,
    on_prev: bool,
    tx: &tokio::sync::mpsc::Sender<Piece>,
) -> Result<Encoded, Option<WeightsError>> {
    use rayon::prelude::*;
    let (total, segment) = (layout.total, delta::SEGMENT);
    let on_prev = on_prev && buffer.is_some();
    let mut next = buffer.unwrap_or_else(|| vec![0u8; total]);
    // A closed channel is a writer that failed: its error is the one to report.
    let send = |b: Vec<u8>| {
        tx.blocking_send(Piece::Bytes(Bytes::from(b)))
            .map_err(|_| None)
    };
    let (mut whole, mut object) = (Xxh3::new(), Xxh3::new());
    if on_prev {
        let h = delta::header(total, segment);
        object.update(&h);
        send(h)?;
    }
    let window = segment * 2 * rayon::current_num_threads().max(1);
    for (w, chunk) in next.chunks_mut(window).enumerate() {
        let from = w * window;
        let frames: Vec<Option<Vec<u8>>> = chunk
            .par_chunks_mut(segment)
            .enumerate()
            .map_init(Vec::new, |scratch: &mut Vec<u8>, (k, out)| {
                let at = from + k * segment;
                if !on_prev {
                    layout.write_range(tensors, at, out)?;
                    return Ok(None);
                }
                // `out` holds the previous version: XOR the new bytes in, compress that,
                // then leave the new bytes there.
                scratch.resize(out.len(), 0);
                layout.write_range(tensors, at, scratch)?;
                delta::xor_in_place(out, scratch);
                let frame = zstd::bulk::compress(out, delta::ZSTD_LEVEL)
                    .map_err(|e| stopped(&format!("zstd: {e}")))?;
                out.copy_from_slice(scratch);
                Ok(Some(frame))
            })
            .collect::<Result<_, WeightsError>>()
            .map_err(Some)?;
        whole.update(chunk);
        for (k, frame) in frames.into_iter().enumerate() {
            match frame {
                Some(f) => {
                    let len = delta::frame_length(&f);
                    object.update(&len);
                    object.update(&f);
                    send(len.to_vec())?;
                    send(f)?;
                }
                None => {
                    let end = ((k + 1) * segment).min(chunk.len());
                    send(chunk[k * segment..end].to_vec())?;
                }
            }
        }
    }
    tx.blocking_send(Piece::End).map_err(|_| None)?;
    let hex = |h: &Xxh3| format!("{:016x}", h.digest());
    Ok(Encoded {
        bytes: next,
        checksum: hex(&whole),
        object_checksum: on_prev.then(|| hex(&object)),
    })
}

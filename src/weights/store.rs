//! Where the bytes of a version live, apart from the announce that names them.
//!
//! Each published version is one object: a full version or a delta. [`RedisStore`] keeps it
//! in chunks beside the streams (`{namespace}:weights:{version}:{chunk}`); [`DirStore`] keeps
//! it as a file in a directory every machine mounts, written to a temporary name, fsynced
//! and renamed, so a reader sees a whole file or none. Either way the announce goes on the
//! weights stream only after the object is complete.
//!
//! Another store (an S3-compatible bucket) is one more implementation of [`BlobStore`]: put
//! the object under a key made from the namespace and version (a single PUT is atomic
//! there, so no rename), get it back whole, delete it; add its name to
//! [`StoreKind`](super::StoreKind) and to [`open`].

use super::{StoreKind, WeightsConfig, WeightsError};
use crate::bus::{SharedBus, Topology};
use bytes::Bytes;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Kills the writing process with `abort` once it has written this many weight chunks (or
/// file pieces): the fault-injection hook of the tests of a trainer killed halfway through
/// a version. Nothing sets it otherwise.
pub const FAULT_EXIT_ENV: &str = "RLSTREAM_FAULT_ABORT_AFTER_WEIGHT_CHUNKS";

fn fault_budget() -> Option<u64> {
    static BUDGET: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| std::env::var(FAULT_EXIT_ENV).ok()?.parse().ok())
}

/// Counts a written piece and aborts when the fault budget is spent.
fn fault_tick() {
    static WRITTEN: AtomicU64 = AtomicU64::new(0);
    if let Some(n) = fault_budget()
        && WRITTEN.fetch_add(1, Ordering::SeqCst) + 1 >= n
    {
        eprintln!("injected fault: aborting after {n} weight chunks ({FAULT_EXIT_ENV})");
        std::process::abort();
    }
}

/// A piece of an object written while it is being made ([`BlobStore::put_stream`]).
pub enum Piece {
    Bytes(Bytes),
    /// The object is whole: nothing follows.
    End,
}

/// The pieces of an object, for a writer that consumes them as they come. The object is
/// complete only once [`Piece::End`] arrives: a channel that closes before it is a writer
/// that stopped halfway, and what was written is removed.
pub type Pieces = tokio::sync::mpsc::Receiver<Piece>;

fn stopped_halfway(store: &'static str, version: u64) -> WeightsError {
    WeightsError::Store {
        store,
        reason: format!("version {version} stopped before its last piece; nothing was kept"),
    }
}

/// Bytes owned by an `Arc<Vec<u8>>`, handed out without a copy.
struct Shared(Arc<Vec<u8>>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// The pieces of an object that is already whole.
fn whole(bytes: Arc<Vec<u8>>) -> Pieces {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    // Capacity 2 holds both: neither send can fail or wait.
    let _ = tx.try_send(Piece::Bytes(Bytes::from_owner(Shared(bytes))));
    let _ = tx.try_send(Piece::End);
    rx
}

/// A place for version objects. `put` is complete when it returns; `get` returns the bytes
/// as stored (the caller verifies them against the announce).
#[async_trait::async_trait]
pub trait BlobStore: Send + Sync {
    fn kind(&self) -> StoreKind;
    /// Writes the object of `version`; returns how many chunks it took.
    async fn put(&self, version: u64, bytes: Arc<Vec<u8>>) -> Result<u32, WeightsError>;
    /// Writes the object of `version` piece by piece as `pieces` brings them, so that
    /// writing overlaps making the object; returns how many chunks and bytes it took. The
    /// default gathers the pieces and [`BlobStore::put`]s them.
    async fn put_stream(
        &self,
        version: u64,
        mut pieces: Pieces,
    ) -> Result<(u32, u64), WeightsError> {
        let mut all = Vec::new();
        loop {
            match pieces.recv().await {
                Some(Piece::Bytes(b)) => all.extend_from_slice(&b),
                Some(Piece::End) => break,
                None => return Err(stopped_halfway(self.kind().as_str(), version)),
            }
        }
        let n = all.len() as u64;
        Ok((self.put(version, Arc::new(all)).await?, n))
    }
    /// Reads the object of `version` written in `chunks` chunks.
    async fn get(&self, version: u64, chunks: u32) -> Result<Vec<u8>, WeightsError>;
    /// Deletes the object of `version` (absent is not an error).
    async fn remove(&self, version: u64, chunks: u32) -> Result<(), WeightsError>;
    /// Removes objects a writer killed halfway left behind; returns how many. Only the
    /// trainer (the one writer of a namespace) calls it, at start.
    async fn clean_partial(&self) -> Result<usize, WeightsError> {
        Ok(0)
    }
}

/// The store `cfg` names, for a pipeline on `bus` under `topo`'s namespace.
pub fn open(
    cfg: &WeightsConfig,
    bus: &SharedBus,
    topo: &Topology,
) -> Result<Arc<dyn BlobStore>, WeightsError> {
    Ok(match cfg.store {
        StoreKind::Redis => Arc::new(RedisStore {
            bus: bus.clone(),
            topo: topo.clone(),
            chunk_bytes: cfg.chunk_bytes.max(1),
        }),
        StoreKind::Dir => {
            let Some(root) = &cfg.store_dir else {
                return Err(WeightsError::Store {
                    store: "dir",
                    reason: "no directory: set --store-dir DIR (weights.store_dir)".into(),
                });
            };
            Arc::new(DirStore::new(root, &topo.namespace, cfg.chunk_bytes))
        }
    })
}

/// Chunks in Redis (or in the embedded bus) beside the streams.
pub struct RedisStore {
    pub bus: SharedBus,
    pub topo: Topology,
    pub chunk_bytes: usize,
}

#[async_trait::async_trait]
impl BlobStore for RedisStore {
    fn kind(&self) -> StoreKind {
        StoreKind::Redis
    }

    async fn put(&self, version: u64, bytes: Arc<Vec<u8>>) -> Result<u32, WeightsError> {
        Ok(self.put_stream(version, whole(bytes)).await?.0)
    }

    /// Cuts the pieces into chunks of `chunk_bytes` (the same chunks whatever the pieces)
    /// and writes them in pipelined batches as they fill.
    async fn put_stream(
        &self,
        version: u64,
        mut pieces: Pieces,
    ) -> Result<(u32, u64), WeightsError> {
        let size = self.chunk_bytes.max(1);
        let mut open = bytes::BytesMut::new();
        let mut ready: Vec<(String, Bytes)> = Vec::new();
        let (mut chunks, mut total) = (0u32, 0u64);
        let cut = |b: Bytes, ready: &mut Vec<(String, Bytes)>, chunks: &mut u32| {
            ready.push((self.topo.weights_chunk_key(version, *chunks), b));
            *chunks += 1;
        };
        loop {
            let piece = pieces.recv().await;
            let end = match piece {
                Some(Piece::Bytes(mut b)) => {
                    total += b.len() as u64;
                    while !b.is_empty() {
                        if open.is_empty() && b.len() >= size {
                            cut(b.split_to(size), &mut ready, &mut chunks);
                            continue;
                        }
                        let take = (size - open.len()).min(b.len());
                        open.extend_from_slice(&b.split_to(take));
                        if open.len() == size {
                            cut(open.split().freeze(), &mut ready, &mut chunks);
                        }
                    }
                    false
                }
                Some(Piece::End) => {
                    if !open.is_empty() || (chunks == 0 && ready.is_empty()) {
                        cut(open.split().freeze(), &mut ready, &mut chunks);
                    }
                    true
                }
                None => {
                    let keys: Vec<String> = (0..chunks)
                        .map(|c| self.topo.weights_chunk_key(version, c))
                        .collect();
                    self.bus.delete(&keys).await?;
                    return Err(stopped_halfway("redis", version));
                }
            };
            // One pipelined batch per few chunks keeps other traffic moving between them.
            while ready.len() >= 16 || (end && !ready.is_empty()) {
                let batch: Vec<_> = ready.drain(..ready.len().min(16)).collect();
                if fault_budget().is_some() {
                    for c in &batch {
                        self.bus.put_blobs(std::slice::from_ref(c)).await?;
                        fault_tick();
                    }
                } else {
                    self.bus.put_blobs(&batch).await?;
                }
            }
            if end {
                return Ok((chunks, total));
            }
        }
    }

    async fn get(&self, version: u64, chunks: u32) -> Result<Vec<u8>, WeightsError> {
        let keys: Vec<String> = (0..chunks)
            .map(|c| self.topo.weights_chunk_key(version, c))
            .collect();
        let mut out = Vec::new();
        for (batch_at, batch) in keys.chunks(16).enumerate() {
            let parts = self.bus.get_blobs(batch).await?;
            for (i, p) in parts.into_iter().enumerate() {
                let p = p.ok_or(WeightsError::MissingChunk {
                    version,
                    chunk: (batch_at * 16 + i) as u32,
                })?;
                out.extend_from_slice(&p);
            }
        }
        Ok(out)
    }

    async fn remove(&self, version: u64, chunks: u32) -> Result<(), WeightsError> {
        let keys: Vec<String> = (0..chunks)
            .map(|c| self.topo.weights_chunk_key(version, c))
            .collect();
        self.bus.delete(&keys).await?;
        Ok(())
    }
}

/// Files `{root}/{namespace}/v{version}.bin` in a shared directory.
pub struct DirStore {
    dir: PathBuf,
    piece: usize,
}

impl DirStore {
    /// The store in `{root}/{namespace}` (created by the first write), writing in pieces of
    /// `piece` bytes.
    pub fn new(root: &Path, namespace: &str, piece: usize) -> Self {
        DirStore {
            dir: root.join(namespace),
            piece: piece.max(1),
        }
    }

    pub fn path(&self, version: u64) -> PathBuf {
        self.dir.join(format!("v{version:012}.bin"))
    }
}

fn dir_err(path: &Path, what: &str, e: &std::io::Error) -> WeightsError {
    WeightsError::Store {
        store: "dir",
        reason: format!("{what} {}: {e}", path.display()),
    }
}

#[async_trait::async_trait]
impl BlobStore for DirStore {
    fn kind(&self) -> StoreKind {
        StoreKind::Dir
    }

    async fn put(&self, version: u64, bytes: Arc<Vec<u8>>) -> Result<u32, WeightsError> {
        Ok(self.put_stream(version, whole(bytes)).await?.0)
    }

    /// Appends each piece to a temporary file as it comes; fsyncs and renames it once the
    /// last has.
    async fn put_stream(
        &self,
        version: u64,
        mut pieces: Pieces,
    ) -> Result<(u32, u64), WeightsError> {
        let path = self.path(version);
        let tmp = self
            .dir
            .join(format!("v{version:012}.{}.partial", std::process::id()));
        let (dir, piece) = (self.dir.clone(), self.piece);
        tokio::task::spawn_blocking(move || {
            // The shared directory itself must exist: one that is missing is a mount that
            // is not there, and a version written under it would reach no generator.
            let root = dir.parent().unwrap_or(&dir);
            if !root.is_dir() {
                return Err(WeightsError::Store {
                    store: "dir",
                    reason: format!(
                        "{} does not exist or is not a directory (is the shared filesystem mounted?)",
                        root.display()
                    ),
                });
            }
            let mut total = 0u64;
            let mut write = || -> std::io::Result<bool> {
                if !dir.is_dir() {
                    std::fs::create_dir(&dir)?;
                }
                let mut f = std::fs::File::create(&tmp)?;
                loop {
                    match pieces.blocking_recv() {
                        Some(Piece::Bytes(b)) => {
                            for c in b.chunks(piece) {
                                f.write_all(c)?;
                                fault_tick();
                            }
                            total += b.len() as u64;
                        }
                        Some(Piece::End) => break,
                        None => return Ok(false),
                    }
                }
                f.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                // The rename is durable once the directory is synced.
                std::fs::File::open(&dir)?.sync_all()?;
                Ok(true)
            };
            match write() {
                Ok(true) => Ok((1, total)),
                Ok(false) => {
                    let _ = std::fs::remove_file(&tmp);
                    Err(stopped_halfway("dir", version))
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    Err(dir_err(&path, "cannot write", &e))
                }
            }
        })
        .await
        .map_err(|e| WeightsError::Store {
            store: "dir",
            reason: format!("writer task failed: {e}"),
        })?
    }

    async fn get(&self, version: u64, _chunks: u32) -> Result<Vec<u8>, WeightsError> {
        let path = self.path(version);
        tokio::task::spawn_blocking(move || match std::fs::read(&path) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(WeightsError::MissingChunk { version, chunk: 0 })
            }
            Err(e) => Err(dir_err(&path, "cannot read", &e)),
        })
        .await
        .map_err(|e| WeightsError::Store {
            store: "dir",
            reason: format!("reader task failed: {e}"),
        })?
    }

    async fn remove(&self, version: u64, _chunks: u32) -> Result<(), WeightsError> {
        match std::fs::remove_file(self.path(version)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(dir_err(&self.path(version), "cannot remove", &e)),
        }
    }

    async fn clean_partial(&self) -> Result<usize, WeightsError> {
        let mut removed = 0;
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(dir_err(&self.dir, "cannot list", &e)),
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().ends_with(".partial") {
                std::fs::remove_file(e.path())
                    .map_err(|err| dir_err(&e.path(), "cannot remove", &err))?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

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

/// A place for version objects. `put` is complete when it returns; `get` returns the bytes
/// as stored (the caller verifies them against the announce).
#[async_trait::async_trait]
pub trait BlobStore: Send + Sync {
    fn kind(&self) -> StoreKind;
    /// Writes the object of `version`; returns how many chunks it took.
    async fn put(&self, version: u64, bytes: Arc<Vec<u8>>) -> Result<u32, WeightsError>;
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
        let chunks: Vec<(String, Bytes)> = if bytes.is_empty() {
            vec![(self.topo.weights_chunk_key(version, 0), Bytes::new())]
        } else {
            bytes
                .chunks(self.chunk_bytes)
                .enumerate()
                .map(|(i, c)| {
                    (
                        self.topo.weights_chunk_key(version, i as u32),
                        Bytes::copy_from_slice(c),
                    )
                })
                .collect()
        };
        if fault_budget().is_some() {
            for c in &chunks {
                self.bus.put_blobs(std::slice::from_ref(c)).await?;
                fault_tick();
            }
        } else {
            // One pipelined batch per few chunks keeps other traffic moving between them.
            for batch in chunks.chunks(16) {
                self.bus.put_blobs(batch).await?;
            }
        }
        Ok(chunks.len() as u32)
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
            let write = || -> std::io::Result<()> {
                if !dir.is_dir() {
                    std::fs::create_dir(&dir)?;
                }
                let mut f = std::fs::File::create(&tmp)?;
                for c in bytes.chunks(piece) {
                    f.write_all(c)?;
                    fault_tick();
                }
                f.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                // The rename is durable once the directory is synced.
                std::fs::File::open(&dir)?.sync_all()
            };
            write().map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                dir_err(&path, "cannot write", &e)
            })
        })
        .await
        .map_err(|e| WeightsError::Store {
            store: "dir",
            reason: format!("writer task failed: {e}"),
        })??;
        Ok(1)
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

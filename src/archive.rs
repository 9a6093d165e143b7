//! Stream archives: `rlstream dump` writes them, `rlstream load` and
//! `rlstream replay --archive` read them.
//!
//! # Format, version 1
//!
//! A gzip stream holding a sequence of MessagePack values (structs as maps):
//!
//! 1. a header `{format: "rlstream-archive", version: 1, streams: [NAME, ...]}`: the stream
//!    names (without namespace) in the order they follow;
//! 2. one `{"Entry": {stream, id, payload}}` per entry: the stream name, the entry id as
//!    Redis writes it (`MS-SEQ`) and the message bytes exactly as read (MessagePack `bin`).
//!    Entries of one stream are in id order;
//! 3. a trailer `{"End": {entries, checksum}}`: the entry count and the xxh3-64 (16 hex
//!    digits) of every entry's stream name, id and payload, in order.
//!
//! A file without its trailer was cut short and is refused. Nothing machine- or
//! time-specific is written (the gzip header has no name and time 0), so dump → load →
//! dump reproduces the file byte for byte. Consumer-group state is not archived: a load
//! restores entries, and consumers start from whatever group start they ask for.

use crate::bus::{Bus, BusError, Entry, EntryId, RangeBound, Topology};
use bytes::Bytes;
use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use serde::{Deserialize, Serialize};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::Xxh3;

pub const FORMAT: &str = "rlstream-archive";
pub const VERSION: u32 = 1;
/// Entries written to the bus per round trip by [`load`].
const PAGE: usize = crate::bus::SCAN_PAGE;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub streams: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize)]
enum Item {
    Entry {
        stream: String,
        id: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    End {
        entries: u64,
        checksum: String,
    },
}

/// One archived entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchivedEntry {
    /// Stream name without namespace (`scored`).
    pub stream: String,
    pub id: EntryId,
    pub payload: Bytes,
}

impl ArchiveError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        ArchiveError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not an rlstream archive: {reason}")]
    NotArchive { path: String, reason: String },
    #[error(
        "{path} is archive format version {found}; this build reads version {VERSION} (use the rlstream that wrote it)"
    )]
    Version { path: String, found: u32 },
    #[error(
        "{path} is cut short after {entries} entries (no trailer): the dump did not finish; dump again"
    )]
    Truncated { path: String, entries: u64 },
    #[error("{path} is corrupt: {reason}")]
    Corrupt { path: String, reason: String },
    #[error(
        "stream {stream} already holds entries up to {last}, and the archive starts at {first}: load into a fresh --namespace"
    )]
    NotEmpty {
        stream: String,
        last: EntryId,
        first: EntryId,
    },
    #[error("the archive has no stream `{0}`")]
    NoStream(String),
    #[error(transparent)]
    Bus(#[from] BusError),
}

fn hash_entry(h: &mut Xxh3, stream: &str, id: &str, payload: &[u8]) {
    for part in [stream.as_bytes(), id.as_bytes(), payload] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
}

/// Writes an archive entry by entry. [`Writer::finish`] writes the trailer; without it the
/// file reads as truncated.
pub struct Writer<W: Write> {
    out: GzEncoder<W>,
    hasher: Xxh3,
    entries: u64,
    path: String,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W, streams: &[String], path: &str) -> Result<Self, ArchiveError> {
        let mut w = Writer {
            out: GzEncoder::new(out, Compression::default()),
            hasher: Xxh3::new(),
            entries: 0,
            path: path.to_string(),
        };
        let header = Header {
            format: FORMAT.into(),
            version: VERSION,
            streams: streams.to_vec(),
        };
        w.put(&header)?;
        Ok(w)
    }

    fn put<T: Serialize>(&mut self, value: &T) -> Result<(), ArchiveError> {
        use rmp::encode::ValueWriteError::{InvalidDataWrite, InvalidMarkerWrite};
        rmp_serde::encode::write_named(&mut self.out, value).map_err(|e| ArchiveError::Io {
            path: self.path.clone(),
            // The file's own error (a full disk, EFBIG) rather than the encoder's summary.
            source: match e {
                rmp_serde::encode::Error::InvalidValueWrite(
                    InvalidMarkerWrite(io) | InvalidDataWrite(io),
                ) => io,
                other => std::io::Error::other(other.to_string()),
            },
        })
    }

    pub fn write(&mut self, stream: &str, id: EntryId, payload: &[u8]) -> Result<(), ArchiveError> {
        let id = id.to_string();
        hash_entry(&mut self.hasher, stream, &id, payload);
        self.entries += 1;
        self.put(&Item::Entry {
            stream: stream.to_string(),
            id,
            payload: payload.to_vec(),
        })
    }

    /// Writes the trailer and flushes; returns the entry count and the inner writer.
    pub fn finish(mut self) -> Result<(u64, W), ArchiveError> {
        let end = Item::End {
            entries: self.entries,
            checksum: format!("{:016x}", self.hasher.digest()),
        };
        self.put(&end)?;
        let path = self.path.clone();
        let inner = self
            .out
            .finish()
            .map_err(|source| ArchiveError::Io { path, source })?;
        Ok((self.entries, inner))
    }
}

/// Reads an archive entry by entry, checking the trailer at the end.
pub struct Reader<R: Read> {
    input: GzDecoder<R>,
    header: Header,
    hasher: Xxh3,
    entries: u64,
    done: bool,
    path: String,
}

impl Reader<BufReader<std::fs::File>> {
    pub fn open(path: &Path) -> Result<Self, ArchiveError> {
        let file = std::fs::File::open(path).map_err(|source| ArchiveError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Reader::new(BufReader::new(file), &path.display().to_string())
    }
}

impl<R: Read> Reader<R> {
    pub fn new(input: R, path: &str) -> Result<Self, ArchiveError> {
        let mut input = GzDecoder::new(input);
        let header: Header =
            rmp_serde::from_read(&mut input).map_err(|e| ArchiveError::NotArchive {
                path: path.to_string(),
                reason: e.to_string(),
            })?;
        if header.format != FORMAT {
            return Err(ArchiveError::NotArchive {
                path: path.to_string(),
                reason: format!("format `{}`", header.format),
            });
        }
        if header.version != VERSION {
            return Err(ArchiveError::Version {
                path: path.to_string(),
                found: header.version,
            });
        }
        Ok(Reader {
            input,
            header,
            hasher: Xxh3::new(),
            entries: 0,
            done: false,
            path: path.to_string(),
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    fn corrupt(&self, reason: impl Into<String>) -> ArchiveError {
        ArchiveError::Corrupt {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    fn next_entry(&mut self) -> Result<Option<ArchivedEntry>, ArchiveError> {
        if self.done {
            return Ok(None);
        }
        let item: Item = match rmp_serde::from_read(&mut self.input) {
            Ok(item) => item,
            Err(rmp_serde::decode::Error::InvalidMarkerRead(e))
                if e.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                return Err(ArchiveError::Truncated {
                    path: self.path.clone(),
                    entries: self.entries,
                });
            }
            Err(e) => return Err(self.corrupt(format!("entry {}: {e}", self.entries + 1))),
        };
        match item {
            Item::Entry {
                stream,
                id,
                payload,
            } => {
                let parsed: EntryId = id
                    .parse()
                    .map_err(|_| self.corrupt(format!("entry id `{id}`")))?;
                hash_entry(&mut self.hasher, &stream, &id, &payload);
                self.entries += 1;
                Ok(Some(ArchivedEntry {
                    stream,
                    id: parsed,
                    payload: Bytes::from(payload),
                }))
            }
            Item::End { entries, checksum } => {
                self.done = true;
                if entries != self.entries {
                    return Err(self.corrupt(format!(
                        "the trailer counts {entries} entries, the file holds {}",
                        self.entries
                    )));
                }
                let found = format!("{:016x}", self.hasher.digest());
                if found != checksum {
                    return Err(self.corrupt(format!(
                        "checksum {found} does not match the trailer's {checksum}"
                    )));
                }
                Ok(None)
            }
        }
    }
}

impl<R: Read> Iterator for Reader<R> {
    type Item = Result<ArchivedEntry, ArchiveError>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.next_entry() {
            Ok(Some(e)) => Some(Ok(e)),
            Ok(None) => None,
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// What a dump or load moved, per stream.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Moved {
    pub streams: Vec<(String, u64)>,
    pub entries: u64,
}

impl Moved {
    /// `dumped 12 entries (scored 10, events 2) to FILE`: `verb`, then `prep` and `path`.
    pub fn line(&self, verb: &str, prep: &str, path: &Path) -> String {
        let per: Vec<String> = self
            .streams
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect();
        format!(
            "{verb} {} entries ({}) {prep} {}",
            self.entries,
            per.join(", "),
            path.display()
        )
    }
}

/// Pages in flight between the bus and the file thread in [`dump`] and [`load`].
const PIPE_DEPTH: usize = 4;

/// What the bus side of [`dump`] hands its file thread: a page of one stream (by index), or
/// the end of a complete read.
enum ToFile {
    Page(usize, Vec<Entry>),
    Done,
}

/// Writes the entries of `streams` (names without namespace) between `from` and `to` to
/// `path`: first to `path.partial`, renamed into place once complete, so a crash never
/// leaves a file that looks finished. `progress` sees the running entry count. Compression
/// and the file writes run on a blocking thread, fed page by page.
pub async fn dump(
    bus: &dyn Bus,
    topo: &Topology,
    streams: &[String],
    from: RangeBound,
    to: RangeBound,
    path: &Path,
    mut progress: impl FnMut(&str, u64),
) -> Result<Moved, ArchiveError> {
    let (tx, rx) = tokio::sync::mpsc::channel(PIPE_DEPTH);
    let file = {
        let (path, streams) = (path.to_path_buf(), streams.to_vec());
        tokio::task::spawn_blocking(move || write_file(&path, &streams, rx))
    };
    let mut moved = Moved::default();
    let read = async {
        for (i, name) in streams.iter().enumerate() {
            let key = topo.key(name);
            let mut pages = crate::bus::Pages::new(&key, from, to);
            let mut n = 0u64;
            while let Some(page) = pages.next(bus).await? {
                n += page.len() as u64;
                progress(name, moved.entries + n);
                if tx.send(ToFile::Page(i, page)).await.is_err() {
                    return Ok(()); // the file thread stopped: its error says why
                }
            }
            moved.streams.push((name.clone(), n));
            moved.entries += n;
        }
        let _ = tx.send(ToFile::Done).await;
        Ok::<_, ArchiveError>(())
    };
    let read = read.await;
    drop(tx);
    joined(file.await, path)?;
    read?;
    Ok(moved)
}

/// The file side of [`dump`]: writes pages until `Done` and puts the file in place; returns
/// without renaming when the bus side stops early (its error is the one reported). A file
/// that was not finished (that error, or one of its own: a full disk) is removed.
fn write_file(
    path: &Path,
    streams: &[String],
    pages: tokio::sync::mpsc::Receiver<ToFile>,
) -> Result<(), ArchiveError> {
    let shown = path.display().to_string();
    let partial = PathBuf::from(format!("{}.partial", path.display()));
    let written = write_partial(&partial, &shown, streams, pages);
    if !matches!(written, Ok(true)) {
        let _ = std::fs::remove_file(&partial);
        return written.map(|_| ());
    }
    std::fs::rename(&partial, path).map_err(|source| ArchiveError::Io {
        path: shown,
        source,
    })
}

/// Writes the pages to `partial` and syncs it; false when the bus side stopped early.
fn write_partial(
    partial: &Path,
    shown: &str,
    streams: &[String],
    mut pages: tokio::sync::mpsc::Receiver<ToFile>,
) -> Result<bool, ArchiveError> {
    let io = |source| ArchiveError::Io {
        path: shown.to_string(),
        source,
    };
    let file = std::fs::File::create(partial).map_err(io)?;
    let mut w = Writer::new(BufWriter::new(file), streams, shown)?;
    loop {
        match pages.blocking_recv() {
            Some(ToFile::Page(i, page)) => {
                for e in page {
                    w.write(&streams[i], e.id, &e.payload)?;
                }
            }
            Some(ToFile::Done) => break,
            None => return Ok(false),
        }
    }
    let (_, out) = w.finish()?;
    let file = out
        .into_inner()
        .map_err(|e| io(std::io::Error::other(e.to_string())))?;
    file.sync_all().map_err(io)?;
    Ok(true)
}

/// A blocking file task's result, a panic in it as an I/O error on `path`.
fn joined<T>(
    r: Result<Result<T, ArchiveError>, tokio::task::JoinError>,
    path: &Path,
) -> Result<T, ArchiveError> {
    r.map_err(|e| ArchiveError::Io {
        path: path.display().to_string(),
        source: std::io::Error::other(format!("the file task failed: {e}")),
    })?
}

/// Each archived stream's first entry id, in file order, after checking the whole file
/// (count, checksum) and that every stream in `only` is in it.
fn first_ids(path: &Path, only: Option<&[String]>) -> Result<Vec<(String, EntryId)>, ArchiveError> {
    let reader = Reader::open(path)?;
    if let Some(only) = only {
        for s in only {
            if !reader.header().streams.contains(s) {
                return Err(ArchiveError::NoStream(s.clone()));
            }
        }
    }
    let mut firsts: Vec<(String, EntryId)> = Vec::new();
    for e in reader {
        let e = e?;
        if !firsts.iter().any(|(s, _)| *s == e.stream) {
            firsts.push((e.stream, e.id));
        }
    }
    Ok(firsts)
}

/// One stream's run of entries, read from an archive for [`load`].
type Batch = (String, Vec<(EntryId, Bytes)>);

/// The file side of [`load`]: reads the archive and sends runs of at most [`PAGE`] entries
/// of one stream each (those in `only`, when given).
fn read_batches(
    path: &Path,
    only: Option<&[String]>,
    out: &tokio::sync::mpsc::Sender<Result<Batch, ArchiveError>>,
) -> Result<(), ArchiveError> {
    let mut batch: Option<Batch> = None;
    for e in Reader::open(path)? {
        let e = e?;
        if only.is_some_and(|o| !o.contains(&e.stream)) {
            continue;
        }
        let full = batch
            .as_ref()
            .is_some_and(|(s, b)| *s != e.stream || b.len() == PAGE);
        if full
            && let Some(b) = batch.take()
            && out.blocking_send(Ok(b)).is_err()
        {
            return Ok(());
        }
        batch
            .get_or_insert_with(|| (e.stream.clone(), Vec::with_capacity(PAGE)))
            .1
            .push((e.id, e.payload));
    }
    if let Some(b) = batch {
        let _ = out.blocking_send(Ok(b));
    }
    Ok(())
}

/// Writes an archive's entries (optionally only `only`) into the streams of `topo`'s
/// namespace, keeping their ids. Refuses a stream that already holds entries at or after
/// the first archived one. The archive is checked to its trailer before anything is
/// written, so a corrupt or truncated file loads nothing. The file is read and
/// decompressed on a blocking thread.
pub async fn load(
    bus: &dyn Bus,
    topo: &Topology,
    path: &Path,
    only: Option<&[String]>,
    mut progress: impl FnMut(&str, u64),
) -> Result<Moved, ArchiveError> {
    let only: Option<Vec<String>> = only.map(<[String]>::to_vec);
    let firsts = {
        let (file, only) = (path.to_path_buf(), only.clone());
        joined(
            tokio::task::spawn_blocking(move || first_ids(&file, only.as_deref())).await,
            path,
        )?
    };
    for (name, first) in &firsts {
        if only.as_ref().is_some_and(|o| !o.contains(name)) {
            continue;
        }
        let key = topo.key(name);
        if let Some(last) = bus.stats(&key).await?.last_id
            && last >= *first
        {
            return Err(ArchiveError::NotEmpty {
                stream: key,
                last,
                first: *first,
            });
        }
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel(PIPE_DEPTH);
    let file = {
        let path = path.to_path_buf();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = read_batches(&path, only.as_deref(), &tx) {
                let _ = tx.blocking_send(Err(e));
            }
        })
    };
    let mut moved = Moved::default();
    let mut last = String::new();
    while let Some(batch) = rx.recv().await {
        let (name, entries) = batch?;
        progress(&name, moved.entries);
        bus.append(&topo.key(&name), &entries).await?;
        let n = entries.len() as u64;
        match moved.streams.iter_mut().find(|(s, _)| *s == name) {
            Some((_, k)) => *k += n,
            None => moved.streams.push((name.clone(), n)),
        }
        moved.entries += n;
        last = name;
    }
    joined(file.await.map(Ok), path)?;
    progress(&last, moved.entries);
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(entries: &[(&str, EntryId, &[u8])]) -> Vec<u8> {
        let mut w = Writer::new(Vec::new(), &["a".into(), "b".into()], "mem").expect("header");
        for (s, id, p) in entries {
            w.write(s, *id, p).expect("write");
        }
        w.finish().expect("finish").1
    }

    #[test]
    fn entries_round_trip_with_ids_and_bytes() {
        let entries: &[(&str, EntryId, &[u8])] = &[
            ("a", EntryId::new(1, 0), b"\x93\x01\x02\x03"),
            ("a", EntryId::new(1, 1), b""),
            ("b", EntryId::new(7, 3), &[0xc1, 0xff, 0x00]),
        ];
        let bytes = sample(entries);
        assert_eq!(bytes, sample(entries), "writing is deterministic");
        let r = Reader::new(&bytes[..], "mem").expect("open");
        assert_eq!(r.header().streams, vec!["a", "b"]);
        let got: Vec<ArchivedEntry> = r.map(|e| e.expect("entry")).collect();
        assert_eq!(got.len(), 3);
        for (g, (s, id, p)) in got.iter().zip(entries) {
            assert_eq!((g.stream.as_str(), g.id, &g.payload[..]), (*s, *id, *p));
        }
    }

    #[test]
    fn a_cut_file_is_truncated_and_a_flipped_byte_is_caught() {
        let payload = vec![7u8; 5000];
        let bytes = sample(&[
            ("a", EntryId::new(1, 0), &payload),
            ("a", EntryId::new(2, 0), &payload),
        ]);
        // Decompress, cut before the trailer, recompress: a dump that died mid-way.
        let mut raw = Vec::new();
        GzDecoder::new(&bytes[..])
            .read_to_end(&mut raw)
            .expect("gunzip");
        let cut = {
            let mut enc = GzEncoder::new(Vec::new(), Compression::default());
            enc.write_all(&raw[..raw.len() - 30]).expect("gzip");
            enc.finish().expect("gzip")
        };
        let err = Reader::new(&cut[..], "cut.rla")
            .expect("header")
            .find_map(Result::err)
            .expect("an error");
        assert!(
            matches!(
                err,
                ArchiveError::Truncated { entries: 2, .. } | ArchiveError::Corrupt { .. }
            ),
            "{err}"
        );
        // A changed payload byte: the checksum catches it.
        let i = raw
            .windows(4)
            .position(|w| w == [7, 7, 7, 7])
            .expect("payload");
        raw[i] = 8;
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(&raw).expect("gzip");
        let flipped = enc.finish().expect("gzip");
        let err = Reader::new(&flipped[..], "flip.rla")
            .expect("header")
            .find_map(Result::err)
            .expect("an error");
        assert!(err.to_string().contains("checksum"), "{err}");
    }

    #[test]
    fn other_files_and_versions_are_refused_clearly() {
        let err = Reader::new(&b"not gzip at all"[..], "x.txt")
            .err()
            .expect("refused");
        assert!(err.to_string().contains("not an rlstream archive"), "{err}");
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        rmp_serde::encode::write_named(
            &mut enc,
            &Header {
                format: FORMAT.into(),
                version: 99,
                streams: vec![],
            },
        )
        .expect("encode");
        let future = enc.finish().expect("gzip");
        let err = Reader::new(&future[..], "new.rla").err().expect("refused");
        assert!(err.to_string().contains("version 99"), "{err}");
    }
}

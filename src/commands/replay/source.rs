//! Where `replay` reads recorded entries: the bus (what standing trims archived, then what
//! Redis still holds) or an archive file, and its errors.

use crate::archive::{self, ArchiveError};
use crate::bus::{EntryId, RangeBound, SharedBus, Topology};
use crate::stages::StageError;
use std::path::PathBuf;

/// Where recorded entries come from.
pub enum Source {
    Bus { bus: SharedBus, topo: Topology },
    Archive(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error(transparent)]
    Bus(#[from] crate::bus::BusError),
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("{0}")]
    Usage(String),
}

impl Source {
    /// Entries of `stream` between the bounds, in id order, at most `limit` (archives are
    /// read to the end so their trailer is checked). `visit` returns false to stop.
    pub async fn each(
        &self,
        stream: &str,
        from: RangeBound,
        to: RangeBound,
        mut visit: impl FnMut(EntryId, &[u8]) -> bool,
    ) -> Result<(), ReplayError> {
        match self {
            Source::Bus { bus, topo } => {
                // What standing trims archived comes first, then what Redis still holds;
                // an entry two of them hold is visited once.
                let mut last: Option<EntryId> = None;
                let mut open = true;
                if let Some(dir) = &topo.archive_dir {
                    for (_, path) in crate::retention::archive_files(dir, topo, stream)? {
                        for e in archive::Reader::open(&path)? {
                            let e = e?;
                            if open
                                && e.stream == stream
                                && last.is_none_or(|l| e.id > l)
                                && within(e.id, from, to)
                            {
                                last = Some(e.id);
                                open = visit(e.id, &e.payload);
                            }
                        }
                    }
                }
                if !open {
                    return Ok(());
                }
                crate::bus::scan(bus.as_ref(), &topo.key(stream), from, to, |page| {
                    page.iter()
                        .filter(|e| last.is_none_or(|l| e.id > l))
                        .all(|e| visit(e.id, &e.payload))
                })
                .await?;
                Ok(())
            }
            Source::Archive(path) => {
                let reader = archive::Reader::open(path)?;
                if !reader.header().streams.iter().any(|s| s == stream) {
                    return Err(ArchiveError::NoStream(stream.to_string()).into());
                }
                let mut open = true;
                for e in reader {
                    let e = e?;
                    if open && e.stream == stream && within(e.id, from, to) {
                        open = visit(e.id, &e.payload);
                    }
                }
                Ok(())
            }
        }
    }
}

fn within(id: EntryId, from: RangeBound, to: RangeBound) -> bool {
    let lower = match from {
        RangeBound::Open => true,
        RangeBound::Inclusive(b) => id >= b,
        RangeBound::Exclusive(b) => id > b,
    };
    let upper = match to {
        RangeBound::Open => true,
        RangeBound::Inclusive(b) => id <= b,
        RangeBound::Exclusive(b) => id < b,
    };
    lower && upper
}

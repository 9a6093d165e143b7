//! Entry ids and entries, with Redis's `ms-seq` id format.

use bytes::Bytes;
use std::fmt;
use std::str::FromStr;

/// A stream entry id: milliseconds and a sequence number, ordered like Redis ids.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct EntryId {
    pub ms: u64,
    pub seq: u64,
}

impl EntryId {
    /// Smaller than every real id (`0-0`).
    pub const ZERO: EntryId = EntryId { ms: 0, seq: 0 };

    pub fn new(ms: u64, seq: u64) -> Self {
        EntryId { ms, seq }
    }

    /// The smallest id after this one.
    pub fn next(self) -> EntryId {
        match self.seq.checked_add(1) {
            Some(seq) => EntryId { ms: self.ms, seq },
            None => EntryId {
                ms: self.ms + 1,
                seq: 0,
            },
        }
    }
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// Error for an id that is not `ms` or `ms-seq`.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a stream entry id (expected MS or MS-SEQ, e.g. 1700000000000-0)")]
pub struct BadEntryId(pub String);

impl FromStr for EntryId {
    type Err = BadEntryId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadEntryId(s.to_string());
        match s.split_once('-') {
            Some((ms, seq)) => Ok(EntryId {
                ms: ms.parse().map_err(|_| bad())?,
                seq: seq.parse().map_err(|_| bad())?,
            }),
            None => Ok(EntryId {
                ms: s.parse().map_err(|_| bad())?,
                seq: 0,
            }),
        }
    }
}

/// One bound of a range read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeBound {
    /// `-` or `+`: the start or end of the stream.
    Open,
    Inclusive(EntryId),
    Exclusive(EntryId),
}

/// One entry as delivered.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub id: EntryId,
    pub payload: Bytes,
    /// Times the entry has been delivered through the group, this delivery included
    /// (1 for plain reads and range reads).
    pub deliveries: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_print_and_order() {
        let a: EntryId = "1700000000000-5".parse().unwrap();
        assert_eq!(a, EntryId::new(1_700_000_000_000, 5));
        assert_eq!(a.to_string(), "1700000000000-5");
        assert_eq!("42".parse::<EntryId>().unwrap(), EntryId::new(42, 0));
        assert!("x-1".parse::<EntryId>().is_err());
        assert!(EntryId::new(1, 9) < EntryId::new(2, 0));
        assert_eq!(EntryId::new(1, u64::MAX).next(), EntryId::new(2, 0));
    }
}

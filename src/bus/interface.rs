//! The bus interface and the records it returns: what [`Bus`] is, in a file of its own so that
//! the bus's implementations and the consumer name it without naming the folder's `mod.rs`.

use super::{BusResult, Entry, EntryId, RangeBound};
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Where a new consumer group starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupStart {
    /// From the first entry still in the stream.
    Beginning,
    /// Only entries added after the group is created.
    End,
}

/// Which entries a group read returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    /// Entries never delivered to this group (`>`).
    New,
    /// Entries already delivered to this consumer and not yet acked (after a restart), with
    /// ids above `after` ([`EntryId::ZERO`] for all): a consumer that holds what it read
    /// pages through them by passing the last id it got.
    OwnPending { after: EntryId },
}

/// Length, pending and lag of one stream, from XINFO.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamStats {
    pub length: u64,
    pub first_id: Option<EntryId>,
    pub last_id: Option<EntryId>,
    pub groups: Vec<GroupStats>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupStats {
    pub name: String,
    /// Entries delivered and not yet acked.
    pub pending: u64,
    /// Entries in the stream not yet delivered to the group (None when Redis cannot tell).
    pub lag: Option<u64>,
    pub last_delivered: EntryId,
    pub consumers: Vec<ConsumerStats>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConsumerStats {
    pub name: String,
    pub pending: u64,
    /// Time since the consumer last read.
    pub idle: Duration,
}

/// A dead letter to write: the original entry and why it was given up on.
#[derive(Debug, Clone)]
pub struct DeadLetterRecord {
    pub entry_id: EntryId,
    /// The encoded [`crate::schema::DeadLetter`].
    pub letter: Bytes,
}

/// Entries read per round trip by [`scan`].
pub const SCAN_PAGE: usize = 1000;

/// A stream read between two bounds in id order, a page of [`SCAN_PAGE`] entries per round
/// trip.
pub struct Pages<'a> {
    stream: &'a str,
    start: RangeBound,
    to: RangeBound,
    done: bool,
}

impl<'a> Pages<'a> {
    pub fn new(stream: &'a str, from: RangeBound, to: RangeBound) -> Self {
        Pages {
            stream,
            start: from,
            to,
            done: false,
        }
    }

    /// The next page; `None` once the range is read.
    pub async fn next(&mut self, bus: &dyn Bus) -> BusResult<Option<Vec<Entry>>> {
        if self.done {
            return Ok(None);
        }
        let page = bus
            .range(self.stream, self.start, self.to, SCAN_PAGE)
            .await?;
        match page.last() {
            Some(last) if page.len() == SCAN_PAGE => self.start = RangeBound::Exclusive(last.id),
            _ => self.done = true,
        }
        Ok(if page.is_empty() { None } else { Some(page) })
    }
}

/// Reads `stream` between the bounds in id order (see [`Pages`]), handing each page to
/// `visit` until it returns false or the range ends.
pub async fn scan(
    bus: &dyn Bus,
    stream: &str,
    from: RangeBound,
    to: RangeBound,
    mut visit: impl FnMut(&[Entry]) -> bool,
) -> BusResult<()> {
    let mut pages = Pages::new(stream, from, to);
    while let Some(page) = pages.next(bus).await? {
        if !visit(&page) {
            break;
        }
    }
    Ok(())
}

/// The shared handle stages hold.
pub type SharedBus = Arc<dyn Bus>;

#[async_trait]
pub trait Bus: Send + Sync + 'static {
    /// `redis` or `memory`, for logs.
    fn backend(&self) -> &'static str;

    /// Creates the consumer group (and the stream) if missing; an existing group is kept.
    async fn create_group(&self, stream: &str, group: &str, start: GroupStart) -> BusResult<()>;

    /// Appends payloads in one pipelined batch, in order. `max_len` trims the stream to
    /// about that many entries (`MAXLEN ~`) as it goes.
    async fn publish(
        &self,
        stream: &str,
        payloads: &[Bytes],
        max_len: Option<u64>,
    ) -> BusResult<Vec<EntryId>>;

    /// Reads up to `count` entries through a consumer group. With [`ReadFrom::New`] and a
    /// `block` duration it waits up to that long for an entry; [`ReadFrom::OwnPending`]
    /// never blocks.
    async fn read_group(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        from: ReadFrom,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>>;

    /// Acknowledges entries; returns how many were pending.
    async fn ack(&self, stream: &str, group: &str, ids: &[EntryId]) -> BusResult<u64>;

    /// Moves up to `count` entries pending for longer than `min_idle` (under any consumer)
    /// to `consumer`, incrementing their delivery counts.
    async fn claim_idle(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        min_idle: Duration,
        count: usize,
    ) -> BusResult<Vec<Entry>>;

    /// Resets the idle time of entries pending under `consumer` without counting a delivery
    /// (`XCLAIM … JUSTID`), so work a consumer holds longer than `claim_idle` (the trainer
    /// holds entries until its next checkpoint) is not claimed while it is alive.
    async fn touch(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        ids: &[EntryId],
    ) -> BusResult<()>;

    /// Atomically appends each letter to `dead_stream` and acks its entry on `stream`, so
    /// a dead-lettered entry is neither lost nor delivered again.
    async fn dead_letter(
        &self,
        stream: &str,
        group: &str,
        dead_stream: &str,
        letters: &[DeadLetterRecord],
    ) -> BusResult<()>;

    /// Reads entries after `after` without a group (every reader sees every entry).
    async fn read_after(
        &self,
        stream: &str,
        after: EntryId,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>>;

    /// Entries between two bounds, in id order, at most `count`.
    async fn range(
        &self,
        stream: &str,
        start: RangeBound,
        end: RangeBound,
        count: usize,
    ) -> BusResult<Vec<Entry>>;

    /// Length, pending and lag.
    async fn stats(&self, stream: &str) -> BusResult<StreamStats>;

    /// Appends entries under the given ids, in order (restoring an archive). Every id must
    /// be above the stream's last id; an error names the first that is not.
    async fn append(&self, stream: &str, entries: &[(EntryId, Bytes)]) -> BusResult<()>;

    /// Removes every entry with an id below `min_id` (`XTRIM MINID =`); returns how many.
    /// Callers decide what is safe to remove (see `crate::retention`).
    async fn trim_before(&self, stream: &str, min_id: EntryId) -> BusResult<u64>;

    /// Bytes the stream takes in the bus's memory (`MEMORY USAGE key SAMPLES 0` on Redis:
    /// every node counted, entries, ids and overhead); 0 for a stream that does not exist.
    async fn memory_usage(&self, stream: &str) -> BusResult<u64>;

    /// The smallest id pending (delivered, not acked) in `group`, if any (`XPENDING`).
    async fn oldest_pending(&self, stream: &str, group: &str) -> BusResult<Option<EntryId>>;

    /// Writes blobs in one pipelined batch.
    async fn put_blobs(&self, blobs: &[(String, Bytes)]) -> BusResult<()>;

    /// Reads blobs; a missing key is `None`.
    async fn get_blobs(&self, keys: &[String]) -> BusResult<Vec<Option<Bytes>>>;

    /// Deletes keys (blobs or whole streams); returns how many existed.
    async fn delete(&self, keys: &[String]) -> BusResult<u64>;
}

//! `MemoryBus`: streams and consumer groups in process, with Redis's semantics.
//!
//! Used by `rlstream run` (no Redis needed) and by fast tests. It keeps pending entry
//! lists, delivery counts, idle times and group lag exactly like Redis does, so code that
//! passes the conformance suite here behaves the same against Redis.

use super::{
    Bus, BusError, BusResult, ConsumerStats, DeadLetterRecord, Entry, EntryId, GroupStart,
    GroupStats, RangeBound, ReadFrom, StreamStats,
};
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

#[derive(Default)]
pub struct MemoryBus {
    state: Mutex<MemoryState>,
    /// Woken on every append, so blocked readers re-check their streams.
    appended: Arc<Notify>,
}

#[derive(Default)]
struct MemoryState {
    streams: HashMap<String, StreamLog>,
    blobs: HashMap<String, Bytes>,
}

#[derive(Default)]
struct StreamLog {
    entries: BTreeMap<EntryId, Bytes>,
    last_id: EntryId,
    groups: BTreeMap<String, Group>,
}

struct Group {
    last_delivered: EntryId,
    pending: BTreeMap<EntryId, PendingEntry>,
    /// Consumer name → last time it read.
    consumers: BTreeMap<String, Instant>,
}

struct PendingEntry {
    consumer: String,
    delivered_at: Instant,
    deliveries: u32,
}

impl MemoryBus {
    /// What an entry costs beyond its payload in [`Bus::memory_usage`]: its id and the
    /// map's node, roughly.
    pub const ENTRY_OVERHEAD: u64 = 48;

    pub fn new() -> Self {
        Self::default()
    }

    pub fn shared() -> Arc<Self> {
        Arc::new(Self::new())
    }

    fn lock(&self) -> MutexGuard<'_, MemoryState> {
        // A panic while holding the lock leaves consistent data (every mutation is
        // completed before any call that could panic), so poisoning is not fatal.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until something is appended or the deadline passes. Returns false on timeout.
    async fn wait_for_append(&self, deadline: Instant) -> bool {
        let notified = self.appended.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        tokio::time::timeout_at(deadline.into(), notified)
            .await
            .is_ok()
    }
}

impl StreamLog {
    fn next_id(&mut self) -> EntryId {
        let ms = crate::time::now_ms();
        let id = if ms > self.last_id.ms {
            EntryId::new(ms, 0)
        } else {
            self.last_id.next()
        };
        self.last_id = id;
        id
    }

    fn group_mut(&mut self, stream: &str, group: &str) -> BusResult<&mut Group> {
        self.groups
            .get_mut(group)
            .ok_or_else(|| no_group(stream, group))
    }

    fn lag(&self, g: &Group) -> u64 {
        self.entries
            .range((Bound::Excluded(g.last_delivered), Bound::Unbounded))
            .count() as u64
    }
}

fn no_group(stream: &str, group: &str) -> BusError {
    BusError::NoGroup {
        stream: stream.to_string(),
        group: group.to_string(),
    }
}

fn to_bound(b: RangeBound) -> Bound<EntryId> {
    match b {
        RangeBound::Open => Bound::Unbounded,
        RangeBound::Inclusive(id) => Bound::Included(id),
        RangeBound::Exclusive(id) => Bound::Excluded(id),
    }
}

#[async_trait]
impl Bus for MemoryBus {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn create_group(&self, stream: &str, group: &str, start: GroupStart) -> BusResult<()> {
        let mut st = self.lock();
        let s = st.streams.entry(stream.to_string()).or_default();
        let last_delivered = match start {
            GroupStart::Beginning => EntryId::ZERO,
            GroupStart::End => s.last_id,
        };
        s.groups.entry(group.to_string()).or_insert_with(|| Group {
            last_delivered,
            pending: BTreeMap::new(),
            consumers: BTreeMap::new(),
        });
        Ok(())
    }

    async fn publish(
        &self,
        stream: &str,
        payloads: &[Bytes],
        max_len: Option<u64>,
    ) -> BusResult<Vec<EntryId>> {
        let ids = {
            let mut st = self.lock();
            let s = st.streams.entry(stream.to_string()).or_default();
            let ids: Vec<EntryId> = payloads
                .iter()
                .map(|p| {
                    let id = s.next_id();
                    s.entries.insert(id, p.clone());
                    id
                })
                .collect();
            if let Some(max) = max_len {
                while s.entries.len() as u64 > max {
                    s.entries.pop_first();
                }
            }
            ids
        };
        self.appended.notify_waiters();
        Ok(ids)
    }

    async fn read_group(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        from: ReadFrom,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>> {
        let deadline = Instant::now() + block.unwrap_or_default();
        loop {
            {
                let mut st = self.lock();
                let s = st
                    .streams
                    .get_mut(stream)
                    .ok_or_else(|| no_group(stream, group))?;
                let StreamLog {
                    entries, groups, ..
                } = s;
                let g = groups
                    .get_mut(group)
                    .ok_or_else(|| no_group(stream, group))?;
                let now = Instant::now();
                g.consumers.insert(consumer.to_string(), now);
                let out: Vec<Entry> = match from {
                    ReadFrom::OwnPending { after } => g
                        .pending
                        .range_mut((Bound::Excluded(after), Bound::Unbounded))
                        .filter(|(_, p)| p.consumer == consumer)
                        .filter_map(|(id, p)| {
                            let payload = entries.get(id)?.clone();
                            p.deliveries += 1;
                            p.delivered_at = now;
                            Some(Entry {
                                id: *id,
                                payload,
                                deliveries: p.deliveries,
                            })
                        })
                        .take(count)
                        .collect(),
                    ReadFrom::New => {
                        let fresh: Vec<(EntryId, Bytes)> = entries
                            .range((Bound::Excluded(g.last_delivered), Bound::Unbounded))
                            .take(count)
                            .map(|(id, p)| (*id, p.clone()))
                            .collect();
                        if let Some((last, _)) = fresh.last() {
                            g.last_delivered = *last;
                        }
                        fresh
                            .into_iter()
                            .map(|(id, payload)| {
                                g.pending.insert(
                                    id,
                                    PendingEntry {
                                        consumer: consumer.to_string(),
                                        delivered_at: now,
                                        deliveries: 1,
                                    },
                                );
                                Entry {
                                    id,
                                    payload,
                                    deliveries: 1,
                                }
                            })
                            .collect()
                    }
                };
                if !out.is_empty() || matches!(from, ReadFrom::OwnPending { .. }) || block.is_none()
                {
                    return Ok(out);
                }
            }
            if !self.wait_for_append(deadline).await {
                return Ok(Vec::new());
            }
        }
    }

    async fn ack(&self, stream: &str, group: &str, ids: &[EntryId]) -> BusResult<u64> {
        let mut st = self.lock();
        let Some(s) = st.streams.get_mut(stream) else {
            return Ok(0);
        };
        let g = s.group_mut(stream, group)?;
        Ok(ids
            .iter()
            .filter(|id| g.pending.remove(id).is_some())
            .count() as u64)
    }

    async fn touch(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        ids: &[EntryId],
    ) -> BusResult<()> {
        let mut st = self.lock();
        let Some(s) = st.streams.get_mut(stream) else {
            return Ok(());
        };
        let g = s.group_mut(stream, group)?;
        let now = Instant::now();
        for id in ids {
            if let Some(p) = g.pending.get_mut(id)
                && p.consumer == consumer
            {
                p.delivered_at = now;
            }
        }
        Ok(())
    }

    async fn claim_idle(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        min_idle: Duration,
        count: usize,
    ) -> BusResult<Vec<Entry>> {
        let mut st = self.lock();
        let s = st
            .streams
            .get_mut(stream)
            .ok_or_else(|| no_group(stream, group))?;
        let StreamLog {
            entries, groups, ..
        } = s;
        let g = groups
            .get_mut(group)
            .ok_or_else(|| no_group(stream, group))?;
        let now = Instant::now();
        g.consumers.entry(consumer.to_string()).or_insert(now);
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (id, p) in g.pending.iter_mut() {
            if out.len() >= count {
                break;
            }
            if now.duration_since(p.delivered_at) < min_idle {
                continue;
            }
            match entries.get(id) {
                // Trimmed while pending: Redis drops such entries from the PEL on claim.
                None => gone.push(*id),
                Some(payload) => {
                    p.consumer = consumer.to_string();
                    p.delivered_at = now;
                    p.deliveries += 1;
                    out.push(Entry {
                        id: *id,
                        payload: payload.clone(),
                        deliveries: p.deliveries,
                    });
                }
            }
        }
        for id in gone {
            g.pending.remove(&id);
        }
        Ok(out)
    }

    async fn dead_letter(
        &self,
        stream: &str,
        group: &str,
        dead_stream: &str,
        letters: &[DeadLetterRecord],
    ) -> BusResult<()> {
        {
            let mut st = self.lock();
            let s = st
                .streams
                .get_mut(stream)
                .ok_or_else(|| no_group(stream, group))?;
            let g = s.group_mut(stream, group)?;
            for l in letters {
                g.pending.remove(&l.entry_id);
            }
            let dead = st.streams.entry(dead_stream.to_string()).or_default();
            for l in letters {
                let id = dead.next_id();
                dead.entries.insert(id, l.letter.clone());
            }
        }
        self.appended.notify_waiters();
        Ok(())
    }

    async fn read_after(
        &self,
        stream: &str,
        after: EntryId,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>> {
        let deadline = Instant::now() + block.unwrap_or_default();
        loop {
            let out = self
                .range(
                    stream,
                    RangeBound::Exclusive(after),
                    RangeBound::Open,
                    count,
                )
                .await?;
            if !out.is_empty() || block.is_none() || !self.wait_for_append(deadline).await {
                return Ok(out);
            }
        }
    }

    async fn range(
        &self,
        stream: &str,
        start: RangeBound,
        end: RangeBound,
        count: usize,
    ) -> BusResult<Vec<Entry>> {
        let st = self.lock();
        let Some(s) = st.streams.get(stream) else {
            return Ok(Vec::new());
        };
        let (lo, hi) = (to_bound(start), to_bound(end));
        if let (Bound::Included(a) | Bound::Excluded(a), Bound::Included(b) | Bound::Excluded(b)) =
            (lo, hi)
            && a > b
        {
            return Ok(Vec::new());
        }
        Ok(s.entries
            .range((lo, hi))
            .take(count)
            .map(|(id, p)| Entry {
                id: *id,
                payload: p.clone(),
                deliveries: 1,
            })
            .collect())
    }

    /// The payloads' bytes plus [`MemoryBus::ENTRY_OVERHEAD`] per entry.
    async fn memory_usage(&self, stream: &str) -> BusResult<u64> {
        let st = self.lock();
        Ok(st.streams.get(stream).map_or(0, |s| {
            s.entries
                .values()
                .map(|p| p.len() as u64 + Self::ENTRY_OVERHEAD)
                .sum()
        }))
    }

    async fn stats(&self, stream: &str) -> BusResult<StreamStats> {
        let st = self.lock();
        let Some(s) = st.streams.get(stream) else {
            return Ok(StreamStats::default());
        };
        let now = Instant::now();
        let groups = s
            .groups
            .iter()
            .map(|(name, g)| GroupStats {
                name: name.clone(),
                pending: g.pending.len() as u64,
                lag: Some(s.lag(g)),
                last_delivered: g.last_delivered,
                consumers: g
                    .consumers
                    .iter()
                    .map(|(c, seen)| ConsumerStats {
                        name: c.clone(),
                        pending: g.pending.values().filter(|p| &p.consumer == c).count() as u64,
                        idle: now.duration_since(*seen),
                    })
                    .collect(),
            })
            .collect();
        Ok(StreamStats {
            length: s.entries.len() as u64,
            first_id: s.entries.keys().next().copied(),
            last_id: s.entries.keys().next_back().copied(),
            groups,
        })
    }

    async fn append(&self, stream: &str, entries: &[(EntryId, Bytes)]) -> BusResult<()> {
        {
            let mut st = self.lock();
            let s = st.streams.entry(stream.to_string()).or_default();
            for (id, payload) in entries {
                if *id <= s.last_id {
                    return Err(BusError::Protocol {
                        op: "XADD",
                        key: stream.to_string(),
                        detail: format!(
                            "entry id {id} is not above the stream's last id {}",
                            s.last_id
                        ),
                    });
                }
                s.entries.insert(*id, payload.clone());
                s.last_id = *id;
            }
        }
        self.appended.notify_waiters();
        Ok(())
    }

    async fn trim_before(&self, stream: &str, min_id: EntryId) -> BusResult<u64> {
        let mut st = self.lock();
        let Some(s) = st.streams.get_mut(stream) else {
            return Ok(0);
        };
        let kept = s.entries.split_off(&min_id);
        let removed = s.entries.len() as u64;
        s.entries = kept;
        Ok(removed)
    }

    async fn oldest_pending(&self, stream: &str, group: &str) -> BusResult<Option<EntryId>> {
        let st = self.lock();
        let Some(s) = st.streams.get(stream) else {
            return Err(no_group(stream, group));
        };
        let g = s.groups.get(group).ok_or_else(|| no_group(stream, group))?;
        Ok(g.pending.keys().next().copied())
    }

    async fn put_blobs(&self, blobs: &[(String, Bytes)]) -> BusResult<()> {
        let mut st = self.lock();
        for (k, v) in blobs {
            st.blobs.insert(k.clone(), v.clone());
        }
        Ok(())
    }

    async fn get_blobs(&self, keys: &[String]) -> BusResult<Vec<Option<Bytes>>> {
        let st = self.lock();
        Ok(keys.iter().map(|k| st.blobs.get(k).cloned()).collect())
    }

    async fn delete(&self, keys: &[String]) -> BusResult<u64> {
        let mut st = self.lock();
        Ok(keys
            .iter()
            .filter(|k| st.blobs.remove(*k).is_some() | st.streams.remove(*k).is_some())
            .count() as u64)
    }
}

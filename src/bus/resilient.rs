//! [`Resilient`]: a bus that rides out outages. Every operation that fails with a
//! retryable error (Redis restarting, a dropped connection, a timeout, `LOADING` while
//! Redis replays its AOF) is retried with exponential backoff until it succeeds or
//! `patience` runs out; errors retrying cannot fix pass through at once.
//!
//! Stages talk to Redis through this, so a Redis restart pauses them instead of stopping
//! them. A full Redis (`maxmemory` with `noeviction`) refuses writes but still serves reads
//! and acks: writers back off here while the consumers drain the streams. Retried writes keep rlstream's at-least-once contract: an `XADD` whose reply was
//! lost may be applied twice, and the trainer drops the duplicate group by id.

use super::{
    Bus, BusResult, DeadLetterRecord, Entry, EntryId, GroupStart, RangeBound, ReadFrom, SharedBus,
    StreamStats,
};
use crate::roles::Stage;
use async_trait::async_trait;
use bytes::Bytes;
use std::future::Future;
use std::time::{Duration, Instant};

/// First wait after a failure; doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub struct Resilient {
    inner: SharedBus,
    patience: Duration,
}

impl Resilient {
    /// Retries `inner`'s retryable failures for up to `patience` per operation.
    pub fn new(inner: SharedBus, patience: Duration) -> Self {
        Resilient { inner, patience }
    }

    async fn retry<T, F, Fut>(&self, op: &'static str, mut call: F) -> BusResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = BusResult<T>>,
    {
        let started = Instant::now();
        let mut backoff = FIRST_BACKOFF;
        let mut failures = 0u32;
        loop {
            match call().await {
                Err(e) if e.is_retryable() => {
                    if started.elapsed() >= self.patience {
                        tracing::error!(op, error = %e, "the bus is still unavailable after {:?}; giving up", self.patience);
                        return Err(e);
                    }
                    if failures == 0 {
                        tracing::warn!(op, error = %e, "the bus is unavailable; retrying with backoff for up to {:?}", self.patience);
                    }
                    failures += 1;
                    // A full Redis is its own kind: writers wait for consumers to drain it.
                    let kind = match e {
                        super::BusError::Full { .. } => "redis_full",
                        _ => "retry",
                    };
                    crate::metrics::error_n(Stage::Bus, kind, 1);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                result => {
                    if failures > 0 {
                        tracing::info!(op, failures, "the bus is back");
                    }
                    return result;
                }
            }
        }
    }
}

#[async_trait]
impl Bus for Resilient {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn create_group(&self, stream: &str, group: &str, start: GroupStart) -> BusResult<()> {
        self.retry("create_group", || {
            self.inner.create_group(stream, group, start)
        })
        .await
    }

    async fn publish(
        &self,
        stream: &str,
        payloads: &[Bytes],
        max_len: Option<u64>,
    ) -> BusResult<Vec<EntryId>> {
        // What a full Redis took of the batch is kept; only the rest is sent again.
        let written = std::sync::Mutex::new(vec![None; payloads.len()]);
        self.retry("publish", || async {
            let pending: Vec<usize> = {
                let w = written.lock().map_err(|_| super::BusError::Closed)?;
                (0..payloads.len()).filter(|&i| w[i].is_none()).collect()
            };
            let rest: Vec<Bytes> = pending.iter().map(|&i| payloads[i].clone()).collect();
            let result = self.inner.publish(stream, &rest, max_len).await;
            let mut w = written.lock().map_err(|_| super::BusError::Closed)?;
            match result {
                Ok(ids) => {
                    for (&i, id) in pending.iter().zip(ids) {
                        w[i] = Some(id);
                    }
                    Ok(w.iter().flatten().copied().collect())
                }
                Err(super::BusError::Full { op, key, written }) => {
                    for (at, id) in written {
                        if let Some(&i) = pending.get(at) {
                            w[i] = Some(id);
                        }
                    }
                    Err(super::BusError::Full {
                        op,
                        key,
                        written: Vec::new(),
                    })
                }
                Err(e) => Err(e),
            }
        })
        .await
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
        self.retry("read_group", || {
            self.inner
                .read_group(stream, group, consumer, from, count, block)
        })
        .await
    }

    async fn ack(&self, stream: &str, group: &str, ids: &[EntryId]) -> BusResult<u64> {
        self.retry("ack", || self.inner.ack(stream, group, ids))
            .await
    }

    async fn claim_idle(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        min_idle: Duration,
        count: usize,
    ) -> BusResult<Vec<Entry>> {
        self.retry("claim_idle", || {
            self.inner
                .claim_idle(stream, group, consumer, min_idle, count)
        })
        .await
    }

    async fn touch(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        ids: &[EntryId],
    ) -> BusResult<()> {
        self.retry("touch", || self.inner.touch(stream, group, consumer, ids))
            .await
    }

    async fn dead_letter(
        &self,
        stream: &str,
        group: &str,
        dead_stream: &str,
        letters: &[DeadLetterRecord],
    ) -> BusResult<()> {
        self.retry("dead_letter", || {
            self.inner.dead_letter(stream, group, dead_stream, letters)
        })
        .await
    }

    async fn read_after(
        &self,
        stream: &str,
        after: EntryId,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>> {
        self.retry("read_after", || {
            self.inner.read_after(stream, after, count, block)
        })
        .await
    }

    async fn range(
        &self,
        stream: &str,
        start: RangeBound,
        end: RangeBound,
        count: usize,
    ) -> BusResult<Vec<Entry>> {
        self.retry("range", || self.inner.range(stream, start, end, count))
            .await
    }

    async fn stats(&self, stream: &str) -> BusResult<StreamStats> {
        self.retry("stats", || self.inner.stats(stream)).await
    }

    async fn memory_usage(&self, stream: &str) -> BusResult<u64> {
        self.retry("memory_usage", || self.inner.memory_usage(stream))
            .await
    }

    async fn append(&self, stream: &str, entries: &[(EntryId, Bytes)]) -> BusResult<()> {
        self.retry("append", || self.inner.append(stream, entries))
            .await
    }

    async fn trim_before(&self, stream: &str, min_id: EntryId) -> BusResult<u64> {
        self.retry("trim_before", || self.inner.trim_before(stream, min_id))
            .await
    }

    async fn oldest_pending(&self, stream: &str, group: &str) -> BusResult<Option<EntryId>> {
        self.retry("oldest_pending", || {
            self.inner.oldest_pending(stream, group)
        })
        .await
    }

    async fn put_blobs(&self, blobs: &[(String, Bytes)]) -> BusResult<()> {
        self.retry("put_blobs", || self.inner.put_blobs(blobs))
            .await
    }

    async fn get_blobs(&self, keys: &[String]) -> BusResult<Vec<Option<Bytes>>> {
        self.retry("get_blobs", || self.inner.get_blobs(keys)).await
    }

    async fn delete(&self, keys: &[String]) -> BusResult<u64> {
        self.retry("delete", || self.inner.delete(keys)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::{BusError, MemoryBus};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Fails the first `n` publishes with a retryable error, then delegates.
    struct Flaky {
        inner: MemoryBus,
        failures_left: AtomicU32,
        kind_retryable: bool,
    }

    fn outage() -> BusError {
        BusError::Timeout {
            op: "XADD",
            key: "k".into(),
            timeout_ms: 1,
        }
    }

    #[async_trait]
    impl Bus for Flaky {
        fn backend(&self) -> &'static str {
            "flaky"
        }
        async fn create_group(&self, s: &str, g: &str, st: GroupStart) -> BusResult<()> {
            self.inner.create_group(s, g, st).await
        }
        async fn publish(&self, s: &str, p: &[Bytes], m: Option<u64>) -> BusResult<Vec<EntryId>> {
            if self
                .failures_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(if self.kind_retryable {
                    outage()
                } else {
                    BusError::Closed
                });
            }
            self.inner.publish(s, p, m).await
        }
        async fn read_group(
            &self,
            s: &str,
            g: &str,
            c: &str,
            f: ReadFrom,
            n: usize,
            b: Option<Duration>,
        ) -> BusResult<Vec<Entry>> {
            self.inner.read_group(s, g, c, f, n, b).await
        }
        async fn ack(&self, s: &str, g: &str, i: &[EntryId]) -> BusResult<u64> {
            self.inner.ack(s, g, i).await
        }
        async fn claim_idle(
            &self,
            s: &str,
            g: &str,
            c: &str,
            m: Duration,
            n: usize,
        ) -> BusResult<Vec<Entry>> {
            self.inner.claim_idle(s, g, c, m, n).await
        }
        async fn touch(&self, s: &str, g: &str, c: &str, i: &[EntryId]) -> BusResult<()> {
            self.inner.touch(s, g, c, i).await
        }
        async fn dead_letter(
            &self,
            s: &str,
            g: &str,
            d: &str,
            l: &[DeadLetterRecord],
        ) -> BusResult<()> {
            self.inner.dead_letter(s, g, d, l).await
        }
        async fn read_after(
            &self,
            s: &str,
            a: EntryId,
            n: usize,
            b: Option<Duration>,
        ) -> BusResult<Vec<Entry>> {
            self.inner.read_after(s, a, n, b).await
        }
        async fn range(
            &self,
            s: &str,
            a: RangeBound,
            b: RangeBound,
            n: usize,
        ) -> BusResult<Vec<Entry>> {
            self.inner.range(s, a, b, n).await
        }
        async fn stats(&self, s: &str) -> BusResult<StreamStats> {
            self.inner.stats(s).await
        }
        async fn memory_usage(&self, s: &str) -> BusResult<u64> {
            self.inner.memory_usage(s).await
        }
        async fn append(&self, s: &str, e: &[(EntryId, Bytes)]) -> BusResult<()> {
            self.inner.append(s, e).await
        }
        async fn trim_before(&self, s: &str, m: EntryId) -> BusResult<u64> {
            self.inner.trim_before(s, m).await
        }
        async fn oldest_pending(&self, s: &str, g: &str) -> BusResult<Option<EntryId>> {
            self.inner.oldest_pending(s, g).await
        }
        async fn put_blobs(&self, b: &[(String, Bytes)]) -> BusResult<()> {
            self.inner.put_blobs(b).await
        }
        async fn get_blobs(&self, k: &[String]) -> BusResult<Vec<Option<Bytes>>> {
            self.inner.get_blobs(k).await
        }
        async fn delete(&self, k: &[String]) -> BusResult<u64> {
            self.inner.delete(k).await
        }
    }

    fn flaky(failures: u32, retryable: bool) -> Arc<Flaky> {
        Arc::new(Flaky {
            inner: MemoryBus::new(),
            failures_left: AtomicU32::new(failures),
            kind_retryable: retryable,
        })
    }

    #[tokio::test]
    async fn outages_are_ridden_out_and_permanent_errors_are_not() {
        let payload = [Bytes::from_static(b"x")];
        let bus = Resilient::new(flaky(3, true), Duration::from_secs(30));
        let ids = bus
            .publish("s", &payload, None)
            .await
            .expect("after 3 failures");
        assert_eq!(ids.len(), 1);

        let bus = Resilient::new(flaky(1, false), Duration::from_secs(30));
        let err = bus
            .publish("s", &payload, None)
            .await
            .expect_err("not retried");
        assert!(matches!(err, BusError::Closed), "{err}");

        let bus = Resilient::new(flaky(u32::MAX, true), Duration::from_millis(300));
        let started = Instant::now();
        let err = bus
            .publish("s", &payload, None)
            .await
            .expect_err("gives up");
        assert!(err.is_retryable());
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}

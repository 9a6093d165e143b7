//! `Consumer<M>`: a typed reader on one consumer group with rlstream's delivery policy.
//!
//! - Reads new entries, and every `claim_idle / 2` claims entries other consumers left
//!   pending longer than `claim_idle` (a consumer that died mid-work).
//! - Bytes that do not decode as `M` go to the dead-letter stream at once, with the
//!   decoder's error: retrying cannot fix them. The consumer keeps going.
//! - An entry delivered more than `max_deliveries` times (every consumer that took it died
//!   or timed out) goes to the dead-letter stream instead of being handed out again.
//! - [`Consumer::fail`] reports a processing error: the entry stays pending for a retry,
//!   unless it has used up its deliveries, in which case it is dead-lettered with that error.
//! - Nothing is acked until the caller says the work is done ([`Consumer::ack`]).
//! - When Redis comes back without its data, the consumer recreates its group and goes on,
//!   or stops, as [`OnDataLoss`] says (see [`super::loss`]).

use super::loss::{LossReport, LossSeen, OnDataLoss};
use super::{
    BusError, BusResult, DeadLetterRecord, Entry, EntryId, GroupStart, ReadFrom, SharedBus,
};
use crate::schema::{self, DeadLetter, Message, SchemaVersion};
use bytes::Bytes;
use std::collections::HashSet;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

/// Delivery policy for one consumer.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// Entries pending longer than this under another consumer are claimed.
    pub claim_idle: Duration,
    /// Deliveries after which an entry is dead-lettered instead of handed out again.
    pub max_deliveries: u32,
    /// Longest wait for new entries in one poll.
    pub block: Duration,
    /// Most entries returned by one poll.
    pub batch: usize,
    /// Largest payload decoded; bigger ones are dead-lettered.
    pub max_message_bytes: usize,
    /// Where a new group starts reading.
    pub start: GroupStart,
    /// What to do when Redis lost the stream's data.
    pub on_data_loss: OnDataLoss,
    /// Where a loss is reported (absent: logged and counted only).
    pub report: Option<LossReport>,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions {
            claim_idle: Duration::from_secs(30),
            max_deliveries: 5,
            block: Duration::from_secs(1),
            batch: 16,
            max_message_bytes: schema::DEFAULT_MAX_MESSAGE_BYTES,
            start: GroupStart::Beginning,
            on_data_loss: OnDataLoss::Recover,
            report: None,
        }
    }
}

/// A decoded entry handed to the stage.
#[derive(Debug, Clone)]
pub struct Delivery<M> {
    pub id: EntryId,
    pub message: M,
    /// Times delivered, this one included.
    pub deliveries: u32,
    /// The bytes as read, kept for dead-lettering and size accounting (a cheap clone).
    pub payload: Bytes,
}

impl<M> Delivery<M> {
    /// The entry as read.
    pub fn entry(&self) -> Entry {
        Entry {
            id: self.id,
            payload: self.payload.clone(),
            deliveries: self.deliveries,
        }
    }
}

/// Counts of what the consumer did besides handing out messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerCounts {
    pub delivered: u64,
    pub claimed: u64,
    pub dead_lettered: u64,
}

pub struct Consumer<M> {
    bus: SharedBus,
    stream: String,
    group: String,
    name: String,
    dead_stream: String,
    opts: ConsumerOptions,
    last_claim: Option<Instant>,
    /// After a restart, this consumer's own pending entries are re-read first, a batch at
    /// a time from after the last one re-read (the trainer holds them all until its next
    /// checkpoint, so reading from the start again would return the same batch forever).
    resume_pending: bool,
    resume_after: EntryId,
    /// Entries handed out and not yet acked, failed or dead-lettered. XAUTOCLAIM cannot
    /// exclude the claiming consumer, so a stage that holds entries longer than
    /// `claim_idle` (the trainer, until its checkpoint) would otherwise claim its own work
    /// back and process it twice.
    held: HashSet<EntryId>,
    /// When held entries were last refreshed (see [`Bus::touch`]).
    last_touch: Option<Instant>,
    counts: ConsumerCounts,
    /// The highest id a read of new entries returned: one at or below it, not in hand,
    /// is an entry the group hands out again (it lost its last reads).
    high_water: EntryId,
    /// Whether the last read of new entries returned entries handed out again (one loss
    /// is reported once, however many reads it takes to pass them).
    replaying: bool,
    /// Whether a loss was recovered from since [`Consumer::take_loss`] last asked.
    lost: bool,
    _message: PhantomData<fn() -> M>,
}

impl<M: Message> Consumer<M> {
    /// Joins (creating if needed) `group` on `stream` as `name`.
    pub async fn join(
        bus: SharedBus,
        stream: impl Into<String>,
        group: impl Into<String>,
        name: impl Into<String>,
        dead_stream: impl Into<String>,
        opts: ConsumerOptions,
    ) -> BusResult<Self> {
        let (stream, group) = (stream.into(), group.into());
        bus.create_group(&stream, &group, opts.start).await?;
        crate::metrics::claimed(&stream, &group, 0);
        Ok(Consumer {
            bus,
            stream,
            group,
            name: name.into(),
            dead_stream: dead_stream.into(),
            opts,
            last_claim: None,
            resume_pending: true,
            resume_after: EntryId::ZERO,
            held: HashSet::new(),
            last_touch: None,
            counts: ConsumerCounts::default(),
            high_water: EntryId::ZERO,
            replaying: false,
            lost: false,
            _message: PhantomData,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    pub fn counts(&self) -> ConsumerCounts {
        self.counts
    }

    /// Whether Redis lost this consumer's data since the last call (and it went on): a
    /// trainer announces its weights again then.
    pub fn take_loss(&mut self) -> bool {
        std::mem::take(&mut self.lost)
    }

    /// The next batch: own pending entries after a restart, then claimed idle entries
    /// when a claim is due, else new entries (waiting up to `block`). May be empty.
    pub async fn poll(&mut self) -> BusResult<Vec<Delivery<M>>> {
        match self.next_batch().await {
            Err(e) if e.is_data_loss() => {
                self.recover(e.to_string()).await?;
                Ok(Vec::new())
            }
            r => r,
        }
    }

    async fn next_batch(&mut self) -> BusResult<Vec<Delivery<M>>> {
        if self.resume_pending {
            let own = self
                .bus
                .read_group(
                    &self.stream,
                    &self.group,
                    &self.name,
                    ReadFrom::OwnPending {
                        after: self.resume_after,
                    },
                    self.opts.batch,
                    None,
                )
                .await?;
            if own.len() < self.opts.batch {
                self.resume_pending = false;
            }
            if let Some(last) = own.last() {
                self.resume_after = last.id;
            }
            if !own.is_empty() {
                return self.admit(own).await;
            }
        }
        // Entries still held here are alive: refresh them well before anyone may claim them.
        if !self.held.is_empty()
            && self
                .last_touch
                .is_none_or(|t| t.elapsed() >= self.opts.claim_idle / 4)
        {
            self.last_touch = Some(Instant::now());
            let held: Vec<EntryId> = self.held.iter().copied().collect();
            self.bus
                .touch(&self.stream, &self.group, &self.name, &held)
                .await?;
        }
        let claim_every = self.opts.claim_idle / 2;
        if self.last_claim.is_none_or(|t| t.elapsed() >= claim_every) {
            self.last_claim = Some(Instant::now());
            let claimed = self
                .bus
                .claim_idle(
                    &self.stream,
                    &self.group,
                    &self.name,
                    self.opts.claim_idle,
                    self.opts.batch,
                )
                .await?;
            if !claimed.is_empty() {
                self.counts.claimed += claimed.len() as u64;
                crate::metrics::claimed(&self.stream, &self.group, claimed.len() as u64);
                tracing::info!(stream = %self.stream, group = %self.group, consumer = %self.name,
                    n = claimed.len(), "claimed entries left idle by another consumer");
                return self.admit(claimed).await;
            }
        }
        let fresh = self
            .bus
            .read_group(
                &self.stream,
                &self.group,
                &self.name,
                ReadFrom::New,
                self.opts.batch,
                Some(self.opts.block),
            )
            .await?;
        let fresh = self.drop_replayed(fresh).await?;
        self.admit(fresh).await
    }

    /// Recreates the group after Redis lost it (`how` says how it showed), or stops with
    /// [`BusError::DataLost`] under [`OnDataLoss::Stop`].
    async fn recover(&mut self, how: String) -> BusResult<()> {
        if self.opts.on_data_loss == OnDataLoss::Stop {
            return Err(BusError::DataLost {
                stream: self.stream.clone(),
                detail: how,
            });
        }
        self.bus
            .create_group(&self.stream, &self.group, GroupStart::Beginning)
            .await?;
        let seen = LossSeen {
            stream: self.stream.clone(),
            group: self.group.clone(),
            how,
            held: self.held.len() as u64,
            replayed: 0,
        };
        // What was in hand stays in hand (it is finished as usual; acking it is a no-op).
        self.held.clear();
        // The new group's entries are not a replay of the old one's, whatever their ids: a
        // Redis that came back empty on a host whose clock is behind numbers them lower.
        self.high_water = EntryId::ZERO;
        (self.resume_pending, self.last_touch, self.lost) = (false, None, true);
        seen.announce(&self.bus, &self.name, self.opts.report.as_ref())
            .await;
        Ok(())
    }

    /// Drops (and acks) new entries at or below the highest id read before and not in
    /// hand: the group hands them out again because it lost its last reads. They were
    /// handled once; the first of a run of them is reported as a loss.
    async fn drop_replayed(&mut self, fresh: Vec<Entry>) -> BusResult<Vec<Entry>> {
        let (again, fresh): (Vec<Entry>, Vec<Entry>) = fresh
            .into_iter()
            .partition(|e| e.id <= self.high_water && !self.held.contains(&e.id));
        if let Some(last) = fresh.last() {
            self.high_water = self.high_water.max(last.id);
        }
        let Some(newest) = again.last().map(|e| e.id) else {
            self.replaying = false;
            return Ok(fresh);
        };
        let how = format!(
            "the group handed out again {} entries up to {newest}, below {} read before",
            again.len(),
            self.high_water
        );
        if self.opts.on_data_loss == OnDataLoss::Stop {
            return Err(BusError::DataLost {
                stream: self.stream.clone(),
                detail: how,
            });
        }
        let ids: Vec<EntryId> = again.iter().map(|e| e.id).collect();
        self.bus.ack(&self.stream, &self.group, &ids).await?;
        if std::mem::replace(&mut self.replaying, true) {
            crate::metrics::lost_entries(&self.stream, &self.group, "replayed", ids.len() as u64);
        } else {
            self.lost = true;
            let seen = LossSeen {
                stream: self.stream.clone(),
                group: self.group.clone(),
                how,
                held: 0,
                replayed: ids.len() as u64,
            };
            seen.announce(&self.bus, &self.name, self.opts.report.as_ref())
                .await;
        }
        Ok(fresh)
    }

    /// Decodes entries, dead-letters what cannot be used, returns the rest.
    async fn admit(&mut self, entries: Vec<Entry>) -> BusResult<Vec<Delivery<M>>> {
        let mut out = Vec::with_capacity(entries.len());
        let mut dead = Vec::new();
        for e in entries {
            if self.held.contains(&e.id) {
                // Claimed back from ourselves: already in hand, not a new delivery.
                continue;
            }
            if e.deliveries > self.opts.max_deliveries {
                let err = format!(
                    "delivered {} times without an ack (max_deliveries = {}); the consumers that took it crashed or timed out",
                    e.deliveries, self.opts.max_deliveries
                );
                dead.push(self.letter(&e, "max_deliveries", err));
                continue;
            }
            match schema::decode_limited::<M>(&e.payload, self.opts.max_message_bytes) {
                Ok(message) => {
                    self.held.insert(e.id);
                    out.push(Delivery {
                        id: e.id,
                        message,
                        deliveries: e.deliveries,
                        payload: e.payload,
                    })
                }
                Err(err) => dead.push(self.letter(&e, err.label(), err.to_string())),
            }
        }
        self.send_dead(dead).await?;
        self.counts.delivered += out.len() as u64;
        Ok(out)
    }

    /// Acknowledges finished work.
    pub async fn ack(&mut self, ids: &[EntryId]) -> BusResult<u64> {
        let n = match self.bus.ack(&self.stream, &self.group, ids).await {
            Err(e) if e.is_data_loss() => {
                self.recover(e.to_string()).await?;
                0
            }
            r => r?,
        };
        for id in ids {
            self.held.remove(id);
        }
        Ok(n)
    }

    /// Forgets entries acked by someone else on this consumer's behalf (a stage that acks
    /// through the bus directly, after publishing its output).
    pub fn release(&mut self, ids: &[EntryId]) {
        for id in ids {
            self.held.remove(id);
        }
    }

    /// Reports that processing `delivery` failed with `error`. It stays pending for another
    /// try after `claim_idle`, or is dead-lettered if it has used its deliveries.
    /// Returns true when it was dead-lettered.
    pub async fn fail(&mut self, delivery: &Delivery<M>, error: &str) -> BusResult<bool> {
        self.held.remove(&delivery.id);
        if delivery.deliveries < self.opts.max_deliveries {
            tracing::warn!(stream = %self.stream, id = %delivery.id, deliveries = delivery.deliveries,
                error, "processing failed; entry left pending for a retry");
            return Ok(false);
        }
        let letter = self.letter(&delivery.entry(), "failed", error.to_string());
        self.send_dead(vec![letter]).await?;
        Ok(true)
    }

    /// Dead-letters `delivery` now: its content is unusable (retrying cannot help).
    pub async fn reject(
        &mut self,
        delivery: &Delivery<M>,
        reason: &str,
        error: &str,
    ) -> BusResult<()> {
        self.reject_entry(&delivery.entry(), reason, error).await
    }

    /// [`Consumer::reject`] for a delivery kept as its raw entry (one that was handed on
    /// and came back as unusable).
    pub async fn reject_entry(
        &mut self,
        entry: &Entry,
        reason: &str,
        error: &str,
    ) -> BusResult<()> {
        let letter = self.letter(entry, reason, error.to_string());
        self.send_dead(vec![letter]).await
    }

    fn letter(&self, e: &Entry, reason: &str, error: String) -> Letter {
        let letter = DeadLetter {
            schema: SchemaVersion::CURRENT,
            source_stream: self.stream.clone(),
            source_id: e.id.to_string(),
            group: self.group.clone(),
            consumer: self.name.clone(),
            reason: reason.to_string(),
            error: error.clone(),
            deliveries: e.deliveries,
            payload: e.payload.to_vec(),
            dead_us: schema::now_us(),
        };
        // A DeadLetter has no fallible fields; encoding cannot fail short of a serde bug.
        let bytes = schema::encode(&letter).unwrap_or_default();
        Letter {
            record: DeadLetterRecord {
                entry_id: e.id,
                letter: Bytes::from(bytes),
            },
            reason: reason.to_string(),
            error,
        }
    }

    async fn send_dead(&mut self, dead: Vec<Letter>) -> BusResult<()> {
        if dead.is_empty() {
            return Ok(());
        }
        for l in &dead {
            tracing::warn!(stream = %self.stream, id = %l.record.entry_id, dead = %self.dead_stream,
                reason = %l.reason, error = %l.error, "entry moved to the dead-letter stream");
        }
        let records: Vec<DeadLetterRecord> = dead.iter().map(|l| l.record.clone()).collect();
        for r in &records {
            self.held.remove(&r.entry_id);
        }
        let sent = self
            .bus
            .dead_letter(&self.stream, &self.group, &self.dead_stream, &records)
            .await;
        match sent {
            // The group is recreated: the letters go out and their acks are no-ops.
            Err(e) if e.is_data_loss() => {
                self.recover(e.to_string()).await?;
                self.bus
                    .dead_letter(&self.stream, &self.group, &self.dead_stream, &records)
                    .await?;
            }
            r => r?,
        }
        self.counts.dead_lettered += records.len() as u64;
        for l in &dead {
            crate::metrics::dead_lettered(&self.stream, &self.group, &l.reason, 1);
        }
        Ok(())
    }
}

/// A dead letter on its way out, with its reason and error for the log and the counter.
struct Letter {
    record: DeadLetterRecord,
    reason: String,
    error: String,
}

//! The generator's writer: publishes finished groups to the rollouts stream, acks their
//! prompts, and tells the reader what became of each prompt (acked, or failed and to be
//! dead-lettered), freeing its room in the in-flight bound.

use super::decode::DecodeStats;
use super::decode::group::{Decoded, Finished};
use super::reader::Settled;
use crate::bus::{EntryId, SharedBus, Topology};
use crate::roles::Stream;
use crate::schema;
use crate::stages::StageError;
use bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Notify;

/// What a generator did, at its end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenSummary {
    pub groups: u64,
    pub tokens: u64,
    pub rejected: u64,
    pub decode: DecodeStats,
    pub final_version: u64,
}

/// Publishes finished groups and acks their prompts.
pub(super) struct RolloutWriter<'a> {
    pub(super) bus: SharedBus,
    pub(super) topo: &'a Topology,
    /// Tells the reader which prompt entries are acked, and which failed.
    pub(super) settled: tokio::sync::mpsc::UnboundedSender<Settled>,
    pub(super) in_flight: Arc<AtomicUsize>,
    /// Wakes a reader held back by the in-flight bound.
    pub(super) released: Arc<Notify>,
    pub(super) summary: GenSummary,
}

impl RolloutWriter<'_> {
    /// Hands the reader what became of `n` prompts, and frees their room in the in-flight
    /// bound (waking a reader held back by it).
    fn settle(&self, settled: Settled, n: usize) {
        let _ = self.settled.send(settled);
        self.in_flight.fetch_sub(n, Ordering::Relaxed);
        self.released.notify_one();
    }

    /// Publishes the finished groups of `decoded` and hands its failed prompts to the
    /// reader, which dead-letters them.
    pub(super) async fn publish(&mut self, decoded: Vec<Decoded>) -> Result<(), StageError> {
        let mut batch: Vec<Finished> = Vec::with_capacity(decoded.len());
        for d in decoded {
            match d {
                Decoded::Group(f) => batch.push(f),
                Decoded::Failed(f) => {
                    self.settle(Settled::Failed(f), 1);
                }
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let payloads = batch
            .iter()
            .map(|f| schema::encode(&f.group).map(Bytes::from))
            .collect::<Result<Vec<_>, _>>()?;
        let entries: Vec<EntryId> = batch.iter().map(|f| f.entry).collect();
        let (topo, out) = (self.topo, Stream::Rollouts);
        self.bus
            .publish(&topo.key(out), &payloads, topo.max_len(out))
            .await?;
        let prompts = Stream::Prompts;
        self.bus
            .ack(&topo.key(prompts), topo.group(prompts), &entries)
            .await?;
        self.settle(Settled::Acked(entries), batch.len());
        let tokens: u64 = batch
            .iter()
            .map(|f| f.group.completion_tokens() as u64)
            .sum();
        let samples: u64 = batch.iter().map(|f| f.group.samples.len() as u64).sum();
        crate::metrics::generated(samples, tokens);
        self.summary.groups += batch.len() as u64;
        self.summary.tokens += tokens;
        Ok(())
    }
}

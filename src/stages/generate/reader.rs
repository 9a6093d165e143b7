//! The prompt reader: polls prompts while the in-flight bound allows (see the
//! [stage docs](super)), turns each into token ids, refuses what the model cannot take, and
//! hands the rest to the decode thread.

use super::GenConfig;
use super::decode::Admit;
use crate::bus::{Bus, Consumer, ConsumerOptions, Delivery, EntryId, SharedBus, Topology};
use crate::model::tokenizer::Tokenizer;
use crate::roles::{Stage, Stream};
use crate::schema::Prompt;
use crate::stages::StageError;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How often the reader refreshes the backlog of the downstream streams.
const BACKLOG_REFRESH: Duration = Duration::from_millis(250);
/// How long a reader held back by the in-flight bound waits before looking again.
const BOUND_RECHECK: Duration = Duration::from_millis(10);

/// Work started but not trained, in groups, from the downstream streams' XINFO (see the
/// stage docs for what is counted).
async fn downstream_backlog(bus: &dyn Bus, topo: &Topology) -> u64 {
    crate::stages::waiting(bus, topo, Stream::Rollouts, true).await
        + crate::stages::waiting(bus, topo, Stream::Scored, false).await
}

/// What the reader shares with the rest of the stage.
pub struct Shared {
    pub stop: Arc<AtomicBool>,
    /// Groups admitted and not yet published.
    pub in_flight: Arc<AtomicUsize>,
}

pub struct Reader {
    bus: SharedBus,
    topo: Topology,
    consumer: Consumer<Prompt>,
    tokenizer: Tokenizer,
    vocab: usize,
    /// Most groups in flight: `max_lag × groups_per_step` (at least one step's).
    bound: usize,
    /// Most groups waiting here for rows, so a stopped generator leaves little pending.
    local_cap: usize,
    backlog: u64,
    refreshed: Option<Instant>,
    shared: Shared,
}

impl Reader {
    pub async fn join(
        policy: &crate::stages::policy::PolicySettings,
        cfg: &GenConfig,
        bus: SharedBus,
        topo: &Topology,
        tokenizer: Tokenizer,
        vocab: usize,
        shared: Shared,
    ) -> Result<Self, StageError> {
        let per_batch = (cfg.max_batch / cfg.group_size).max(1);
        let opts = ConsumerOptions {
            batch: per_batch,
            ..topo.consumer_options()
        };
        let consumer = Consumer::<Prompt>::join(
            bus.clone(),
            topo.key(Stream::Prompts),
            topo.group(Stream::Prompts),
            &cfg.name,
            topo.dead_key(),
            opts,
        )
        .await?;
        Ok(Reader {
            bus,
            topo: topo.clone(),
            consumer,
            tokenizer,
            vocab,
            bound: (policy.max_lag.max(1) * policy.groups_per_step as u64) as usize,
            local_cap: per_batch * 2,
            backlog: 0,
            refreshed: None,
            shared,
        })
    }

    /// Reads until stopped; `acked` carries the prompt entries the publisher acked, so the
    /// consumer stops holding them.
    pub async fn run(
        mut self,
        admit: mpsc::Sender<Admit>,
        mut acked: tokio::sync::mpsc::UnboundedReceiver<Vec<EntryId>>,
    ) -> Result<(), StageError> {
        let mut backoff = Duration::from_millis(100);
        while !self.shared.stop.load(Ordering::Relaxed) {
            while let Ok(ids) = acked.try_recv() {
                self.consumer.release(&ids);
            }
            if !self.room().await {
                continue;
            }
            let batch = match self.consumer.poll().await {
                Ok(b) => {
                    backoff = Duration::from_millis(100);
                    b
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(error = %e, "reading prompts: retrying");
                    crate::metrics::error(Stage::Gen, "bus");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
                Err(e) => return Err(StageError::from(e)),
            };
            for d in batch {
                let Some(a) = self.admission(d).await? else {
                    continue;
                };
                self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
                self.backlog += 1;
                if admit.send(a).is_err() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Whether the in-flight bound leaves room for more prompts; when it does not, waits a
    /// moment first.
    async fn room(&mut self) -> bool {
        let due = self.refreshed.map_or(Duration::ZERO, |t| {
            BACKLOG_REFRESH.saturating_sub(t.elapsed())
        });
        if due.is_zero() {
            self.backlog = downstream_backlog(self.bus.as_ref(), &self.topo).await;
            self.refreshed = Some(Instant::now());
        }
        let local = self.shared.in_flight.load(Ordering::Relaxed);
        if local < self.local_cap && (self.backlog as usize + local) < self.bound {
            return true;
        }
        tokio::time::sleep(BOUND_RECHECK).await;
        false
    }

    /// The prompt's token ids, or `None` once a prompt the model cannot take is
    /// dead-lettered.
    async fn admission(&mut self, d: Delivery<Prompt>) -> Result<Option<Admit>, StageError> {
        let tokens = match &d.message.prompt_tokens {
            Some(t) => t.0.clone(),
            None => match self.tokenizer.encode(&d.message.text) {
                Ok(t) => t,
                Err(e) => {
                    crate::metrics::error(Stage::Gen, "tokenize");
                    self.consumer.reject(&d, "tokenize", &e.to_string()).await?;
                    return Ok(None);
                }
            },
        };
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            let why = format!(
                "prompt token {bad} is outside the model's vocabulary of {}",
                self.vocab
            );
            self.consumer.reject(&d, "vocabulary", &why).await?;
            return Ok(None);
        }
        Ok(Some(Admit {
            entry: d.id,
            prompt: d.message,
            tokens,
        }))
    }
}

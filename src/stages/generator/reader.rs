//! The prompt reader: polls prompts while the in-flight bound allows (see the
//! [stage docs](super)), turns each into token ids, refuses what the model cannot take, and
//! hands the rest to the decode thread.

use super::GenConfig;
use super::config::TruncatePrompt;
use super::decode::group::{Admit, Failed, PromptSender};
use crate::bus::{Bus, Consumer, ConsumerOptions, Delivery, EntryId, SharedBus, Topology};
use crate::model::InferBackend;
use crate::model::ModelConfig;
use crate::model::tokenizer::Tokenizer;
use crate::roles::{Stage, Stream};
use crate::schema::{Limits, Prompt, Refusal};
use crate::stages::StageError;
use crate::weights::ModelSlot;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How often the reader refreshes the backlog of the downstream streams.
const BACKLOG_REFRESH: Duration = Duration::from_millis(250);

/// Work started but not trained, in groups, from the downstream streams' XINFO (see the
/// stage docs for what is counted); exact up to `cap`.
async fn downstream_backlog(bus: &dyn Bus, topo: &Topology, cap: u64) -> u64 {
    crate::stages::waiting(bus, topo, Stream::Rollouts, true, cap).await
        + crate::stages::waiting(bus, topo, Stream::Scored, false, cap).await
}

/// What became of a prompt the reader handed on.
pub enum Settled {
    /// Published and acked.
    Acked(Vec<EntryId>),
    /// The model could not run it.
    Failed(Failed),
}

/// How a prompt's ids are fitted to the model before decoding.
#[derive(Debug, Clone, Copy)]
struct PromptFit {
    limits: Limits,
    /// Stands for an empty prompt, so the first token has something to follow.
    bos: u32,
    max_new_tokens: usize,
    truncate: TruncatePrompt,
}

impl PromptFit {
    /// The ids to decode from (left-truncated when asked), or why the model cannot take
    /// them.
    fn apply(&self, mut tokens: Vec<u32>) -> Result<Vec<u32>, Refusal> {
        if tokens.is_empty() {
            tokens.push(self.bos);
        }
        let context = self.limits.context;
        if self.truncate == TruncatePrompt::Left && tokens.len() + self.max_new_tokens > context {
            let keep = context.saturating_sub(self.max_new_tokens).max(1);
            tokens.drain(..tokens.len().saturating_sub(keep));
        }
        self.limits.prompt("prompt_tokens", &tokens)?;
        Ok(tokens)
    }
}

/// What the reader shares with the rest of the stage.
pub struct Shared {
    pub stop: Arc<AtomicBool>,
    /// Groups admitted and not yet published.
    pub in_flight: Arc<AtomicUsize>,
    /// Signalled when a group leaves `in_flight` (published or failed).
    pub released: Arc<Notify>,
    /// The newest weights version announced (see [`Follower::announced`]).
    ///
    /// [`Follower::announced`]: crate::weights::Follower::announced
    pub announced: Arc<AtomicU64>,
    /// The model being decoded with.
    pub slot: ModelSlot<InferBackend>,
}

pub struct PromptReader {
    bus: SharedBus,
    topo: Topology,
    consumer: Consumer<Prompt>,
    tokenizer: Tokenizer,
    /// What the model takes, and how a prompt is fitted to it.
    fit: PromptFit,
    /// Steps of work allowed in flight ([`PolicySettings::steps_in_flight`]).
    steps_in_flight: u64,
    groups_per_step: usize,
    /// Most groups waiting here for rows, so a stopped generator leaves little pending.
    local_cap: usize,
    backlog: u64,
    refreshed: Option<Instant>,
    shared: Shared,
}

/// How the reader reads prompts: a batch's worth of groups at a time.
pub fn consumer_options(cfg: &GenConfig, topo: &Topology) -> ConsumerOptions {
    ConsumerOptions {
        batch: (cfg.max_batch / cfg.group_size).max(1),
        ..topo.consumer_options()
    }
}

impl PromptReader {
    pub fn new(
        policy: &crate::stages::policy::PolicySettings,
        cfg: &GenConfig,
        consumer: Consumer<Prompt>,
        (bus, topo): (SharedBus, &Topology),
        tokenizer: Tokenizer,
        model: &ModelConfig,
        shared: Shared,
    ) -> Self {
        let per_batch = (cfg.max_batch / cfg.group_size).max(1);
        PromptReader {
            bus,
            topo: topo.clone(),
            consumer,
            tokenizer,
            fit: PromptFit {
                limits: model.limits(),
                bos: model.bos_token_id.unwrap_or(0),
                max_new_tokens: cfg.max_new_tokens as usize,
                truncate: cfg.truncate_prompt,
            },
            steps_in_flight: policy.steps_in_flight(),
            groups_per_step: policy.groups_per_step,
            local_cap: per_batch * 2,
            backlog: 0,
            refreshed: None,
            shared,
        }
    }

    /// Reads until stopped; `settled` carries the prompt entries the publisher acked (the
    /// consumer stops holding them) and those the model failed on (dead-lettered here).
    pub async fn run(
        mut self,
        admit: PromptSender,
        mut settled: tokio::sync::mpsc::UnboundedReceiver<Settled>,
    ) -> Result<(), StageError> {
        let mut backoff = Duration::from_millis(100);
        while !self.shared.stop.load(Ordering::Relaxed) {
            while let Ok(s) = settled.try_recv() {
                match s {
                    Settled::Acked(ids) => self.consumer.release(&ids),
                    Settled::Failed(f) => {
                        crate::metrics::error(Stage::Gen, f.reason);
                        self.consumer
                            .reject_entry(&f.source, f.reason, &f.detail)
                            .await?;
                    }
                }
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
            let mut handed = false;
            for d in batch {
                let Some(a) = self.admission(d).await? else {
                    continue;
                };
                self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
                self.backlog += 1;
                handed = true;
                if admit.prompt(a).is_err() {
                    return Ok(());
                }
            }
            // An idle decoder waits for this before its first forward pass.
            if handed && admit.read_end().is_err() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Most groups in flight now: `max_lag` steps' worth, less a step for each version the
    /// model being decoded with is behind the newest announced one. A group started now
    /// is trained after the groups ahead of it, so its staleness then is about the steps
    /// ahead of it plus the versions the generator is already behind; bounding the sum
    /// keeps it within `max_lag` (the trainer drops what is older).
    fn bound(&self) -> usize {
        let behind = self
            .shared
            .announced
            .load(Ordering::Relaxed)
            .saturating_sub(self.shared.slot.load().version);
        self.steps_in_flight.saturating_sub(behind) as usize * self.groups_per_step
    }

    /// Whether the in-flight bound leaves room for more prompts; when it does not, waits
    /// until a group leaves or the backlog is due for a refresh.
    async fn room(&mut self) -> bool {
        let mut due = self.refreshed.map_or(Duration::ZERO, |t| {
            BACKLOG_REFRESH.saturating_sub(t.elapsed())
        });
        if due.is_zero() {
            let cap = (self.steps_in_flight as usize * self.groups_per_step).min(10_000) as u64;
            self.backlog = downstream_backlog(self.bus.as_ref(), &self.topo, cap).await;
            self.refreshed = Some(Instant::now());
            due = BACKLOG_REFRESH;
        }
        let local = self.shared.in_flight.load(Ordering::Relaxed);
        if local < self.local_cap && (self.backlog as usize + local) < self.bound() {
            return true;
        }
        let _ = tokio::time::timeout(due, self.shared.released.notified()).await;
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
        let tokens = match self.fit.apply(tokens) {
            Ok(t) => t,
            Err(r) => {
                self.consumer.reject(&d, r.reason, &r.detail).await?;
                return Ok(None);
            }
        };
        Ok(Some(Admit {
            source: d.entry(),
            prompt: d.message,
            tokens,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fit(truncate: TruncatePrompt) -> PromptFit {
        PromptFit {
            limits: Limits {
                vocab: 10,
                context: 8,
                routing: None,
            },
            bos: 1,
            max_new_tokens: 3,
            truncate,
        }
    }

    #[test]
    fn prompts_are_fitted_to_the_context_or_refused() {
        let none = fit(TruncatePrompt::None);
        assert_eq!(
            none.apply(vec![]),
            Ok(vec![1]),
            "an empty prompt starts at BOS"
        );
        // Whole: anything shorter than the context (the completion gets what is left).
        assert_eq!(none.apply(vec![9; 7]), Ok(vec![9; 7]));
        let r = none.apply(vec![2; 8]).expect_err("at the context");
        assert_eq!(r.reason, "context");
        assert_eq!(
            none.apply(vec![2, 10]).expect_err("id").reason,
            "vocabulary"
        );
        // Left: the end is kept so that max_new_tokens fit; short prompts are untouched.
        let left = fit(TruncatePrompt::Left);
        assert_eq!(
            left.apply(vec![1, 2, 3, 4, 5, 6, 7]),
            Ok(vec![3, 4, 5, 6, 7])
        );
        assert_eq!(left.apply((0..9).collect()), Ok(vec![4, 5, 6, 7, 8]));
        assert_eq!(left.apply(vec![1, 2]), Ok(vec![1, 2]));
        assert_eq!(
            left.apply(vec![2, 10, 3]).expect_err("id").reason,
            "vocabulary"
        );
    }
}

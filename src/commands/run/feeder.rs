//! The run's feeder: prompts of the task's RL stream (or the dataset's training rows, epoch
//! after epoch) onto the prompts stream, a backlog of about two steps in async mode, or one
//! step at a time in sync mode (released once the generator holds the weights the previous
//! step made).

use super::queues::queue_depths;
use crate::bus::{SharedBus, Topology};
use crate::model::InferBackend;
use crate::stages::{StageError, feed};
use crate::tasks::{self, BuiltinTask, Dataset};
use crate::weights::ModelSlot;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// Salt of the RL prompt stream, so RL prompts differ from the warm start's.
const RL_PROMPT_SALT: u64 = 0x0005_eed0_fa11;
/// How often the async feeder checks the prompt backlog.
const FEED_POLL: Duration = Duration::from_millis(10);
/// Trainer progress the sync feeder waits on: steps attempted and the version reached.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Progress {
    pub(super) steps: u64,
    pub(super) version: u64,
}

/// Keeps prompts flowing: in async mode a backlog of about two steps; in sync mode one
/// step's worth at a time, released when the previous step's weights are in the generator.
pub(super) struct Feeder {
    pub(super) rows: FeedRows,
    pub(super) seed: u64,
    pub(super) per_step: usize,
    pub(super) sync: bool,
    pub(super) bus: SharedBus,
    pub(super) topo: Topology,
    pub(super) slot: ModelSlot<InferBackend>,
    /// Groups the trainer's dynamic sampling filtered (`train.filter_groups`): in sync
    /// mode each is replaced by one more prompt, so the step fills.
    pub(super) filtered: Arc<AtomicU64>,
    /// What is fed: each prompt new, or with `[difficulty]` on, sometimes one scored before.
    pub(super) pool: feed::DifficultyPool,
    /// Prompts fed so far, and of them fed again, for the run's summary.
    pub(super) counts: Arc<FeedCounts>,
}

/// Prompts a run's feeder fed, and of them those the difficulty-aware feed fed again.
#[derive(Debug, Default)]
pub(super) struct FeedCounts {
    pub(super) fed: AtomicU64,
    pub(super) reoffered: AtomicU64,
}

/// What the feeder draws prompts from.
pub(super) enum FeedRows {
    /// A built-in task's endless RL stream (its tokens carried in the messages).
    Task(BuiltinTask),
    /// A dataset's training rows, in an order shuffled by the seed each epoch (tokenised by
    /// the generator with the model's tokenizer).
    Dataset {
        rows: Dataset,
        /// The epoch whose order `order` is.
        epoch: u64,
        order: Vec<usize>,
    },
}

impl FeedRows {
    /// Dataset rows, in no epoch's order yet.
    pub(super) fn dataset(rows: Dataset) -> Self {
        FeedRows::Dataset {
            rows,
            epoch: u64::MAX,
            order: Vec::new(),
        }
    }

    /// Prompt `i` of the run under `seed`, with its id.
    fn prompt(&mut self, seed: u64, i: u64) -> (String, tasks::TaskItem) {
        match self {
            FeedRows::Task(task) => (task.prompt_id(i), task.item(seed ^ RL_PROMPT_SALT, i)),
            FeedRows::Dataset { rows, epoch, order } => {
                let len = rows.items.len() as u64;
                if *epoch != i / len {
                    *epoch = i / len;
                    *order = (0..rows.items.len()).collect();
                    let mut rng = rand::rngs::StdRng::seed_from_u64(
                        crate::seed::mix(seed ^ RL_PROMPT_SALT) ^ *epoch,
                    );
                    order.shuffle(&mut rng);
                }
                let it = &rows.items[order[(i % len) as usize]];
                let epoch = u32::try_from(*epoch).unwrap_or(u32::MAX);
                (rows.item_id(epoch, it), it.item.clone())
            }
        }
    }

    /// The task or dataset name the prompts carry.
    fn name(&self) -> &str {
        match self {
            FeedRows::Task(task) => task.name(),
            FeedRows::Dataset { rows, .. } => &rows.name,
        }
    }
}

impl Feeder {
    /// Prompts fed so far: each one the pool's, new or fed again.
    fn fed(&self) -> u64 {
        let s = self.pool.state();
        s.fresh + s.reoffered
    }

    async fn publish(&mut self, n: usize) -> Result<(), StageError> {
        if self.pool.on() {
            self.pool
                .read_outcomes(self.bus.as_ref(), &self.topo)
                .await?;
        }
        let (rows, seed) = (&mut self.rows, self.seed);
        let mut i = self.pool.state().fresh;
        let mut fresh = || {
            i += 1;
            Some(rows.prompt(seed, i - 1))
        };
        let items: Vec<_> = (0..n).filter_map(|_| self.pool.next(&mut fresh)).collect();
        let builtin = matches!(self.rows, FeedRows::Task(_));
        let name = self.rows.name();
        feed::publish(&self.bus, &self.topo, name, &items, builtin).await?;
        self.counts.fed.store(self.fed(), Ordering::Relaxed);
        let again = self.pool.state().reoffered;
        self.counts.reoffered.store(again, Ordering::Relaxed);
        Ok(())
    }

    /// Feeds until `stop`; returns the prompts fed.
    pub(super) async fn run(
        mut self,
        progress: watch::Receiver<Progress>,
        stop: watch::Receiver<bool>,
    ) -> Result<u64, StageError> {
        let fed = self.feed(progress, stop).await?;
        let s = self.pool.state();
        if self.pool.on() {
            tracing::info!(
                fed,
                reoffered = s.reoffered,
                outcomes = s.outcomes,
                "the difficulty-aware feed fed {} of {fed} prompts again",
                s.reoffered
            );
        }
        Ok(fed)
    }

    async fn feed(
        &mut self,
        mut progress: watch::Receiver<Progress>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<u64, StageError> {
        let target = (2 * self.per_step) as u64;
        let mut released = 0u64;
        let mut replaced = 0u64;
        while !*stop.borrow() {
            if self.sync {
                // One step's prompts, one more for each group the trainer filters out
                // meanwhile, then wait for the trainer's step and the generator's swap.
                self.publish(self.per_step).await?;
                released += 1;
                let version = loop {
                    let seen = self.filtered.load(Ordering::Relaxed);
                    if seen > replaced {
                        self.publish((seen - replaced) as usize).await?;
                        replaced = seen;
                    }
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => return Ok(self.fed()),
                        p = progress.wait_for(|p| p.steps >= released) => match p {
                            Ok(p) => break p.version,
                            Err(_) => return Ok(self.fed()),
                        },
                        () = tokio::time::sleep(FEED_POLL) => {}
                    }
                };
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    () = self.slot.reached(version) => {}
                }
            } else {
                // The backlog is read from the bus's stream stats, which signal nothing when
                // the generator takes prompts: looked at every FEED_POLL.
                let [waiting, _, _] = queue_depths(&self.bus, &self.topo).await;
                if waiting < target {
                    self.publish((target - waiting) as usize).await?;
                }
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    () = tokio::time::sleep(FEED_POLL) => {}
                }
            }
        }
        Ok(self.fed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{DatasetItem, TaskItem, Unit};
    use std::collections::BTreeSet;

    fn rows(n: usize) -> Dataset {
        let items = (1..=n)
            .map(|line| DatasetItem {
                line,
                item: TaskItem {
                    prompt: format!("q{line}"),
                    answer: line.to_string(),
                    meta: Default::default(),
                },
                chat: None,
            })
            .collect();
        Dataset {
            name: "d".into(),
            items,
            unit: Unit::Line,
            rows: n,
            skipped: Vec::new(),
        }
    }

    /// Each epoch feeds every training row once, in an order of its own drawn from the
    /// seed; the ids say which epoch and line each prompt is.
    #[test]
    fn dataset_rows_are_fed_once_per_epoch_in_a_seeded_order() {
        let epoch = |f: &mut FeedRows, seed: u64, e: u64| -> Vec<(String, String)> {
            (e * 7..e * 7 + 7)
                .map(|i| {
                    let (id, it) = f.prompt(seed, i);
                    (id, it.prompt)
                })
                .collect()
        };
        let mut f = FeedRows::dataset(rows(7));
        let first = epoch(&mut f, 1, 0);
        let second = epoch(&mut f, 1, 1);
        for (e, fed) in [(0, &first), (1, &second)] {
            let lines: BTreeSet<&str> = fed.iter().map(|(_, p)| p.as_str()).collect();
            assert_eq!(lines.len(), 7, "epoch {e}: {fed:?}");
            assert!(
                fed.iter()
                    .all(|(id, p)| *id == format!("d-e{e}-l{}", &p[1..]))
            );
        }
        assert_ne!(first, second, "each epoch shuffles again");
        // The same seed, the same order; read out of order (a sync step's worth at a time).
        let mut again = FeedRows::dataset(rows(7));
        assert_eq!(epoch(&mut again, 1, 1), second);
        assert_eq!(epoch(&mut again, 1, 0), first);
        assert_ne!(epoch(&mut FeedRows::dataset(rows(7)), 2, 0), first);
    }
}

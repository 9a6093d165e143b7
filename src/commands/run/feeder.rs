//! The run's feeder: prompts of the task's RL stream onto the prompts stream, a backlog of
//! about two steps in async mode, or one step at a time in sync mode (released once the
//! generator holds the weights the previous step made).

use super::queues::queue_depths;
use crate::bus::{SharedBus, Topology};
use crate::model::InferBackend;
use crate::stages::{StageError, feed};
use crate::tasks::{self, BuiltinTask};
use crate::weights::ModelSlot;
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
    pub(super) task: BuiltinTask,
    pub(super) seed: u64,
    pub(super) per_step: usize,
    pub(super) sync: bool,
    pub(super) bus: SharedBus,
    pub(super) topo: Topology,
    pub(super) slot: ModelSlot<InferBackend>,
    pub(super) next: u64,
}

impl Feeder {
    /// Prompts `from..from + n` of the RL prompt stream.
    fn prompts(&self, n: usize) -> Vec<(String, tasks::TaskItem)> {
        let seed = self.seed ^ RL_PROMPT_SALT;
        (self.next..self.next + n as u64)
            .map(|i| (self.task.prompt_id(i), self.task.item(seed, i)))
            .collect()
    }

    async fn publish(&mut self, n: usize) -> Result<(), StageError> {
        let items = self.prompts(n);
        self.next += feed::publish(&self.bus, &self.topo, self.task.name(), &items, true).await?;
        Ok(())
    }

    /// Feeds until `stop`; returns the prompts fed.
    pub(super) async fn run(
        mut self,
        mut progress: watch::Receiver<Progress>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<u64, StageError> {
        let target = (2 * self.per_step) as u64;
        let mut released = 0u64;
        while !*stop.borrow() {
            if self.sync {
                // One step's prompts, then wait for the trainer's step and the generator's swap.
                self.publish(self.per_step).await?;
                released += 1;
                let version = tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    p = progress.wait_for(|p| p.steps >= released) => match p {
                        Ok(p) => p.version,
                        Err(_) => break,
                    },
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
        Ok(self.next)
    }
}

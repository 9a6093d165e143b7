//! The run's view of its steps while it runs: one report row and a display update per
//! trainer step, until the trainer ends (or a Ctrl-C asks it to checkpoint and stop).

use super::queues::queue_depths;
use super::stage_tasks::Stages;
use crate::bus::{SharedBus, Topology};
use crate::display::Phase;
use crate::model::InferBackend;
use crate::report::{RunProgress, StepRow};
use crate::schema::StepRecord;
use crate::stages::StageError;
use crate::stages::generator::GenSummary;
use crate::stages::train::TrainSummary;
use crate::weights::ModelSlot;
use std::future::Future;
use std::time::Instant;
use tokio::sync::mpsc;

/// The run's view of its steps: one report row and a display update per trainer step.
pub(super) struct Monitor {
    pub(super) phase: Phase,
    pub(super) total: u64,
    pub(super) rows: Vec<StepRow>,
    pub(super) trained_tokens: u64,
    pub(super) started: Instant,
}

impl Monitor {
    fn record(
        &mut self,
        s: &StepRecord,
        time_s: f64,
        gen_version: u64,
        queues: [u64; 3],
    ) -> &StepRow {
        self.trained_tokens += s.tokens;
        self.rows.push(step_row(
            s,
            time_s,
            gen_version,
            self.trained_tokens,
            queues,
        ));
        &self.rows[self.rows.len() - 1]
    }

    /// Follows the steps until the trainer ends (a Ctrl-C asks it to checkpoint and stop);
    /// returns the rows, the summaries and the RL phase's wall time.
    pub(super) async fn watch(
        mut self,
        mut stages: Stages,
        mut steps: mpsc::UnboundedReceiver<StepRecord>,
        bus: &SharedBus,
        topo: &Topology,
        slot: &ModelSlot<InferBackend>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(Vec<StepRow>, TrainSummary, GenSummary, f64), StageError> {
        tokio::pin!(shutdown);
        let mut stopping = false;
        let train_result = loop {
            tokio::select! {
                _ = &mut shutdown, if !stopping => {
                    stopping = true;
                    self.phase.println("stopping: the trainer checkpoints what it trained");
                    stages.stop.send_replace(true);
                }
                Some(s) = steps.recv() => {
                    let queues = queue_depths(bus, topo).await;
                    let time_s = self.started.elapsed().as_secs_f64();
                    let (short, long) = {
                        let row = self.record(&s, time_s, slot.load().version, queues);
                        (short_status(row), status_line(row))
                    };
                    self.phase.update_with(s.step.min(self.total), &short, &long);
                }
                r = &mut stages.train => break r,
            }
        };
        let wall_s = self.started.elapsed().as_secs_f64();
        let (t, g) = stages.join(train_result).await?;
        while let Ok(s) = steps.try_recv() {
            self.record(&s, wall_s, slot.load().version, [0; 3]);
        }
        self.phase
            .finish(&self.rows.last().map(status_line).unwrap_or_default());
        Ok((self.rows, t, g, wall_s))
    }
}

fn step_row(s: &StepRecord, time_s: f64, gen_version: u64, trained: u64, q: [u64; 3]) -> StepRow {
    StepRow {
        record: s.clone(),
        run: RunProgress {
            time_s,
            gen_version,
            trained_tokens_per_s: trained as f64 / time_s.max(1e-9),
            queue_prompts: q[0],
            queue_rollouts: q[1],
            queue_scored: q[2],
        },
    }
}

/// The bar's status: reward, sample accuracy and the trainer's version (29 columns at most
/// up to version 99,999).
fn short_status(r: &StepRow) -> String {
    let s = &r.record;
    format!(
        "reward {:.3} acc {:.0}% v{}",
        s.reward_mean,
        100.0 * s.accuracy,
        s.version
    )
}

fn status_line(r: &StepRow) -> String {
    let (s, run) = (&r.record, &r.run);
    format!(
        "v{} (gen v{}) reward {:.3} acc {:.0}% {:.0} tok/s stale {:.1}/{} queue {}/{}/{}",
        s.version,
        run.gen_version,
        s.reward_mean,
        100.0 * s.accuracy,
        run.trained_tokens_per_s,
        s.staleness_mean,
        s.staleness_max,
        run.queue_prompts,
        run.queue_rollouts,
        run.queue_scored
    )
}

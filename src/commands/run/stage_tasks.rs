//! The four stage tasks of a run over one bus: the trainer, the scorer, the generator and
//! the feeder, each the same code as its own process. Each stops the others when it fails,
//! so an error anywhere ends the run.

use super::feeder::{Feeder, Progress};
use crate::bus::{SharedBus, Topology};
use crate::collective::Collective;
use crate::config::Config;
use crate::model::InferBackend;
use crate::roles::Stage;
use crate::schema::StepRecord;
use crate::stages::generator::{self as gen_stage, GenSummary};
use crate::stages::train::{self, TrainJob, TrainSummary, TrainerSettings};
use crate::stages::{StageContext, StageError, score};
use crate::weights::{LocalWeights, ModelSlot, Transport};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use tokio::sync::{mpsc, watch};

type StageTask = tokio::task::JoinHandle<Result<StageResult, StageError>>;

/// What a stage task returns to the run.
pub(super) enum StageResult {
    Train(TrainSummary),
    Gen(GenSummary),
    Other,
}

/// The running stage tasks and the signal that stops them all.
pub(super) struct Stages {
    pub(super) train: StageTask,
    score: StageTask,
    generator: StageTask,
    feed: StageTask,
    pub(super) stop: Arc<watch::Sender<bool>>,
}

/// Completes once `stop` is set (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs `stage` as a task that sets `stop` when it fails.
fn spawn_stage(
    stop: &Arc<watch::Sender<bool>>,
    stage: impl Future<Output = Result<StageResult, StageError>> + Send + 'static,
) -> StageTask {
    let stop = stop.clone();
    tokio::spawn(async move {
        let r = stage.await;
        if r.is_err() {
            stop.send_replace(true);
        }
        r
    })
}

/// The trainer until its step limit or `until`, telling the feeder each step's progress
/// and the monitor each step's record.
async fn train_stage(
    settings: TrainerSettings,
    (bus, topo): (SharedBus, Topology),
    (transport, ranks): (Transport, Box<dyn Collective>),
    until: impl Future<Output = ()> + Send,
    (progress, filtered): (watch::Sender<Progress>, Arc<AtomicU64>),
    records: mpsc::UnboundedSender<StepRecord>,
) -> Result<StageResult, StageError> {
    let mut steps = 0u64;
    let on_step = move |s: &StepRecord| {
        steps += 1;
        progress.send_replace(Progress {
            steps,
            version: s.version,
        });
        let _ = records.send(s.clone());
    };
    let job = TrainJob::new(&settings)
        .transport(transport)
        .ranks(ranks)
        .count_filtered(filtered)
        .on_step(on_step);
    let role = (Stage::Train, settings.train.name.as_str());
    train::run(job, StageContext::new(role, bus, &topo, until))
        .await
        .map(StageResult::Train)
}

impl Stages {
    pub(super) fn spawn(
        feeder: Feeder,
        cfg: &Config,
        bus: &SharedBus,
        topo: &Topology,
        slot: &ModelSlot<InferBackend>,
        ranks: Box<dyn Collective>,
        records: mpsc::UnboundedSender<StepRecord>,
    ) -> Self {
        let transport = Transport::InProcess(LocalWeights::default());
        let stop = Arc::new(watch::channel(false).0);
        let (progress_tx, progress_rx) = watch::channel(Progress::default());
        let settings = TrainerSettings {
            policy: cfg.policy.clone(),
            train: cfg.train.clone(),
        };
        let train = spawn_stage(
            &stop,
            train_stage(
                settings,
                (bus.clone(), topo.clone()),
                (transport.clone(), ranks),
                stopped(stop.subscribe()),
                (progress_tx, feeder.filtered.clone()),
                records,
            ),
        );
        let score_cfg = cfg.score.clone();
        let (score_bus, score_topo) = (bus.clone(), topo.clone());
        let until = stopped(stop.subscribe());
        let score = spawn_stage(&stop, async move {
            let role = (Stage::Score, score_cfg.name.as_str());
            let ctx = StageContext::new(role, score_bus, &score_topo, until);
            score::run(&score_cfg, ctx)
                .await
                .map(|_| StageResult::Other)
        });
        let (policy, gen_cfg) = (cfg.policy.clone(), cfg.generator.clone());
        let (gen_bus, gen_topo, gen_slot) = (bus.clone(), topo.clone(), slot.clone());
        let until = stopped(stop.subscribe());
        let generator = spawn_stage(&stop, async move {
            let job = gen_stage::GenJob {
                policy: &policy,
                cfg: &gen_cfg,
                slot: gen_slot,
                transport,
            };
            let role = (Stage::Gen, gen_cfg.name.as_str());
            gen_stage::run(job, StageContext::new(role, gen_bus, &gen_topo, until))
                .await
                .map(StageResult::Gen)
        });
        let stop_rx = stop.subscribe();
        let feeding = cfg.run.feed;
        let feed = spawn_stage(&stop, async move {
            if !feeding {
                // The endpoint's agents are the only source of groups.
                stopped(stop_rx).await;
                return Ok(StageResult::Other);
            }
            feeder
                .run(progress_rx, stop_rx)
                .await
                .map(|_| StageResult::Other)
        });
        Stages {
            train,
            score,
            generator,
            feed,
            stop,
        }
    }

    /// Stops the other stages once the trainer has ended with `train`, and returns the
    /// trainer's and the generator's summaries, or the first real failure (the other stages
    /// only stopped because of it).
    pub(super) async fn join(
        self,
        train: Result<Result<StageResult, StageError>, tokio::task::JoinError>,
    ) -> Result<(TrainSummary, GenSummary), StageError> {
        self.stop.send_replace(true);
        let join = |r: Result<Result<StageResult, StageError>, tokio::task::JoinError>,
                    name: Stage| {
            r.map_err(|e| StageError::Other(format!("{name} task: {e}")))?
        };
        let train_r = join(train, Stage::Train);
        let gen_r = join(self.generator.await, Stage::Gen);
        let score_r = join(self.score.await, Stage::Score);
        let feed_r = join(self.feed.await, Stage::Feed);
        let train_summary = match train_r? {
            StageResult::Train(t) => t,
            _ => TrainSummary::default(),
        };
        let gen_summary = match gen_r? {
            StageResult::Gen(g) => g,
            _ => GenSummary::default(),
        };
        score_r?;
        feed_r?;
        Ok((train_summary, gen_summary))
    }
}

//! `rlstream train`: reads scored groups through the trainer's consumer group, drops groups
//! older than `max_lag` versions, optimises an importance-weighted policy-gradient
//! objective, publishes weights, and checkpoints.
//!
//! Delivery: entries are acked only after the checkpoint that contains their effect is on
//! disk. On restart the trainer loads its newest checkpoint and, under the same consumer
//! name, re-reads the entries it had taken but not acked, so a crash at any point loses
//! nothing and trains nothing twice. Group ids trained since the checkpoint are remembered
//! in it, so a group published twice upstream (a scorer that crashed between publish and
//! ack) is not trained twice either.
//!
//! - [`intake`]: which groups are trained and when (pure, unit-tested);
//! - [`credit`]: rewards placed on tokens become per-token advantages;
//! - [`loss`]: the objective and the step's statistics;
//! - [`trainer`]: model, optimizer, state, steps;
//! - [`adamw`]: the optimizer's update, one in-place pass per parameter;
//! - [`exchange`]: trainer ranks' gradient all-reduce with the buckets on the device;
//! - [`checkpoint`]: the checkpoint layout `run` and `replay` share.

pub mod adamw;
pub mod checkpoint;
mod config;
pub mod credit;
pub mod exchange;
pub mod intake;
mod loss;
pub mod objective;
mod ranks;
mod sharded;
mod state;
mod steps;
mod sums;
mod trainer;

pub use checkpoint::CheckpointError;
pub use config::*;
pub use ranks::follow;
pub use state::TrainerState;
pub use steps::{Outcome, step as step_over_ranks};
pub use trainer::{TrainOn, Trainer, TrainerOn};

use super::{StageContext, StageError};
use crate::bus::{Consumer, ConsumerOptions, Delivery, EntryId, SharedBus, Topology};
use crate::collective::{self, Collective};
use crate::model::fault;
use crate::roles::{Stage, Stream};
use crate::schema::{self, Event, ScoredGroup, StepRecord};
use crate::weights::{Publisher, Transport, WeightsError};

use bytes::Bytes;
use intake::{DropReason, Intake, staleness};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long the trainer retries publishing into a weights store that fails (full,
/// unmounted) before it stops with the store's error.
const STORE_PATIENCE: Duration = Duration::from_secs(300);

/// How far back a starting trainer reads generators' heartbeats for the version they hold
/// (they beat every [`super::HEARTBEAT_EVERY`]).
const HELD_WITHIN: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TrainSummary {
    pub steps: u64,
    pub version: u64,
    pub trained_groups: u64,
    pub dropped: BTreeMap<String, u64>,
    pub history: Vec<StepRecord>,
}

/// A running trainer: what `run` keeps between steps.
struct Loop<'a> {
    cfg: &'a TrainerSettings,
    bus: SharedBus,
    topo: &'a Topology,
    trainer: Trainer,
    publisher: Publisher,
    consumer: Consumer<ScoredGroup>,
    intake: Intake,
    /// Entries done with (trained or dropped) but not yet acked: acked after the next
    /// checkpoint.
    unacked: Vec<EntryId>,
    last_checkpoint: u64,
    /// Since the last step, for the step's wait time.
    waiting: Instant,
    /// The trainer ranks this one leads (one rank alone without `mpirun`).
    ranks: &'a mut dyn Collective,
    /// When the other ranks last heard from this one.
    last_command: Instant,
    summary: TrainSummary,
    /// Groups dynamic sampling filtered since the last step.
    filtered: u64,
    /// Groups filtered since the stage began, for whoever feeds prompts in this process.
    filtered_total: Option<Arc<AtomicU64>>,
}

/// What the trainer stage does: its settings, how its weights reach the generators
/// ([`Transport::Bus`] unless they share this process), the ranks it leads (one alone
/// without `mpirun`), and what sees each step's record (progress displays and reports).
pub struct TrainJob<'a, F> {
    pub settings: &'a TrainerSettings,
    pub transport: Transport,
    pub ranks: Box<dyn Collective>,
    pub on_step: F,
    /// Counts the groups dynamic sampling filters (`train.filter_groups`), as they are:
    /// a `--sync` feeder replaces each with a prompt.
    pub filtered: Option<Arc<AtomicU64>>,
}

impl<'a> TrainJob<'a, fn(&StepRecord)> {
    /// One rank alone, weights on the bus, nothing called per step.
    pub fn new(settings: &'a TrainerSettings) -> Self {
        TrainJob {
            settings,
            transport: Transport::Bus,
            ranks: Box::new(collective::Solo::default()),
            on_step: |_| {},
            filtered: None,
        }
    }
}

impl<'a, F: FnMut(&StepRecord)> TrainJob<'a, F> {
    pub fn transport(self, transport: Transport) -> Self {
        TrainJob { transport, ..self }
    }

    pub fn ranks(self, ranks: Box<dyn Collective>) -> Self {
        TrainJob { ranks, ..self }
    }

    pub fn on_step<G: FnMut(&StepRecord)>(self, on_step: G) -> TrainJob<'a, G> {
        TrainJob {
            settings: self.settings,
            transport: self.transport,
            ranks: self.ranks,
            on_step,
            filtered: self.filtered,
        }
    }

    /// Counts filtered groups into `total` as they are filtered.
    pub fn count_filtered(self, total: Arc<AtomicU64>) -> Self {
        TrainJob {
            filtered: Some(total),
            ..self
        }
    }
}

/// Runs the trainer until `settings.train.steps` steps (0: until shutdown).
pub async fn run<F: FnMut(&StepRecord)>(
    job: TrainJob<'_, F>,
    ctx: StageContext<'_>,
) -> Result<TrainSummary, StageError> {
    let TrainJob {
        settings: cfg,
        transport,
        mut ranks,
        on_step,
        filtered,
    } = job;
    let trainer = tokio::task::block_in_place(|| ranks::lead(cfg, ranks.as_mut()))?;
    let hooks = (on_step, filtered);
    let result = run_loop(cfg, ctx, transport, trainer, ranks.as_mut(), hooks).await;
    match &result {
        // Every rank has seen it and stopped.
        Err(StageError::Ranks(_)) => {}
        _ if ranks.world() > 1 => {
            let error = result.as_ref().err().map(ToString::to_string);
            tokio::task::block_in_place(|| {
                ranks::send(ranks.as_mut(), &ranks::RankCommand::Stop { error })
            })?;
        }
        _ => {}
    }
    result
}

/// [`run`] once the trainer (and its ranks) started.
async fn run_loop(
    cfg: &TrainerSettings,
    mut ctx: StageContext<'_>,
    transport: Transport,
    trainer: Trainer,
    ranks: &mut dyn Collective,
    (mut on_step, filtered): (impl FnMut(&StepRecord), Option<Arc<AtomicU64>>),
) -> Result<TrainSummary, StageError> {
    // Read no more than a step's worth: what the trainer has not taken stays visible as lag
    // to the generators' in-flight bound.
    let opts = ConsumerOptions {
        batch: cfg.policy.groups_per_step,
        ..ctx.topo.consumer_options()
    };
    let consumer = ctx.consumer::<ScoredGroup>(Stream::Scored, opts);
    let on = (ctx.bus.clone(), ctx.topo);
    let mut lp = Loop::start(cfg, on, transport, trainer, ranks, consumer.await?).await?;
    lp.filtered_total = filtered;
    let mut heartbeat = ctx.heartbeat();
    let standing = [Stream::Scored, Stream::Weights, Stream::Events].map(Stream::as_str);
    let standing = [&standing[..], &[ctx.topo.dead_letter.as_str()]].concat();
    let retention = ctx.start(&standing);
    crate::metrics::holds(Stage::Train, lp.trainer.state.version);
    while !lp.done() {
        let mut fields = vec![
            ("step", lp.trainer.state.step as f64),
            ("trained_groups", lp.trainer.state.trained_groups as f64),
            ("buffered_groups", lp.intake.len() as f64),
        ];
        if !lp.publisher.in_process() {
            fields.push(("weights_store_bytes", lp.publisher.held_bytes() as f64));
            fields.push(("weights_max_bytes", lp.publisher.max_bytes() as f64));
        }
        heartbeat.beat(lp.trainer.state.version, &fields).await;
        let batch = tokio::select! {
            biased;
            _ = ctx.shutdown() => break,
            b = lp.consumer.poll() => b?,
        };
        if lp.consumer.take_loss() && lp.trainer.state.version > 0 {
            // Redis lost its data, the weights' announces with it: announce the current
            // version again so that a generator that starts now can fetch it.
            tracing::warn!(
                version = lp.trainer.state.version,
                "announcing the weights again after Redis lost its data"
            );
            lp.publish_weights().await?;
        }
        lp.admit(batch).await?;
        lp.keep_alive()?;
        while !lp.done() {
            let Some(taken) = lp.next_batch() else { break };
            if let Some(record) = lp.train(taken).await? {
                on_step(&record);
                lp.summary.history.push(record);
            }
        }
    }
    let summary = lp.finish().await;
    if let Some(r) = retention {
        r.finish().await;
    }
    summary
}

impl<'a> Loop<'a> {
    /// The trainer from its checkpoint (or model), joined to the scored stream, with its
    /// version above anything a crashed predecessor published.
    async fn start(
        cfg: &'a TrainerSettings,
        (bus, topo): (SharedBus, &'a Topology),
        transport: Transport,
        trainer: Trainer,
        ranks: &'a mut dyn Collective,
        consumer: Consumer<ScoredGroup>,
    ) -> Result<Loop<'a>, StageError> {
        let mut publisher = Publisher::new(bus.clone(), topo.clone(), cfg.train.keep_versions)
            .with_transport(transport.clone());
        if let Transport::Store(w) = &transport {
            let dtype = w.resolve_dtype(cfg.policy.model.as_deref());
            publisher = publisher.with_config(w, dtype)?;
        }
        let params = match trainer.adapter() {
            Some(a) => a.spec.num_params(trainer.model().config()),
            None => trainer.model().config().num_params(),
        };
        publisher.check_fits(crate::weights::params_bytes(params, publisher.dtype()))?;
        publisher.adopt().await?;
        let mut lp = Loop {
            cfg,
            bus,
            topo,
            last_checkpoint: trainer.state.step,
            trainer,
            publisher,
            consumer,
            intake: Intake::new(
                cfg.policy.max_lag,
                cfg.policy.groups_per_step,
                intake::Filter::of(&cfg.train),
            ),
            filtered: 0,
            filtered_total: None,
            unacked: Vec::new(),
            waiting: Instant::now(),
            summary: TrainSummary::default(),
            ranks,
            last_command: Instant::now(),
        };
        lp.resume_versions().await?;
        Ok(lp)
    }

    /// A trainer that died after its last checkpoint may have published versions whose
    /// steps are now lost; generators hold them and ignore anything not newer (the
    /// announces say so, or, when Redis lost them, the generators' heartbeats). Number on
    /// from above them, so versions never go backwards and generators take the resumed
    /// weights at once. A resumed trainer publishes its weights, so generators that start
    /// from the initial model (or whose weights stream was trimmed) catch up instead of
    /// producing groups too stale to train on.
    async fn resume_versions(&mut self) -> Result<(), StageError> {
        let announced = crate::weights::newest_announce(self.bus.as_ref(), self.topo)
            .await?
            .map(|a| a.version);
        // Generators' heartbeats say what they hold even when Redis lost the announces.
        let held =
            super::held_version(self.bus.as_ref(), self.topo, Stage::Gen, HELD_WITHIN).await?;
        let state = &mut self.trainer.state;
        if let Some(newest) = announced.max(held)
            && newest > state.version
        {
            tracing::warn!(
                checkpoint_version = state.version,
                published = newest,
                "versions past the checkpoint were published (or are held by generators) \
                 before a restart; continuing at {}",
                newest + 1
            );
            state.version = newest + 1;
        }
        if state.version > 0 {
            self.publish_weights().await?;
        }
        Ok(())
    }

    fn done(&self) -> bool {
        let steps = self.cfg.train.steps;
        steps > 0 && self.trainer.state.step >= steps
    }

    /// Offers a polled batch to the intake; what it refuses is counted and done with. A
    /// group the model cannot run (see [`Limits`](crate::schema::Limits)) is dead-lettered.
    async fn admit(&mut self, batch: Vec<Delivery<ScoredGroup>>) -> Result<(), StageError> {
        let limits = self.trainer.model().config().limits();
        for d in batch {
            if let Err(r) = limits.scored(&d.message) {
                crate::metrics::error(Stage::Train, r.reason);
                self.consumer.reject(&d, r.reason, &r.detail).await?;
                continue;
            }
            let version = self.trainer.state.version;
            let trainer = &self.trainer;
            if let Some((d, reason)) = self.intake.offer(d, version, |id| trainer.seen(id)) {
                self.drop_delivery(d, reason);
            }
        }
        Ok(())
    }

    fn drop_delivery(&mut self, d: Delivery<ScoredGroup>, reason: DropReason) {
        if reason.filtered() {
            self.filtered += 1;
            if let Some(total) = &self.filtered_total {
                total.fetch_add(1, Ordering::Relaxed);
            }
        }
        let lag = staleness(&d.message, self.trainer.state.version);
        tracing::debug!(group = %d.message.rollout.group_id, lag, reason = reason.as_str(), "dropped");
        self.trainer.state.record_drop(&d.message, reason);
        self.unacked.push(d.id);
    }

    /// One step's worth of groups, after dropping those that aged while they waited.
    fn next_batch(&mut self) -> Option<Vec<Delivery<ScoredGroup>>> {
        for d in self.intake.expire(self.trainer.state.version) {
            self.drop_delivery(d, DropReason::Stale);
        }
        if let Some(full) = self.intake.take() {
            return Some(full);
        }
        // Dynamic sampling may leave a step short for long: past `max_fill_wait_s` it is
        // taken with the groups that are there.
        let bound = self.cfg.train.max_fill_wait_s;
        let waited = self.waiting.elapsed().as_secs_f64();
        if bound > 0.0 && waited >= bound && !self.intake.is_empty() {
            tracing::warn!(
                groups = self.intake.len(),
                groups_per_step = self.cfg.policy.groups_per_step,
                waited_s = waited,
                filtered = self.filtered,
                "a step waited train.max_fill_wait_s for informative groups: taken short"
            );
            return self.intake.take_all();
        }
        None
    }

    /// One optimizer step on `taken`: the record, its event and metrics, then weights and a
    /// checkpoint when they are due.
    async fn train(
        &mut self,
        taken: Vec<Delivery<ScoredGroup>>,
    ) -> Result<Option<StepRecord>, StageError> {
        let version_before = self.trainer.state.version;
        // The wait ends where the step begins: since the last step's end (weights and
        // checkpoint included), not counting this step's own time.
        let wait_s = self.waiting.elapsed().as_secs_f64();
        let Some((taken, mut record)) = self.contained_step(taken).await? else {
            return Ok(None);
        };
        let groups: Vec<&ScoredGroup> = taken.iter().map(|d| &d.message).collect();
        record.wait_s = wait_s;
        record.staleness = groups
            .iter()
            .map(|g| staleness(g, version_before))
            .collect();
        record.staleness_max = record.staleness.iter().copied().max().unwrap_or(0);
        record.staleness_mean =
            record.staleness.iter().sum::<u64>() as f64 / record.staleness.len().max(1) as f64;
        if record.skipped {
            for g in &groups {
                self.trainer.state.record_drop(g, DropReason::Nonfinite);
            }
        }
        record.filtered_groups = std::mem::take(&mut self.filtered);
        let cut = self.intake.take_truncation();
        (record.truncated_samples, record.masked_samples) = (cut.truncated, cut.masked);
        record.trained_groups = self.trainer.state.trained_groups;
        record.dropped_groups = self.trainer.state.dropped.values().sum();
        self.unacked.extend(taken.iter().map(|d| d.id));
        log_step(&record);
        let samples = groups.iter().map(|g| g.rollout.samples.len() as u64).sum();
        crate::metrics::trained(&record, samples);
        self.publish_step_event(&record).await?;
        let stepped = self.trainer.state.version != version_before;
        if stepped
            && self
                .trainer
                .state
                .version
                .is_multiple_of(self.cfg.train.publish_every)
        {
            self.publish_weights().await?;
        }
        if self.trainer.state.step - self.last_checkpoint >= self.cfg.train.checkpoint_every {
            self.checkpoint_and_ack().await?;
        }
        self.waiting = Instant::now();
        Ok(Some(record))
    }

    /// One step on `taken` over every rank, and the groups it stepped on. A step that
    /// panics changes no weight: each group is then run alone (forward and backward, no
    /// update), those that panic alone are dead-lettered with reason `panic`, and the step
    /// is taken on the rest (see [`fault`] and [`steps::step`]). `None` when no group is
    /// left.
    async fn contained_step(
        &mut self,
        taken: Vec<Delivery<ScoredGroup>>,
    ) -> Result<Option<(Vec<Delivery<ScoredGroup>>, StepRecord)>, StageError> {
        if self.ranks.world() > 1 {
            let groups = taken
                .iter()
                .map(|d| schema::encode(&d.message).map(serde_bytes::ByteBuf::from))
                .collect::<Result<_, _>>()?;
            let state = &self.trainer.state;
            let cmd = ranks::RankCommand::Step {
                step: state.step,
                version: state.version,
                groups,
            };
            self.command(&cmd)?;
        }
        let groups: Vec<&ScoredGroup> = taken.iter().map(|d| &d.message).collect();
        let (trainer, c) = (&mut self.trainer, &mut *self.ranks);
        let outcome = tokio::task::block_in_place(|| steps::step(trainer, c, &groups))?;
        for (i, detail) in &outcome.rejected {
            self.reject_panicked(&taken[*i], detail).await?;
        }
        let Some(record) = outcome.record else {
            return Ok(None);
        };
        let mut taken: Vec<Option<Delivery<ScoredGroup>>> = taken.into_iter().map(Some).collect();
        let kept = outcome
            .kept
            .iter()
            .filter_map(|&i| taken[i].take())
            .collect();
        Ok(Some((kept, record)))
    }

    /// Broadcasts `cmd` to the other ranks.
    fn command(&mut self, cmd: &ranks::RankCommand) -> Result<(), StageError> {
        let c = &mut *self.ranks;
        tokio::task::block_in_place(|| ranks::send(c, cmd))?;
        self.last_command = Instant::now();
        Ok(())
    }

    /// Tells the other ranks this one is alive while it waits for groups: their wait for
    /// the next command has a deadline.
    fn keep_alive(&mut self) -> Result<(), StageError> {
        if self.ranks.world() > 1 && self.last_command.elapsed() > self.ranks.timeout() / 4 {
            self.command(&ranks::RankCommand::Idle)?;
        }
        Ok(())
    }

    async fn reject_panicked(
        &mut self,
        d: &Delivery<ScoredGroup>,
        detail: &str,
    ) -> Result<(), StageError> {
        tracing::error!(group = %d.message.rollout.group_id, detail, "group dead-lettered");
        crate::metrics::error(Stage::Train, fault::PANIC);
        self.consumer.reject(d, fault::PANIC, detail).await?;
        Ok(())
    }

    /// Makes what was trained durable, then acks it.
    async fn checkpoint_and_ack(&mut self) -> Result<(), StageError> {
        if self.ranks.world() > 1 {
            // `latest` names the checkpoint once every rank has written its optimizer
            // shard (when sharded) and the ranks' weights agree.
            let dir = tokio::task::block_in_place(|| self.trainer.write_checkpoint())?;
            let step = self.trainer.state.step;
            self.command(&ranks::RankCommand::Verify { step })?;
            let (trainer, c) = (&self.trainer, &mut *self.ranks);
            tokio::task::block_in_place(|| ranks::verify(trainer, c, None))?;
            checkpoint::mark_latest(&self.cfg.train.checkpoint_dir, &dir)?;
        } else {
            tokio::task::block_in_place(|| self.trainer.checkpoint())?;
        }
        self.consumer.ack(&self.unacked).await?;
        self.unacked.clear();
        self.last_checkpoint = self.trainer.state.step;
        Ok(())
    }

    /// Stopping: a checkpoint for what was trained since the last one. Groups still in the
    /// intake were not trained: they stay pending and come back to this consumer after a
    /// restart.
    async fn finish(mut self) -> Result<TrainSummary, StageError> {
        if self.trainer.state.step > self.last_checkpoint || !self.unacked.is_empty() {
            self.checkpoint_and_ack().await?;
        }
        let state = &self.trainer.state;
        let mut summary = self.summary;
        summary.steps = state.step;
        summary.version = state.version;
        summary.trained_groups = state.trained_groups;
        summary.dropped = state.dropped.clone();
        tracing::info!(
            steps = summary.steps,
            version = summary.version,
            trained_groups = summary.trained_groups,
            dropped = ?summary.dropped,
            "train stopped"
        );
        Ok(summary)
    }

    /// Publishes the trainer's current weights in the form the transport takes.
    async fn publish_weights(&mut self) -> Result<(), StageError> {
        let began = Instant::now();
        let mut wait = Duration::from_secs(1);
        loop {
            // Host tensors: handed over in process, or encoded by the publisher in the
            // dtype on the wire.
            let payload = tokio::task::block_in_place(|| self.trainer.payload())?;
            let state = &self.trainer.state;
            match self
                .publisher
                .publish_payload(state.version, state.step, payload)
                .await
            {
                Ok(_) => break,
                // A store that is full or unreachable may recover (space freed, a share
                // remounted): retry for a while, then stop with its error.
                Err(e @ WeightsError::Store { .. }) if began.elapsed() < STORE_PATIENCE => {
                    crate::metrics::error(Stage::Train, "weights_store");
                    tracing::error!(
                        version = state.version,
                        error = %e,
                        "cannot publish weights; retrying in {wait:?} (free space in the store or fix its mount; the trainer stops after {STORE_PATIENCE:?})"
                    );
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
                Err(e) => return Err(e.into()),
            }
        }
        crate::metrics::weight_sync(Stage::Train, began.elapsed().as_secs_f64());
        Ok(())
    }

    /// A `step` event on the events stream: what `rlstream status` and `replay` read.
    async fn publish_step_event(&self, record: &StepRecord) -> Result<(), StageError> {
        let event = Event {
            fields: record.to_fields(),
            ..Event::new(
                "step",
                Stage::Train.as_str(),
                &self.cfg.train.name,
                record.version,
            )
        };
        let bytes = Bytes::from(schema::encode(&event)?);
        let events = Stream::Events;
        self.bus
            .publish(&self.topo.key(events), &[bytes], self.topo.max_len(events))
            .await?;
        Ok(())
    }
}

fn log_step(r: &StepRecord) {
    tracing::info!(
        step = r.step,
        version = r.version,
        loss = format!("{:.4}", r.loss),
        reward = format!("{:.3}", r.reward_mean),
        ess = format!("{:.3}", r.ess),
        clip = format!("{:.3}", r.clip_fraction),
        grad_norm = format!("{:.3}", r.grad_norm),
        step_s = format!("{:.3}", r.step_s),
        "train step"
    );
}

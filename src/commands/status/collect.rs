//! Gathering a [`Status`] from the bus: each stream's stats (XINFO) and memory, the newest
//! weights announce and dead letter, and the events of the window, grouped by process.

use super::snapshot::{
    ConsumerStatus, DataLossStatus, DeadLetterStatus, GroupStatus, ProcessStatus, Status,
    StreamStatus, TrainerStatus, WeightsStatus,
};
use crate::bus::{Bus, BusError, EntryId, RangeBound, Topology};
use crate::roles::{Stage, Stream};
use crate::schema::{self, DeadLetter, Event, StepRecord, WeightsAnnounce};
use std::collections::BTreeMap;
use std::time::Duration;

/// Most events read for one snapshot (heartbeats and steps of the window).
const MAX_EVENTS: usize = 50_000;
/// A process whose newest event is older than this is shown as silent.
const SILENT_AFTER: Duration = Duration::from_secs(10);

/// The newest entry of `stream`, decoded; None when empty, unreadable or undecodable.
async fn newest<M: schema::Message>(
    bus: &dyn Bus,
    stream: &str,
    last: Option<EntryId>,
) -> Option<M> {
    let entries = bus
        .range(stream, RangeBound::Inclusive(last?), RangeBound::Open, 1)
        .await
        .ok()?;
    schema::decode(&entries.first()?.payload).ok()
}

fn age_s(now_us: u64, then_us: u64) -> f64 {
    now_us.saturating_sub(then_us) as f64 / 1e6
}

/// Rate of a running count over a source's events: (last − first) / elapsed.
fn count_rate(events: &[&Event], field: &str) -> Option<f64> {
    let (first, last) = (events.first()?, events.last()?);
    let span = last.time_us.checked_sub(first.time_us)? as f64 / 1e6;
    let (a, b) = (first.fields.get(field)?, last.fields.get(field)?);
    (span > 0.0).then(|| (b - a).max(0.0) / span)
}

/// Rate of per-step amounts (trainer step events): the sum after the first / elapsed.
fn step_rate(steps: &[&Event], field: &str) -> Option<f64> {
    let (first, last) = (steps.first()?, steps.last()?);
    let span = last.time_us.checked_sub(first.time_us)? as f64 / 1e6;
    let sum: f64 = steps[1..].iter().filter_map(|e| e.fields.get(field)).sum();
    (span > 0.0).then(|| sum / span)
}

/// What the streams say: each stream's status, the dead letters and the newest weights.
#[derive(Default)]
struct StreamsPart {
    streams: Vec<StreamStatus>,
    dead_letters: u64,
    last_dead_letter: Option<DeadLetterStatus>,
    weights: Option<WeightsStatus>,
}

fn group_status(g: crate::bus::GroupStats) -> GroupStatus {
    GroupStatus {
        name: g.name,
        pending: g.pending,
        lag: g.lag,
        consumers: g
            .consumers
            .into_iter()
            .map(|c| ConsumerStatus {
                name: c.name,
                pending: c.pending,
                idle_s: c.idle.as_secs_f64(),
            })
            .collect(),
    }
}

async fn read_streams(
    bus: &dyn Bus,
    topo: &Topology,
    now_us: u64,
) -> Result<StreamsPart, BusError> {
    let mut part = StreamsPart::default();
    for name in topo.streams.keys() {
        let key = topo.key(name);
        let s = bus.stats(&key).await?;
        if key == topo.dead_key() {
            part.dead_letters = s.length;
            part.last_dead_letter =
                newest::<DeadLetter>(bus, &key, s.last_id)
                    .await
                    .map(|d| DeadLetterStatus {
                        source_stream: d.source_stream,
                        source_id: d.source_id,
                        reason: d.reason,
                        error: d.error,
                        age_s: age_s(now_us, d.dead_us),
                    });
        }
        if name == Stream::Weights.as_str() {
            part.weights = newest::<WeightsAnnounce>(bus, &key, s.last_id)
                .await
                .map(|a| WeightsStatus {
                    version: a.version,
                    stored_bytes: a.object_bytes(),
                    format: a.format,
                    bytes: a.bytes,
                    store: a.store,
                    published_s: age_s(now_us, a.published_us),
                    store_bytes: None,
                    max_bytes: None,
                });
        }
        let memory_bytes = bus.memory_usage(&key).await?;
        part.streams.push(StreamStatus {
            name: name.clone(),
            key,
            length: s.length,
            memory_bytes,
            max_bytes: topo.streams[name].trim_max_bytes,
            groups: s.groups.into_iter().map(group_status).collect(),
        });
    }
    Ok(part)
}

/// The events of the last `window`, by (stage, source), oldest first.
async fn read_events(
    bus: &dyn Bus,
    topo: &Topology,
    now_us: u64,
    window: Duration,
) -> Result<BTreeMap<(String, String), Vec<Event>>, BusError> {
    let from_ms = (now_us / 1000).saturating_sub(window.as_millis() as u64);
    let mut by_source: BTreeMap<(String, String), Vec<Event>> = BTreeMap::new();
    let entries = bus
        .range(
            &topo.key(Stream::Events),
            RangeBound::Inclusive(EntryId::new(from_ms, 0)),
            RangeBound::Open,
            MAX_EVENTS,
        )
        .await?;
    for e in entries
        .iter()
        .filter_map(|e| schema::decode::<Event>(&e.payload).ok())
    {
        by_source
            .entry((e.stage.clone(), e.source.clone()))
            .or_default()
            .push(e);
    }
    Ok(by_source)
}

/// What the events say: each process, the trainer's newest step and the flow totals.
#[derive(Default)]
struct EventsPart {
    processes: Vec<ProcessStatus>,
    losses: Vec<DataLossStatus>,
    trainer: Option<TrainerStatus>,
    generated: f64,
    scored: f64,
    trained: f64,
}

/// The trainer's status from its newest step event, among `steps` of one source.
fn trainer_status(source: &str, steps: &[&Event], now_us: u64) -> Option<TrainerStatus> {
    let s = steps.last()?;
    let record = match StepRecord::from_fields(&s.fields) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(source = %source, error = %e, "unreadable step event");
            return None;
        }
    };
    Some(TrainerStatus {
        source: source.to_string(),
        step: record.step,
        version: s.version,
        last_step_s: age_s(now_us, s.time_us),
        reward_mean: record.reward_mean,
        accuracy: record.accuracy,
        loss: record.loss,
        staleness_max: record.staleness_max,
        steps_per_s: steps.first().and_then(|first| {
            let span = s.time_us.checked_sub(first.time_us)? as f64 / 1e6;
            (span > 0.0).then(|| (steps.len() - 1) as f64 / span)
        }),
    })
}

impl EventsPart {
    /// Adds the process `(stage, source)` with its events `evs` (oldest first); a trainer's
    /// last heartbeat fills in the weights store's size and bound.
    fn add(
        &mut self,
        (stage, source): &(String, String),
        evs: &[Event],
        weights: Option<&mut WeightsStatus>,
        now_us: u64,
    ) {
        let Some(last) = evs.last() else { return };
        let of_kind = |k: &str| -> Vec<&Event> { evs.iter().filter(|e| e.kind == k).collect() };
        let (beats, steps) = (of_kind("heartbeat"), of_kind("step"));
        self.losses
            .extend(of_kind("data_loss").into_iter().map(|e| DataLossStatus {
                stage: stage.clone(),
                source: source.clone(),
                what: e.text.clone().unwrap_or_default(),
                held: e.fields.get("held").map_or(0, |v| *v as u64),
                replayed: e.fields.get("replayed").map_or(0, |v| *v as u64),
                age_s: age_s(now_us, e.time_us),
            }));
        let role = Stage::from_name(stage);
        let (rate, rate_unit) = match role {
            Some(Stage::Gen) => (count_rate(&beats, "tokens"), "tok/s generated"),
            Some(Stage::Score) => (count_rate(&beats, "groups"), "groups/s scored"),
            Some(Stage::Train) => (step_rate(&steps, "tokens"), "tok/s trained"),
            _ => (None, ""),
        };
        match role {
            Some(Stage::Gen) => self.generated += rate.unwrap_or(0.0),
            Some(Stage::Score) => self.scored += rate.unwrap_or(0.0),
            Some(Stage::Train) => self.trained += rate.unwrap_or(0.0),
            _ => {}
        }
        if role == Some(Stage::Train)
            && let (Some(w), Some(b)) = (weights, beats.last())
        {
            let field = |k: &str| b.fields.get(k).map(|v| *v as u64);
            w.store_bytes = field("weights_store_bytes");
            w.max_bytes = field("weights_max_bytes");
        }
        let last_seen_s = age_s(now_us, last.time_us);
        self.processes.push(ProcessStatus {
            stage: stage.clone(),
            source: source.clone(),
            version: evs.iter().map(|e| e.version).max().unwrap_or(0),
            last_seen_s,
            silent: last_seen_s > SILENT_AFTER.as_secs_f64(),
            rate,
            rate_unit,
        });
        let newer = steps
            .last()
            .is_some_and(|s| self.trainer.as_ref().is_none_or(|t| t.version <= s.version));
        if newer && let Some(t) = trainer_status(source, &steps, now_us) {
            self.trainer = Some(t);
        }
    }
}

/// Reads a snapshot of the pipeline under `topo`'s namespace.
pub async fn collect(
    bus: &dyn Bus,
    topo: &Topology,
    bus_name: &str,
    window: Duration,
) -> Result<Status, BusError> {
    let now_us = schema::now_us();
    let mut streams = read_streams(bus, topo, now_us).await?;
    let mut events = EventsPart::default();
    for (process, evs) in &read_events(bus, topo, now_us, window).await? {
        events.add(process, evs, streams.weights.as_mut(), now_us);
    }
    Ok(Status {
        bus: bus_name.to_string(),
        namespace: topo.namespace.clone(),
        time_us: now_us,
        window_s: window.as_secs_f64(),
        memory_bytes: streams.streams.iter().map(|s| s.memory_bytes).sum(),
        budget_bytes: topo.budget(),
        archive_dir: topo.archive_dir.as_ref().map(|d| d.display().to_string()),
        streams: std::mem::take(&mut streams.streams),
        processes: events.processes,
        trainer: events.trainer,
        weights: streams.weights,
        dead_letters: streams.dead_letters,
        last_dead_letter: streams.last_dead_letter,
        data_losses: {
            let mut losses = events.losses;
            losses.sort_by(|a, b| b.age_s.total_cmp(&a.age_s));
            losses
        },
        generated_tokens_per_s: events.generated,
        scored_groups_per_s: events.scored,
        trained_tokens_per_s: events.trained,
    })
}

//! `rlstream status`: a running pipeline at a glance, from the bus alone.
//!
//! - every stream of the topology: length, and per consumer group the pending entries, the
//!   lag and each consumer's pending count and idle time (XINFO);
//! - every process that wrote an event in the window (`heartbeat` from each stage every
//!   2 s, `step` from the trainer): its stage, policy version, when it was last seen and its
//!   throughput over the window;
//! - the trainer's latest step and the newest published weights;
//! - the dead-letter count and the newest dead letter's reason.
//!
//! [`collect`] gathers a [`Status`] (serialisable, for `--json`); [`render`] draws it.

use crate::bus::{Bus, EntryId, RangeBound, Topology};
use crate::roles::{Stage, Stream};
use crate::schema::{self, DeadLetter, Event, StepRecord, WeightsAnnounce};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// Most events read for one snapshot (heartbeats and steps of the window).
const MAX_EVENTS: usize = 50_000;
/// A process whose newest event is older than this is shown as silent.
const SILENT_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Status {
    /// Where the pipeline runs: the Redis URL (without credentials) and namespace.
    pub bus: String,
    pub namespace: String,
    pub time_us: u64,
    /// Seconds of events the throughput and process list cover.
    pub window_s: f64,
    pub streams: Vec<StreamStatus>,
    /// Memory of every stream together, and the budget the topology's limits add up to
    /// (None when some stream has no limit).
    pub memory_bytes: u64,
    pub budget_bytes: Option<u64>,
    /// Where standing trims archive what they remove, if anywhere.
    pub archive_dir: Option<String>,
    pub processes: Vec<ProcessStatus>,
    pub trainer: Option<TrainerStatus>,
    pub weights: Option<WeightsStatus>,
    pub dead_letters: u64,
    pub last_dead_letter: Option<DeadLetterStatus>,
    /// Totals over the window: generated and trained tokens per second, scored groups per
    /// second.
    pub generated_tokens_per_s: f64,
    pub scored_groups_per_s: f64,
    pub trained_tokens_per_s: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StreamStatus {
    pub name: String,
    pub key: String,
    pub length: u64,
    /// Bus memory the stream takes (Redis `MEMORY USAGE`).
    pub memory_bytes: u64,
    /// Its standing memory limit (`trim_max_bytes`), if any.
    pub max_bytes: Option<u64>,
    pub groups: Vec<GroupStatus>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GroupStatus {
    pub name: String,
    pub pending: u64,
    /// None when Redis cannot tell.
    pub lag: Option<u64>,
    pub consumers: Vec<ConsumerStatus>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConsumerStatus {
    pub name: String,
    pub pending: u64,
    pub idle_s: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProcessStatus {
    pub stage: String,
    pub source: String,
    /// Policy version the process holds (0 for scorers, which hold none).
    pub version: u64,
    /// Seconds since its newest event.
    pub last_seen_s: f64,
    pub silent: bool,
    /// Over the window: tokens/s for gen (generated) and train (trained), groups/s for score.
    pub rate: Option<f64>,
    pub rate_unit: &'static str,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TrainerStatus {
    pub source: String,
    pub step: u64,
    pub version: u64,
    pub last_step_s: f64,
    pub reward_mean: f64,
    pub accuracy: f64,
    pub loss: f64,
    pub staleness_max: u64,
    pub steps_per_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WeightsStatus {
    pub version: u64,
    pub format: String,
    pub bytes: u64,
    /// Where the versions are stored (`redis`, `dir`, `memory`).
    pub store: String,
    /// The newest version's stored size (its delta's, for a delta).
    pub stored_bytes: u64,
    pub published_s: f64,
    /// What the versions occupy in their store and the bound (0: none), from the trainer's
    /// last heartbeat in the window.
    pub store_bytes: Option<u64>,
    pub max_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeadLetterStatus {
    pub source_stream: String,
    pub source_id: String,
    pub reason: String,
    pub error: String,
    pub age_s: f64,
}

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

/// Reads a snapshot of the pipeline under `topo`'s namespace.
pub async fn collect(
    bus: &dyn Bus,
    topo: &Topology,
    bus_name: &str,
    window: Duration,
) -> Result<Status, crate::bus::BusError> {
    let now_us = schema::now_us();
    let mut streams = Vec::new();
    let mut dead_letters = 0;
    let mut last_dead_letter = None;
    let mut weights = None;
    for name in topo.streams.keys() {
        let key = topo.key(name);
        let s = bus.stats(&key).await?;
        if key == topo.dead_key() {
            dead_letters = s.length;
            last_dead_letter =
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
        if name == "weights" {
            weights = newest::<WeightsAnnounce>(bus, &key, s.last_id)
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
        streams.push(StreamStatus {
            name: name.clone(),
            key,
            length: s.length,
            memory_bytes,
            max_bytes: topo.streams[name].trim_max_bytes,
            groups: s
                .groups
                .into_iter()
                .map(|g| GroupStatus {
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
                })
                .collect(),
        });
    }

    let from_ms = (now_us / 1000).saturating_sub(window.as_millis() as u64);
    let events: Vec<Event> = bus
        .range(
            &topo.key(Stream::Events),
            RangeBound::Inclusive(EntryId::new(from_ms, 0)),
            RangeBound::Open,
            MAX_EVENTS,
        )
        .await?
        .iter()
        .filter_map(|e| schema::decode::<Event>(&e.payload).ok())
        .collect();
    let mut by_source: BTreeMap<(String, String), Vec<&Event>> = BTreeMap::new();
    for e in &events {
        by_source
            .entry((e.stage.clone(), e.source.clone()))
            .or_default()
            .push(e);
    }
    let mut processes = Vec::new();
    let mut trainer: Option<TrainerStatus> = None;
    let (mut generated, mut scored, mut trained) = (0.0, 0.0, 0.0);
    for ((stage, source), evs) in &by_source {
        let Some(last) = evs.last() else { continue };
        let beats: Vec<&Event> = evs
            .iter()
            .copied()
            .filter(|e| e.kind == "heartbeat")
            .collect();
        let steps: Vec<&Event> = evs.iter().copied().filter(|e| e.kind == "step").collect();
        let role = Stage::from_name(stage);
        let (rate, rate_unit) = match role {
            Some(Stage::Gen) => (count_rate(&beats, "tokens"), "tok/s generated"),
            Some(Stage::Score) => (count_rate(&beats, "groups"), "groups/s scored"),
            Some(Stage::Train) => (step_rate(&steps, "tokens"), "tok/s trained"),
            _ => (None, ""),
        };
        match role {
            Some(Stage::Gen) => generated += rate.unwrap_or(0.0),
            Some(Stage::Score) => scored += rate.unwrap_or(0.0),
            Some(Stage::Train) => trained += rate.unwrap_or(0.0),
            _ => {}
        }
        if role == Some(Stage::Train)
            && let (Some(w), Some(b)) = (weights.as_mut(), beats.last())
        {
            let field = |k: &str| b.fields.get(k).map(|v| *v as u64);
            w.store_bytes = field("weights_store_bytes");
            w.max_bytes = field("weights_max_bytes");
        }
        let last_seen_s = age_s(now_us, last.time_us);
        processes.push(ProcessStatus {
            stage: stage.clone(),
            source: source.clone(),
            version: evs.iter().map(|e| e.version).max().unwrap_or(0),
            last_seen_s,
            silent: last_seen_s > SILENT_AFTER.as_secs_f64(),
            rate,
            rate_unit,
        });
        if let Some(s) = steps.last()
            && trainer.as_ref().is_none_or(|t| t.version <= s.version)
        {
            let record = match StepRecord::from_fields(&s.fields) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(source = %source, error = %e, "unreadable step event");
                    continue;
                }
            };
            trainer = Some(TrainerStatus {
                source: source.clone(),
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
            });
        }
    }
    Ok(Status {
        bus: bus_name.to_string(),
        namespace: topo.namespace.clone(),
        time_us: now_us,
        window_s: window.as_secs_f64(),
        memory_bytes: streams.iter().map(|s| s.memory_bytes).sum(),
        budget_bytes: topo.budget(),
        archive_dir: topo.archive_dir.as_ref().map(|d| d.display().to_string()),
        streams,
        processes,
        trainer,
        weights,
        dead_letters,
        last_dead_letter,
        generated_tokens_per_s: generated,
        scored_groups_per_s: scored,
        trained_tokens_per_s: trained,
    })
}

fn seconds(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// Bytes for humans, in binary units (`1.5 MiB`).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// The snapshot as a terminal table.
pub fn render(s: &Status) -> String {
    let mut o = String::new();
    let when = crate::time::utc(s.time_us);
    let _ = writeln!(
        o,
        "rlstream status  {}  namespace {}  {when}",
        s.bus, s.namespace
    );
    let _ = writeln!(o);
    let w = s
        .streams
        .iter()
        .map(|st| st.key.len())
        .max()
        .unwrap_or(0)
        .max(16);
    let _ = writeln!(
        o,
        "{:<w$} {:>9} {:>21}  {:<8} {:>8} {:>8}  CONSUMERS (pending, idle)",
        "STREAM", "LENGTH", "MEMORY / LIMIT", "GROUP", "PENDING", "LAG"
    );
    for st in &s.streams {
        let memory = format!(
            "{} / {}",
            bytes(st.memory_bytes),
            st.max_bytes.map_or("none".to_string(), bytes)
        );
        if st.groups.is_empty() {
            let _ = writeln!(
                o,
                "{:<w$} {:>9} {memory:>21}  {:<8} {:>8} {:>8}",
                st.key, st.length, "-", "", ""
            );
        }
        for (i, g) in st.groups.iter().enumerate() {
            let consumers = if g.consumers.is_empty() {
                "none".to_string()
            } else {
                g.consumers
                    .iter()
                    .map(|c| format!("{} ({}, {})", c.name, c.pending, seconds(c.idle_s)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let (key, len, mem) = if i == 0 {
                (st.key.as_str(), st.length.to_string(), memory.as_str())
            } else {
                ("", String::new(), "")
            };
            let lag = g.lag.map_or("?".to_string(), |l| l.to_string());
            let _ = writeln!(
                o,
                "{key:<w$} {len:>9} {mem:>21}  {:<8} {:>8} {lag:>8}  {consumers}",
                g.name, g.pending
            );
        }
    }
    let budget = match s.budget_bytes {
        Some(b) => format!(
            "{} of the {} budget ({:.1}%)",
            bytes(s.memory_bytes),
            bytes(b),
            100.0 * s.memory_bytes as f64 / b.max(1) as f64
        ),
        None => format!(
            "{} (no budget: a stream has no trim_max_bytes)",
            bytes(s.memory_bytes)
        ),
    };
    let archive = match &s.archive_dir {
        Some(d) => format!("trimmed entries are archived to {d}"),
        None => "trimmed entries are dropped (no --archive-dir)".to_string(),
    };
    let _ = writeln!(o, "streams take {budget}; {archive}");
    let _ = writeln!(o);
    if s.processes.is_empty() {
        let _ = writeln!(
            o,
            "no process wrote an event in the last {}: nothing is running under namespace `{}` \
             (or it runs under another --namespace)",
            seconds(s.window_s),
            s.namespace
        );
    } else {
        let _ = writeln!(
            o,
            "{:<6} {:<28} {:>8}  {:>16}  THROUGHPUT (last {})",
            "STAGE",
            "PROCESS",
            "VERSION",
            "LAST SEEN",
            seconds(s.window_s)
        );
        for p in &s.processes {
            let version = if p.stage == Stage::Score.as_str() {
                "-".to_string()
            } else {
                p.version.to_string()
            };
            let rate = p
                .rate
                .map_or("-".to_string(), |r| format!("{r:.1} {}", p.rate_unit));
            let seen = if p.silent {
                format!("{} SILENT", seconds(p.last_seen_s))
            } else {
                seconds(p.last_seen_s)
            };
            let _ = writeln!(
                o,
                "{:<6} {:<28} {version:>8}  {seen:>16}  {rate}",
                p.stage, p.source
            );
        }
    }
    let _ = writeln!(o);
    match &s.trainer {
        Some(t) => {
            let _ = writeln!(
                o,
                "trainer   step {} (version {}) {} ago; reward {:.3}, accuracy {:.3}, loss {:.4}, staleness max {}{}",
                t.step,
                t.version,
                seconds(t.last_step_s),
                t.reward_mean,
                t.accuracy,
                t.loss,
                t.staleness_max,
                t.steps_per_s
                    .map_or(String::new(), |r| format!(", {r:.2} steps/s"))
            );
        }
        None => {
            let _ = writeln!(o, "trainer   no step in the window");
        }
    }
    match &s.weights {
        Some(w) => {
            let stored = if w.stored_bytes == w.bytes {
                String::new()
            } else {
                format!(", stored as {:.2} MB", w.stored_bytes as f64 / 1e6)
            };
            let _ = writeln!(
                o,
                "weights   version {} published {} ago ({}, {:.1} MB{stored}) in {}",
                w.version,
                seconds(w.published_s),
                w.format,
                w.bytes as f64 / 1e6,
                w.store
            );
            if let Some(held) = w.store_bytes {
                let bound = match w.max_bytes {
                    Some(m) if m > 0 => format!(" of weights.max_bytes {:.1} MB", m as f64 / 1e6),
                    _ => " (no bound: weights.max_bytes = 0)".into(),
                };
                let _ = writeln!(
                    o,
                    "          the store holds {:.1} MB{bound}",
                    held as f64 / 1e6
                );
            }
        }
        None => {
            let _ = writeln!(o, "weights   none published yet");
        }
    }
    let _ = writeln!(
        o,
        "flow      {:.0} tok/s generated, {:.1} groups/s scored, {:.0} tok/s trained",
        s.generated_tokens_per_s, s.scored_groups_per_s, s.trained_tokens_per_s
    );
    match &s.last_dead_letter {
        Some(d) => {
            let _ = writeln!(
                o,
                "dead      {} entries; newest {} ago from {} {}: {} ({})",
                s.dead_letters,
                seconds(d.age_s),
                d.source_stream,
                d.source_id,
                d.reason,
                d.error
            );
        }
        None => {
            let _ = writeln!(o, "dead      {} entries", s.dead_letters);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::MemoryBus;
    use bytes::Bytes;

    fn event(
        kind: &str,
        stage: &str,
        source: &str,
        version: u64,
        t: u64,
        f: &[(&str, f64)],
    ) -> Bytes {
        let e = Event {
            schema: schema::SchemaVersion::CURRENT,
            kind: kind.into(),
            stage: stage.into(),
            source: source.into(),
            version,
            fields: f.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
            text: None,
            time_us: t,
        };
        Bytes::from(schema::encode(&e).expect("encode"))
    }

    #[tokio::test]
    async fn rates_versions_and_backlog_from_events_and_streams() {
        let bus = MemoryBus::new();
        let topo = Topology::default();
        let now = schema::now_us();
        let ev = topo.key(Stream::Events);
        let events = vec![
            event(
                "heartbeat",
                "gen",
                "g1",
                3,
                now - 4_000_000,
                &[("tokens", 100.0)],
            ),
            event(
                "heartbeat",
                "gen",
                "g1",
                4,
                now - 2_000_000,
                &[("tokens", 500.0)],
            ),
            event(
                "heartbeat",
                "score",
                "s1",
                0,
                now - 4_000_000,
                &[("groups", 10.0)],
            ),
            event(
                "heartbeat",
                "score",
                "s1",
                0,
                now - 2_000_000,
                &[("groups", 30.0)],
            ),
            event(
                "step",
                "train",
                "t1",
                4,
                now - 3_000_000,
                &[("step", 4.0), ("tokens", 50.0)],
            ),
            event(
                "step",
                "train",
                "t1",
                5,
                now - 1_000_000,
                &[("step", 5.0), ("tokens", 300.0), ("reward_mean", 0.5)],
            ),
        ];
        bus.publish(&ev, &events, None).await.expect("publish");
        let prompts = topo.key(Stream::Prompts);
        bus.create_group(&prompts, "gen", crate::bus::GroupStart::Beginning)
            .await
            .expect("group");
        bus.publish(&prompts, &vec![Bytes::from_static(b"x"); 5], None)
            .await
            .expect("publish");
        bus.read_group(&prompts, "gen", "g1", crate::bus::ReadFrom::New, 2, None)
            .await
            .expect("read");

        let s = collect(&bus, &topo, "memory", Duration::from_secs(60))
            .await
            .expect("status");
        let p = s
            .streams
            .iter()
            .find(|st| st.name == "prompts")
            .expect("prompts");
        assert_eq!(p.length, 5);
        assert_eq!(p.groups[0].pending, 2);
        assert_eq!(p.groups[0].lag, Some(3));
        assert_eq!(p.groups[0].consumers[0].name, "g1");
        // Five one-byte entries on the embedded bus, under the shipped 256 MiB limit.
        let each = 1 + MemoryBus::ENTRY_OVERHEAD;
        assert_eq!((p.memory_bytes, p.max_bytes), (5 * each, Some(256 << 20)));
        assert_eq!(s.budget_bytes, topo.budget());
        assert!(s.memory_bytes >= p.memory_bytes);
        // 400 tokens in 2 s; 20 groups in 2 s; 300 tokens (after the first step) in 2 s.
        assert!((s.generated_tokens_per_s - 200.0).abs() < 1e-6, "{s:?}");
        assert!((s.scored_groups_per_s - 10.0).abs() < 1e-6);
        assert!((s.trained_tokens_per_s - 150.0).abs() < 1e-6);
        let g = s.processes.iter().find(|p| p.stage == "gen").expect("gen");
        assert_eq!(g.version, 4);
        assert!(!g.silent);
        let t = s.trainer.as_ref().expect("trainer");
        assert_eq!((t.step, t.version), (5, 5));
        assert_eq!(t.reward_mean, 0.5);
        assert_eq!(s.dead_letters, 0);
        let text = render(&s);
        for want in [
            "rl:prompts",
            "g1 (2,",
            "200.0 tok/s generated",
            "step 5 (version 5)",
            &format!("{} B / 256.0 MiB", 5 * each),
            "GiB budget",
            "trimmed entries are dropped (no --archive-dir)",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[tokio::test]
    async fn the_weights_line_shows_the_store_and_its_bound() {
        let bus = MemoryBus::new();
        let topo = Topology::default();
        let now = schema::now_us();
        let mut a = schema::examples::weights_announce();
        a.published_us = now - 1_000_000;
        bus.publish(
            &topo.key(Stream::Weights),
            &[Bytes::from(schema::encode(&a).expect("encode"))],
            None,
        )
        .await
        .expect("publish");
        let beat = event(
            "heartbeat",
            "train",
            "t1",
            8,
            now - 500_000,
            &[
                ("step", 8.0),
                ("weights_store_bytes", 12_500_000.0),
                ("weights_max_bytes", 50_000_000.0),
            ],
        );
        bus.publish(&topo.key(Stream::Events), &[beat], None)
            .await
            .expect("publish");
        let s = collect(&bus, &topo, "memory", Duration::from_secs(60))
            .await
            .expect("status");
        let w = s.weights.as_ref().expect("weights");
        assert_eq!(
            (w.store_bytes, w.max_bytes),
            (Some(12_500_000), Some(50_000_000))
        );
        let text = render(&s);
        for want in [
            "weights   version 8",
            "(xor-zstd, 4.2 MB, stored as 0.08 MB) in redis",
            "the store holds 12.5 MB of weights.max_bytes 50.0 MB",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[tokio::test]
    async fn an_idle_namespace_says_so() {
        let bus = MemoryBus::new();
        let topo = Topology::default()
            .with_namespace("nothing-here")
            .expect("ns");
        let s = collect(&bus, &topo, "memory", Duration::from_secs(30))
            .await
            .expect("status");
        assert!(s.processes.is_empty() && s.trainer.is_none() && s.weights.is_none());
        assert!(render(&s).contains("nothing is running under namespace `nothing-here`"));
    }
}

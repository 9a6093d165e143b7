//! What `rlstream status` reports ([`Status`] and its parts, serialisable for `--json`),
//! and the units it shows durations and sizes in.

use serde::Serialize;

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
    /// Times, in the window, a consumer found Redis without its data and went on, oldest
    /// first.
    pub data_losses: Vec<DataLossStatus>,
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

/// A consumer that found Redis without its data (a `data_loss` event).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DataLossStatus {
    pub stage: String,
    pub source: String,
    /// The stream and group, and how the loss showed.
    pub what: String,
    /// Entries in the consumer's hand, and entries handed out again and dropped.
    pub held: u64,
    pub replayed: u64,
    pub age_s: f64,
}

pub(crate) fn seconds(s: f64) -> String {
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

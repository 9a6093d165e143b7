//! What every stage runs with: [`StageContext`] (the bus, the topology, the stage's role and
//! consumer name, the shutdown signal), from which a stage takes its typed consumers, its
//! heartbeat and its standing trim task; and [`StageError`], the one error a stage returns.
//! Nothing here names a stage's own types.

use crate::bus::{Bus, BusError, Consumer, ConsumerOptions, LossReport, SharedBus, Topology};
use crate::model::ModelError;
use crate::roles::{Stage, Stream};
use crate::schema::CodecError;
use crate::weights::WeightsError;
use std::future::Future;
use std::pin::Pin;

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Config(#[from] crate::settings::InvalidSetting),
    #[error(transparent)]
    Dataset(#[from] crate::tasks::DatasetError),
    /// A stage's own failure (its scorer, its checkpoints), kept whole: each stage's error
    /// types live in its folder and convert into this.
    #[error(transparent)]
    Own(Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot start the {what} thread: {source}")]
    Thread {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A task or thread of the stage panicked or was cancelled.
    #[error("{0}")]
    Panic(String),
    #[error("{0}")]
    Other(String),
    /// Trainer ranks stopped together: every rank has seen this error.
    #[error("{0}")]
    Ranks(String),
}

/// Entries of `stream` that the group its stage reads it through has not finished, from
/// XINFO: not yet delivered (lag), plus delivered but unacked when `count_pending`; the
/// whole stream while the group does not exist yet. 0 when the stream cannot be read (the
/// callers only pace with it).
///
/// Redis cannot report the lag of a group after it restarts from its append-only file,
/// until the group next reads to the end of the stream (a trainer that reads a step at a
/// time may never do so). The lag is then counted by reading the undelivered entries, at
/// most `cap` of them: callers that compare it with a bound pass the bound.
pub async fn waiting(
    bus: &dyn Bus,
    topo: &Topology,
    stream: Stream,
    count_pending: bool,
    cap: u64,
) -> u64 {
    let (key, group) = (topo.key(stream), topo.group(stream));
    let Ok(s) = bus.stats(&key).await else {
        return 0;
    };
    let Some(g) = s.groups.iter().find(|g| g.name == group) else {
        return s.length;
    };
    let lag = match g.lag {
        Some(lag) => lag,
        None => bus
            .range(
                &key,
                crate::bus::RangeBound::Exclusive(g.last_delivered),
                crate::bus::RangeBound::Open,
                cap as usize,
            )
            .await
            .map_or(0, |e| e.len() as u64),
    };
    lag + if count_pending { g.pending } else { 0 }
}

/// How often a stage writes a `heartbeat` event.
pub const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Writes `heartbeat` events (stage, consumer name, policy version, running counts) to the
/// events stream at most every [`HEARTBEAT_EVERY`]: `rlstream status` reads them to show each
/// process's version, liveness and throughput. A failed write is counted and logged, never
/// fatal: liveness reporting must not stop the work.
pub struct Heartbeat {
    bus: crate::bus::SharedBus,
    stream: String,
    max_len: Option<u64>,
    stage: Stage,
    source: String,
    last: Option<std::time::Instant>,
}

impl Heartbeat {
    pub fn new(bus: crate::bus::SharedBus, topo: &Topology, stage: Stage, source: &str) -> Self {
        crate::metrics::error_n(stage, "heartbeat", 0);
        Heartbeat {
            bus,
            stream: topo.key(Stream::Events),
            max_len: topo.max_len(Stream::Events),
            stage,
            source: source.to_string(),
            last: None,
        }
    }

    /// Writes a heartbeat if one is due.
    pub async fn beat(&mut self, version: u64, fields: &[(&str, f64)]) {
        if self.last.is_some_and(|t| t.elapsed() < HEARTBEAT_EVERY) {
            return;
        }
        self.last = Some(std::time::Instant::now());
        let event = crate::schema::Event {
            fields: fields.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
            ..crate::schema::Event::new("heartbeat", self.stage.as_str(), &self.source, version)
        };
        let written = match crate::schema::encode(&event) {
            Ok(b) => self
                .bus
                .publish(&self.stream, &[bytes::Bytes::from(b)], self.max_len)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = written {
            crate::metrics::error(self.stage, "heartbeat");
            tracing::warn!(error = %e, "cannot write a heartbeat event");
        }
    }
}

/// The newest policy version `stage`'s processes reported in their heartbeats over the last
/// `within` of the events stream (what live generators hold). Unlike the weights stream's
/// announces, this comes back within a heartbeat after Redis lost its data.
pub async fn held_version(
    bus: &dyn Bus,
    topo: &Topology,
    stage: Stage,
    within: std::time::Duration,
) -> Result<Option<u64>, BusError> {
    let key = topo.key(Stream::Events);
    let Some(last) = bus.stats(&key).await?.last_id else {
        return Ok(None);
    };
    let since = crate::bus::EntryId::new(last.ms.saturating_sub(within.as_millis() as u64), 0);
    let mut newest = None;
    crate::bus::scan(
        bus,
        &key,
        crate::bus::RangeBound::Inclusive(since),
        crate::bus::RangeBound::Open,
        |page| {
            for e in page {
                if let Ok(ev) = crate::schema::decode::<crate::schema::Event>(&e.payload)
                    && ev.kind == "heartbeat"
                    && ev.stage == stage.as_str()
                {
                    newest = newest.max(Some(ev.version));
                }
            }
            true
        },
    )
    .await?;
    Ok(newest)
}

/// A stage's shutdown signal: completes when the stage should finish what it holds and stop.
pub type Shutdown<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What a stage runs with.
pub struct StageContext<'a> {
    pub bus: SharedBus,
    pub topo: &'a Topology,
    pub stage: Stage,
    /// This process's name in its consumer group (and its heartbeats' source).
    pub name: String,
    shutdown: Shutdown<'a>,
}

impl<'a> StageContext<'a> {
    pub fn new(
        (stage, name): (Stage, &str),
        bus: SharedBus,
        topo: &'a Topology,
        shutdown: impl Future<Output = ()> + Send + 'a,
    ) -> Self {
        StageContext {
            bus,
            topo,
            stage,
            name: name.to_string(),
            shutdown: Box::pin(shutdown),
        }
    }

    /// Joins the consumer group the topology names for `stream`, as this stage's consumer,
    /// with the topology's dead-letter stream. (The future holds no borrow of the context,
    /// so a stage's future stays `Send`.)
    /// A loss of the stream's data is reported as this stage on the events stream.
    pub fn consumer<M: crate::schema::Message>(
        &self,
        stream: Stream,
        mut opts: ConsumerOptions,
    ) -> impl Future<Output = Result<Consumer<M>, BusError>> + Send + 'static {
        let (topo, bus, name) = (self.topo, self.bus.clone(), self.name.clone());
        opts.report = Some(LossReport::new(
            self.stage,
            stream,
            topo.key(Stream::Events),
            topo.max_len(Stream::Events),
        ));
        let (key, group, dead) = (
            topo.key(stream),
            topo.group(stream).to_string(),
            topo.dead_key(),
        );
        async move { Consumer::join(bus, key, group, name, dead, opts).await }
    }

    /// The stage's heartbeat writer.
    pub fn heartbeat(&self) -> Heartbeat {
        Heartbeat::new(self.bus.clone(), self.topo, self.stage, &self.name)
    }

    /// Marks the stage started (its metrics) and starts the standing trim policies of
    /// `streams` (see [`crate::retention::spawn_standing`]); the task runs while the handle
    /// lives.
    pub fn start(&self, streams: &[&str]) -> Option<crate::retention::Standing> {
        crate::metrics::started(self.stage);
        crate::retention::spawn_standing(self.bus.clone(), self.topo, streams, self.stage)
    }

    /// The shutdown signal, to poll in a `select!` (once it completed, not again).
    pub fn shutdown(&mut self) -> &mut Shutdown<'a> {
        &mut self.shutdown
    }
}

//! When Redis comes back without its data (it restarted without persistence, was flushed,
//! or a replica that lacked the last writes was promoted): what a [`Consumer`] does about
//! it, and how it tells the operator.
//!
//! A consumer notices a loss in one of two ways: its group is gone (`NOGROUP`, or a blocked
//! read whose stream was deleted under it), or its group hands out again entries it had
//! delivered before (a replica promoted before it had the group's last reads). By default
//! ([`OnDataLoss::Recover`]) it recreates its group, says so once in plain words (a log
//! line, a `data_loss` event on the events stream that `rlstream status` shows, the
//! `rlstream_bus_data_loss_total` counter) and goes on; entries handed out again are
//! dropped, since they were handled once. [`OnDataLoss::Stop`] stops the stage with
//! [`BusError::DataLost`] instead.
//!
//! [`Consumer`]: super::Consumer
//! [`BusError::DataLost`]: super::BusError::DataLost

use super::SharedBus;
use crate::roles::{Stage, Stream};
use crate::schema::{self, Event};
use bytes::Bytes;

/// What a consumer does when Redis lost the data of its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDataLoss {
    /// Recreate the group, report the loss, go on.
    #[default]
    Recover,
    /// Stop the stage with a message that says what was lost.
    Stop,
}

/// Where and as whom a consumer reports a loss.
#[derive(Debug, Clone)]
pub struct LossReport {
    /// The events stream's key and bound.
    pub events: String,
    pub max_len: Option<u64>,
    pub stage: Stage,
    /// What the loss means on this stream, and what to do about it.
    pub advice: &'static str,
}

impl LossReport {
    /// The report of a consumer of `stream` in `stage`.
    pub fn new(stage: Stage, stream: Stream, events: String, max_len: Option<u64>) -> Self {
        LossReport {
            events,
            max_len,
            stage,
            advice: advice(stream),
        }
    }

    /// Writes a `data_loss` event; a failure is logged, never fatal (the loss is already
    /// logged and counted).
    pub(super) async fn publish(&self, bus: &SharedBus, source: &str, what: &LossSeen) {
        let event = Event {
            fields: [
                ("held", what.held as f64),
                ("replayed", what.replayed as f64),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            text: Some(format!("{} {}: {}", what.stream, what.group, what.how)),
            ..Event::new("data_loss", self.stage.as_str(), source, 0)
        };
        let written = match schema::encode(&event) {
            Ok(b) => bus
                .publish(&self.events, &[Bytes::from(b)], self.max_len)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = written {
            tracing::warn!(error = %e, "cannot write the data_loss event");
        }
    }
}

/// What the loss of a stream costs, and the remedy, for the log line.
fn advice(stream: Stream) -> &'static str {
    match stream {
        Stream::Prompts => {
            "prompts that waited on the stream are gone: feed them again (`rlstream feed`); the trainer drops any group it already trained"
        }
        Stream::Rollouts => {
            "rollouts that waited to be scored are gone; the generators go on producing new ones"
        }
        Stream::Scored => {
            "scored groups that waited to be trained are gone; the trainer announces its weights again and goes on with new groups"
        }
        _ => "entries that waited on the stream are gone",
    }
}

/// One loss as a consumer saw it.
#[derive(Debug, Clone)]
pub struct LossSeen {
    pub stream: String,
    pub group: String,
    /// How it showed (the error, or the entries handed out again).
    pub how: String,
    /// Entries in the consumer's hand whose pending record is gone.
    pub held: u64,
    /// Entries handed out again and dropped.
    pub replayed: u64,
}

impl LossSeen {
    /// Logs, counts and reports the loss (`report` absent: logged and counted only).
    pub(super) async fn announce(
        &self,
        bus: &SharedBus,
        consumer: &str,
        report: Option<&LossReport>,
    ) {
        let advice = report.map_or("", |r| r.advice);
        tracing::warn!(
            stream = %self.stream, group = %self.group, consumer, held = self.held,
            replayed = self.replayed,
            "Redis lost the data of stream `{}` ({}): it came back without it (restarted \
             without persistence, flushed, or a replica without the last writes promoted). \
             The group is recreated and the stage goes on; {advice}. Set \
             redis_stop_on_data_loss to stop instead",
            self.stream, self.how
        );
        crate::metrics::data_loss(&self.stream, &self.group);
        crate::metrics::lost_entries(&self.stream, &self.group, "held", self.held);
        crate::metrics::lost_entries(&self.stream, &self.group, "replayed", self.replayed);
        if let Some(r) = report {
            r.publish(bus, consumer, self).await;
        }
    }
}

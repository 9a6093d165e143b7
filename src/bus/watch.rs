//! The XINFO poller behind the stream gauges (length, pending, lag, consumers).

use super::{SharedBus, Topology};
use crate::metrics::{
    STREAM_CONSUMERS, STREAM_LAG, STREAM_LENGTH, STREAM_PENDING, STREAM_POLL, error, error_n,
};
use crate::roles::Stage;
use metrics::gauge;

/// Reads length, pending, lag and consumers of every stream in `topo` every
/// [`STREAM_POLL`] into gauges, until the task is aborted. A read that fails is counted
/// (`errors_total{kind="xinfo"}`) and retried next round; the gauges keep their last value.
pub fn watch_streams(bus: SharedBus, topo: Topology, stage: Stage) -> tokio::task::JoinHandle<()> {
    error_n(stage, "xinfo", 0);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(STREAM_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for name in topo.streams.keys() {
                let key = topo.key(name);
                match bus.stats(&key).await {
                    Ok(s) => {
                        gauge!(STREAM_LENGTH, "stream" => key.clone()).set(s.length as f64);
                        for g in &s.groups {
                            let labels = [("stream", key.clone()), ("group", g.name.clone())];
                            gauge!(STREAM_PENDING, &labels).set(g.pending as f64);
                            // Redis cannot always tell the lag (after deletions inside
                            // the undelivered range): then the gauge keeps its last value.
                            if let Some(lag) = g.lag {
                                gauge!(STREAM_LAG, &labels).set(lag as f64);
                            }
                            gauge!(STREAM_CONSUMERS, &labels).set(g.consumers.len() as f64);
                        }
                    }
                    Err(e) => {
                        error(stage, "xinfo");
                        tracing::debug!(stream = %key, error = %e, "stream metrics: read failed");
                    }
                }
            }
        }
    })
}

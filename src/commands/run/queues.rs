//! The work waiting for each stage of a run, read off the bus.

use crate::bus::{SharedBus, Topology};
use crate::roles::Stream;
use crate::stages::waiting;

/// Most entries read to count a queue whose lag Redis cannot report (see
/// [`waiting`]); the report's queue columns stop there.
const QUEUE_SCAN_CAP: u64 = 1000;

/// Work waiting for each stage: prompts and rollouts not yet finished (lag + pending), scored
/// groups not yet delivered to the trainer (lag; the trainer keeps what it trained pending
/// until its checkpoint).
pub(crate) async fn queue_depths(bus: &SharedBus, topo: &Topology) -> [u64; 3] {
    let bus = bus.as_ref();
    [
        waiting(bus, topo, Stream::Prompts, true, QUEUE_SCAN_CAP).await,
        waiting(bus, topo, Stream::Rollouts, true, QUEUE_SCAN_CAP).await,
        waiting(bus, topo, Stream::Scored, false, QUEUE_SCAN_CAP).await,
    ]
}

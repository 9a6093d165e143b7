//! The stream bus: append-only streams with consumer groups, plus a small blob store for
//! weight chunks.
//!
//! [`Bus`] is the one interface every stage talks to. [`RedisBus`] is the real thing
//! (Redis streams: XADD, XREADGROUP, XACK, XAUTOCLAIM, XINFO); [`MemoryBus`] gives the same
//! consumer-group semantics in process for `rlstream run` and fast tests. The conformance
//! suite in `tests/integration/bus_conformance.rs` runs unchanged against both.
//!
//! Delivery is at-least-once: an entry read through a group stays pending until acked, and
//! an entry left pending longer than `claim_idle` is claimed by another consumer. Policy on
//! top of that (dead-lettering, delivery limits, decoding) lives in [`Consumer`].

mod consumer;
mod entry;
mod error;
mod interface;
mod loss;
mod memory;
mod redis;
mod resilient;
pub mod topology;
mod watch;

pub use consumer::{Consumer, ConsumerOptions, Delivery};
pub use entry::{Entry, EntryId, RangeBound};
pub use error::{BusError, BusResult, RetryHint};
pub use interface::{
    Bus, ConsumerStats, DeadLetterRecord, GroupStart, GroupStats, Pages, ReadFrom, SCAN_PAGE,
    SharedBus, StreamStats, scan,
};
pub use loss::{LossReport, OnDataLoss};
pub use memory::MemoryBus;
pub use redis::{RedisBus, RedisOptions, TlsFiles, redact_url};
pub use resilient::Resilient;
pub use topology::{Keep, StreamSpec, Topology, TopologyError};
pub use watch::watch_streams;

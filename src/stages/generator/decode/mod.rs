//! The decode thread: owns the batch (a [`Generator`]), loads the current model from the
//! slot before every forward pass (one atomic load, timed as the swap stall), admits work
//! from its row sources while rows are free, and hands each source back what became of its
//! rows. A forward pass that panics is bisected to the requests that caused it.
//!
//! What feeds rows is behind one interface, [`RowSource`] (`source.rs`): the stream's
//! prompts (`prompts.rs`), the environments' episodes (`episodes.rs`, sharing the groups
//! and reads of `group.rs`) and the endpoint's calls (`calls.rs`). Each has an inbox of its
//! own; every sender rings one [`Doorbell`] (`inbox.rs`) that an idle loop sleeps on.

pub mod calls;
pub mod episodes;
pub mod group;
pub mod inbox;
pub mod kept;
pub mod prompts;
pub mod source;
#[cfg(test)]
mod tests;
mod text;

pub use inbox::Doorbell;
pub use source::{DecodeStats, Panicked, RowSource, Rows, Waiting};

use crate::model::fault;
use crate::model::sampler::{Completion, Generator};
use crate::model::{InferBackend, ModelError};
use crate::weights::{ModelSlot, Versioned};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long the idle decode thread waits for work before checking for shutdown.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// How long an idle decoder that got work still arriving (the first prompts of a read)
/// waits for the rest before its first forward pass. The reader hands a read's prompts over
/// one by one, with admission checks between them; waiting for the read's end makes a batch
/// that starts from idle (every step of a `--sync` run) the same whatever the threads'
/// timing, so its bits repeat. A reader held up inside a read (the in-flight bound) ends
/// the wait.
const READ_WAIT: Duration = Duration::from_millis(500);

/// The decode loop's state.
pub struct Decoder {
    name: String,
    max_batch: usize,
    slot: ModelSlot<InferBackend>,
    generator: Generator<InferBackend>,
    /// In the order they are admitted from on every pass.
    sources: Vec<Box<dyn RowSource>>,
    bell: Arc<Doorbell>,
    next_id: u64,
    last_version: u64,
    stats: DecodeStats,
}

impl Decoder {
    /// A loop named `name` decoding at most `max_batch` rows with the model in `slot`, fed
    /// by `sources` (admitted from in this order) whose senders ring `bell`.
    pub fn new(
        name: &str,
        max_batch: usize,
        slot: ModelSlot<InferBackend>,
        sources: Vec<Box<dyn RowSource>>,
        bell: Arc<Doorbell>,
    ) -> Self {
        Decoder {
            name: name.to_string(),
            max_batch,
            last_version: slot.load().version,
            slot,
            generator: Generator::new(),
            sources,
            bell,
            next_id: 0,
            stats: DecodeStats::default(),
        }
    }

    /// Runs the loop on a thread of its own (named after the generator).
    pub fn spawn(
        self,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<std::thread::JoinHandle<Result<DecodeStats, ModelError>>> {
        std::thread::Builder::new()
            .name(format!("{}-decode", self.name))
            .spawn(move || self.run(&stop))
    }

    /// Runs until `stop` is set or a source's results have nowhere to go. Work the model
    /// cannot run goes back to its source; only a failure that no one request explains (a
    /// tensor that cannot reach the host) stops the loop.
    pub fn run(mut self, stop: &AtomicBool) -> Result<DecodeStats, ModelError> {
        while !stop.load(Ordering::Relaxed) {
            if !self.wait_for_work() {
                continue;
            }
            let current = self.current_model();
            let mut rows = Rows {
                generator: &mut self.generator,
                model: &current,
                stats: &mut self.stats,
                next_id: &mut self.next_id,
                max_batch: self.max_batch,
            };
            for s in &mut self.sources {
                s.prepare(&mut rows)?;
            }
            for s in &mut self.sources {
                s.admit(&mut rows)?;
            }
            if self.generator.active() > 0 {
                self.step(&current)?;
            } else {
                let done = self.generator.take_done();
                self.hand_back(&current, done);
            }
            for s in &mut self.sources {
                s.after_pass();
            }
            if self.sources.iter().any(|s| s.closed()) {
                break;
            }
        }
        Ok(self.stats)
    }

    fn receive(&mut self) {
        for s in &mut self.sources {
            s.receive();
        }
    }

    fn any(&self, w: source::Waiting) -> bool {
        self.sources.iter().any(|s| s.waiting() == w)
    }

    /// With no row decoding and nothing waiting, waits for work *before* the model is
    /// loaded, so the first work after a pause starts on the newest weights; then for the
    /// rest of work still arriving ([`READ_WAIT`]). Whether there is anything to do.
    fn wait_for_work(&mut self) -> bool {
        let quiet = self.generator.active() == 0
            && !self.any(Waiting::Arriving)
            && !self.any(Waiting::Ready);
        if !quiet {
            self.receive();
            return true;
        }
        let idle = Instant::now();
        self.bell.wait(IDLE_WAIT);
        self.receive();
        while self.any(Waiting::Arriving) && !self.any(Waiting::Ready) && self.bell.wait(READ_WAIT)
        {
            self.receive();
        }
        self.stats.idle_s += idle.elapsed().as_secs_f64();
        !(self.generator.is_idle()
            && self
                .sources
                .iter()
                .all(|s| s.waiting() == Waiting::Nothing && !s.busy()))
    }

    /// The model for the next pass; a newer one than the last pass counts as a swap.
    fn current_model(&mut self) -> Arc<Versioned<InferBackend>> {
        let t0 = Instant::now();
        let current = self.slot.load();
        let stall = t0.elapsed().as_secs_f64();
        if current.version != self.last_version {
            self.stats.swaps += 1;
            self.stats.swap_stalls.push(stall);
            self.last_version = current.version;
            crate::metrics::swapped(current.version, stall);
        }
        current
    }

    /// The source that started `request`.
    fn owner(sources: &mut [Box<dyn RowSource>], request: u64) -> Option<&mut dyn RowSource> {
        sources
            .iter_mut()
            .find(|s| s.owns(request))
            .map(|s| &mut **s as &mut dyn RowSource)
    }

    /// Hands each source what became of its rows: the tokens drawn for watched rows, then
    /// the finished completions `done`, then the episode turns that ended.
    fn hand_back(&mut self, current: &Versioned<InferBackend>, done: Vec<Completion>) {
        let mut rows = Rows {
            generator: &mut self.generator,
            model: current,
            stats: &mut self.stats,
            next_id: &mut self.next_id,
            max_batch: self.max_batch,
        };
        for d in rows.generator().take_drawn() {
            if let Some(s) = Self::owner(&mut self.sources, d.request_id) {
                s.drawn(&mut rows, d);
            }
        }
        for c in done {
            rows.count(&c);
            if let Some(s) = Self::owner(&mut self.sources, c.request_id) {
                s.finished(&mut rows, c);
            }
        }
        for t in rows.generator().take_turns() {
            if let Some(s) = Self::owner(&mut self.sources, t.request_id) {
                s.turn_ended(&mut rows, t);
            }
        }
    }

    /// One forward pass over every active row, its results handed back. A pass that panics
    /// is discarded and its rows are re-run one at a time: the requests whose rows panic
    /// alone fail, the others go on (see [`fault`]).
    fn step(&mut self, current: &Versioned<InferBackend>) -> Result<(), ModelError> {
        let busy = Instant::now();
        let before = self.generator.snapshot();
        let requests = self.generator.row_requests();
        let pass = fault::contain(|| {
            fault::inject(self.labels(&requests));
            self.generator.forward(&current.policy)
        });
        self.stats.steps += 1;
        let host = match pass {
            Ok(host) => host?,
            Err(panic) => {
                self.generator.restore(before);
                self.culprits(current, &requests, &panic);
                self.stats.busy_s += busy.elapsed().as_secs_f64();
                self.hand_back(current, Vec::new());
                return Ok(());
            }
        };
        let vocab = current.policy.config().vocab_size;
        let done = self
            .generator
            .sample(host.as_deref().unwrap_or(&[]), current.version, vocab);
        let took = busy.elapsed();
        tracing::trace!(
            rows = requests.len(),
            ms = took.as_millis() as u64,
            "decode pass"
        );
        self.stats.busy_s += took.as_secs_f64();
        self.hand_back(current, done);
        Ok(())
    }

    /// The message ids `requests` came from.
    fn labels<'a>(&'a self, requests: &'a [u64]) -> impl Iterator<Item = &'a str> + 'a {
        requests
            .iter()
            .filter_map(|&r| self.sources.iter().find_map(|s| s.label(r)))
    }

    /// After a batched pass panicked with `panic`: re-runs each row alone and fails the
    /// requests whose rows panic. When no row panics alone, the batch as a whole is the
    /// culprit and every request in it fails, so the same pass cannot panic forever.
    fn culprits(&mut self, current: &Versioned<InferBackend>, requests: &[u64], panic: &str) {
        let mut bad: Vec<u64> = Vec::new();
        for (i, &r) in requests.iter().enumerate() {
            if bad.contains(&r) {
                continue;
            }
            let alone = fault::contain(|| {
                fault::inject(self.labels(std::slice::from_ref(&r)));
                self.generator.probe_row(&current.policy, i)
            });
            if alone.is_err() {
                bad.push(r);
            }
        }
        let alone = !bad.is_empty();
        if !alone {
            bad = requests.to_vec();
            bad.dedup();
        }
        tracing::error!(
            panic,
            requests = bad.len(),
            alone,
            "a forward pass panicked; failing the requests that caused it"
        );
        let how = Panicked {
            message: panic,
            alone,
        };
        for r in bad {
            self.generator.drop_request(r);
            if let Some(s) = Self::owner(&mut self.sources, r) {
                s.panicked(r, &how);
            }
        }
    }
}

//! What feeds rows to the decode loop: the [`RowSource`] interface, and [`Rows`], what a
//! source may do to the batch while the loop lends it.
//!
//! The loop owns the batch (a [`Generator`]), the model and the order of a pass; a source
//! owns its requests. Each request id belongs to the source that started it, and the loop
//! hands back to that source what becomes of its rows: each token drawn for watched rows,
//! each finished completion, each ended episode turn, and a forward pass that panicked.

use crate::model::ModelError;
use crate::model::fault;
use crate::model::sampler::{Completion, Drawn, Generator, Turn};
use crate::model::{InferBackend, Policy};
use crate::schema::FinishReason;
use crate::weights::Versioned;
use std::time::Instant;

/// What the decode thread measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeStats {
    pub steps: u64,
    pub tokens: u64,
    /// Forward passes that ran on a newer model than the previous pass.
    pub swaps: u64,
    /// Time to pick up the current model before each pass, per swap (seconds).
    pub swap_stalls: Vec<f64>,
    /// Seconds waiting for a prompt with no row to decode, and seconds in forward passes
    /// (prefill and decode).
    pub idle_s: f64,
    pub busy_s: f64,
}

/// What a source has waiting for rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    Nothing,
    /// Work whose batch is still arriving (the rest of a read): a loop that was idle waits
    /// a little for it before its first pass, so that pass is the same whatever the threads'
    /// timing.
    Arriving,
    /// Work to start now.
    Ready,
}

/// A forward pass that panicked over a source's rows (see [`crate::model::fault`]).
pub struct Panicked<'a> {
    pub message: &'a str,
    /// Whether the source's rows panicked alone too; else no row did and the whole batch
    /// failed.
    pub alone: bool,
}

/// The batch, lent to a source for one call.
pub struct Rows<'a> {
    pub(super) generator: &'a mut Generator<InferBackend>,
    pub(super) model: &'a Versioned<InferBackend>,
    pub(super) stats: &'a mut DecodeStats,
    pub(super) next_id: &'a mut u64,
    pub(super) max_batch: usize,
}

impl Rows<'_> {
    /// Whether `n` more rows fit in the batch.
    pub fn fit(&self, n: usize) -> bool {
        self.generator.active() + n <= self.max_batch
    }

    /// A request id no other request has.
    pub fn new_request(&mut self) -> u64 {
        let id = *self.next_id;
        *self.next_id += 1;
        id
    }

    pub fn generator(&mut self) -> &mut Generator<InferBackend> {
        self.generator
    }

    /// Runs `f` on the batch and the model (a prefill), timed as busy, with a panic
    /// contained as its message.
    pub fn prefill<T>(
        &mut self,
        f: impl FnOnce(&mut Generator<InferBackend>, &Policy<InferBackend>, u64) -> T,
    ) -> Result<T, String> {
        let t0 = Instant::now();
        let (generator, model) = (&mut *self.generator, self.model);
        let out = fault::contain(|| f(generator, &model.policy, model.version));
        self.stats.busy_s += t0.elapsed().as_secs_f64();
        out
    }

    /// Counts a completion's tokens as decoded.
    pub fn count(&mut self, c: &Completion) {
        self.stats.tokens += c.tokens.len() as u64;
    }
}

/// Something that feeds rows to the decode loop: the stream's prompts, the endpoint's
/// calls, the environments' episodes. The loop calls it, in this order, on every pass:
/// [`receive`](Self::receive), [`prepare`](Self::prepare), [`admit`](Self::admit), then,
/// for each of its requests, what became of their rows, then [`after_pass`](Self::after_pass).
pub trait RowSource: Send {
    /// Takes what arrived in its inbox, without waiting.
    fn receive(&mut self);

    /// What it has waiting for rows.
    fn waiting(&self) -> Waiting;

    /// Whether it holds requests (decoding, or parked outside the batch).
    fn busy(&self) -> bool;

    /// Before admission: drops what was abandoned, resumes what was parked.
    fn prepare(&mut self, _rows: &mut Rows<'_>) -> Result<(), ModelError> {
        Ok(())
    }

    /// Starts waiting work while its rows fit.
    fn admit(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError>;

    /// Whether `request` is one of its own.
    fn owns(&self, request: u64) -> bool;

    /// The message id `request` came from, for fault injection ([`fault::inject`]).
    fn label(&self, _request: u64) -> Option<&str> {
        None
    }

    /// A token drawn for one of its watched rows.
    fn drawn(&mut self, _rows: &mut Rows<'_>, _drawn: Drawn) {}

    /// One of its rows finished (its tokens are already counted).
    fn finished(&mut self, rows: &mut Rows<'_>, completion: Completion);

    /// A model turn of one of its episode rows ended; the default ends the row there.
    fn turn_ended(&mut self, rows: &mut Rows<'_>, turn: Turn) {
        let ended = rows
            .generator()
            .end(turn.request_id, turn.index, None, FinishReason::Length);
        if let Some(c) = ended {
            rows.count(&c);
            self.finished(rows, c);
        }
    }

    /// A forward pass over `request`'s rows panicked; its rows are already dropped.
    fn panicked(&mut self, request: u64, how: &Panicked<'_>);

    /// After the pass: reports what it holds.
    fn after_pass(&mut self) {}

    /// Whether whoever takes its results is gone, so the loop should stop.
    fn closed(&self) -> bool {
        false
    }
}

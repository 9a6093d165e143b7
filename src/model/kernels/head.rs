//! The output head's chunking: how many rows of logits exist at once when the trainer (and
//! everything that scores completions: the teacher, `sft`) takes log-probs, and a record of
//! the widest logits any pass built, which tests read.
//!
//! A completion token's log-prob needs its row of logits `[vocabulary]`; the trainer's
//! batch needs one per token. At a 151,936-id vocabulary, 8 × 1,024 tokens of logits are
//! 5.0 GB of f32 before their gradient. [`Kernels::head_logprobs`](super::Kernels) runs the
//! head and the log-prob over [`HEAD_CHUNK_ROWS`] rows at a time and recomputes each
//! chunk's logits in the backward, so the head's activation memory is one chunk's
//! (`HEAD_CHUNK_ROWS × vocabulary`: 311 MB at 151,936 ids), whatever the batch. Up to one
//! chunk of rows the logits are kept for the backward instead (no recompute: a step of
//! short completions pays nothing for the bound).
//!
//! Each row's logits are the decode step's (the linear kernel sums every output in a
//! fixed order whatever the rows around it), and each log-prob runs over the whole row in
//! one pass ([`token_logprob`](super::token_logprob)): chunking rows leaves every value bit
//! for bit as it was, which keeps the sampler's and the trainer's log-probs equal.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Rows of logits one chunk of the head holds.
pub const HEAD_CHUNK_ROWS: usize = 512;

static WIDEST: AtomicUsize = AtomicUsize::new(0);

/// Notes that logits were built for `rows` rows at once.
pub(crate) fn note_logits(rows: usize) {
    WIDEST.fetch_max(rows, Ordering::Relaxed);
}

/// The most rows of logits built at once in this process since [`reset_widest_logits`]
/// (every head product goes through the policy's head or the chunked log-prob kernel,
/// which note it).
pub fn widest_logits() -> usize {
    WIDEST.load(Ordering::Relaxed)
}

pub fn reset_widest_logits() {
    WIDEST.store(0, Ordering::Relaxed);
}

/// The chunks `0..n` splits into, `chunk` rows each (the last one shorter).
pub(crate) fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let chunk = chunk.max(1);
    (0..n.div_ceil(chunk)).map(move |c| c * chunk..((c + 1) * chunk).min(n))
}

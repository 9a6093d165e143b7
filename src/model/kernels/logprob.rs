//! The one definition of a token's log-prob under a tempered, truncated distribution, and
//! the sets of ids a truncation kept.

use super::exp::exp_in_place;

/// Additive attention bias for masked positions. Finite, so a fully masked row (never
/// produced here) would not turn into NaN, and gradients stay clean.
pub(crate) const MASKED: f32 = -1e9;

/// Whether log-probs at `temperature` are of the logits divided by it: not at 1, and not
/// when it is not positive (greedy decoding records log-probs of the unscaled distribution).
pub(crate) fn tempered(temperature: f32) -> bool {
    temperature > 0.0 && temperature != 1.0
}

/// The factor the native kernels multiply the logits by: `1 / temperature` where
/// [`tempered`], else 1.
pub(crate) fn inv_temperature(temperature: f32) -> f32 {
    if tempered(temperature) {
        1.0 / temperature
    } else {
        1.0
    }
}

/// The ids each row's log-prob is renormalised over: a sampling mask's kept set (top-k,
/// top-p), or for a row without one (an untruncated draw, an episode's environment token)
/// the whole vocabulary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kept {
    /// Row `i`'s ids are `ids[offsets[i]..offsets[i + 1]]`, ascending; none: the vocabulary.
    offsets: Vec<usize>,
    ids: Vec<u32>,
}

impl Kept {
    /// `rows` rows over the whole vocabulary.
    pub fn whole(rows: usize) -> Self {
        Kept {
            offsets: vec![0; rows + 1],
            ids: Vec::new(),
        }
    }

    /// One row per set (an empty one: the whole vocabulary); each set's ids sorted.
    pub fn of<'a>(sets: impl IntoIterator<Item = &'a [u32]>) -> Self {
        let mut kept = Kept {
            offsets: vec![0],
            ids: Vec::new(),
        };
        for set in sets {
            let at = kept.ids.len();
            kept.ids.extend_from_slice(set);
            kept.ids[at..].sort_unstable();
            kept.offsets.push(kept.ids.len());
        }
        kept
    }

    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Row `i`'s kept ids, ascending; empty for the whole vocabulary.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.ids[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Rows `rows` as a set of their own (row `rows.start` first).
    pub fn range(&self, rows: std::ops::Range<usize>) -> Kept {
        Kept::of(rows.map(|i| self.row(i)))
    }

    /// Whether any row is renormalised over fewer ids than the vocabulary.
    pub fn any(&self) -> bool {
        !self.ids.is_empty()
    }
}

/// What the chunked output head ([`Kernels::head_logprobs`](super::Kernels)) scores each
/// row against: its target id, the temperature, its kept ids, and the rows one chunk holds.
#[derive(Debug, Clone, Copy)]
pub struct HeadTargets<'a> {
    pub targets: &'a [u32],
    pub temperature: f32,
    pub kept: &'a Kept,
    pub chunk: usize,
}

/// The log-prob of `target` under `softmax(row · k)` renormalised over `kept` (ascending
/// ids; empty: the whole vocabulary), with `k` = [`inv_temperature`], and that log-sum-exp.
///
/// The one definition of a token's log-prob: the sampler records it as the behaviour
/// log-prob, and the trainer's kernel ([`Kernels::token_logprobs`] on the CPU) computes
/// it row by row, so with the same logits the two agree bit for bit. The maximum and the
/// sum of exponentials run in f32 over the ids in ascending order.
pub fn token_logprob(row: &[f32], target: usize, temperature: f32, kept: &[u32]) -> (f32, f32) {
    let k = inv_temperature(temperature);
    let mut max = f32::NEG_INFINITY;
    let sum = if kept.is_empty() {
        row.iter().for_each(|&z| max = max.max(z * k));
        sum_exp(row.iter().map(|&z| z * k - max))
    } else {
        let at = |i: &u32| row.get(*i as usize).copied().unwrap_or(f32::NEG_INFINITY);
        kept.iter().for_each(|i| max = max.max(at(i) * k));
        sum_exp(kept.iter().map(|i| at(i) * k - max))
    };
    let lse = max + sum.ln();
    (
        row.get(target).copied().unwrap_or(f32::NEG_INFINITY) * k - lse,
        lse,
    )
}

/// `Σ e^v` over `values`, added in their order; the exponentials are taken a block at a
/// time ([`exp_in_place`]).
fn sum_exp(values: impl Iterator<Item = f32>) -> f32 {
    let (mut block, mut values, mut sum) = ([0f32; 256], values, 0f32);
    loop {
        let mut n = 0;
        // `zip` asks the block for a slot first, so no value is drawn and dropped.
        for (slot, v) in block.iter_mut().zip(&mut values) {
            *slot = v;
            n += 1;
        }
        exp_in_place(&mut block[..n]);
        block[..n].iter().for_each(|e| sum += e);
        if n < block.len() {
            return sum;
        }
    }
}

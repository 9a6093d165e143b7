//! Rows whose KV cache outlives them. A watched row admitted with [`Watch::keep`] leaves
//! its cache behind when it finishes
//! ([`Generator::take_kept`](super::Generator::take_kept)); a later request whose prompt
//! extends exactly the ids that cache holds continues from it
//! ([`Generator::admit_continued`](super::Generator::admit_continued)), prefilling only
//! its new tokens, as a parked episode row resumes. A cache is kept only when one weights
//! version computed all of it, and it is continued only under that version, so every
//! token is sampled with the log-prob a fresh prefill under that version gives, bit for
//! bit.

use crate::model::Kernels;
use crate::model::llama::KvCache;
use burn::tensor::backend::Backend;

/// How a watched request's rows are reported, and whether the first is kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Watch {
    /// The likeliest ids listed beside each drawn token
    /// ([`alternatives`](crate::model::draw::alternatives)).
    pub alternatives: usize,
    /// Whether row 0 leaves its cache behind when it finishes.
    pub keep: bool,
}

/// A finished row's KV cache (one row, no padding), the ids it holds (the prompt and every
/// completion token but the last, which no pass has fed), and the version whose weights
/// computed all of it.
pub struct KeptCache<B: Backend> {
    pub cache: KvCache<B>,
    pub ids: Vec<u32>,
    pub version: u64,
}

impl<B: Backend> KeptCache<B> {
    /// The bytes its keys and values take (f32).
    pub fn bytes(&self) -> usize {
        self.cache
            .layers
            .iter()
            .map(|(k, v)| (k.shape().num_elements() + v.shape().num_elements()) * 4)
            .sum()
    }
}

impl<B: Kernels> KeptCache<B> {
    /// Row `i` of `cache`, holding `ids` as one `version` computed them: `None` when the
    /// row's positions are not exactly those ids.
    pub(super) fn row(cache: &KvCache<B>, i: usize, ids: Vec<u32>, version: u64) -> Option<Self> {
        let mut own = cache.clone();
        own.keep_rows(&[i]);
        (own.next_positions() == [ids.len()]).then_some(KeptCache {
            cache: own,
            ids,
            version,
        })
    }

    /// Whether a request on `prompt` at `version` may continue this cache: the same
    /// weights computed it, and the prompt extends its ids by at least one token.
    pub(super) fn continued_by(&self, prompt: &[u32], version: u64) -> bool {
        let held = self.ids.len();
        self.version == version && prompt.len() > held && prompt[..held] == self.ids[..]
    }
}

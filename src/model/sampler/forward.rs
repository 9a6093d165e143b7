//! The forward passes the generator runs and their host copies: a decode step over the
//! batch, one prompt or feed onto a cache, and prompts prefilled together in passes of
//! similar lengths.

use super::Request;
use crate::model::llama::{AttnMode, KvCache, Policy};
use crate::model::moe::Routes;
use crate::model::{Kernels, ModelError};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// Host copy of logits `[rows, vocab]`.
pub(super) fn logits_rows<B: Backend>(logits: Tensor<B, 2>) -> Result<Vec<f32>, ModelError> {
    crate::model::host_f32(logits.into_data())
}

/// One decode step of the rows of `cache`, each feeding its token of `last`, over
/// `cache`, which it extends: the host logits `[rows, vocab]`, and for an MoE model the
/// experts each row's token ran through (`[rows, layers, k]`).
pub(super) fn decode_pass<B: Kernels>(
    model: &Policy<B>,
    cache: &mut KvCache<B>,
    last: Vec<i64>,
) -> Result<(Vec<f32>, Option<Vec<u16>>), ModelError> {
    let b = last.len();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(last, [b, 1]), &model.device());
    let positions = cache.next_positions();
    let mut routes = recording(model);
    let logits = model.forward_routed(tokens, &positions, AttnMode::Cached(cache), &mut routes);
    let host = logits_rows(logits.reshape([b, model.config().vocab_size]))?;
    Ok((host, routes.record.then_some(routes.used)))
}

/// Feeds `feed` (one row, from position `start`) onto `cache`: the host logits of its last
/// position, and for an MoE model the experts of every fed token (`[feed, layers, k]`).
/// Only the last position goes through the LM head, not the whole feed (at a 151,936-id
/// vocabulary, 35 GFLOP saved per 128-token prompt).
pub(super) fn prefill<B: Kernels>(
    model: &Policy<B>,
    cache: &mut KvCache<B>,
    feed: &[u32],
    start: usize,
) -> Result<(Vec<f32>, Option<Vec<u16>>), ModelError> {
    let l = feed.len();
    let ids: Vec<i64> = feed.iter().map(|&t| i64::from(t)).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, l]), &model.device());
    let positions: Vec<usize> = (start..start + l).collect();
    let mut routes = recording(model);
    let hidden = model.trunk_routed(tokens, &positions, AttnMode::Cached(cache), &mut routes);
    let d = model.config().hidden_size;
    let last = model.project(hidden.slice([0..1, l - 1..l]).reshape([1, d]));
    let host = logits_rows(last.reshape([1, model.config().vocab_size]))?;
    Ok((host, routes.record.then_some(routes.used)))
}

/// Most prompt tokens (padding included) one pass of [`Generator::admit_all`] prefills.
pub const PREFILL_TOKENS: usize = 8192;

/// A prompt prefilled: the host logits of its last position, its cache (one row), and
/// for an MoE model the experts of each of its tokens.
pub(super) struct Prefilled<B: Backend> {
    pub last: Vec<f32>,
    pub cache: KvCache<B>,
    pub routes: Option<Vec<u16>>,
}

/// `req`'s prompt as the model will read it (its BOS when empty), or the refusal when
/// the model cannot take it.
pub(super) fn checked_prompt<B: Kernels>(
    model: &Policy<B>,
    req: &Request,
) -> Result<Vec<u32>, ModelError> {
    model
        .config()
        .limits()
        .prompt("prompt", &req.prompt)
        .map_err(ModelError::Refused)?;
    Ok(if req.prompt.is_empty() {
        vec![model.config().bos_token_id.unwrap_or(0)]
    } else {
        req.prompt.clone()
    })
}

/// What a pass costs beyond its tokens, in prompt tokens: every pass reads all the
/// weights once and walks every layer, which took as long as the products of about 40
/// prompt tokens in a 0.5B model's prefill on a 2-core AVX-512 CPU (one pass of 238 tokens
/// against two of 224). A token costs two FLOPs per weight and reading a weight four bytes,
/// so the ratio hardly moves with the model's size.
const PASS_TOKENS: usize = 48;

/// `order` (indices by ascending length) cut into passes, each at most [`PREFILL_TOKENS`]
/// tokens once padded to its longest prompt (a lone prompt longer than that is a pass
/// alone): of those cuts, the one with the fewest padded tokens plus [`PASS_TOKENS`] a
/// pass. Prompts of 6 to 9 tokens go in one pass; prompts of 3 and of 300 in two.
pub(super) fn passes(order: &[usize], len: impl Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let lens: Vec<usize> = order.iter().map(|&i| len(i)).collect();
    // best[i]: the least cost of the first `i` prompts, and where its last pass starts.
    let mut best = vec![(0usize, 0usize); lens.len() + 1];
    for i in 1..=lens.len() {
        let longest = lens[i - 1];
        best[i] = (usize::MAX, i - 1);
        for j in (0..i).rev() {
            let padded = (i - j) * longest;
            // Starting earlier only adds tokens.
            if i - j > 1 && padded > PREFILL_TOKENS {
                break;
            }
            let cost = best[j].0.saturating_add(PASS_TOKENS + padded);
            if cost < best[i].0 {
                best[i] = (cost, j);
            }
        }
    }
    let mut out = Vec::new();
    let mut i = lens.len();
    while i > 0 {
        let j = best[i].1;
        out.push(order[j..i].to_vec());
        i = j;
    }
    out.reverse();
    out
}

/// Feeds every prompt of `feeds` from position 0 in one pass, each row left-padded to the
/// longest (the padding's columns masked out of every row's attention, as a cache's rows
/// of different lengths are): each prompt's [`Prefilled`], in order. Only the last
/// position of each row goes through the LM head.
pub(super) fn prefill_together<B: Kernels>(
    model: &Policy<B>,
    feeds: &[&[u32]],
) -> Result<Vec<Prefilled<B>>, ModelError> {
    let (b, l) = (
        feeds.len(),
        feeds.iter().map(|f| f.len()).max().unwrap_or(0),
    );
    let pads: Vec<usize> = feeds.iter().map(|f| l - f.len()).collect();
    let (mut ids, mut positions) = (Vec::with_capacity(b * l), Vec::with_capacity(b * l));
    for (f, &pad) in feeds.iter().zip(&pads) {
        ids.extend(std::iter::repeat_n(0i64, pad));
        ids.extend(f.iter().map(|&t| i64::from(t)));
        positions.extend(std::iter::repeat_n(0, pad).chain(0..f.len()));
    }
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, l]), &model.device());
    let mut cache = model.empty_cache(b);
    cache.starts.clone_from(&pads);
    let mut routes = recording(model);
    let hidden = model.trunk_routed(
        tokens,
        &positions,
        AttnMode::Cached(&mut cache),
        &mut routes,
    );
    let (d, vocab) = (model.config().hidden_size, model.config().vocab_size);
    let last = model.project(hidden.slice([0..b, l - 1..l]).reshape([b, d]));
    let host = logits_rows(last.reshape([b, vocab]))?;
    // The experts of each row's own tokens, `[tokens, layers, k]` row-major per token.
    let per_token = routes.used.len() / (b * l).max(1);
    let mut out = Vec::with_capacity(b);
    for (r, &pad) in pads.iter().enumerate() {
        let mut own = cache.clone();
        own.keep_rows(&[r]);
        out.push(Prefilled {
            last: host[r * vocab..(r + 1) * vocab].to_vec(),
            cache: own,
            routes: routes
                .record
                .then(|| routes.used[(r * l + pad) * per_token..(r + 1) * l * per_token].to_vec()),
        });
    }
    Ok(out)
}

/// Routes that record the experts used when `model` has MoE layers.
pub(super) fn recording<B: Backend>(model: &Policy<B>) -> Routes {
    if model.config().moe.is_some() {
        Routes::recording()
    } else {
        Routes::default()
    }
}

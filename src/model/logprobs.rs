//! The trainer's view: teacher-forced log-probs of given completion tokens, with gradients.
//!
//! With the same weights and sampling settings these equal the sampler's behaviour
//! log-probs bit for bit on the CPU backend: the forward gives each position the logits the
//! sampler's decode step gave it (the kernels' fixed orders, see [`super::kernels`]), and
//! both sides take the log-prob by one function,
//! [`token_logprob`](super::kernels::token_logprob): the same temperature and, when the
//! sampler recorded a mask (top-k/top-p truncation), the same kept ids.

use super::kernels::{Kept, Kernels, reshape};
use super::llama::Policy;
use super::moe::{LIVE, Routes};
use crate::schema::{Routing, SamplingMask};
use burn::tensor::{Int, Tensor, TensorData};

/// One sequence to score.
#[derive(Debug, Clone, Copy)]
pub struct ScoredSeq<'a> {
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
    pub mask: Option<&'a SamplingMask>,
    /// MoE policies: the experts the sampler recorded for the prompt and for the
    /// completion (see [`crate::schema::Routing`]).
    pub routing: Option<(&'a Routing, &'a Routing)>,
}

impl<'a> ScoredSeq<'a> {
    /// A completion of `prompt` with neither a sampling mask nor recorded routing.
    pub fn plain(prompt: &'a [u32], completion: &'a [u32]) -> Self {
        ScoredSeq {
            prompt,
            completion,
            mask: None,
            routing: None,
        }
    }
}

/// How [`completion_logprobs_routed`] routes an MoE policy's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routed {
    /// Through the experts the sampler recorded, where it recorded them.
    Replay,
    /// Through the live router's choice, counting where it differs from the record.
    Live,
}

/// What the MoE layers of a scoring pass did with the recorded routing: decisions compared
/// and how many of them the live router makes differently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutingStats {
    pub compared: usize,
    pub differ: usize,
}

/// Log-probs `[batch, max_completion]` of each completion token and a `[batch,
/// max_completion]` 0/1 tensor marking real (not padding) entries.
///
/// Only the positions that predict a completion token go through the LM head and the
/// log-softmax: the trunk runs over prompt + completion, then the hidden states of those
/// positions are gathered (`[batch × max_completion, hidden]`) before the vocabulary-sized
/// work, and that work runs over chunks of rows ([`Policy::head_logprobs`]): the logits
/// never exist for more than [`HEAD_CHUNK_ROWS`](super::kernels::HEAD_CHUNK_ROWS) rows.
/// Each log-prob is [`token_logprob`](super::kernels::token_logprob) (over the kept ids
/// when the sampler recorded a mask), without materialising the full log-softmax.
pub fn completion_logprobs<B: Kernels>(
    model: &Policy<B>,
    seqs: &[ScoredSeq<'_>],
    temperature: f32,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (lp, valid, _) = completion_logprobs_routed(model, seqs, temperature, Routed::Live);
    (lp, valid)
}

/// The `[batch × len, layers, k]` replay table of `seqs` padded to `lmax` positions:
/// each sequence's recorded experts (prompt, then completion but its last token), and
/// [`LIVE`] elsewhere. `None` when no sequence carries routing.
fn replay_table(seqs: &[ScoredSeq<'_>], lmax: usize, per_token: usize) -> Option<Vec<u16>> {
    if per_token == 0 || seqs.iter().all(|s| s.routing.is_none()) {
        return None;
    }
    let mut table = vec![LIVE; seqs.len() * lmax * per_token];
    for (r, s) in seqs.iter().enumerate() {
        let Some((prompt, own)) = s.routing else {
            continue;
        };
        let ids: Vec<u16> = prompt.unpack().into_iter().chain(own.unpack()).collect();
        if !ids.len().is_multiple_of(per_token) || ids.len() / per_token > lmax {
            continue;
        }
        let at = r * lmax * per_token;
        table[at..at + ids.len()].copy_from_slice(&ids);
    }
    Some(table)
}

/// A batch of sequences laid out for one teacher-forced pass: inputs `prompt ++
/// completion` right-padded to `lmax`; row `r`'s completion token `j` is predicted at
/// position `p − 1 + j` (`p`: its prompt length, at least 1), with `cmax` slots a row.
struct Layout {
    lmax: usize,
    cmax: usize,
    input: Vec<i64>,
    /// The flat position each completion slot is predicted at.
    rows: Vec<i64>,
    target: Vec<u32>,
    /// 1 for a real completion token, 0 for padding.
    valid: Vec<f32>,
}

impl Layout {
    fn of(seqs: &[ScoredSeq<'_>]) -> Self {
        let b = seqs.len();
        let lmax = seqs
            .iter()
            .map(|s| s.prompt.len().max(1) + s.completion.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let cmax = seqs
            .iter()
            .map(|s| s.completion.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut l = Layout {
            lmax,
            cmax,
            input: vec![0i64; b * lmax],
            rows: vec![0i64; b * cmax],
            target: vec![0u32; b * cmax],
            valid: vec![0f32; b * cmax],
        };
        for (r, s) in seqs.iter().enumerate() {
            for (t, &tok) in s.prompt.iter().chain(s.completion).enumerate() {
                l.input[r * lmax + t] = i64::from(tok);
            }
            let p = s.prompt.len().max(1);
            for j in 0..cmax {
                let k = r * cmax + j;
                let jj = j.min(s.completion.len().saturating_sub(1));
                l.rows[k] = (r * lmax + p - 1 + jj) as i64;
                l.target[k] = s.completion.get(j).copied().unwrap_or(0);
                l.valid[k] = if j < s.completion.len() { 1.0 } else { 0.0 };
            }
        }
        l
    }
}

/// Each completion slot's kept ids (row `r · cmax + j`): the sampler's mask at that step,
/// or the whole vocabulary (no mask, padding, or an episode's environment token, which
/// carries an empty set: it is context, scored over the whole vocabulary).
fn kept_sets(seqs: &[ScoredSeq<'_>], cmax: usize) -> Kept {
    Kept::of(seqs.iter().flat_map(|s| {
        (0..cmax).map(move |j| match s.mask {
            Some(m) if j < s.completion.len() && j < m.steps() => m.step(j),
            _ => &[][..],
        })
    }))
}

/// [`completion_logprobs`] of an MoE policy routed as `routed` says, with what the MoE
/// layers found comparing the live router with the recorded routing. A dense policy, or
/// sequences without routing, route live.
pub fn completion_logprobs_routed<B: Kernels>(
    model: &Policy<B>,
    seqs: &[ScoredSeq<'_>],
    temperature: f32,
    routed: Routed,
) -> (Tensor<B, 2>, Tensor<B, 2>, RoutingStats) {
    let s = scored(model, seqs, temperature, routed);
    (s.lp, s.valid, s.routing)
}

/// What a teacher-forced pass over a batch found, with what its entropy needs: the final
/// hidden state that predicts each completion slot and each slot's kept ids.
pub struct Scored<B: Kernels> {
    /// `[batch, max_completion]` log-probs, 0 on padding.
    pub lp: Tensor<B, 2>,
    /// `[batch, max_completion]`: 1 for a real completion token.
    pub valid: Tensor<B, 2>,
    pub routing: RoutingStats,
    /// `[batch × max_completion, hidden]`.
    hidden: Tensor<B, 2>,
    kept: Kept,
    temperature: f32,
}

impl<B: Kernels> Scored<B> {
    /// Each completion token's entropy `[batch, max_completion]` (0 on padding) of the
    /// distribution its log-prob is taken under (tempered, over the kept ids), through the
    /// policy `model` the pass ran ([`Policy::head_entropy`]): with the logits of every row
    /// kept for the backward on an autodiff backend.
    pub fn entropy(&self, model: &Policy<B>) -> Tensor<B, 2> {
        let [b, c] = self.valid.dims();
        let h = model.head_entropy(self.hidden.clone(), self.temperature, &self.kept);
        h.reshape([b, c]) * self.valid.clone()
    }

    /// [`Scored::entropy`] without a graph: on the autodiff backend's inner backend,
    /// through `inner`, the policy's weights without gradient (a statistic).
    pub fn entropy_detached<A>(&self, inner: &Policy<A>) -> Tensor<A, 2>
    where
        A: Kernels,
        B: burn::tensor::backend::AutodiffBackend<InnerBackend = A>,
    {
        let [b, c] = self.valid.dims();
        let h = inner.head_entropy(self.hidden.clone().inner(), self.temperature, &self.kept);
        h.reshape([b, c]) * self.valid.clone().inner()
    }
}

/// The teacher-forced pass of [`completion_logprobs_routed`].
pub fn scored<B: Kernels>(
    model: &Policy<B>,
    seqs: &[ScoredSeq<'_>],
    temperature: f32,
    routed: Routed,
) -> Scored<B> {
    let trunk = |tokens, routes: &mut Routes| model.hidden_routed(tokens, routes);
    scored_through(model, seqs, temperature, routed, trunk)
}

/// [`scored`] with the trunk (ids `[batch, len]` from position 0 to the final hidden
/// states `[batch, len, hidden]`) run by `trunk`, the MoE layers routed as the given
/// [`Routes`] say: how the trainer's layer-by-layer recompute
/// ([`super::recompute`]) takes part. Everything after the trunk is [`scored`]'s.
pub fn scored_through<B: Kernels>(
    model: &Policy<B>,
    seqs: &[ScoredSeq<'_>],
    temperature: f32,
    routed: Routed,
    trunk: impl FnOnce(Tensor<B, 2, Int>, &mut Routes) -> Tensor<B, 3>,
) -> Scored<B> {
    let device = model.device();
    let b = seqs.len();
    let Layout {
        lmax,
        cmax,
        input,
        rows,
        target,
        valid,
    } = Layout::of(seqs);
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(input, [b, lmax]), &device);
    let per_token = model
        .config()
        .routing_shape()
        .map_or(0, |shape| shape.per_token());
    let mut routes = match (replay_table(seqs, lmax, per_token), routed) {
        (Some(table), Routed::Replay) => Routes::replaying(table),
        (Some(table), Routed::Live) => Routes::comparing(table),
        (None, _) => Routes::default(),
    };
    let hidden = trunk(tokens, &mut routes);
    let routing = RoutingStats {
        compared: routes.replayed,
        differ: routes.differ,
    };
    let d = hidden.dims()[2];
    let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [b * cmax]), &device);
    let picked = reshape(hidden, [b * lmax, d]).select(0, rows);
    let valid = Tensor::<B, 2>::from_data(TensorData::new(valid, [b, cmax]), &device);
    let kept = kept_sets(seqs, cmax);
    let lp = model
        .head_logprobs(picked.clone(), &target, temperature, &kept)
        .reshape([b, cmax]);
    Scored {
        lp: lp * valid.clone(),
        valid,
        routing,
        hidden: picked,
        kept,
        temperature,
    }
}

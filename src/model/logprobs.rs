//! The trainer's view: teacher-forced log-probs of given completion tokens, with gradients.
//!
//! With the same weights and sampling settings these equal the sampler's behaviour
//! log-probs: logits are divided by the same temperature and, when the sampler recorded a
//! mask (top-k/top-p truncation), renormalised over the same kept ids.

use super::kernels::reference::{logsumexp, scaled, target_ids};
use super::kernels::{Kernels, MASKED};
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
/// work. Each log-prob is `logit[token] − logsumexp(logits)` (over the kept ids when the
/// sampler recorded a mask), without materialising the full log-softmax: one fused kernel
/// ([`Kernels::token_logprobs`]) when no row has a mask.
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

/// The kept sets of the masked sequences, one row of `kmax` ids per completion slot: the
/// kept ids with bias 0, padded with the sampled token at bias [`MASKED`]; slots without a
/// mask (or an episode's environment tokens, with an empty set) keep only their first
/// entry unmasked and are not renormalised (`use_mask` 0).
struct KeptSets {
    kmax: usize,
    kept: Vec<i64>,
    bias: Vec<f32>,
    use_mask: Vec<f32>,
}

impl KeptSets {
    fn of(seqs: &[ScoredSeq<'_>], cmax: usize) -> Self {
        let n = seqs.len() * cmax;
        let kmax = seqs
            .iter()
            .filter_map(|s| s.mask)
            .flat_map(|m| m.offsets.windows(2).map(|w| (w[1] - w[0]) as usize))
            .max()
            .unwrap_or(1)
            .max(1);
        let mut k = KeptSets {
            kmax,
            kept: vec![0i64; n * kmax],
            bias: vec![MASKED; n * kmax],
            use_mask: vec![0f32; n],
        };
        for (r, s) in seqs.iter().enumerate() {
            for j in 0..cmax {
                let base = (r * cmax + j) * kmax;
                match s.mask {
                    // An empty kept set is an episode's environment token (never sampled):
                    // it is context, scored over the whole vocabulary like an unmasked one.
                    Some(m) if j < s.completion.len() && !m.step(j).is_empty() => {
                        for (slot, &id) in m.step(j).iter().enumerate() {
                            k.kept[base + slot] = i64::from(id);
                            k.bias[base + slot] = 0.0;
                        }
                        for slot in m.step(j).len()..kmax {
                            k.kept[base + slot] = i64::from(s.completion[j]);
                        }
                        k.use_mask[r * cmax + j] = 1.0;
                    }
                    _ => k.bias[base] = 0.0,
                }
            }
        }
        k
    }
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
    let hidden = model.hidden_routed(tokens, &mut routes);
    let stats = RoutingStats {
        compared: routes.replayed,
        differ: routes.differ,
    };
    let d = hidden.dims()[2];
    let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [b * cmax]), &device);
    let picked = hidden.reshape([b * lmax, d]).select(0, rows);
    let logits = model.project(picked);
    let valid = Tensor::<B, 2>::from_data(TensorData::new(valid, [b, cmax]), &device);
    let full = B::token_logprobs(logits.clone(), &target, temperature).reshape([b, cmax]);
    if seqs.iter().all(|s| s.mask.is_none()) {
        return (full * valid.clone(), valid, stats);
    }
    // Renormalise over the kept ids: a log-sum-exp over each slot's kept logits.
    let scaled = scaled(logits, temperature);
    let tok = scaled.clone().gather(1, target_ids::<B>(&target, &device));
    let n = b * cmax;
    let k = KeptSets::of(seqs, cmax);
    let kept = Tensor::<B, 2, Int>::from_data(TensorData::new(k.kept, [n, k.kmax]), &device);
    let bias = Tensor::<B, 2>::from_data(TensorData::new(k.bias, [n, k.kmax]), &device);
    let kept_lse = logsumexp(scaled.gather(1, kept) + bias);
    let masked = (tok - kept_lse).reshape([b, cmax]);
    let use_mask = Tensor::<B, 2>::from_data(TensorData::new(k.use_mask, [b, cmax]), &device);
    let out = masked * use_mask.clone() + full * (use_mask.neg() + 1.0);
    (out * valid.clone(), valid, stats)
}

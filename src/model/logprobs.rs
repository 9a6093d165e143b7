//! The trainer's view: teacher-forced log-probs of given completion tokens, with gradients.
//!
//! With the same weights and sampling settings these equal the sampler's behaviour
//! log-probs: logits are divided by the same temperature and, when the sampler recorded a
//! mask (top-k/top-p truncation), renormalised over the same kept ids.

use super::llama::{MASKED, Policy};
use crate::schema::SamplingMask;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// One sequence to score.
#[derive(Debug, Clone, Copy)]
pub struct ScoredSeq<'a> {
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
    pub mask: Option<&'a SamplingMask>,
}

/// Log-probs `[batch, max_completion]` of each completion token and a `[batch,
/// max_completion]` 0/1 tensor marking real (not padding) entries.
pub fn completion_logprobs<B: Backend>(
    model: &Policy<B>,
    seqs: &[ScoredSeq<'_>],
    temperature: f32,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let device = model.device();
    let b = seqs.len();
    let lmax = seqs
        .iter()
        .map(|s| s.prompt.len() + s.completion.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let cmax = seqs
        .iter()
        .map(|s| s.completion.len())
        .max()
        .unwrap_or(0)
        .max(1);
    // Inputs: prompt ++ completion, right-padded. Targets: the next token at each position.
    let mut input = vec![0i64; b * lmax];
    let mut target = vec![0i64; b * lmax];
    let mut cols = vec![0i64; b * cmax];
    let mut valid = vec![0f32; b * cmax];
    for (r, s) in seqs.iter().enumerate() {
        let full: Vec<u32> = s.prompt.iter().chain(s.completion).copied().collect();
        for (t, &tok) in full.iter().enumerate() {
            input[r * lmax + t] = i64::from(tok);
            if t > 0 {
                target[r * lmax + t - 1] = i64::from(tok);
            }
        }
        let p = s.prompt.len().max(1);
        for j in 0..cmax {
            cols[r * cmax + j] = (p - 1 + j.min(s.completion.len().saturating_sub(1))) as i64;
            valid[r * cmax + j] = if j < s.completion.len() { 1.0 } else { 0.0 };
        }
    }
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(input, [b, lmax]), &device);
    let logits = model.forward(tokens);
    let scaled = if temperature > 0.0 && temperature != 1.0 {
        logits.div_scalar(temperature)
    } else {
        logits
    };
    let target = Tensor::<B, 3, Int>::from_data(TensorData::new(target, [b, lmax, 1]), &device);
    let cols = Tensor::<B, 2, Int>::from_data(TensorData::new(cols, [b, cmax]), &device);
    let valid = Tensor::<B, 2>::from_data(TensorData::new(valid, [b, cmax]), &device);

    let full = log_softmax(scaled.clone(), 2)
        .gather(2, target.clone())
        .reshape([b, lmax]);
    let full = full.gather(1, cols.clone());
    if seqs.iter().all(|s| s.mask.is_none()) {
        return (full * valid.clone(), valid);
    }
    // Renormalise over the kept ids: gather the kept logits per step (padded with the
    // sampled token, masked out) and take a log-sum-exp over them.
    let kmax = seqs
        .iter()
        .filter_map(|s| s.mask)
        .flat_map(|m| m.offsets.windows(2).map(|w| (w[1] - w[0]) as usize))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut kept = vec![0i64; b * lmax * kmax];
    let mut bias = vec![MASKED; b * lmax * kmax];
    let mut use_mask = vec![0f32; b * cmax];
    for (r, s) in seqs.iter().enumerate() {
        let p = s.prompt.len().max(1);
        for t in 0..lmax {
            let base = (r * lmax + t) * kmax;
            let j = (t + 1).checked_sub(p);
            match (s.mask, j) {
                (Some(m), Some(j)) if j < s.completion.len() => {
                    for (slot, &id) in m.step(j).iter().enumerate() {
                        kept[base + slot] = i64::from(id);
                        bias[base + slot] = 0.0;
                    }
                    for slot in m.step(j).len()..kmax {
                        kept[base + slot] = i64::from(s.completion[j]);
                    }
                }
                _ => {
                    kept[base] = 0;
                    bias[base] = 0.0;
                }
            }
        }
        if s.mask.is_some() {
            for j in 0..s.completion.len() {
                use_mask[r * cmax + j] = 1.0;
            }
        }
    }
    let kept = Tensor::<B, 3, Int>::from_data(TensorData::new(kept, [b, lmax, kmax]), &device);
    let bias = Tensor::<B, 3>::from_data(TensorData::new(bias, [b, lmax, kmax]), &device);
    let kept_logits = scaled.clone().gather(2, kept) + bias;
    let m = kept_logits.clone().max_dim(2).detach();
    let lse = (kept_logits - m.clone()).exp().sum_dim(2).log() + m;
    let tok = scaled.gather(2, target);
    let masked = (tok - lse).reshape([b, lmax]).gather(1, cols);
    let use_mask = Tensor::<B, 2>::from_data(TensorData::new(use_mask, [b, cmax]), &device);
    let out = masked * use_mask.clone() + full * (use_mask.neg() + 1.0);
    (out * valid.clone(), valid)
}

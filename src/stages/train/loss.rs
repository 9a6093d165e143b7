//! The objective: per-token importance ratios against the behaviour log-probs, the PPO,
//! TIS or capped-REINFORCE surrogate, the optional KL to the initial policy, and the step's
//! statistics.

use super::{LossKind, TrainerSettings};
use crate::model::logprobs::{ScoredSeq, completion_logprobs};
use crate::model::{ModelError, Policy};
use crate::schema::{ScoredGroup, StepRecord};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, ModelError> {
    crate::model::host_f32(t.into_data())
}

/// The one value of a reduced tensor.
fn scalar<B: Backend>(t: Tensor<B, 1>) -> Result<f32, ModelError> {
    host(t)?
        .first()
        .copied()
        .ok_or_else(|| ModelError::HostCopy("a reduced tensor holds no value".into()))
}

/// The loss of a batch of groups and its statistics (everything but timing and grad norm).
pub fn loss<B: AutodiffBackend>(
    model: &Policy<B>,
    reference: Option<&Policy<B::InnerBackend>>,
    groups: &[&ScoredGroup],
    cfg: &TrainerSettings,
) -> Result<(Tensor<B, 1>, StepRecord), ModelError> {
    let device = model.device();
    let mut seqs = Vec::new();
    let mut adv = Vec::new();
    let mut behaviour = Vec::new();
    for g in groups {
        for (s, a) in g.rollout.samples.iter().zip(&g.advantages) {
            seqs.push(ScoredSeq {
                prompt: &g.rollout.prompt_tokens,
                completion: &s.tokens,
                mask: s.mask.as_ref(),
            });
            adv.push(*a);
            behaviour.push(s.logprobs.as_slice());
        }
    }
    let b = seqs.len();
    let (lp, valid) = completion_logprobs(model, &seqs, cfg.policy.temperature);
    let c = lp.dims()[1];
    let mut mu = vec![0f32; b * c];
    let mut a_tok = vec![0f32; b * c];
    for (i, (m, a)) in behaviour.iter().zip(&adv).enumerate() {
        mu[i * c..i * c + m.len()].copy_from_slice(m);
        a_tok[i * c..(i + 1) * c].fill(*a);
    }
    let mu = Tensor::<B, 2>::from_data(TensorData::new(mu, [b, c]), &device);
    let a_tok = Tensor::<B, 2>::from_data(TensorData::new(a_tok, [b, c]), &device);
    let log_ratio = (lp.clone() - mu) * valid.clone();
    let ratio = log_ratio.clone().exp();
    let per_token = surrogate(ratio.clone(), a_tok, lp.clone(), cfg);
    let n_tokens: f32 = scalar(valid.clone().sum())?.max(1.0);
    let mut total = (per_token * valid.clone()).sum().div_scalar(n_tokens);
    let mut ref_kl = 0.0;
    if let (Some(reference), true) = (reference, cfg.train.kl_coef > 0.0) {
        let (ref_lp, _) = completion_logprobs(reference, &seqs, cfg.policy.temperature);
        let ref_lp = Tensor::<B, 2>::from_inner(ref_lp);
        let d = (ref_lp - lp.clone()) * valid.clone();
        let k3 = (d.clone().exp() - d - 1.0) * valid.clone();
        let kl = k3.sum().div_scalar(n_tokens);
        ref_kl = f64::from(scalar(kl.clone().detach())?);
        total = total + kl.mul_scalar(cfg.train.kl_coef);
    }
    let (r, v, l) = (host(ratio.detach())?, host(valid)?, host(lp.detach())?);
    let stats = StepRecord {
        loss: f64::from(scalar(total.clone().detach())?),
        ref_kl,
        ..token_stats(&r, &v, &l, groups, cfg)
    };
    Ok((total, stats))
}

/// The per-token surrogate loss (negated objective) of the configured kind.
fn surrogate<B: AutodiffBackend>(
    ratio: Tensor<B, 2>,
    a_tok: Tensor<B, 2>,
    lp: Tensor<B, 2>,
    cfg: &TrainerSettings,
) -> Tensor<B, 2> {
    let t = &cfg.train;
    match t.loss {
        LossKind::Ppo => {
            let unclipped = ratio.clone() * a_tok.clone();
            let clipped = ratio.clamp(1.0 - t.clip_eps, 1.0 + t.clip_eps_high) * a_tok;
            unclipped.min_pair(clipped).neg()
        }
        LossKind::Tis => (ratio.detach().clamp_max(t.is_cap) * a_tok * lp).neg(),
        LossKind::Reinforce => (ratio.clamp_max(t.is_cap) * a_tok).neg(),
    }
}

/// The step's statistics over real tokens (`v` = 1) from the host copies of the ratios
/// `r` and log-probs `l`, and the groups' rewards.
fn token_stats(
    r: &[f32],
    v: &[f32],
    l: &[f32],
    groups: &[&ScoredGroup],
    cfg: &TrainerSettings,
) -> StepRecord {
    let (mut sum_r, mut sum_r2, mut n, mut clipped, mut r_max, mut mkl, mut nll) =
        (0f64, 0f64, 0f64, 0f64, 0f64, 0f64, 0f64);
    for i in 0..r.len() {
        if v[i] == 0.0 {
            continue;
        }
        let ri = f64::from(r[i]);
        sum_r += ri;
        sum_r2 += ri * ri;
        n += 1.0;
        r_max = r_max.max(ri);
        let out = match cfg.train.loss {
            LossKind::Ppo => {
                ri < f64::from(1.0 - cfg.train.clip_eps)
                    || ri > f64::from(1.0 + cfg.train.clip_eps_high)
            }
            LossKind::Tis | LossKind::Reinforce => ri > f64::from(cfg.train.is_cap),
        };
        clipped += f64::from(u8::from(out));
        mkl += ri - 1.0 - ri.ln();
        nll -= f64::from(l[i]);
    }
    let n = n.max(1.0);
    let rewards: Vec<f32> = groups
        .iter()
        .flat_map(|g| g.rewards.iter().copied())
        .collect();
    StepRecord {
        reward_mean: rewards.iter().map(|&x| f64::from(x)).sum::<f64>()
            / rewards.len().max(1) as f64,
        accuracy: rewards.iter().filter(|&&x| x >= 1.0).count() as f64
            / rewards.len().max(1) as f64,
        ess: if sum_r2 > 0.0 {
            sum_r * sum_r / (n * sum_r2)
        } else {
            0.0
        },
        clip_fraction: clipped / n,
        ratio_mean: sum_r / n,
        ratio_max: r_max,
        mismatch_kl: mkl / n,
        entropy: nll / n,
        groups: groups.len() as u64,
        tokens: n as u64,
        ..StepRecord::default()
    }
}

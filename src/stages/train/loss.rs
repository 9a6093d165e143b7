//! The loss of a batch on the model: the samples' log-probs, advantages and behaviour
//! log-probs put into the objective ([`objective`]: ratios, surrogate, KL, aggregation),
//! and the step's statistics.

use super::objective::{self, Norm};
use super::{LossAgg, RoutingMode, TrainerSettings, credit};
use crate::model::logprobs::{Routed, ScoredSeq, completion_logprobs, completion_logprobs_routed};
use crate::model::{Kernels, ModelError, Policy};
use crate::schema::{ScoredGroup, StepRecord};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};
use std::ops::Range;

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

/// A sample's advantage: its outcome advantage on every token, or one per token.
#[derive(Debug, Clone, PartialEq)]
pub enum Advantage {
    Outcome(f32),
    PerToken(Vec<f32>),
}

/// The samples of a batch of groups, flattened: what the loss runs over.
pub struct Samples<'a> {
    seqs: Vec<ScoredSeq<'a>>,
    adv: Vec<Advantage>,
    behaviour: Vec<&'a [f32]>,
    /// Whether each completion token is the model's (an episode's environment tokens are
    /// not); empty for a sample without environment turns.
    own: Vec<Vec<bool>>,
}

impl<'a> Samples<'a> {
    /// The groups' samples with their advantages: per token (by [`credit`]) for a group
    /// that carries `token_rewards`, its outcome advantage broadcast otherwise. `discount`
    /// is `train.token_discount`.
    pub fn of(groups: &[&'a ScoredGroup], discount: f32) -> Self {
        let mut out = Samples {
            seqs: Vec::new(),
            adv: Vec::new(),
            behaviour: Vec::new(),
            own: Vec::new(),
        };
        for g in groups {
            let own: Vec<Vec<bool>> = g
                .rollout
                .samples
                .iter()
                .map(|s| {
                    if s.env.is_empty() {
                        Vec::new()
                    } else {
                        s.model_tokens()
                    }
                })
                .collect();
            match &g.token_rewards {
                Some(tr) => {
                    let tr: Vec<&[f32]> = tr.iter().map(|r| r.as_slice()).collect();
                    out.adv.extend(
                        credit::token_advantages(&g.advantages, &tr, &own, discount)
                            .into_iter()
                            .map(Advantage::PerToken),
                    );
                }
                None => out
                    .adv
                    .extend(g.advantages.iter().map(|&a| Advantage::Outcome(a))),
            }
            for s in &g.rollout.samples {
                out.seqs.push(ScoredSeq {
                    prompt: &g.rollout.prompt_tokens,
                    completion: &s.tokens,
                    mask: s.mask.as_ref(),
                    routing: g.rollout.prompt_routing.as_ref().zip(s.routing.as_ref()),
                });
                out.behaviour.push(s.logprobs.as_slice());
            }
            out.own.extend(own);
        }
        out
    }

    /// The completion tokens of all the samples (the rows of the output head's pass).
    pub fn completion_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.completion.len()).sum()
    }

    /// Consecutive runs of samples of at most `max_tokens` prompt + completion tokens each
    /// (a longer sample runs alone); `0` puts every sample in one run.
    pub fn micro_batches(&self, max_tokens: usize) -> Vec<Range<usize>> {
        if max_tokens == 0 {
            return std::iter::once(0..self.seqs.len()).collect();
        }
        let mut out = Vec::new();
        let (mut start, mut used) = (0, 0);
        for (i, s) in self.seqs.iter().enumerate() {
            let n = s.prompt.len() + s.completion.len();
            if i > start && used + n > max_tokens {
                out.push(start..i);
                (start, used) = (i, 0);
            }
            used += n;
        }
        out.push(start..self.seqs.len());
        out
    }
}

/// Each sample's model completion tokens in `groups` (an episode's environment tokens are
/// context).
fn sample_tokens<'a>(groups: &'a [&ScoredGroup]) -> impl Iterator<Item = usize> + 'a {
    groups.iter().flat_map(|g| &g.rollout.samples).map(|s| {
        if s.env.is_empty() {
            s.tokens.len()
        } else {
            s.model_tokens().iter().filter(|&&o| o).count()
        }
    })
}

/// The model's completion tokens of `groups`: what a step is shared among ranks by.
pub fn tokens(groups: &[&ScoredGroup]) -> usize {
    sample_tokens(groups).sum()
}

/// What the loss of a step on `groups` is divided by (see [`Norm`]).
pub fn norm(groups: &[&ScoredGroup], cfg: &TrainerSettings) -> Norm {
    Norm::of(sample_tokens(groups), &cfg.train)
}

/// What one micro-batch's part of the loss leaves for the step's statistics: host copies
/// of its ratios, validity and log-probs, and its share of the loss and of the KL.
#[derive(Debug, Default)]
pub struct Part {
    r: Vec<f32>,
    /// Each token's advantage: whether its clip binds depends on its sign.
    a: Vec<f32>,
    /// 0 where off-policy masking dropped the token (empty when nothing is masked).
    k: Vec<f32>,
    v: Vec<f32>,
    l: Vec<f32>,
    loss: f64,
    ref_kl: f64,
    /// MoE: recorded routing decisions seen, and those the live router makes differently.
    routing: crate::model::logprobs::RoutingStats,
}

/// The loss of the samples in `range`: their per-token surrogate (and KL) weighted by the
/// step's `norm` (token-mean: divided by the whole step's token count), so that the parts
/// of a step add up to its loss and their gradients to its gradient.
pub fn part<B: AutodiffBackend + Kernels>(
    model: &Policy<B>,
    reference: Option<&Policy<B::InnerBackend>>,
    samples: &Samples,
    range: Range<usize>,
    norm: &Norm,
    cfg: &TrainerSettings,
) -> Result<(Tensor<B, 1>, Part), ModelError>
where
    B::InnerBackend: Kernels,
{
    let device = model.device();
    let seqs = &samples.seqs[range.clone()];
    let b = seqs.len();
    let routed = match cfg.train.routing {
        RoutingMode::Replay => Routed::Replay,
        RoutingMode::Live => Routed::Live,
    };
    let (lp, valid, routing) =
        completion_logprobs_routed(model, seqs, cfg.policy.temperature, routed);
    let c = lp.dims()[1];
    let mut mu = vec![0f32; b * c];
    let mut a_tok = vec![0f32; b * c];
    let mut context = false;
    let mut own = vec![1f32; b * c];
    for (i, k) in range.enumerate() {
        let m = samples.behaviour[k];
        mu[i * c..i * c + m.len()].copy_from_slice(m);
        match &samples.adv[k] {
            Advantage::Outcome(a) => a_tok[i * c..(i + 1) * c].fill(*a),
            Advantage::PerToken(a) => a_tok[i * c..i * c + a.len()].copy_from_slice(a),
        }
        // An environment token is context: no loss, no ratio, no advantage; whatever its
        // behaviour log-prob or reward says is never read.
        for (t, &o) in samples.own[k].iter().enumerate() {
            if !o {
                context = true;
                own[i * c + t] = 0.0;
                mu[i * c + t] = 0.0;
                a_tok[i * c + t] = 0.0;
            }
        }
    }
    let valid = if context {
        valid * Tensor::<B, 2>::from_data(TensorData::new(own, [b, c]), &device)
    } else {
        valid
    };
    let mu = Tensor::<B, 2>::from_data(TensorData::new(mu, [b, c]), &device);
    let adv = Tensor::<B, 2>::from_data(TensorData::new(a_tok.clone(), [b, c]), &device);
    let t = &cfg.train;
    let log_ratio = objective::log_ratios(&lp, mu, &valid);
    let kept = objective::kept(log_ratio.clone().detach(), &valid, t);
    let ratio = objective::ratios(&lp, log_ratio, &valid, t.loss);
    let per_token = objective::surrogate(ratio.clone(), adv, lp.clone(), t);
    // Token-mean divides one sum by the step's tokens (as it always has, bit for bit); the
    // other modes weigh each row. `on` is 1 where a token's loss counts.
    let weighted = |x: Tensor<B, 2>, on: Tensor<B, 2>| match t.loss_agg_mode {
        LossAgg::TokenMean => (x * on).sum().div_scalar(norm.tokens),
        agg => {
            let w = objective::row_weights(&valid, norm, agg).repeat_dim(1, c);
            (x * on * w).sum()
        }
    };
    let on = match &kept {
        Some(k) => valid.clone() * k.clone(),
        None => valid.clone(),
    };
    let mut total = weighted(per_token, on);
    let mut ref_kl = 0.0;
    if let (Some(reference), true) = (reference, t.kl_coef > 0.0) {
        let (ref_lp, _) = completion_logprobs(reference, seqs, cfg.policy.temperature);
        let ref_lp = Tensor::<B, 2>::from_inner(ref_lp);
        let kl = objective::kl(lp.clone(), ref_lp, t.kl_loss_type) * valid.clone();
        let kl = weighted(kl, valid.clone());
        ref_kl = f64::from(scalar(kl.clone().detach())?);
        total = total + kl.mul_scalar(t.kl_coef);
    }
    let part = Part {
        r: host(ratio.detach())?,
        a: a_tok,
        k: match kept {
            Some(k) => host(k)?,
            None => Vec::new(),
        },
        v: host(valid)?,
        l: host(lp.detach())?,
        loss: f64::from(scalar(total.clone().detach())?),
        ref_kl,
        routing,
    };
    Ok((total, part))
}

/// What a step's statistics are made of, as sums over its tokens (and the largest ratio):
/// the parts of one trainer, or the ranks of several, add up with [`TokenSums::add`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenSums {
    loss: f64,
    ref_kl: f64,
    compared: u64,
    differ: u64,
    sum_r: f64,
    sum_r2: f64,
    n: f64,
    clipped: f64,
    masked: f64,
    r_max: f64,
    mkl: f64,
    gap: f64,
    nll: f64,
}

impl TokenSums {
    /// The sums over `parts`, token by token in order.
    pub fn of(parts: &[Part], cfg: &TrainerSettings) -> Self {
        let mut s = TokenSums::default();
        for p in parts {
            s.loss += p.loss;
            s.ref_kl += p.ref_kl;
            s.compared += p.routing.compared as u64;
            s.differ += p.routing.differ as u64;
            s.tokens(p, cfg);
        }
        s
    }

    /// Another trainer rank's sums added to these.
    pub fn add(&mut self, o: &TokenSums) {
        self.loss += o.loss;
        self.ref_kl += o.ref_kl;
        self.compared += o.compared;
        self.differ += o.differ;
        self.sum_r += o.sum_r;
        self.sum_r2 += o.sum_r2;
        self.n += o.n;
        self.clipped += o.clipped;
        self.masked += o.masked;
        self.r_max = self.r_max.max(o.r_max);
        self.mkl += o.mkl;
        self.gap += o.gap;
        self.nll += o.nll;
    }

    /// Adds the real tokens (`v` = 1) of one part from the host copies of its ratios,
    /// advantages and log-probs.
    fn tokens(&mut self, p: &Part, cfg: &TrainerSettings) {
        for i in 0..p.r.len() {
            if p.v[i] == 0.0 {
                continue;
            }
            let ri = f64::from(p.r[i]);
            self.sum_r += ri;
            self.sum_r2 += ri * ri;
            self.n += 1.0;
            self.r_max = self.r_max.max(ri);
            let out = objective::clipped(ri, f64::from(p.a[i]), &cfg.train);
            self.clipped += f64::from(u8::from(out));
            if p.k.get(i).is_some_and(|&k| k == 0.0) {
                self.masked += 1.0;
            }
            self.mkl += ri - 1.0 - ri.ln();
            self.gap += ri.ln().abs();
            self.nll -= f64::from(p.l[i]);
        }
    }

    /// The step's statistics: these sums over its tokens, and what its groups carry.
    pub fn record(&self, groups: &[&ScoredGroup]) -> StepRecord {
        let n = self.n.max(1.0);
        let rewards: Vec<f32> = groups
            .iter()
            .flat_map(|g| g.rewards.iter().copied())
            .collect();
        StepRecord {
            loss: self.loss,
            ref_kl: self.ref_kl,
            teacher_kl: teacher_kl(groups),
            routing_mismatch: (self.compared > 0)
                .then(|| self.differ as f64 / self.compared as f64),
            swap_tokens: swap_tokens(groups),
            reward_mean: rewards.iter().map(|&x| f64::from(x)).sum::<f64>()
                / rewards.len().max(1) as f64,
            accuracy: rewards.iter().filter(|&&x| x >= 1.0).count() as f64
                / rewards.len().max(1) as f64,
            ess: if self.sum_r2 > 0.0 {
                self.sum_r * self.sum_r / (n * self.sum_r2)
            } else {
                0.0
            },
            clip_fraction: self.clipped / n,
            masked_fraction: self.masked / n,
            ratio_mean: self.sum_r / n,
            ratio_max: self.r_max,
            mismatch_kl: self.mkl / n,
            logprob_gap: self.gap / n,
            entropy: self.nll / n,
            groups: groups.len() as u64,
            tokens: n as u64,
            ..StepRecord::default()
        }
    }
}

/// Model tokens sampled after their completion's first version run: after a weight swap
/// inside it (see [`StepRecord::swap_tokens`]).
fn swap_tokens(groups: &[&ScoredGroup]) -> u64 {
    let mut n = 0u64;
    for g in groups {
        for s in &g.rollout.samples {
            let Some(second) = s.versions.get(1) else {
                continue;
            };
            let own = s.model_tokens();
            n += own
                .iter()
                .skip(second.start as usize)
                .filter(|&&o| o)
                .count() as u64;
        }
    }
    n
}

/// KL(student ‖ teacher) on the sampled tokens of the groups a teacher scored: the mean of
/// behaviour − teacher log-prob (the k1 estimate, the negated reverse-KL reward); `None`
/// when no group carries teacher log-probs.
fn teacher_kl(groups: &[&ScoredGroup]) -> Option<f64> {
    let (mut sum, mut n) = (0f64, 0usize);
    for g in groups {
        let Some(teacher) = &g.ref_logprobs else {
            continue;
        };
        for (s, t) in g.rollout.samples.iter().zip(teacher) {
            let own = s.model_tokens();
            for ((&b, &t), _) in s
                .logprobs
                .iter()
                .zip(t.iter())
                .zip(&own)
                .filter(|(_, o)| **o)
            {
                sum += f64::from(b) - f64::from(t);
                n += 1;
            }
        }
    }
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TrainBackend;
    use crate::model::config::{Architecture, ModelConfig};
    use crate::schema::{RolloutGroup, SchemaVersion, examples};
    use burn::tensor::backend::AutodiffBackend;

    type Inner = <TrainBackend as AutodiffBackend>::InnerBackend;

    fn host2(t: Tensor<Inner, 2>) -> Vec<f32> {
        crate::model::host_f32(t.into_data()).unwrap()
    }

    /// Samples 1 and 3 of the example group switch versions halfway (token 5 of 10): their
    /// last five tokens each were drawn over an older version's cache; an environment span
    /// among them is not counted.
    #[test]
    fn swap_tokens_counts_model_tokens_after_a_swap_inside_a_completion() {
        let mut rollout = examples::rollout_group(4, 10, 16, 0);
        let group = |rollout: RolloutGroup| ScoredGroup {
            schema: SchemaVersion::CURRENT,
            rewards: vec![0.0; rollout.samples.len()],
            advantages: vec![0.0; rollout.samples.len()],
            rollout,
            token_rewards: None,
            ref_logprobs: None,
            scorer_id: "swap".into(),
            scored_us: 0,
        };
        assert_eq!(swap_tokens(&[&group(rollout.clone())]), 10);
        rollout.samples[1].env = vec![crate::schema::Span { start: 7, len: 2 }];
        assert_eq!(swap_tokens(&[&group(rollout)]), 8);
    }

    /// One sample of two completion tokens whose token rewards, with γ = 0, give the
    /// per-token advantages [+1, −1] (the group's mean reward is 0 and the outcome advantage
    /// 0). Its behaviour log-probs are the model's own, so every ratio is 1 and the PPO
    /// surrogate's gradient is −(1/N)·Σ_t A_t·∇log π(y_t) with N = 2 tokens: by hand,
    /// −(∇lp₀ − ∇lp₁)/2, each ∇lp_t taken alone through the log-prob path. A broadcast
    /// advantage of the same group (no token rewards, outcome 0) gives no gradient at all.
    #[test]
    fn per_token_advantages_give_the_hand_computed_gradient() {
        let device = Default::default();
        let model =
            Policy::<TrainBackend>::random(&ModelConfig::tiny(Architecture::Llama, 16), 3, &device)
                .unwrap();
        let mut rollout = examples::rollout_group(1, 2, 16, 0);
        for s in &mut rollout.samples {
            s.mask = None;
        }
        let seq = ScoredSeq::plain(&rollout.prompt_tokens, &rollout.samples[0].tokens);
        // A backward pass consumes its graph: each token's log-prob gets a forward of its own.
        let lp = || completion_logprobs(&model, &[seq], 1.0).0;
        let per_token = |t: usize| {
            let grads = lp().slice([0..1, t..t + 1]).sum().backward();
            (
                host2(model.embed.weight.val().grad(&grads).unwrap()),
                model.norm.gamma.val().grad(&grads).unwrap(),
            )
        };
        let ((e0, n0), (e1, n1)) = (per_token(0), per_token(1));
        let behaviour = host(lp().detach()).unwrap();
        rollout.samples[0].logprobs = behaviour.into();
        let mut group = ScoredGroup {
            schema: SchemaVersion { major: 2, minor: 0 },
            rollout,
            rewards: vec![0.0],
            advantages: vec![0.0],
            token_rewards: Some(vec![vec![1.0, -1.0].into()]),
            ref_logprobs: None,
            scorer_id: "hand".into(),
            scored_us: 0,
        };
        let mut cfg = TrainerSettings::default();
        cfg.train.token_discount = 0.0;
        let loss_grads = |g: &ScoredGroup| {
            let samples = Samples::of(&[g], cfg.train.token_discount);
            assert_eq!(tokens(&[g]), 2);
            let norm = norm(&[g], &cfg);
            assert_eq!(norm.tokens, 2.0);
            let (total, _) = part(&model, None, &samples, 0..1, &norm, &cfg).unwrap();
            let grads = total.backward();
            (
                host2(model.embed.weight.val().grad(&grads).unwrap()),
                model.norm.gamma.val().grad(&grads).unwrap(),
            )
        };
        let (e, n) = loss_grads(&group);
        let want_e: Vec<f32> = e0.iter().zip(&e1).map(|(a, b)| -(a - b) / 2.0).collect();
        let want_n = (n0 - n1).div_scalar(-2.0);
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        let scale = want_e.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 1e-4, "the hand-computed gradient is not zero");
        assert!(
            diff(&e, &want_e) < 1e-5 * scale.max(1.0),
            "embedding gradient"
        );
        let (n, want_n) = (
            crate::model::host_f32(n.into_data()).unwrap(),
            crate::model::host_f32(want_n.into_data()).unwrap(),
        );
        assert!(diff(&n, &want_n) < 1e-5, "final norm gradient");

        group.token_rewards = None;
        let (e, _) = loss_grads(&group);
        assert!(
            e.iter().all(|&x| x == 0.0),
            "a zero outcome advantage moves nothing"
        );
    }

    /// An episode's environment tokens are context: filling their behaviour log-probs and
    /// token rewards with garbage (and a teacher's log-probs) changes neither the loss nor
    /// the gradient, bit for bit, and they do not count in the tokens the loss averages.
    #[test]
    fn environment_tokens_do_not_reach_the_loss() {
        let device = Default::default();
        let model =
            Policy::<TrainBackend>::random(&ModelConfig::tiny(Architecture::Llama, 16), 4, &device)
                .unwrap();
        let clean = examples::scored_episode();
        let mut garbage = clean.clone();
        for (i, s) in garbage.rollout.samples.iter_mut().enumerate() {
            let own = s.model_tokens();
            let mut lp = s.logprobs.to_vec();
            let mut tr = garbage.token_rewards.as_ref().unwrap()[i].to_vec();
            for t in (0..lp.len()).filter(|&t| !own[t]) {
                lp[t] = -37.5 - t as f32;
                tr[t] = 1e6;
            }
            s.logprobs = lp.into();
            garbage.token_rewards.as_mut().unwrap()[i] = tr.into();
        }
        garbage.ref_logprobs = Some(
            garbage
                .rollout
                .samples
                .iter()
                .map(|s| vec![-99.0; s.tokens.len()].into())
                .collect(),
        );
        let mut cfg = TrainerSettings::default();
        cfg.train.kl_coef = 0.0;
        let run = |g: &ScoredGroup, discount: f32| {
            let samples = Samples::of(&[g], discount);
            let n = tokens(&[g]);
            let (total, part) =
                part(&model, None, &samples, 0..2, &norm(&[g], &cfg), &cfg).unwrap();
            let grads = total.backward();
            let e = host2(model.embed.weight.val().grad(&grads).unwrap());
            (n, part.loss, e)
        };
        for discount in [1.0, 0.0] {
            let (n, loss, grad) = run(&clean, discount);
            assert_eq!(n, 8 - 3 + 6 - 2, "model tokens only");
            let (n2, loss2, grad2) = run(&garbage, discount);
            assert_eq!(n2, n);
            assert_eq!(loss.to_bits(), loss2.to_bits(), "loss, γ = {discount}");
            assert!(
                grad.iter()
                    .zip(&grad2)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "gradient, γ = {discount}"
            );
            assert!(grad.iter().any(|&x| x != 0.0));
        }
        // The same garbage on a model token does change the loss: the test can fail.
        let mut moved = clean.clone();
        let mut lp = moved.rollout.samples[0].logprobs.to_vec();
        lp[0] = -37.5;
        moved.rollout.samples[0].logprobs = lp.into();
        assert_ne!(run(&moved, 1.0).1.to_bits(), run(&clean, 1.0).1.to_bits());
    }
}

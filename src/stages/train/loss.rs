//! The loss of a batch on the model: the samples' log-probs, advantages and behaviour
//! log-probs put into the objective ([`objective`]: ratios, surrogate, KL, aggregation),
//! each micro-batch leaving its [`Part`] for the step's statistics (`sums.rs`).

use super::objective::{self, Norm};
use super::{LossAgg, RoutingMode, TrainerSettings, credit};
use crate::model::logprobs::{
    Routed, Scored, ScoredSeq, completion_logprobs, completion_logprobs_routed, scored,
    scored_through,
};
use crate::model::recompute::Checkpoints;
use crate::model::{Kernels, ModelError, Policy};
use crate::schema::{Sample, ScoredGroup};
use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use std::collections::HashMap;
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
    /// Each completion, for the versions that sampled it (decoupled PPO's log-linear
    /// proximal).
    sampled: Vec<&'a Sample>,
    /// Decoupled PPO, recomputed: the proximal log-probs of each completion.
    prox: Vec<&'a [f32]>,
}

/// Decoupled PPO, recomputed: the log-probs of each sample's completion tokens under the
/// policy before the step, by group id (a group's samples in order).
pub type Proximal = HashMap<String, Vec<Vec<f32>>>;

/// What a token's importance ratio is taken against.
#[derive(Debug, Clone, Copy)]
pub enum Prox {
    /// The behaviour policy μ that sampled it: r = π_θ/μ.
    Behaviour,
    /// Decoupled PPO whose proximal policy is the one the forward runs (a step of one
    /// update): log π_prox = sg(log π_θ).
    Current,
    /// Decoupled PPO: the proximal log-probs a forward of the policy before the step found
    /// ([`Samples::of`]'s `proximal`).
    Recomputed,
    /// Decoupled PPO, log-linear: log π_prox = log μ + α·(sg(log π_θ) − log μ) per token,
    /// α = (v_prox − v_μ) / (v_prox + 1 − v_μ); `version` is v_prox, the trainer's version
    /// before the step (the step makes v_prox + 1).
    Loglinear { version: u64 },
}

/// What one optimizer update of a step runs with: the norm of its groups (all ranks),
/// what its ratios are taken against, and whether it is the step's first update (the one
/// whose policy is the step's starting policy: its tokens give the behaviour statistics).
#[derive(Debug, Clone, Copy)]
pub struct Pass {
    pub norm: Norm,
    pub prox: Prox,
    pub first: bool,
}

impl Pass {
    /// The one update of a step over `groups`, its ratios against the behaviour policy, or
    /// for decoupled PPO against the current one: with one update per step the proximal
    /// policy (the one before the step) is the one the forward runs, exactly, whichever
    /// `prox_logp_method`.
    pub fn whole(groups: &[&ScoredGroup], cfg: &TrainerSettings) -> Self {
        Pass {
            norm: norm(groups, cfg),
            prox: if cfg.train.use_decoupled_loss {
                Prox::Current
            } else {
                Prox::Behaviour
            },
            first: true,
        }
    }
}

impl<'a> Samples<'a> {
    /// The groups' samples with their advantages: per token (by [`credit`]) for a group
    /// that carries `token_rewards`, its outcome advantage broadcast otherwise. `discount`
    /// is `train.token_discount`; `proximal`, decoupled PPO's recomputed log-probs, holds
    /// every group's when given.
    pub fn of(
        groups: &[&'a ScoredGroup],
        discount: f32,
        proximal: Option<&'a Proximal>,
    ) -> Result<Self, ModelError> {
        let mut out = Samples {
            seqs: Vec::new(),
            adv: Vec::new(),
            behaviour: Vec::new(),
            own: Vec::new(),
            sampled: Vec::new(),
            prox: Vec::new(),
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
                out.sampled.push(s);
            }
            out.own.extend(own);
            if let Some(p) = proximal {
                let id = &g.rollout.group_id;
                let of_group = p
                    .get(id)
                    .filter(|lps| lps.len() == g.rollout.samples.len())
                    .ok_or_else(|| {
                        ModelError::Unsupported(format!(
                            "decoupled PPO: no proximal log-probs for group {id}"
                        ))
                    })?;
                out.prox.extend(of_group.iter().map(|lp| lp.as_slice()));
            }
        }
        Ok(out)
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
    /// The ratio each token's loss used (against μ, or decoupled PPO's proximal policy).
    pub(super) r: Vec<f32>,
    /// Each token's log π_θ − log μ: how far the trainer is from the behaviour.
    pub(super) g: Vec<f32>,
    /// Decoupled PPO: each token's log π_prox − log μ (empty otherwise).
    pub(super) w: Vec<f32>,
    /// Each token's advantage: whether its clip binds depends on its sign.
    pub(super) a: Vec<f32>,
    /// 0 where off-policy masking or the behaviour weight's cap dropped the token (empty
    /// when nothing is masked).
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) l: Vec<f32>,
    /// Each token's entropy of the policy's distribution (empty when not computed).
    pub(super) h: Vec<f32>,
    /// Completion tokens per row of the host copies.
    pub(super) cols: usize,
    /// Whether this part is of the step's first update.
    pub(super) first: bool,
    pub(super) loss: f64,
    pub(super) ref_kl: f64,
    /// MoE: recorded routing decisions seen, and those the live router makes differently.
    pub(super) routing: crate::model::logprobs::RoutingStats,
}

/// How an MoE policy's tokens are routed in the trainer (`train.routing`).
fn routed(cfg: &TrainerSettings) -> Routed {
    match cfg.train.routing {
        RoutingMode::Replay => Routed::Replay,
        RoutingMode::Live => Routed::Live,
    }
}

/// Each sample's completion log-probs under `model`, without gradient, micro-batch by
/// micro-batch (`micro_batch_tokens`): what the trainer's forward computes for them.
pub fn logprobs<B: Kernels>(
    model: &Policy<B>,
    samples: &Samples,
    cfg: &TrainerSettings,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let mut out = Vec::with_capacity(samples.seqs.len());
    for range in samples.micro_batches(cfg.train.micro_batch_tokens) {
        let seqs = &samples.seqs[range];
        let (lp, _, _) =
            completion_logprobs_routed(model, seqs, cfg.policy.temperature, routed(cfg));
        let c = lp.dims()[1];
        let lp = host(lp)?;
        for (i, s) in seqs.iter().enumerate() {
            out.push(lp[i * c..i * c + s.completion.len()].to_vec());
        }
    }
    Ok(out)
}

/// The proximal log-probs of the samples in `range` as `[rows × c]` (0 past a
/// completion), for `pass.prox`; `None` when the ratio is against the behaviour.
fn proximal<B: AutodiffBackend>(
    samples: &Samples,
    range: Range<usize>,
    lp: &Tensor<B, 2>,
    mu: &Tensor<B, 2>,
    prox: Prox,
) -> Option<Tensor<B, 2>> {
    let [b, c] = lp.dims();
    let host = |fill: &dyn Fn(usize, &mut [f32])| {
        let mut out = vec![0f32; b * c];
        for (i, k) in range.clone().enumerate() {
            fill(k, &mut out[i * c..(i + 1) * c]);
        }
        Tensor::<B, 2>::from_data(TensorData::new(out, [b, c]), &lp.device())
    };
    match prox {
        Prox::Behaviour => None,
        Prox::Current => Some(lp.clone().detach()),
        Prox::Recomputed => Some(host(&|k, row| {
            let p = samples.prox[k];
            row[..p.len()].copy_from_slice(p);
        })),
        Prox::Loglinear { version } => {
            let alpha = host(&|k, row| {
                let sample = samples.sampled[k];
                for (t, x) in row.iter_mut().enumerate().take(sample.tokens.len()) {
                    let behind = version.saturating_sub(sample.version_at(t)) as f32;
                    *x = behind / (behind + 1.0);
                }
            });
            Some(mu.clone() + alpha * (lp.clone().detach() - mu.clone()))
        }
    }
}

/// The behaviour log-probs `[rows × c]` and the advantages of the samples in `range`,
/// and where an episode's environment tokens are, a 0/1 mask of the model's own tokens.
fn token_inputs(
    samples: &Samples,
    range: Range<usize>,
    c: usize,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let b = range.len();
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
    (mu, a_tok, context.then_some(own))
}

/// A part's per-token surrogate, with what the statistics read of it.
struct Surrogate<B: Backend> {
    per_token: Tensor<B, 2>,
    /// The ratios the surrogate used.
    ratio: Tensor<B, 2>,
    /// log π_θ − log μ.
    gap: Tensor<B, 2>,
    /// Decoupled PPO: log π_prox − log μ.
    behaviour: Option<Tensor<B, 2>>,
    /// 1 on the tokens masking keeps; `None` when nothing is masked.
    kept: Option<Tensor<B, 2>>,
}

/// The surrogate of log-probs `lp` against the behaviour `mu`, or for decoupled PPO
/// against the proximal log-probs `prox`, each token weighed by π_prox/μ.
fn surrogate<B: AutodiffBackend>(
    lp: &Tensor<B, 2>,
    mu: Tensor<B, 2>,
    adv: Tensor<B, 2>,
    valid: &Tensor<B, 2>,
    prox: Option<Tensor<B, 2>>,
    t: &super::TrainConfig,
) -> Surrogate<B> {
    let gap = objective::log_ratios(lp, mu.clone(), valid);
    // The ratio's anchor, and what off-policy masking reads: the behaviour's log-ratio, or
    // for decoupled PPO the proximal policy's log-ratio to the behaviour.
    let (log_ratio, behaviour) = match prox {
        None => (gap.clone(), None),
        Some(prox) => (
            objective::log_ratios(lp, prox.clone(), valid),
            Some(objective::log_ratios(&prox, mu, valid)),
        ),
    };
    let masked = behaviour.clone().unwrap_or_else(|| gap.clone().detach());
    let mut kept = objective::kept(masked, valid, t);
    let ratio = objective::ratios(lp, log_ratio, valid, t.loss);
    let mut per_token = objective::surrogate(ratio.clone(), adv, lp.clone(), t);
    if let Some(lw) = &behaviour {
        let (weight, capped) = objective::behaviour_weights(lw.clone(), t.behav_imp_weight_cap);
        per_token = per_token * weight;
        kept = match (kept, capped) {
            (Some(k), Some(c)) => Some(k * c),
            (k, c) => k.or(c),
        };
    }
    Surrogate {
        per_token,
        ratio,
        gap,
        behaviour,
        kept,
    }
}

/// A part's loss, its statistics, and with gradient checkpointing what the backward needs
/// after the loss's ([`part`]).
pub type PartOf<B> = (Tensor<B, 1>, Part, Option<Checkpoints<B>>);

/// The loss of the samples in `range`: their per-token surrogate (and KL) weighted by the
/// update's norm (token-mean: divided by the whole update's token count), so that the
/// parts of an update add up to its loss and their gradients to its gradient. With
/// `train.gradient_checkpointing`, the trunk's activations are recomputed layer by layer
/// in the backward: what [`Checkpoints::backward`] needs to finish it after the loss's
/// comes third.
pub fn part<B: AutodiffBackend + Kernels>(
    model: &Policy<B>,
    reference: Option<&Policy<B::InnerBackend>>,
    samples: &Samples,
    range: Range<usize>,
    pass: &Pass,
    cfg: &TrainerSettings,
) -> Result<PartOf<B>, ModelError>
where
    B::InnerBackend: Kernels,
{
    let device = model.device();
    let seqs = &samples.seqs[range.clone()];
    let b = seqs.len();
    let norm = &pass.norm;
    let (pass_of, saved) = teacher_forced(model, seqs, cfg);
    let (lp, valid) = (pass_of.lp.clone(), pass_of.valid.clone());
    let c = lp.dims()[1];
    let (mu, a_tok, own) = token_inputs(samples, range.clone(), c);
    let valid = match own {
        Some(own) => valid * Tensor::<B, 2>::from_data(TensorData::new(own, [b, c]), &device),
        None => valid,
    };
    let mu = Tensor::<B, 2>::from_data(TensorData::new(mu, [b, c]), &device);
    let adv = Tensor::<B, 2>::from_data(TensorData::new(a_tok.clone(), [b, c]), &device);
    let t = &cfg.train;
    let prox = proximal(samples, range, &lp, &mu, pass.prox);
    let Surrogate {
        per_token,
        ratio,
        gap,
        behaviour,
        kept,
    } = surrogate(&lp, mu, adv, &valid, prox, t);
    // Token-mean divides one sum by the update's tokens (as it always has, bit for bit);
    // the other modes weigh each row. `on` is 1 where a token's loss counts.
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
    // The policy's entropy: with its gradient for the bonus, else as a statistic of the
    // step's first update (no graph).
    let entropy = if t.entropy_coeff != 0.0 {
        let h = pass_of.entropy(model);
        let bonus = weighted(h.clone(), valid.clone());
        total = total - bonus.mul_scalar(t.entropy_coeff);
        match pass.first {
            true => host(h.detach())?,
            false => Vec::new(),
        }
    } else if pass.first && t.calculate_entropy {
        host(pass_of.entropy_detached(&model.valid()))?
    } else {
        Vec::new()
    };
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
        g: host(gap.detach())?,
        w: behaviour.map(host).transpose()?.unwrap_or_default(),
        a: a_tok,
        k: kept.map(host).transpose()?.unwrap_or_default(),
        v: host(valid)?,
        l: host(lp.detach())?,
        h: entropy,
        cols: c,
        first: pass.first,
        loss: f64::from(scalar(total.clone().detach())?),
        ref_kl,
        routing: pass_of.routing,
    };
    Ok((total, part, saved))
}

/// The teacher-forced pass of `seqs` [`part`] takes its loss from, and with
/// `train.gradient_checkpointing` what its backward needs after the loss's.
fn teacher_forced<B: AutodiffBackend + Kernels>(
    model: &Policy<B>,
    seqs: &[ScoredSeq<'_>],
    cfg: &TrainerSettings,
) -> (Scored<B>, Option<Checkpoints<B>>)
where
    B::InnerBackend: Kernels,
{
    let (temperature, routed) = (cfg.policy.temperature, routed(cfg));
    if !cfg.train.gradient_checkpointing {
        return (scored(model, seqs, temperature, routed), None);
    }
    let mut saved = None;
    let trunk = |tokens, routes: &mut _| {
        let (hidden, s) = model.hidden_checkpointed(tokens, routes);
        saved = Some(s);
        hidden
    };
    let pass_of = scored_through(model, seqs, temperature, routed, trunk);
    (pass_of, saved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TrainBackend;
    use crate::model::config::{Architecture, ModelConfig};
    use crate::schema::{SchemaVersion, examples};
    use burn::tensor::backend::AutodiffBackend;

    type Inner = <TrainBackend as AutodiffBackend>::InnerBackend;

    fn host2(t: Tensor<Inner, 2>) -> Vec<f32> {
        crate::model::host_f32(t.into_data()).unwrap()
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
            let samples = Samples::of(&[g], cfg.train.token_discount, None).unwrap();
            assert_eq!(tokens(&[g]), 2);
            let norm = norm(&[g], &cfg);
            assert_eq!(norm.tokens, 2.0);
            let pass = Pass {
                norm,
                prox: Prox::Behaviour,
                first: true,
            };
            let (total, _, _) = part(&model, None, &samples, 0..1, &pass, &cfg).unwrap();
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

    fn tiny_llama(seed: u64) -> Policy<TrainBackend> {
        let cfg = ModelConfig::tiny(Architecture::Llama, 16);
        Policy::<TrainBackend>::random(&cfg, seed, &Default::default()).unwrap()
    }

    /// A group of two samples of four tokens under a tiny random Llama, its behaviour
    /// log-probs the model's own less `offset` (every behaviour weight π/μ = e^offset),
    /// advantages ±1; sample 1 was sampled by version 1 up to token 2, then by 3.
    fn offset_group(model: &Policy<TrainBackend>, offset: f32) -> ScoredGroup {
        let mut rollout = examples::rollout_group(2, 4, 16, 0);
        for s in &mut rollout.samples {
            s.mask = None;
            s.versions = vec![(0, 3).into()];
            let seq = ScoredSeq::plain(&rollout.prompt_tokens, &s.tokens);
            let lp = host(completion_logprobs(model, &[seq], 1.0).0).unwrap();
            s.logprobs = lp.iter().map(|x| x - offset).collect::<Vec<f32>>().into();
        }
        rollout.samples[1].versions = vec![(0, 1).into(), (2, 3).into()];
        ScoredGroup {
            schema: SchemaVersion::CURRENT,
            rewards: vec![1.0, 0.0],
            advantages: vec![1.0, -1.0],
            rollout,
            token_rewards: None,
            ref_logprobs: None,
            scorer_id: "offset".into(),
            scored_us: 0,
        }
    }

    /// Decoupled PPO with one update (π_prox the current policy) weighs each token by
    /// w = π/μ and clips r = π/π_prox = 1, which never binds: its gradient is
    /// −(1/N)·Σ w·A·∇lp, TIS's with the weight untruncated (e^0.3 < is_cap). The losses
    /// differ (−Σ w·A / N against −Σ w·A·lp / N), the gradients agree.
    #[test]
    fn decoupled_ppo_with_one_update_has_the_untruncated_tis_gradient() {
        let model = tiny_llama(5);
        let g = offset_group(&model, 0.3);
        let run = |cfg: &TrainerSettings| {
            let samples = Samples::of(&[&g], 1.0, None).unwrap();
            let (total, part, _) =
                part(&model, None, &samples, 0..2, &Pass::whole(&[&g], cfg), cfg).unwrap();
            let grads = total.backward();
            (part, host2(model.embed.weight.val().grad(&grads).unwrap()))
        };
        let mut cfg = TrainerSettings::default();
        cfg.train.loss = super::super::LossKind::Tis;
        let (tis, want) = run(&cfg);
        cfg.train.loss = super::super::LossKind::Ppo;
        cfg.train.use_decoupled_loss = true;
        let (dec, got) = run(&cfg);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 1e-4);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5 * scale.max(1.0), "{a} vs {b}");
        }
        assert!(
            dec.r
                .iter()
                .zip(&dec.v)
                .all(|(r, v)| *v == 0.0 || *r == 1.0)
        );
        assert!(
            dec.w
                .iter()
                .zip(&dec.v)
                .all(|(w, v)| *v == 0.0 || (w - 0.3).abs() < 1e-5)
        );
        assert!((dec.loss - tis.loss).abs() > 1e-3, "the losses differ");
        // A cap below e^0.3 drops every token.
        cfg.train.behav_imp_weight_cap = 1.2;
        let (capped, grad) = run(&cfg);
        assert!(capped.k.iter().all(|&k| k == 0.0));
        assert!(grad.iter().all(|&x| x == 0.0));
    }

    /// Log-linear proximal log-probs at v_prox = 3: tokens sampled by version 3 have α = 0
    /// (π_prox = μ), those by version 1 α = 2/3, so log π_prox − log μ = α·(lp − log μ).
    #[test]
    fn loglinear_proximal_by_hand() {
        let model = tiny_llama(6);
        let g = offset_group(&model, 0.3);
        let mut cfg = TrainerSettings::default();
        cfg.train.use_decoupled_loss = true;
        let samples = Samples::of(&[&g], 1.0, None).unwrap();
        let pass = Pass {
            norm: norm(&[&g], &cfg),
            prox: Prox::Loglinear { version: 3 },
            first: true,
        };
        let (_, p, _) = part(&model, None, &samples, 0..2, &pass, &cfg).unwrap();
        let c = p.cols;
        for row in 0..2 {
            for t in 0..4 {
                let i = row * c + t;
                let alpha = if row == 1 && t < 2 { 2.0 / 3.0 } else { 0.0 };
                assert!((p.g[i] - 0.3).abs() < 1e-5);
                assert!(
                    (p.w[i] - alpha * p.g[i]).abs() < 1e-5,
                    "row {row} token {t}"
                );
            }
        }
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
            let samples = Samples::of(&[g], discount, None).unwrap();
            let n = tokens(&[g]);
            let (total, part, _) =
                part(&model, None, &samples, 0..2, &Pass::whole(&[g], &cfg), &cfg).unwrap();
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

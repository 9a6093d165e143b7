//! The objectives on tensors, apart from the model: the importance ratios (per token, or
//! per sequence for GSPO), each loss's per-token surrogate, the KL estimators, and the
//! weights that aggregate per-token losses into the step's loss (`loss_agg_mode`).
//!
//! Every function takes `[rows × completion tokens]` tensors where `valid` is 1 on the
//! tokens the loss counts (the model's own completion tokens) and 0 elsewhere.

use super::{IsMask, KlKind, LossAgg, LossKind, TrainConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

/// A sequence's log-ratio is clamped to this before `exp` (GSPO), as verl does: a sequence
/// far off-policy gets a large finite ratio, never an infinite one.
const MAX_SEQ_LOG_RATIO: f32 = 10.0;

/// What a step's loss is divided by, counted over all its groups, so that micro-batches
/// and trainer ranks add up to the step's loss: its model tokens, its sequences, and the
/// length `seq-mean-token-sum-norm` divides by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Norm {
    pub tokens: f32,
    pub sequences: f32,
    /// `loss_scale_factor`, or the step's longest completion in model tokens when it is 0.
    pub length: f32,
}

impl Norm {
    /// The norm of a step with these model tokens per sequence.
    pub fn of(tokens_per_sequence: impl IntoIterator<Item = usize>, cfg: &TrainConfig) -> Self {
        let (mut tokens, mut sequences, mut longest) = (0usize, 0usize, 0usize);
        for t in tokens_per_sequence {
            tokens += t;
            sequences += 1;
            longest = longest.max(t);
        }
        let length = if cfg.loss_scale_factor > 0.0 {
            cfg.loss_scale_factor
        } else {
            longest.max(1) as f32
        };
        Norm {
            tokens: tokens.max(1) as f32,
            sequences: sequences.max(1) as f32,
            length,
        }
    }
}

/// Each row's weight in the step's loss, `[rows × 1]`: the step's loss is
/// Σ_rows weight · Σ_tokens loss. `token-mean` weighs every token alike (1 / tokens);
/// `seq-mean-token-mean` averages each sequence's tokens, then the sequences
/// (1 / (sequences · its tokens)); `seq-mean-token-sum` sums each sequence's tokens and
/// averages the sequences (1 / sequences); `seq-mean-token-sum-norm` (Dr. GRPO) divides
/// those sums by one constant length (1 / (sequences · length)).
pub fn row_weights<B: Backend>(valid: &Tensor<B, 2>, norm: &Norm, agg: LossAgg) -> Tensor<B, 2> {
    let ones = valid.clone().sum_dim(1).ones_like();
    match agg {
        LossAgg::TokenMean => ones.div_scalar(norm.tokens),
        LossAgg::SeqMeanTokenMean => {
            let own = valid.clone().sum_dim(1).clamp_min(1.0);
            ones.div(own).div_scalar(norm.sequences)
        }
        LossAgg::SeqMeanTokenSum => ones.div_scalar(norm.sequences),
        LossAgg::SeqMeanTokenSumNorm => ones.div_scalar(norm.sequences * norm.length),
    }
}

/// Each token's log-ratio log(π_θ/μ), 0 off `valid`.
pub fn log_ratios<B: Backend>(
    lp: &Tensor<B, 2>,
    mu: Tensor<B, 2>,
    valid: &Tensor<B, 2>,
) -> Tensor<B, 2> {
    (lp.clone() - mu) * valid.clone()
}

/// The importance ratio each token's loss uses, from the [`log_ratios`]: π_θ/μ per token,
/// or for GSPO the sequence's ratio exp(mean_t log(π_θ/μ)) on every token of it, whose
/// gradient at each token is that of its own log-prob scaled by the sequence ratio
/// (GSPO-token with the sequence's advantage, arXiv 2507.18071, eq. 13).
pub fn ratios<B: AutodiffBackend>(
    lp: &Tensor<B, 2>,
    log_ratio: Tensor<B, 2>,
    valid: &Tensor<B, 2>,
    loss: LossKind,
) -> Tensor<B, 2> {
    let log_ratio = match loss {
        LossKind::Gspo => {
            let c = lp.dims()[1];
            let own = valid.clone().sum_dim(1).clamp_min(1.0);
            let seq = log_ratio.sum_dim(1).div(own).detach().repeat_dim(1, c);
            let per_token = lp.clone() - lp.clone().detach() + seq;
            per_token.clamp_max(MAX_SEQ_LOG_RATIO) * valid.clone()
        }
        _ => log_ratio,
    };
    log_ratio.exp()
}

/// Off-policy masking: 1 on the tokens the loss keeps, 0 on those `is_mask` drops, from the
/// per-token log-ratios log(π_θ/μ) (0 off `valid`; no gradient flows through the mask).
/// `token` drops each token whose ratio is outside [is_mask_low, is_mask_high]; `sequence`
/// every token of a sequence whose geometric-mean ratio exp(mean_t log r) is. `None` when
/// nothing is masked.
pub fn kept<B: Backend>(
    log_ratio: Tensor<B, 2>,
    valid: &Tensor<B, 2>,
    cfg: &TrainConfig,
) -> Option<Tensor<B, 2>> {
    let (lo, hi) = (cfg.is_mask_low.ln(), cfg.is_mask_high.ln());
    let inside =
        |x: Tensor<B, 2>| x.clone().greater_equal_elem(lo).float() * x.lower_equal_elem(hi).float();
    match cfg.is_mask {
        IsMask::None => None,
        IsMask::Token => Some(inside(log_ratio)),
        IsMask::Sequence => {
            let c = log_ratio.dims()[1];
            let own = valid.clone().sum_dim(1).clamp_min(1.0);
            let mean = (log_ratio * valid.clone()).sum_dim(1).div(own);
            Some(inside(mean).repeat_dim(1, c))
        }
    }
}

/// Decoupled PPO's behaviour weights π_prox/μ from their logs (no gradient flows through
/// them), and with a `cap` > 0 the mask that drops each token whose weight exceeds it
/// (AReaL's behav_imp_weight_cap); `None` when nothing is capped.
pub fn behaviour_weights<B: Backend>(
    log_weight: Tensor<B, 2>,
    cap: f32,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let mask = (cap > 0.0).then(|| log_weight.clone().lower_equal_elem(cap.ln()).float());
    (log_weight.exp(), mask)
}

/// The per-token surrogate loss (the negated objective) of `cfg.loss`, from the ratios of
/// [`ratios`], the per-token advantages and the log-probs `lp`:
/// - `ppo`, `gspo`: −min(r·A, clip(r, 1−ε, 1+ε_high)·A); with `clip_ratio_c` = c > 1,
///   a negative advantage's loss is also capped at −c·A (dual clip, arXiv 1912.09729);
/// - `tis`: −sg(min(r, C))·A·log π;
/// - `cispo`: −sg(clip(r, 1−ε, 1+ε_high))·A·log π: every token keeps its gradient, only the
///   weight is clipped (MiniMax-M1, arXiv 2506.13585);
/// - `reinforce`: −min(r, C)·A.
pub fn surrogate<B: AutodiffBackend>(
    ratio: Tensor<B, 2>,
    adv: Tensor<B, 2>,
    lp: Tensor<B, 2>,
    cfg: &TrainConfig,
) -> Tensor<B, 2> {
    let (lo, hi) = (1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high);
    match cfg.loss {
        LossKind::Ppo | LossKind::Gspo => {
            let unclipped = ratio.clone() * adv.clone();
            let clipped = ratio.clamp(lo, hi) * adv.clone();
            let loss = unclipped.min_pair(clipped).neg();
            if cfg.clip_ratio_c > 0.0 {
                let capped = loss
                    .clone()
                    .min_pair(adv.clone().mul_scalar(-cfg.clip_ratio_c));
                loss.mask_where(adv.lower_elem(0.0), capped)
            } else {
                loss
            }
        }
        LossKind::Tis => (ratio.detach().clamp_max(cfg.is_cap) * adv * lp).neg(),
        LossKind::Cispo => (ratio.detach().clamp(lo, hi) * adv * lp).neg(),
        LossKind::Reinforce => (ratio.clamp_max(cfg.is_cap) * adv).neg(),
    }
}

/// Whether a token of ratio `r` and advantage `a` was clipped (its gradient cut or its
/// weight bounded) by `cfg.loss`: what the step's `clip_fraction` counts.
pub fn clipped(r: f64, a: f64, cfg: &TrainConfig) -> bool {
    let (lo, hi) = (
        f64::from(1.0 - cfg.clip_eps),
        f64::from(1.0 + cfg.clip_eps_high),
    );
    match cfg.loss {
        LossKind::Ppo | LossKind::Gspo => {
            let dual = cfg.clip_ratio_c > 0.0 && a < 0.0 && r > f64::from(cfg.clip_ratio_c);
            (a > 0.0 && r > hi) || (a < 0.0 && r < lo) || dual
        }
        LossKind::Cispo => r < lo || r > hi,
        LossKind::Tis | LossKind::Reinforce => r > f64::from(cfg.is_cap),
    }
}

/// The per-token KL estimate to the reference policy, with d = log π_ref − log π_θ:
/// `k1` −d; `k2` d²/2; `k3` e^d − d − 1 (unbiased, always ≥ 0); `low-var-kl` k3 clamped
/// to [−10, 10] (verl's name for it).
pub fn kl<B: Backend>(lp: Tensor<B, 2>, ref_lp: Tensor<B, 2>, kind: KlKind) -> Tensor<B, 2> {
    let d = ref_lp - lp;
    match kind {
        KlKind::K1 => d.neg(),
        KlKind::K2 => d.powi_scalar(2).mul_scalar(0.5),
        KlKind::K3 => d.clone().exp() - d - 1.0,
        KlKind::LowVarKl => (d.clone().exp() - d - 1.0).clamp(-10.0, 10.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TrainBackend;
    use burn::tensor::TensorData;

    type B = TrainBackend;

    fn t(rows: &[&[f32]]) -> Tensor<B, 2> {
        let (b, c) = (rows.len(), rows[0].len());
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_data(TensorData::new(flat, [b, c]), &Default::default())
    }

    fn host(x: Tensor<B, 2>) -> Vec<f32> {
        crate::model::host_f32(x.into_data()).unwrap()
    }

    fn close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    fn cfg(loss: LossKind) -> TrainConfig {
        TrainConfig {
            loss,
            ..TrainConfig::default()
        }
    }

    /// Two sequences of 3 and 1 model tokens (the second padded): the four modes' row
    /// weights by hand.
    #[test]
    fn row_weights_by_hand() {
        let valid = t(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0]]);
        let mut c = TrainConfig::default();
        let norm = Norm::of([3, 1], &c);
        assert_eq!((norm.tokens, norm.sequences, norm.length), (4.0, 2.0, 3.0));
        let w = |agg| host(row_weights(&valid, &norm, agg));
        close(&w(LossAgg::TokenMean), &[0.25, 0.25]);
        close(&w(LossAgg::SeqMeanTokenMean), &[1.0 / 6.0, 0.5]);
        close(&w(LossAgg::SeqMeanTokenSum), &[0.5, 0.5]);
        close(&w(LossAgg::SeqMeanTokenSumNorm), &[1.0 / 6.0, 1.0 / 6.0]);
        c.loss_scale_factor = 8.0;
        let norm = Norm::of([3, 1], &c);
        close(
            &host(row_weights(&valid, &norm, LossAgg::SeqMeanTokenSumNorm)),
            &[1.0 / 16.0, 1.0 / 16.0],
        );
    }

    /// Log-ratios 0.2, −0.4 on one sequence (mean −0.1) and 0.3 on the other: per token
    /// they stay as they are; GSPO puts each sequence's mean on all its tokens.
    #[test]
    fn gspo_puts_the_sequence_ratio_on_every_token() {
        let lp = t(&[&[-1.0, -2.0], &[-0.5, -9.0]]);
        let mu = t(&[&[-1.2, -1.6], &[-0.8, 0.0]]);
        let valid = t(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let per_token = log_ratios(&lp, mu, &valid);
        close(&host(per_token.clone()), &[0.2, -0.4, 0.3, 0.0]);
        let r = ratios(&lp, per_token, &valid, LossKind::Gspo);
        close(&host(r.clone().log()), &[-0.1, -0.1, 0.3, 0.0]);
        let e = |x: f32| x.exp();
        close(&host(r), &[e(-0.1), e(-0.1), e(0.3), 1.0]);
    }

    /// The surrogates at ratios 0.5, 1.0, 1.5 with advantages +1 and −1, ε = 0.2,
    /// ε_high = 0.28, C = 2, log-prob −2 everywhere.
    #[test]
    fn surrogates_by_hand() {
        let ratio = t(&[&[0.5, 1.0, 1.5], &[0.5, 1.0, 1.5]]);
        let adv = t(&[&[1.0, 1.0, 1.0], &[-1.0, -1.0, -1.0]]);
        let lp = t(&[&[-2.0, -2.0, -2.0], &[-2.0, -2.0, -2.0]]);
        let run = |c: &TrainConfig| host(surrogate(ratio.clone(), adv.clone(), lp.clone(), c));
        // PPO: A > 0 takes min(r, clip(r)) = 0.5, 1, 1.28; A < 0 takes max(r, clip(r)) = 0.8, 1, 1.5.
        close(
            &run(&cfg(LossKind::Ppo)),
            &[-0.5, -1.0, -1.28, 0.8, 1.0, 1.5],
        );
        // Dual clip at c = 1.2 caps the negative-advantage loss at 1.2.
        let mut dual = cfg(LossKind::Ppo);
        dual.clip_ratio_c = 1.2;
        close(&run(&dual), &[-0.5, -1.0, -1.28, 0.8, 1.0, 1.2]);
        // CISPO: −clip(r)·A·lp with clip(r) = 0.8, 1, 1.28.
        close(
            &run(&cfg(LossKind::Cispo)),
            &[1.6, 2.0, 2.56, -1.6, -2.0, -2.56],
        );
        // TIS: −min(r, 2)·A·lp.
        close(
            &run(&cfg(LossKind::Tis)),
            &[1.0, 2.0, 3.0, -1.0, -2.0, -3.0],
        );
        close(
            &run(&cfg(LossKind::Reinforce)),
            &[-0.5, -1.0, -1.5, 0.5, 1.0, 1.5],
        );
    }

    /// Ratios e^0.5 ≈ 1.65, e^1 ≈ 2.72 and e^−1 ≈ 0.37 on one sequence (geometric mean
    /// e^{1/6} ≈ 1.18), e^−0.9 ≈ 0.41 on the other: the band [0.5, 2] keeps the first token
    /// alone, or the first sequence whole.
    #[test]
    fn off_policy_masks_by_hand() {
        let lr = t(&[&[0.5, 1.0, -1.0], &[-0.9, 0.0, 0.0]]);
        let valid = t(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0]]);
        let mut c = TrainConfig::default();
        assert!(kept(lr.clone(), &valid, &c).is_none());
        c.is_mask = IsMask::Token;
        let k = kept(lr.clone(), &valid, &c).unwrap();
        close(&host(k * valid.clone()), &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        c.is_mask = IsMask::Sequence;
        let k = kept(lr, &valid, &c).unwrap();
        close(&host(k * valid), &[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
    }

    /// Which tokens each loss counts as clipped.
    #[test]
    fn clipped_tokens_by_hand() {
        let ppo = cfg(LossKind::Ppo);
        assert!(clipped(1.5, 1.0, &ppo) && !clipped(1.5, -1.0, &ppo));
        assert!(clipped(0.5, -1.0, &ppo) && !clipped(0.5, 1.0, &ppo));
        let mut dual = ppo.clone();
        dual.clip_ratio_c = 3.0;
        assert!(clipped(3.5, -1.0, &dual) && !clipped(2.5, -1.0, &dual));
        let cispo = cfg(LossKind::Cispo);
        assert!(clipped(0.5, 1.0, &cispo) && clipped(1.5, -1.0, &cispo));
        assert!(!clipped(1.1, 1.0, &cispo));
    }

    /// The KL estimators at d = log π_ref − log π = 0.5 and −1.
    #[test]
    fn kl_estimators_by_hand() {
        let lp = t(&[&[-1.0, -1.0]]);
        let ref_lp = t(&[&[-0.5, -2.0]]);
        let k = |kind| host(kl(lp.clone(), ref_lp.clone(), kind));
        close(&k(KlKind::K1), &[-0.5, 1.0]);
        close(&k(KlKind::K2), &[0.125, 0.5]);
        let k3 = |d: f32| d.exp() - d - 1.0;
        close(&k(KlKind::K3), &[k3(0.5), k3(-1.0)]);
        close(&k(KlKind::LowVarKl), &[k3(0.5), k3(-1.0)]);
        let far = host(kl(t(&[&[-20.0]]), t(&[&[0.0]]), KlKind::LowVarKl));
        close(&far, &[10.0]);
    }
}

//! A step's statistics: the sums over its tokens that the parts of one trainer, the ranks
//! of several and the updates of a step add up ([`TokenSums`]), and the step record made of
//! them and of what the step's groups carry.

use super::TrainerSettings;
use super::loss::{Part, tokens};
use super::objective;
use crate::schema::{PromptOutcome, ScoredGroup, StepRecord};
use serde::{Deserialize, Serialize};

/// What a step's statistics are made of, as sums over its tokens (and the largest ratio):
/// the parts of one trainer, the ranks of several, and the updates of a step add up with
/// [`TokenSums::add`].
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
    /// Tokens of the step's first update, over which the behaviour statistics run.
    first_n: f64,
    mkl: f64,
    gap: f64,
    nll: f64,
    /// Σ of the policy's entropy, and the tokens it was computed on.
    entropy: f64,
    entropy_n: f64,
    /// Decoupled PPO: Σ |log π_prox − log μ|.
    prox_gap: f64,
    /// Sequences, and the sums of their ratios and squared ratios.
    seqs: f64,
    seq_r: f64,
    seq_r2: f64,
}

impl TokenSums {
    /// The sums over `parts`, token by token in order.
    pub fn of(parts: &[Part], cfg: &TrainerSettings) -> Self {
        let mut s = TokenSums::default();
        for p in parts {
            s.loss += p.loss;
            s.ref_kl += p.ref_kl;
            // The router against the recorded routing: a behaviour statistic, taken on
            // the step's first update as the log-prob gap is.
            if p.first {
                s.compared += p.routing.compared as u64;
                s.differ += p.routing.differ as u64;
            }
            s.tokens(p, cfg);
        }
        s
    }

    /// The loss these sums hold (an update's, summed over its parts and ranks).
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// Another trainer rank's (or update's) sums added to these.
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
        self.first_n += o.first_n;
        self.mkl += o.mkl;
        self.gap += o.gap;
        self.nll += o.nll;
        self.entropy += o.entropy;
        self.entropy_n += o.entropy_n;
        self.prox_gap += o.prox_gap;
        self.seqs += o.seqs;
        self.seq_r += o.seq_r;
        self.seq_r2 += o.seq_r2;
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
            if let Some(&w) = p.w.get(i) {
                self.prox_gap += f64::from(w).abs();
            }
            self.nll -= f64::from(p.l[i]);
            if let Some(&h) = p.h.get(i) {
                self.entropy += f64::from(h);
                self.entropy_n += 1.0;
            }
            if p.first {
                let g = f64::from(p.g[i]);
                self.first_n += 1.0;
                self.mkl += g.exp() - 1.0 - g;
                self.gap += g.abs();
            }
        }
        // Each sequence's ratio: the geometric mean of its tokens' (GSPO's own ratio).
        for (row, v) in p.r.chunks(p.cols.max(1)).zip(p.v.chunks(p.cols.max(1))) {
            let (sum, n) = row
                .iter()
                .zip(v)
                .filter(|(_, v)| **v != 0.0)
                .fold((0f64, 0f64), |(s, n), (r, _)| {
                    (s + f64::from(*r).ln(), n + 1.0)
                });
            if n > 0.0 {
                let r = (sum / n).exp();
                self.seqs += 1.0;
                self.seq_r += r;
                self.seq_r2 += r * r;
            }
        }
    }

    /// The step's statistics from these sums over its `updates`, and what its groups carry:
    /// the loss and KL are each update's mean, the ratios' statistics run over every
    /// update's tokens, the behaviour's over the first update's.
    pub fn record(&self, groups: &[&ScoredGroup], updates: usize) -> StepRecord {
        let n = self.n.max(1.0);
        let first = self.first_n.max(1.0);
        let per_update = updates.max(1) as f64;
        let rewards: Vec<f32> = groups
            .iter()
            .flat_map(|g| g.rewards.iter().copied())
            .collect();
        let seqs = self.seqs.max(1.0);
        let seq_mean = self.seq_r / seqs;
        StepRecord {
            loss: self.loss / per_update,
            ref_kl: self.ref_kl / per_update,
            teacher_kl: teacher_kl(groups),
            routing_mismatch: (self.compared > 0)
                .then(|| self.differ as f64 / self.compared as f64),
            swap_tokens: swap_tokens(groups),
            reward_mean: rewards.iter().map(|&x| f64::from(x)).sum::<f64>()
                / rewards.len().max(1) as f64,
            accuracy: rewards
                .iter()
                .filter(|&&x| PromptOutcome::passes(x))
                .count() as f64
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
            seq_ratio_std: (self.seq_r2 / seqs - seq_mean * seq_mean).max(0.0).sqrt(),
            mismatch_kl: self.mkl / first,
            logprob_gap: self.gap / first,
            prox_gap: self.prox_gap / n,
            sampled_nll: self.nll / n,
            policy_entropy: self.entropy / self.entropy_n.max(1.0),
            updates: updates as u64,
            groups: groups.len() as u64,
            tokens: tokens(groups) as u64,
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
    use crate::schema::{RolloutGroup, SchemaVersion, examples};

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
}

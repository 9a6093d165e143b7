//! `StepRecord`: what one optimizer step did. One typed record for the trainer, the `step`
//! event's fields, `rlstream status`, `replay`, the run report and the metrics. On the wire
//! it stays an open map of named numbers ([`Event::fields`](super::Event)), so readers in
//! other languages need no schema change when a field is added, and older events without a
//! field read as its default.

use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepRecord {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Policy version after the step.
    pub version: u64,
    pub loss: f64,
    pub reward_mean: f64,
    /// Fraction of samples with full reward (≥ 1).
    pub accuracy: f64,
    /// (Σr)² / (N·Σr²) over tokens: 1 when on-policy.
    pub ess: f64,
    /// Share of tokens whose loss the objective's clip changed (docs/objectives.md, "The
    /// step record").
    pub clip_fraction: f64,
    /// Share of tokens off-policy masking dropped from the loss (`train.is_mask`).
    pub masked_fraction: f64,
    /// The ratios the objective used (π_θ/μ, or for decoupled PPO π_θ/π_prox), over the
    /// tokens of every update of the step.
    pub ratio_mean: f64,
    pub ratio_max: f64,
    /// Standard deviation over the step's sequences of their ratio: GSPO's sequence ratio,
    /// the geometric mean of the token ratios under the other objectives.
    pub seq_ratio_std: f64,
    /// KL(μ‖π) estimated on the sampled tokens (k3), on the step's first update (the one
    /// whose policy is the step's starting policy).
    pub mismatch_kl: f64,
    /// Mean |log π − log μ| over the sampled tokens: how far the trainer's log-probs are
    /// from the behaviour log-probs. Exactly 0 when every token is on-policy (weights in
    /// f32, no swap inside a completion): the sampler and the trainer compute a log-prob
    /// bit for bit alike, so any gap is staleness, a swap, or bf16 on the wire.
    /// Measured on the step's first update, as `mismatch_kl`.
    pub logprob_gap: f64,
    /// Decoupled PPO: mean |log π_prox − log μ| over the tokens, how stale the behaviour is
    /// against the proximal policy (0 otherwise, and in a `--sync` run).
    pub prox_gap: f64,
    /// Sampled tokens drawn after a weight swap inside their completion: their KV cache
    /// holds keys and values an older version computed, so no one version's teacher-forced
    /// log-prob equals theirs exactly (counted from each sample's version runs; for an
    /// episode, whose cache a new turn rebuilds, an upper bound).
    pub swap_tokens: u64,
    /// Mixture-of-experts policies: the fraction of the recorded (token, MoE layer)
    /// routing decisions for which the trainer's live router picks other experts, on the
    /// step's first update. None when no group carried routing.
    pub routing_mismatch: Option<f64>,
    /// KL to the initial policy (k3), when `kl_coef` > 0.
    pub ref_kl: f64,
    /// KL(student ‖ teacher) on the sampled tokens (mean behaviour − teacher log-prob) of
    /// the step's groups a teacher scored; none (not in the event's fields, null in the
    /// report's JSON, empty in its CSV) when none was.
    pub teacher_kl: Option<f64>,
    /// Mean negative log-prob of the sampled tokens under the trainer's policy (a Monte
    /// Carlo estimate of the entropy; `entropy` in step events before this name).
    pub sampled_nll: f64,
    /// Mean entropy of the policy's distribution (after temperature and the sampling mask)
    /// over the completion tokens, on the step's first update (0 with
    /// `calculate_entropy = false`).
    pub policy_entropy: f64,
    /// Optimizer updates the step took (`ppo_mini_batch_size`, `ppo_epochs`).
    pub updates: u64,
    pub grad_norm: f64,
    /// Groups in the step.
    pub groups: u64,
    /// Completion tokens trained on.
    pub tokens: u64,
    /// Versions behind the trainer, mean and most over the step's groups.
    pub staleness_mean: f64,
    pub staleness_max: u64,
    /// Seconds spent waiting for data before this step, and in the step.
    pub wait_s: f64,
    pub step_s: f64,
    /// Groups dynamic sampling kept out since the previous step (`train.filter_groups`):
    /// the stream replaced each.
    pub filtered_groups: u64,
    /// Completions cut at `max_new_tokens` in the groups the trainer took in since the
    /// previous step, and those of them kept out of the loss (`train.mask_truncated`).
    pub truncated_samples: u64,
    pub masked_samples: u64,
    /// Groups trained and dropped since the run began.
    pub trained_groups: u64,
    pub dropped_groups: u64,
    /// The step was skipped: the loss or the gradient was not finite (1 on the wire).
    #[serde(deserialize_with = "bool_or_number")]
    pub skipped: bool,
    /// Versions behind the trainer, per group (in process only: the metrics' histogram).
    #[serde(skip)]
    pub staleness: Vec<u64>,
}

/// A field that is not a number on the wire.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("step event field: {0}")]
pub struct StepFieldError(String);

impl StepRecord {
    /// The record as an event's named numbers (`skipped` as 0 or 1).
    pub fn to_fields(&self) -> BTreeMap<String, f64> {
        let Ok(serde_json::Value::Object(map)) = serde_json::to_value(self) else {
            return BTreeMap::new();
        };
        map.into_iter()
            .filter_map(|(k, v)| {
                let x = match v {
                    serde_json::Value::Number(n) => n.as_f64()?,
                    serde_json::Value::Bool(b) => f64::from(u8::from(b)),
                    _ => return None,
                };
                Some((k, x))
            })
            .collect()
    }

    /// The record an event's named numbers describe; missing fields read as their
    /// default, unknown ones are ignored, a count that is not a whole number is an error.
    pub fn from_fields(fields: &BTreeMap<String, f64>) -> Result<Self, StepFieldError> {
        let map = fields
            .iter()
            .map(|(k, &v)| {
                let n = if v.fract() == 0.0 && v.abs() < 9.0e15 {
                    serde_json::Number::from(v as i64)
                } else {
                    serde_json::Number::from_f64(v)
                        .ok_or_else(|| StepFieldError(format!("`{k}` is {v}")))?
                };
                Ok((k.clone(), serde_json::Value::Number(n)))
            })
            .collect::<Result<serde_json::Map<_, _>, StepFieldError>>()?;
        serde_json::from_value(serde_json::Value::Object(map))
            .map_err(|e| StepFieldError(e.to_string()))
    }
}

fn bool_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Flag {
        Bool(bool),
        Number(f64),
    }
    Ok(match Flag::deserialize(d)? {
        Flag::Bool(b) => b,
        Flag::Number(x) => x != 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_with_integers_as_integers() {
        let r = StepRecord {
            step: 3,
            version: 4,
            loss: -0.25,
            tokens: 96,
            staleness_max: 2,
            skipped: true,
            teacher_kl: Some(0.125),
            ..StepRecord::default()
        };
        let f = r.to_fields();
        assert_eq!(f["teacher_kl"], 0.125);
        let none = StepRecord::default().to_fields();
        assert!(!none.contains_key("teacher_kl"), "{none:?}");
        assert_eq!(StepRecord::from_fields(&none).unwrap().teacher_kl, None);
        assert_eq!(f["step"], 3.0);
        assert_eq!(f["skipped"], 1.0);
        assert_eq!(StepRecord::from_fields(&f).unwrap(), r);
        // An older event without a field, and one with an unknown field, still read.
        let mut old = BTreeMap::from([("step".to_string(), 7.0), ("later".to_string(), 1.5)]);
        assert_eq!(StepRecord::from_fields(&old).unwrap().step, 7);
        old.insert("step".into(), 7.5);
        assert!(StepRecord::from_fields(&old).is_err(), "a fractional step");
    }
}

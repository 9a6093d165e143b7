//! `ScoredGroup`: a rollout group with rewards and advantages, ready for the trainer.

use super::error::check_finite;
use super::{CodecError, Floats, Message, RolloutGroup, SchemaVersion};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoredGroup {
    pub schema: SchemaVersion,
    /// The rollout exactly as the generator published it.
    pub rollout: RolloutGroup,
    /// One scalar reward per sample.
    pub rewards: Vec<f32>,
    /// One advantage per sample (group-normalised by the scorer).
    pub advantages: Vec<f32>,
    /// Optional rewards placed on tokens, one array per sample with one entry per completion
    /// token: a reward sits on the token that earns it (a step's or turn's last token, or
    /// every token for a teacher's signal). The trainer turns them into per-token
    /// advantages added to the outcome advantage (`stages::train::credit`); rewards on an
    /// episode's environment tokens are ignored. Schema 2.0: a group that carries them is
    /// written as 2.0 (or later), since a 1.x trainer would ignore them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_rewards: Option<Vec<Floats>>,
    /// Optional teacher log-probs of each completion token at temperature 1 over the full
    /// vocabulary (`score --teacher`), one array per sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ref_logprobs: Option<Vec<Floats>>,
    /// Which scorer produced the rewards (consumer name or external command).
    pub scorer_id: String,
    /// When scoring finished, microseconds since the epoch.
    pub scored_us: u64,
}

impl ScoredGroup {
    /// The version a group is written as: 4.0 when its rollout carries sampling masks
    /// (packed kept sets since RolloutGroup 3.0, which a 3.x reader cannot read); 3.1 when
    /// its rollout carries routing (a 3.0 trainer ignores it and routes live); 3.0 when its rollout holds an episode (a 2.x
    /// trainer, which reads no environment spans, would train the environment's tokens);
    /// 2.0 when it carries `token_rewards`, which a 1.x trainer would silently train
    /// without; 1.0 otherwise, which every reader since 1.0 reads the same way.
    pub fn version_for(
        rollout: &RolloutGroup,
        token_rewards: &Option<Vec<Floats>>,
    ) -> SchemaVersion {
        if rollout.samples.iter().any(|s| s.mask.is_some()) {
            Self::SCHEMA
        } else if rollout.prompt_routing.is_some() {
            SchemaVersion { major: 3, minor: 1 }
        } else if rollout.has_episodes() {
            SchemaVersion { major: 3, minor: 0 }
        } else if token_rewards.is_some() {
            SchemaVersion { major: 2, minor: 0 }
        } else {
            SchemaVersion::CURRENT
        }
    }

    /// Keeps the samples `keep` says yes to, with their rewards, advantages and per-token
    /// arrays (advantages stay as the scorer computed them over the whole group); returns
    /// how many were removed.
    pub fn retain_samples(&mut self, keep: impl Fn(&super::Sample) -> bool) -> usize {
        let kept: Vec<bool> = self.rollout.samples.iter().map(keep).collect();
        let removed = kept.iter().filter(|&&k| !k).count();
        if removed == 0 {
            return 0;
        }
        fn retain<T>(v: &mut Vec<T>, kept: &[bool]) {
            let mut i = 0;
            v.retain(|_| {
                i += 1;
                kept.get(i - 1).copied().unwrap_or(false)
            });
        }
        retain(&mut self.rollout.samples, &kept);
        retain(&mut self.rewards, &kept);
        retain(&mut self.advantages, &kept);
        for arrays in [&mut self.token_rewards, &mut self.ref_logprobs]
            .into_iter()
            .flatten()
        {
            retain(arrays, &kept);
        }
        removed
    }

    fn check_per_token(&self, field: &str, arrays: &Option<Vec<Floats>>) -> Result<(), CodecError> {
        let Some(arrays) = arrays else { return Ok(()) };
        let samples = &self.rollout.samples;
        if arrays.len() != samples.len() {
            return Err(CodecError::length(
                Self::KIND,
                field,
                samples.len(),
                arrays.len(),
            ));
        }
        for (i, (a, s)) in arrays.iter().zip(samples).enumerate() {
            let name = format!("{field}[{i}]");
            if a.len() != s.tokens.len() {
                return Err(CodecError::length(
                    Self::KIND,
                    name,
                    s.tokens.len(),
                    a.len(),
                ));
            }
            check_finite(Self::KIND, &name, a)?;
        }
        Ok(())
    }
}

impl Message for ScoredGroup {
    const KIND: &'static str = "ScoredGroup";
    const SCHEMA: SchemaVersion = SchemaVersion { major: 4, minor: 0 };
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
    fn validate(&self) -> Result<(), CodecError> {
        self.rollout.validate_as(Self::KIND)?;
        let n = self.rollout.samples.len();
        for (field, values) in [("rewards", &self.rewards), ("advantages", &self.advantages)] {
            if values.len() != n {
                return Err(CodecError::length(Self::KIND, field, n, values.len()));
            }
            check_finite(Self::KIND, field, values)?;
        }
        self.check_per_token("token_rewards", &self.token_rewards)?;
        self.check_per_token("ref_logprobs", &self.ref_logprobs)
    }
}

//! The `[policy]` settings: what the generators and the trainer must agree on, defined once
//! for both (the model they start from, the sampling temperature the trainer's log-probs
//! assume, the staleness bound and the step size the generators' in-flight bound uses).

crate::settings! {
    /// The `[policy]` section, read by `gen`, `train` and `run`.
    pub struct PolicySettings, flags PolicyArgs, section "policy" {
        /// Initial policy: a Hugging Face model directory (also the trainer's KL reference).
        #[arg(value_name = "DIR")]
        pub model: Option<std::path::PathBuf> = None,
        /// Sampling temperature of the generators; the trainer's log-probs use the same.
        pub temperature: f32 = 1.0,
        /// Groups whose oldest token is more than this many versions behind the trainer are dropped; generators keep at most this many steps of work in flight (0: strictly on-policy, one step in flight, sampled on the newest weights only).
        pub max_lag: u64 = 4,
        /// Scored groups per optimizer step (the generators' in-flight bound uses it too).
        pub groups_per_step: usize = 8,
        /// Seed of sampling, training and the built-in prompts.
        pub seed: u64 = 0,
    }
}

impl PolicySettings {
    /// Steps of work the generators keep in flight (started but not yet trained):
    /// `max_lag`, and one at `max_lag = 0`, where nothing may be stale. Then the trainer
    /// keeps only groups sampled wholly by its current weights, and the generators start
    /// a prompt only when they hold the newest announced version (each step waits for the
    /// swap of the one before, as `--sync` does).
    pub fn steps_in_flight(&self) -> u64 {
        self.max_lag.max(1)
    }

    /// Checks values the types cannot.
    pub fn validate(&self) -> Result<(), crate::settings::InvalidSetting> {
        use crate::settings::invalid;
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(invalid(
                "policy.temperature",
                "must be > 0 for RL (greedy samples carry no log-probs)",
            ));
        }
        if self.groups_per_step == 0 {
            return Err(invalid("policy.groups_per_step", "must be at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `max_lag = 0` is strictly on-policy: one step in flight (nothing could be sampled
    /// otherwise), none of it stale.
    #[test]
    fn max_lag_zero_keeps_one_step_in_flight() {
        let at = |max_lag| PolicySettings {
            max_lag,
            ..PolicySettings::default()
        };
        assert_eq!(at(0).steps_in_flight(), 1);
        assert_eq!(at(1).steps_in_flight(), 1);
        assert_eq!(at(4).steps_in_flight(), 4);
        assert!(at(0).validate().is_ok());
    }
}

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
        /// Groups whose oldest token is more than this many versions old are dropped; generators run at most this many steps ahead.
        pub max_lag: u64 = 4,
        /// Scored groups per optimizer step (the generators' in-flight bound uses it too).
        pub groups_per_step: usize = 8,
        /// Seed of sampling, training and the built-in prompts.
        pub seed: u64 = 0,
    }
}

impl PolicySettings {
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

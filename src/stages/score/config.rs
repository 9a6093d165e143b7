//! The `[score]` settings, and how rewards become advantages.

use serde::{Deserialize, Serialize};

/// How rewards become advantages within a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AdvantageKind {
    /// (r − mean) / (std + ε): GRPO.
    Grpo,
    /// r − mean of the other samples: leave-one-out (RLOO).
    Loo,
    /// r − mean, no scaling (Dr. GRPO).
    Nostd,
}
crate::enum_setting!(AdvantageKind);

crate::settings! {
    /// The `[score]` section.
    pub struct ScoreConfig, flags ScoreArgs, section "score" {
        /// How rewards become advantages within a group.
        pub advantage: AdvantageKind = AdvantageKind::Grpo,
        /// External scorer speaking JSON lines on stdin/stdout, run without a shell (see examples/verifier.py).
        #[arg(value_name = "CMD")]
        pub scorer_cmd: Option<String> = None,
        /// Seconds an external scorer may take per group.
        pub scorer_timeout_s: f64 = 30.0,
        /// External scorer processes, each scoring one group at a time: a polled batch is scored this many groups at once.
        pub scorers: usize = 1,
        /// Model directory whose tokenizer decodes completions; the built-in character tokenizer when absent.
        #[arg(value_name = "DIR")]
        pub tokenizer: Option<std::path::PathBuf> = None,
        /// Consumer name, unique per scorer process.
        pub name: String = "score-0".into(),
    }
}

impl ScoreConfig {
    /// Checks values the types cannot.
    pub fn validate(&self) -> Result<(), crate::settings::InvalidSetting> {
        if self.scorers == 0 {
            return Err(crate::settings::invalid(
                "score.scorers",
                "must be at least 1",
            ));
        }
        if !(self.scorer_timeout_s.is_finite() && self.scorer_timeout_s > 0.0) {
            return Err(crate::settings::invalid(
                "score.scorer_timeout_s",
                "must be > 0",
            ));
        }
        Ok(())
    }
}

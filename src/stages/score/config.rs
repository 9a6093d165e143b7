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

/// What a teacher's log-probs become.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DistillKind {
    /// Nothing: they travel as `ref_logprobs` only.
    None,
    /// Per-token rewards distill_coef · (teacher − behaviour log-prob): on-policy
    /// distillation by reverse KL.
    ReverseKl,
}
crate::enum_setting!(DistillKind);

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
        /// External scorer processes: a polled batch is scored scorers × scorer-in-flight groups at once, each group on the process holding the fewest.
        pub scorers: usize = 1,
        /// Groups each external scorer process holds at once; above 1, each request's `request_id` must come back in its answer (answers may then come in any order).
        pub scorer_in_flight: usize = 1,
        /// Split each completion into steps after every occurrence of this string and send them to --scorer-cmd, which may answer one reward per step (`step_rewards`); a step's reward sits on its last token.
        #[arg(value_name = "TEXT")]
        pub step_separator: Option<String> = None,
        /// Teacher model directory (any supported Hugging Face checkpoint with the student's tokenizer): each sampled token gets the teacher's log-prob at temperature 1 over the full vocabulary, one batched prefill per group.
        #[arg(value_name = "DIR")]
        pub teacher: Option<std::path::PathBuf> = None,
        /// What the teacher's log-probs become: none (sent as ref_logprobs) or reverse-kl (per-token rewards distill_coef · (teacher − behaviour log-prob)).
        pub distill: DistillKind = DistillKind::None,
        /// Weight of the teacher's per-token rewards.
        pub distill_coef: f32 = 1.0,
        /// Weight of the outcome (verifier) advantage beside token rewards; 0 trains on token rewards alone (pure distillation).
        pub outcome_coef: f32 = 1.0,
        /// DAPO's soft overlong penalty (arXiv 2503.14476): over the last N tokens before max_new_tokens a completion's reward falls linearly, to −overlong_penalty at the limit (0: off). Episodes are not shaped.
        #[arg(value_name = "TOKENS")]
        pub overlong_buffer: u32 = 0,
        /// The overlong penalty at max_new_tokens (DAPO's penalty factor).
        pub overlong_penalty: f32 = 1.0,
        /// Length penalty: each completion's reward less length_penalty × its tokens / max_new_tokens (0: off). Episodes are not shaped.
        pub length_penalty: f32 = 0.0,
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
        if self.scorer_in_flight == 0 {
            return Err(crate::settings::invalid(
                "score.scorer_in_flight",
                "must be at least 1",
            ));
        }
        if !(self.scorer_timeout_s.is_finite() && self.scorer_timeout_s > 0.0) {
            return Err(crate::settings::invalid(
                "score.scorer_timeout_s",
                "must be > 0",
            ));
        }
        for (k, v) in [
            ("score.distill_coef", self.distill_coef),
            ("score.outcome_coef", self.outcome_coef),
            ("score.overlong_penalty", self.overlong_penalty),
            ("score.length_penalty", self.length_penalty),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(crate::settings::invalid(k, "must be >= 0"));
            }
        }
        if self.step_separator.as_deref() == Some("") {
            return Err(crate::settings::invalid(
                "score.step_separator",
                "must not be empty",
            ));
        }
        Ok(())
    }
}

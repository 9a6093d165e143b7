//! The `[feed]` settings.

use crate::tasks::BuiltinTask;
use std::path::PathBuf;

crate::settings! {
    /// The `[feed]` section.
    pub struct FeedConfig, flags FeedArgs, section "feed" {
        /// Built-in task to generate prompts from.
        pub task: Option<BuiltinTask> = None,
        /// Dataset instead of a built-in task, JSONL or Parquet: {"prompt": ..., "answer": ..., "verifier": exact|numeric|contains|positional|math} per line or row, or "messages": [{"role", "content"}, ...] in place of "prompt".
        #[arg(value_name = "FILE")]
        pub dataset: Option<PathBuf> = None,
        /// The dataset's prompt column (Parquet) or field (JSONL).
        #[arg(value_name = "NAME")]
        pub prompt_column: String = "prompt".into(),
        /// The dataset's answer column or field.
        #[arg(value_name = "NAME")]
        pub answer_column: String = "answer".into(),
        /// The dataset's conversation column or field (a list of {role, content}), read when there is no prompt column.
        #[arg(value_name = "NAME")]
        pub messages_column: String = "messages".into(),
        /// Model directory whose chat template (chat_template.jinja or tokenizer_config.json) renders the dataset's `messages` rows: the policy's.
        #[arg(value_name = "DIR")]
        pub chat_template: Option<PathBuf> = None,
        /// Prompts to feed from a built-in task.
        pub count: u64 = 1000,
        /// Passes over a dataset.
        pub epochs: u32 = 1,
        /// Shuffle the dataset's order each epoch (seeded).
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub shuffle: bool = false,
        /// Seed of the built-in task's prompts and of the shuffle.
        pub seed: u64 = 0,
        /// With --reoffer: prompts kept waiting for the generators; the feed stays up, tops the stream up to this, and stops once its new prompts are all fed.
        pub backlog: u64 = 64,
    }
}

impl FeedConfig {
    /// The dataset's column names.
    pub fn columns(&self) -> crate::tasks::Columns {
        crate::tasks::Columns {
            prompt: self.prompt_column.clone(),
            answer: self.answer_column.clone(),
            messages: self.messages_column.clone(),
        }
    }
}

crate::settings! {
    /// The `[difficulty]` section: a difficulty-aware feed (`feed` and `run`).
    pub struct DifficultyConfig, flags DifficultyArgs, section "difficulty" {
        /// Share of the prompts fed that are prompts fed before and scored since, drawn again with weight max(reoffer_floor, 4·p·(1−p)) at their latest pass rate p, so those neither always nor never solved come back most (prime-rl's difficulty pools, ROLL's query filter); 0: off, every prompt new. Pass rates come from the scorers' `outcomes` events.
        pub reoffer: f64 = 0.0,
        /// The weight of a prompt always or never solved, against 1 for one solved half the time.
        pub reoffer_floor: f64 = 0.05,
        /// Prompts remembered for re-offering, the most recently fed kept.
        pub reoffer_pool: usize = 4096,
    }
}

impl DifficultyConfig {
    /// Checks values the types cannot.
    pub fn validate(&self) -> Result<(), crate::settings::InvalidSetting> {
        use crate::settings::invalid;
        if !(0.0..1.0).contains(&self.reoffer) {
            return Err(invalid(
                "difficulty.reoffer",
                "must be in [0, 1): a share of the prompts fed",
            ));
        }
        if !(self.reoffer_floor > 0.0 && self.reoffer_floor <= 1.0) {
            return Err(invalid("difficulty.reoffer_floor", "must be in (0, 1]"));
        }
        if self.reoffer_pool == 0 {
            return Err(invalid("difficulty.reoffer_pool", "must be at least 1"));
        }
        Ok(())
    }
}

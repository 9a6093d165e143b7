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

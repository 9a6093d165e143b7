//! The `[feed]` settings.

use crate::tasks::BuiltinTask;
use std::path::PathBuf;

crate::settings! {
    /// The `[feed]` section.
    pub struct FeedConfig, flags FeedArgs, section "feed" {
        /// Built-in task to generate prompts from.
        pub task: Option<BuiltinTask> = None,
        /// JSONL dataset instead of a built-in task: {"prompt": ..., "answer": ..., "verifier": exact|numeric|contains|positional|math}, or "messages": [{"role", "content"}, ...] in place of "prompt".
        #[arg(value_name = "FILE")]
        pub dataset: Option<PathBuf> = None,
        /// Model directory whose chat template (tokenizer_config.json) renders the dataset's `messages` rows: the policy's.
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

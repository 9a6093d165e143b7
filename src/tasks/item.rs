//! What a task or a dataset row hands the pipeline: one prompt ([`TaskItem`]) and the meta
//! keys the scorer reads.

use std::collections::BTreeMap;

/// Meta key of the reference answer.
pub const ANSWER: &str = "answer";
/// Meta key naming the verifier of a dataset item.
pub const VERIFIER: &str = "verifier";

/// One prompt of a task.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskItem {
    pub prompt: String,
    pub answer: String,
    /// Everything the scorer needs (answer, verifier), carried in the messages.
    pub meta: BTreeMap<String, String>,
}

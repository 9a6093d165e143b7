//! `Prompt`: one unit of work for the generator, written by `rlstream feed`.

use super::{CodecError, Message, SchemaVersion, Tokens};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    pub schema: SchemaVersion,
    /// Stable id of this prompt across epochs and restarts (`add-000042`).
    pub prompt_id: String,
    /// Task name whose verifier scores the completions (`add`, `reverse`, a dataset's).
    pub task: String,
    /// The prompt as text, for humans and for generators that tokenize themselves.
    pub text: String,
    /// The prompt already tokenized, when the feeder knows the policy's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<Tokens>,
    /// Task data the scorer needs and the generator passes through (e.g. `answer`).
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// When the prompt was fed, microseconds since the epoch.
    pub created_us: u64,
}

impl Message for Prompt {
    const KIND: &'static str = "Prompt";
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
    fn validate(&self) -> Result<(), CodecError> {
        if self.prompt_id.is_empty() {
            return Err(CodecError::invalid(
                Self::KIND,
                "prompt_id",
                "must not be empty",
            ));
        }
        if self.task.is_empty() {
            return Err(CodecError::invalid(Self::KIND, "task", "must not be empty"));
        }
        Ok(())
    }
}

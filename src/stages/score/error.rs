//! Why a group was not scored, and which failures dead-letter it.

use super::external::ScorerError;
use crate::model::ModelError;

/// Why a group was not scored.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    /// The prompt or a completion cannot be turned into text: its ids are not the
    /// tokenizer's. Retrying cannot help; the group is dead-lettered with reason
    /// [`DETOKENIZE`].
    #[error("{what} cannot be detokenized: {source}")]
    Detokenize {
        what: String,
        #[source]
        source: ModelError,
    },
    /// The built-in scorer has no answer to compare with. Retrying cannot help; the group
    /// is dead-lettered with reason [`NO_ANSWER`].
    #[error("group {0} has no `answer` in its meta; use --scorer-cmd for this task")]
    NoAnswer(String),
    #[error(transparent)]
    External(#[from] ScorerError),
    #[error(transparent)]
    Encode(#[from] crate::schema::CodecError),
    /// The teacher cannot run the group (an id past its vocabulary, longer than its
    /// context). Retrying cannot help; dead-lettered with the refusal's reason.
    #[error("the teacher cannot score this group: {0}")]
    TeacherInput(crate::schema::Refusal),
    /// The teacher's computation failed (worth a retry).
    #[error("teacher: {0}")]
    TeacherFailed(String),
}

/// Dead-letter reason of a group whose text cannot be recovered.
pub const DETOKENIZE: &str = "detokenize";
/// Dead-letter reason of a group the built-in scorer has no answer for.
pub const NO_ANSWER: &str = "no_answer";

impl ScoreError {
    /// The dead-letter reason of an error retrying cannot help; `None` for one worth a
    /// retry (a scorer that timed out, crashed or answered badly).
    pub fn dead_letter_reason(&self) -> Option<&'static str> {
        match self {
            ScoreError::Detokenize { .. } => Some(DETOKENIZE),
            ScoreError::NoAnswer(_) => Some(NO_ANSWER),
            ScoreError::TeacherInput(r) => Some(r.reason),
            ScoreError::External(_) | ScoreError::Encode(_) | ScoreError::TeacherFailed(_) => None,
        }
    }
}

//! What goes wrong with a model: its files, its config, its tensors, input it cannot run.

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model config: `{field}` {reason}")]
    Config { field: String, reason: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("missing file {path}: {reason}")]
    MissingFile { path: String, reason: String },
    #[error("no model at {dir}: {reason}")]
    NoModel { dir: String, reason: String },
    #[error("checkpoint is missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {dtype}; rlstream reads F32, F16 and BF16")]
    Dtype { name: String, dtype: String },
    #[error("bad safetensors data{}: {reason}", .path.as_ref().map(|p| format!(" in {p}")).unwrap_or_default())]
    Safetensors {
        path: Option<String>,
        reason: String,
    },
    #[error("weights checksum mismatch: expected {expected}, got {found}")]
    Checksum { expected: String, found: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("cannot copy a tensor to the host: {0}")]
    HostCopy(String),
    /// Input the model cannot run (an id past the vocabulary, too long for the context).
    #[error("{0}")]
    Refused(crate::schema::Refusal),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ModelError {
    /// A failed read or write of `path`.
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

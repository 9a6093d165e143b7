//! `CodecError`: everything that can be wrong with bytes that claim to be a message.

use super::SchemaVersion;

/// Why bytes could not become a message (or a message could not become bytes).
///
/// Every variant names the problem precisely enough to fix the producer; none is worth a
/// retry, since the same bytes fail the same way: the consumer dead-letters them.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CodecError {
    #[error("{kind}: message is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        kind: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("{kind}: bytes end before the message does (truncated after {len} bytes)")]
    Truncated { kind: &'static str, len: usize },
    #[error("{kind}: not a MessagePack map ({detail})")]
    NotMessagePack { kind: &'static str, detail: String },
    #[error("{kind}: missing field `{field}`")]
    MissingField { kind: &'static str, field: String },
    #[error(
        "{kind}: schema {found} is newer than the {supported} this build reads; upgrade rlstream"
    )]
    SchemaTooNew {
        kind: &'static str,
        found: SchemaVersion,
        supported: SchemaVersion,
    },
    #[error("{kind}: {field}: expected {expected} values, found {found}")]
    LengthMismatch {
        kind: &'static str,
        field: String,
        expected: usize,
        found: usize,
    },
    #[error("{kind}: {field}: {reason}")]
    InvalidValue {
        kind: &'static str,
        field: String,
        reason: String,
    },
    #[error("{kind}: {detail}")]
    Malformed { kind: &'static str, detail: String },
    #[error("{kind}: cannot encode: {detail}")]
    Encode { kind: &'static str, detail: String },
}

impl CodecError {
    /// Short stable label for metrics and dead letters (`truncated`, `schema`, ...).
    pub fn label(&self) -> &'static str {
        match self {
            CodecError::TooLarge { .. } => "too_large",
            CodecError::Truncated { .. } => "truncated",
            CodecError::NotMessagePack { .. } => "not_msgpack",
            CodecError::MissingField { .. } => "missing_field",
            CodecError::SchemaTooNew { .. } => "schema",
            CodecError::LengthMismatch { .. } => "length_mismatch",
            CodecError::InvalidValue { .. } => "invalid_value",
            CodecError::Malformed { .. } => "malformed",
            CodecError::Encode { .. } => "encode",
        }
    }

    pub(crate) fn invalid(
        kind: &'static str,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        CodecError::InvalidValue {
            kind,
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn length(
        kind: &'static str,
        field: impl Into<String>,
        expected: usize,
        found: usize,
    ) -> Self {
        CodecError::LengthMismatch {
            kind,
            field: field.into(),
            expected,
            found,
        }
    }
}

/// Refuses a non-finite value in `values` (field `field` of a `kind` message), naming its index.
pub(super) fn check_finite(
    kind: &'static str,
    field: &str,
    values: &[f32],
) -> Result<(), CodecError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(CodecError::invalid(
            kind,
            format!("{field}[{i}]"),
            format!("{} is not finite", values[i]),
        )),
    }
}

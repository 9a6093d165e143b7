//! Encoding and decoding of every message: MessagePack maps with named fields.
//!
//! Decoding is strict about what would corrupt training (version, lengths, non-finite
//! numbers) and lenient about what would only block evolution: unknown fields are ignored,
//! so a producer on a newer minor schema can add fields without breaking older consumers.

use super::{CodecError, SchemaVersion};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::io::Cursor;

/// Largest message a consumer decodes unless configured otherwise (64 MiB). A hostile or
/// buggy producer cannot make a consumer allocate more than this per message.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A message type that travels on a stream.
pub trait Message: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// Name used in errors, schemas and fixtures (`RolloutGroup`).
    const KIND: &'static str;
    /// The schema version this build writes and the newest major it reads.
    const SCHEMA: SchemaVersion = SchemaVersion::CURRENT;

    /// The version the message claims.
    fn schema(&self) -> SchemaVersion;

    /// Checks invariants a well-formed decode cannot express (lengths agree, numbers are
    /// finite). Called by [`decode`]; call it before [`encode`] when building by hand.
    fn validate(&self) -> Result<(), CodecError> {
        Ok(())
    }
}

/// Encodes a message as a MessagePack map with named fields.
pub fn encode<M: Message>(msg: &M) -> Result<Vec<u8>, CodecError> {
    rmp_serde::to_vec_named(msg).map_err(|e| CodecError::Encode {
        kind: M::KIND,
        detail: e.to_string(),
    })
}

/// Decodes and validates a message, with the default size limit.
pub fn decode<M: Message>(bytes: &[u8]) -> Result<M, CodecError> {
    decode_limited(bytes, DEFAULT_MAX_MESSAGE_BYTES)
}

/// Decodes and validates a message no larger than `max_bytes`.
pub fn decode_limited<M: Message>(bytes: &[u8], max_bytes: usize) -> Result<M, CodecError> {
    let kind = M::KIND;
    if bytes.len() > max_bytes {
        return Err(CodecError::TooLarge {
            kind,
            size: bytes.len(),
            limit: max_bytes,
        });
    }
    check_map_marker(kind, bytes)?;
    let mut de = rmp_serde::Deserializer::new(Cursor::new(bytes));
    let msg = match M::deserialize(&mut de) {
        Ok(m) => m,
        Err(e) => {
            // A newer major may have changed any field: report the version, not the symptom.
            if let Some(found) = peek_schema(bytes)
                && found.major > M::SCHEMA.major
            {
                return Err(too_new::<M>(found));
            }
            return Err(map_decode_error(kind, bytes.len(), e));
        }
    };
    let used = de.position() as usize;
    if used != bytes.len() {
        return Err(CodecError::Malformed {
            kind,
            detail: format!("{} trailing bytes after the message", bytes.len() - used),
        });
    }
    let found = msg.schema();
    if found.major > M::SCHEMA.major {
        return Err(too_new::<M>(found));
    }
    if found.major == 0 {
        return Err(CodecError::invalid(
            kind,
            "schema",
            format!("unknown schema {found}"),
        ));
    }
    msg.validate()?;
    Ok(msg)
}

fn too_new<M: Message>(found: SchemaVersion) -> CodecError {
    CodecError::SchemaTooNew {
        kind: M::KIND,
        found,
        supported: M::SCHEMA,
    }
}

/// Every message is a map: an array would decode positionally and silently misassign fields.
fn check_map_marker(kind: &'static str, bytes: &[u8]) -> Result<(), CodecError> {
    let Some(&first) = bytes.first() else {
        return Err(CodecError::Truncated { kind, len: 0 });
    };
    let is_map = matches!(first, 0x80..=0x8f | 0xde | 0xdf);
    if is_map {
        Ok(())
    } else {
        Err(CodecError::NotMessagePack {
            kind,
            detail: format!(
                "first byte 0x{first:02x} is a {:?}, not a map",
                rmp::Marker::from_u8(first)
            ),
        })
    }
}

/// Reads only the `schema` field, ignoring everything else.
fn peek_schema(bytes: &[u8]) -> Option<SchemaVersion> {
    #[derive(serde::Deserialize)]
    struct Envelope {
        schema: SchemaVersion,
    }
    rmp_serde::from_slice::<Envelope>(bytes)
        .ok()
        .map(|e| e.schema)
}

fn map_decode_error(kind: &'static str, len: usize, e: rmp_serde::decode::Error) -> CodecError {
    use rmp_serde::decode::Error as E;
    match e {
        E::InvalidMarkerRead(io) | E::InvalidDataRead(io)
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            CodecError::Truncated { kind, len }
        }
        E::Syntax(msg) => match msg
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            Some(field) => CodecError::MissingField {
                kind,
                field: field.to_string(),
            },
            None => CodecError::Malformed { kind, detail: msg },
        },
        E::TypeMismatch(marker) => CodecError::Malformed {
            kind,
            detail: format!("unexpected MessagePack {marker:?}"),
        },
        other => CodecError::Malformed {
            kind,
            detail: other.to_string(),
        },
    }
}

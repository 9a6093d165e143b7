//! Encoding and decoding of every message: MessagePack maps with named fields.
//!
//! Decoding is strict about what would corrupt training (version, lengths, non-finite
//! numbers) and lenient about what would only block evolution: unknown fields are ignored,
//! so a producer on a newer minor schema can add fields without breaking older consumers.

use super::{CodecError, SchemaVersion};
use serde::Serialize;
use serde::de::DeserializeOwned;

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
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
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
    let used = encoded_len(bytes).unwrap_or(bytes.len());
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

/// Length of the first MessagePack value in `buf`, walking headers only (strings and bins
/// are skipped, not copied). `None` if the value runs past the end or uses a reserved byte.
pub(super) fn encoded_len(buf: &[u8]) -> Option<usize> {
    fn be(buf: &[u8], at: usize, n: usize) -> Option<usize> {
        let bytes = buf.get(at..at + n)?;
        Some(
            bytes
                .iter()
                .fold(0usize, |acc, &b| (acc << 8) | usize::from(b)),
        )
    }
    let mut pos = 0usize;
    let mut remaining: u64 = 1;
    while remaining > 0 {
        remaining -= 1;
        let m = *buf.get(pos)?;
        pos += 1;
        let skip = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
            0x80..=0x8f => {
                remaining += 2 * u64::from(m & 0x0f);
                0
            }
            0x90..=0x9f => {
                remaining += u64::from(m & 0x0f);
                0
            }
            0xa0..=0xbf => usize::from(m & 0x1f),
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xca | 0xce | 0xd2 => 4,
            0xcb | 0xcf | 0xd3 => 8,
            0xd4 => 2,
            0xd5 => 3,
            0xd6 => 5,
            0xd7 => 9,
            0xd8 => 17,
            0xc4 | 0xd9 => 1 + be(buf, pos, 1)?,
            0xc5 | 0xda => 2 + be(buf, pos, 2)?,
            0xc6 | 0xdb => 4 + be(buf, pos, 4)?,
            0xc7 => 2 + be(buf, pos, 1)?,
            0xc8 => 3 + be(buf, pos, 2)?,
            0xc9 => 5 + be(buf, pos, 4)?,
            0xdc | 0xde => {
                let n = be(buf, pos, 2)? as u64;
                remaining += if m == 0xde { 2 * n } else { n };
                2
            }
            0xdd | 0xdf => {
                let n = be(buf, pos, 4)? as u64;
                remaining += if m == 0xdf { 2 * n } else { n };
                4
            }
            0xc1 => return None,
        };
        pos = pos.checked_add(skip)?;
        if pos > buf.len() {
            return None;
        }
    }
    Some(pos)
}

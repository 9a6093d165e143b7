//! `DeadLetter`: a message that could not be processed, kept with its bytes and the reason.

use super::{Message, SchemaVersion};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub schema: SchemaVersion,
    /// Stream key and entry id the payload was read from.
    pub source_stream: String,
    pub source_id: String,
    /// Consumer group and consumer that gave up on it.
    pub group: String,
    pub consumer: String,
    /// Short stable reason (`truncated`, `schema`, `max_deliveries`, ...).
    pub reason: String,
    /// The full error, for a human.
    pub error: String,
    /// How many times the entry had been delivered.
    pub deliveries: u32,
    /// The original bytes, untouched.
    #[serde(with = "serde_bytes_buf")]
    pub payload: Vec<u8>,
    pub dead_us: u64,
}

impl Message for DeadLetter {
    const KIND: &'static str = "DeadLetter";
    fn schema(&self) -> SchemaVersion {
        self.schema
    }
}

/// Raw bytes as MessagePack `bin`, whatever they contain.
mod serde_bytes_buf {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct BytesVisitor;
        impl serde::de::Visitor<'_> for BytesVisitor {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
        }
        d.deserialize_bytes(BytesVisitor)
    }
}

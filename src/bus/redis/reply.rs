//! Redis replies read back: stream entries, ids, field maps and range bounds.

use crate::bus::{Entry, EntryId, RangeBound};
use bytes::Bytes;
use redis::Value;
use std::collections::HashMap;

/// The field of every stream entry that holds the MessagePack bytes.
pub const PAYLOAD_FIELD: &str = "d";

pub(super) fn bound_arg(b: RangeBound, open: &str) -> String {
    match b {
        RangeBound::Open => open.to_string(),
        RangeBound::Inclusive(id) => id.to_string(),
        RangeBound::Exclusive(id) => format!("({id}"),
    }
}

// ---- reply parsing -------------------------------------------------------------------

pub(super) fn as_array(v: &Value) -> &[Value] {
    match v {
        Value::Array(a) | Value::Set(a) => a,
        _ => &[],
    }
}

pub(super) fn as_bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

pub(super) fn as_string(v: &Value) -> String {
    as_bytes(v)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

pub(super) fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => as_bytes(other).and_then(|b| std::str::from_utf8(b).ok()?.parse().ok()),
    }
}

pub(super) fn parse_id(v: &Value) -> Option<EntryId> {
    std::str::from_utf8(as_bytes(v)?).ok()?.parse().ok()
}

/// A flat `[k1, v1, k2, v2, ...]` reply (or a RESP3 map) as a map.
pub(super) fn fields(v: &Value) -> HashMap<String, &Value> {
    match v {
        Value::Map(pairs) => pairs.iter().map(|(k, v)| (as_string(k), v)).collect(),
        other => as_array(other)
            .chunks_exact(2)
            .map(|kv| (as_string(&kv[0]), &kv[1]))
            .collect(),
    }
}

/// `[[id, [field, value, ...]], ...]` → entries. Entries whose body is gone (deleted while
/// pending) or lacks the payload field come back with an empty payload, which the
/// consumer dead-letters rather than silently dropping.
pub(super) fn parse_entries(v: &Value, deliveries: u32) -> Vec<Entry> {
    as_array(v)
        .iter()
        .filter_map(|e| {
            let parts = as_array(e);
            let id = parse_id(parts.first()?)?;
            let payload = parts
                .get(1)
                .map(fields)
                .and_then(|f| {
                    f.get(PAYLOAD_FIELD)
                        .and_then(|v| as_bytes(v))
                        .map(Bytes::copy_from_slice)
                })
                .unwrap_or_default();
            Some(Entry {
                id,
                payload,
                deliveries,
            })
        })
        .collect()
}

/// XREAD/XREADGROUP reply for one stream: `[[stream, entries]]`, a RESP3 map, or nil.
pub(super) fn parse_read_reply(v: &Value, deliveries: u32) -> Vec<Entry> {
    match v {
        Value::Nil => Vec::new(),
        Value::Map(pairs) => pairs
            .first()
            .map(|(_, e)| parse_entries(e, deliveries))
            .unwrap_or_default(),
        other => as_array(other)
            .first()
            .and_then(|s| as_array(s).get(1))
            .map(|e| parse_entries(e, deliveries))
            .unwrap_or_default(),
    }
}

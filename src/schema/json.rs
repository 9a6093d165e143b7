//! The documented MessagePack → JSON mapping used by the `.json` fixture twins, the JSON
//! Schemas and `rlstream replay`: maps and arrays as they are, `bin` as a base64 string,
//! integers and floats as JSON numbers. Any language with a MessagePack library can apply
//! the same mapping and compare against the fixtures.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use rmpv::Value;
use serde_json::Value as Json;

/// Decodes any MessagePack bytes into the neutral JSON view.
pub fn msgpack_to_json(bytes: &[u8]) -> Result<Json, String> {
    let mut cursor = bytes;
    let value = rmpv::decode::read_value(&mut cursor).map_err(|e| e.to_string())?;
    if !cursor.is_empty() {
        return Err(format!("{} trailing bytes", cursor.len()));
    }
    Ok(value_to_json(&value))
}

pub fn value_to_json(v: &Value) -> Json {
    match v {
        Value::Nil => Json::Null,
        Value::Boolean(b) => Json::Bool(*b),
        Value::Integer(i) => i
            .as_u64()
            .map(Json::from)
            .or_else(|| i.as_i64().map(Json::from))
            .unwrap_or(Json::Null),
        Value::F32(f) => float(f64::from(*f)),
        Value::F64(f) => float(*f),
        Value::String(s) => Json::String(s.as_str().unwrap_or_default().to_string()),
        Value::Binary(b) => Json::String(STANDARD.encode(b)),
        Value::Array(items) => Json::Array(items.iter().map(value_to_json).collect()),
        Value::Map(pairs) => Json::Object(
            pairs
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        Value::String(s) => s.as_str().unwrap_or_default().to_string(),
                        other => other.to_string(),
                    };
                    (key, value_to_json(v))
                })
                .collect(),
        ),
        Value::Ext(_, b) => Json::String(STANDARD.encode(b)),
    }
}

fn float(f: f64) -> Json {
    serde_json::Number::from_f64(f)
        .map(Json::Number)
        .unwrap_or(Json::Null)
}

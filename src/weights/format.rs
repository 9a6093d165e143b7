//! What both sides of the weights hand-over agree on: the format tag of each kind of version
//! object, the size of a version, and the key a generator asks for a keyframe under.

use crate::bus::Topology;
use crate::model::tensors::WeightDtype;
use crate::schema::LORA_FORMAT_PREFIX;

/// Format tag of versions handed over in process (no blob: host tensors by reference).
pub const IN_PROCESS_FORMAT: &str = "in-process-f32";

/// Format tag of a whole version in `dtype`: a safetensors blob.
pub fn full_format(dtype: WeightDtype) -> &'static str {
    match dtype {
        WeightDtype::F32 => "safetensors-f32",
        WeightDtype::Bf16 => "safetensors-bf16",
    }
}

/// Whether `format` is a whole version a follower can load.
pub(crate) fn is_full_format(format: &str) -> bool {
    format == "safetensors-f32" || format == "safetensors-bf16"
}

/// Format tag of a whole adapter in `dtype`: a safetensors blob in PEFT's tensor names.
pub fn lora_format(dtype: WeightDtype) -> String {
    format!("{LORA_FORMAT_PREFIX}{}", full_format(dtype))
}

/// Format tag of an adapter handed over in process.
pub const LORA_IN_PROCESS_FORMAT: &str = "lora-in-process-f32";

/// Whether `format` is an object a follower reads whole (a full version or an adapter).
pub(crate) fn is_whole_format(format: &str) -> bool {
    is_full_format(format)
        || format
            .strip_prefix(LORA_FORMAT_PREFIX)
            .is_some_and(is_full_format)
}

/// The size of a version of `params` parameters in `dtype`.
pub fn params_bytes(params: usize, dtype: WeightDtype) -> u64 {
    let width = match dtype {
        WeightDtype::F32 => 4,
        WeightDtype::Bf16 => 2,
    };
    params as u64 * width
}

/// The key a generator sets to ask the trainer for a keyframe.
pub(crate) fn keyframe_request_key(topo: &Topology) -> String {
    format!("{}:weights:keyframe-request", topo.namespace)
}

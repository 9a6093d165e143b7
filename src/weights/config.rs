//! The `[weights]` settings: how published versions travel, read by the trainer (which
//! writes them) and the generators (which read them), so both sides take the same flags.

use crate::model::tensors::WeightDtype;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the bytes of each version live; the announce always goes on the weights stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// Chunks in Redis beside the streams: nothing else to set up; the versions kept count
    /// against Redis memory.
    Redis,
    /// Files in a directory every trainer and generator machine mounts (`store_dir`).
    Dir,
}
crate::enum_setting!(StoreKind);

impl StoreKind {
    /// The name on the announce.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreKind::Redis => "redis",
            StoreKind::Dir => "dir",
        }
    }
}

/// The dtype of published weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PublishDtype {
    /// The dtype of the starting checkpoint's `config.json` (`torch_dtype` / `dtype`): bf16
    /// for a bfloat16 model, f32 otherwise.
    Auto,
    /// 32-bit floats: exactly the trainer's master weights.
    F32,
    /// bfloat16, rounded to nearest even: half the bytes; the generator computes in f32
    /// from the rounded values.
    Bf16,
}
crate::enum_setting!(PublishDtype);

crate::settings! {
    /// The `[weights]` section, read by `gen`, `train` and `run`.
    pub struct WeightsConfig, flags WeightsArgs, section "weights" {
        /// Where published versions are stored: redis (chunks beside the streams) or dir (files in --store-dir, a directory every machine mounts; Redis then carries only the announces).
        pub store: StoreKind = StoreKind::Redis,
        /// The shared directory of --store dir (NFS, a cluster filesystem), the same path on every machine.
        #[arg(value_name = "DIR")]
        pub store_dir: Option<PathBuf> = None,
        /// Dtype of published weights: auto (the starting checkpoint's config.json dtype), f32 or bf16; the trainer's master weights stay f32.
        pub wire_dtype: PublishDtype = PublishDtype::Auto,
        /// Publish versions as deltas (XOR against the previous version, zstd), with a full keyframe every --keyframe-every versions.
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub delta: bool = true,
        /// A full keyframe every this many versions (and whenever a generator asks for one).
        pub keyframe_every: u64 = 10,
        /// Bound on the bytes the published versions occupy in their store, deltas included (0: no bound); the trainer refuses a bound that cannot hold two full versions.
        #[arg(value_name = "BYTES")]
        pub max_bytes: u64 = 0,
        /// Size of the pieces a version is written to Redis in.
        #[arg(value_name = "BYTES")]
        pub chunk_bytes: usize = 4 << 20,
    }
}

impl WeightsConfig {
    /// Checks values the types cannot.
    pub fn validate(&self) -> Result<(), crate::settings::InvalidSetting> {
        use crate::settings::invalid;
        if self.keyframe_every == 0 {
            return Err(invalid("weights.keyframe_every", "must be at least 1"));
        }
        if self.chunk_bytes == 0 {
            return Err(invalid("weights.chunk_bytes", "must be at least 1"));
        }
        if self.store == StoreKind::Dir && self.store_dir.is_none() {
            return Err(invalid(
                "weights.store_dir",
                "is needed with store = \"dir\": a directory every trainer and generator machine mounts (--store-dir DIR)",
            ));
        }
        Ok(())
    }

    /// The dtype versions are published in, for a trainer that started from `model_dir`.
    pub fn resolve_dtype(&self, model_dir: Option<&Path>) -> WeightDtype {
        match self.wire_dtype {
            PublishDtype::F32 => WeightDtype::F32,
            PublishDtype::Bf16 => WeightDtype::Bf16,
            PublishDtype::Auto => model_dir
                .and_then(checkpoint_dtype)
                .unwrap_or(WeightDtype::F32),
        }
    }
}

/// The dtype a checkpoint's `config.json` declares (`torch_dtype`, or transformers 5's
/// `dtype`): bf16 for `bfloat16`, f32 for anything else; `None` when it says nothing or
/// cannot be read.
pub fn checkpoint_dtype(dir: &Path) -> Option<WeightDtype> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let name = v
        .get("torch_dtype")
        .or_else(|| v.get("dtype"))
        .and_then(serde_json::Value::as_str)?;
    Some(if name == "bfloat16" {
        WeightDtype::Bf16
    } else {
        WeightDtype::F32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let c = WeightsConfig::default();
        assert_eq!(c.resolve_dtype(Some(dir.path())), WeightDtype::F32);
        for (json, want) in [
            (r#"{"torch_dtype": "bfloat16"}"#, WeightDtype::Bf16),
            (r#"{"dtype": "bfloat16"}"#, WeightDtype::Bf16),
            (r#"{"torch_dtype": "float32"}"#, WeightDtype::F32),
            (r#"{"torch_dtype": "float16"}"#, WeightDtype::F32),
        ] {
            std::fs::write(dir.path().join("config.json"), json).unwrap();
            assert_eq!(c.resolve_dtype(Some(dir.path())), want, "{json}");
        }
        let forced = WeightsConfig {
            wire_dtype: PublishDtype::F32,
            ..WeightsConfig::default()
        };
        assert_eq!(forced.resolve_dtype(Some(dir.path())), WeightDtype::F32);
    }

    #[test]
    fn a_dir_store_needs_its_directory() {
        let c = WeightsConfig {
            store: StoreKind::Dir,
            ..WeightsConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("store_dir"));
    }
}

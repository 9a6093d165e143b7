//! Configuration of every command: one TOML file with a section per stage.
//!
//! Precedence, lowest to highest: the file (`--config FILE`), then environment variables
//! `RLSTREAM__{SECTION}__{KEY}` (e.g. `RLSTREAM__GEN__GROUP_SIZE=8`, top-level keys as
//! `RLSTREAM__REDIS`), then command-line flags. Unknown keys and impossible values are
//! refused with the key named. The resolved config is saved beside each checkpoint.

use crate::stages::score::AdvantageKind;
use crate::stages::train::LossKind;
use crate::tasks::BuiltinTask;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "RLSTREAM__";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("config: `{key}` {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Redis URL (`redis://`, `rediss://` for TLS, `redis://user:pass@host` for ACL users).
    pub redis: Option<String>,
    /// How long, in seconds, a stage keeps retrying while Redis is unreachable (a restart,
    /// a network blip) before it stops with an error [default: 300].
    pub redis_patience_s: Option<u64>,
    /// PEM file of the CA that signed the Redis server's certificate (`rediss://` URLs);
    /// without it the system's trusted roots (or `SSL_CERT_FILE`) are used.
    pub redis_tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a Redis with `tls-auth-clients yes`.
    pub redis_tls_cert: Option<PathBuf>,
    /// PEM private key of `redis_tls_cert`.
    pub redis_tls_key: Option<PathBuf>,
    /// Key prefix; overrides the topology's.
    pub namespace: Option<String>,
    /// Stream topology file; the shipped default when absent.
    pub topology: Option<PathBuf>,
    /// Address of the Prometheus `/metrics` listener (loopback by default).
    pub metrics_addr: Option<String>,
    pub feed: FeedConfig,
    /// The `[gen]` section (`gen` is reserved in Rust 2024).
    #[serde(rename = "gen")]
    pub generator: GenConfig,
    pub score: ScoreConfig,
    pub train: TrainConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeedConfig {
    /// Built-in task to generate prompts from.
    pub task: Option<BuiltinTask>,
    /// JSONL dataset instead of a built-in task.
    pub dataset: Option<PathBuf>,
    /// Prompts to feed from a built-in task.
    pub count: u64,
    /// Passes over a dataset.
    pub epochs: u32,
    /// Shuffle dataset order each epoch (seeded).
    pub shuffle: bool,
    pub seed: u64,
}

impl Default for FeedConfig {
    fn default() -> Self {
        FeedConfig {
            task: None,
            dataset: None,
            count: 1000,
            epochs: 1,
            shuffle: false,
            seed: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenConfig {
    /// Hugging Face model directory of the initial policy.
    pub model: Option<PathBuf>,
    /// Completions per prompt (G).
    pub group_size: usize,
    pub max_new_tokens: u32,
    pub temperature: f32,
    /// 0 disables.
    pub top_k: u32,
    /// 1.0 disables.
    pub top_p: f32,
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// Staleness bound shared with the trainer (versions).
    pub max_lag: u64,
    /// Groups per optimizer step, shared with the trainer (for the in-flight bound).
    pub groups_per_step: usize,
    pub seed: u64,
    /// Consumer name; unique per generator process.
    pub name: String,
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig {
            model: None,
            group_size: 8,
            max_new_tokens: 16,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_batch: 64,
            max_lag: 4,
            groups_per_step: 8,
            seed: 0,
            name: "gen-0".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoreConfig {
    pub advantage: AdvantageKind,
    /// External scorer speaking JSON lines on stdin/stdout (run without a shell).
    pub scorer_cmd: Option<String>,
    /// Seconds an external scorer may take per group.
    pub scorer_timeout_s: f64,
    /// Model directory whose tokenizer decodes completions; the built-in character
    /// tokenizer when absent.
    pub tokenizer: Option<PathBuf>,
    pub name: String,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        ScoreConfig {
            advantage: AdvantageKind::Grpo,
            scorer_cmd: None,
            scorer_timeout_s: 30.0,
            tokenizer: None,
            name: "score-0".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Hugging Face model directory of the initial policy.
    pub model: Option<PathBuf>,
    pub loss: LossKind,
    pub lr: f64,
    pub weight_decay: f64,
    /// Gradient clipping by global norm.
    pub max_grad_norm: f32,
    /// PPO clip range below and above 1.
    pub clip_eps: f32,
    pub clip_eps_high: f32,
    /// Truncation of the importance weight (tis) and cap of the ratio (reinforce).
    pub is_cap: f32,
    /// KL penalty to the initial policy (0 disables).
    pub kl_coef: f32,
    /// Scored groups per optimizer step.
    pub groups_per_step: usize,
    /// Groups whose oldest token is more than this many versions old are dropped.
    pub max_lag: u64,
    /// Publish weights every this many steps.
    pub publish_every: u64,
    /// Versions of weights kept in Redis.
    pub keep_versions: usize,
    /// Checkpoint every this many steps (entries are acked only after a checkpoint).
    pub checkpoint_every: u64,
    /// Where checkpoints go.
    pub checkpoint_dir: PathBuf,
    /// Stop after this many steps (0 runs until stopped).
    pub steps: u64,
    /// Sampling temperature the generators use (the trainer's log-probs must match it).
    pub temperature: f32,
    pub seed: u64,
    pub name: String,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: None,
            loss: LossKind::Ppo,
            lr: 1e-4,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            clip_eps: 0.2,
            clip_eps_high: 0.28,
            is_cap: 2.0,
            kl_coef: 0.0,
            groups_per_step: 8,
            max_lag: 4,
            publish_every: 1,
            keep_versions: 3,
            checkpoint_every: 10,
            checkpoint_dir: PathBuf::from("checkpoints"),
            steps: 0,
            temperature: 1.0,
            seed: 0,
            name: "train-0".into(),
        }
    }
}

impl Config {
    /// File (if any), then environment. Flags are applied by the caller afterwards.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with_env(path, std::env::vars())
    }

    /// Like [`Config::load`], over `base` instead of the stage defaults: a command whose
    /// defaults differ (`rlstream run`) passes them here, and the file and environment still
    /// override them.
    pub fn load_over(base: &Config, path: Option<&Path>) -> Result<Self, ConfigError> {
        let base = toml::Table::try_from(base).map_err(|e| ConfigError::Parse {
            origin: "(command defaults)".into(),
            message: e.to_string(),
        })?;
        Self::load_layers(base, path, std::env::vars())
    }

    pub fn load_with_env(
        path: Option<&Path>,
        env: impl Iterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        Self::load_layers(toml::Table::new(), path, env)
    }

    fn load_layers(
        base: toml::Table,
        path: Option<&Path>,
        env: impl Iterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let file = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Io {
                    path: p.display().to_string(),
                    source,
                })?;
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError::Parse {
                        origin: p.display().to_string(),
                        message: e.to_string(),
                    })?
            }
            None => toml::Table::new(),
        };
        let mut table = base;
        merge(&mut table, file);
        let mut overrides = Vec::new();
        for (k, v) in env {
            let Some(rest) = k.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(str::to_lowercase).collect();
            let value = parse_scalar(&v);
            insert(&mut table, &path, value).map_err(|reason| ConfigError::Parse {
                origin: format!("environment variable {k}"),
                message: reason,
            })?;
            overrides.push(k);
        }
        // A value that does not fit may come from the file or from an override: name both.
        let origin = match (path, overrides.is_empty()) {
            (Some(p), true) => p.display().to_string(),
            (Some(p), false) => format!("{} with {}", p.display(), overrides.join(", ")),
            (None, true) => "(defaults)".to_string(),
            (None, false) => format!("(defaults with {})", overrides.join(", ")),
        };
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin,
                message: e.to_string(),
            })
    }

    /// Checks values the types cannot: ranges and combinations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let g = &self.generator;
        if g.group_size == 0 {
            return Err(invalid("gen.group_size", "must be at least 1"));
        }
        if g.max_new_tokens == 0 {
            return Err(invalid("gen.max_new_tokens", "must be at least 1"));
        }
        if !(g.temperature.is_finite() && g.temperature > 0.0) {
            return Err(invalid(
                "gen.temperature",
                "must be > 0 for RL (greedy samples carry no log-probs)",
            ));
        }
        if !(g.top_p > 0.0 && g.top_p <= 1.0) {
            return Err(invalid("gen.top_p", "must be in (0, 1]"));
        }
        if g.max_batch < g.group_size {
            return Err(invalid(
                "gen.max_batch",
                format!("must be at least gen.group_size ({})", g.group_size),
            ));
        }
        if g.groups_per_step == 0 {
            return Err(invalid("gen.groups_per_step", "must be at least 1"));
        }
        if !(self.score.scorer_timeout_s.is_finite() && self.score.scorer_timeout_s > 0.0) {
            return Err(invalid("score.scorer_timeout_s", "must be > 0"));
        }
        let t = &self.train;
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(invalid("train.lr", "must be > 0"));
        }
        for (k, v) in [
            ("train.clip_eps", t.clip_eps),
            ("train.clip_eps_high", t.clip_eps_high),
        ] {
            if !(v.is_finite() && v > 0.0 && v < 1.0) {
                return Err(invalid(k, "must be in (0, 1)"));
            }
        }
        if !(t.is_cap.is_finite() && t.is_cap >= 1.0) {
            return Err(invalid("train.is_cap", "must be >= 1"));
        }
        if !(t.max_grad_norm.is_finite() && t.max_grad_norm > 0.0) {
            return Err(invalid("train.max_grad_norm", "must be > 0"));
        }
        if t.groups_per_step == 0
            || t.publish_every == 0
            || t.checkpoint_every == 0
            || t.keep_versions == 0
        {
            return Err(invalid(
                "train",
                "groups_per_step, publish_every, checkpoint_every and keep_versions must be at least 1",
            ));
        }
        if !(t.temperature.is_finite() && t.temperature > 0.0) {
            return Err(invalid("train.temperature", "must be > 0"));
        }
        Ok(())
    }
}

/// An environment value as TOML if it parses as a scalar, else as a string.
fn parse_scalar(v: &str) -> toml::Value {
    format!("x = {v}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("x"))
        .filter(|x| !x.is_table())
        .unwrap_or_else(|| toml::Value::String(v.to_string()))
}

/// Sets every key of `over` in `base`, descending into sections present in both.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

fn insert(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    match path {
        [] => Err("empty key".into()),
        [last] => {
            table.insert(last.clone(), value);
            Ok(())
        }
        [first, rest @ ..] => {
            let entry = table
                .entry(first.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            match entry {
                toml::Value::Table(t) => insert(t, rest, value),
                _ => Err(format!("`{first}` is not a section")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_defaults_sit_under_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[train]\nlr = 0.5\n").unwrap();
        let mut base = Config::default();
        base.train.lr = 0.25;
        base.train.steps = 7;
        base.generator.model = Some(PathBuf::from("m"));
        let c = Config::load_over(&base, Some(&path)).unwrap();
        assert_eq!((c.train.lr, c.train.steps), (0.5, 7));
        assert_eq!(c.generator.model, Some(PathBuf::from("m")));
        assert_eq!(Config::load_over(&base, None).unwrap().train.lr, 0.25);
    }

    fn env(pairs: &[(&str, &str)]) -> impl Iterator<Item = (String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn file_then_environment() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rl.toml");
        std::fs::write(
            &path,
            "namespace = \"exp1\"\n[gen]\ngroup_size = 4\ntemperature = 0.7\n",
        )
        .unwrap();
        let c = Config::load_with_env(
            Some(&path),
            env(&[
                ("RLSTREAM__GEN__GROUP_SIZE", "6"),
                ("RLSTREAM__REDIS", "redis://h:1"),
                ("HOME", "/x"),
            ]),
        )
        .unwrap();
        assert_eq!(c.namespace.as_deref(), Some("exp1"));
        assert_eq!(c.generator.group_size, 6, "environment beats the file");
        assert_eq!(c.generator.temperature, 0.7);
        assert_eq!(c.redis.as_deref(), Some("redis://h:1"));
        assert_eq!(c.train, TrainConfig::default());
        c.validate().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rl.toml");
        std::fs::write(&path, "[gen]\ngroup_sise = 4\n").unwrap();
        let e = Config::load_with_env(Some(&path), env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("group_sise"), "{e}");
        let e = Config::load_with_env(None, env(&[("RLSTREAM__TRAIN__LOSS", "adam")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("adam"), "{e}");
        let mut c = Config::default();
        c.train.clip_eps = 1.5;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("train.clip_eps")
        );
        let e = Config::load(Some(Path::new("/nonexistent/rl.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/rl.toml"), "{e}");
    }
}

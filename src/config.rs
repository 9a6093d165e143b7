//! Configuration of every command: one TOML file with a section per stage.
//!
//! Precedence, lowest to highest, in one merge ([`Config::resolve`]): the command's own
//! defaults (a layer: `rlstream run` has some), the file (`--config FILE`), environment
//! variables `RLSTREAM__{SECTION}__{KEY}` (e.g. `RLSTREAM__GEN__GROUP_SIZE=8`, top-level keys
//! as `RLSTREAM__REDIS`), then command-line flags. Each setting is defined once, next to the
//! stage that reads it, with its default and doc line (see [`crate::settings`]); the flags
//! are made from those definitions. Unknown keys and impossible values are refused with the
//! key named. The resolved config is saved beside each checkpoint.

use crate::settings::InvalidSetting;
use crate::tasks::BuiltinTask;
use std::path::{Path, PathBuf};

pub use crate::stages::feed::{DifficultyArgs, DifficultyConfig, FeedArgs, FeedConfig};
pub use crate::stages::generator::{GenArgs, GenConfig};
pub use crate::stages::policy::{PolicyArgs, PolicySettings};
pub use crate::stages::score::{ScoreArgs, ScoreConfig};
pub use crate::stages::train::{TrainArgs, TrainConfig};
pub use crate::weights::{WeightsArgs, WeightsConfig};

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "RLSTREAM__";

/// The Redis a stage connects to when none is configured.
pub const DEFAULT_REDIS: &str = "redis://127.0.0.1:6379";

/// A section of the config file: its name (empty at the top level), its keys, and the
/// commands whose flags set them.
pub struct FileSection {
    pub name: &'static str,
    pub keys: Vec<crate::settings::Key>,
    pub commands: &'static [&'static str],
}

/// Every section of the config file, in the order the reference lists them: the settings
/// test walks them, and `docs/settings.md` is made from them.
pub fn file_sections() -> Vec<FileSection> {
    use crate::settings::Section;
    let s = |name, keys, commands| FileSection {
        name,
        keys,
        commands,
    };
    vec![
        s(
            Config::NAME,
            Config::keys(),
            &["feed", "gen", "score", "train", "run"],
        ),
        s(FeedConfig::NAME, FeedConfig::keys(), &["feed"]),
        s(
            DifficultyConfig::NAME,
            DifficultyConfig::keys(),
            &["feed", "run"],
        ),
        s(
            PolicySettings::NAME,
            PolicySettings::keys(),
            &["gen", "train", "run"],
        ),
        s(GenConfig::NAME, GenConfig::keys(), &["gen", "run"]),
        s(ScoreConfig::NAME, ScoreConfig::keys(), &["score", "run"]),
        s(TrainConfig::NAME, TrainConfig::keys(), &["train", "run"]),
        s(
            WeightsConfig::NAME,
            WeightsConfig::keys(),
            &["gen", "train"],
        ),
        s(RunConfig::NAME, RunConfig::keys(), &["run"]),
    ]
}

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
    #[error(transparent)]
    Invalid(#[from] InvalidSetting),
}

crate::settings! {
    /// The whole file: the connection settings at the top level, a section per stage.
    pub struct Config, flags CommonArgs, section "" {
        /// Redis URL (redis://, rediss:// for TLS, redis://user:pass@host for ACL users, redis+sentinel://HOST:PORT,HOST:PORT/PRIMARY to follow Sentinel failovers); redis://127.0.0.1:6379 when absent, and `run` uses its embedded bus unless given.
        #[arg(value_name = "URL")]
        pub redis: Option<String> = None,
        /// Seconds a stage keeps retrying while Redis is unreachable (a restart, a network blip) before it stops with an error.
        #[arg(value_name = "SECS")]
        pub redis_patience_s: u64 = 300,
        /// Stop a stage, with a message that says what was lost, when Redis comes back without its data (restarted without persistence, flushed, a replica without the last writes promoted); by default the stage recreates its consumer groups, reports the loss and goes on.
        pub redis_stop_on_data_loss: bool = false,
        /// PEM CA certificate of a rediss:// server; the system's trusted roots (or SSL_CERT_FILE) when absent.
        #[arg(value_name = "FILE")]
        pub redis_tls_ca: Option<PathBuf> = None,
        /// PEM client certificate, for a Redis with `tls-auth-clients yes` (with --redis-tls-key).
        #[arg(value_name = "FILE")]
        pub redis_tls_cert: Option<PathBuf> = None,
        /// PEM private key of --redis-tls-cert.
        #[arg(value_name = "FILE")]
        pub redis_tls_key: Option<PathBuf> = None,
        /// Key prefix of every stream; overrides the topology's (`rl`).
        pub namespace: Option<String> = None,
        /// Stream topology file; the shipped streams/default.toml when absent.
        #[arg(value_name = "FILE")]
        pub topology: Option<PathBuf> = None,
        /// Stages write the stream entries their standing trims remove here (one file per trim), and replay reads this directory and Redis as one history; overrides the topology's archive_dir. Absent: trimmed entries are dropped.
        #[arg(value_name = "DIR")]
        pub archive_dir: Option<PathBuf> = None,
        /// Serve Prometheus metrics at http://ADDR/metrics: a port (loopback, e.g. 9101) or HOST:PORT (e.g. 0.0.0.0:9101); off when absent.
        #[arg(value_name = "ADDR")]
        pub metrics_addr: Option<String> = None,
    }
    sections {
        /// `[feed]`: where prompts come from.
        pub feed: FeedConfig,
        /// `[difficulty]`: prompts fed again by how hard they are (`feed`, `run`).
        pub difficulty: DifficultyConfig,
        /// `[policy]`: what the generators and the trainer agree on.
        pub policy: PolicySettings,
        /// `[gen]` (`gen` is reserved in Rust 2024).
        #[serde(rename = "gen")]
        pub generator: GenConfig,
        /// `[score]`.
        pub score: ScoreConfig,
        /// `[train]`.
        pub train: TrainConfig,
        /// `[weights]`: how versions travel from the trainer to the generators.
        pub weights: WeightsConfig,
        /// `[run]`: the one-process pipeline's own settings.
        pub run: RunConfig,
    }
}

crate::settings! {
    /// The `[run]` section: what `rlstream run` does beyond the stages.
    pub struct RunConfig, flags RunArgs, section "run" {
        /// Built-in task to learn.
        pub task: BuiltinTask = BuiltinTask::Longer,
        /// Dataset to learn instead of a built-in task, JSONL or Parquet as `feed --dataset` reads it (plain or `messages` rows, their verifiers); needs --model, whose tokenizer and chat template feed it.
        #[arg(value_name = "FILE")]
        pub dataset: Option<PathBuf> = None,
        /// Held-out rows of --dataset's form, evaluated before, halfway and after; when absent, --held-out-share of --dataset is held out of training.
        #[arg(value_name = "FILE")]
        pub eval_dataset: Option<PathBuf> = None,
        /// Share of --dataset's rows held out of training when there is no --eval-dataset, chosen by a hash of each row's prompt or conversation (the same rows whatever the seed or order).
        #[arg(value_name = "SHARE")]
        pub held_out_share: f64 = 0.1,
        /// The dataset's prompt column (Parquet) or field (JSONL).
        #[arg(value_name = "NAME")]
        pub prompt_column: String = "prompt".into(),
        /// The dataset's answer column or field.
        #[arg(value_name = "NAME")]
        pub answer_column: String = "answer".into(),
        /// The dataset's conversation column or field (a list of {role, content}), read when there is no prompt column.
        #[arg(value_name = "NAME")]
        pub messages_column: String = "messages".into(),
        /// The synchronous baseline: generate a batch, score it, train on it, publish, repeat.
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub sync: bool = false,
        /// Run directory for the warm-start model, checkpoints and report; runs/TASK-UNIXTIME when absent.
        #[arg(value_name = "DIR")]
        pub out: Option<PathBuf> = None,
        /// Where the learning curve and per-step metrics go; OUT/report when absent.
        #[arg(value_name = "DIR")]
        pub report: Option<PathBuf> = None,
        /// Warm-start (supervised) steps on the task's demonstrations (`sort`'s for `longer`).
        pub sft_steps: u64 = 100,
        /// Width of the warm-start model.
        pub hidden: usize = 64,
        /// Layers of the warm-start model.
        pub layers: usize = 2,
        /// Experts per layer of the warm-start model: a Qwen3-MoE-shaped policy routing each token to 2 of them (trained with train.routing, replay by default); 0 is dense.
        pub experts: usize = 0,
        /// Progress as log lines even on a terminal.
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub plain: bool = false,
        /// Held-out prompts evaluated before RL, halfway and after (`rlstream eval`'s set and metrics); 0 skips the evaluation.
        pub eval_prompts: usize = 1000,
        /// Samples per held-out prompt for pass@1 at the training temperature.
        pub eval_samples: usize = 4,
        /// Held-out evaluation at every checkpoint whose step is a multiple of this, instead of halfway only: the held-out learning curve, each point with the wall time its step finished at (evaluated after training, off the clock); a multiple of train.checkpoint_every; 0: before, halfway and after.
        #[arg(value_name = "STEPS")]
        pub eval_every: u64 = 0,
        /// Feed the task's (or the dataset's) prompts; false: the trainer learns only from what agents send through the endpoint (needs --serve; not with --sync, which paces the feed).
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub feed: bool = true,
    }
}

impl Config {
    /// Merges the layers, lowest first: `base` (a command's own defaults), the file at
    /// `path`, the `RLSTREAM__*` variables of `env`, then `flags`.
    pub fn resolve(
        base: toml::Table,
        path: Option<&Path>,
        env: impl Iterator<Item = (String, String)>,
        flags: toml::Table,
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
        merge(&mut table, flags);
        // A value that does not fit may come from the file or from an override: name both.
        let origin = match (path, overrides.is_empty()) {
            (Some(p), true) => p.display().to_string(),
            (Some(p), false) => format!("{} with {}", p.display(), overrides.join(", ")),
            (None, true) => "(defaults)".to_string(),
            (None, false) => format!("(defaults with {})", overrides.join(", ")),
        };
        if let Some(message) = moved_to_policy(&table) {
            return Err(ConfigError::Parse { origin, message });
        }
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin,
                message: e.to_string(),
            })
    }

    /// The Redis URL to connect to.
    pub fn redis_url(&self) -> &str {
        self.redis.as_deref().unwrap_or(DEFAULT_REDIS)
    }

    /// Checks values the types cannot: ranges and combinations.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        self.policy.validate()?;
        self.difficulty.validate()?;
        self.generator.validate()?;
        self.score.validate()?;
        self.train.validate()?;
        self.weights.validate()?;
        let share = self.run.held_out_share;
        if !(0.0..1.0).contains(&share) {
            return Err(crate::settings::invalid(
                "run.held_out_share",
                format!("{share} is not a share: give at least 0 and less than 1"),
            ));
        }
        if !self.run.feed && (self.generator.serve.is_none() || self.run.sync) {
            return Err(crate::settings::invalid(
                "run.feed",
                "false leaves the endpoint's agents as the only source of groups: give --serve ADDR (and no --sync, which paces the feed by the trainer)",
            ));
        }
        let (every, ckpt) = (self.run.eval_every, self.train.checkpoint_every);
        if every % ckpt != 0 {
            return Err(crate::settings::invalid(
                "run.eval_every",
                format!(
                    "{every} is not a multiple of train.checkpoint_every ({ckpt}): checkpoints are what is evaluated; give a multiple, or a --checkpoint-every that divides it"
                ),
            ));
        }
        Ok(())
    }
}

/// A key that the generators and the trainer now share in `[policy]`, still given in
/// `[gen]` or `[train]`: say where it went rather than only that it is unknown.
fn moved_to_policy(table: &toml::Table) -> Option<String> {
    use crate::settings::Section;
    for section in [GenConfig::NAME, TrainConfig::NAME] {
        let Some(t) = table.get(section).and_then(toml::Value::as_table) else {
            continue;
        };
        for key in PolicySettings::keys() {
            if t.contains_key(key.name) {
                return Some(format!(
                    "`[{section}] {k}` is now `[policy] {k}` (RLSTREAM__POLICY__{K}): the generators and the trainer share it",
                    k = key.name,
                    K = key.name.to_uppercase()
                ));
            }
        }
    }
    None
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

    fn env(pairs: &[(&str, &str)]) -> impl Iterator<Item = (String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>()
            .into_iter()
    }

    fn none() -> toml::Table {
        toml::Table::new()
    }

    #[test]
    fn command_defaults_sit_under_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[train]\nlr = 0.5\n").unwrap();
        let base: toml::Table = "[train]\nlr = 0.25\nsteps = 7\n[policy]\nmodel = \"m\"\n"
            .parse()
            .unwrap();
        let c = Config::resolve(base.clone(), Some(&path), env(&[]), none()).unwrap();
        assert_eq!((c.train.lr, c.train.steps), (0.5, 7));
        assert_eq!(c.policy.model, Some(PathBuf::from("m")));
        let c = Config::resolve(base, None, env(&[]), none()).unwrap();
        assert_eq!(c.train.lr, 0.25);
    }

    #[test]
    fn file_then_environment_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rl.toml");
        std::fs::write(
            &path,
            "namespace = \"exp1\"\n[gen]\ngroup_size = 4\nmax_batch = 16\n[policy]\ntemperature = 0.7\n",
        )
        .unwrap();
        let flags = GenArgs {
            max_batch: Some(32),
            ..GenArgs::default()
        };
        let c = Config::resolve(
            none(),
            Some(&path),
            env(&[
                ("RLSTREAM__GEN__GROUP_SIZE", "6"),
                ("RLSTREAM__GEN__MAX_BATCH", "24"),
                ("RLSTREAM__REDIS", "redis://h:1"),
                ("HOME", "/x"),
            ]),
            flags.layer(),
        )
        .unwrap();
        assert_eq!(c.namespace.as_deref(), Some("exp1"));
        assert_eq!(c.generator.group_size, 6, "environment beats the file");
        assert_eq!(c.generator.max_batch, 32, "a flag beats the environment");
        assert_eq!(c.policy.temperature, 0.7);
        assert_eq!(c.redis.as_deref(), Some("redis://h:1"));
        assert_eq!(c.train, TrainConfig::default());
        c.validate().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rl.toml");
        std::fs::write(&path, "[gen]\ngroup_sise = 4\n").unwrap();
        let e = Config::resolve(none(), Some(&path), env(&[]), none())
            .unwrap_err()
            .to_string();
        assert!(e.contains("group_sise"), "{e}");
        let e = Config::resolve(
            none(),
            None,
            env(&[("RLSTREAM__TRAIN__LOSS", "adam")]),
            none(),
        )
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
        let e = Config::resolve(
            none(),
            Some(Path::new("/nonexistent/rl.toml")),
            env(&[]),
            none(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("/nonexistent/rl.toml"), "{e}");
    }
}

//! Stream topology: which streams exist, who reads them, how long they are kept, and the
//! delivery policy. Loaded from `streams/default.toml` (or `--topology FILE`) and checked
//! before any stage starts, so a typo fails at launch with the offending key named.

use super::ConsumerOptions;
use crate::roles::Stream;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The topology shipped in `streams/default.toml`, compiled in so the binary works anywhere.
pub const DEFAULT_TOPOLOGY: &str = include_str!("../../streams/default.toml");

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Prefix of every key: streams are `{namespace}:{name}`, so several runs can share one
    /// Redis.
    pub namespace: String,
    /// Milliseconds an entry may stay pending under one consumer before another claims it.
    pub claim_idle_ms: u64,
    /// Deliveries after which an entry goes to the dead-letter stream.
    pub max_deliveries: u32,
    /// Largest message, in bytes, a consumer will decode.
    pub max_message_bytes: usize,
    /// Name (in `[streams.*]`) of the dead-letter stream.
    pub dead_letter: String,
    /// Milliseconds a blocking read waits before returning empty (bounds shutdown latency).
    #[serde(default = "default_block_ms")]
    pub block_ms: u64,
    /// Where standing trims write what they remove (one archive file per trim, named
    /// `{namespace}.{stream}.{first id}.rla`), so that `replay` reads Redis and the archive
    /// as one history; `--archive-dir` sets it. Absent: trimmed entries are dropped.
    #[serde(default)]
    pub archive_dir: Option<std::path::PathBuf>,
    /// Milliseconds between two rounds of the stages' standing trims.
    #[serde(default = "default_trim_every_ms")]
    pub trim_every_ms: u64,
    pub streams: BTreeMap<String, StreamSpec>,
    /// What consumers do when Redis lost a stream's data: the `redis_stop_on_data_loss`
    /// setting, not the file's.
    #[serde(skip)]
    pub on_data_loss: super::OnDataLoss,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StreamSpec {
    /// Consumer groups created on the stream.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Approximate maximum number of entries (`MAXLEN ~`); absent means unbounded.
    #[serde(default)]
    pub max_len: Option<u64>,
    /// What the stream carries, for humans.
    #[serde(default)]
    pub description: String,
    /// Standing retention, applied by the stages as they run: keep the newest N entries.
    /// Like `rlstream trim`, it never removes an entry a consumer group has not finished.
    #[serde(default)]
    pub trim_keep_last: Option<u64>,
    /// Standing retention: remove entries older than this many seconds (never unfinished
    /// ones).
    #[serde(default)]
    pub trim_older_than_s: Option<u64>,
    /// Standing retention by memory: the oldest finished entries go once the stream takes
    /// more than this many bytes of the bus's memory (Redis `MEMORY USAGE`). Applied with
    /// either policy above; the shipped topology sets one for every stream.
    #[serde(default)]
    pub trim_max_bytes: Option<u64>,
}

impl StreamSpec {
    /// The standing trim policies, in the order they are applied.
    pub fn trim_policies(&self) -> Vec<Keep> {
        let by_count = match (self.trim_keep_last, self.trim_older_than_s) {
            (Some(n), _) => Some(Keep::Last(n)),
            (None, Some(s)) => Some(Keep::Newer(std::time::Duration::from_secs(s))),
            (None, None) => None,
        };
        by_count
            .into_iter()
            .chain(self.trim_max_bytes.map(Keep::Bytes))
            .collect()
    }
}

fn default_block_ms() -> u64 {
    1000
}

fn default_trim_every_ms() -> u64 {
    10_000
}

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("cannot read topology file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("topology {origin}: {source}")]
    Parse {
        origin: String,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("topology {origin}: {problem}")]
    Invalid { origin: String, problem: String },
}

impl Default for Topology {
    fn default() -> Self {
        // The shipped file is checked by a unit test, so this cannot fail at run time.
        Topology::parse(DEFAULT_TOPOLOGY, "streams/default.toml")
            .expect("shipped topology is valid")
    }
}

impl Topology {
    pub fn load(path: &Path) -> Result<Self, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates; `origin` names the source in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, TopologyError> {
        let topo: Topology = toml::from_str(text).map_err(|source| TopologyError::Parse {
            origin: origin.to_string(),
            source: Box::new(source),
        })?;
        topo.validate().map_err(|problem| TopologyError::Invalid {
            origin: origin.to_string(),
            problem,
        })?;
        Ok(topo)
    }

    fn validate(&self) -> Result<(), String> {
        let ns = &self.namespace;
        if ns.is_empty()
            || ns
                .chars()
                .any(|c| c.is_whitespace() || c == ':' || c.is_control())
        {
            return Err(format!(
                "namespace `{ns}` must be non-empty, without spaces or ':'"
            ));
        }
        for (key, value) in [
            ("claim_idle_ms", self.claim_idle_ms),
            ("max_deliveries", u64::from(self.max_deliveries)),
            ("max_message_bytes", self.max_message_bytes as u64),
            ("block_ms", self.block_ms),
            ("trim_every_ms", self.trim_every_ms),
        ] {
            if value == 0 {
                return Err(format!("`{key}` must be greater than 0"));
            }
        }
        for name in Stream::ALL.map(Stream::as_str) {
            if !self.streams.contains_key(name) {
                return Err(format!("missing stream `[streams.{name}]`"));
            }
        }
        if !self.streams.contains_key(&self.dead_letter) {
            return Err(format!(
                "dead_letter = `{}` names no stream in [streams.*]",
                self.dead_letter
            ));
        }
        for (name, spec) in &self.streams {
            if name.is_empty() || name.contains(char::is_whitespace) {
                return Err(format!(
                    "stream name `{name}` must be non-empty, without spaces"
                ));
            }
            if spec.trim_keep_last.is_some() && spec.trim_older_than_s.is_some() {
                return Err(format!(
                    "`streams.{name}` sets both trim_keep_last and trim_older_than_s: pick one"
                ));
            }
            if spec.trim_keep_last == Some(0)
                || spec.trim_older_than_s == Some(0)
                || spec.trim_max_bytes == Some(0)
            {
                return Err(format!(
                    "`streams.{name}`: a trim policy of 0 would remove everything (omit it to keep all)"
                ));
            }
            if spec.max_len == Some(0) {
                return Err(format!(
                    "`streams.{name}.max_len` must be greater than 0 (omit it for unbounded)"
                ));
            }
            let mut seen = std::collections::BTreeSet::new();
            for g in &spec.groups {
                if g.is_empty() || !seen.insert(g) {
                    return Err(format!(
                        "`streams.{name}.groups` has an empty or repeated group `{g}`"
                    ));
                }
            }
        }
        for stream in Stream::ALL {
            if let (Some(stage), Some(spec)) = (stream.reader(), self.streams.get(stream.as_str()))
                && spec.groups.is_empty()
            {
                return Err(format!(
                    "`streams.{stream}.groups` is empty: name the consumer group `{stage}` reads it through"
                ));
            }
        }
        Ok(())
    }

    /// The memory budget of the streams: the sum of their `trim_max_bytes`, when every
    /// stream has one (otherwise some stream is unbounded and there is no budget).
    pub fn budget(&self) -> Option<u64> {
        self.streams.values().map(|s| s.trim_max_bytes).sum()
    }

    /// The consumer group a stage reads `stream` through: the first of the stream's
    /// `groups` (validation makes sure the streams read through a group have one). Any
    /// further groups are for other readers.
    pub fn group(&self, stream: Stream) -> &str {
        self.streams
            .get(stream.as_str())
            .and_then(|s| s.groups.first())
            .map_or(stream.as_str(), String::as_str)
    }

    /// With a different namespace (`--namespace`).
    pub fn with_namespace(mut self, namespace: &str) -> Result<Self, TopologyError> {
        self.namespace = namespace.to_string();
        self.validate().map_err(|problem| TopologyError::Invalid {
            origin: "--namespace".to_string(),
            problem,
        })?;
        Ok(self)
    }

    /// Redis key of a stream by role (`prompts` → `rl:prompts`).
    pub fn key(&self, name: impl AsRef<str>) -> String {
        format!("{}:{}", self.namespace, name.as_ref())
    }

    /// The stream names of `wanted` after checking each is in the topology; every stream
    /// when `wanted` is empty.
    pub fn select(&self, wanted: &[String]) -> Result<Vec<String>, TopologyError> {
        if wanted.is_empty() {
            return Ok(self.streams.keys().cloned().collect());
        }
        for s in wanted {
            if !self.streams.contains_key(s) {
                return Err(TopologyError::Invalid {
                    origin: "--stream".into(),
                    problem: format!(
                        "{s} is not in the topology ({})",
                        self.streams.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                });
            }
        }
        Ok(wanted.to_vec())
    }

    /// What the topology resolves to, for people: the policy, then each stream's key,
    /// groups and retention.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "namespace {}: claim_idle {} ms, max_deliveries {}, max_message_bytes {}, dead letters to {}\n",
            self.namespace,
            self.claim_idle_ms,
            self.max_deliveries,
            self.max_message_bytes,
            self.dead_key()
        );
        for (name, spec) in &self.streams {
            let retention = spec
                .max_len
                .map_or("unbounded".to_string(), |n| format!("~{n} entries"));
            out += &format!(
                "  {:<16} groups [{}], {retention}  {}\n",
                self.key(name),
                spec.groups.join(", "),
                spec.description
            );
        }
        out
    }

    /// Key of the dead-letter stream.
    pub fn dead_key(&self) -> String {
        self.key(&self.dead_letter)
    }

    /// Key of one weight chunk.
    pub fn weights_chunk_key(&self, version: u64, chunk: u32) -> String {
        format!("{}:weights:{version}:{chunk}", self.namespace)
    }

    pub fn max_len(&self, name: impl AsRef<str>) -> Option<u64> {
        self.streams.get(name.as_ref()).and_then(|s| s.max_len)
    }

    /// The delivery policy for a consumer.
    pub fn consumer_options(&self) -> ConsumerOptions {
        ConsumerOptions {
            claim_idle: Duration::from_millis(self.claim_idle_ms),
            max_deliveries: self.max_deliveries,
            block: Duration::from_millis(self.block_ms),
            max_message_bytes: self.max_message_bytes,
            on_data_loss: self.on_data_loss,
            ..ConsumerOptions::default()
        }
    }
}

/// What a standing or one-off trim keeps of a stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Keep {
    /// The newest N entries.
    Last(u64),
    /// Entries newer than this (by entry id time).
    Newer(Duration),
    /// As many of the newest entries as fit in this many bytes of the bus's memory.
    Bytes(u64),
}

impl Keep {
    /// From `rlstream trim`'s flags: `--keep-last N` (positive) or `--older-than 90s|30m|12h|7d`.
    pub fn from_flags(keep_last: Option<u64>, older_than: Option<&str>) -> Result<Keep, String> {
        match (keep_last, older_than) {
            (Some(0), _) => Err("--keep-last 0 would remove everything; use a positive N".into()),
            (Some(n), _) => Ok(Keep::Last(n)),
            (None, Some(d)) => match crate::time::parse_duration(d) {
                Some(d) if !d.is_zero() => Ok(Keep::Newer(d)),
                _ => Err(format!(
                    "`{d}` is not a positive duration like 90s, 30m, 12h or 7d"
                )),
            },
            (None, None) => Err("trim needs --keep-last N or --older-than DURATION".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Topology::parse(text, "test").unwrap_err().to_string()
    }

    fn shipped_with(replace: &str, with: &str) -> String {
        assert!(DEFAULT_TOPOLOGY.contains(replace), "{replace}");
        DEFAULT_TOPOLOGY.replacen(replace, with, 1)
    }

    #[test]
    fn shipped_topology_is_valid() {
        let t = Topology::default();
        assert_eq!(t.key(Stream::Prompts), "rl:prompts");
        assert_eq!(t.dead_key(), "rl:dead");
        assert_eq!(t.streams["prompts"].groups, vec!["gen"]);
        assert_eq!(t.weights_chunk_key(7, 2), "rl:weights:7:2");
        assert_eq!(t.group(Stream::Prompts), "gen");
        assert_eq!(t.group(Stream::Rollouts), "score");
        assert_eq!(t.group(Stream::Scored), "train");
    }

    #[test]
    fn stages_read_through_the_groups_the_file_names() {
        let text = shipped_with("groups = [\"score\"]", "groups = [\"scorers\", \"audit\"]");
        let t = Topology::parse(&text, "test").unwrap();
        assert_eq!(
            t.group(Stream::Rollouts),
            "scorers",
            "the first group is the stage's"
        );
        let e = err(&shipped_with("groups = [\"train\"]", "groups = []"));
        assert!(e.contains("`streams.scored.groups` is empty"), "{e}");
        assert!(e.contains("`train`"), "{e}");
    }

    #[test]
    fn trim_policies_parse_and_conflicts_are_refused() {
        let t = Topology::parse(
            &shipped_with(
                "groups = [\"train\"]",
                "groups = [\"train\"]\ntrim_keep_last = 500",
            ),
            "test",
        )
        .expect("valid");
        assert_eq!(
            t.streams["scored"].trim_policies(),
            [Keep::Last(500), Keep::Bytes(2 << 30)]
        );
        assert_eq!(
            t.streams["prompts"].trim_policies(),
            [Keep::Bytes(256 << 20)]
        );
        // Every shipped stream has a memory limit: the budget is their sum.
        assert_eq!(t.budget(), Some((2 << 30) + 5 * (256 << 20)));
        let e = err(&shipped_with(
            "groups = [\"train\"]",
            "groups = [\"train\"]\ntrim_keep_last = 5\ntrim_older_than_s = 60",
        ));
        assert!(e.contains("pick one"), "{e}");
        let e = err(&shipped_with(
            "groups = [\"train\"]",
            "groups = [\"train\"]\ntrim_older_than_s = 0",
        ));
        assert!(e.contains("remove everything"), "{e}");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = err(&shipped_with(
            "max_deliveries =",
            "max_delivery = 3\nmax_deliveries =",
        ));
        assert!(e.contains("max_delivery"), "{e}");
    }

    #[test]
    fn missing_stream_is_named() {
        let e = err(&shipped_with("[streams.scored]", "[streams.scored_typo]"));
        assert!(e.contains("missing stream `[streams.scored]`"), "{e}");
    }

    #[test]
    fn zero_and_negative_limits_are_refused() {
        let e = err(&shipped_with("claim_idle_ms = 30000", "claim_idle_ms = 0"));
        assert!(e.contains("`claim_idle_ms` must be greater than 0"), "{e}");
        let e = err(&shipped_with("max_deliveries = 5", "max_deliveries = -2"));
        assert!(e.contains("max_deliveries"), "{e}");
        let e = err(&shipped_with("max_len = 100000", "max_len = 0"));
        assert!(e.contains("max_len` must be greater than 0"), "{e}");
    }

    #[test]
    fn bad_namespace_and_dead_letter_are_refused() {
        assert!(Topology::default().with_namespace("a b").is_err());
        let e = err(&shipped_with(
            "dead_letter = \"dead\"",
            "dead_letter = \"nowhere\"",
        ));
        assert!(e.contains("nowhere"), "{e}");
    }
}

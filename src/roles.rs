//! The names every layer shares: the stages (metric labels, event sources) and the stream
//! roles of the topology. One enum each, so a name is spelt once.

/// Who reports in metrics (the `stage` label) and events: a pipeline stage, or a command
/// or layer that counts its own errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    Feed,
    Gen,
    Score,
    Train,
    /// `rlstream run`, the pipeline in one process.
    Run,
    /// The bus itself (retries through outages).
    Bus,
    Status,
    Replay,
    Dump,
    Load,
    Trim,
}

impl Stage {
    pub const ALL: [Stage; 11] = [
        Stage::Feed,
        Stage::Gen,
        Stage::Score,
        Stage::Train,
        Stage::Run,
        Stage::Bus,
        Stage::Status,
        Stage::Replay,
        Stage::Dump,
        Stage::Load,
        Stage::Trim,
    ];

    /// The label value and event `stage` field.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Feed => "feed",
            Stage::Gen => "gen",
            Stage::Score => "score",
            Stage::Train => "train",
            Stage::Run => "run",
            Stage::Bus => "bus",
            Stage::Status => "status",
            Stage::Replay => "replay",
            Stage::Dump => "dump",
            Stage::Load => "load",
            Stage::Trim => "trim",
        }
    }

    /// The stage a name (an event's `stage` field) stands for.
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stream every pipeline needs, by its name in the topology's `[streams.*]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stream {
    /// Prompts, read by the generators' group.
    Prompts,
    /// Rollout groups, read by the scorers' group.
    Rollouts,
    /// Scored groups, read by the trainer's group.
    Scored,
    /// Weight announces, read whole by every generator.
    Weights,
    /// Dead letters.
    Dead,
    /// Heartbeats and step summaries.
    Events,
}

impl Stream {
    pub const ALL: [Stream; 6] = [
        Stream::Prompts,
        Stream::Rollouts,
        Stream::Scored,
        Stream::Weights,
        Stream::Dead,
        Stream::Events,
    ];

    /// The name in the topology file.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stream::Prompts => "prompts",
            Stream::Rollouts => "rollouts",
            Stream::Scored => "scored",
            Stream::Weights => "weights",
            Stream::Dead => "dead",
            Stream::Events => "events",
        }
    }

    /// The stream a name (in the topology, or given by a user) stands for.
    pub fn from_name(name: &str) -> Option<Stream> {
        Stream::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// The stage whose consumer group reads the stream, for the streams read through one.
    pub const fn reader(self) -> Option<Stage> {
        match self {
            Stream::Prompts => Some(Stage::Gen),
            Stream::Rollouts => Some(Stage::Score),
            Stream::Scored => Some(Stage::Train),
            Stream::Weights | Stream::Dead | Stream::Events => None,
        }
    }
}

impl AsRef<str> for Stream {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

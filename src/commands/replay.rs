//! `rlstream replay`: read any range of any stream, from Redis or from an archive, filter
//! it, and print it as JSON lines, a table or detokenised text; and `replay --train`:
//! re-run the trainer from a checkpoint over recorded scored entries and compare every step
//! with the recorded run, bit for bit.

use crate::archive::{self, ArchiveError};
use crate::bus::{EntryId, MemoryBus, RangeBound, SharedBus, Topology};
use crate::model::tokenizer::Tokenizer;
use crate::roles::{Stage, Stream};
use crate::schema::json::msgpack_to_json;
use crate::schema::{
    self, DeadLetter, Event, Floats, Prompt, RolloutGroup, Sample, ScoredGroup, StepRecord,
    WeightsAnnounce,
};
use crate::stages::{StageError, train};
use crate::weights::{LocalWeights, Transport};
use serde_json::{Value as Json, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where recorded entries come from.
pub enum Source {
    Bus { bus: SharedBus, topo: Topology },
    Archive(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error(transparent)]
    Bus(#[from] crate::bus::BusError),
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("{0}")]
    Usage(String),
}

impl Source {
    /// Entries of `stream` between the bounds, in id order, at most `limit` (archives are
    /// read to the end so their trailer is checked). `visit` returns false to stop.
    pub async fn each(
        &self,
        stream: &str,
        from: RangeBound,
        to: RangeBound,
        mut visit: impl FnMut(EntryId, &[u8]) -> bool,
    ) -> Result<(), ReplayError> {
        match self {
            Source::Bus { bus, topo } => {
                // What standing trims archived comes first, then what Redis still holds;
                // an entry two of them hold is visited once.
                let mut last: Option<EntryId> = None;
                let mut open = true;
                if let Some(dir) = &topo.archive_dir {
                    for (_, path) in crate::retention::archive_files(dir, topo, stream)? {
                        for e in archive::Reader::open(&path)? {
                            let e = e?;
                            if open
                                && e.stream == stream
                                && last.is_none_or(|l| e.id > l)
                                && within(e.id, from, to)
                            {
                                last = Some(e.id);
                                open = visit(e.id, &e.payload);
                            }
                        }
                    }
                }
                if !open {
                    return Ok(());
                }
                crate::bus::scan(bus.as_ref(), &topo.key(stream), from, to, |page| {
                    page.iter()
                        .filter(|e| last.is_none_or(|l| e.id > l))
                        .all(|e| visit(e.id, &e.payload))
                })
                .await?;
                Ok(())
            }
            Source::Archive(path) => {
                let reader = archive::Reader::open(path)?;
                if !reader.header().streams.iter().any(|s| s == stream) {
                    return Err(ArchiveError::NoStream(stream.to_string()).into());
                }
                let mut open = true;
                for e in reader {
                    let e = e?;
                    if open && e.stream == stream && within(e.id, from, to) {
                        open = visit(e.id, &e.payload);
                    }
                }
                Ok(())
            }
        }
    }
}

fn within(id: EntryId, from: RangeBound, to: RangeBound) -> bool {
    let lower = match from {
        RangeBound::Open => true,
        RangeBound::Inclusive(b) => id >= b,
        RangeBound::Exclusive(b) => id > b,
    };
    let upper = match to {
        RangeBound::Open => true,
        RangeBound::Inclusive(b) => id <= b,
        RangeBound::Exclusive(b) => id < b,
    };
    lower && upper
}

/// `--from`/`--to`: an entry id (`MS-SEQ`), milliseconds since the epoch (`MS`), a UTC time
/// (`2026-11-29T16:30:00Z`, seconds optional), or a time ago (`-90s`, `-10m`, `-2h`,
/// `-1d`). Times become the first id at that millisecond.
pub fn parse_point(s: &str) -> Result<EntryId, ReplayError> {
    let bad = || {
        ReplayError::Usage(format!(
            "`{s}` is not an entry id (MS-SEQ), epoch milliseconds, a UTC time (2026-11-29T16:30:00Z) or a time ago (-10m)"
        ))
    };
    if let Ok(id) = s.parse::<EntryId>() {
        return Ok(id);
    }
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(EntryId::new(ms, 0));
    }
    if let Some(ago) = s.strip_prefix('-') {
        let ago = crate::time::parse_duration(ago).ok_or_else(bad)?;
        let now_ms = crate::time::now_ms();
        return Ok(EntryId::new(
            now_ms.saturating_sub(ago.as_millis() as u64),
            0,
        ));
    }
    crate::time::parse_utc_ms(s)
        .map(|ms| EntryId::new(ms, 0))
        .ok_or_else(bad)
}

/// A comparison on the mean reward of a group (`--reward '<0.5'`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardFilter {
    op: Cmp,
    value: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
}

impl std::str::FromStr for RewardFilter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (op, rest) = if let Some(r) = s.strip_prefix("<=") {
            (Cmp::Le, r)
        } else if let Some(r) = s.strip_prefix(">=") {
            (Cmp::Ge, r)
        } else if let Some(r) = s.strip_prefix('<') {
            (Cmp::Lt, r)
        } else if let Some(r) = s.strip_prefix('>') {
            (Cmp::Gt, r)
        } else if let Some(r) = s.strip_prefix('=') {
            (Cmp::Eq, r)
        } else {
            (Cmp::Eq, s)
        };
        let value: f64 = rest
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a reward test like <0.5, >=0.9 or =1"))?;
        Ok(RewardFilter { op, value })
    }
}

impl RewardFilter {
    fn keeps(&self, r: f64) -> bool {
        match self.op {
            Cmp::Lt => r < self.value,
            Cmp::Le => r <= self.value,
            Cmp::Gt => r > self.value,
            Cmp::Ge => r >= self.value,
            Cmp::Eq => r == self.value,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object per line (for jq).
    Json,
    /// One readable line per entry.
    Table,
    /// Prompts and completions as text, with each token's policy version and log-prob.
    Text,
}

pub struct ReadOptions {
    pub stream: String,
    pub from: RangeBound,
    pub to: RangeBound,
    pub count: Option<usize>,
    /// Keeps groups (and prompts, dead letters of them) whose id contains this.
    pub group_id: Option<String>,
    /// Keeps rollouts and scored groups at least this many versions behind the newest
    /// weights announced when they were written.
    pub min_staleness: Option<u64>,
    pub reward: Option<RewardFilter>,
    pub format: Format,
    /// Decodes completions for `text` (default: the built-in character tokenizer).
    pub tokenizer: Option<Tokenizer>,
}

/// What one entry is, decoded enough to filter and print.
enum Decoded {
    Prompt(Prompt),
    Rollout(RolloutGroup),
    Scored(ScoredGroup),
    Weights(WeightsAnnounce),
    Dead(DeadLetter),
    Event(Event),
    Undecodable(String),
}

fn decode(stream: &str, payload: &[u8]) -> Decoded {
    fn d<M: schema::Message>(p: &[u8], f: fn(M) -> Decoded) -> Decoded {
        match schema::decode::<M>(p) {
            Ok(m) => f(m),
            Err(e) => Decoded::Undecodable(e.to_string()),
        }
    }
    match Stream::from_name(stream) {
        Some(Stream::Prompts) => d(payload, Decoded::Prompt),
        Some(Stream::Rollouts) => d(payload, Decoded::Rollout),
        Some(Stream::Scored) => d(payload, Decoded::Scored),
        Some(Stream::Weights) => d(payload, Decoded::Weights),
        Some(Stream::Dead) => d(payload, Decoded::Dead),
        Some(Stream::Events) | None => d(payload, Decoded::Event),
    }
}

fn stream_of_key(key: &str) -> &str {
    key.rsplit_once(':').map_or(key, |(_, s)| s)
}

/// The group a message is about, for `--group-id`.
fn group_of(m: &Decoded) -> Option<String> {
    match m {
        Decoded::Prompt(p) => Some(p.prompt_id.clone()),
        Decoded::Rollout(g) => Some(g.group_id.clone()),
        Decoded::Scored(g) => Some(g.rollout.group_id.clone()),
        Decoded::Dead(d) => group_of(&decode(stream_of_key(&d.source_stream), &d.payload)),
        _ => None,
    }
}

fn rollout_of(m: &Decoded) -> Option<&RolloutGroup> {
    match m {
        Decoded::Rollout(g) => Some(g),
        Decoded::Scored(g) => Some(&g.rollout),
        _ => None,
    }
}

fn mean(xs: &[f32]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().map(|&x| f64::from(x)).sum::<f64>() / xs.len() as f64
}

fn time_of(id: EntryId) -> String {
    crate::time::utc(id.ms * 1000)
}

/// Newest announced weights version at each announce id, for staleness.
async fn announces(source: &Source) -> Result<Vec<(EntryId, u64)>, ReplayError> {
    let mut out = Vec::new();
    source
        .each(
            Stream::Weights.as_str(),
            RangeBound::Open,
            RangeBound::Open,
            |id, p| {
                if let Ok(a) = schema::decode::<WeightsAnnounce>(p) {
                    out.push((id, a.version));
                }
                true
            },
        )
        .await?;
    Ok(out)
}

fn version_at(announces: &[(EntryId, u64)], id: EntryId) -> Option<u64> {
    let i = announces.partition_point(|(a, _)| *a <= id);
    i.checked_sub(1).map(|i| announces[i].1)
}

/// Prints matching entries to `out`; returns how many were printed.
pub async fn read(
    source: &Source,
    opts: &ReadOptions,
    out: &mut dyn std::io::Write,
) -> Result<u64, ReplayError> {
    if Stream::from_name(&opts.stream).is_none() {
        return Err(ReplayError::Usage(format!(
            "--stream {} is not one of {}",
            opts.stream,
            Stream::ALL.map(Stream::as_str).join(", ")
        )));
    }
    let announced = match opts.min_staleness {
        Some(_) => {
            let a = announces(source).await?;
            if a.is_empty() {
                return Err(ReplayError::Usage(
                    "--min-staleness needs the weights stream (announces) in the source".into(),
                ));
            }
            a
        }
        None => Vec::new(),
    };
    let char_tok = Tokenizer::Char(crate::tasks::char_tokenizer());
    let tok = opts.tokenizer.as_ref().unwrap_or(&char_tok);
    let mut shown = 0u64;
    let mut failed: Option<std::io::Error> = None;
    source
        .each(&opts.stream, opts.from, opts.to, |id, payload| {
            let m = decode(&opts.stream, payload);
            if let Some(want) = &opts.group_id
                && !group_of(&m).is_some_and(|g| g.contains(want.as_str()))
            {
                return true;
            }
            if let Some(f) = &opts.reward {
                let Decoded::Scored(g) = &m else { return true };
                if !f.keeps(mean(&g.rewards)) {
                    return true;
                }
            }
            if let Some(min) = opts.min_staleness {
                let Some(g) = rollout_of(&m) else { return true };
                let newest = version_at(&announced, id).unwrap_or(0);
                let lag = newest.saturating_sub(g.oldest_version().unwrap_or(newest));
                if lag < min {
                    return true;
                }
            }
            let text = match opts.format {
                Format::Json => json_line(&opts.stream, id, payload, &m).to_string() + "\n",
                Format::Table => table_line(id, &m) + "\n",
                Format::Text => text_block(id, &m, tok),
            };
            if let Err(e) = out.write_all(text.as_bytes()) {
                failed = Some(e);
                return false;
            }
            shown += 1;
            opts.count.is_none_or(|c| shown < c as u64)
        })
        .await?;
    match failed {
        // A closed pipe (`| head`) ends the listing; it is not an error.
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(ReplayError::Usage(format!("cannot write: {e}")))
        }
        _ => Ok(shown),
    }
}

fn json_line(stream: &str, id: EntryId, payload: &[u8], m: &Decoded) -> Json {
    let message = msgpack_to_json(payload).unwrap_or_else(|e| json!({ "undecodable": e }));
    let mut line = json!({
        "stream": stream,
        "id": id.to_string(),
        "time": time_of(id),
        "message": message,
    });
    if let Decoded::Dead(d) = m {
        // The original bytes, decoded where they still decode, and always as hex.
        line["original"] = msgpack_to_json(&d.payload).unwrap_or(Json::Null);
        line["original_hex"] = Json::String(d.payload.iter().map(|b| format!("{b:02x}")).collect());
    }
    if let Decoded::Undecodable(e) = m {
        line["error"] = Json::String(e.clone());
    }
    line
}

fn table_line(id: EntryId, m: &Decoded) -> String {
    let head = format!("{id:<20} {}", time_of(id));
    let body = match m {
        Decoded::Prompt(p) => format!("prompt {} task {} {:?}", p.prompt_id, p.task, p.text),
        Decoded::Rollout(g) => rollout_summary(g),
        Decoded::Scored(s) => format!(
            "{}  reward mean {:.3} [{}]",
            rollout_summary(&s.rollout),
            mean(&s.rewards),
            s.rewards
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Decoded::Weights(a) => format!(
            "weights v{} step {} {} {} bytes in {} chunks, checksum {}",
            a.version, a.step, a.format, a.bytes, a.chunks, a.checksum
        ),
        Decoded::Dead(d) => format!(
            "dead letter from {} {} (group {}, consumer {}, {} deliveries): {}: {} [{} bytes]",
            d.source_stream,
            d.source_id,
            d.group,
            d.consumer,
            d.deliveries,
            d.reason,
            d.error,
            d.payload.len()
        ),
        Decoded::Event(e) => {
            let fields: Vec<String> = e
                .fields
                .iter()
                .map(|(k, v)| format!("{k}={}", number(*v)))
                .collect();
            format!(
                "{} {} {} v{} {}",
                e.kind,
                e.stage,
                e.source,
                e.version,
                fields.join(" ")
            )
        }
        Decoded::Undecodable(err) => format!("undecodable: {err}"),
    };
    format!("{head}  {body}")
}

fn rollout_summary(g: &RolloutGroup) -> String {
    let versions: std::collections::BTreeSet<u64> = g
        .samples
        .iter()
        .flat_map(|s| s.versions.iter().map(|v| v.version))
        .collect();
    format!(
        "group {} task {} {} samples {} tokens versions {:?} by {}",
        g.group_id,
        g.task,
        g.samples.len(),
        g.completion_tokens(),
        versions,
        g.gen_id
    )
}

/// Tokens `range` of `s` (the model's), each as `"piece"(vVERSION LOGPROB)`, with
/// `r±REWARD` where a reward sits on it and `tTEACHER` where a teacher scored it.
fn tokens_line(
    s: &Sample,
    range: std::ops::Range<usize>,
    tok: &Tokenizer,
    token_rewards: Option<&[f32]>,
    teacher: Option<&[f32]>,
) -> String {
    let mut o = String::new();
    for (i, (&t, &lp)) in s
        .tokens
        .iter()
        .zip(s.logprobs.iter())
        .enumerate()
        .take(range.end)
        .skip(range.start)
    {
        // Tokens without text (end of sequence, special tokens) show as their id.
        let piece = tok
            .decode(&[t])
            .ok()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| format!("<{t}>"));
        let _ = write!(o, "{piece:?}(v{} {lp:.2}", s.version_at(i));
        if let Some(&r) = token_rewards.and_then(|r| r.get(i))
            && r != 0.0
        {
            let _ = write!(o, " r{r:+.3}");
        }
        if let Some(&t) = teacher.and_then(|t| t.get(i)) {
            let _ = write!(o, " t{t:.2}");
        }
        o.push_str(") ");
    }
    o.trim_end().to_string()
}

fn text_block(id: EntryId, m: &Decoded, tok: &Tokenizer) -> String {
    let (g, scored) = match m {
        Decoded::Rollout(g) => (g, None),
        Decoded::Scored(s) => (&s.rollout, Some(s)),
        other => return table_line(id, other) + "\n",
    };
    let rewards = scored.map(|s| &s.rewards);
    let per_sample = |f: fn(&ScoredGroup) -> &Option<Vec<Floats>>, i: usize| {
        scored
            .and_then(|s| f(s).as_ref())
            .and_then(|a| a.get(i))
            .map(|a| a.as_slice())
    };
    let mut o = String::new();
    let prompt = tok
        .decode(&g.prompt_tokens)
        .unwrap_or_else(|e| format!("<{e}>"));
    let _ = writeln!(
        o,
        "== {id} {}  group {}  task {}",
        time_of(id),
        g.group_id,
        g.task
    );
    let _ = writeln!(o, "prompt: {prompt:?}");
    for (i, s) in g.samples.iter().enumerate() {
        let text = tok.decode(&s.tokens).unwrap_or_else(|e| format!("<{e}>"));
        let reward = rewards
            .and_then(|r| r.get(i))
            .map_or(String::new(), |r| format!(" reward {r:.2}"));
        let (token_rewards, teacher) = (
            per_sample(|s| &s.token_rewards, i),
            per_sample(|s| &s.ref_logprobs, i),
        );
        if !s.is_episode() {
            let _ = writeln!(o, "  [{i}]{reward} {:?} {text:?}", s.finish);
            let line = tokens_line(s, 0..s.tokens.len(), tok, token_rewards, teacher);
            let _ = writeln!(o, "      {line}");
            continue;
        }
        // An episode, turn by turn: the model's turns with versions and log-probs and the
        // turn's reward, the environment's answers as text.
        let turns = s.turns();
        let model_turns = turns.iter().filter(|(_, env)| !env).count();
        let _ = writeln!(
            o,
            "  [{i}]{reward} {:?} episode of {model_turns} turns",
            s.finish
        );
        let mut n = 0;
        for (range, env) in turns {
            if env {
                let text = tok
                    .decode(&s.tokens[range.clone()])
                    .unwrap_or_else(|e| format!("<{e}>"));
                let _ = writeln!(o, "      env     {text:?}");
                continue;
            }
            n += 1;
            let turn_reward = s
                .turn_rewards
                .iter()
                .find(|r| range.contains(&(r.index as usize)))
                .map_or(String::new(), |r| format!("  turn reward {:+.3}", r.reward));
            let line = tokens_line(s, range, tok, token_rewards, teacher);
            let _ = writeln!(o, "      turn {n:<2} {line}{turn_reward}");
        }
    }
    o
}

/// A number as a table shows it: a whole number without decimals (`step=3`), others to
/// four places.
fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.4}")
    }
}

/// What `replay --train` re-runs.
pub struct RetrainOptions {
    /// One checkpoint directory (`step-*`, as the trainer writes under --checkpoint-dir).
    pub checkpoint: PathBuf,
    pub from: RangeBound,
    pub to: RangeBound,
    /// Stop after this many steps past the checkpoint (default: until the entries run out).
    pub steps: Option<u64>,
}

/// The header of the step table `replay --train` prints, over [`RetrainStep::row`]s.
pub fn retrain_header() -> String {
    format!(
        "{:>6} {:>12} {:>12} {:>8} {:>7}  recorded run",
        "step", "loss", "grad_norm", "reward", "groups"
    )
}

/// One re-run step beside the recorded one.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RetrainStep {
    pub step: u64,
    pub version: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub reward_mean: f64,
    pub groups: usize,
    /// The recorded (loss, grad_norm, reward_mean) of this step, if the source has it.
    pub recorded: Option<(f64, f64, f64)>,
    /// All three bit-identical to the recording.
    pub identical: Option<bool>,
}

impl RetrainStep {
    /// The step as a row under [`RETRAIN_HEADER`].
    pub fn row(&self) -> String {
        let rec = match (self.recorded, self.identical) {
            (Some(_), Some(true)) => "identical".to_string(),
            (Some((l, g, r)), _) => format!("DIFFERS: loss {l:.6} grad_norm {g:.6} reward {r:.4}"),
            (None, _) => "not recorded".to_string(),
        };
        format!(
            "{:>6} {:>12.6} {:>12.6} {:>8.4} {:>7}  {rec}",
            self.step, self.loss, self.grad_norm, self.reward_mean, self.groups
        )
    }
}

#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RetrainSummary {
    pub start_step: u64,
    pub steps: Vec<RetrainStep>,
    pub compared: u64,
    pub identical: u64,
    /// The first step that differs from the recording.
    pub first_divergence: Option<u64>,
    pub dropped: BTreeMap<String, u64>,
}

impl RetrainSummary {
    /// The one-line summary of a re-run.
    pub fn line(&self) -> String {
        let mut line = format!(
            "re-ran {} steps from checkpoint step {}; {} of {} recorded steps bit-identical",
            self.steps.len(),
            self.start_step,
            self.identical,
            self.compared
        );
        if let Some(d) = self.first_divergence {
            line += &format!("; first divergence at step {d}");
        }
        if !self.dropped.is_empty() {
            line += &format!("; dropped {:?}", self.dropped);
        }
        line
    }
}

/// Re-runs training from `opts.checkpoint` over the scored entries of `source` between the
/// bounds, with the trainer's own code and batching (the same drop rules, the same
/// `groups_per_step`, the config the checkpoint was written with), and compares each step
/// with the step events recorded in the source.
pub async fn retrain(
    source: &Source,
    opts: &RetrainOptions,
    mut on_step: impl FnMut(&RetrainStep),
) -> Result<RetrainSummary, ReplayError> {
    // The replaying trainer keeps its own checkpoints in a directory removed afterwards.
    let scratch = tempfile::Builder::new()
        .prefix("rlstream-replay-")
        .tempdir()
        .map_err(|e| ReplayError::Usage(format!("cannot create a scratch directory: {e}")))?;
    let (mut cfg, state) =
        train::checkpoint::stage(&opts.checkpoint, scratch.path()).map_err(StageError::from)?;
    let start_step = state.step;
    cfg.train.steps = opts.steps.map_or(0, |n| start_step + n);
    // Checkpoints of the re-run are not needed; the final one still lands in the scratch dir.
    cfg.train.checkpoint_every = u64::MAX;
    cfg.train.name = "replay".into();

    let mut recorded: BTreeMap<u64, (f64, f64, f64)> = BTreeMap::new();
    let events = source
        .each(
            Stream::Events.as_str(),
            RangeBound::Open,
            RangeBound::Open,
            |_, p| {
                if let Ok(e) = schema::decode::<Event>(p)
                    && e.kind == "step"
                    && e.stage == Stage::Train.as_str()
                    && let Ok(r) = StepRecord::from_fields(&e.fields)
                {
                    recorded.insert(r.step, (r.loss, r.grad_norm, r.reward_mean));
                }
                true
            },
        )
        .await;
    if let Err(ReplayError::Archive(ArchiveError::NoStream(_))) = events {
        tracing::warn!("the archive has no events stream: nothing to compare with");
    } else {
        events?;
    }

    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology {
        block_ms: 20,
        ..Topology::default()
    };
    let key = topo.key(Stream::Scored);
    let mut batch: Vec<(EntryId, bytes::Bytes)> = Vec::new();
    source
        .each(Stream::Scored.as_str(), opts.from, opts.to, |id, p| {
            batch.push((id, bytes::Bytes::copy_from_slice(p)));
            true
        })
        .await?;
    if batch.is_empty() {
        return Err(ReplayError::Usage(
            "no scored entries in the range: nothing to train on".into(),
        ));
    }
    bus.append(&key, &batch).await?;

    // Stop once the trainer has been handed every entry: the steps those make possible are
    // taken before it looks at the stop signal again.
    let done = {
        let (bus, topo) = (bus.clone(), topo.clone());
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let s = bus.stats(&topo.key(Stream::Scored)).await;
                if let Ok(s) = s
                    && s.groups
                        .iter()
                        .any(|g| g.name == topo.group(Stream::Scored) && g.lag == Some(0))
                {
                    return;
                }
            }
        }
    };
    let mut summary = RetrainSummary {
        start_step,
        ..RetrainSummary::default()
    };
    let outcome = train::run(
        &cfg,
        bus,
        &topo,
        Transport::InProcess(LocalWeights::default()),
        done,
        |s| {
            let rec = recorded.get(&s.step).copied();
            let identical = rec.map(|(l, g, r)| {
                l.to_bits() == s.loss.to_bits()
                    && g.to_bits() == s.grad_norm.to_bits()
                    && r.to_bits() == s.reward_mean.to_bits()
            });
            let step = RetrainStep {
                step: s.step,
                version: s.version,
                loss: s.loss,
                grad_norm: s.grad_norm,
                reward_mean: s.reward_mean,
                groups: s.groups as usize,
                recorded: rec,
                identical,
            };
            on_step(&step);
            summary.steps.push(step);
        },
    )
    .await?;
    summary.dropped = outcome.dropped;
    for s in &summary.steps {
        if let Some(same) = s.identical {
            summary.compared += 1;
            if same {
                summary.identical += 1;
            } else if summary.first_divergence.is_none() {
                summary.first_divergence = Some(s.step);
            }
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text view marks each token that carries a reward (`r±…`) and the teacher's
    /// log-prob (`t…`) where a teacher scored it.
    #[test]
    fn text_shows_token_rewards_and_teacher_logprobs() {
        let g = crate::schema::examples::scored_group();
        let tok = Tokenizer::Char(crate::model::tokenizer::CharTokenizer::new(
            "abcdefghijklmn",
        ));
        let text = text_block(EntryId::new(1, 0), &Decoded::Scored(g.clone()), &tok);
        let lines: Vec<&str> = text.lines().collect();
        // Sample 0's reward of 1 sits on its last token; sample 1's reward there is 0.
        let first = lines[3];
        assert_eq!(first.matches(" r").count(), 1, "{text}");
        assert!(first.ends_with("r+1.000 t-1.00)"), "{text}");
        assert_eq!(first.matches(" t-").count(), 4, "{text}");
        assert!(!lines[5].contains(" r"), "{text}");
        let plain = text_block(EntryId::new(1, 0), &Decoded::Rollout(g.rollout), &tok);
        assert!(!plain.contains(" t-") && !plain.contains(" r+"), "{plain}");
        // An episode: the environment's tokens show as such, the turns' rewards on the
        // turns' last model tokens.
        let e = crate::schema::examples::scored_episode();
        let text = text_block(EntryId::new(1, 0), &Decoded::Scored(e.clone()), &tok);
        let sample = &e.rollout.samples[0];
        let turns: Vec<&str> = text
            .lines()
            .skip(3)
            .take_while(|l| !l.starts_with("  ["))
            .collect();
        let model = sample.turns().iter().filter(|(_, env)| !env).count();
        assert_eq!(turns.len(), sample.turns().len(), "{text}");
        assert_eq!(
            turns
                .iter()
                .filter(|l| l.trim_start().starts_with("turn "))
                .count(),
            model,
            "{text}"
        );
        assert_eq!(
            turns
                .iter()
                .filter(|l| l.trim_start().starts_with("env "))
                .count(),
            sample.env.len(),
            "{text}"
        );
        assert!(
            text.contains(&format!("episode of {model} turns")),
            "{text}"
        );
        // Each turn's reward shows on its line: on the token and as the turn's.
        for r in &sample.turn_rewards {
            let line = turns
                .iter()
                .find(|l| l.contains(&format!("turn reward {:+.3}", r.reward)));
            assert!(line.is_some(), "{text}");
        }
        assert!(
            text.contains("r-0.100)") && text.contains("r+1.000)"),
            "{text}"
        );
        assert!(!text.contains("(env)"), "{text}");
    }

    #[test]
    fn points_parse_as_ids_times_and_ages() {
        let p = |s: &str| parse_point(s).map_err(|e| e.to_string());
        assert_eq!(p("1764433812345-7"), Ok(EntryId::new(1_764_433_812_345, 7)));
        assert_eq!(p("1764433812345"), Ok(EntryId::new(1_764_433_812_345, 0)));
        assert_eq!(p("1970-01-01T00:00:00Z"), Ok(EntryId::new(0, 0)));
        assert_eq!(
            p("2024-02-29T12:34:56Z"),
            Ok(EntryId::new(1_709_210_096_000, 0))
        );
        assert_eq!(
            p("2024-02-29T12:34Z"),
            Ok(EntryId::new(1_709_210_040_000, 0))
        );
        let now = schema::now_us() / 1000;
        let ago = parse_point("-10m").expect("ago").ms;
        assert!(
            (now - 600_000..=now - 599_000).contains(&ago),
            "{ago} vs {now}"
        );
        for bad in [
            "yesterday",
            "-10x",
            "2024-13-01T00:00:00Z",
            "2024-02-29 12:34:56",
            "--5m",
        ] {
            let e = p(bad).expect_err(bad);
            assert!(e.contains("is not an entry id"), "{e}");
        }
    }

    #[test]
    fn reward_tests_parse() {
        let f = |s: &str| s.parse::<RewardFilter>();
        assert!(f("<0.5").is_ok_and(|r| r.keeps(0.4) && !r.keeps(0.5)));
        assert!(f("<=0.5").is_ok_and(|r| r.keeps(0.5)));
        assert!(f(">0.9").is_ok_and(|r| r.keeps(1.0) && !r.keeps(0.9)));
        assert!(f(">= 1").is_ok_and(|r| r.keeps(1.0)));
        assert!(f("1").is_ok_and(|r| r.keeps(1.0) && !r.keeps(0.99)));
        assert!(f("<x").is_err() && f("").is_err());
    }
}

//! Recorded calls, and the episodes and groups agents build from them.
//!
//! **Recording.** A call whose request names an episode (`X-Rlstream-Episode`) is kept, as
//! ids, under that episode, in the order the calls ended: its prompt's ids and, per choice,
//! the generator's own record of the completion (token ids, behaviour log-probs, version
//! runs, the kept sets when sampling truncated). `GET /v1/rlstream/episodes/{id}` returns them.
//!
//! **Episodes to train.** A call that also names a group (`X-Rlstream-Group`) builds a
//! trainable episode, one completion per call. Its first call's prompt is the group's
//! prompt; each later call must *extend* what the episode holds, byte for byte:
//! - chat: the conversation rendered with the chat template starts with the episode's text
//!   (its first rendering, then each completion decoded with its special tokens, then each
//!   addition), so an assistant message whose text is the sampled text keeps the sampled
//!   ids, and only the text after it is tokenized;
//! - text prompts: the prompt starts with the episode's text as the client had it (its
//!   first prompt, each completion's returned text, each addition);
//! - token-id prompts: the ids start with the episode's ids.
//!
//! The call is then decoded from the episode's ids followed by the tokenized addition, so
//! the tokens trained are the tokens the model read; the addition becomes an environment
//! span (no loss on it). A call that does not extend (a template that drops earlier
//! reasoning, a client that edits history) is served from its own tokenization, counted
//! (`rlstream_serve_drift_total`), and its episode is never trained: it is left out of its
//! group when closed (a group whose every episode drifted is dead-lettered, reason `drift`).
//!
//! **Closing.** `POST /v1/rlstream/episodes/{id}/close` with `{"reward": r}` (and
//! optionally `"turn_rewards"`, one per call) closes an episode: the reward goes on its last
//! model token, each turn reward on its call's last token. When all `group_size` episodes
//! of a group are closed, the group is published to the rollouts stream as one
//! RolloutGroup whose prompt is the group's (meta `env = agent`, so the scorer takes the
//! episode returns as rewards). A group not complete after `serve_group_timeout_s` is
//! dead-lettered with the reason; episodes idle past `serve_episode_ttl_s` are forgotten.
//!
//! Everything lives in the generator's memory: a generator that stops loses the episodes
//! not yet published (their calls' clients lose it too).

use super::recorded::RecordedCall;
use crate::model::sampler::Completion;
use crate::schema::{
    FinishReason, RolloutGroup, Sample, SamplingMask, SamplingParams, Span, TurnReward, VersionRun,
};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most bytes of an episode or group id.
pub const MAX_ID: usize = 200;

/// How an episode's calls give their prompts (they must all give them one way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
    Ids,
}

/// A call's prompt as given, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub enum Given {
    /// Chat rendered with the template, or a text prompt: the text.
    Text(Kind, String),
    Ids(Vec<u32>),
}

/// What an episode's trained sequence is made of after its prompt.
#[derive(Debug, Clone)]
enum Part {
    /// Tokens the client added between two calls.
    Env(Vec<u32>),
    /// A call's completion.
    Model(Box<Completion>),
}

/// A trainable episode's sequence: the group's prompt, then the parts, and the text they
/// make as its calls give prompts.
#[derive(Debug, Clone)]
struct Track {
    kind: Kind,
    prompt: Vec<u32>,
    parts: Vec<Part>,
    text: String,
}

impl Track {
    /// The ids the model has read and written so far.
    fn ids(&self) -> Vec<u32> {
        let mut ids = self.prompt.clone();
        for p in &self.parts {
            match p {
                Part::Env(t) => ids.extend_from_slice(t),
                Part::Model(c) => ids.extend_from_slice(&c.tokens),
            }
        }
        ids
    }

    /// The sample of the closed episode, with `reward` on its last model token and each
    /// of `turn_rewards` (one per call) on its call's last token.
    fn sample(&self, vocab: usize, reward: f32, turn_rewards: &[f32]) -> Sample {
        let (mut tokens, mut logprobs, mut versions) = (Vec::new(), Vec::new(), Vec::new());
        let (mut env, mut rewards, mut finish) = (Vec::new(), Vec::new(), FinishReason::Length);
        let truncated = self
            .parts
            .iter()
            .any(|p| matches!(p, Part::Model(c) if c.mask.is_some()));
        let (mut offsets, mut kept) = (vec![0u32], Vec::new());
        let mut turn = 0;
        for p in &self.parts {
            let start = tokens.len() as u32;
            match p {
                Part::Env(t) if !t.is_empty() => {
                    env.push(Span {
                        start,
                        len: t.len() as u32,
                    });
                    tokens.extend_from_slice(t);
                    logprobs.extend(std::iter::repeat_n(0.0, t.len()));
                    offsets.extend(std::iter::repeat_n(kept.len() as u32, t.len()));
                }
                Part::Env(_) => {}
                Part::Model(c) => {
                    for r in &c.versions {
                        if versions
                            .last()
                            .is_none_or(|l: &VersionRun| l.version != r.version)
                        {
                            versions.push(VersionRun {
                                start: start + r.start,
                                version: r.version,
                            });
                        }
                    }
                    tokens.extend_from_slice(&c.tokens);
                    logprobs.extend_from_slice(&c.logprobs);
                    for i in 0..c.tokens.len() {
                        match &c.mask {
                            Some(m) => kept.extend_from_slice(m.step(i)),
                            None if truncated => kept.extend(0..vocab as u32),
                            None => {}
                        }
                        offsets.push(kept.len() as u32);
                    }
                    let last = (tokens.len() - 1) as u32;
                    let r = turn_rewards.get(turn).copied().unwrap_or(0.0);
                    rewards.push(TurnReward {
                        index: last,
                        reward: r,
                    });
                    finish = c.finish;
                    turn += 1;
                }
            }
        }
        if let Some(last) = rewards.last_mut() {
            last.reward += reward;
        }
        Sample {
            tokens: tokens.into(),
            logprobs: logprobs.into(),
            versions,
            finish,
            mask: truncated.then(|| SamplingMask {
                offsets: offsets.into(),
                ids: kept.into(),
            }),
            env,
            turn_rewards: rewards,
            routing: None,
        }
    }
}

/// What became of an episode's latest call for training.
#[derive(Debug, Clone, PartialEq)]
pub enum Extension {
    /// Not part of a trainable episode.
    Untracked,
    /// The episode's first call: its prompt is the group's.
    First,
    /// Decode from these ids: the episode's, then the tokenized addition (`added` ids,
    /// from `added_text`).
    Extends {
        ids: Vec<u32>,
        added: usize,
        added_text: String,
    },
    /// The prompt does not extend the episode: served as tokenized, the episode untrained.
    Drift,
}

struct Episode {
    calls: Vec<RecordedCall>,
    group: Option<String>,
    track: Option<Track>,
    /// Calls that did not extend the episode.
    drifted: u32,
    /// A call of this episode is being decoded.
    busy: bool,
    closed: bool,
    used: Instant,
}

impl Episode {
    fn new(used: Instant) -> Self {
        Episode {
            calls: Vec::new(),
            group: None,
            track: None,
            drifted: 0,
            busy: false,
            closed: false,
            used,
        }
    }

    /// Refuses a closed episode, or one with a call being decoded.
    fn open(&self, episode: &str) -> Result<(), EpisodeRefusal> {
        if self.closed {
            return Err(refuse(
                409,
                "episode_closed",
                format!("episode `{episode}` is closed"),
            ));
        }
        if self.busy {
            return Err(refuse(
                409,
                "episode_busy",
                format!(
                    "episode `{episode}` has a call being decoded: an episode's calls follow one another"
                ),
            ));
        }
        Ok(())
    }
}

struct Group {
    prompt: Vec<u32>,
    sampling: SamplingParams,
    members: Vec<String>,
    /// Closed members' samples (`None`: left out, drifted).
    closed: Vec<Option<Sample>>,
    started: Instant,
    started_us: u64,
}

/// Why an episode call or close is refused.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeRefusal {
    /// 400, 404 or 409.
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

fn refuse(status: u16, code: &'static str, message: impl Into<String>) -> EpisodeRefusal {
    EpisodeRefusal {
        status,
        code,
        message: message.into(),
    }
}

/// A closed group, ready to publish or to dead-letter.
#[derive(Debug)]
pub enum Closed {
    /// Not every episode of the group is closed yet: `closed` of `of`.
    Waiting {
        closed: usize,
        of: usize,
    },
    Publish(Box<RolloutGroup>),
    /// Every episode drifted (or the group timed out): nothing to train.
    Dead {
        group: String,
        reason: &'static str,
        detail: String,
    },
}

struct State {
    episodes: HashMap<String, Episode>,
    groups: HashMap<String, Group>,
}

/// The recorded episodes and open groups of one generator.
pub struct AgentEpisodes {
    ttl: Duration,
    group_size: usize,
    group_timeout: Duration,
    vocab: usize,
    gen_id: String,
    state: Mutex<State>,
}

/// What the start of a call needs to know.
pub struct Start<'a> {
    pub episode: &'a str,
    pub group: Option<&'a str>,
    pub n: usize,
    pub given: &'a Given,
    /// The prompt as tokenized (the group's prompt on an episode's first call).
    pub prompt: &'a [u32],
    pub sampling: &'a SamplingParams,
}

impl AgentEpisodes {
    pub fn new(
        ttl: Duration,
        group_size: usize,
        group_timeout: Duration,
        vocab: usize,
        gen_id: &str,
    ) -> Self {
        AgentEpisodes {
            ttl,
            group_size,
            group_timeout,
            vocab,
            gen_id: gen_id.to_string(),
            state: Mutex::new(State {
                episodes: HashMap::new(),
                groups: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock left whole records: keep using them.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a call of `s.episode`: how its prompt relates to the episode (see the module
    /// docs); an episode's first call in a group joins the group. `tokenize` turns an
    /// addition's text into ids. Marks the episode busy until [`Episodes::record`] or
    /// [`Episodes::release`].
    pub fn start(
        &self,
        s: &Start<'_>,
        tokenize: impl Fn(&str) -> Result<Vec<u32>, String>,
    ) -> Result<Extension, EpisodeRefusal> {
        let now = Instant::now();
        let mut state = self.lock();
        let State { episodes, groups } = &mut *state;
        let ttl = self.ttl;
        episodes.retain(|_, e| e.busy || e.group.is_some() || now.duration_since(e.used) < ttl);
        let e = episodes
            .entry(s.episode.to_string())
            .or_insert_with(|| Episode::new(now));
        check_call(e, s)?;
        let group = s.group.map(str::to_string).or_else(|| e.group.clone());
        let extension = match (&group, &e.track) {
            (None, _) => Extension::Untracked,
            (Some(g), None) => {
                self.join(groups, g, s)?;
                Extension::First
            }
            (Some(_), Some(t)) => extend(t, s.given, &tokenize),
        };
        if extension == Extension::Drift {
            e.drifted += 1;
            crate::metrics::drift();
        }
        e.busy = true;
        e.used = now;
        e.group = group;
        Ok(extension)
    }

    /// Makes `s.episode` a member of group `g` (created with `s.prompt` as its prompt).
    fn join(
        &self,
        groups: &mut HashMap<String, Group>,
        g: &str,
        s: &Start<'_>,
    ) -> Result<(), EpisodeRefusal> {
        let group = groups.entry(g.to_string()).or_insert_with(|| Group {
            prompt: s.prompt.to_vec(),
            sampling: s.sampling.clone(),
            members: Vec::new(),
            closed: Vec::new(),
            started: Instant::now(),
            started_us: crate::schema::now_us(),
        });
        if group.prompt != s.prompt {
            return Err(refuse(
                400,
                "group_prompt_mismatch",
                format!(
                    "the first call of every episode of group `{g}` has the group's prompt ({} tokens); this one has another ({} tokens)",
                    group.prompt.len(),
                    s.prompt.len()
                ),
            ));
        }
        if !group.members.iter().any(|m| m == s.episode) {
            if group.members.len() >= self.group_size {
                return Err(refuse(
                    409,
                    "group_full",
                    format!("group `{g}` has its {} episodes already", self.group_size),
                ));
            }
            group.members.push(s.episode.to_string());
        }
        Ok(())
    }

    /// Ends a call that will not be recorded (refused by the model, failed, abandoned); an
    /// episode whose first call this was leaves its group.
    pub fn release(&self, episode: &str) {
        let mut state = self.lock();
        let State { episodes, groups } = &mut *state;
        let Some(e) = episodes.get_mut(episode) else {
            return;
        };
        e.busy = false;
        if e.track.is_none()
            && let Some(g) = e.group.take()
            && let Some(group) = groups.get_mut(&g)
        {
            group.members.retain(|m| m != episode);
            if group.members.is_empty() && group.closed.is_empty() {
                groups.remove(&g);
            }
        }
    }

    /// Appends a finished call to `episode` (its number there), and its completion to the
    /// episode's trained sequence when it has one.
    pub fn record(
        &self,
        episode: &str,
        call: RecordedCall,
        extension: &Extension,
        given: &Given,
        completion_text: &str,
    ) -> usize {
        let mut state = self.lock();
        let e = state
            .episodes
            .entry(episode.to_string())
            .or_insert_with(|| Episode::new(Instant::now()));
        e.busy = false;
        e.used = Instant::now();
        match (extension, call.choices.first().cloned()) {
            (Extension::First, Some(c)) => {
                let (kind, text) = match given {
                    Given::Text(k, t) => (*k, t.clone()),
                    Given::Ids(_) => (Kind::Ids, String::new()),
                };
                e.track = Some(Track {
                    kind,
                    prompt: call.prompt.clone(),
                    parts: vec![Part::Model(Box::new(c))],
                    text: text + completion_text,
                });
            }
            (
                Extension::Extends {
                    ids,
                    added,
                    added_text,
                },
                Some(c),
            ) => {
                if let Some(t) = e.track.as_mut() {
                    t.parts.push(Part::Env(ids[ids.len() - *added..].to_vec()));
                    t.parts.push(Part::Model(Box::new(c)));
                    t.text.push_str(added_text);
                    t.text.push_str(completion_text);
                }
            }
            _ => {}
        }
        e.calls.push(call);
        crate::metrics::recorded_call();
        e.calls.len() - 1
    }

    /// Closes `episode` with its `reward` (and a reward per call): the group when this
    /// completed it.
    pub fn close(
        &self,
        episode: &str,
        reward: f32,
        turn_rewards: &[f32],
    ) -> Result<Closed, EpisodeRefusal> {
        let mut state = self.lock();
        let State { episodes, groups } = &mut *state;
        let Some(e) = episodes.get_mut(episode) else {
            return Err(refuse(
                404,
                "episode_not_found",
                format!(
                    "no episode `{episode}` (never started, or forgotten after --serve-episode-ttl-s)"
                ),
            ));
        };
        let (g, sample) = closing(e, episode, self.vocab, reward, turn_rewards)?;
        let Some(group) = groups.get_mut(&g) else {
            return Err(refuse(
                404,
                "group_not_found",
                format!("group `{g}` is gone (timed out)"),
            ));
        };
        group.closed.push(sample);
        let closed = group.closed.len();
        if closed < self.group_size {
            return Ok(Closed::Waiting {
                closed,
                of: self.group_size,
            });
        }
        let Some(group) = groups.remove(&g) else {
            return Ok(Closed::Waiting {
                closed,
                of: self.group_size,
            });
        };
        for m in &group.members {
            episodes.remove(m);
        }
        Ok(self.finish(g, group))
    }

    /// A complete group as a RolloutGroup, or dead when no episode can be trained.
    fn finish(&self, id: String, group: Group) -> Closed {
        let samples: Vec<Sample> = group.closed.into_iter().flatten().collect();
        if samples.is_empty() {
            return Closed::Dead {
                group: id,
                reason: "drift",
                detail: format!(
                    "every episode of the group drifted from what was sampled ({} episodes)",
                    group.members.len()
                ),
            };
        }
        let mut meta = std::collections::BTreeMap::new();
        meta.insert(crate::env::ENV.to_string(), "agent".to_string());
        Closed::Publish(Box::new(RolloutGroup {
            schema: RolloutGroup::version_for(&samples),
            group_id: format!("agent:{id}"),
            prompt_id: id,
            task: "agent".into(),
            prompt_tokens: group.prompt.into(),
            samples,
            sampling: group.sampling,
            gen_id: self.gen_id.clone(),
            started_us: group.started_us,
            finished_us: crate::schema::now_us(),
            meta,
            prompt_routing: None,
        }))
    }

    /// Groups open longer than the timeout, removed with their episodes, as dead groups.
    pub fn expired(&self) -> Vec<Closed> {
        let now = Instant::now();
        let mut state = self.lock();
        let State { episodes, groups } = &mut *state;
        let old: Vec<String> = groups
            .iter()
            .filter(|(_, g)| now.duration_since(g.started) >= self.group_timeout)
            .map(|(k, _)| k.clone())
            .collect();
        old.into_iter()
            .filter_map(|id| {
                let g = groups.remove(&id)?;
                for m in &g.members {
                    episodes.remove(m);
                }
                Some(Closed::Dead {
                    detail: format!(
                        "{} of {} episodes closed after {} s",
                        g.closed.len(),
                        self.group_size,
                        self.group_timeout.as_secs()
                    ),
                    group: id,
                    reason: "group_timeout",
                })
            })
            .collect()
    }

    /// The episode's calls as JSON, or `None` when none is recorded under `episode`.
    pub fn json(&self, episode: &str) -> Option<Value> {
        let state = self.lock();
        let e = state.episodes.get(episode)?;
        let calls: Vec<Value> = e.calls.iter().enumerate().map(|(i, c)| c.json(i)).collect();
        Some(json!({
            "episode": episode,
            "group": e.group,
            "drifted_calls": e.drifted,
            "closed": e.closed,
            "calls": calls,
        }))
    }
}

/// Closes `e`: its group, and its sample (`None` when a call drifted), or why it cannot
/// be closed.
fn closing(
    e: &mut Episode,
    episode: &str,
    vocab: usize,
    reward: f32,
    turn_rewards: &[f32],
) -> Result<(String, Option<Sample>), EpisodeRefusal> {
    e.open(episode)?;
    let Some(g) = e.group.clone() else {
        return Err(refuse(
            400,
            "no_group",
            format!("episode `{episode}` names no group (X-Rlstream-Group): nothing to train"),
        ));
    };
    let Some(track) = &e.track else {
        return Err(refuse(
            400,
            "no_calls",
            format!("episode `{episode}` has no call to train on"),
        ));
    };
    let calls = track
        .parts
        .iter()
        .filter(|p| matches!(p, Part::Model(_)))
        .count();
    if !turn_rewards.is_empty() && turn_rewards.len() != calls {
        return Err(refuse(
            400,
            "invalid_value",
            format!(
                "turn_rewards has {} rewards for {calls} calls",
                turn_rewards.len()
            ),
        ));
    }
    let sample = (e.drifted == 0).then(|| track.sample(vocab, reward, turn_rewards));
    e.closed = true;
    crate::metrics::agent_episode(if sample.is_some() { "closed" } else { "drift" });
    Ok((g, sample))
}

/// Refuses a call on a closed or busy episode, or one that names another group than its
/// episode's.
fn check_call(e: &Episode, s: &Start<'_>) -> Result<(), EpisodeRefusal> {
    let episode = s.episode;
    e.open(episode)?;
    match (s.group, e.group.as_deref()) {
        (Some(g), Some(mine)) if g != mine => Err(refuse(
            400,
            "group_mismatch",
            format!("episode `{episode}` belongs to group `{mine}`, not `{g}`"),
        )),
        (Some(_), None) if !e.calls.is_empty() => Err(refuse(
            400,
            "group_mismatch",
            format!("episode `{episode}` was started without a group: name it on its first call"),
        )),
        (Some(_), _) | (None, Some(_)) if s.n != 1 => Err(refuse(
            400,
            "invalid_value",
            "a call of a trained episode samples one completion (n = 1)",
        )),
        _ => Ok(()),
    }
}

/// How a call's prompt (`given`) relates to a trainable episode's `track`.
fn extend(
    track: &Track,
    given: &Given,
    tokenize: &dyn Fn(&str) -> Result<Vec<u32>, String>,
) -> Extension {
    let ids = track.ids();
    match given {
        Given::Ids(p) if track.kind == Kind::Ids && p.starts_with(&ids) => Extension::Extends {
            added: p.len() - ids.len(),
            ids: p.clone(),
            added_text: String::new(),
        },
        Given::Text(kind, text) if *kind == track.kind && text.starts_with(&track.text) => {
            let rest = &text[track.text.len()..];
            match tokenize(rest) {
                Ok(added) => Extension::Extends {
                    added: added.len(),
                    ids: ids.into_iter().chain(added).collect(),
                    added_text: rest.to_string(),
                },
                Err(_) => Extension::Drift,
            }
        }
        _ => Extension::Drift,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 4,
            stop_tokens: vec![0],
            seed: 1,
        }
    }

    fn completion(tokens: Vec<u32>, version: u64) -> Completion {
        Completion {
            request_id: 0,
            index: 0,
            logprobs: tokens.iter().map(|&t| -0.5 - t as f32).collect(),
            tokens,
            versions: vec![VersionRun { start: 0, version }],
            finish: FinishReason::Stop,
            mask: None,
            env: Vec::new(),
            turn_rewards: Vec::new(),
            turns: 0,
            routing: None,
            prompt_routing: None,
        }
    }

    fn call(prompt: &[u32], c: Completion) -> RecordedCall {
        RecordedCall {
            endpoint: "completions",
            prompt: prompt.to_vec(),
            sampling: params(),
            choices: vec![c],
        }
    }

    /// Each byte an id: additions tokenize on their own, as the endpoint's tokenizer would.
    fn bytes(t: &str) -> Result<Vec<u32>, String> {
        Ok(t.bytes().map(u32::from).collect())
    }

    /// Plays one episode's call: starts it, records `completion` (returned as `text`).
    fn play(
        eps: &AgentEpisodes,
        episode: &str,
        prompt: &str,
        tokens: Vec<u32>,
        v: u64,
        text: &str,
    ) -> Extension {
        let given = Given::Text(Kind::Text, prompt.to_string());
        let ids = bytes(prompt).unwrap_or_default();
        let p = params();
        let s = Start {
            episode,
            group: Some("g"),
            n: 1,
            given: &given,
            prompt: &ids,
            sampling: &p,
        };
        let ext = eps.start(&s, bytes).expect("a call");
        let decoded = match &ext {
            Extension::Extends { ids, .. } => ids.clone(),
            _ => ids,
        };
        eps.record(
            episode,
            call(&decoded, completion(tokens, v)),
            &ext,
            &given,
            text,
        );
        ext
    }

    #[test]
    fn calls_that_extend_become_one_sample_and_an_edited_history_is_left_out() {
        let eps = AgentEpisodes::new(
            Duration::from_secs(60),
            2,
            Duration::from_secs(60),
            300,
            "gen-0",
        );
        assert_eq!(
            play(&eps, "a", "1+1=", vec![50, 0], 3, "2"),
            Extension::First
        );
        // The client's next prompt: what it sent, what it got, and the tool's answer.
        let ext = play(&eps, "a", "1+1=2 ok?", vec![51, 0], 4, "3");
        let prompt = bytes("1+1=").unwrap_or_default();
        let mut want: Vec<u32> = prompt.iter().copied().chain([50, 0]).collect();
        want.extend(bytes(" ok?").unwrap_or_default());
        assert_eq!(
            ext,
            Extension::Extends {
                ids: want,
                added: 4,
                added_text: " ok?".into()
            }
        );
        assert!(matches!(
            eps.close("a", 1.0, &[]),
            Ok(Closed::Waiting { closed: 1, of: 2 })
        ));
        assert_eq!(
            eps.close("a", 1.0, &[]).err().map(|r| r.code),
            Some("episode_closed")
        );

        assert_eq!(
            play(&eps, "b", "1+1=", vec![52, 0], 3, "4"),
            Extension::First
        );
        assert_eq!(
            play(&eps, "b", "1+1=5 ok?", vec![53, 0], 4, "x"),
            Extension::Drift
        );
        let group = match eps.close("b", 0.5, &[]) {
            Ok(Closed::Publish(g)) => g,
            other => panic!("{other:?}"),
        };
        assert_eq!(group.prompt_tokens.as_slice(), prompt.as_slice());
        assert_eq!(group.samples.len(), 1, "the drifted episode is left out");
        let s = &group.samples[0];
        assert_eq!(s.tokens.as_slice(), [50, 0, 32, 111, 107, 63, 51, 0]);
        assert_eq!(s.env, vec![Span { start: 2, len: 4 }]);
        assert_eq!(&s.logprobs.as_slice()[2..6], [0.0; 4]);
        assert_eq!(s.version_at(1), 3);
        assert_eq!(s.version_at(6), 4);
        let rewards: Vec<(u32, f32)> = s.turn_rewards.iter().map(|r| (r.index, r.reward)).collect();
        assert_eq!(rewards, [(1, 0.0), (7, 1.0)]);
        assert!(
            eps.json("a").is_none(),
            "a published group's episodes are freed"
        );
    }

    #[test]
    fn a_group_takes_one_prompt_and_g_episodes_and_an_open_group_expires() {
        let eps = AgentEpisodes::new(Duration::from_secs(60), 1, Duration::ZERO, 300, "gen-0");
        play(&eps, "a", "1+1=", vec![50, 0], 0, "2");
        let given = Given::Text(Kind::Text, "1+1=".into());
        let ids = bytes("1+1=").unwrap_or_default();
        let p = params();
        let other = Start {
            episode: "b",
            group: Some("g"),
            n: 1,
            given: &given,
            prompt: &ids,
            sampling: &p,
        };
        let refused = |s: &Start<'_>| eps.start(s, bytes).err().map(|r| r.code);
        assert_eq!(refused(&other), Some("group_full"));
        let busy = Start {
            episode: "a",
            ..other
        };
        assert_eq!(refused(&Start { n: 2, ..busy }), Some("invalid_value"));
        let expired = eps.expired();
        assert!(matches!(
            &expired[..],
            [Closed::Dead {
                reason: "group_timeout",
                ..
            }]
        ));
        assert_eq!(
            eps.close("a", 1.0, &[]).err().map(|r| r.code),
            Some("episode_not_found")
        );
    }
}

//! What one recorded entry is, decoded enough to filter and print, whatever its stream.

use crate::bus::EntryId;
use crate::roles::Stream;
use crate::schema::{self, DeadLetter, Event, Prompt, RolloutGroup, ScoredGroup, WeightsAnnounce};

/// What one entry is, decoded enough to filter and print.
pub(super) enum EntryMessage {
    Prompt(Prompt),
    Rollout(RolloutGroup),
    Scored(ScoredGroup),
    Weights(WeightsAnnounce),
    Dead(DeadLetter),
    Event(Event),
    Undecodable(String),
}

pub(super) fn decode(stream: &str, payload: &[u8]) -> EntryMessage {
    fn d<M: schema::Message>(p: &[u8], f: fn(M) -> EntryMessage) -> EntryMessage {
        match schema::decode::<M>(p) {
            Ok(m) => f(m),
            Err(e) => EntryMessage::Undecodable(e.to_string()),
        }
    }
    match Stream::from_name(stream) {
        Some(Stream::Prompts) => d(payload, EntryMessage::Prompt),
        Some(Stream::Rollouts) => d(payload, EntryMessage::Rollout),
        Some(Stream::Scored) => d(payload, EntryMessage::Scored),
        Some(Stream::Weights) => d(payload, EntryMessage::Weights),
        Some(Stream::Dead) => d(payload, EntryMessage::Dead),
        Some(Stream::Events) | None => d(payload, EntryMessage::Event),
    }
}

pub(super) fn stream_of_key(key: &str) -> &str {
    key.rsplit_once(':').map_or(key, |(_, s)| s)
}

/// The group a message is about, for `--group-id`.
pub(super) fn group_of(m: &EntryMessage) -> Option<String> {
    match m {
        EntryMessage::Prompt(p) => Some(p.prompt_id.clone()),
        EntryMessage::Rollout(g) => Some(g.group_id.clone()),
        EntryMessage::Scored(g) => Some(g.rollout.group_id.clone()),
        EntryMessage::Dead(d) => group_of(&decode(stream_of_key(&d.source_stream), &d.payload)),
        _ => None,
    }
}

pub(super) fn rollout_of(m: &EntryMessage) -> Option<&RolloutGroup> {
    match m {
        EntryMessage::Rollout(g) => Some(g),
        EntryMessage::Scored(g) => Some(&g.rollout),
        _ => None,
    }
}

pub(super) fn mean(xs: &[f32]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().map(|&x| f64::from(x)).sum::<f64>() / xs.len() as f64
}

pub(super) fn time_of(id: EntryId) -> String {
    crate::time::utc(id.ms * 1000)
}

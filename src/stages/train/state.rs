//! The trainer's persistent state, saved as `state.json` in each checkpoint: its version
//! and step, what it trained and dropped, and the group ids it remembers so that nothing
//! is trained twice across restarts.

use super::intake::DropReason;
use crate::schema::ScoredGroup;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Group ids remembered for de-duplication.
pub(super) const REMEMBERED_GROUPS: usize = 100_000;

/// Persistent trainer state, saved as `state.json` in each checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub version: u64,
    pub step: u64,
    pub trained_groups: u64,
    pub dropped: BTreeMap<String, u64>,
    /// Recently trained group ids (de-duplication across restarts).
    pub recent_groups: VecDeque<String>,
    /// Recently dropped group ids with the reason, for accounting.
    pub recent_dropped: VecDeque<(String, String)>,
    /// LoRA: the checksum of the frozen base the adapter was trained on (a resume on
    /// another base is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_checksum: Option<String>,
}

impl TrainerState {
    /// Counts a group that will not be trained, with the reason: the one place a drop is
    /// recorded, for every reason.
    pub fn record_drop(&mut self, g: &ScoredGroup, reason: DropReason) {
        let reason = reason.as_str();
        *self.dropped.entry(reason.to_string()).or_default() += 1;
        crate::metrics::dropped(reason, g.rollout.samples.len() as u64);
        self.recent_dropped
            .push_back((g.rollout.group_id.clone(), reason.to_string()));
        while self.recent_dropped.len() > REMEMBERED_GROUPS {
            self.recent_dropped.pop_front();
        }
    }
}

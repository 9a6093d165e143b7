//! The trainer's intake: which scored groups it trains on, and when. Pure bookkeeping with
//! no bus or model, so every rule is unit-tested here.
//!
//! A group is dropped (acked, counted with its reason, never trained) when its oldest token
//! is more than `max_lag` versions behind the trainer (`stale`, judged on arrival and again
//! before every step, since buffered groups age) or when its group id was trained already
//! or is waiting in the buffer (`duplicate`). The rest wait in arrival order until a step's
//! worth (`per_step`) is there.

use crate::bus::Delivery;
use crate::schema::ScoredGroup;

/// Why a group is not trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Older than `max_lag` versions.
    Stale,
    /// Trained already, or already waiting.
    Duplicate,
    /// Its step had a non-finite loss or gradient and was skipped.
    Nonfinite,
}

impl DropReason {
    pub const ALL: [DropReason; 3] = [
        DropReason::Stale,
        DropReason::Duplicate,
        DropReason::Nonfinite,
    ];

    /// The name in the trainer state, the step records and the metrics' `reason` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::Stale => "stale",
            DropReason::Duplicate => "duplicate",
            DropReason::Nonfinite => "nonfinite",
        }
    }
}

/// Versions `g` is behind a trainer at `version` (its oldest token counts).
pub fn staleness(g: &ScoredGroup, version: u64) -> u64 {
    g.rollout
        .oldest_version()
        .map_or(0, |v| version.saturating_sub(v))
}

/// Groups waiting for a step.
pub struct Intake {
    max_lag: u64,
    per_step: usize,
    buffer: Vec<Delivery<ScoredGroup>>,
}

impl Intake {
    pub fn new(max_lag: u64, per_step: usize) -> Self {
        Intake {
            max_lag,
            per_step: per_step.max(1),
            buffer: Vec::new(),
        }
    }

    /// Groups waiting.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// Takes `d` in for a trainer at `version` (`None`), or hands it back with the reason it is not
    /// trained; `trained` tells whether a group id was trained already.
    pub fn offer(
        &mut self,
        d: Delivery<ScoredGroup>,
        version: u64,
        trained: impl Fn(&str) -> bool,
    ) -> Option<(Delivery<ScoredGroup>, DropReason)> {
        let id = &d.message.rollout.group_id;
        if staleness(&d.message, version) > self.max_lag {
            Some((d, DropReason::Stale))
        } else if trained(id)
            || self
                .buffer
                .iter()
                .any(|b| b.message.rollout.group_id == *id)
        {
            Some((d, DropReason::Duplicate))
        } else {
            self.buffer.push(d);
            None
        }
    }

    /// Groups that have grown stale at `version` while they waited, removed.
    pub fn expire(&mut self, version: u64) -> Vec<Delivery<ScoredGroup>> {
        let max_lag = self.max_lag;
        let (fresh, aged) = std::mem::take(&mut self.buffer)
            .into_iter()
            .partition(|d| staleness(&d.message, version) <= max_lag);
        self.buffer = fresh;
        aged
    }

    /// One step's worth, the oldest waiting, once that many are waiting; ordered by group id
    /// (prompt id first), not by arrival, so the same groups make the same step however the
    /// scorers' replies interleaved (a `--sync` run is repeatable bit for bit).
    pub fn take(&mut self) -> Option<Vec<Delivery<ScoredGroup>>> {
        if self.buffer.len() < self.per_step {
            return None;
        }
        let mut taken: Vec<_> = self.buffer.drain(..self.per_step).collect();
        taken.sort_by(|a, b| a.message.rollout.group_id.cmp(&b.message.rollout.group_id));
        Some(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::EntryId;
    use crate::schema::examples;

    /// A delivery of group `id` whose tokens were sampled at `version`.
    fn delivery(id: &str, version: u64) -> Delivery<ScoredGroup> {
        let mut g = examples::scored_group();
        g.rollout.group_id = id.into();
        for s in &mut g.rollout.samples {
            s.versions = vec![(0, version).into()];
        }
        Delivery {
            id: EntryId::new(version, 0),
            message: g,
            deliveries: 1,
            payload: bytes::Bytes::new(),
        }
    }

    fn never(_: &str) -> bool {
        false
    }

    #[test]
    fn stale_and_duplicate_groups_are_handed_back_with_the_reason() {
        let mut intake = Intake::new(2, 3);
        assert!(
            intake.offer(delivery("a", 8), 10, never).is_none(),
            "lag 2 = max_lag"
        );
        let (d, why) = intake.offer(delivery("b", 7), 10, never).unwrap();
        assert_eq!(
            (d.message.rollout.group_id.as_str(), why),
            ("b", DropReason::Stale)
        );
        let (_, why) = intake.offer(delivery("a", 9), 10, never).unwrap();
        assert_eq!(why, DropReason::Duplicate, "already waiting");
        let (_, why) = intake.offer(delivery("c", 9), 10, |id| id == "c").unwrap();
        assert_eq!(why, DropReason::Duplicate, "already trained");
        assert_eq!(intake.len(), 1);
    }

    #[test]
    fn a_step_takes_its_worth_in_arrival_order_and_waiting_groups_age() {
        let mut intake = Intake::new(1, 2);
        for (id, v) in [("a", 5), ("b", 6), ("c", 6)] {
            assert!(intake.offer(delivery(id, v), 6, never).is_none());
        }
        let step: Vec<String> = intake
            .take()
            .unwrap()
            .into_iter()
            .map(|d| d.message.rollout.group_id)
            .collect();
        assert_eq!(step, ["a", "b"]);
        assert!(intake.take().is_none(), "one left, fewer than a step");
        assert!(intake.expire(7).is_empty(), "c is 1 behind at 7");
        let aged = intake.expire(8);
        assert_eq!(aged.len(), 1, "c is 2 behind at 8");
        assert!(intake.is_empty());
    }

    #[test]
    fn reasons_have_their_wire_names() {
        let names: Vec<&str> = DropReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names, ["stale", "duplicate", "nonfinite"]);
    }
}

//! The trainer's intake: which scored groups it trains on, and when. Pure bookkeeping with
//! no bus or model, so every rule is unit-tested here.
//!
//! A group is dropped (acked, counted with its reason, never trained) when its oldest token
//! is more than `max_lag` versions behind the trainer (`stale`, judged on arrival and again
//! before every step, since buffered groups age), when its group id was trained already
//! or is waiting in the buffer (`duplicate`), or, with dynamic sampling on, when it would
//! teach nothing (`zero_variance`, `low_advantage`; see [`Filter`]). The rest wait in
//! arrival order until a step's worth (`per_step`) is there.

use super::TrainConfig;
use crate::bus::Delivery;
use crate::schema::{FinishReason, ScoredGroup};

/// Why a group is not trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Older than `max_lag` versions.
    Stale,
    /// Trained already, or already waiting.
    Duplicate,
    /// Its step had a non-finite loss or gradient and was skipped.
    Nonfinite,
    /// Dynamic sampling: every reward equal, so every advantage 0.
    ZeroVariance,
    /// Dynamic sampling: every |advantage| below `filter_min_abs_advantage`.
    LowAdvantage,
    /// `mask_truncated`: every completion was cut at `max_new_tokens`.
    Truncated,
}

impl DropReason {
    pub const ALL: [DropReason; 6] = [
        DropReason::Stale,
        DropReason::Duplicate,
        DropReason::Nonfinite,
        DropReason::ZeroVariance,
        DropReason::LowAdvantage,
        DropReason::Truncated,
    ];

    /// Whether dynamic sampling or overlong masking dropped it because it would teach
    /// nothing (the stream replaces it; not an error).
    pub const fn filtered(self) -> bool {
        matches!(
            self,
            DropReason::ZeroVariance | DropReason::LowAdvantage | DropReason::Truncated
        )
    }

    /// The name in the trainer state, the step records and the metrics' `reason` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::Stale => "stale",
            DropReason::Duplicate => "duplicate",
            DropReason::Nonfinite => "nonfinite",
            DropReason::ZeroVariance => "zero_variance",
            DropReason::LowAdvantage => "low_advantage",
            DropReason::Truncated => "truncated",
        }
    }
}

/// Versions `g` is behind a trainer at `version` (its oldest token counts).
pub fn staleness(g: &ScoredGroup, version: u64) -> u64 {
    g.rollout
        .oldest_version()
        .map_or(0, |v| version.saturating_sub(v))
}

/// Dynamic sampling: which groups teach nothing and stay out of the optimizer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Filter {
    /// Groups whose rewards are all equal (and whose token rewards, if any, all 0).
    pub zero_variance: bool,
    /// Groups whose every |advantage| is below this (0: none), token rewards all 0.
    pub min_abs_advantage: f32,
    /// Completions cut at `max_new_tokens` are removed from their group (`mask_truncated`).
    pub mask_truncated: bool,
}

impl Filter {
    /// `train.filter_groups` and `train.filter_min_abs_advantage`.
    pub fn of(cfg: &TrainConfig) -> Self {
        Filter {
            zero_variance: cfg.filter_groups,
            min_abs_advantage: if cfg.filter_groups {
                cfg.filter_min_abs_advantage
            } else {
                0.0
            },
            mask_truncated: cfg.mask_truncated,
        }
    }

    /// Why `g` teaches nothing, if it does not. Token rewards place advantages on tokens
    /// whatever the outcome rewards are, so a group with a nonzero one is kept.
    pub fn reason(&self, g: &ScoredGroup) -> Option<DropReason> {
        let tokens = g
            .token_rewards
            .as_ref()
            .is_some_and(|t| t.iter().any(|r| r.iter().any(|&x| x != 0.0)));
        if tokens {
            return None;
        }
        if self.zero_variance && g.rewards.windows(2).all(|w| w[0] == w[1]) {
            return Some(DropReason::ZeroVariance);
        }
        let low = |a: &f32| a.abs() < self.min_abs_advantage;
        if self.min_abs_advantage > 0.0 && g.advantages.iter().all(low) {
            return Some(DropReason::LowAdvantage);
        }
        None
    }
}

/// Completions cut at `max_new_tokens` in the groups the intake took in, and those of them
/// `mask_truncated` kept out of the loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Truncation {
    pub truncated: u64,
    pub masked: u64,
}

/// Groups waiting for a step.
pub struct Intake {
    max_lag: u64,
    per_step: usize,
    filter: Filter,
    buffer: Vec<Delivery<ScoredGroup>>,
    /// Since [`Intake::take_truncation`] last read it.
    truncation: Truncation,
}

impl Intake {
    pub fn new(max_lag: u64, per_step: usize, filter: Filter) -> Self {
        Intake {
            max_lag,
            per_step: per_step.max(1),
            filter,
            buffer: Vec::new(),
            truncation: Truncation::default(),
        }
    }

    /// The completions cut at the length limit since the last call.
    pub fn take_truncation(&mut self) -> Truncation {
        std::mem::take(&mut self.truncation)
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
        } else if let Some(reason) = self.filter.reason(&d.message) {
            Some((d, reason))
        } else {
            self.admit(d)
        }
    }

    /// Counts `d`'s truncated completions, masks them when `mask_truncated` says so, and
    /// keeps what is left for a step.
    fn admit(
        &mut self,
        mut d: Delivery<ScoredGroup>,
    ) -> Option<(Delivery<ScoredGroup>, DropReason)> {
        let cut = |s: &crate::schema::Sample| s.finish == FinishReason::Length;
        let truncated = d.message.rollout.samples.iter().filter(|s| cut(s)).count() as u64;
        self.truncation.truncated += truncated;
        if self.filter.mask_truncated && truncated > 0 {
            self.truncation.masked += truncated;
            if d.message.rollout.samples.iter().all(cut) {
                return Some((d, DropReason::Truncated));
            }
            d.message.retain_samples(|s| !cut(s));
        }
        self.buffer.push(d);
        None
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
        self.drain(self.per_step)
    }

    /// Every group waiting, as a short step (in [`Intake::take`]'s order); `None` when
    /// none is.
    pub fn take_all(&mut self) -> Option<Vec<Delivery<ScoredGroup>>> {
        self.drain(self.buffer.len().min(self.per_step))
    }

    fn drain(&mut self, n: usize) -> Option<Vec<Delivery<ScoredGroup>>> {
        if n == 0 {
            return None;
        }
        let mut taken: Vec<_> = self.buffer.drain(..n).collect();
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
        let mut intake = Intake::new(2, 3, Filter::default());
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
        let mut intake = Intake::new(1, 2, Filter::default());
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
        let mut short = Intake::new(1, 2, Filter::default());
        assert!(short.take_all().is_none());
        assert!(short.offer(delivery("d", 6), 6, never).is_none());
        assert_eq!(short.take_all().map(|s| s.len()), Some(1), "a short step");
        assert!(short.is_empty());
        assert!(intake.expire(7).is_empty(), "c is 1 behind at 7");
        let aged = intake.expire(8);
        assert_eq!(aged.len(), 1, "c is 2 behind at 8");
        assert!(intake.is_empty());
    }

    #[test]
    fn reasons_have_their_wire_names() {
        let names: Vec<&str> = DropReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            names,
            [
                "stale",
                "duplicate",
                "nonfinite",
                "zero_variance",
                "low_advantage",
                "truncated"
            ]
        );
    }

    /// Dynamic sampling: a group whose rewards are all equal is handed back (a group that
    /// differs is kept, and with the filter off every group is); one whose advantages are
    /// all small is handed back under a threshold; a nonzero token reward keeps either.
    #[test]
    fn groups_that_teach_nothing_are_handed_back() {
        let group = |id: &str, rewards: &[f32], advantages: &[f32]| {
            let mut d = delivery(id, 5);
            d.message.rewards = rewards.to_vec();
            d.message.advantages = advantages.to_vec();
            d.message.token_rewards = None;
            d
        };
        let on = Filter {
            zero_variance: true,
            ..Filter::default()
        };
        let mut intake = Intake::new(4, 8, on);
        let (_, why) = intake
            .offer(group("same", &[1.0, 1.0], &[0.0, 0.0]), 5, never)
            .unwrap();
        assert_eq!(why, DropReason::ZeroVariance);
        assert!(
            intake
                .offer(group("differ", &[1.0, 0.0], &[1.0, -1.0]), 5, never)
                .is_none()
        );
        let mut off = Intake::new(4, 8, Filter::default());
        assert!(
            off.offer(group("same", &[1.0, 1.0], &[0.0, 0.0]), 5, never)
                .is_none()
        );
        let low = Filter {
            min_abs_advantage: 0.1,
            ..on
        };
        let mut intake = Intake::new(4, 8, low);
        let small = group("small", &[0.5, 0.52], &[0.05, -0.05]);
        let (_, why) = intake.offer(small.clone(), 5, never).unwrap();
        assert_eq!(why, DropReason::LowAdvantage);
        let mut tokens = small;
        tokens.message.token_rewards = Some(vec![vec![0.0, 1.0].into(), vec![0.0; 2].into()]);
        assert!(
            intake.offer(tokens, 5, never).is_none(),
            "a token reward teaches"
        );
        let cfg = TrainConfig {
            filter_min_abs_advantage: 0.1,
            ..TrainConfig::default()
        };
        assert_eq!(
            Filter::of(&cfg),
            Filter::default(),
            "off unless filter_groups"
        );
    }

    /// Overlong masking: a completion cut at the limit leaves its group (with its reward,
    /// advantage and per-token arrays) before the step, counted; a group cut whole is
    /// handed back; with the setting off both are only counted.
    #[test]
    fn truncated_completions_are_masked_and_counted() {
        let cut = |id: &str, which: &[bool]| {
            let mut d = delivery(id, 5);
            for (s, &c) in d.message.rollout.samples.iter_mut().zip(which) {
                s.finish = if c {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
            }
            d
        };
        let mask = Filter {
            mask_truncated: true,
            ..Filter::default()
        };
        let mut intake = Intake::new(4, 1, mask);
        assert!(intake.offer(cut("one", &[true, false]), 5, never).is_none());
        let (_, why) = intake.offer(cut("all", &[true, true]), 5, never).unwrap();
        assert_eq!(why, DropReason::Truncated);
        assert!(why.filtered(), "the stream replaces it");
        assert_eq!(
            intake.take_truncation(),
            Truncation {
                truncated: 3,
                masked: 3
            }
        );
        assert_eq!(intake.take_truncation(), Truncation::default(), "taken");
        let step = intake.take().unwrap();
        let g = &step[0].message;
        let whole = examples::scored_group();
        assert_eq!(g.rollout.samples.len(), 1);
        assert_eq!(g.rollout.samples[0].tokens, whole.rollout.samples[1].tokens);
        assert_eq!(
            (g.rewards.clone(), g.advantages.clone()),
            (vec![0.0], vec![-0.70710677])
        );
        let second =
            |a: &Option<Vec<crate::schema::Floats>>| a.as_ref().map(|a| vec![a[1].clone()]);
        assert_eq!(g.token_rewards, second(&whole.token_rewards));
        assert_eq!(g.ref_logprobs, second(&whole.ref_logprobs));
        crate::schema::Message::validate(g).unwrap();

        let mut off = Intake::new(4, 1, Filter::default());
        assert!(off.offer(cut("all", &[true, true]), 5, never).is_none());
        assert_eq!(off.take_truncation().masked, 0);
        assert_eq!(off.take().unwrap()[0].message.rollout.samples.len(), 2);
    }
}

//! A difficulty-aware feed (`[difficulty]`): prompts fed before come back with a
//! probability that favours those the policy neither always nor never solves.
//!
//! The scorers publish, per scored batch, an `outcomes` event (schema 1.1) with each
//! group's prompt id and how many of its completions passed. A [`DifficultyPool`] remembers the
//! prompts it fed (up to `reoffer_pool`, the most recently fed kept), reads those events
//! after the last one it read, and keeps each prompt's latest pass rate p. Each prompt it
//! then feeds is, with probability `reoffer` (once some prompt has a pass rate), one of the
//! scored prompts drawn with weight max(`reoffer_floor`, 4·p·(1−p)), and otherwise the next
//! new prompt. A prompt fed again is a new group (its group id carries the prompt's entry
//! id), so the trainer trains it again.
//!
//! The pool's whole state (remembered prompts, pass rates, draws taken, events read) is a
//! value ([`DifficultyPool::state`]): `rlstream feed` keeps it on the bus beside the streams, so a
//! restarted feed continues the same schedule. Draws come from a counter hashed with the
//! seed, not from a stateful generator, so the state needs no generator's internals.

use super::DifficultyConfig;
use crate::bus::{Bus, EntryId, Topology};
use crate::roles::Stream;
use crate::schema::{self, Event, PromptOutcome};
use crate::tasks::TaskItem;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Events read per bus call.
const EVENTS_PER_READ: usize = 1000;

/// One remembered prompt: what to feed again, and its latest pass rate once scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Known {
    item: TaskItem,
    rate: Option<f64>,
}

/// What a [`DifficultyPool`] is, as kept between runs of a feed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DifficultyState {
    known: BTreeMap<String, Known>,
    /// Ids in the order they were first fed, oldest first: who is forgotten first.
    order: VecDeque<String>,
    /// Random numbers drawn so far.
    draws: u64,
    /// The last events entry read.
    events_after: EntryId,
    /// New prompts fed so far (a resumed feed starts after them), prompts fed again, and
    /// outcomes taken in.
    pub fresh: u64,
    pub reoffered: u64,
    pub outcomes: u64,
}

/// The prompts fed, their pass rates, and the draws that pick what to feed next.
pub struct DifficultyPool {
    cfg: DifficultyConfig,
    seed: u64,
    state: DifficultyState,
}

/// The weight of a prompt with pass rate `p`: 1 at one half, `floor` at 0 and 1.
pub fn weight(p: f64, floor: f64) -> f64 {
    (4.0 * p * (1.0 - p)).max(floor)
}

impl DifficultyPool {
    pub fn new(cfg: &DifficultyConfig, seed: u64) -> Self {
        DifficultyPool::resume(cfg, seed, DifficultyState::default())
    }

    /// A pool continuing from `state`.
    pub fn resume(cfg: &DifficultyConfig, seed: u64, state: DifficultyState) -> Self {
        DifficultyPool {
            cfg: cfg.clone(),
            seed: crate::seed::mix(seed ^ 0xd1ff_1c01),
            state,
        }
    }

    /// Whether prompts are ever fed again.
    pub fn on(&self) -> bool {
        self.cfg.reoffer > 0.0
    }

    pub fn state(&self) -> &DifficultyState {
        &self.state
    }

    /// The next uniform number in [0, 1).
    fn unit(&mut self) -> f64 {
        self.state.draws += 1;
        // SplitMix64's n-th output: a state stepped by the golden gamma, then mixed.
        let state = self
            .seed
            .wrapping_add(self.state.draws.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        (crate::seed::mix(state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Takes in one group's outcome: the prompt's pass rate, if the pool remembers it.
    pub fn record(&mut self, o: &PromptOutcome) {
        if let Some(k) = self.state.known.get_mut(&o.prompt_id) {
            k.rate = Some(o.pass_rate());
            self.state.outcomes += 1;
        }
    }

    /// Reads the outcomes events published since the last read.
    pub async fn read_outcomes(
        &mut self,
        bus: &dyn Bus,
        topo: &Topology,
    ) -> Result<(), crate::bus::BusError> {
        let key = topo.key(Stream::Events);
        loop {
            let entries = bus
                .read_after(&key, self.state.events_after, EVENTS_PER_READ, None)
                .await?;
            for e in &entries {
                self.state.events_after = e.id;
                // Events are for reading along; one that does not decode is someone
                // else's and is skipped.
                let Ok(event) = schema::decode::<Event>(&e.payload) else {
                    continue;
                };
                if event.kind == Event::OUTCOMES {
                    event.outcomes.iter().for_each(|o| self.record(o));
                }
            }
            if entries.len() < EVENTS_PER_READ {
                return Ok(());
            }
        }
    }

    /// A scored prompt drawn by weight, if any prompt has a pass rate.
    fn draw_scored(&mut self) -> Option<(String, TaskItem)> {
        let floor = self.cfg.reoffer_floor;
        let total: f64 = self
            .state
            .known
            .values()
            .filter_map(|k| k.rate)
            .map(|p| weight(p, floor))
            .sum();
        if total <= 0.0 {
            return None;
        }
        let mut at = self.unit() * total;
        let mut last = None;
        for (id, k) in &self.state.known {
            let Some(p) = k.rate else { continue };
            last = Some((id, k));
            at -= weight(p, floor);
            if at < 0.0 {
                break;
            }
        }
        last.map(|(id, k)| (id.clone(), k.item.clone()))
    }

    /// Remembers a new prompt, forgetting the oldest past `reoffer_pool`.
    fn remember(&mut self, id: &str, item: &TaskItem) {
        if !self.on() || self.state.known.contains_key(id) {
            return;
        }
        let known = Known {
            item: item.clone(),
            rate: None,
        };
        self.state.known.insert(id.to_string(), known);
        self.state.order.push_back(id.to_string());
        while self.state.order.len() > self.cfg.reoffer_pool {
            if let Some(old) = self.state.order.pop_front() {
                self.state.known.remove(&old);
            }
        }
    }

    /// The next prompt to feed: a scored one again with probability `reoffer`, otherwise
    /// `fresh()`'s (remembered); `None` when `fresh` has none left and none is re-offered.
    pub fn next(
        &mut self,
        fresh: &mut impl FnMut() -> Option<(String, TaskItem)>,
    ) -> Option<(String, TaskItem)> {
        if self.on()
            && self.unit() < self.cfg.reoffer
            && let Some(again) = self.draw_scored()
        {
            self.state.reoffered += 1;
            return Some(again);
        }
        let (id, item) = fresh()?;
        self.state.fresh += 1;
        self.remember(&id, &item);
        Some((id, item))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(i: u64) -> (String, TaskItem) {
        let item = TaskItem {
            prompt: format!("q{i}"),
            answer: i.to_string(),
            meta: Default::default(),
        };
        (format!("p{i}"), item)
    }

    fn counter() -> impl FnMut() -> Option<(String, TaskItem)> {
        let mut i = 0;
        move || {
            i += 1;
            Some(item(i))
        }
    }

    fn outcome(id: &str, passed: u32) -> PromptOutcome {
        PromptOutcome {
            prompt_id: id.into(),
            passed,
            samples: 8,
        }
    }

    #[test]
    fn weights_favour_the_middle() {
        assert_eq!(weight(0.5, 0.05), 1.0);
        assert_eq!(weight(0.0, 0.05), 0.05);
        assert_eq!(weight(1.0, 0.05), 0.05);
        assert!((weight(0.25, 0.05) - 0.75).abs() < 1e-12);
    }

    /// Off, every prompt is new and nothing is remembered.
    #[test]
    fn off_feeds_every_prompt_once() {
        let mut pool = DifficultyPool::new(&DifficultyConfig::default(), 0);
        let mut fresh = counter();
        let ids: Vec<String> = (0..5).map(|_| pool.next(&mut fresh).unwrap().0).collect();
        assert_eq!(ids, ["p1", "p2", "p3", "p4", "p5"]);
        pool.record(&outcome("p1", 4));
        assert_eq!(pool.state().fresh, 5);
        assert_eq!(
            pool.state(),
            &DifficultyState {
                fresh: 5,
                ..DifficultyState::default()
            }
        );
    }

    /// With pass rates 0, 1/2 and 1, the half-solved prompt comes back most, in the share
    /// the weights give (1 against 0.05 + 0.05), and about `reoffer` of what is fed is
    /// fed again.
    #[test]
    fn reoffers_the_half_solved_most() {
        // A pool that remembers every prompt fed here, so the three scored stay in it.
        let cfg = DifficultyConfig {
            reoffer: 0.5,
            reoffer_pool: 1 << 20,
            ..DifficultyConfig::default()
        };
        let mut pool = DifficultyPool::new(&cfg, 7);
        let mut fresh = counter();
        assert!(pool.next(&mut fresh).is_some_and(|(id, _)| id == "p1"));
        for (id, passed) in [("p1", 0), ("p2", 4), ("p3", 8)] {
            pool.record(&outcome(id, passed));
        }
        assert_eq!(pool.state().outcomes, 1, "only fed prompts are kept");
        while pool.state().fresh < 3 {
            pool.next(&mut fresh);
        }
        for (id, passed) in [("p2", 4), ("p3", 8)] {
            pool.record(&outcome(id, passed));
        }
        let mut again = BTreeMap::<String, u32>::new();
        let before = pool.state().reoffered;
        let n = 10_000;
        for _ in 0..n {
            let (id, _) = pool.next(&mut fresh).unwrap();
            if ["p1", "p2", "p3"].contains(&id.as_str()) {
                *again.entry(id).or_default() += 1;
            }
        }
        let total: u32 = again.values().sum();
        assert_eq!(u64::from(total), pool.state().reoffered - before);
        let share = f64::from(total) / f64::from(n);
        assert!((share - 0.5).abs() < 0.02, "{share}");
        let half = f64::from(again["p2"]) / f64::from(total);
        assert!((half - 1.0 / 1.1).abs() < 0.02, "{again:?}");
    }

    /// The pool keeps the most recently fed prompts, and a pool resumed from a state
    /// continues the same schedule as one never stopped.
    #[test]
    fn forgets_the_oldest_and_resumes_the_same_schedule() {
        let cfg = DifficultyConfig {
            reoffer: 0.9,
            reoffer_pool: 4,
            ..DifficultyConfig::default()
        };
        let mut pool = DifficultyPool::new(&cfg, 1);
        let mut fresh = counter();
        for _ in 0..6 {
            pool.next(&mut fresh);
        }
        let kept: Vec<&String> = pool.state().known.keys().collect();
        assert_eq!(kept, ["p3", "p4", "p5", "p6"]);
        (3..=6).for_each(|i| pool.record(&outcome(&format!("p{i}"), i as u32)));
        let bytes = rmp_serde::to_vec(pool.state()).unwrap();
        let state: DifficultyState = rmp_serde::from_slice(&bytes).unwrap();
        let mut resumed = DifficultyPool::resume(&cfg, 1, state);
        let mut fresh_resumed = counter();
        // The resumed feed's new prompts continue where the first's stopped.
        for _ in 0..resumed.state().fresh {
            fresh_resumed();
        }
        let a: Vec<String> = (0..50).map(|_| pool.next(&mut fresh).unwrap().0).collect();
        let b: Vec<String> = (0..50)
            .map(|_| resumed.next(&mut fresh_resumed).unwrap().0)
            .collect();
        assert_eq!(a, b);
        assert!(pool.state().reoffered > 0);
    }
}

//! What a scorer says about a group.

use crate::schema::{Floats, RolloutGroup};

/// What a scorer says about a group: one outcome reward per completion, and rewards placed
/// on tokens when it gave any.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    pub rewards: Vec<f32>,
    pub token_rewards: Option<Vec<Floats>>,
    /// The teacher's log-prob of each token (`score --teacher`).
    pub teacher: Option<Vec<Floats>>,
    /// The rewards are an environment's episode returns, already placed on tokens as turn
    /// rewards: no outcome advantage on top (it would count them twice).
    pub from_env: bool,
}

/// The scores of a group of episodes (its prompt names an environment): each episode's
/// return (the sum of its turn rewards) as its reward, the turn rewards as token rewards.
pub fn episode_scores(g: &RolloutGroup) -> Scores {
    let rewards = g
        .samples
        .iter()
        .map(|s| s.turn_rewards.iter().map(|r| r.reward).sum())
        .collect();
    let token_rewards = g
        .samples
        .iter()
        .map(|s| {
            let mut r = vec![0f32; s.tokens.len()];
            for t in &s.turn_rewards {
                if let Some(x) = r.get_mut(t.index as usize) {
                    *x += t.reward;
                }
            }
            r.into()
        })
        .collect();
    Scores {
        rewards,
        token_rewards: Some(token_rewards),
        teacher: None,
        from_env: true,
    }
}

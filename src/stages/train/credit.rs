//! Credit assignment: rewards placed on tokens become per-token advantages.
//!
//! A scored group carries one outcome advantage per sample (`advantages`, normalised in the
//! group by the scorer) and, optionally, rewards placed on tokens (`token_rewards`): a reward
//! sits on the token that earns it, such as the last token of a reasoning step or of a
//! turn, or on every token (a teacher's per-token signal). This is the one place where the
//! second become advantages:
//!
//! ```text
//! G[i][t] = Σ_{u ≥ t} γ^(u−t) · r[i][u]       return-to-go of sample i from token t
//! b       = mean of G[j][u] over every token u of every sample j of the group
//! A[i][t] = advantages[i] + G[i][t] − b
//! ```
//!
//! - With γ = 1 (the default, `train.token_discount`), a token is credited with every
//!   reward placed at or after it: a step's reward reaches every token of that step and of
//!   the steps before it, as in DeepSeekMath's process supervision. For a teacher's
//!   per-token signal (teacher − student log-prob) the return-to-go is the score-function
//!   gradient of the whole completion's reverse KL.
//! - With γ = 0 each token keeps only its own reward: the per-token form of on-policy
//!   distillation, and no reward reaches tokens before the one it sits on.
//! - The group baseline `b` is one number per group, the mean return over its tokens: it
//!   does not depend on any token's action, so it centres the advantages without biasing
//!   the gradient. With γ > 0 the return still varies with position (earlier tokens have
//!   more rewards ahead of them); that spread is what the placed rewards say.
//! - A zero is a reward of zero: no reward placed and a reward of 0 are the same thing.
//! - In an episode, the environment's tokens are context: a reward placed on one is
//!   ignored, and they do not count in `b` (their advantages are never used). `u` runs
//!   over token positions, so γ discounts per token, environment tokens included.
//!
//! Without `token_rewards` a sample's outcome advantage is broadcast to its tokens.

/// The per-token advantages of one group's samples. `token_rewards[i]` has one entry per
/// completion token of sample `i` (the codec checks the lengths); `own[i][t]` says whether
/// token `t` is the model's (false: the environment's; empty: all the model's); `outcome[i]`
/// is its outcome advantage; `discount` is γ in [0, 1].
pub fn token_advantages(
    outcome: &[f32],
    token_rewards: &[&[f32]],
    own: &[Vec<bool>],
    discount: f32,
) -> Vec<Vec<f32>> {
    let gamma = f64::from(discount);
    let is_own = |i: usize, t: usize| own.get(i).and_then(|o| o.get(t)).copied().unwrap_or(true);
    let returns: Vec<Vec<f64>> = token_rewards
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut g = vec![0f64; r.len()];
            let mut acc = 0f64;
            for t in (0..r.len()).rev() {
                let reward = if is_own(i, t) { f64::from(r[t]) } else { 0.0 };
                acc = reward + gamma * acc;
                g[t] = acc;
            }
            g
        })
        .collect();
    let (mut sum, mut n) = (0f64, 0usize);
    for (i, g) in returns.iter().enumerate() {
        for (t, &x) in g.iter().enumerate() {
            if is_own(i, t) {
                sum += x;
                n += 1;
            }
        }
    }
    let baseline = if n == 0 { 0.0 } else { sum / n as f64 };
    returns
        .iter()
        .zip(outcome)
        .map(|(g, &a)| {
            g.iter()
                .map(|&x| (f64::from(a) + x - baseline) as f32)
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: &[Vec<f32>], want: &[&[f32]]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.len(), w.len(), "{got:?}");
            for (a, b) in g.iter().zip(w.iter()) {
                assert!((a - b).abs() < 1e-6, "{got:?} vs {want:?}");
            }
        }
    }

    /// Two samples of a group, worked by hand. Sample 0: three tokens, a step reward 1 on
    /// token 1 and 0.5 on token 2 (the last step's last token). Sample 1: two tokens, a
    /// reward −1 on its last token.
    ///
    /// γ = 1: returns G0 = [1.5, 1.5, 0.5], G1 = [−1, −1]; b = (1.5 + 1.5 + 0.5 − 1 − 1) / 5
    /// = 0.3; with outcome advantages [0.2, −0.2]: A0 = [1.4, 1.4, 0.4], A1 = [−1.5, −1.5].
    ///
    /// γ = 0.5: G0 = [0.5·1 + 0.25·0.5, 1 + 0.5·0.5, 0.5] = [0.625, 1.25, 0.5],
    /// G1 = [−0.5, −1]; b = (0.625 + 1.25 + 0.5 − 0.5 − 1) / 5 = 0.175.
    ///
    /// γ = 0: G = r; b = (0 + 1 + 0.5 + 0 − 1) / 5 = 0.1.
    #[test]
    fn hand_computed_group() {
        let r0: &[f32] = &[0.0, 1.0, 0.5];
        let r1: &[f32] = &[0.0, -1.0];
        let outcome = [0.2, -0.2];
        close(
            &token_advantages(&outcome, &[r0, r1], &[], 1.0),
            &[&[1.4, 1.4, 0.4], &[-1.5, -1.5]],
        );
        close(
            &token_advantages(&outcome, &[r0, r1], &[], 0.5),
            &[&[0.65, 1.275, 0.525], &[-0.875, -1.375]],
        );
        close(
            &token_advantages(&outcome, &[r0, r1], &[], 0.0),
            &[&[0.1, 1.1, 0.6], &[-0.3, -1.3]],
        );
    }

    /// An episode: sample 0's tokens 1 and 2 are the environment's. The reward placed on
    /// token 2 (garbage) is ignored, and the baseline counts the model's tokens only.
    /// γ = 1: G0 = [1, 1, 1, 1] (the reward on token 3 flows back through the environment's
    /// tokens), G1 = [−1, −1]; over the 4 model tokens b = (1 + 1 − 1 − 1) / 4 = 0; with
    /// outcome 0: A0 = [1, 1, 1, 1] (tokens 1, 2 unused), A1 = [−1, −1].
    #[test]
    fn environment_tokens_carry_no_reward_and_no_weight_in_the_baseline() {
        let r0: &[f32] = &[0.0, 0.0, 9.0, 1.0];
        let r1: &[f32] = &[0.0, -1.0];
        let own = [vec![true, false, false, true], vec![]];
        close(
            &token_advantages(&[0.0, 0.0], &[r0, r1], &own, 1.0),
            &[&[1.0, 1.0, 1.0, 1.0], &[-1.0, -1.0]],
        );
    }

    #[test]
    fn zero_token_rewards_broadcast_the_outcome() {
        let z: &[f32] = &[0.0; 4];
        close(
            &token_advantages(&[0.7, -0.7], &[z, &z[..2]], &[], 1.0),
            &[&[0.7; 4], &[-0.7; 2]],
        );
        assert!(token_advantages(&[], &[], &[], 1.0).is_empty());
        close(&token_advantages(&[0.5], &[&[]], &[], 1.0), &[&[]]);
    }
}

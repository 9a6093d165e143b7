//! Reward shaping by length, before advantages: DAPO's soft overlong penalty
//! (`score.overlong_buffer`, `score.overlong_penalty`) and a linear length penalty
//! (`score.length_penalty`). A completion's length is its tokens, a final stop token
//! included; the limit is its group's `max_new_tokens`.

use super::ScoreConfig;
use crate::schema::RolloutGroup;

/// What the shaping of one group did: the completions each penalty lowered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shaped {
    pub overlong: u64,
    pub length: u64,
}

/// DAPO's soft overlong penalty of a completion of `len` tokens under a limit of `max`
/// tokens: 0 up to `max − buffer`, then falling linearly to `−penalty` at `max`.
pub fn overlong_penalty(len: usize, max: usize, buffer: usize, penalty: f32) -> f32 {
    let buffer = buffer.min(max);
    let free = max - buffer;
    if buffer == 0 || len <= free {
        return 0.0;
    }
    -penalty * (len.min(max) - free) as f32 / buffer as f32
}

/// Lowers the rewards of `g`'s completions as the settings say; an episode's rewards are
/// its environment's and are left alone.
pub fn shape(cfg: &ScoreConfig, g: &RolloutGroup, rewards: &mut [f32]) -> Shaped {
    let mut out = Shaped::default();
    let max = g.sampling.max_new_tokens as usize;
    if crate::env::is_episode(&g.meta) || max == 0 {
        return out;
    }
    for (r, s) in rewards.iter_mut().zip(&g.samples) {
        let len = s.tokens.len();
        let over = overlong_penalty(len, max, cfg.overlong_buffer as usize, cfg.overlong_penalty);
        if over < 0.0 {
            *r += over;
            out.overlong += 1;
        }
        if cfg.length_penalty > 0.0 && len > 0 {
            *r -= cfg.length_penalty * len as f32 / max as f32;
            out.length += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::examples;

    #[test]
    fn dapo_overlong_penalty_is_linear_over_the_buffer() {
        // DAPO: L_max = 20, L_cache = 4: free up to 16, −1 at 20, linear between.
        let p = |len| overlong_penalty(len, 20, 4, 1.0);
        assert_eq!(p(3), 0.0);
        assert_eq!(p(16), 0.0);
        assert_eq!(p(17), -0.25);
        assert_eq!(p(18), -0.5);
        assert_eq!(p(20), -1.0);
        assert_eq!(overlong_penalty(20, 20, 4, 0.5), -0.5);
        assert_eq!(overlong_penalty(20, 20, 0, 1.0), 0.0, "off");
        assert_eq!(
            overlong_penalty(3, 4, 10, 1.0),
            -0.75,
            "a buffer past the limit"
        );
    }

    #[test]
    fn shaping_lowers_long_completions_and_leaves_episodes_alone() {
        let mut g = examples::rollout_group(2, 4, 16, 0);
        g.sampling.max_new_tokens = 8;
        g.samples[0].tokens = vec![1u32; 8].into();
        g.samples[1].tokens = vec![1u32; 2].into();
        let cfg = ScoreConfig {
            overlong_buffer: 4,
            length_penalty: 0.5,
            ..ScoreConfig::default()
        };
        let mut r = vec![1.0, 1.0];
        let shaped = shape(&cfg, &g, &mut r);
        assert_eq!(r, vec![1.0 - 1.0 - 0.5, 1.0 - 0.125]);
        assert_eq!(
            shaped,
            Shaped {
                overlong: 1,
                length: 2
            }
        );
        let mut r = vec![1.0, 1.0];
        assert_eq!(
            shape(&ScoreConfig::default(), &g, &mut r),
            Shaped::default()
        );
        assert_eq!(r, vec![1.0, 1.0], "off by default");
        g.meta.insert(crate::env::ENV.into(), "x".into());
        let mut r = vec![1.0, 1.0];
        assert_eq!(shape(&cfg, &g, &mut r), Shaped::default());
    }
}

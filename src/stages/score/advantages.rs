//! How rewards become advantages within a group (`--advantage`).

use super::AdvantageKind;

/// Added to the standard deviation so uniform groups get zero advantage, not NaN.
const STD_EPS: f32 = 1e-6;

pub fn advantages(rewards: &[f32], kind: AdvantageKind) -> Vec<f32> {
    let n = rewards.len() as f32;
    if rewards.is_empty() {
        return Vec::new();
    }
    let mean = rewards.iter().sum::<f32>() / n;
    match kind {
        AdvantageKind::Grpo => {
            let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / n;
            rewards
                .iter()
                .map(|r| (r - mean) / (var.sqrt() + STD_EPS))
                .collect()
        }
        AdvantageKind::Loo => {
            if rewards.len() == 1 {
                return vec![0.0];
            }
            let sum: f32 = rewards.iter().sum();
            rewards.iter().map(|r| r - (sum - r) / (n - 1.0)).collect()
        }
        AdvantageKind::Nostd => rewards.iter().map(|r| r - mean).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantage_variants() {
        let r = [1.0, 0.0, 0.0, 1.0];
        let g = advantages(&r, AdvantageKind::Grpo);
        assert!(
            (g[0] - 1.0).abs() < 1e-4 && (g[1] + 1.0).abs() < 1e-4,
            "{g:?}"
        );
        assert_eq!(
            advantages(&r, AdvantageKind::Nostd),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        let l = advantages(&r, AdvantageKind::Loo);
        assert!((l[0] - (1.0 - 1.0 / 3.0)).abs() < 1e-6, "{l:?}");
        assert_eq!(advantages(&[0.3, 0.3], AdvantageKind::Grpo), vec![0.0, 0.0]);
    }
}

//! Checks of message validation on the example messages: here rather than beside each
//! message type, because the examples are built from those types.

use super::*;

/// Environment spans must be non-empty, in order, not overlapping and within the
/// tokens; an environment token needs no place in the kept set of a sampling mask.
#[test]
fn environment_spans_are_checked() {
    let g = examples::episode_group();
    assert!(g.validate_as("RolloutGroup").is_ok());
    assert_eq!(
        g.samples[0].model_tokens(),
        vec![true, true, false, false, false, true, true, true]
    );
    for (spans, want) in [
        (vec![(2, 0)], "samples[0].env[0]"),
        (vec![(2, 3), (4, 1)], "samples[0].env[1]"),
        (vec![(6, 3)], "within the 8 tokens"),
    ] {
        let mut bad = g.clone();
        bad.samples[0].env = spans.into_iter().map(Into::into).collect();
        let e = bad.validate_as("RolloutGroup").unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    let mut masked = g.clone();
    let s = &mut masked.samples[0];
    let offsets: Vec<u32> = (0..=s.tokens.len() as u32).collect();
    // Each model token's kept set is itself; the environment's hold another id.
    let ids: Vec<u32> = s
        .tokens
        .iter()
        .zip(s.model_tokens())
        .map(|(&t, own)| if own { t } else { 15 })
        .collect();
    s.mask = Some(SamplingMask {
        offsets: offsets.into(),
        ids: ids.into(),
    });
    assert!(masked.validate_as("RolloutGroup").is_ok());
    // Packed kept sets: 3.0, whatever else the group holds.
    let packed = SchemaVersion { major: 3, minor: 0 };
    assert_eq!(RolloutGroup::version_for(&masked.samples), packed);
    masked.samples.iter_mut().for_each(|s| s.env.clear());
    assert!(
        masked.validate_as("RolloutGroup").is_err(),
        "now token 2 is the model's"
    );
    // Without masks, turn rewards alone still make an episode (one solved in a single
    // turn).
    masked.samples.iter_mut().for_each(|s| s.mask = None);
    let episode = SchemaVersion { major: 2, minor: 1 };
    assert_eq!(RolloutGroup::version_for(&masked.samples), episode);
    masked
        .samples
        .iter_mut()
        .for_each(|s| s.turn_rewards.clear());
    assert_eq!(
        RolloutGroup::version_for(&masked.samples),
        SchemaVersion::CURRENT
    );
}
#[test]
fn turn_rewards_are_checked() {
    let g = examples::episode_group();
    for (rewards, want) in [
        (vec![(3, 1.0)], "not one of the 8 tokens' model tokens"),
        (vec![(8, 1.0)], "not one of the 8 tokens' model tokens"),
        (vec![(5, 1.0), (1, 1.0)], "indices must increase"),
        (vec![(1, f32::NAN)], "not finite"),
    ] {
        let mut bad = g.clone();
        bad.samples[0].turn_rewards = rewards.into_iter().map(Into::into).collect();
        let e = bad.validate_as("RolloutGroup").unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("turn_rewards"), "{e}");
    }
}

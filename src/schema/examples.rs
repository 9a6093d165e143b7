//! Deterministic example messages: the golden fixtures in `schemas/fixtures/`, the codec
//! benchmarks and tests all build from here, so they agree on what a message looks like.

use super::{
    DeadLetter, Event, FinishReason, Floats, Prompt, RolloutGroup, Routing, RoutingShape, Sample,
    SamplingMask, SamplingParams, SchemaVersion, ScoredGroup, WeightsAnnounce, WeightsKind,
};
use std::collections::BTreeMap;

/// A fixed timestamp (2026-01-01T00:00:00Z) so fixtures are byte-stable.
pub const EXAMPLE_TIME_US: u64 = 1_767_225_600_000_000;

/// Tiny deterministic generator (xorshift64*), so examples need no RNG dependency.
struct Xs(u64);
impl Xs {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
}

pub fn prompt() -> Prompt {
    Prompt {
        schema: SchemaVersion::CURRENT,
        prompt_id: "add-000042".into(),
        task: "add".into(),
        text: "12+30=".into(),
        prompt_tokens: Some(vec![2, 3, 11, 4, 1, 12].into()),
        meta: BTreeMap::from([("answer".to_string(), "42".to_string())]),
        created_us: EXAMPLE_TIME_US,
    }
}

/// A RolloutGroup of `samples` completions of `tokens` tokens each over a `vocab`-sized
/// vocabulary; with `mask_k > 0`, top-k sampling kept up to `mask_k` ids per step (the
/// sampled one and `mask_k − 1` drawn at random, repeats dropped) and the mask is recorded. Sample `i` switches policy version halfway through when `i` is odd.
pub fn rollout_group(samples: usize, tokens: usize, vocab: u32, mask_k: u32) -> RolloutGroup {
    let mut rng = Xs(0x9e37_79b9_7f4a_7c15);
    let samples = (0..samples)
        .map(|i| {
            let mut ids = Vec::with_capacity(tokens);
            let mut logprobs = Vec::with_capacity(tokens);
            let mut offsets = vec![0u32];
            let mut kept = Vec::new();
            for _ in 0..tokens {
                let tok = rng.below(vocab);
                ids.push(tok);
                logprobs.push(-((rng.below(1000) + 1) as f32) / 250.0);
                if mask_k > 0 {
                    let start = kept.len();
                    kept.push(tok);
                    for _ in 1..mask_k {
                        kept.push(rng.below(vocab));
                    }
                    // A kept set is a set: ascending, each id once (as the wire holds it).
                    let mut set = kept.split_off(start);
                    set.sort_unstable();
                    set.dedup();
                    kept.extend(set);
                    offsets.push(kept.len() as u32);
                }
            }
            let mut versions = vec![(0u32, 7u64).into()];
            if i % 2 == 1 && tokens > 1 {
                versions.push(((tokens / 2) as u32, 8u64).into());
            }
            Sample {
                tokens: ids.into(),
                logprobs: logprobs.into(),
                versions,
                finish: if i % 3 == 0 {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                },
                mask: (mask_k > 0).then(|| SamplingMask {
                    offsets: offsets.into(),
                    ids: kept.into(),
                }),
                env: Vec::new(),
                turn_rewards: Vec::new(),
                routing: None,
            }
        })
        .collect::<Vec<_>>();
    RolloutGroup {
        schema: RolloutGroup::version_for(&samples),
        group_id: "gen-0-000017".into(),
        prompt_id: "add-000042".into(),
        task: "add".into(),
        prompt_tokens: vec![2, 3, 11, 4, 1, 12].into(),
        samples,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: mask_k,
            top_p: 1.0,
            max_new_tokens: tokens as u32,
            stop_tokens: vec![0],
            seed: 17,
        },
        gen_id: "gen-0".into(),
        started_us: EXAMPLE_TIME_US,
        finished_us: EXAMPLE_TIME_US + 250_000,
        meta: BTreeMap::from([("answer".to_string(), "42".to_string())]),
        prompt_routing: None,
    }
}

/// Routing of `tokens` tokens through `shape`: token `t`'s experts in layer `l` are
/// `(t + l + j · 3) mod experts` for slot `j` (distinct while `3k` ≤ `experts`).
pub fn routing(shape: RoutingShape, tokens: usize) -> Routing {
    let ids: Vec<u16> = (0..tokens)
        .flat_map(|t| {
            (0..shape.layers as usize).flat_map(move |l| {
                (0..shape.k as usize)
                    .map(move |j| ((t + l + 3 * j) % shape.experts as usize) as u16)
            })
        })
        .collect();
    Routing::pack(shape, &ids)
}

/// A mixture-of-experts policy's group (schema 2.2): [`rollout_group`]`(2, 4, 16, 2)` with
/// the experts of 2 MoE layers, top-2 of 8, for the prompt's 6 tokens and each sample's
/// first 3 (the last token is never read).
pub fn routed_group() -> RolloutGroup {
    let shape = RoutingShape {
        layers: 2,
        k: 2,
        experts: 8,
    };
    let mut g = rollout_group(2, 4, 16, 2);
    g.prompt_routing = Some(routing(shape, g.prompt_tokens.len()));
    for s in &mut g.samples {
        s.routing = Some(routing(shape, s.tokens.len() - 1));
    }
    g.schema = RolloutGroup::version_for(&g.samples);
    g
}

/// A group of two episodes (schema 2.1), a guessing game over a 16-id vocabulary. Episode
/// 0: a model turn (tokens 0–1), the environment's reply (2–4), a model turn (5–7) sampled
/// after a weight swap between the turns. Episode 1: a model turn (0), the reply (1–2), a
/// model turn (3–5) with a swap inside it. The environment's tokens carry log-prob 0. Turn
/// rewards: −0.1 for each wrong guess, 1 for the right one.
pub fn episode_group() -> RolloutGroup {
    let sample = |tokens: Vec<u32>,
                  logprobs: Vec<f32>,
                  versions: Vec<(u32, u64)>,
                  env,
                  rewards: Vec<(u32, f32)>| Sample {
        tokens: tokens.into(),
        logprobs: logprobs.into(),
        versions: versions.into_iter().map(Into::into).collect(),
        finish: FinishReason::Stop,
        mask: None,
        env,
        turn_rewards: rewards.into_iter().map(Into::into).collect(),
        routing: None,
    };
    let samples = vec![
        sample(
            vec![10, 11, 3, 4, 5, 12, 13, 0],
            vec![-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.125, -0.75],
            vec![(0, 7), (5, 8)],
            vec![(2, 3).into()],
            vec![(1, -0.1), (7, 1.0)],
        ),
        sample(
            vec![9, 3, 4, 10, 11, 0],
            vec![-2.0, 0.0, 0.0, -0.5, -1.5, -0.25],
            vec![(0, 7), (4, 8)],
            vec![(1, 2).into()],
            vec![(0, -0.1)],
        ),
    ];
    RolloutGroup {
        schema: RolloutGroup::version_for(&samples),
        group_id: "gen-0-000018".into(),
        task: "guess".into(),
        prompt_id: "guess-000007".into(),
        samples,
        ..rollout_group(2, 1, 16, 0)
    }
}

/// The scored twin of [`episode_group`] (schema 3.0): each turn's reward on the turn's last
/// model token.
pub fn scored_episode() -> ScoredGroup {
    let rollout = episode_group();
    let token_rewards = Some(vec![
        vec![0.0, -0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0].into(),
        vec![-0.1, 0.0, 0.0, 0.0, 0.0, 0.0].into(),
    ]);
    ScoredGroup {
        schema: ScoredGroup::version_for(&rollout, &token_rewards),
        token_rewards,
        ref_logprobs: None,
        rollout,
        rewards: vec![0.9, -0.1],
        advantages: vec![1.0, -1.0],
        scorer_id: "score-0".into(),
        scored_us: EXAMPLE_TIME_US + 300_000,
    }
}

/// The benchmark's realistic group: 8 samples × 256 tokens, top-k 8 masks, 32k vocabulary.
pub fn realistic_rollout_group() -> RolloutGroup {
    rollout_group(8, 256, 32_000, 8)
}

/// A group with rewards placed on tokens and a teacher's log-probs (schema 2.0).
pub fn scored_group() -> ScoredGroup {
    let rollout = rollout_group(2, 4, 16, 2);
    let per_token = |f: fn(usize, usize) -> f32| -> Vec<Floats> {
        rollout
            .samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (0..s.tokens.len())
                    .map(|t| f(i, t))
                    .collect::<Vec<f32>>()
                    .into()
            })
            .collect()
    };
    let token_rewards = Some(per_token(|i, t| if t == 3 { 1.0 - i as f32 } else { 0.0 }));
    let ref_logprobs = Some(per_token(|i, t| -0.25 * (i + t + 1) as f32));
    ScoredGroup {
        schema: ScoredGroup::version_for(&rollout, &token_rewards),
        token_rewards,
        ref_logprobs,
        rollout,
        rewards: vec![1.0, 0.0],
        advantages: vec![0.70710677, -0.70710677],
        scorer_id: "score-0".into(),
        scored_us: EXAMPLE_TIME_US + 300_000,
    }
}

/// A group as schema 1.0 wrote it: outcome rewards only (its `token_rewards`, all zero, were
/// never produced by a 1.0 scorer).
pub fn scored_group_v1() -> ScoredGroup {
    let rollout = rollout_group(2, 4, 16, 2);
    ScoredGroup {
        schema: SchemaVersion::CURRENT,
        token_rewards: Some(
            rollout
                .samples
                .iter()
                .map(|s| vec![0.0; s.tokens.len()].into())
                .collect(),
        ),
        rollout,
        rewards: vec![1.0, 0.0],
        advantages: vec![0.70710677, -0.70710677],
        ref_logprobs: None,
        scorer_id: "score-0".into(),
        scored_us: EXAMPLE_TIME_US + 300_000,
    }
}

/// A delta version in Redis chunks (schema 2.0): version 8 as the XOR against version 7,
/// in a chain that starts at the keyframe version 5.
pub fn weights_announce() -> WeightsAnnounce {
    WeightsAnnounce {
        schema: <WeightsAnnounce as super::Message>::SCHEMA,
        version: 8,
        step: 8,
        kind: WeightsKind::Full,
        format: super::DELTA_FORMAT.into(),
        dtype: "bf16".into(),
        bytes: 4_194_304,
        chunks: 1,
        checksum: "0123456789abcdef".into(),
        store: "redis".into(),
        base: Some(7),
        keyframe: Some(5),
        stored_bytes: Some(81_920),
        stored_checksum: Some("fedcba9876543210".into()),
        lora: None,
        started_us: EXAMPLE_TIME_US,
        published_us: EXAMPLE_TIME_US + 12_000,
    }
}

/// A full version as schema 1.0 wrote it: the fields of 2.0 take their defaults.
pub fn weights_announce_v1() -> WeightsAnnounce {
    WeightsAnnounce {
        schema: SchemaVersion { major: 1, minor: 0 },
        version: 8,
        step: 8,
        kind: WeightsKind::Full,
        format: "rlstream-params-v1".into(),
        dtype: "f32".into(),
        bytes: 4_194_304,
        chunks: 4,
        checksum: "0123456789abcdef".into(),
        store: "redis".into(),
        base: None,
        keyframe: None,
        stored_bytes: None,
        stored_checksum: None,
        lora: None,
        started_us: EXAMPLE_TIME_US,
        published_us: EXAMPLE_TIME_US + 12_000,
    }
}

/// A delta version as schema 2.0 wrote it (the fixture this build's 2.1 replaced).
pub fn weights_announce_v2_0() -> WeightsAnnounce {
    WeightsAnnounce {
        schema: SchemaVersion { major: 2, minor: 0 },
        ..weights_announce()
    }
}

/// An adapter version (schema 2.1): a rank-16 adapter on every linear module, bf16, in
/// Redis chunks, for the base whose checksum it names.
pub fn weights_announce_lora() -> WeightsAnnounce {
    WeightsAnnounce {
        schema: <WeightsAnnounce as super::Message>::SCHEMA,
        version: 12,
        step: 12,
        kind: WeightsKind::Lora,
        format: "lora-safetensors-bf16".into(),
        dtype: "bf16".into(),
        bytes: 17_596_416,
        chunks: 5,
        checksum: "00112233445566aa".into(),
        store: "redis".into(),
        base: None,
        keyframe: None,
        stored_bytes: None,
        stored_checksum: None,
        lora: Some(super::AdapterInfo {
            rank: 16,
            alpha: 32.0,
            targets: [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            .map(String::from)
            .to_vec(),
            base_checksum: "9f8e7d6c5b4a3210".into(),
        }),
        started_us: EXAMPLE_TIME_US,
        published_us: EXAMPLE_TIME_US + 9_000,
    }
}

pub fn dead_letter() -> DeadLetter {
    DeadLetter {
        schema: SchemaVersion::CURRENT,
        source_stream: "rl:rollouts".into(),
        source_id: "1767225600000-0".into(),
        group: "score".into(),
        consumer: "score-0".into(),
        reason: "truncated".into(),
        error: "RolloutGroup: bytes end before the message does (truncated after 3 bytes)".into(),
        deliveries: 1,
        payload: vec![0x8b, 0xa6, 0x73],
        dead_us: EXAMPLE_TIME_US,
    }
}

pub fn event() -> Event {
    Event {
        schema: SchemaVersion::CURRENT,
        kind: "step".into(),
        stage: "train".into(),
        source: "train-0".into(),
        version: 8,
        fields: BTreeMap::from([
            ("loss".to_string(), 0.125),
            ("reward_mean".to_string(), 0.5),
        ]),
        text: None,
        time_us: EXAMPLE_TIME_US,
        outcomes: Vec::new(),
    }
}

/// A scorer's outcomes event (schema 1.1).
pub fn event_outcomes() -> Event {
    Event {
        schema: SchemaVersion { major: 1, minor: 1 },
        kind: Event::OUTCOMES.into(),
        stage: "score".into(),
        source: "score-0".into(),
        version: 0,
        fields: BTreeMap::new(),
        text: None,
        time_us: EXAMPLE_TIME_US,
        outcomes: vec![
            crate::schema::PromptOutcome {
                prompt_id: "add-000042".into(),
                passed: 3,
                samples: 8,
            },
            crate::schema::PromptOutcome {
                prompt_id: "calc-000007".into(),
                passed: 0,
                samples: 8,
            },
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::codec::{encode, encoded_len};

    #[test]
    fn encoded_len_walks_every_message() {
        let bytes = encode(&realistic_rollout_group()).unwrap();
        assert_eq!(encoded_len(&bytes), Some(bytes.len()));
        let bytes = encode(&scored_group()).unwrap();
        assert_eq!(encoded_len(&bytes), Some(bytes.len()));
        assert_eq!(encoded_len(&bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0xc0);
        assert_eq!(encoded_len(&longer), Some(bytes.len()));
    }
}

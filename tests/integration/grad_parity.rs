//! The trainer's loss and every parameter's gradient match PyTorch's on one batch, within
//! 1e-4, sampling mask and temperature included (`tests/fixtures/grads`, made by
//! `scripts/make_grad_fixtures.py`): PPO and TIS on the tiny Qwen2 (tied embeddings, q/k/v
//! biases) and Llama fixtures, and on Qwen2 every other objective, aggregation mode, dual
//! clip and KL estimator the fixture's `variants` list (each the `[train]` settings it runs
//! with); and running the step in micro-batches gives the same loss and gradients as one
//! pass, within 1e-5. A faster loss that is wrong fails here.

use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::tensors::{TensorMap, safetensors_to_tensors};
use rlstream::schema::{
    self, FinishReason, RolloutGroup, Sample, SamplingMask, SchemaVersion, ScoredGroup, VersionRun,
};
use rlstream::stages::train::{Trainer, TrainerSettings};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct Batch {
    temperature: f32,
    clip_eps: f32,
    clip_eps_high: f32,
    is_cap: f32,
    groups: Vec<Group>,
    /// Each variant's `[train]` settings beyond the batch's, by fixture name.
    variants: BTreeMap<String, serde_json::Map<String, serde_json::Value>>,
}

#[derive(Deserialize)]
struct Group {
    prompt: Vec<u32>,
    advantages: Vec<f32>,
    samples: Vec<FixtureSample>,
}

#[derive(Deserialize)]
struct FixtureSample {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    mask: Option<Mask>,
}

#[derive(Deserialize)]
struct Mask {
    offsets: Vec<u32>,
    ids: Vec<u32>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn batch() -> Batch {
    let text = std::fs::read_to_string(fixtures().join("grads/batch.json")).expect("batch");
    serde_json::from_str(&text).expect("batch.json")
}

fn groups(b: &Batch) -> Vec<ScoredGroup> {
    let mut rollout = schema::examples::rollout_group(1, 1, 2, 0);
    rollout.sampling.temperature = b.temperature;
    b.groups
        .iter()
        .enumerate()
        .map(|(i, g)| ScoredGroup {
            schema: SchemaVersion::CURRENT,
            rollout: RolloutGroup {
                group_id: format!("g{i}"),
                prompt_tokens: g.prompt.clone().into(),
                samples: g
                    .samples
                    .iter()
                    .map(|s| Sample {
                        tokens: s.tokens.clone().into(),
                        logprobs: s.logprobs.clone().into(),
                        versions: vec![VersionRun {
                            start: 0,
                            version: 0,
                        }],
                        finish: FinishReason::Length,
                        mask: s.mask.as_ref().map(|m| SamplingMask {
                            offsets: m.offsets.clone().into(),
                            ids: m.ids.clone().into(),
                        }),
                        env: Vec::new(),
                        turn_rewards: Vec::new(),
                        routing: None,
                    })
                    .collect(),
                ..rollout.clone()
            },
            rewards: vec![0.0; g.samples.len()],
            advantages: g.advantages.clone(),
            token_rewards: None,
            ref_logprobs: None,
            scorer_id: "fixture".into(),
            scored_us: 0,
        })
        .collect()
}

/// `[train]` settings with the batch's clip ranges and cap, `over` laid on top (field names
/// and values as in a config file).
fn train_config(b: &Batch, over: &serde_json::Map<String, serde_json::Value>) -> TrainConfig {
    let base = TrainConfig {
        clip_eps: b.clip_eps,
        clip_eps_high: b.clip_eps_high,
        is_cap: b.is_cap,
        ..TrainConfig::default()
    };
    let mut fields = serde_json::to_value(base).expect("settings as JSON");
    for (k, v) in over {
        fields[k] = v.clone();
    }
    serde_json::from_value(fields).expect("the variant's settings")
}

fn trainer(model: &str, train: TrainConfig, micro_batch_tokens: usize, b: &Batch) -> Trainer {
    let dir = tempfile::tempdir().expect("tmp");
    let settings = TrainerSettings {
        policy: PolicySettings {
            model: Some(fixtures().join("models").join(model)),
            temperature: b.temperature,
            ..PolicySettings::default()
        },
        train: TrainConfig {
            micro_batch_tokens,
            checkpoint_dir: dir.path().join("ckpt"),
            ..train
        },
    };
    Trainer::start(&settings).expect("trainer")
}

/// The largest absolute difference between two gradient sets, and where.
fn max_diff(ours: &TensorMap, theirs: &TensorMap) -> (f32, String) {
    let mut worst = (0f32, String::new());
    for (name, t) in theirs {
        let o = ours
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(o.shape, t.shape, "{name}");
        for (a, b) in o.data.iter().zip(&t.data) {
            let d = (a - b).abs();
            if d > worst.0 || d.is_nan() {
                worst = (d, name.clone());
            }
        }
    }
    worst
}

#[test]
fn loss_and_gradients_match_pytorch() {
    let b = batch();
    let gs = groups(&b);
    let refs: Vec<&ScoredGroup> = gs.iter().collect();
    let text = std::fs::read_to_string(fixtures().join("grads/losses.json")).expect("losses");
    let losses: serde_json::Value = serde_json::from_str(&text).expect("losses.json");
    let mut checked = 0;
    for model in ["qwen2", "llama"] {
        for (kind, over) in &b.variants {
            let path = fixtures().join(format!("grads/{model}_{kind}.safetensors"));
            if !path.exists() {
                continue;
            }
            let train = train_config(&b, over);
            let t = trainer(model, train, 0, &b);
            let (ours, stats) = t.named_gradients(&refs).expect("gradients");
            let bytes = std::fs::read(&path).expect("fixture");
            let theirs = safetensors_to_tensors(&bytes, Some(&path)).expect("safetensors");
            assert_eq!(ours.len(), theirs.len(), "{model} {kind}: parameter count");
            let want = losses[format!("{model}_{kind}")].as_f64().expect("loss");
            assert!(
                (stats.loss - want).abs() < 1e-5,
                "{model} {kind}: loss {} vs PyTorch {want}",
                stats.loss
            );
            let (d, name) = max_diff(&ours, &theirs);
            assert!(d < 1e-4, "{model} {kind}: gradient of {name} off by {d}");
            checked += 1;
        }
    }
    assert!(
        checked >= b.variants.len() + 2,
        "{checked} fixtures checked"
    );
}

#[test]
fn micro_batches_add_up_to_the_whole_batch() {
    let b = batch();
    let gs = groups(&b);
    let refs: Vec<&ScoredGroup> = gs.iter().collect();
    // Every variant: a sequence-level ratio or a per-sequence weight must not change when a
    // step is split.
    for (kind, over) in &b.variants {
        let (whole, s1) = trainer("qwen2", train_config(&b, over), 0, &b)
            .named_gradients(&refs)
            .expect("one pass");
        // Samples hold 4 to 8 tokens: 8 runs each alone, 13 pairs the middle two.
        for micro in [8, 13] {
            let (parts, s2) = trainer("qwen2", train_config(&b, over), micro, &b)
                .named_gradients(&refs)
                .expect("micro-batches");
            assert!((s1.loss - s2.loss).abs() < 1e-6, "{kind} {micro}: loss");
            assert_eq!(s1.tokens, s2.tokens);
            assert!((s1.ratio_mean - s2.ratio_mean).abs() < 1e-6);
            let (d, name) = max_diff(&parts, &whole);
            assert!(d < 1e-5, "{kind} {micro}: gradient of {name} off by {d}");
        }
    }
}

/// Whether the trainer's forward passes are the same bits with and without a graph: on the
/// CPU's kernels, not on a CubeCL backend's.
const EXACT: bool = !cfg!(feature = "wgpu");

/// Gradient checkpointing (the trunk recomputed layer by layer in the backward) changes
/// neither the loss nor the statistics, and the gradients only in the last bits: for both
/// models (llama's head is the tied embedding, which gets its two parts in another order),
/// every objective variant, in one pass and in micro-batches. On the CPU the loss and the
/// ratios keep their bits ([`EXACT`]); on a CubeCL backend, whose kernels run without a
/// graph in the recompute's forward, they agree to rounding.
#[test]
fn recomputed_layers_give_the_whole_graphs_gradients() {
    let b = batch();
    let gs = groups(&b);
    let refs: Vec<&ScoredGroup> = gs.iter().collect();
    for model in ["qwen2", "llama"] {
        for (kind, over) in &b.variants {
            for micro in [0, 13] {
                let at = format!("{model} {kind} {micro}");
                let (whole, s1) = trainer(model, train_config(&b, over), micro, &b)
                    .named_gradients(&refs)
                    .expect("one graph");
                let mut train = train_config(&b, over);
                train.gradient_checkpointing = true;
                let (layered, s2) = trainer(model, train, micro, &b)
                    .named_gradients(&refs)
                    .expect("recomputed");
                let same = |a: f64, b: f64| match EXACT {
                    true => a.to_bits() == b.to_bits(),
                    false => (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                };
                let (l1, l2, r1, r2) = (s1.loss, s2.loss, s1.ratio_mean, s2.ratio_mean);
                assert!(same(l1, l2), "{at}: loss {l1} vs {l2}");
                assert!(same(r1, r2), "{at}: mean ratio {r1} vs {r2}");
                assert_eq!(s1.tokens, s2.tokens, "{at}");
                assert_eq!(whole.len(), layered.len(), "{at}: parameter count");
                let (d, name) = max_diff(&layered, &whole);
                let bound = if EXACT { 1e-6 } else { 1e-5 };
                assert!(d < bound, "{at}: gradient of {name} off by {d}");
            }
        }
    }
}

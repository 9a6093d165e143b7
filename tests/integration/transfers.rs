//! What crosses between host and device in a training step and a decode step, counted by
//! the `Counted` wrapper around the build's backend (on the CPU build, the CPU backend made
//! to take the device paths; with `--features wgpu`, the real crossings of burn's CubeCL
//! backend): the batch goes in, statistics and the sampler's logits come out, and nothing
//! else. The same batch on a model four times larger moves the same bytes: no parameter,
//! gradient or optimizer moment crosses.

use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::counted::{Counted, Transfers, transfers};
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema::{SamplingParams, ScoredGroup};
use rlstream::stages::train::{TrainerOn, TrainerSettings};

type Device = Counted<InferBackend>;
type Train = burn::backend::Autodiff<Device>;

const VOCAB: usize = 48;

/// Two models with the same vocabulary and head size: the second has twice the width, twice
/// the depth and about eight times the parameters.
fn models() -> [ModelConfig; 2] {
    [
        ModelConfig::new(Architecture::Qwen2, VOCAB, 64, 128, 2, 4, 2, 16)
            .with_qkv_bias(true)
            .with_max_position(256),
        ModelConfig::new(Architecture::Qwen2, VOCAB, 128, 256, 4, 8, 4, 16)
            .with_qkv_bias(true)
            .with_max_position(256),
    ]
}

fn group() -> ScoredGroup {
    let model = Policy::<InferBackend>::random(&models()[0], 3, &Default::default()).unwrap();
    let rewards = (0..4).map(|i| f32::from(u8::from(i < 2))).collect();
    crate::common::sampled_group(&model, "g", vec![5, 9, 2, 7], 8, 1, rewards)
}

/// The transfers of the second training step on `cfg` (the first makes the optimizer's
/// state), and the model's parameter bytes.
fn train_step(cfg: &ModelConfig, g: &ScoredGroup) -> (Transfers, usize) {
    let dir = tempfile::tempdir().unwrap();
    let model = Policy::<Device>::random(cfg, 8, &Default::default()).unwrap();
    model.save_hf(&dir.path().join("model")).unwrap();
    let settings = TrainerSettings {
        policy: PolicySettings {
            model: Some(dir.path().join("model")),
            ..PolicySettings::default()
        },
        train: TrainConfig {
            lr: 1e-3,
            checkpoint_dir: dir.path().join("ckpt"),
            ..TrainConfig::default()
        },
    };
    let mut trainer = TrainerOn::<Train>::start(&settings).unwrap();
    assert!(!trainer.step(&[g]).unwrap().skipped);
    let before = transfers();
    let stats = trainer.step(&[g]).unwrap();
    let moved = transfers().since(before);
    assert!(!stats.skipped && stats.grad_norm > 0.0, "{stats:?}");
    (moved, cfg.num_params() * 4)
}

#[test]
fn a_training_step_moves_the_batch_and_its_statistics_not_the_model() {
    let g = group();
    let tokens: usize = g
        .rollout
        .samples
        .iter()
        .map(|s| g.rollout.prompt_tokens.len() + s.tokens.len())
        .sum();
    let [(small, small_bytes), (big, big_bytes)] = models().map(|cfg| train_step(&cfg, &g));
    eprintln!(
        "train step, {tokens} tokens: {small:?} at {small_bytes} parameter bytes, {big:?} at {big_bytes}"
    );
    assert!(big_bytes > 6 * small_bytes, "{small_bytes} {big_bytes}");
    assert_eq!(
        small, big,
        "a step's host traffic grew with the model ({small_bytes} → {big_bytes} parameter bytes)"
    );
    // In: the batch's token ids, positions, rotary angles and per-token weights. Out: the
    // loss and the step's statistics. Both tens of bytes per token, and far below one copy
    // of the model.
    assert!(
        big.write_bytes as usize <= 64 * tokens,
        "{big:?} for {tokens} tokens"
    );
    assert!(
        big.read_bytes as usize <= 16 * tokens,
        "{big:?} for {tokens} tokens"
    );
    assert!(
        ((big.read_bytes + big.write_bytes) as usize) < big_bytes / 20,
        "{big:?} against {big_bytes} parameter bytes"
    );
}

/// The transfers of one decode step of `rows` rows on `cfg`, after the prompts' prefill
/// and a first step.
fn decode_step(cfg: &ModelConfig, rows: usize) -> Transfers {
    let model = Policy::<Device>::random(cfg, 8, &Default::default()).unwrap();
    let mut g = Generator::<Device>::new();
    let req = Request {
        id: 0,
        prompt: vec![3, 4, 5, 6],
        n: rows,
        params: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 16,
            stop_tokens: vec![],
            seed: 2,
        },
    };
    g.admit(&model, 0, &req).unwrap();
    g.step(&model, 0).unwrap();
    let before = transfers();
    g.step(&model, 0).unwrap();
    transfers().since(before)
}

#[test]
fn a_decode_step_reads_the_logits_and_writes_the_next_tokens() {
    let rows = 4;
    let [small, big] = models().map(|cfg| decode_step(&cfg, rows));
    eprintln!("decode step, {rows} rows: {small:?}, {big:?}");
    assert_eq!(
        small, big,
        "a decode step's host traffic grew with the model"
    );
    let logits = (rows * VOCAB * 4) as u64;
    assert!(
        big.read_bytes >= logits && big.read_bytes <= logits + 1024,
        "{big:?}: the logits are {logits} bytes"
    );
    assert!(big.write_bytes <= 4096, "{big:?}");
}

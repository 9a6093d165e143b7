//! One trainer step moves the policy the right way: completions with positive advantage
//! become more likely and those with negative advantage less, for every loss.

use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema::ScoredGroup;
use rlstream::stages::train::TrainerSettings;
use rlstream::stages::train::{LossKind, Trainer};

/// Trainer settings starting from the model saved under `dir/model`.
fn settings(dir: &std::path::Path, train: TrainConfig) -> TrainerSettings {
    TrainerSettings {
        policy: PolicySettings {
            model: Some(dir.join("model")),
            ..PolicySettings::default()
        },
        train,
    }
}

fn group(model: &Policy<InferBackend>) -> ScoredGroup {
    let rewards: Vec<f32> = (0..8).map(|i| if i < 2 { 1.0 } else { 0.0 }).collect();
    crate::common::sampled_group(model, "g", vec![4, 9, 2], 6, 3, rewards)
}

fn seq_logprobs(model: &Policy<InferBackend>, g: &ScoredGroup) -> Vec<f32> {
    crate::common::teacher_forced(model, g)
        .iter()
        .map(|r| r.iter().sum())
        .collect()
}

/// A tiny random policy of `arch`, saved as `model` in a fresh directory.
fn saved_tiny(arch: Architecture) -> (tempfile::TempDir, ModelConfig, Policy<InferBackend>) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny(arch, 32);
    let model = Policy::<InferBackend>::random(&cfg, 8, &Default::default()).unwrap();
    model.save_hf(&dir.path().join("model")).unwrap();
    (dir, cfg, model)
}

#[test]
fn a_step_raises_good_completions_and_lowers_bad_ones() {
    let (dir, cfg, model) = saved_tiny(Architecture::Qwen2);
    let g = group(&model);
    let before = seq_logprobs(&model, &g);
    for loss in [LossKind::Ppo, LossKind::Tis, LossKind::Reinforce] {
        let tc = settings(
            dir.path(),
            TrainConfig {
                loss,
                lr: 1e-2,
                checkpoint_dir: dir.path().join(format!("ckpt-{loss:?}")),
                ..TrainConfig::default()
            },
        );
        let mut trainer = Trainer::start(&tc).unwrap();
        let stats = trainer.step(&[&g]).unwrap();
        assert!(!stats.skipped);
        assert!(
            (stats.ess - 1.0).abs() < 1e-3,
            "on-policy ESS {}",
            stats.ess
        );
        assert!(
            stats.mismatch_kl.abs() < 1e-4,
            "on-policy mismatch {}",
            stats.mismatch_kl
        );
        let after_model = Policy::<InferBackend>::from_bytes(
            &cfg,
            &trainer.weights_blob().unwrap(),
            &Default::default(),
        )
        .unwrap();
        let after = seq_logprobs(&after_model, &g);
        let delta: Vec<f32> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        let good = (delta[0] + delta[1]) / 2.0;
        let bad = delta[2..].iter().sum::<f32>() / 6.0;
        assert!(
            good > 0.0 && good > bad,
            "{loss:?}: good {good}, bad {bad}, deltas {delta:?}"
        );
    }
}

/// A group whose advantages are not finite (only reachable by building messages by hand:
/// the decoder refuses them) makes the loss NaN: the step is skipped and the weights stay.
#[test]
fn a_nan_loss_skips_the_step_and_keeps_the_weights() {
    let (dir, _, model) = saved_tiny(Architecture::Llama);
    let mut g = group(&model);
    g.advantages[3] = f32::NAN;
    let tc = settings(
        dir.path(),
        TrainConfig {
            lr: 1e-2,
            checkpoint_dir: dir.path().join("ckpt"),
            ..TrainConfig::default()
        },
    );
    let mut trainer = Trainer::start(&tc).unwrap();
    let before = trainer.weights_blob().unwrap();
    let stats = trainer.step(&[&g]).unwrap();
    assert!(stats.skipped, "{stats:?}");
    assert!(!stats.loss.is_finite());
    assert_eq!(trainer.weights_blob().unwrap(), before, "weights changed");
    assert_eq!((trainer.state.version, trainer.state.step), (0, 0));
    // A good group afterwards trains normally.
    let good = group(&model);
    let stats = trainer.step(&[&good]).unwrap();
    assert!(!stats.skipped && stats.loss.is_finite());
    assert_eq!(trainer.state.version, 1);
}

/// `--save-dtype bf16`: the checkpoint's model.safetensors is bf16 (half the bytes,
/// `torch_dtype: bfloat16`, each value the f32 weight rounded), and a trainer resumed from
/// it continues from its own f32 weights, not from the rounded ones.
#[test]
fn bf16_checkpoints_hold_rounded_weights_and_resume_at_f32() {
    use burn::module::AutodiffModule;
    use rlstream::model::hf::read_hf_tensors;
    use rlstream::model::tensors::WeightDtype;
    let (dir, _, model) = saved_tiny(Architecture::Qwen2);
    let g = group(&model);
    let tc = settings(
        dir.path(),
        TrainConfig {
            lr: 1e-2,
            save_dtype: WeightDtype::Bf16,
            checkpoint_dir: dir.path().join("ckpt"),
            ..TrainConfig::default()
        },
    );
    let mut trainer = Trainer::start(&tc).unwrap();
    trainer.step(&[&g]).unwrap();
    let saved = trainer.checkpoint().unwrap();
    let exact = trainer.model().valid().to_tensors().unwrap();
    let config = std::fs::read_to_string(saved.join("config.json")).unwrap();
    assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");
    let file = std::fs::metadata(saved.join("model.safetensors"))
        .unwrap()
        .len();
    let f32_bytes: usize = exact.values().map(|t| t.data.len() * 4).sum();
    assert!(
        (file as f64) < 0.55 * f32_bytes as f64,
        "{file} bytes for {f32_bytes} of f32"
    );
    let rounded = read_hf_tensors(&saved).unwrap();
    let mut differ = 0;
    for (name, t) in &exact {
        for (a, b) in t.data.iter().zip(&rounded[name].data) {
            assert_eq!(half::bf16::from_f32(*a).to_f32(), *b, "{name}");
            differ += usize::from(a != b);
        }
    }
    assert!(differ > 0, "bf16 rounding should change some weights");
    let resumed = Trainer::start(&tc).unwrap();
    assert_eq!(resumed.model().valid().to_tensors().unwrap(), exact);
}

#[test]
fn keep_freed_memory_turns_the_allocators_purging_off_after_the_first_step() {
    let (dir, _, model) = saved_tiny(Architecture::Qwen2);
    let g = group(&model);
    let default = rlstream::cpu::purge_delay_ms();
    assert!(default >= 0, "purging is on by default ({default} ms)");
    for keep in [false, true] {
        let tc = settings(
            dir.path(),
            TrainConfig {
                lr: 1e-2,
                checkpoint_dir: dir.path().join(format!("ckpt-{keep}")),
                keep_freed_memory: keep,
                ..TrainConfig::default()
            },
        );
        let mut trainer = Trainer::start(&tc).unwrap();
        assert_eq!(
            rlstream::cpu::purge_delay_ms(),
            default,
            "not before a step"
        );
        assert!(!trainer.step(&[&g]).unwrap().skipped);
        // A device backend's memory is not the host allocator's: the setting leaves it.
        let host = <InferBackend as rlstream::model::WeightStorage>::HOST_MEMORY;
        let now = rlstream::cpu::purge_delay_ms();
        let expected = if keep && host { -1 } else { default };
        assert_eq!(
            now, expected,
            "keep_freed_memory {keep}, host memory {host}"
        );
        // The next steps train as before.
        assert!(!trainer.step(&[&g]).unwrap().skipped);
    }
}

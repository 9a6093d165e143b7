//! No operation over zero elements on the device paths. CUDA refuses a kernel launch with
//! no blocks (`CUDA_ERROR_INVALID_VALUE`: the first GPU run stopped every prefill on one),
//! while wgpu and the CPU backends accept it. The `Counted` wrapper refuses such an
//! operation with a panic that names it (`rlstream::model::counted::nonempty`), so every
//! test that runs on it checks its path: generation on every parity fixture, on an adapter
//! and in episodes with weight swaps (`decode_kernels`, `episodes`), host traffic
//! (`transfers`), the fused kernels' composed forms (`src/model/kernels/tests.rs`). Here:
//! the refusal itself, and the trainer through its objectives and batch shapes on dense,
//! MoE and LoRA policies, on groups of ragged lengths with kept-set masks.

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor};
use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::counted::Counted;
use rlstream::model::{Architecture, InferBackend, ModelConfig, MoeConfig, Policy};
use rlstream::schema::{SamplingParams, ScoredGroup};
use rlstream::stages::train::{IsMask, LossAgg, LossKind, RoutingMode, TrainerOn, TrainerSettings};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// The build's backend, with operations over zero elements refused.
type Checked = Counted<InferBackend>;
type CheckedTrain = Autodiff<Checked>;

const VOCAB: usize = 40;

/// The panic message of `f`, which must panic.
fn refused(what: &str, f: impl FnOnce()) -> String {
    let err = catch_unwind(AssertUnwindSafe(f))
        .err()
        .unwrap_or_else(|| panic!("{what} ran over zero elements without a refusal"));
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_default()
}

#[test]
fn an_operation_over_no_elements_is_refused_and_named() {
    let d = Default::default();
    // Allocation without a fill and the host transfers launch nothing.
    let none = Tensor::<Checked, 2>::empty([0, 4], &d);
    assert_eq!(none.clone().into_data().num_elements(), 0);
    let x = Tensor::<Checked, 2>::ones([2, 4], &d);
    assert_eq!((x.clone() + x.clone()).sum().into_scalar(), 16.0);

    // A fill, as the first GPU run's fresh KV cache was made.
    let msg = refused("a fill", || {
        Tensor::<Checked, 4>::zeros([2, 1, 0, 16], &d);
    });
    assert!(
        msg.contains("float_zeros") && msg.contains("CUDA_ERROR_INVALID_VALUE"),
        "{msg}"
    );
    // A concatenation whose sides have no elements (burn drops a side that is empty only
    // along the concatenated dimension; these are empty along another).
    let msg = refused("a concatenation", || {
        Tensor::cat(vec![none.clone(), none.clone()], 1);
    });
    assert!(msg.contains("float_cat"), "{msg}");
    // An element-wise operation on an empty input, a product with an empty inner
    // dimension, and the integer and boolean kinds. (A slice down to nothing is burn's own
    // `empty`, which launches nothing.)
    let msg = refused("exp", || {
        none.clone().exp();
    });
    assert!(msg.contains("float_exp"), "{msg}");
    assert_eq!(x.clone().slice([0..2, 2..2]).dims(), [2, 0]);
    refused("a product", || {
        Tensor::<Checked, 2>::empty([2, 0], &d).matmul(Tensor::empty([0, 3], &d));
    });
    let msg = refused("an integer range", || {
        Tensor::<Checked, 1, Int>::arange(3..3, &d);
    });
    assert!(msg.contains("int_"), "{msg}");
    let msg = refused("a comparison", || {
        none.clone().greater_elem(0.0);
    });
    assert!(msg.contains("float_greater_elem"), "{msg}");
}

/// A group of 4 completions of `prompt` sampled on the checked backend (so generation is
/// checked too): stop tokens end some early, top-k records kept sets, and the rewards
/// differ unless `flat`.
fn group(
    model: &Policy<Checked>,
    id: &str,
    prompt: Vec<u32>,
    top_k: u32,
    flat: bool,
) -> ScoredGroup {
    let params = SamplingParams {
        temperature: 1.0,
        top_k,
        top_p: 1.0,
        max_new_tokens: 6,
        stop_tokens: (0..6).collect(),
        seed: prompt.len() as u64,
    };
    let rewards = (0..4)
        .map(|i| {
            if flat {
                1.0
            } else {
                f32::from(u8::from(i % 2 == 0))
            }
        })
        .collect();
    crate::common::group_sampled_with(model, id, prompt, params, rewards)
}

/// Two steps of a trainer on `cfg`'s model with `train`'s objective and batch shape, on
/// three groups: prompts of 1, 3 and 9 tokens, ragged completions, kept-set masks on one,
/// equal rewards (advantage 0 everywhere) on another.
fn train_two_steps(cfg: &ModelConfig, train: TrainConfig) {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = Policy::<Checked>::random(cfg, 5, &Default::default()).expect("model");
    model.save_hf(&dir.path().join("model")).expect("save");
    let groups = [
        group(&model, "a", vec![7], 0, false),
        group(&model, "b", vec![9, 10, 11], 8, false),
        group(&model, "c", (12..21).collect(), 0, true),
    ];
    let what = format!(
        "{:?} {:?} micro-batches {}",
        cfg.architecture, train.loss, train.micro_batch_tokens
    );
    let settings = TrainerSettings {
        policy: PolicySettings {
            model: Some(dir.path().join("model")),
            ..PolicySettings::default()
        },
        train: TrainConfig {
            checkpoint_dir: dir.path().join("ckpt"),
            ..train
        },
    };
    let mut trainer = TrainerOn::<CheckedTrain>::start(&settings).expect("trainer");
    let all: Vec<&ScoredGroup> = groups.iter().collect();
    for step in 0..2 {
        let stats = trainer
            .step(&all)
            .unwrap_or_else(|e| panic!("{what}, step {step}: {e}"));
        assert!(
            !stats.skipped && stats.grad_norm.is_finite(),
            "{what}: {stats:?}"
        );
    }
    // A step on the equal-reward group alone: every advantage is 0.
    trainer
        .step(&all[2..])
        .unwrap_or_else(|e| panic!("{what}, a flat group alone: {e}"));
}

#[test]
fn the_trainer_launches_nothing_over_no_elements() {
    let dense = ModelConfig::tiny(Architecture::Qwen2, VOCAB);
    let base = || TrainConfig {
        lr: 1e-3,
        ..TrainConfig::default()
    };
    // Every objective, in one pass and in micro-batches of at most 12 tokens (a sequence
    // alone, or a few), with the entropy recorded.
    for (loss, micro) in [
        (LossKind::Ppo, 0),
        (LossKind::Ppo, 12),
        (LossKind::Tis, 12),
        (LossKind::Reinforce, 0),
        (LossKind::Gspo, 12),
        (LossKind::Cispo, 0),
    ] {
        train_two_steps(
            &dense,
            TrainConfig {
                loss,
                micro_batch_tokens: micro,
                ..base()
            },
        );
    }
    // Off-policy masks, the KL penalty, the entropy bonus, decoupled PPO, mini-batches
    // over two epochs, another aggregation, truncated completions kept out.
    train_two_steps(
        &dense,
        TrainConfig {
            is_mask: IsMask::Token,
            kl_coef: 0.1,
            entropy_coeff: 0.01,
            use_decoupled_loss: true,
            ppo_mini_batch_size: 1,
            ppo_epochs: 2,
            loss_agg_mode: LossAgg::SeqMeanTokenSumNorm,
            mask_truncated: true,
            micro_batch_tokens: 16,
            ..base()
        },
    );
    train_two_steps(
        &dense,
        TrainConfig {
            is_mask: IsMask::Sequence,
            ..base()
        },
    );
    // Mixture of experts (8 experts, 2 a token, and a shared one: on a few tokens some
    // experts get none), with the experts replayed (the default) and routed live.
    let mut experts = MoeConfig::new(8, 2, 24);
    experts.shared_expert_size = Some(24);
    let moe = ModelConfig::tiny(Architecture::Qwen2Moe, VOCAB).with_moe(Some(experts));
    train_two_steps(&moe, base());
    train_two_steps(
        &moe,
        TrainConfig {
            routing: RoutingMode::Live,
            micro_batch_tokens: 12,
            ..base()
        },
    );
    // LoRA on a frozen base.
    train_two_steps(
        &ModelConfig::tiny(Architecture::Llama, VOCAB),
        TrainConfig {
            lora_rank: 4,
            micro_batch_tokens: 12,
            ..base()
        },
    );
}

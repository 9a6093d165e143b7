//! What a training pass keeps in memory: the output head's logits never exist for more
//! rows than one chunk (in the trainer, the teacher, `sft` and `eval`), attention keeps
//! state linear in the length for its backward, and a checkpointed trunk keeps one hidden
//! state per layer.
//!
//! The memory test counts the bytes this process holds through its allocator; nextest
//! runs each test in a process of its own, so nothing else allocates meanwhile.

use burn::tensor::{Int, Tensor, TensorData};
use rlstream::commands::eval::{self, EvalSet};
use rlstream::commands::sft::{self, SftOptions};
use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::kernels::{HEAD_CHUNK_ROWS, PackOnce, reset_widest_logits, widest_logits};
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::moe::Routes;
use rlstream::model::tokenizer::Tokenizer;
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy, TrainBackend};
use rlstream::stages::score::teacher::Teacher;
use rlstream::stages::train::{Trainer, TrainerSettings};
use rlstream::tasks::BuiltinTask;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// The system allocator, counting the bytes held.
struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is the system allocator's; the counter only observes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HELD.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A model of `layers` layers with many narrow heads (so attention's probabilities would
/// dwarf everything linear).
fn narrow_heads(layers: usize) -> Policy<TrainBackend> {
    let cfg =
        ModelConfig::new(Architecture::Llama, 64, 32, 32, layers, 8, 8, 4).with_max_position(2048);
    Policy::<TrainBackend>::random(&cfg, 3, &Default::default()).unwrap()
}

/// Bytes a teacher-forced pass over one sequence of `len` tokens keeps alive for its
/// backward, on a model of `layers` layers with many narrow heads (so attention's
/// probabilities, `heads × len²`, would dwarf everything linear).
fn kept_for_backward(layers: usize, len: usize) -> isize {
    let model = narrow_heads(layers);
    let prompt = [1u32];
    let completion: Vec<u32> = (0..len - 1).map(|i| (i % 60) as u32 + 2).collect();
    let seqs = [ScoredSeq::plain(&prompt, &completion)];
    let before = HELD.load(Ordering::SeqCst);
    let (lp, valid) = completion_logprobs(&model, &seqs, 1.0);
    let held = HELD.load(Ordering::SeqCst) - before;
    drop((lp, valid));
    held
}

#[test]
fn attention_keeps_state_linear_in_the_length_for_its_backward() {
    // One layer's share: two layers less one, at two lengths four times apart.
    let per_layer = |len| kept_for_backward(2, len) - kept_for_backward(1, len);
    let (short, long) = (per_layer(128), per_layer(512));
    assert!(short > 0, "a layer keeps something: {short} bytes");
    // Linear state grows 4× from 128 to 512 tokens; the probabilities (8 heads × len² ×
    // 4 bytes: 0.5 MB then 8.4 MB a layer) would make it about 12×.
    let growth = long as f64 / short as f64;
    eprintln!("a layer keeps {short} bytes at 128 tokens, {long} at 512 ({growth:.2}x)");
    assert!(
        growth < 5.0,
        "a layer keeps {short} bytes at 128 tokens and {long} at 512 ({growth:.1}×): more than linear"
    );
}

/// Bytes the trunk of a pass over one sequence of `len` tokens keeps alive for its
/// backward with the layers checkpointed (`train.gradient_checkpointing`), on
/// [`narrow_heads`]' model.
fn kept_checkpointed(layers: usize, len: usize) -> (isize, usize) {
    let model = narrow_heads(layers);
    let ids: Vec<i64> = (0..len).map(|i| (i % 60) as i64 + 2).collect();
    let tokens = Tensor::<TrainBackend, 2, Int>::from_data(
        TensorData::new(ids, [1, len]),
        &Default::default(),
    );
    let before = HELD.load(Ordering::SeqCst);
    let kept = model.hidden_checkpointed(tokens, &mut Routes::default());
    let held = HELD.load(Ordering::SeqCst) - before;
    drop(kept);
    (held, model.config().hidden_size)
}

#[test]
fn checkpointed_layers_keep_one_hidden_state_each() {
    let len = 256;
    let (one, hidden) = kept_checkpointed(1, len);
    let (two, _) = kept_checkpointed(2, len);
    let per_layer = two - one;
    let state = (len * hidden * 4) as isize;
    let plain = kept_for_backward(2, len) - kept_for_backward(1, len);
    eprintln!(
        "a checkpointed layer keeps {per_layer} bytes, a plain one {plain}; one hidden state is {state}"
    );
    assert!(
        per_layer <= state + 4096,
        "a checkpointed layer keeps {per_layer} bytes, more than its input's {state}"
    );
    assert!(
        plain > 4 * state,
        "a plain layer keeps {plain} bytes (the test of the test)"
    );
}

/// The recorder sees a pass that builds every position's logits (the test of the test).
#[test]
fn the_widest_logits_record_sees_a_full_forward() {
    let cfg = ModelConfig::tiny(Architecture::Qwen2, 32);
    let model = Policy::<InferBackend>::random(&cfg, 1, &Default::default()).unwrap();
    reset_widest_logits();
    let ids: Vec<i64> = (0..300).map(|i| i % 30).collect();
    let tokens = burn::tensor::Tensor::<InferBackend, 2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(ids, [1, 300]),
        &Default::default(),
    );
    let _ = model.forward(tokens);
    assert_eq!(widest_logits(), 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_scoring_pass_builds_logits_for_more_than_one_chunk() {
    let dir = tempfile::tempdir().unwrap();
    reset_widest_logits();
    // sft: 256 prompts a step, each answer several tokens: more rows than a chunk.
    let opts = SftOptions {
        out: dir.path().join("sft"),
        steps: 1,
        batch: 256,
        eval: 8,
        ..SftOptions::default()
    };
    sft::run(&opts, |_, _| {}).expect("sft");
    let model = eval::load_model(&dir.path().join("sft"), None).expect("sft's model");
    // eval: greedy decoding over a few prompts.
    let set = EvalSet::task(BuiltinTask::Add, 8);
    eval::greedy(&model, &set, 8, |_| {}).expect("eval");
    // The trainer: one group of 8 completions of 80 tokens, 640 rows in one pass.
    let g = crate::common::sampled_group(
        &model,
        "g",
        vec![4, 9, 2],
        80,
        3,
        vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0],
    );
    let rows: usize = g.rollout.samples.iter().map(|s| s.tokens.len()).sum();
    assert!(rows > HEAD_CHUNK_ROWS, "{rows} completion tokens");
    let settings = TrainerSettings {
        policy: PolicySettings {
            model: Some(dir.path().join("sft")),
            ..PolicySettings::default()
        },
        train: TrainConfig {
            checkpoint_dir: dir.path().join("ckpt"),
            ..TrainConfig::default()
        },
    };
    let mut trainer = Trainer::start(&settings).expect("trainer");
    trainer.step(&[&g]).expect("step");
    // The teacher (the same model) on the same completions.
    let tokenizer = Tokenizer::load(&dir.path().join("sft")).expect("tokenizer");
    let teacher = Teacher::load(&dir.path().join("sft"), &tokenizer).expect("teacher");
    let scored = teacher.logprobs(&[&g.rollout]).await;
    assert!(
        scored.iter().all(Result::is_ok),
        "teacher refused the group"
    );
    // The trainer's pass (one micro-batch of 640 rows) ran in chunks, the first one full,
    // and nothing built more.
    let widest = widest_logits();
    assert_eq!(
        widest, HEAD_CHUNK_ROWS,
        "the widest logits were built for {widest} rows at once (a chunk is {HEAD_CHUNK_ROWS})"
    );
}

/// A step in micro-batches packs each weight once for all of them (forward, backward and
/// the head's recomputation): the same packings as a step of two micro-batches, one per
/// linear weight and one for the tied head.
#[test]
fn a_micro_batched_step_packs_each_weight_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny(Architecture::Llama, 64).with_tie_embeddings(true);
    let model = Policy::<InferBackend>::random(&cfg, 4, &Default::default()).expect("model");
    model.save_hf(&dir.path().join("model")).expect("save");
    let g =
        crate::common::sampled_group(&model, "g", vec![5, 3, 9], 24, 1, vec![1.0, 0.0, 0.5, 0.25]);
    let packings = |micro_batch_tokens: usize| {
        let settings = TrainerSettings {
            policy: PolicySettings {
                model: Some(dir.path().join("model")),
                ..PolicySettings::default()
            },
            train: TrainConfig {
                checkpoint_dir: dir.path().join(format!("ckpt{micro_batch_tokens}")),
                micro_batch_tokens,
                ..TrainConfig::default()
            },
        };
        let mut trainer = Trainer::start(&settings).expect("trainer");
        let before = PackOnce::packings_kept();
        trainer.step(&[&g]).expect("step");
        PackOnce::packings_kept() - before
    };
    // One sample a micro-batch (four), then two samples each (two).
    let (four, two) = (packings(1), packings(54));
    let linear = cfg.num_layers * 7;
    assert_eq!(four, linear + 1, "four micro-batches kept {four} packings");
    assert_eq!(two, four, "two micro-batches kept {two} packings");
    assert_eq!(
        PackOnce::packed_weights(),
        0,
        "the step let its packings go"
    );
}

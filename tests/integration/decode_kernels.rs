//! Generation on the trainer's kernels (NdArray, linear weights kept `[out, in]` and read
//! by the few-row kernel) against the sampler it replaced (Flex, burn's composed
//! operations): the same tokens and finish reasons, the same kept sets and experts, and
//! log-probs within 1e-5, on every transformers parity fixture (dense and MoE), on a PEFT
//! adapter, and (in `episodes`) on episodes with weight swaps. Requests join the batch at
//! different passes, so admission, prefix sharing across a group and the cache's row
//! bookkeeping all run.

use burn::backend::Flex;
use rlstream::model::hf::load_hf;
use rlstream::model::sampler::{Completion, Generator, Request};
use rlstream::model::{InferBackend, Kernels, Policy, lora};
use rlstream::schema::SamplingParams;
use std::path::PathBuf;

/// The largest log-prob difference allowed between the two samplers.
pub const LOGPROB_TOLERANCE: f32 = 1e-5;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Three groups of three: prompts of 1, 6 and 19 tokens; temperature, top-k and top-p
/// sampling (the last two record kept sets).
fn requests(vocab: usize) -> Vec<Request> {
    let prompt = |len: usize, salt: usize| -> Vec<u32> {
        (0..len)
            .map(|i| ((i * 7 + salt * 13 + 3) % vocab) as u32)
            .collect()
    };
    let params = |temperature, top_k, top_p, seed| SamplingParams {
        temperature,
        top_k,
        top_p,
        max_new_tokens: 12,
        stop_tokens: vec![],
        seed,
    };
    vec![
        Request {
            id: 0,
            prompt: prompt(1, 0),
            n: 3,
            params: params(1.0, 0, 1.0, 1),
        },
        Request {
            id: 1,
            prompt: prompt(6, 1),
            n: 3,
            params: params(0.8, 10, 1.0, 2),
        },
        Request {
            id: 2,
            prompt: prompt(19, 2),
            n: 3,
            params: params(1.2, 0, 0.9, 3),
        },
    ]
}

/// The requests run on `model`, the second joining after two passes and the third after
/// three more.
fn sample<B: Kernels>(model: &Policy<B>) -> Vec<Completion> {
    let reqs = requests(model.config().vocab_size);
    let mut g = Generator::new();
    let mut done = Vec::new();
    for (r, passes) in reqs.iter().zip([2, 3, 0]) {
        g.admit(model, 0, r).expect("admit");
        for _ in 0..passes {
            done.extend(g.step(model, 0).expect("pass"));
        }
    }
    while !g.is_idle() {
        done.extend(g.step(model, 0).expect("pass"));
    }
    done.sort_by_key(|c| (c.request_id, c.index));
    done
}

/// Same tokens, finishes, kept sets and experts; log-probs within [`LOGPROB_TOLERANCE`].
/// Returns the largest log-prob difference.
pub fn assert_same_generation(what: &str, new: &[Completion], old: &[Completion]) -> f32 {
    assert_eq!(new.len(), old.len(), "{what}: completions");
    let mut worst = 0f32;
    for (a, b) in new.iter().zip(old) {
        let at = format!("{what}, request {} sample {}", a.request_id, a.index);
        assert_eq!(a.tokens, b.tokens, "{at}: tokens");
        assert_eq!(a.finish, b.finish, "{at}: finish");
        assert_eq!(a.mask, b.mask, "{at}: kept sets");
        assert_eq!(a.routing, b.routing, "{at}: experts");
        assert_eq!(a.prompt_routing, b.prompt_routing, "{at}: prompt experts");
        assert_eq!(a.env, b.env, "{at}: environment spans");
        assert_eq!(a.logprobs.len(), b.logprobs.len(), "{at}: log-probs");
        for (t, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
            let d = (x - y).abs();
            assert!(
                d <= LOGPROB_TOLERANCE,
                "{at}, token {t}: log-prob {x} on the trainer's kernels, {y} on Flex"
            );
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn every_parity_fixture_generates_as_on_flex() {
    let names = [
        "llama",
        "llama3",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
    ];
    for name in names {
        let dir = fixtures().join("models").join(name);
        let new: Policy<InferBackend> = load_hf(&dir, &Default::default()).expect("load");
        let old: Policy<Flex> = load_hf(&dir, &Default::default()).expect("load");
        let (a, b) = (sample(&new), sample(&old));
        assert_eq!(a.len(), 9, "{name}");
        let moe = name.ends_with("moe");
        assert!(
            a.iter().all(|c| c.routing.is_some() == moe),
            "{name}: experts recorded"
        );
        assert!(
            a.iter().any(|c| c.mask.is_some()),
            "{name}: kept sets recorded"
        );
        assert_same_generation(name, &a, &b);
    }
}

#[test]
fn an_adapter_generates_as_on_flex() {
    for name in ["qwen3", "llama"] {
        let (base, adapter) = (
            fixtures().join("models").join(name),
            fixtures().join("lora").join(name),
        );
        let new: Policy<InferBackend> =
            lora::load_with_adapter(&base, &adapter, &Default::default()).expect("adapter");
        let old: Policy<Flex> =
            lora::load_with_adapter(&base, &adapter, &Default::default()).expect("adapter");
        assert!(new.has_adapter());
        assert_same_generation(name, &sample(&new), &sample(&old));
        // The adapter changes what is sampled: the comparison is of the adapted model.
        let plain: Policy<InferBackend> = load_hf(&base, &Default::default()).expect("base");
        assert_ne!(
            sample(&plain),
            sample(&new),
            "{name}: the adapter changes nothing"
        );
    }
}

/// A bf16 checkpoint (every parity fixture's values rounded to bf16) is held for
/// generation in 16 bits, and samples exactly what the same values give in f32: the
/// trainer's model (autodiff, `[in, out]` f32 weights, the same kernels) draws the same
/// tokens with the same log-prob bits, and Flex within [`LOGPROB_TOLERANCE`]. Copying the
/// weights back out gives the bf16 values, and an adapter merges onto them.
#[test]
fn a_bf16_checkpoint_generates_from_16_bit_weights_as_in_f32() {
    use burn::backend::Autodiff;
    use burn::tensor::DType;
    use rlstream::model::tensors::WeightDtype;
    for name in ["qwen2", "qwen3_moe", "llama"] {
        let tmp = tempfile::tempdir().expect("tmp");
        let f32_model: Policy<InferBackend> =
            load_hf(&fixtures().join("models").join(name), &Default::default()).expect("load");
        f32_model
            .save_hf_as(tmp.path(), WeightDtype::Bf16)
            .expect("save bf16");
        let half: Policy<InferBackend> = load_hf(tmp.path(), &Default::default()).expect("load");
        let q = half.blocks[0].attn.q.weight.val();
        assert_eq!(q.dtype(), DType::U16, "{name}: q_proj held in 16 bits");
        let trainer: Policy<Autodiff<InferBackend>> =
            load_hf(tmp.path(), &Default::default()).expect("load");
        assert_eq!(
            half.to_tensors().expect("tensors"),
            trainer.to_tensors().expect("tensors"),
            "{name}: the weights copied out"
        );
        let (a, b) = (sample(&half), sample(&trainer));
        assert_eq!(assert_same_generation(name, &a, &b), 0.0, "{name}");
        for (x, y) in a.iter().zip(&b) {
            let bits = |c: &Completion| c.logprobs.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(x), bits(y), "{name}: log-prob bits");
        }
        let flex: Policy<Flex> = load_hf(tmp.path(), &Default::default()).expect("load");
        assert_same_generation(name, &a, &sample(&flex));
    }
    // An adapter merged onto 16-bit base weights (as a generator applies adapter versions).
    let tmp = tempfile::tempdir().expect("tmp");
    let base: Policy<InferBackend> =
        load_hf(&fixtures().join("models/qwen3"), &Default::default()).expect("load");
    base.save_hf_as(tmp.path(), WeightDtype::Bf16)
        .expect("save bf16");
    let adapter = fixtures().join("lora/qwen3");
    let new: Policy<InferBackend> =
        lora::load_with_adapter(tmp.path(), &adapter, &Default::default()).expect("adapter");
    let old: Policy<Flex> =
        lora::load_with_adapter(tmp.path(), &adapter, &Default::default()).expect("adapter");
    let merged = new.merged();
    // The merged weight keeps the layout a decode step streams: `[out, in]` in memory.
    let q = merged.blocks[0].attn.q.weight.val();
    match q.into_primitive().tensor() {
        burn::backend::ndarray::NdArrayTensor::F32(s) => {
            assert!(
                s.into_shared().t().is_standard_layout(),
                "merged q_proj layout"
            )
        }
        _ => panic!("the merged q_proj is f32"),
    }
    assert_same_generation("merged adapter", &sample(&merged), &sample(&old));
}

//! Generation on the trainer's kernels (NdArray, linear weights kept `[out, in]` and read
//! by the few-row kernel) against burn's composed operations (the model as it runs on a
//! backend without native kernels, here `Counted<NdArray>`, as the sampler ran before the
//! trainer's kernels): the same tokens and finish reasons, the same kept sets and experts, and
//! log-probs within 1e-5, on every transformers parity fixture (dense and MoE), on a PEFT
//! adapter, and (in `episodes`) on episodes with weight swaps. Requests join the batch at
//! different passes, so admission, prefix sharing across a group and the cache's row
//! bookkeeping all run.

use burn::backend::NdArray;
use rlstream::model::counted::Counted;
use rlstream::model::hf::load_hf;
use rlstream::model::sampler::{Completion, Generator, Request};
use rlstream::model::{InferBackend, Kernels, Policy, lora};
use rlstream::schema::SamplingParams;
use std::path::PathBuf;

/// The model as burn's composed operations run it: no native kernel, weights in burn's
/// `[in, out]` layout.
pub type Composed = Counted<NdArray>;

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
                "{at}, token {t}: log-prob {x} on the trainer's kernels, {y} composed"
            );
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn every_parity_fixture_generates_as_with_composed_operations() {
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
        let old: Policy<Composed> = load_hf(&dir, &Default::default()).expect("load");
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
fn an_adapter_generates_as_with_composed_operations() {
    for name in ["qwen3", "llama"] {
        let (base, adapter) = (
            fixtures().join("models").join(name),
            fixtures().join("lora").join(name),
        );
        let new: Policy<InferBackend> =
            lora::load_with_adapter(&base, &adapter, &Default::default()).expect("adapter");
        let old: Policy<Composed> =
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

#[cfg(not(feature = "wgpu"))]
/// `model` written as a bf16 checkpoint and loaded for generation samples exactly what the
/// same values give in f32: the trainer's model (autodiff, `[in, out]` f32 weights, the same
/// kernels) draws the same tokens with the same log-prob bits, and composed operations within
/// [`LOGPROB_TOLERANCE`]; copying the weights back out gives the bf16 values. Returns the
/// generation model.
fn bf16_copy_samples_as_in_f32(what: &str, model: &Policy<InferBackend>) -> Policy<InferBackend> {
    use burn::backend::Autodiff;
    use rlstream::model::tensors::WeightDtype;
    let tmp = tempfile::tempdir().expect("tmp");
    model
        .save_hf_as(tmp.path(), WeightDtype::Bf16)
        .expect("save bf16");
    let half: Policy<InferBackend> = load_hf(tmp.path(), &Default::default()).expect("load");
    let trainer: Policy<Autodiff<InferBackend>> =
        load_hf(tmp.path(), &Default::default()).expect("load");
    assert_eq!(
        half.to_tensors().expect("tensors"),
        trainer.to_tensors().expect("tensors"),
        "{what}: the weights copied out"
    );
    let (a, b) = (sample(&half), sample(&trainer));
    assert_eq!(assert_same_generation(what, &a, &b), 0.0, "{what}");
    let bits = |c: &Completion| c.logprobs.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(x), bits(y), "{what}: log-prob bits");
    }
    let composed: Policy<Composed> = load_hf(tmp.path(), &Default::default()).expect("load");
    assert_same_generation(what, &a, &sample(&composed));
    half
}

/// A bf16 checkpoint's large linear weights are held for generation in 16 bits and sample
/// exactly as in f32; small ones (every parity fixture's) stay f32, as exactly. An adapter
/// merges onto 16-bit weights and keeps the layout decode streams.
// 16-bit weights in memory are the NdArray backend's decode kernels (not built on wgpu).
#[cfg(not(feature = "wgpu"))]
#[test]
fn a_bf16_checkpoint_generates_from_16_bit_weights_as_in_f32() {
    use burn::tensor::DType;
    use rlstream::model::tensors::WeightDtype;
    use rlstream::model::{Architecture, ModelConfig};
    for name in ["qwen2", "qwen3_moe", "llama"] {
        let model: Policy<InferBackend> =
            load_hf(&fixtures().join("models").join(name), &Default::default()).expect("load");
        let half = bf16_copy_samples_as_in_f32(name, &model);
        let q = half.blocks[0].attn.q.weight.val();
        assert_eq!(q.dtype(), DType::F32, "{name}: a small q_proj stays f32");
    }
    // 512 × 512 attention and 512 × 1024 MLP weights: at the 16-bit threshold and over it.
    let cfg = ModelConfig::new(Architecture::Qwen2, 96, 512, 1024, 2, 8, 2, 64)
        .with_qkv_bias(true)
        .with_max_position(256);
    let model = Policy::<InferBackend>::random(&cfg, 5, &Default::default()).expect("policy");
    let half = bf16_copy_samples_as_in_f32("512 wide", &model);
    let block = &half.blocks[0];
    assert_eq!(
        block.attn.q.weight.val().dtype(),
        DType::U16,
        "q_proj in 16 bits"
    );
    let mlp = block.mlp.as_ref().expect("dense");
    assert_eq!(
        mlp.up.weight.val().dtype(),
        DType::U16,
        "up_proj in 16 bits"
    );
    assert_eq!(
        block.attn.k.weight.val().dtype(),
        DType::F32,
        "k_proj (64k values) f32"
    );
    // An adapter merged onto 16-bit base weights (as a generator applies adapter versions).
    let spec = lora::LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: rlstream::model::layers::Target::ALL.to_vec(),
    };
    let adapter: rlstream::model::tensors::TensorMap = spec
        .expected_tensors(&cfg)
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|j| ((j * 7 + i * 13) % 17) as f32 / 170.0 - 0.05)
                .collect();
            (name, rlstream::model::tensors::HostTensor { shape, data })
        })
        .collect();
    let tmp = tempfile::tempdir().expect("tmp");
    model
        .save_hf_as(tmp.path(), WeightDtype::Bf16)
        .expect("save bf16");
    let new = half.with_adapter(&spec, &adapter).expect("adapter");
    let old = load_hf::<Composed>(tmp.path(), &Default::default())
        .expect("load")
        .with_adapter(&spec, &adapter)
        .expect("adapter");
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

//! The sampler and the trainer's view agree: same weights and sampling settings give the
//! same log-probs bit for bit, a row's results do not depend on its batch (continuous
//! batching, left padding, admission time), weight swaps between passes are tagged, and bad
//! checkpoints get clear errors.

use rlstream::model::hf;
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::sampler::{Completion, Generator, Request};
use rlstream::model::tensors::{self, HostTensor};
use rlstream::model::{
    Architecture, InferBackend, Kernels, ModelConfig, ModelError, Policy, TrainBackend,
};
use rlstream::schema::SamplingParams;
use std::path::PathBuf;

type B = InferBackend;

fn tiny(arch: Architecture) -> Policy<B> {
    Policy::random(&ModelConfig::tiny(arch, 40), 11, &Default::default()).unwrap()
}

fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        max_new_tokens: 12,
        stop_tokens: vec![0],
        seed,
    }
}

fn requests(p: &SamplingParams) -> Vec<Request> {
    [vec![3u32, 4, 5], vec![7, 8, 9, 10, 11, 12, 13], vec![20]]
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            id: i as u64,
            prompt,
            n: 3,
            params: SamplingParams {
                seed: p.seed + i as u64,
                ..p.clone()
            },
        })
        .collect()
}

/// The trainer's view of finished completions: prompt, completion, recorded mask.
fn scored_seqs<'a>(reqs: &'a [Request], done: &'a [Completion]) -> Vec<ScoredSeq<'a>> {
    done.iter()
        .map(|c| ScoredSeq {
            prompt: &reqs[c.request_id as usize].prompt,
            completion: &c.tokens,
            mask: c.mask.as_ref(),
            routing: None,
        })
        .collect()
}

fn trainer_logprobs<BB: Kernels>(
    model: &Policy<BB>,
    reqs: &[Request],
    done: &[Completion],
    t: f32,
) -> Vec<Vec<f32>> {
    let seqs = scored_seqs(reqs, done);
    let (lp, _) = completion_logprobs(model, &seqs, t);
    let cmax = lp.dims()[1];
    let flat: Vec<f32> = lp.into_data().convert::<f32>().into_vec().unwrap();
    done.iter()
        .enumerate()
        .map(|(i, c)| flat[i * cmax..i * cmax + c.tokens.len()].to_vec())
        .collect()
}

/// Tokens whose trainer log-prob is not the sampler's, bit for bit, and the largest gap.
fn mismatch(done: &[Completion], trainer: &[Vec<f32>]) -> (usize, f32) {
    let pairs = || {
        done.iter()
            .zip(trainer)
            .flat_map(|(c, t)| c.logprobs.iter().zip(t))
    };
    let differ = pairs().filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    let gap = pairs().map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    (differ, gap)
}

#[test]
fn trainer_logprobs_equal_sampler_logprobs() {
    for arch in [Architecture::Qwen2, Architecture::Llama] {
        let model = tiny(arch);
        for (t, k, p) in [
            (1.0, 0, 1.0),
            (0.7, 0, 1.0),
            (0.9, 6, 1.0),
            (1.0, 0, 0.8),
            (0.8, 10, 0.9),
        ] {
            let reqs = requests(&params(t, k, p, 5));
            let done = Generator::generate(&model, 0, &reqs).unwrap();
            assert_eq!(done.len(), 9);
            let truncating = k > 0 || p < 1.0;
            assert_eq!(
                done.iter().all(|c| c.mask.is_some()),
                truncating,
                "mask iff truncation"
            );
            let trainer = trainer_logprobs(&model, &reqs, &done, t);
            let (differ, gap) = mismatch(&done, &trainer);
            assert_eq!(differ, 0, "{arch:?} t={t} k={k} p={p}: largest gap {gap}");
        }
    }
}

#[test]
fn trainer_logprobs_have_gradients_on_the_autodiff_backend() {
    let cfg = ModelConfig::tiny(Architecture::Qwen2, 40);
    let infer = Policy::<B>::random(&cfg, 3, &Default::default()).unwrap();
    let train =
        Policy::<TrainBackend>::from_bytes(&cfg, &infer.to_bytes().unwrap(), &Default::default())
            .unwrap();
    let reqs = requests(&params(1.0, 8, 1.0, 9));
    let done = Generator::generate(&infer, 0, &reqs).unwrap();
    // The trainer's backend, with gradients, gives the sampler's bits.
    let trainer = trainer_logprobs(&train, &reqs, &done, 1.0);
    assert_eq!(mismatch(&done, &trainer), (0, 0.0));
    let seqs = scored_seqs(&reqs, &done);
    let (lp, valid) = completion_logprobs(&train, &seqs, 1.0);
    let loss = (lp * valid).sum().neg();
    let grads = loss.backward();
    let g = train
        .embed
        .weight
        .grad(&grads)
        .expect("embedding has a gradient");
    let norm: f32 = g.square().sum().into_scalar();
    assert!(norm.is_finite() && norm > 0.0, "grad norm {norm}");
}

#[test]
fn continuous_batching_does_not_change_results() {
    let model = tiny(Architecture::Llama);
    let reqs = requests(&params(1.0, 0, 1.0, 21));
    let together = Generator::generate(&model, 0, &reqs).unwrap();
    // Admit the requests one at a time, two forward passes apart.
    let mut g = Generator::new();
    let mut staggered = Vec::new();
    for r in &reqs {
        g.admit(&model, 0, r).unwrap();
        for _ in 0..2 {
            staggered.extend(g.step(&model, 0).unwrap());
        }
    }
    while !g.is_idle() {
        staggered.extend(g.step(&model, 0).unwrap());
    }
    staggered.sort_by_key(|c| (c.request_id, c.index));
    assert_eq!(staggered.len(), together.len());
    for (a, b) in together.iter().zip(&staggered) {
        assert_eq!(
            a.tokens, b.tokens,
            "request {} sample {}",
            a.request_id, a.index
        );
        let bits = |c: &Completion| c.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(a),
            bits(b),
            "request {} sample {}",
            a.request_id,
            a.index
        );
    }
    // Samples of one prompt differ (each has its own random stream).
    assert!(
        together
            .windows(2)
            .any(|w| w[0].request_id == w[1].request_id && w[0].tokens != w[1].tokens)
    );
}

/// A row's tokens and log-probs do not depend on its batch-mates, on the left padding its
/// shorter prompt gets among longer ones, or on when it was admitted: the same prompt decoded
/// alone and amid 15 others of other lengths, admitted midway, gives the same bits.
#[test]
fn a_rows_tokens_and_logprobs_do_not_depend_on_its_batch() {
    for arch in [Architecture::Qwen2, Architecture::Llama] {
        let model = tiny(arch);
        let p = SamplingParams {
            max_new_tokens: 10,
            stop_tokens: vec![],
            ..params(0.9, 8, 1.0, 77)
        };
        let ours = Request {
            id: 100,
            prompt: vec![5, 6, 7, 8],
            n: 1,
            params: p.clone(),
        };
        let alone = Generator::generate(&model, 0, std::slice::from_ref(&ours)).unwrap();
        let mut g = Generator::new();
        let mut done = Vec::new();
        for i in 0..15u64 {
            let len = 1 + (i as usize * 5) % 13;
            let other = Request {
                id: i,
                prompt: (0..len)
                    .map(|t| 1 + ((t as u64 * 7 + i) % 39) as u32)
                    .collect(),
                n: 1,
                params: SamplingParams {
                    seed: i,
                    ..p.clone()
                },
            };
            g.admit(&model, 0, &other).unwrap();
            if i == 8 {
                done.extend(g.step(&model, 0).unwrap());
                done.extend(g.step(&model, 0).unwrap());
                g.admit(&model, 0, &ours).unwrap();
            }
        }
        while !g.is_idle() {
            done.extend(g.step(&model, 0).unwrap());
        }
        let amid = done.iter().find(|c| c.request_id == 100).unwrap();
        assert_eq!(done.len(), 16);
        assert_eq!(amid.tokens, alone[0].tokens, "{arch:?}");
        let bits = |c: &Completion| c.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(amid), bits(&alone[0]), "{arch:?}");
    }
}

#[test]
fn a_swap_between_passes_is_tagged_on_later_tokens() {
    let cfg = ModelConfig::tiny(Architecture::Qwen2, 40);
    let old = Policy::<B>::random(&cfg, 1, &Default::default()).unwrap();
    let new = Policy::<B>::random(&cfg, 2, &Default::default()).unwrap();
    let mut p = params(1.0, 0, 1.0, 4);
    p.stop_tokens.clear();
    let req = Request {
        id: 0,
        prompt: vec![5, 6],
        n: 2,
        params: p,
    };
    let mut g = Generator::new();
    g.admit(&old, 3, &req).unwrap();
    for _ in 0..4 {
        assert!(g.step(&old, 3).unwrap().is_empty());
    }
    let mut done = Vec::new();
    while !g.is_idle() {
        done.extend(g.step(&new, 4).unwrap());
    }
    for c in &done {
        assert_eq!(c.tokens.len(), 12);
        let runs: Vec<(u32, u64)> = c.versions.iter().map(|r| (r.start, r.version)).collect();
        assert_eq!(runs, vec![(0, 3), (5, 4)]);
    }
}

#[test]
fn sampling_is_reproducible_from_the_seed() {
    let model = tiny(Architecture::Qwen2);
    let reqs = requests(&params(1.0, 0, 0.95, 77));
    assert_eq!(
        Generator::generate(&model, 0, &reqs).unwrap(),
        Generator::generate(&model, 0, &reqs).unwrap()
    );
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

fn load_err(dir: &std::path::Path) -> String {
    match hf::load_hf::<B>(dir, &Default::default()) {
        Ok(_) => panic!("loaded a broken checkpoint"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_checkpoints_get_clear_errors() {
    let dir = copy_fixture("qwen2");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    assert!(
        load_err(dir.path()).contains("model.safetensors"),
        "{}",
        load_err(dir.path())
    );

    let dir = copy_fixture("llama");
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel"),
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("unsupported model") && e.contains("GPT2LMHeadModel"),
        "{e}"
    );

    let dir = copy_fixture("llama");
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("num_key_value_heads"), "{e}");

    // A tensor of the wrong shape and a missing tensor are named.
    let dir = copy_fixture("llama");
    let mut t = hf::read_hf_tensors(dir.path()).unwrap();
    t.insert(
        "model.layers.1.mlp.up_proj.weight".into(),
        HostTensor {
            shape: vec![3, 3],
            data: vec![0.0; 9],
        },
    );
    std::fs::write(
        dir.path().join("model.safetensors"),
        tensors::tensors_to_safetensors(&t).unwrap(),
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("[3, 3]"),
        "{e}"
    );
    t.remove("model.layers.1.mlp.up_proj.weight");
    std::fs::write(
        dir.path().join("model.safetensors"),
        tensors::tensors_to_safetensors(&t).unwrap(),
    )
    .unwrap();
    assert!(load_err(dir.path()).contains("missing tensor `model.layers.1.mlp.up_proj.weight`"));

    // Corrupt bytes.
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}",
    )
    .unwrap();
    assert!(load_err(dir.path()).contains("bad safetensors data"));
    let e = Policy::<B>::from_bytes(
        &ModelConfig::tiny(Architecture::Qwen2, 40),
        b"garbage",
        &Default::default(),
    );
    assert!(matches!(e, Err(ModelError::Safetensors { .. })));
}

#[test]
fn sharded_checkpoints_load() {
    let dir = copy_fixture("qwen2");
    let tensors = hf::read_hf_tensors(dir.path()).unwrap();
    let (mut a, mut b) = (tensors::TensorMap::new(), tensors::TensorMap::new());
    let mut weight_map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let shard = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        weight_map.insert(name.clone(), shard.into());
        if i % 2 == 0 {
            a.insert(name, t)
        } else {
            b.insert(name, t)
        };
    }
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("model-00001-of-00002.safetensors"),
        tensors::tensors_to_safetensors(&a).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("model-00002-of-00002.safetensors"),
        tensors::tensors_to_safetensors(&b).unwrap(),
    )
    .unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded: Policy<B> = hf::load_hf(dir.path(), &Default::default()).unwrap();
    let single: Policy<B> = hf::load_hf(&fixture("qwen2"), &Default::default()).unwrap();
    assert_eq!(sharded.to_tensors().unwrap(), single.to_tensors().unwrap());
}

//! Parity with `transformers`: the tiny random Qwen2 and Llama checkpoints in
//! `tests/fixtures/models/` (made by `scripts/make_parity_fixtures.py`) must give the
//! reference logits within 1e-4 and the same greedy continuation, through both the
//! full-recompute and the KV-cache paths; saving and reloading must be lossless.

use burn::tensor::{Int, Tensor, TensorData};
use rlstream::model::hf::{self, load_hf};
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::SamplingParams;
use std::path::PathBuf;

type B = InferBackend;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

struct Reference {
    inputs: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
    greedy_prompt: Vec<u32>,
    greedy_continuation: Vec<u32>,
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    fn take<T: serde::de::DeserializeOwned>(v: &serde_json::Value, k: &str) -> T {
        serde_json::from_value(v[k].clone()).unwrap()
    }
    Reference {
        inputs: take(&v, "inputs"),
        logits: take(&v, "logits"),
        greedy_prompt: take(&v, "greedy_prompt"),
        greedy_continuation: take(&v, "greedy_continuation"),
    }
}

fn max_abs_diff(model: &Policy<B>, r: &Reference) -> f32 {
    let (b, l) = (r.inputs.len(), r.inputs[0].len());
    let ids: Vec<i64> = r.inputs.iter().flatten().map(|&t| i64::from(t)).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, l]), &Default::default());
    let got: Vec<f32> = model.forward(tokens).into_data().into_vec().unwrap();
    let want: Vec<f32> = r.logits.iter().flatten().flatten().copied().collect();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn greedy(model: &Policy<B>, r: &Reference) -> Vec<u32> {
    let req = Request {
        id: 0,
        prompt: r.greedy_prompt.clone(),
        n: 1,
        params: SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: r.greedy_continuation.len() as u32,
            stop_tokens: vec![],
            seed: 0,
        },
    };
    Generator::generate(model, 0, &[req])
        .unwrap()
        .remove(0)
        .tokens
}

fn check(name: &str) {
    let device = Default::default();
    let model: Policy<B> = load_hf(&fixture(name), &device).unwrap();
    let r = reference(name);
    let diff = max_abs_diff(&model, &r);
    assert!(diff <= 1e-4, "{name}: max |Δlogit| = {diff}");
    assert_eq!(
        greedy(&model, &r),
        r.greedy_continuation,
        "{name}: greedy continuation"
    );

    // Save in HF format and load back: identical tensors and logits.
    let dir = tempfile::tempdir().unwrap();
    model.save_hf(dir.path()).unwrap();
    let again: Policy<B> = load_hf(dir.path(), &device).unwrap();
    assert_eq!(again.to_tensors().unwrap(), model.to_tensors().unwrap());
    assert_eq!(max_abs_diff(&again, &r), diff);
    // The published-weights path: bytes and back.
    let bytes = model.to_bytes().unwrap();
    let rebuilt = Policy::<B>::from_bytes(model.config(), &bytes, &device).unwrap();
    assert_eq!(rebuilt.to_tensors().unwrap(), model.to_tensors().unwrap());
    assert_eq!(
        hf::checksum(&bytes),
        hf::checksum(&rebuilt.to_bytes().unwrap())
    );
}

#[test]
fn qwen2_matches_transformers() {
    check("qwen2");
}

#[test]
fn llama_matches_transformers() {
    check("llama");
}

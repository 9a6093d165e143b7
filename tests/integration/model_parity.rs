//! Parity with `transformers`: the tiny random Qwen2, Qwen3, Llama and Llama 3 (rotary
//! scaling, inputs past its original context) checkpoints in `tests/fixtures/models/` (made
//! by `scripts/make_parity_fixtures.py`) must give the reference logits within 1e-4 and the
//! same greedy continuation, through both the full-recompute and the KV-cache paths; saving
//! and reloading must be lossless. Configurations rlstream does not run are refused by name.
//!
//! The mixture-of-experts checkpoints (`scripts/make_moe_fixtures.py`: Qwen3-MoE with a
//! dense layer among its sparse ones, Qwen2-MoE with a shared expert) must also choose
//! the experts `transformers` chose for every token of every MoE layer, and read the same
//! from the hub's per-expert tensors and from transformers 5's fused 3-D ones.

use burn::tensor::{Int, Tensor, TensorData};
use rlstream::model::config::ModelConfig;
use rlstream::model::hf::{self, load_hf};
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::moe::Routes;
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::tensors;
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

/// The trainer's teacher-forced log-probs of each input row after its first 3 tokens,
/// against log-softmax of the reference logits: the largest difference.
fn logprob_diff(model: &Policy<B>, r: &Reference) -> f32 {
    let seqs: Vec<ScoredSeq<'_>> = r
        .inputs
        .iter()
        .map(|row| ScoredSeq::plain(&row[..3], &row[3..]))
        .collect();
    let (lp, _) = completion_logprobs(model, &seqs, 1.0);
    let got: Vec<f32> = lp.into_data().into_vec().unwrap();
    let mut worst = 0.0f32;
    for (b, row) in r.inputs.iter().enumerate() {
        for (j, &token) in row[3..].iter().enumerate() {
            // Position 2 + j predicts token 3 + j.
            let logits = &r.logits[b][2 + j];
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + logits.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
            let want = logits[token as usize] - lse;
            worst = worst.max((got[b * (row.len() - 3) + j] - want).abs());
        }
    }
    worst
}

fn check(name: &str) {
    let device = Default::default();
    let model: Policy<B> = load_hf(&fixture(name), &device).unwrap();
    let r = reference(name);
    let diff = max_abs_diff(&model, &r);
    assert!(diff <= 1e-4, "{name}: max |Δlogit| = {diff}");
    let lp = logprob_diff(&model, &r);
    assert!(lp <= 1e-4, "{name}: max |Δ teacher-forced log-prob| = {lp}");
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
        tensors::checksum(&bytes),
        tensors::checksum(&rebuilt.to_bytes().unwrap())
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

#[test]
fn qwen3_matches_transformers() {
    check("qwen3");
    let cfg = ModelConfig::from_hf_json(
        &std::fs::read_to_string(fixture("qwen3").join("config.json")).unwrap(),
    )
    .unwrap();
    // The fixture's head width (16) is not hidden / heads (8), and q, k have their norms.
    assert_eq!((cfg.head_dim, cfg.hidden_size / cfg.num_heads), (16, 8));
    assert!(cfg.qk_norm && !cfg.qkv_bias);
}

/// The MoE checks: parity as for the dense models, each token's experts per MoE layer
/// equal transformers' (recorded by the fixture script), and the fused layout reads as the
/// per-expert one.
fn check_moe(name: &str, experts: usize, shared: bool) {
    check(name);
    let device = Default::default();
    let model: Policy<B> = load_hf(&fixture(name), &device).unwrap();
    let moe = model.config().moe.clone().expect("an MoE config");
    assert_eq!(
        (moe.num_experts, moe.shared_expert_size.is_some()),
        (experts, shared)
    );
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    // The config rlstream writes reads back the same.
    assert_eq!(
        &ModelConfig::from_hf_json(&model.config().to_hf_json()).unwrap(),
        model.config()
    );
    let layers: Vec<usize> = serde_json::from_value(v["moe_layers"].clone()).unwrap();
    assert_eq!(layers, model.config().moe_layers());
    let want: Vec<Vec<Vec<Vec<u16>>>> = serde_json::from_value(v["experts"].clone()).unwrap();
    let r = reference(name);
    let (b, l) = (r.inputs.len(), r.inputs[0].len());
    let ids: Vec<i64> = r.inputs.iter().flatten().map(|&t| i64::from(t)).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, l]), &device);
    let mut routes = Routes::recording();
    model.hidden_routed(tokens, &mut routes);
    let want: Vec<u16> = want.into_iter().flatten().flatten().flatten().collect();
    assert_eq!(
        routes.used, want,
        "{name}: experts chosen per token and layer"
    );

    let fused = hf::read_hf_tensors(&fixture(name).join("fused")).unwrap();
    assert!(
        fused
            .keys()
            .any(|k| k.ends_with("mlp.experts.gate_up_proj"))
    );
    let from_fused: Policy<B> = load_hf(&fixture(name).join("fused"), &device).unwrap();
    assert_eq!(
        from_fused.to_tensors().unwrap(),
        model.to_tensors().unwrap(),
        "{name}: the fused layout reads as the per-expert one"
    );
    // rlstream writes the hub's per-expert layout.
    let dir = tempfile::tempdir().unwrap();
    from_fused.save_hf(dir.path()).unwrap();
    let written = hf::read_hf_tensors(dir.path()).unwrap();
    assert!(written.contains_key("model.layers.0.mlp.experts.0.gate_proj.weight"));
    assert!(!written.keys().any(|k| k.ends_with("gate_up_proj")));
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_moe("qwen3_moe", 8, false);
}

#[test]
fn qwen2_moe_with_a_shared_expert_matches_transformers() {
    check_moe("qwen2_moe", 6, true);
}

#[test]
fn llama3_rope_scaling_matches_transformers_past_the_original_context() {
    let r = reference("llama3");
    assert!(r.inputs[0].len() > 64 && r.greedy_prompt.len() > 64);
    check("llama3");
}

fn config_json(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
        .unwrap()
}

#[test]
fn llama3_scaling_reads_the_same_from_rope_scaling_and_rope_parameters() {
    // transformers 5 writes `rope_parameters` (the fixture); 4.x wrote `rope_scaling` with
    // `rope_theta` beside it, and older files `type` for `rope_type`.
    let v5 = config_json("llama3");
    let mut v4 = v5.clone();
    let params = v4
        .as_object_mut()
        .unwrap()
        .remove("rope_parameters")
        .unwrap();
    let mut scaling = params.clone();
    let theta = scaling
        .as_object_mut()
        .unwrap()
        .remove("rope_theta")
        .unwrap();
    v4["rope_theta"] = theta;
    v4["rope_scaling"] = scaling.clone();
    let mut old = v4.clone();
    let kind = old["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("rope_type")
        .unwrap();
    old["rope_scaling"]["type"] = kind;
    let read = |v: &serde_json::Value| ModelConfig::from_hf_json(&v.to_string()).unwrap();
    let want = read(&v5);
    let r = want.rope_scaling.expect("llama3 scaling is read");
    assert_eq!((r.factor, r.original_max_position), (8.0, 64));
    assert_eq!(want.rope_theta, 10_000.0);
    assert_eq!(read(&v4), want);
    assert_eq!(read(&old), want);
    // And written back in a form transformers reads the same.
    assert_eq!(ModelConfig::from_hf_json(&want.to_hf_json()).unwrap(), want);
}

#[test]
fn configurations_rlstream_does_not_run_are_refused_by_name() {
    let refused = |base: &str, edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let mut v = config_json(base);
        edit(&mut v);
        let e = ModelConfig::from_hf_json(&v.to_string())
            .expect_err(says)
            .to_string();
        assert!(e.contains(says), "{says}: {e}");
    };
    for kind in ["yarn", "dynamic", "linear", "longrope"] {
        refused(
            "llama3",
            &|v| v["rope_parameters"]["rope_type"] = kind.into(),
            &format!("rope_type `{kind}`"),
        );
        refused(
            "llama",
            &|v| v["rope_scaling"] = serde_json::json!({"type": kind, "factor": 2.0}),
            &format!("rope_type `{kind}`"),
        );
    }
    refused(
        "llama3",
        &|v| {
            v["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("low_freq_factor");
        },
        "rope_scaling.low_freq_factor",
    );
    refused(
        "qwen3",
        &|v| v["use_sliding_window"] = true.into(),
        "sliding-window attention",
    );
    refused(
        "qwen3",
        &|v| v["layer_types"][1] = "sliding_attention".into(),
        "layer_types `sliding_attention`",
    );
    refused(
        "qwen3",
        &|v| v["architectures"][0] = "Qwen3MoeForCausalLM".into(),
        "`num_experts` is required for Qwen3MoeForCausalLM",
    );
    refused("qwen3", &|v| v["num_experts"] = 8.into(), "num_experts");
    refused(
        "qwen3_moe",
        &|v| v["num_experts_per_tok"] = 9.into(),
        "`num_experts_per_tok` 9 must be between 1 and num_experts 8",
    );
    refused(
        "qwen3",
        &|v| v["hidden_act"] = "gelu".into(),
        "hidden_act `gelu`",
    );
    refused("llama", &|v| v["mlp_bias"] = true.into(), "mlp_bias");
}

//! The endpoint of `rlstream gen --serve` driven by the real `openai` Python client
//! (`tests/clients/openai_check.py`) against the real binary on Redis: completions and chat
//! completions, whole and streamed, on the built-in task model and on a tiny Qwen3 with the
//! real Qwen3 tokenizer and chat template; every token id, log-prob and version a client
//! received equal to the episode the generator recorded; a weight version published while
//! the generator serves, and the calls after it tagged with it; each refusal with its
//! status and OpenAI error code; more requests than admitted; a client that leaves mid-stream.

use crate::common::{
    bin, free_port, http_get, on_bus, python_json, redis_bus, redis_url, serve_gen, unique_ns,
};
use rlstream::bus::Topology;
use rlstream::model::hf::load_hf;
use rlstream::model::tensors::WeightDtype;
use rlstream::model::{InferBackend, Policy};
use rlstream::weights::{Payload, Publisher, WeightsConfig};
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Runs one phase of the client check; its JSON summary.
fn client(base: &str, model: &str, phase: &str, extra: &[&str]) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_check.py");
    let script = script.to_str().expect("a UTF-8 path");
    let mut args = vec![script, "--base", base, "--model", model, "--phase", phase];
    args.extend_from_slice(extra);
    python_json(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_client_gets_ids_logprobs_and_versions_across_a_weight_swap() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("calc");
    crate::common::warm_start("calc", &model, 10, &[]);
    let key = dir.path().join("key");
    std::fs::write(&key, "s3cret\n").unwrap();
    let ns = unique_ns("serve");
    let log = dir.path().join("gen.log");
    let gen_flags = [
        "--serve-key-file",
        key.to_str().unwrap(),
        "--serve-max-requests",
        "1",
        "--max-batch",
        "16",
    ];
    let serving = serve_gen(&model, &ns, &log, &gen_flags, &[]);
    let (base, metrics) = (&serving.base, &serving.metrics);
    let m = metrics.as_str();

    let before = client(
        base,
        "calc",
        "calls",
        &["--key", "s3cret", "--metrics", m, "--expect-version", "0"],
    );
    assert_eq!(before["calls"], 2, "{before}");
    assert!(
        before["alternatives"]["listed"].as_u64() > Some(6),
        "{before}"
    );

    // A new version, published as the trainer publishes, while the generator serves.
    let policy: Policy<InferBackend> = load_hf(&model, &Default::default()).unwrap();
    let next = Policy::<InferBackend>::random(policy.config(), 11, &Default::default()).unwrap();
    let bus = redis_bus().await;
    let topo = Topology::default().with_namespace(&ns).unwrap();
    let mut publisher = Publisher::new(bus, topo, 2)
        .with_config(&WeightsConfig::default(), WeightDtype::F32)
        .unwrap();
    publisher.adopt().await.unwrap();
    publisher
        .publish_payload(1, 1, Payload::Tensors(next.to_tensors().unwrap()))
        .await
        .unwrap();
    // The follower swaps it into the slot; the next call starts on it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("new weights swapped in")
    {
        assert!(
            Instant::now() < deadline,
            "the generator never swapped version 1 in:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = client(
        base,
        "calc",
        "calls",
        &["--key", "s3cret", "--metrics", m, "--expect-version", "1"],
    );
    assert_eq!(after["versions"], serde_json::json!([1]), "{after}");

    let refusals = client(
        base,
        "calc",
        "refusals",
        &["--key", "s3cret", "--metrics", m, "--context", "128"],
    );
    let expect = [
        ("no_key", serde_json::json!(401)),
        ("models_no_key", serde_json::json!(401)),
        ("wrong_key", serde_json::json!([401, "invalid_api_key"])),
        ("malformed", serde_json::json!([400, "invalid_json"])),
        ("unknown_model", serde_json::json!([404, "model_not_found"])),
        (
            "past_context",
            serde_json::json!([400, "context_length_exceeded"]),
        ),
        (
            "max_tokens_past_context",
            serde_json::json!([400, "context_length_exceeded"]),
        ),
        ("ids_past_vocab", serde_json::json!([400, "invalid_value"])),
        (
            "unsupported",
            serde_json::json!([400, "unsupported_parameter"]),
        ),
        (
            "too_many_alternatives",
            serde_json::json!([400, "invalid_value"]),
        ),
        ("not_trainable", serde_json::json!([400, "not_trainable"])),
        ("no_template", serde_json::json!([400, "invalid_value"])),
        ("bad_n", serde_json::json!([400, "invalid_value"])),
        ("unknown_route", serde_json::json!([404, "not_found"])),
    ];
    for (case, status) in expect {
        assert_eq!(refusals[case], status, "{case}: {refusals}");
    }
    let load = client(
        base,
        "calc",
        "load",
        &["--key", "s3cret", "--metrics", m, "--context", "128"],
    );
    assert!(load["too_many"].as_u64().unwrap() >= 1, "{load}");
    // No refused request reached the decoder: the generator decoded only the calls served.
    let scrape = crate::common::scrape(metrics);
    assert_eq!(
        crate::common::metric(&scrape, "rlstream_serve_rows"),
        0.0,
        "{scrape}"
    );
    assert!(
        crate::common::metric(&scrape, "rlstream_serve_recorded_calls_total") >= 4.0,
        "{scrape}"
    );
}

#[test]
fn a_chat_model_with_a_bpe_tokenizer_serves_chat_whole_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&model);
    let ns = unique_ns("serve-chat");
    let log = dir.path().join("gen.log");
    let serving = serve_gen(&model, &ns, &log, &["--serve-max-requests", "1"], &[]);
    let (base, metrics) = (&serving.base, &serving.metrics);
    let (status, models) = http_get(&serving.addr, "/v1/models");
    assert_eq!(status, 200, "{models}");
    let chat = client(base, "qwen3", "chat", &[]);
    assert!(chat["alternatives"]["tokens"].as_u64() >= Some(1), "{chat}");
    // The prompt is the model's chat template rendered (with its kwargs) and tokenized.
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let template = rlstream::model::chat::ChatTemplate::load(&model)
        .unwrap()
        .unwrap();
    let tokenizer = rlstream::model::tokenizer::Tokenizer::load(&model).unwrap();
    let messages = [
        serde_json::json!({"role": "system", "content": "You add numbers."}),
        serde_json::json!({"role": "user", "content": "What is 2+2? Answer in one word."}),
    ];
    let mut no_thinking = serde_json::Map::new();
    no_thinking.insert("enable_thinking".into(), Value::Bool(false));
    for (kwargs, prompt) in [
        (serde_json::Map::new(), &chat["prompt"]),
        (no_thinking, &chat["chat_prompt_no_thinking"]),
    ] {
        let text = template.render(&messages, true, &kwargs).unwrap();
        assert_eq!(tokenizer.encode(&text).unwrap(), ids(prompt), "{text}");
    }
    let load = client(
        base,
        "qwen3",
        "load",
        &["--metrics", metrics, "--context", "512"],
    );
    assert!(load["too_many"].as_u64().unwrap() >= 1, "{load}");
}

#[test]
fn an_endpoint_beyond_loopback_needs_a_bearer_key() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("calc");
    crate::common::warm_start("calc", &model, 2, &[]);
    let ns = unique_ns("serve-open");
    let out = bin()
        .args(on_bus(
            &[
                "gen",
                "--model",
                model.to_str().unwrap(),
                "--serve",
                &format!("0.0.0.0:{}", free_port()),
            ],
            &redis_url(),
            &ns,
        ))
        .env_remove("RLSTREAM_SERVE_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("binds beyond loopback") && err.contains("--serve-key-file"),
        "{err}"
    );
}

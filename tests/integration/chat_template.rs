//! The real Qwen3 and Llama 3.1 chat templates and tokenizers (committed verbatim with their
//! sources, see `scripts/make_chat_fixtures.py`): rlstream renders each reference
//! conversation to the same text as `transformers`' `apply_chat_template`, and encodes it to
//! the same token ids.

use rlstream::model::chat::ChatTemplate;
use rlstream::model::tokenizer::Tokenizer;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers")
}

#[test]
fn real_chat_templates_render_and_encode_as_transformers_does() {
    let text = std::fs::read_to_string(fixtures().join("chat_reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    let mut loaded: BTreeMap<String, (ChatTemplate, Tokenizer)> = BTreeMap::new();
    let mut seen = BTreeMap::<(String, String), usize>::new();
    for (i, case) in cases.iter().enumerate() {
        let name = case["tokenizer"].as_str().unwrap().to_string();
        let (template, tokenizer) = loaded.entry(name.clone()).or_insert_with(|| {
            let dir = fixtures().join(&name);
            // A directory saved again by transformers keeps the template, not the
            // vocabulary it shares with the fixture it came from.
            let vocab = fixtures().join(name.strip_suffix("_saved").unwrap_or(&name));
            (
                ChatTemplate::load(&dir).unwrap().expect("a chat template"),
                Tokenizer::load(&vocab).unwrap(),
            )
        });
        let messages = case["messages"].as_array().unwrap();
        let kwargs = case["kwargs"].as_object().unwrap();
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(messages, generation, kwargs).unwrap();
        assert_eq!(
            rendered, case["text"],
            "case {i} ({name}, kwargs {kwargs:?}, generation prompt {generation})"
        );
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(
            tokenizer.encode(&rendered).unwrap(),
            ids,
            "case {i} ({name}) ids"
        );
        *seen
            .entry((name, serde_json::to_string(kwargs).unwrap()))
            .or_default() += 1;
    }
    // Both templates, and Qwen3's enable_thinking both ways, were exercised.
    let keys: Vec<String> = seen.keys().map(|(n, k)| format!("{n} {k}")).collect();
    for want in [
        "llama3_1 {}",
        "qwen3 {}",
        "qwen3 {\"enable_thinking\":false}",
        "qwen3 {\"enable_thinking\":true}",
        "qwen3_saved {}",
    ] {
        assert!(
            keys.iter().any(|k| k == want),
            "{want} missing from {keys:?}"
        );
    }
    let thinking_off = cases
        .iter()
        .find(|c| c["kwargs"]["enable_thinking"] == false && c["add_generation_prompt"] == true)
        .unwrap();
    assert!(
        thinking_off["text"]
            .as_str()
            .unwrap()
            .ends_with("<think>\n\n</think>\n\n")
    );
}

#[test]
fn committed_tokenizer_files_match_their_recorded_sources() {
    for name in ["qwen3", "llama3_1"] {
        let dir = fixtures().join(name);
        let source: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("SOURCE.json")).unwrap())
                .unwrap();
        for (file, digest) in source["files"].as_object().unwrap() {
            let bytes = std::fs::read(dir.join(file)).unwrap();
            let got = sha256_hex(&bytes);
            assert_eq!(&got, digest, "{name}/{file} changed since it was fetched");
        }
        assert!(
            source["upstream_licence"]
                .as_str()
                .is_some_and(|l| !l.is_empty())
        );
    }
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn generate_renders_a_chat_with_the_model_template_and_stops_at_its_end_of_turn() {
    // A tiny random Qwen3 with the real Qwen3 tokenizer and generation config.
    let dir = tempfile::tempdir().unwrap();
    let cfg = crate::common::tiny_qwen3(dir.path());
    let stops = rlstream::model::hf::stop_tokens(dir.path(), &cfg);
    assert_eq!(stops, [151_645, 151_643]);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rlstream"))
        .args(["generate", "--model", dir.path().to_str().unwrap()])
        .args(["--chat", "What is 2+2?", "--enable-thinking", "false"])
        .args(["--max-new-tokens", "4", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_str(stdout.trim()).unwrap();
    // The same ids as transformers' apply_chat_template for that conversation.
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("chat_reference.json")).unwrap(),
    )
    .unwrap();
    let want = reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["tokenizer"] == "qwen3"
                && c["kwargs"]["enable_thinking"] == false
                && c["messages"].as_array().unwrap().len() == 1
                && c["messages"][0]["content"] == "What is 2+2?"
        })
        .unwrap();
    assert_eq!(doc["prompt_ids"], want["ids"]);
    assert!(doc["completions"][0]["ids"].as_array().unwrap().len() <= 4);

    // A model without a chat template is told to use --prompt.
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rlstream"))
        .args([
            "generate",
            "--model",
            dir.path().to_str().unwrap(),
            "--chat",
            "hi",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no chat template"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A tokenizer saved by transformers 5's own `save_pretrained` keeps its template in
/// `chat_template.jinja` and none in `tokenizer_config.json`: rlstream reads it from there
/// (and renders it as transformers does: the `qwen3_saved` cases above).
#[test]
fn a_template_saved_to_chat_template_jinja_is_read_from_there() {
    let dir = fixtures().join("qwen3_saved");
    assert!(dir.join("chat_template.jinja").exists());
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert!(config.get("chat_template").is_none(), "{config}");
    assert!(ChatTemplate::load(&dir).unwrap().is_some());
}

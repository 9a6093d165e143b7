//! `rlstream generate` as a user runs it: the real binary on the fixture checkpoints.

use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn rlstream(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rlstream"))
        .args(args)
        .output()
        .expect("run rlstream")
}

#[test]
fn greedy_json_output_matches_the_transformers_reference() {
    let dir = fixture("llama");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt: Vec<u64> = serde_json::from_value(reference["greedy_prompt"].clone()).unwrap();
    let want: Vec<u64> = serde_json::from_value(reference["greedy_continuation"].clone()).unwrap();
    let ids = prompt
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let out = rlstream(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got: Vec<u64> = serde_json::from_value(v["completions"][0]["ids"].clone()).unwrap();
    // The checkpoint's eos (0) stops generation; transformers ran on without a stop.
    let stop = want
        .iter()
        .position(|&t| t == 0)
        .map_or(want.len(), |i| i + 1);
    assert_eq!(got, want[..stop]);
    assert_eq!(v["completions"][0]["finish"], "stop");
    let logprobs: Vec<f32> =
        serde_json::from_value(v["completions"][0]["logprobs"].clone()).unwrap();
    assert_eq!(logprobs.len(), got.len());
}

#[test]
fn text_prompt_goes_through_the_tokenizer_and_sampling_is_seeded() {
    let dir = fixture("qwen2");
    let args = [
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "12+30=",
        "--top-k",
        "5",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--n",
        "3",
        "--json",
    ];
    let (a, b) = (rlstream(&args), rlstream(&args));
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout, "same seed, same output");
    let v: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!([3, 4, 12, 5, 2, 14]));
    let completions = v["completions"].as_array().unwrap();
    assert_eq!(completions.len(), 3);
    for c in completions {
        let lp: Vec<f32> = serde_json::from_value(c["logprobs"].clone()).unwrap();
        assert!(lp.iter().all(|&l| l <= 0.0 && l.is_finite()));
        assert!(c["text"].is_string());
    }
}

#[test]
fn bad_invocations_fail_with_a_clear_message() {
    let dir = fixture("qwen2");
    let d = dir.to_str().unwrap();
    for (args, expect) in [
        (
            vec!["generate", "--model", d],
            "give --prompt TEXT, --chat TEXT or --prompt-ids",
        ),
        (
            vec!["generate", "--model", d, "--prompt-ids", "1,999"],
            "outside the vocabulary of 64",
        ),
        (
            vec![
                "generate",
                "--model",
                d,
                "--prompt-ids",
                "1",
                "--top-p",
                "0",
            ],
            "--top-p 0 must be in (0, 1]",
        ),
        (
            vec!["generate", "--model", "/nonexistent", "--prompt-ids", "1"],
            "no model at /nonexistent: the directory does not exist",
        ),
    ] {
        let out = rlstream(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

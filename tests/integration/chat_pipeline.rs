//! A real chat model's shape through the pipeline: a tiny random Qwen3 with the real Qwen3
//! tokenizer and chat template, the shipped chat dataset (`examples/math_chat.jsonl`, math
//! verifier), `feed` → `gen` → `score` → `train` as processes of the real binary on Redis.
//! The prompts are rendered with the template, the trainer steps and publishes, the
//! generator swaps to the new weights, and the scorer uses the math verifier.

use crate::common::{interrupt, messages, run_ok, spawn};
use rlstream::schema::{Event, Prompt, RolloutGroup, ScoredGroup};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const IM_START: u32 = 151_644;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_chat_dataset_runs_through_feed_gen_score_and_train() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&model);
    let m = model.to_str().unwrap();
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/math_chat.jsonl");
    let ns = crate::common::unique_ns("chat");
    let url = crate::common::redis_url();
    let args = |extra: &[&str]| crate::common::on_bus(extra, &url, &ns);
    let log = |n: &str| dir.path().join(format!("{n}.log"));

    // Without the template's model, chat rows are refused with what to give.
    let refused = crate::common::bin()
        .args(args(&["feed", "--dataset", data.to_str().unwrap()]))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("give --chat-template DIR"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let fed = run_ok(
        &args(&[
            "feed",
            "--dataset",
            data.to_str().unwrap(),
            "--chat-template",
            m,
            "--epochs",
            "6",
        ])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    assert!(fed.starts_with("fed 72 prompts"), "{fed}");

    let ckpt = dir.path().join("ckpt");
    let generator = spawn(
        &args(&[
            "gen",
            "--model",
            m,
            "--group-size",
            "4",
            "--max-new-tokens",
            "6",
            "--max-batch",
            "32",
            "--name",
            "gen-0",
        ]),
        &log("gen"),
    );
    let score = spawn(
        &args(&["score", "--name", "score-0", "--tokenizer", m]),
        &log("score"),
    );
    let train = spawn(
        &args(&[
            "train",
            "--model",
            m,
            "--groups-per-step",
            "4",
            "--lr",
            "1e-3",
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ]),
        &log("train"),
    );

    let bus = crate::common::redis_bus().await;
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut steps = Vec::new();
    let mut swapped = false;
    while Instant::now() < deadline && !(steps.len() >= 4 && swapped) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        steps = messages::<Event>(&bus, &format!("{ns}:events"))
            .await
            .into_iter()
            .filter(|e| e.kind == "step")
            .collect();
        swapped = messages::<RolloutGroup>(&bus, &format!("{ns}:rollouts"))
            .await
            .iter()
            .flat_map(|g| &g.samples)
            .any(|s| s.versions.iter().any(|v| v.version > 0));
    }
    interrupt(train, "train", &log("train"));
    interrupt(generator, "gen", &log("gen"));
    interrupt(score, "score", &log("score"));
    let tail = |n: &str| {
        let text = std::fs::read_to_string(log(n)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    };
    assert!(
        steps.len() >= 4,
        "{} steps\ntrain:\n{}\ngen:\n{}\nscore:\n{}",
        steps.len(),
        tail("train"),
        tail("gen"),
        tail("score")
    );
    assert!(
        swapped,
        "no token was sampled with trained weights:\n{}",
        std::fs::read_to_string(log("gen")).unwrap_or_default()
    );

    // Prompts are the template's rendering, the generator tokenised them with the real
    // tokenizer, and the scorer scored with the math verifier.
    let prompts = messages::<Prompt>(&bus, &format!("{ns}:prompts")).await;
    let first = &prompts[0];
    assert!(
        first
            .text
            .starts_with("<|im_start|>system\nYou are a careful math tutor.")
            && first.text.ends_with("<|im_start|>assistant\n"),
        "{:?}",
        first.text
    );
    assert!(
        prompts
            .iter()
            .any(|p| p.text.ends_with("<think>\n\n</think>\n\n"))
    );
    let rollouts = messages::<RolloutGroup>(&bus, &format!("{ns}:rollouts")).await;
    assert_eq!(rollouts[0].prompt_tokens.as_slice()[0], IM_START);
    let scored = messages::<ScoredGroup>(&bus, &format!("{ns}:scored")).await;
    assert!(!scored.is_empty());
    for g in &scored {
        assert_eq!(g.rollout.task, "math_chat");
        assert_eq!(
            g.rollout.meta.get("verifier").map(String::as_str),
            Some("math")
        );
        assert!(
            g.rewards.iter().all(|r| *r == 0.0 || *r == 1.0),
            "{:?}",
            g.rewards
        );
    }
    crate::common::drop_namespace(&ns).await;
}

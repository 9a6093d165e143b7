//! Reproducibility and held-out evaluation, through the real binary: two `--sync` runs with
//! one seed on the embedded bus end with the same checkpoint bytes (weights and optimizer
//! state) and the same held-out results; `rlstream eval` reports pass@1 and greedy results
//! with intervals, the same ones twice, and refuses what it cannot evaluate.

use crate::common::run_ok;
use serde_json::Value;
use std::path::Path;

/// A short `--sync` run: 3 steps (3 publishes, the generator swaps to each), a small
/// held-out evaluation before, halfway and after.
fn sync_run(out: &Path, seed: &str) -> Value {
    run_ok(&[
        "run",
        "--task",
        "sort",
        "--sync",
        "--seed",
        seed,
        "--sft-steps",
        "20",
        "--steps",
        "3",
        "--checkpoint-every",
        "2",
        "--eval-prompts",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(out.join("report/summary.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The trainer state with the bus-assigned entry ids taken out of the group ids: the ids say
/// which entries were trained, and the bus numbers entries by its clock.
fn state_without_entry_ids(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("state.json")).unwrap();
    text.lines()
        .map(|l| match l.find('@') {
            Some(i) => format!("{}\"", &l[..i]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Held-out points without their timing.
fn held_out(summary: &Value) -> Vec<Value> {
    summary["held_out"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let mut p = p.clone();
            let fields = p.as_object_mut().unwrap();
            // Wall-clock times: how long it took, and when its step finished.
            fields.remove("seconds");
            fields.remove("time_s");
            p
        })
        .collect()
}

#[test]
fn two_sync_runs_with_one_seed_write_identical_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    let (sa, sb) = (sync_run(&a, "11"), sync_run(&b, "11"));
    sync_run(&c, "12");
    assert_eq!(sa["steps"], 3);
    assert!(sa["swaps"].as_u64().unwrap() >= 2, "{}", sa["swaps"]);
    let files = [
        "model.safetensors",
        "trainer_model.mpk",
        "trainer_optim.mpk",
    ];
    for step in ["step-00000002", "step-00000003"] {
        let (ca, cb, cc) = (
            a.join("checkpoints").join(step),
            b.join("checkpoints").join(step),
            c.join("checkpoints").join(step),
        );
        for f in files {
            let (x, y) = (
                std::fs::read(ca.join(f)).unwrap(),
                std::fs::read(cb.join(f)).unwrap(),
            );
            assert!(!x.is_empty());
            assert!(x == y, "{step}/{f} differs between two runs with seed 11");
            // Another seed samples other completions, so it trains to other weights: the
            // comparison above can fail.
            if f == "model.safetensors" {
                assert!(
                    x != std::fs::read(cc.join(f)).unwrap(),
                    "{step}/{f}: seeds 11 and 12"
                );
            }
        }
        assert_eq!(state_without_entry_ids(&ca), state_without_entry_ids(&cb));
    }
    // Before, halfway (step 2) and after: the same held-out results, sample for sample.
    let (ha, hb) = (held_out(&sa), held_out(&sb));
    assert_eq!(
        ha.iter()
            .map(|p| p["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 2, 3]
    );
    assert_eq!(ha, hb);
    let svg = std::fs::read_to_string(a.join("report/learning_curve.svg")).unwrap();
    // Two estimates per held-out point, on each of the two panels.
    assert_eq!(svg.matches("<circle").count(), 2 * 3 * 2, "{svg}");
}

#[test]
fn eval_reports_intervals_and_repeats_itself() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("sft");
    crate::common::warm_start("sort", &model, 30, &[]);
    let eval = |json: &Path| -> Value {
        let stdout = run_ok(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--task",
            "sort",
            "--prompts",
            "200",
            "--samples",
            "3",
            "--batch",
            "128",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(stdout.contains("eval sort: pass@1 "), "{stdout}");
        assert!(stdout.contains("greedy accuracy"), "{stdout}");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("seconds");
        v
    };
    let first = eval(&dir.path().join("a.json"));
    assert_eq!(first, eval(&dir.path().join("b.json")));
    assert_eq!(first["prompts"], 200);
    assert_eq!(first["samples"], 3);
    for key in ["pass_at_1", "reward", "greedy_accuracy", "greedy_reward"] {
        let e = &first[key];
        let (mean, lo, hi) = (
            e["mean"].as_f64().unwrap(),
            e["lo"].as_f64().unwrap(),
            e["hi"].as_f64().unwrap(),
        );
        assert!((0.0..=1.0).contains(&mean), "{key}: {e}");
        assert!(lo <= mean && mean <= hi, "{key}: {e}");
        assert_eq!(e["n"], 200, "{key}");
    }
    // A warm start of 30 steps has learned part of the answer: partial credit.
    assert!(first["reward"]["mean"].as_f64().unwrap() > 0.05, "{first}");

    // The control of the README's table: the same model given more supervised training.
    let more = dir.path().join("more");
    crate::common::warm_start("sort", &more, 30, &["--init", model.to_str().unwrap()]);
    let json = dir.path().join("more.json");
    run_ok(&[
        "eval",
        "--model",
        more.to_str().unwrap(),
        "--task",
        "sort",
        "--prompts",
        "200",
        "--json",
        json.to_str().unwrap(),
    ]);
    let continued: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(
        continued["reward"]["mean"].as_f64().unwrap() > first["reward"]["mean"].as_f64().unwrap(),
        "30 more steps from the model: {continued} against {first}"
    );

    // What it cannot evaluate is refused with a message that says what to do.
    let refused = |args: &[&str], says: &str| {
        let out = crate::common::bin().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    };
    let m = model.to_str().unwrap();
    refused(&["eval", "--task", "sort"], "give --model DIR");
    refused(&["eval", "--model", m], "give --task");
    refused(
        &["eval", "--model", m, "--task", "sort", "--samples", "0"],
        "at least 1",
    );
    let missing = dir.path().join("nothing");
    refused(
        &[
            "eval",
            "--model",
            missing.to_str().unwrap(),
            "--task",
            "sort",
        ],
        "nothing",
    );
    let data = dir.path().join("noanswer.jsonl");
    std::fs::write(&data, "{\"prompt\": \"sort:321=\"}\n").unwrap();
    refused(
        &["eval", "--model", m, "--dataset", data.to_str().unwrap()],
        "missing `answer`",
    );

    // A dataset is evaluated item by item with the model's own tokenizer.
    let data = dir.path().join("digits.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"sort:321=\", \"answer\": \"123\", \"verifier\": \"positional\"}\n\
         {\"prompt\": \"sort:90=\", \"answer\": \"09\"}\n",
    )
    .unwrap();
    let stdout = run_ok(&["eval", "--model", m, "--dataset", data.to_str().unwrap()]);
    assert!(stdout.contains("eval digits: pass@1"), "{stdout}");
    assert!(stdout.contains("2 prompts × 4 samples"), "{stdout}");
}

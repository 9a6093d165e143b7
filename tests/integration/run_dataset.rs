//! `rlstream run --model DIR --dataset FILE` on the embedded bus: a tiny random Qwen3 with
//! the real Qwen3 tokenizer and chat template learns from a file of chat rows. The rows a
//! hash of their conversation holds out are never fed and are what the run evaluates
//! before, halfway and after; every other row is fed, rendered with the model's template;
//! a run that cannot split its file, or has no model for it, stops with what to give.

use rlstream::bus::{MemoryBus, RangeBound, SharedBus};
use rlstream::commands::run::{self, DatasetSource, RunOptions, RunPrompts};
use rlstream::commands::sft::SftOptions;
use rlstream::config::Config;
use rlstream::display::DisplayMode;
use rlstream::schema::{self, Prompt};
use rlstream::tasks::{Columns, Dataset, held_out_share};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

const SHARE: f64 = 0.25;

/// 40 chat rows asking for sums, answered by the math verifier.
fn write_sums(path: &Path) {
    let rows: String = (0..40)
        .map(|i| {
            let (a, b) = (i % 9 + 1, i / 9 + 2);
            let row = serde_json::json!({
                "messages": [
                    {"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": format!("What is {a} + {b}?")},
                ],
                "answer": (a + b).to_string(),
                "verifier": "math",
            });
            format!("{row}\n")
        })
        .collect();
    std::fs::write(path, rows).unwrap();
}

fn options(dir: &Path, model: Option<&Path>, data: &Path, share: f64) -> RunOptions {
    RunOptions {
        prompts: RunPrompts::Dataset(DatasetSource {
            path: data.to_path_buf(),
            columns: Columns::default(),
            eval: None,
            held_out_share: share,
        }),
        model: model.map(Path::to_path_buf),
        sft: SftOptions::default(),
        out: dir.join(format!("run-{share}")),
        report: None,
        sync: true,
        seed: 0,
        display: DisplayMode::Quiet,
    }
}

fn config() -> Config {
    let mut cfg = Config::resolve(
        run::dataset_defaults_layer(),
        None,
        std::iter::empty(),
        toml::Table::new(),
    )
    .unwrap();
    cfg.train.steps = 2;
    cfg.train.checkpoint_every = 1;
    cfg.policy.groups_per_step = 2;
    cfg.generator.group_size = 2;
    cfg.generator.max_new_tokens = 4;
    cfg.run.eval_samples = 1;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_run_feeds_its_training_rows_and_evaluates_the_held_out_ones() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&model);
    let data = dir.path().join("sums.jsonl");
    write_sums(&data);
    let rows = Dataset::load(&data).unwrap();
    let held: BTreeSet<usize> = rows
        .items
        .iter()
        .filter(|it| held_out_share(&it.split_key(), SHARE))
        .map(|it| it.line)
        .collect();
    assert!(
        (4..=16).contains(&held.len()),
        "{} of 40 held out",
        held.len()
    );

    let bus: SharedBus = Arc::new(MemoryBus::new());
    let opts = options(dir.path(), Some(&model), &data, SHARE);
    let outcome = crate::common::run_alone(&opts, config(), bus.clone()).await;
    let s = &outcome.summary;
    assert_eq!(
        (s.task.as_str(), s.steps, s.mode.as_str()),
        ("sums", 2, "sync")
    );
    let points: Vec<(u64, usize, &str)> = s
        .held_out
        .iter()
        .map(|h| (h.step, h.eval.prompts, h.eval.task.as_str()))
        .collect();
    let n = held.len();
    assert_eq!(points, [(0, n, "sums"), (1, n, "sums"), (2, n, "sums")]);
    assert!(s.pass_at_1_gain.is_some());

    let topo = rlstream::bus::Topology::default();
    let stream = topo.key(rlstream::roles::Stream::Prompts);
    let entries = bus
        .range(&stream, RangeBound::Open, RangeBound::Open, 10_000)
        .await
        .unwrap();
    assert!(entries.len() >= 4, "{} prompts fed", entries.len());
    for e in &entries {
        let p: Prompt = schema::decode(&e.payload).unwrap();
        let line: usize = p
            .prompt_id
            .strip_prefix("sums-e0-l")
            .unwrap()
            .parse()
            .unwrap();
        assert!(!held.contains(&line), "held-out line {line} was fed");
        assert_eq!(p.task, "sums");
        assert!(
            p.prompt_tokens.is_none(),
            "the generator tokenises dataset rows"
        );
        assert!(
            p.text
                .starts_with("<|im_start|>system\nAnswer with a number.")
        );
        assert!(p.text.ends_with("<|im_start|>assistant\n"), "{:?}", p.text);
        assert_eq!(p.meta["verifier"], "math");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_run_without_a_model_or_a_held_out_row_says_what_to_give() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&model);
    let data = dir.path().join("sums.jsonl");
    write_sums(&data);
    let run = |opts: RunOptions| async move {
        let bus: SharedBus = Arc::new(MemoryBus::new());
        run::run(
            &opts,
            config(),
            bus,
            rlstream::bus::Topology::default(),
            Box::new(rlstream::collective::Solo::default()),
            std::future::pending(),
        )
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };
    let e = run(options(dir.path(), None, &data, SHARE)).await;
    assert!(e.contains("sums.jsonl needs --model DIR"), "{e}");
    let e = run(options(dir.path(), Some(&model), &data, 0.0)).await;
    assert!(
        e.contains("no row of") && e.contains("give --eval-dataset FILE"),
        "{e}"
    );
}

//! `rlstream run`: the whole pipeline in one process learns; `--sync` and async produce the
//! same messages and trainer metrics; the report files are written and well-formed; the
//! real binary runs it on the embedded bus and on Redis.

use rlstream::bus::{MemoryBus, RangeBound, SharedBus};
use rlstream::commands::run::{self, RunOptions, RunOutcome};
use rlstream::commands::sft::{self, SftOptions};
use rlstream::display::DisplayMode;
use rlstream::report::StepRow;
use rlstream::schema::{self, Event, RolloutGroup, ScoredGroup, json::msgpack_to_json};
use rlstream::tasks::BuiltinTask;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const TASK: BuiltinTask = BuiltinTask::Sort;

fn warm_start(dir: &Path) -> PathBuf {
    let out = dir.join("sft");
    let opts = SftOptions {
        task: TASK,
        out: out.clone(),
        steps: 100,
        ..SftOptions::default()
    };
    sft::run(&opts, |_, _| {}).unwrap();
    out
}

async fn run_mode(dir: &Path, model: &Path, sync: bool, steps: u64, bus: SharedBus) -> RunOutcome {
    let mut cfg = run::defaults(TASK);
    cfg.train.steps = steps;
    let opts = RunOptions {
        prompts: run::RunPrompts::Task(TASK),
        model: Some(model.to_path_buf()),
        sft: SftOptions::default(),
        out: dir.join(if sync { "sync" } else { "async" }),
        report: None,
        sync,
        seed: 0,
        display: DisplayMode::Quiet,
    };
    crate::common::run_alone(&opts, cfg, bus).await
}

/// Top-level keys of every message on `stream`, after checking each decodes as `M`.
async fn keys_of<M: schema::Message>(bus: &SharedBus, stream: &str) -> (usize, BTreeSet<String>) {
    let entries = bus
        .range(stream, RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .unwrap();
    let mut keys = BTreeSet::new();
    for e in &entries {
        schema::decode::<M>(&e.payload).unwrap();
        let json = msgpack_to_json(&e.payload).unwrap();
        keys.extend(json.as_object().unwrap().keys().cloned());
    }
    (entries.len(), keys)
}

/// Field names of the trainer's step events; every stage also wrote heartbeats, and the
/// scorer its outcomes.
async fn step_fields(bus: &SharedBus) -> BTreeSet<String> {
    let entries = bus
        .range("rl:events", RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .unwrap();
    let mut fields = BTreeSet::new();
    let mut beating = BTreeSet::new();
    let mut outcomes = 0;
    for e in &entries {
        let ev: Event = schema::decode(&e.payload).unwrap();
        match ev.kind.as_str() {
            "step" => fields.extend(ev.fields.keys().cloned()),
            "heartbeat" => {
                beating.insert(ev.stage);
            }
            Event::OUTCOMES => outcomes += ev.outcomes.len(),
            other => panic!("unexpected event kind {other}"),
        }
    }
    assert!(outcomes > 0, "the scorer's outcomes");
    assert_eq!(
        beating,
        BTreeSet::from(["gen".to_string(), "score".into(), "train".into()])
    );
    fields
}

fn check_report(o: &RunOutcome, steps: u64) {
    let jsonl = std::fs::read_to_string(&o.report.as_ref().expect("report").jsonl).unwrap();
    let rows: Vec<StepRow> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len() as u64, steps);
    for (r, m) in rows.iter().zip(&o.rows) {
        let (r, m) = (&r.record, &m.record);
        assert_eq!((r.step, r.version, r.tokens), (m.step, m.version, m.tokens));
        assert!((r.reward_mean - m.reward_mean).abs() < 1e-12);
    }
    assert!(rows.windows(2).all(|w| w[0].run.time_s <= w[1].run.time_s));
    let csv = std::fs::read_to_string(&o.report.as_ref().expect("report").csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len() as u64, steps + 1);
    let width = lines[0].split(',').count();
    assert!(lines[0].starts_with("step,time_s,"), "{}", lines[0]);
    assert!(lines.iter().all(|l| l.split(',').count() == width));
    let svg = std::fs::read_to_string(&o.report.as_ref().expect("report").svg).unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    // Two panels × (reward, accuracy) × (raw, smoothed), each with one point per step.
    let polylines: Vec<&str> = svg.split("<polyline points=\"").skip(1).collect();
    assert_eq!(polylines.len(), 8);
    for p in polylines {
        let points = p.split('"').next().unwrap().split(' ').count();
        assert_eq!(points as u64, steps);
    }
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&o.report.as_ref().expect("report").summary).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["steps"], steps);
    assert_eq!(summary["mode"], o.summary.mode);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_learns_and_sync_speaks_the_same_schema() {
    let dir = tempfile::tempdir().unwrap();
    let model = warm_start(dir.path());

    let async_bus: SharedBus = Arc::new(MemoryBus::new());
    let a = run_mode(dir.path(), &model, false, 80, async_bus.clone()).await;
    let s = &a.summary;
    assert_eq!(
        (s.mode.as_str(), s.steps, s.trained_groups),
        ("async", 80, 640)
    );
    assert!(
        s.reward_end > s.reward_start + 0.03,
        "reward did not improve: {:.3} -> {:.3}",
        s.reward_start,
        s.reward_end
    );
    // The generator followed the trainer while decoding. Versions that pass while it is
    // idle at its in-flight bound are skipped (it loads only the newest), so the count
    // depends on timing: one run that shared the CPU with other tests swapped 38 times.
    assert!(s.swaps >= 20, "{} swaps", s.swaps);
    assert!(s.staleness.keys().all(|&k| k <= 4), "{:?}", s.staleness);
    check_report(&a, 80);

    let sync_bus: SharedBus = Arc::new(MemoryBus::new());
    let b = run_mode(dir.path(), &model, true, 12, sync_bus.clone()).await;
    assert_eq!((b.summary.mode.as_str(), b.summary.steps), ("sync", 12));
    // No overlap: every group was generated by the version it was trained on.
    assert_eq!(
        b.summary.staleness.keys().copied().collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!(b.summary.staleness[&0], 12 * 8);
    // ...and the trainer's log-probs are the sampler's, bit for bit.
    for row in &b.rows {
        let r = &row.record;
        assert_eq!((r.logprob_gap, r.ratio_max), (0.0, 1.0), "step {}", r.step);
    }
    check_report(&b, 12);

    for (stream, what) in [("rl:rollouts", "rollouts"), ("rl:scored", "scored")] {
        let (na, ka) = if what == "rollouts" {
            keys_of::<RolloutGroup>(&async_bus, stream).await
        } else {
            keys_of::<ScoredGroup>(&async_bus, stream).await
        };
        let (nb, kb) = if what == "rollouts" {
            keys_of::<RolloutGroup>(&sync_bus, stream).await
        } else {
            keys_of::<ScoredGroup>(&sync_bus, stream).await
        };
        assert!(na >= 640 && nb >= 96, "{what}: {na} / {nb}");
        assert_eq!(ka, kb, "{what} messages differ between async and sync");
    }
    let (fa, fb) = (step_fields(&async_bus).await, step_fields(&sync_bus).await);
    assert!(
        fa.contains("reward_mean") && fa.contains("accuracy"),
        "{fa:?}"
    );
    assert_eq!(fa, fb, "trainer metrics differ between async and sync");
}

fn rlstream(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rlstream"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_binary_runs_on_the_embedded_bus_and_on_redis() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let args = [
        "run",
        "--task",
        "reverse",
        "--sft-steps",
        "20",
        "--steps",
        "4",
        "--out",
        out_s,
    ];
    let o = rlstream(&args);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        stdout.contains("async run of `reverse` on the memory bus: 4 steps"),
        "{stdout}"
    );
    // Not a terminal: progress comes as log lines.
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("warm start done in"), "{stderr}");
    assert!(stderr.contains("RL done in"), "{stderr}");
    for f in [
        "learning_curve.svg",
        "metrics.jsonl",
        "metrics.csv",
        "summary.json",
    ] {
        assert!(out.join("report").join(f).is_file(), "{f} missing");
    }
    // What is left for replay is said: nothing, from the embedded bus.
    assert!(
        stdout.contains("ended with it, so there is nothing to replay"),
        "{stdout}"
    );
    // The trainer's busy and waiting times do not overlap, and rate intervals stay in range.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report/summary.json")).unwrap())
            .unwrap();
    let secs = |k: &str| summary[k].as_f64().unwrap();
    assert!(
        secs("train_busy_s") + secs("train_wait_s") <= secs("wall_s") + 0.05,
        "busy {} + wait {} > wall {}",
        secs("train_busy_s"),
        secs("train_wait_s"),
        secs("wall_s")
    );
    assert_eq!(
        summary["namespace"].as_str().map(str::is_empty),
        Some(false)
    );
    for h in summary["held_out"].as_array().unwrap() {
        for k in ["pass_at_1", "greedy_accuracy"] {
            let (lo, hi) = (h[k]["lo"].as_f64().unwrap(), h[k]["hi"].as_f64().unwrap());
            assert!(
                (0.0..=1.0).contains(&lo) && (0.0..=1.0).contains(&hi),
                "{k}: {h}"
            );
        }
    }

    // The same directory is refused rather than resumed into a fresh bus.
    let again = rlstream(&args);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already holds a run"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    // --redis: the same command on Redis streams, starting from the model just trained,
    // with the consumer groups renamed in the topology file: the stages read through the
    // groups the file names.
    let ns = crate::common::unique_ns("run");
    let url = crate::common::redis_url();
    let model = out.join("sft");
    let renamed = [
        ("gen", "generators"),
        ("score", "scorers"),
        ("train", "learners"),
    ];
    let mut topology = rlstream::bus::topology::DEFAULT_TOPOLOGY.to_string();
    for (from, to) in renamed {
        let line = format!("groups = [\"{from}\"]");
        assert!(topology.contains(&line), "the shipped topology has {line}");
        topology = topology.replace(&line, &format!("groups = [\"{to}\"]"));
    }
    let topology_file = dir.path().join("renamed.toml");
    std::fs::write(&topology_file, topology).unwrap();
    let o = rlstream(&[
        "run",
        "--task",
        "reverse",
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "3",
        "--out",
        dir.path().join("redis-run").to_str().unwrap(),
        "--redis",
        &url,
        "--namespace",
        &ns,
        "--topology",
        topology_file.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("on the redis bus: 3 steps"), "{stdout}");
    assert!(
        stdout.contains(&format!("rlstream replay --redis URL --namespace {ns}")),
        "{stdout}"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let bus = crate::common::redis_bus().await;
        let scored = bus.stats(&format!("{ns}:scored")).await.unwrap();
        assert!(scored.length >= 24, "{scored:?}");
        for (stream, group) in [
            ("prompts", "generators"),
            ("rollouts", "scorers"),
            ("scored", "learners"),
        ] {
            let s = bus.stats(&format!("{ns}:{stream}")).await.unwrap();
            let names: Vec<&str> = s.groups.iter().map(|g| g.name.as_str()).collect();
            assert_eq!(names, [group], "{stream}: {s:?}");
        }
        crate::common::drop_namespace(&ns).await;
    });
}

#[test]
fn a_model_with_another_tokenizer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let o = rlstream(&[
        "run",
        "--model",
        "tests/fixtures/models/llama",
        "--out",
        dir.path().join("x").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("character tokenizer"), "{stderr}");
}

/// Dynamic sampling under `--sync`: the trainer keeps every group whose rewards are all
/// equal out of its steps, the feeder replaces each with a prompt, and every step still
/// trains `groups_per_step` groups, each with rewards that differ. Checked against the
/// scored stream: what the trainer remembers training and dropping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_dynamic_sampling_trains_only_groups_that_teach() {
    let dir = tempfile::tempdir().unwrap();
    let task = BuiltinTask::Add;
    let model = dir.path().join("sft");
    let warm = SftOptions {
        task,
        out: model.clone(),
        steps: 60,
        ..SftOptions::default()
    };
    sft::run(&warm, |_, _| {}).unwrap();
    let mut cfg = run::defaults(task);
    cfg.train.steps = 4;
    cfg.train.checkpoint_every = 4;
    cfg.train.filter_groups = true;
    cfg.run.eval_prompts = 0;
    let out = dir.path().join("run");
    let opts = RunOptions {
        prompts: run::RunPrompts::Task(task),
        model: Some(model),
        sft: SftOptions::default(),
        out: out.clone(),
        report: None,
        sync: true,
        seed: 1,
        display: DisplayMode::Quiet,
    };
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let o = crate::common::run_alone(&opts, cfg, bus.clone()).await;
    assert_eq!((o.summary.steps, o.summary.trained_groups), (4, 32));
    let filtered: u64 = o.rows.iter().map(|r| r.record.filtered_groups).sum();
    assert!(
        filtered > 0,
        "no group was filtered: the test shows nothing"
    );

    let scored = bus
        .range("rl:scored", RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .unwrap();
    let rewards: std::collections::BTreeMap<String, Vec<f32>> = scored
        .iter()
        .map(|e| {
            let g: ScoredGroup = schema::decode(&e.payload).unwrap();
            (g.rollout.group_id, g.rewards)
        })
        .collect();
    // Each filtered group was replaced (a step's prompts may follow the last step).
    assert!(
        rewards.len() as u64 >= 32 + filtered,
        "{} scored",
        rewards.len()
    );
    let latest = rlstream::stages::train::checkpoint::latest(&out.join("checkpoints")).unwrap();
    let state = rlstream::stages::train::checkpoint::read_state(&latest).unwrap();
    let same = |id: &str| rewards[id].windows(2).all(|w| w[0] == w[1]);
    assert_eq!(state.recent_groups.len(), 32);
    assert!(
        state.recent_groups.iter().all(|id| !same(id)),
        "a zero-variance group trained"
    );
    let dropped: Vec<&String> = state
        .recent_dropped
        .iter()
        .filter(|(_, why)| why == "zero_variance")
        .map(|(id, _)| id)
        .collect();
    assert!(dropped.len() as u64 >= filtered);
    assert!(dropped.iter().all(|id| same(id)));

    // Async, the generators' in-flight bound counts every group, filtered or not: the
    // staleness trained stays within max_lag. With the difficulty-aware feed on, some
    // prompts are fed again; with overlong masking, every truncated completion is masked.
    let mut cfg = run::defaults(task);
    cfg.train.steps = 8;
    cfg.train.filter_groups = true;
    cfg.train.mask_truncated = true;
    cfg.difficulty.reoffer = 0.5;
    cfg.run.eval_prompts = 0;
    let max_lag = cfg.policy.max_lag;
    let opts = RunOptions {
        out: dir.path().join("async"),
        sync: false,
        ..opts
    };
    let o = crate::common::run_alone(&opts, cfg, Arc::new(MemoryBus::new())).await;
    assert_eq!((o.summary.steps, o.summary.trained_groups), (8, 64));
    assert!(o.rows.iter().map(|r| r.record.filtered_groups).sum::<u64>() > 0);
    let staleness = &o.summary.staleness;
    assert!(staleness.keys().all(|&k| k <= max_lag), "{staleness:?}");
    let (fed, again) = (o.summary.prompts_fed, o.summary.prompts_reoffered);
    assert!(again > 0 && again < fed, "{again} of {fed} fed again");
    assert!(
        o.rows
            .iter()
            .all(|r| r.record.masked_samples == r.record.truncated_samples)
    );
}

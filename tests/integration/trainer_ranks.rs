//! Data-parallel trainer ranks under `mpirun` (the real binary, a real Open MPI and Redis):
//! 2 and 3 ranks train to one trainer's weights from the same groups, `--sync` runs with
//! 2 ranks stay bitwise on-policy and repeat themselves bit for bit, a killed rank stops
//! every rank and a restart loses nothing and trains nothing twice, and ranks whose
//! settings differ refuse to start. Sharded optimizer state and gradients train to one
//! trainer's weights and resume at another number of ranks.

use crate::common::{
    mpirun, rank_pid, redis_bus, redis_url, sampled_group, spawn_command, tiny_llama, unique_ns,
};
use bytes::Bytes;
use rlstream::bus::SharedBus;
use rlstream::model::tensors::{TensorMap, read_safetensors_file};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn run_mpi(n: usize, args: &[String]) -> Output {
    mpirun(&[(n, args.to_vec())])
        .stdin(Stdio::null())
        .output()
        .expect("mpirun (Debian: openmpi-bin)")
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_string()).collect()
}

/// `n` scored groups sampled from `model`, published to `ns`'s scored stream.
async fn publish_groups(bus: &SharedBus, ns: &str, model: &Policy<InferBackend>, n: u64) {
    let payloads: Vec<Bytes> = (0..n)
        .map(|i| {
            let rewards: Vec<f32> = (0..4).map(|k| ((i * 7 + k) % 3) as f32).collect();
            let g = sampled_group(
                model,
                &format!("g{i:03}"),
                vec![(i % 20) as u32 + 1, 3],
                5,
                i,
                rewards,
            );
            Bytes::from(schema::encode(&g).unwrap())
        })
        .collect();
    bus.publish(&format!("{ns}:scored"), &payloads, None)
        .await
        .unwrap();
}

/// `rlstream train` on `ns` from the model in `dir/model`, checkpoints in `ckpt`; a flag
/// in `extra` replaces the one here.
fn train_args(dir: &Path, ns: &str, ckpt: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let url = redis_url();
    let (model, steps, ckpt) = (
        dir.join("model").to_str().unwrap().to_string(),
        steps.to_string(),
        ckpt.to_str().unwrap().to_string(),
    );
    let base = [
        ("--model", model.as_str()),
        ("--groups-per-step", "2"),
        ("--steps", &steps),
        ("--checkpoint-every", "2"),
        ("--checkpoint-dir", &ckpt),
        ("--lr", "1e-4"),
        ("--max-lag", "1000"),
        ("--collective-timeout-s", "20"),
        ("--redis", &url),
        ("--namespace", ns),
    ];
    let mut a = vec!["train".to_string()];
    for (flag, value) in base {
        if !extra.contains(&flag) {
            a.extend(strings(&[flag, value]));
        }
    }
    a.extend(strings(extra));
    a
}

fn weights(ckpt: &Path) -> TensorMap {
    let latest = rlstream::stages::train::checkpoint::latest(ckpt).expect("a checkpoint");
    read_safetensors_file(&latest.join("model.safetensors")).unwrap()
}

/// Per tensor, max |a − b| over max |a|.
fn worst_relative(a: &TensorMap, b: &TensorMap) -> (String, f64) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (String::new(), 0f64);
    for (name, x) in a {
        let y = &b[name];
        let scale = x
            .data
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        let d = x
            .data
            .iter()
            .zip(&y.data)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        let rel = f64::from(d / scale);
        if rel > worst.1 {
            worst = (name.clone(), rel);
        }
    }
    worst
}

/// One trainer, 2 ranks and 3 ranks train on the same 16 groups: 8 steps of 2 groups (the
/// third rank has no group in any step) and 5 steps of 3; and 4 steps of 4 groups in four
/// updates each under decoupled PPO on one rank and on two. They end at the same weights
/// within 1e-6 of each tensor's largest; with bf16 on the wire, close but not exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_and_three_ranks_train_to_one_trainers_weights() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 5);
    let bus = redis_bus().await;
    let mut ckpts: Vec<PathBuf> = Vec::new();
    // Several updates a step under decoupled PPO: the proximal log-probs each rank
    // recomputes for its share are gathered, and every update is shared anew.
    let several: &[&str] = &[
        "--ppo-mini-batch-size",
        "2",
        "--ppo-epochs",
        "2",
        "--use-decoupled-loss",
    ];
    let runs: [(usize, u64, &[&str]); 8] = [
        (1, 2, &[]),
        (2, 2, &[]),
        (3, 2, &[]),
        (2, 2, &["--allreduce-dtype", "bf16"]),
        (1, 3, &[]),
        (3, 3, &[]),
        (1, 4, several),
        (2, 4, several),
    ];
    for (ranks, per_step, extra) in runs {
        let ns = unique_ns(&format!("ranks{ranks}"));
        publish_groups(&bus, &ns, &model, 16).await;
        let ckpt = dir.path().join(format!("ckpt-{}", ckpts.len()));
        let (steps, groups) = (16 / per_step, 16 / per_step * per_step);
        let per_step = per_step.to_string();
        let mut extra = extra.to_vec();
        extra.extend(["--groups-per-step", &per_step]);
        let out = run_mpi(ranks, &train_args(dir.path(), &ns, &ckpt, steps, &extra));
        let stdout = ok(&out, &format!("{ranks} trainer ranks"));
        let done = format!("trained {steps} steps to version {steps} on {groups} groups");
        assert!(stdout.contains(&done), "{stdout}");
        ckpts.push(ckpt);
    }
    let start = read_safetensors_file(&dir.path().join("model/model.safetensors")).unwrap();
    for (one, other, what) in [
        (0, 1, "2 ranks"),
        (0, 2, "3 ranks, one idle"),
        (4, 5, "3 ranks"),
        (6, 7, "2 ranks, 4 decoupled updates a step"),
    ] {
        let one = weights(&ckpts[one]);
        assert!(
            worst_relative(&one, &start).1 > 1e-3,
            "training moved the weights"
        );
        let (name, rel) = worst_relative(&one, &weights(&ckpts[other]));
        eprintln!("{what} against one trainer: worst {name}, {rel:e} of its largest weight");
        assert!(
            rel <= 1e-6,
            "{what}: {name} differs by {rel:e} of its largest weight"
        );
    }
    let (name, rel) = worst_relative(&weights(&ckpts[0]), &weights(&ckpts[3]));
    eprintln!("2 ranks, bf16 all-reduce: worst {name}, {rel:e}");
    assert!(rel < 5e-3, "bf16 all-reduce: {name} differs by {rel:e}");
}

/// The gradients' all-reduce with its buckets filled on the backend's device
/// (`--grad-buffers device`) against the host path: 2 ranks on the same groups end with the
/// same bits. On the CPU build the CPU backend's tensors stand in for a device's (MPI reads
/// each bucket through the host); in CI's CubeCL run they are the wgpu backend's buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_gradient_buckets_sum_to_the_host_paths_bits() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 5);
    let bus = redis_bus().await;
    let mut ends = Vec::new();
    for buffers in ["host", "device"] {
        let ns = unique_ns(&format!("grad-buffers-{buffers}"));
        publish_groups(&bus, &ns, &model, 2).await;
        let ckpt = dir.path().join(format!("ckpt-{buffers}"));
        let extra = ["--grad-buffers", buffers, "--checkpoint-every", "1"];
        let args = train_args(dir.path(), &ns, &ckpt, 1, &extra);
        let stdout = ok(&run_mpi(2, &args), &format!("2 ranks, {buffers} buffers"));
        assert!(
            stdout.contains("trained 1 steps to version 1 on 2 groups"),
            "{stdout}"
        );
        ends.push(weights(&ckpt));
    }
    let start = read_safetensors_file(&dir.path().join("model/model.safetensors")).unwrap();
    assert!(
        worst_relative(&ends[0], &start).1 > 1e-3,
        "training moved the weights"
    );
    for (name, host) in &ends[0] {
        let device = &ends[1][name];
        let same = host
            .data
            .iter()
            .zip(&device.data)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{name}: the device buckets' sums differ from the host's"
        );
    }
}

/// Optimizer state and gradients sharded over the ranks (`--shard`): 2 ranks sharding the
/// optimizer and 3 sharding the gradients too (the third rank has no group in any step) end
/// within 1e-6 of one trainer on the same 16 groups; so do a run whose sharded checkpoint of
/// 2 ranks resumes at 3 (each rank reads its new range from the old files), and one whose
/// unsharded checkpoint of one trainer resumes sharded over 2. A sharded checkpoint refuses
/// to resume unsharded, saying how.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_ranks_train_to_one_trainers_weights_and_resume_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 5);
    let bus = redis_bus().await;
    // (name, ranks, steps to reach, flags): runs of one name share the groups and the
    // checkpoints, the second resuming where the first stopped.
    let runs: [(&str, usize, u64, &[&str]); 7] = [
        ("one", 1, 8, &[]),
        ("optimizer", 2, 8, &["--shard", "optimizer"]),
        ("gradients", 3, 8, &["--shard", "gradients"]),
        ("resharded", 2, 4, &["--shard", "gradients"]),
        ("resharded", 3, 8, &["--shard", "gradients"]),
        ("unsharded-first", 1, 4, &[]),
        ("unsharded-first", 2, 8, &["--shard", "optimizer"]),
    ];
    let mut spaces: std::collections::BTreeMap<&str, String> = Default::default();
    for (name, ranks, steps, extra) in runs {
        if !spaces.contains_key(name) {
            let ns = unique_ns(&format!("shard-{name}"));
            publish_groups(&bus, &ns, &model, 16).await;
            spaces.insert(name, ns);
        }
        let ckpt = dir.path().join(format!("ckpt-{name}"));
        let out = run_mpi(
            ranks,
            &train_args(dir.path(), &spaces[name], &ckpt, steps, extra),
        );
        let stdout = ok(&out, &format!("{name}: {ranks} ranks to step {steps}"));
        assert!(stdout.contains(&format!("to version {steps}")), "{stdout}");
    }
    let files = |name: &str| -> Vec<String> {
        let latest =
            rlstream::stages::train::checkpoint::latest(&dir.path().join(format!("ckpt-{name}")))
                .expect("a checkpoint");
        let mut f: Vec<String> = std::fs::read_dir(latest)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("optimizer-shard-") || n.starts_with("trainer_optim"))
            .collect();
        f.sort();
        f
    };
    assert_eq!(files("one"), ["trainer_optim.mpk"]);
    assert_eq!(
        files("gradients"),
        [
            "optimizer-shard-0000-of-0003.bin",
            "optimizer-shard-0001-of-0003.bin",
            "optimizer-shard-0002-of-0003.bin"
        ]
    );
    let one = weights(&dir.path().join("ckpt-one"));
    let start = read_safetensors_file(&dir.path().join("model/model.safetensors")).unwrap();
    assert!(
        worst_relative(&one, &start).1 > 1e-3,
        "training moved the weights"
    );
    for name in ["optimizer", "gradients", "resharded", "unsharded-first"] {
        let (worst, rel) = worst_relative(&one, &weights(&dir.path().join(format!("ckpt-{name}"))));
        eprintln!("{name} against one trainer: worst {worst}, {rel:e} of its largest weight");
        assert!(
            rel <= 1e-6,
            "{name}: {worst} differs by {rel:e} of its largest weight"
        );
    }
    let ckpt = dir.path().join("ckpt-gradients");
    let args = train_args(dir.path(), &spaces["gradients"], &ckpt, 10, &[]);
    let out = run_mpi(1, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an unsharded resume of shards must be refused"
    );
    assert!(
        stderr.contains("sharded optimizer state (3 shard files): resume with --shard optimizer or --shard gradients"),
        "{stderr}"
    );
}

/// `mpirun -n 2 rlstream run --sync` on a mixture-of-experts policy with micro-batches and
/// top-k, the ranks sharding optimizer state and gradients: every ratio exactly 1 and every
/// routing decision replayed, and a second run with the seed writes the same checkpoint
/// bytes, each rank's optimizer shard included.
#[test]
fn two_rank_sync_runs_are_bitwise_on_policy_and_repeat_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let run = |out: &Path| {
        let args = strings(&[
            "run",
            "--task",
            "guess",
            "--experts",
            "4",
            "--sft-steps",
            "30",
            "--sync",
            "--seed",
            "3",
            "--steps",
            "3",
            "--checkpoint-every",
            "3",
            "--micro-batch-tokens",
            "200",
            "--top-k",
            "6",
            "--eval-prompts",
            "0",
            "--plain",
            "--collective-timeout-s",
            "60",
            "--shard",
            "gradients",
            "--out",
            out.to_str().unwrap(),
        ]);
        ok(&run_mpi(2, &args), "mpirun -n 2 rlstream run --sync");
        let text = std::fs::read_to_string(out.join("report/metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let rows = run(&a);
    assert_eq!(rows.len(), 3);
    for r in &rows {
        assert!(r["tokens"].as_u64().unwrap() > 200, "one micro-batch: {r}");
        assert_eq!(r["logprob_gap"], 0.0, "{r}");
        assert_eq!(
            (&r["ratio_mean"], &r["ratio_max"]),
            (&1.0.into(), &1.0.into()),
            "{r}"
        );
        assert_eq!(r["routing_mismatch"], 0.0, "{r}");
    }
    run(&b);
    for f in [
        "model.safetensors",
        "trainer_model.mpk",
        "optimizer-shard-0000-of-0002.bin",
        "optimizer-shard-0001-of-0002.bin",
    ] {
        let step = "checkpoints/step-00000003";
        let (x, y) = (
            std::fs::read(a.join(step).join(f)).unwrap(),
            std::fs::read(b.join(step).join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs between two 2-rank runs with one seed");
    }
}

/// Steps the trainer announced on the events stream.
async fn steps_announced(bus: &SharedBus, ns: &str) -> usize {
    crate::common::messages::<schema::Event>(bus, &format!("{ns}:events"))
        .await
        .iter()
        .filter(|e| e.kind == "step")
        .count()
}

/// Starts 2 trainer ranks with `args` (their log in `log`), sends rank 1 `signal` once
/// `steps` steps were announced on `ns`, and waits up to `within` seconds for every rank to
/// stop: the exit status and the log.
async fn signal_rank_1(
    bus: &SharedBus,
    ns: &str,
    args: Vec<String>,
    log: &Path,
    steps: usize,
    signal: &str,
    within: u64,
) -> (std::process::ExitStatus, String) {
    let mut ranks = spawn_command(mpirun(&[(2, args)]), log);
    let deadline = Instant::now() + Duration::from_secs(120);
    while steps_announced(bus, ns).await < steps {
        assert!(
            Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let victim = rank_pid(ranks.id().expect("running"), 1).expect("rank 1's process");
    Command::new("kill")
        .args([signal, &victim.to_string()])
        .status()
        .unwrap();
    let sent = Instant::now();
    let status = loop {
        if let Some(s) = ranks.try_wait() {
            break s;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(within),
            "ranks still running {within} s after rank 1 got {signal}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, std::fs::read_to_string(log).unwrap())
}

/// Rank 1 is killed with SIGKILL while the ranks train: every rank stops promptly, the
/// lost rank named; all ranks restarted train the rest from the last checkpoint, and at the
/// end every group was trained exactly once in the surviving line and every entry is acked.
/// Rank 1 stopped with SIGSTOP instead: rank 0 names it when the collective's deadline
/// passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_stops_every_rank_and_a_restart_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 6);
    let bus = redis_bus().await;
    let ns = unique_ns("rank-kill");
    publish_groups(&bus, &ns, &model, 40).await;
    let ckpt = dir.path().join("ckpt");
    // Until stopped: the kill lands wherever the ranks are.
    let args = train_args(dir.path(), &ns, &ckpt, 0, &["--collective-timeout-s", "5"]);
    let (status, text) = signal_rank_1(
        &bus,
        &ns,
        args,
        &dir.path().join("first.log"),
        5,
        "-KILL",
        20,
    )
    .await;
    assert!(!status.success());
    assert!(text.contains("rank 1"), "the lost rank is named:\n{text}");

    // Restart every rank: 40 groups at 2 a step is 20 steps in the surviving line.
    let again = train_args(dir.path(), &ns, &ckpt, 20, &[]);
    let stdout = ok(&run_mpi(2, &again), "the restarted ranks");
    assert!(stdout.contains("trained 20 steps to version"), "{stdout}");
    let latest = rlstream::stages::train::checkpoint::latest(&ckpt).unwrap();
    let state = rlstream::stages::train::checkpoint::read_state(&latest).unwrap();
    let trained: std::collections::BTreeSet<&String> = state.recent_groups.iter().collect();
    assert_eq!(state.trained_groups, 40, "{state:?}");
    assert_eq!(
        (state.recent_groups.len(), trained.len()),
        (40, 40),
        "each group once"
    );
    let stats = bus.stats(&format!("{ns}:scored")).await.unwrap();
    let group = stats.groups.iter().find(|g| g.name == "train").unwrap();
    assert_eq!(
        (group.pending, group.lag),
        (0, Some(0)),
        "every entry acked"
    );

    // A stopped rank (alive, never answering): the deadline passes and rank 0 names it.
    let ns = unique_ns("rank-stop");
    publish_groups(&bus, &ns, &model, 40).await;
    let ckpt = dir.path().join("ckpt-stop");
    let args = train_args(dir.path(), &ns, &ckpt, 0, &["--collective-timeout-s", "3"]);
    let (status, text) = signal_rank_1(
        &bus,
        &ns,
        args,
        &dir.path().join("stop.log"),
        2,
        "-STOP",
        30,
    )
    .await;
    assert!(!status.success());
    assert!(
        text.contains("lost rank 1 (no answer to a roll call"),
        "{text}"
    );
}

/// Ranks started with different settings refuse to start, naming the setting and both
/// values, before either reads a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_different_settings_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    tiny_llama(dir.path(), 7);
    let ns = unique_ns("rank-refuse");
    let ckpt = dir.path().join("ckpt");
    let a = train_args(dir.path(), &ns, &ckpt, 2, &[]);
    let b = train_args(dir.path(), &ns, &ckpt, 2, &["--lr", "2e-3"]);
    let out = mpirun(&[(1, a), (1, b)])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("rank 1's settings differ: train.lr is 0.002 here and 0.0001 on rank 0"),
        "{text}"
    );
    let bus = redis_bus().await;
    assert!(
        bus.stats(&format!("{ns}:scored"))
            .await
            .map(|s| s.groups.is_empty())
            .unwrap_or(true)
    );
}

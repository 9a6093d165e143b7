//! A full disk, without a mount: the stage process runs under a file size limit
//! (`ulimit -f`, with SIGXFSZ ignored so a write past it fails with EFBIG as ENOSPC would).
//! A checkpoint, an archive segment and a run's report that cannot be written leave the
//! previous one whole, remove or ack nothing that was not persisted, and the process says
//! what failed.

use crate::common::{dead_letters, redis_bus, run_ok, sampled_group};
use bytes::Bytes;
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema;
use std::path::Path;
use std::process::Output;

/// `rlstream ARGS` with files limited to `kib` KiB.
fn limited(kib: u64, args: &[&str]) -> Output {
    let exe = env!("CARGO_BIN_EXE_rlstream");
    std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(r#"trap '' XFSZ; ulimit -f {kib}; exec "$0" "$@""#))
        .arg(exe)
        .args(args)
        .output()
        .expect("bash")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn file_kib(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len() / 1024)
}

/// A trainer whose next checkpoint cannot be written stops with the file's error; the
/// previous checkpoint stays whole and in charge, the groups trained since stay pending,
/// and a trainer started again with room resumes there and trains each group once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_cannot_be_written_leaves_the_last_one_in_charge() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let ns = crate::common::unique_ns("fulldisk");
    let cfg = ModelConfig::tiny(Architecture::Llama, 32);
    let model = Policy::<InferBackend>::random(&cfg, 4, &Default::default()).expect("model");
    let model_dir = d.join("model");
    model.save_hf(&model_dir).expect("save");
    let groups: Vec<Bytes> = (0..16u64)
        .map(|i| {
            let g = sampled_group(
                &model,
                &format!("g{i}"),
                vec![(i % 20) as u32 + 1, 3],
                4,
                i,
                vec![1.0, 0.0, 0.5, 0.25],
            );
            Bytes::from(schema::encode(&g).expect("encode"))
        })
        .collect();
    let bus = redis_bus().await;
    let scored = format!("{ns}:scored");
    bus.publish(&scored, &groups, None).await.expect("publish");
    let ckpt = d.join("ckpt");
    let url = crate::common::redis_url();
    let train = |steps: &'static str| {
        let (m, c) = (model_dir.to_str(), ckpt.to_str());
        let (m, c) = (m.expect("utf-8"), c.expect("utf-8"));
        let args = [
            "train",
            "--redis",
            &url,
            "--namespace",
            &ns,
            "--model",
            m,
            "--steps",
            steps,
            "--groups-per-step",
            "4",
            "--max-lag",
            "1000",
            "--checkpoint-every",
            "1",
            "--checkpoint-dir",
            c,
        ]
        .map(String::from);
        args.to_vec()
    };
    let out = run_ok(&strs(&train("1")));
    assert!(out.starts_with("trained 1 steps"), "{out}");
    let before = crate::common::checkpoint_state(&ckpt);
    let latest = std::fs::read_to_string(ckpt.join("latest")).expect("latest");
    let weights = std::fs::read_dir(ckpt.join(latest.trim()))
        .expect("checkpoint")
        .filter_map(Result::ok)
        .map(|e| file_kib(&e.path()))
        .max()
        .unwrap_or(0);
    assert!(weights > 8, "the largest checkpoint file is {weights} KiB");

    // Room for the logs, not for a checkpoint's largest file.
    let full = limited(weights / 2, &strs(&train("3")));
    let said = text(&full);
    assert!(!full.status.success(), "{said}");
    assert!(said.contains("File too large"), "{said}");
    assert!(!said.contains("panicked"), "{said}");
    assert_eq!(
        crate::common::checkpoint_state(&ckpt),
        before,
        "the step-1 checkpoint is still the newest"
    );
    let pending = crate::common::pending(&ns, "scored", "train").await;
    assert_eq!(pending.len(), 4, "the group trained since stays unacked");

    let out = run_ok(&strs(&train("3")));
    assert!(out.starts_with("trained 3 steps"), "{out}");
    let trained = crate::common::trained_groups(&ckpt);
    let unique: std::collections::HashSet<&String> = trained.iter().collect();
    assert_eq!((trained.len(), unique.len()), (12, 12), "{trained:?}");
    assert!(dead_letters(&bus, &format!("{ns}:dead")).await.is_empty());
    crate::common::drop_namespace(&ns).await;
}

/// A trim whose archive cannot be written removes nothing, and leaves no partial file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_that_cannot_be_written_removes_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let ns = crate::common::unique_ns("fullarchive");
    let bus = redis_bus().await;
    let key = format!("{ns}:prompts");
    // Bytes that do not compress: 64 entries of 4 KiB from a xorshift generator.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let payloads: Vec<Bytes> = (0..64)
        .map(|_| {
            (0..512)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect::<Vec<u8>>()
                .into()
        })
        .collect();
    bus.publish(&key, &payloads, None).await.expect("publish");
    let archive = dir.path().join("prompts.rla");
    let url = crate::common::redis_url();
    let args = [
        "trim",
        "--redis",
        &url,
        "--namespace",
        &ns,
        "--stream",
        "prompts",
        "--keep-last",
        "1",
        "--archive",
        archive.to_str().expect("utf-8"),
    ];
    let full = limited(64, &args);
    let said = text(&full);
    assert!(!full.status.success(), "{said}");
    assert!(said.contains("File too large"), "{said}");
    assert_eq!(bus.stats(&key).await.expect("stats").length, 64);
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");

    let out = run_ok(&args);
    assert!(out.contains("63"), "{out}");
    assert_eq!(bus.stats(&key).await.expect("stats").length, 1);
    crate::common::drop_namespace(&ns).await;
}

/// A run whose report cannot be written (`/dev/full` where it writes) prints its summary,
/// says what failed and where its checkpoints are, and leaves an earlier report whole.
#[test]
fn a_report_that_cannot_be_written_leaves_the_earlier_one_whole() {
    let dir = tempfile::tempdir().expect("tmp");
    let report = dir.path().join("report");
    let r = report.to_str().expect("utf-8");
    let out = |n: &str| dir.path().join(n).to_str().expect("utf-8").to_string();
    let (first_out, second_out) = (out("first"), out("second"));
    let first = run_ok(&[
        "run",
        "--task",
        "sort",
        "--sft-steps",
        "5",
        "--steps",
        "2",
        "--out",
        &first_out,
        "--report",
        r,
    ]);
    assert!(first.contains("learning curve:"), "{first}");
    let earlier = std::fs::read(report.join("metrics.jsonl")).expect("jsonl");
    assert!(!earlier.is_empty());

    std::os::unix::fs::symlink("/dev/full", report.join("metrics.jsonl.partial")).expect("symlink");
    let model = format!("{first_out}/sft");
    let full = crate::common::bin()
        .args([
            "run",
            "--task",
            "sort",
            "--model",
            &model,
            "--steps",
            "2",
            "--out",
            &second_out,
            "--report",
            r,
        ])
        .output()
        .expect("rlstream");
    let said = text(&full);
    assert!(!full.status.success(), "{said}");
    assert!(
        said.contains("cannot write report file")
            && said.contains("No space left on device")
            && said.contains("The run itself finished"),
        "{said}"
    );
    assert!(
        String::from_utf8_lossy(&full.stdout).contains("2 steps"),
        "the summary is printed: {said}"
    );
    assert_eq!(
        std::fs::read(report.join("metrics.jsonl")).expect("jsonl"),
        earlier,
        "the earlier report is whole"
    );
    let partial: Vec<_> = std::fs::read_dir(&report)
        .expect("dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".partial"))
        .collect();
    assert!(partial.is_empty(), "{partial:?}");
}

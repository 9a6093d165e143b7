//! Bounded Redis memory, on the real thing: a real trainer process on a real Redis under a
//! topology whose memory limits are far below what the run writes. Its standing trims
//! move finished entries into `--archive-dir` and never an unfinished one; `replay` reads
//! the archive and Redis as one history, and `replay --train` reproduces the steps after a
//! checkpoint whose groups and step records now live only in the archive.

use crate::common::run_ok;
use bytes::Bytes;
use rlstream::bus::{RangeBound, Topology};
use rlstream::retention;
use rlstream::schema;
use std::time::{Duration, Instant};

const GROUPS: u64 = 80;
const STEPS: u64 = 16;
const PER_STEP: u64 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_budget_archives_finished_entries_and_replay_reads_both() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let model = crate::common::tiny_llama(d, 4);
    let payloads: Vec<Bytes> = (0..GROUPS)
        .map(|i| {
            let rewards: Vec<f32> = (0..4).map(|k| ((i * 7 + k * 3) % 5) as f32 / 4.0).collect();
            let g = crate::common::sampled_group(
                &model,
                &format!("g{i}"),
                vec![(i % 20) as u32 + 1, 3],
                4,
                i,
                rewards,
            );
            Bytes::from(schema::encode(&g).expect("encode"))
        })
        .collect();
    let url = crate::common::redis_url();
    let ns = crate::common::unique_ns("budget");
    let bus = crate::common::redis_bus().await;
    let topo = Topology::default().with_namespace(&ns).expect("ns");
    let scored = topo.key("scored");
    bus.publish(&scored, &payloads, None)
        .await
        .expect("publish");
    let all = bus.memory_usage(&scored).await.expect("memory");
    // Limits of a quarter of the scored groups, and of a few step records: the run has to
    // trim both streams several times over.
    let limit = all / 4;
    let mut section = String::new();
    let text = rlstream::bus::topology::DEFAULT_TOPOLOGY
        .lines()
        .map(|l| {
            if l.starts_with("[streams.") {
                section = l.to_string();
            }
            match l {
                l if l.starts_with("trim_max_bytes") && section == "[streams.events]" => {
                    "trim_max_bytes = 2048".to_string()
                }
                l if l.starts_with("trim_max_bytes") => format!("trim_max_bytes = {limit}"),
                l if l.starts_with("trim_every_ms") => "trim_every_ms = 100".to_string(),
                l => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let topo_file = d.join("topology.toml");
    std::fs::write(&topo_file, text).expect("topology");
    let archive = d.join("archive");
    let ckpt = d.join("ckpt");
    let s = |p: &std::path::Path| p.to_str().expect("utf-8").to_string();
    let args: Vec<String> = crate::common::on_bus(
        &[
            "train",
            "--model",
            &s(&d.join("model")),
            "--topology",
            &s(&topo_file),
            "--archive-dir",
            &s(&archive),
            "--steps",
            &STEPS.to_string(),
            "--groups-per-step",
            &PER_STEP.to_string(),
            "--max-lag",
            "1000",
            "--lr",
            "1e-3",
            "--checkpoint-every",
            "4",
            "--checkpoint-dir",
            &s(&ckpt),
        ],
        &url,
        &ns,
    );
    let log = d.join("train.log");
    let mut train = crate::common::spawn(&args, &log);
    // An entry trimmed before the trainer read it would never come: the run would stall.
    let start = Instant::now();
    let status = loop {
        if let Some(status) = train.try_wait() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the trainer stalled: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let train_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{train_log}");

    // The archive holds finished entries of both streams; the groups never delivered are
    // all still in Redis.
    let archived = retention::archive_files(&archive, &topo, "scored").expect("archive");
    assert!(archived.len() >= 2, "{archived:?}\n{train_log}");
    assert!(
        !retention::archive_files(&archive, &topo, "events")
            .expect("archive")
            .is_empty()
    );
    let in_redis = bus
        .range(&scored, RangeBound::Open, RangeBound::Open, 1000)
        .await
        .expect("range");
    let unread = (GROUPS - STEPS * PER_STEP) as usize;
    assert!(in_redis.len() >= unread && in_redis.len() < GROUPS as usize / 2);
    let tail: Vec<&[u8]> = in_redis[in_redis.len() - unread..]
        .iter()
        .map(|e| e.payload.as_ref())
        .collect();
    let expected: Vec<&[u8]> = payloads[payloads.len() - unread..]
        .iter()
        .map(|p| p.as_ref())
        .collect();
    assert_eq!(tail, expected, "an unfinished entry was trimmed");
    // The trainer's last round on its way out left the stream within its limit, or holding
    // nothing but unfinished work.
    let used = bus.memory_usage(&scored).await.expect("memory");
    assert!(
        used <= limit || in_redis.len() == unread,
        "scored takes {used} bytes in {} entries, over its limit of {limit}",
        in_redis.len()
    );

    // One history: every group once, in order, across the archive files and Redis.
    let bus_args = |extra: &[&str]| {
        let mut a = crate::common::on_bus(extra, &url, &ns);
        a.extend(["--archive-dir".to_string(), s(&archive)]);
        a
    };
    let listed = crate::common::json_lines(&run_ok(
        &bus_args(&["replay", "--stream", "scored"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    let ids: Vec<String> = listed
        .iter()
        .map(|l| {
            l["message"]["rollout"]["group_id"]
                .as_str()
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    let want: Vec<String> = (0..GROUPS).map(|i| format!("g{i}")).collect();
    assert_eq!(ids, want);
    // Without the archive only what Redis kept.
    let redis_only = crate::common::json_lines(&run_ok(
        &crate::common::on_bus(&["replay", "--stream", "scored"], &url, &ns)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    assert_eq!(redis_only.len(), in_redis.len());

    // The groups trained after step 4 and its step records are in the archive only: the
    // re-run from that checkpoint reads them from there and matches every recorded step.
    let first_kept = in_redis[0].id;
    let step4: Vec<_> = listed.iter().take(((4 + 1) * PER_STEP) as usize).collect();
    assert!(
        step4.iter().all(|l| l["id"]
            .as_str()
            .and_then(|i| i.parse::<rlstream::bus::EntryId>().ok())
            < Some(first_kept)),
        "the groups after the checkpoint are still in Redis: nothing to prove"
    );
    let ck = ckpt.join("step-00000004");
    let done = STEPS - 4;
    let out = run_ok(
        &bus_args(&[
            "replay",
            "--train",
            "--checkpoint",
            &s(&ck),
            "--steps",
            &done.to_string(),
        ])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    assert!(
        out.contains(&format!(
            "re-ran {done} steps from checkpoint step 4; {done} of {done} recorded steps bit-identical"
        )),
        "{out}"
    );
    crate::common::drop_namespace(&ns).await;
}

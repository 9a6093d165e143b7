//! Stages ride out a Redis restart: a real redis-server on a spare port with AOF
//! (`appendfsync always`), a real pipeline of gen, score and train processes, Redis killed
//! with SIGKILL mid-run and started again on the same data. The stages retry with backoff
//! instead of exiting, the trainer finishes its steps, versions never go backwards, nothing
//! fed is lost and no group is trained twice.

use crate::common::{free_port, interrupt, run_ok, spawn, start_redis};
use rlstream::bus::{Bus, RangeBound, RedisBus, SharedBus};
use rlstream::schema::{self, Event};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The trainer's step events, read on a fresh connection (the test's own view survives
/// the restart the same way: by connecting again).
async fn steps(url: &str) -> Vec<Event> {
    let Ok(bus) = RedisBus::connect(url).await else {
        return Vec::new();
    };
    let bus: SharedBus = Arc::new(bus);
    bus.range("rl:events", RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|e| schema::decode::<Event>(&e.payload).ok())
        .filter(|e| e.kind == "step")
        .collect()
}

/// Each pipeline stream's length and its groups' lag and pending, for a failure message.
async fn stream_state(url: &str) -> String {
    let Ok(bus) = RedisBus::connect(url).await else {
        return "(redis unreachable)".into();
    };
    let mut out = String::new();
    for key in [
        "rl:prompts",
        "rl:rollouts",
        "rl:scored",
        "rl:weights",
        "rl:dead",
    ] {
        match bus.stats(key).await {
            Ok(s) => {
                out += &format!("{key}: length {}\n", s.length);
                for g in &s.groups {
                    out += &format!(
                        "  group {}: lag {:?}, pending {}, last delivered {}\n",
                        g.name, g.lag, g.pending, g.last_delivered
                    );
                }
            }
            Err(e) => out += &format!("{key}: {e}\n"),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_survive_a_redis_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let data = d.join("redis");
    std::fs::create_dir_all(&data).expect("mkdir");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let redis = start_redis(&data, port, &[]);
    let model = d.join("model");
    let m = model.to_str().expect("utf-8");
    crate::common::warm_start("sort", &model, 30, &[]);
    let fed = run_ok(&["feed", "--redis", &url, "--task", "sort", "--count", "1500"]);
    assert!(fed.starts_with("fed 1500"), "{fed}");
    let log = |n: &str| d.join(format!("{n}.log"));
    let args = |v: &[&str]| {
        let mut a: Vec<String> = v.iter().map(|s| s.to_string()).collect();
        a.extend(["--redis".to_string(), url.clone()]);
        a
    };
    let generator = spawn(
        &args(&["gen", "--model", m, "--max-new-tokens", "9"]),
        &log("gen"),
    );
    let score = spawn(&args(&["score"]), &log("score"));
    let ckpt = d.join("ckpt");
    let mut train = spawn(
        &args(&[
            "train",
            "--model",
            m,
            "--lr",
            "5e-4",
            "--steps",
            "60",
            "--checkpoint-every",
            "10",
            "--checkpoint-dir",
            ckpt.to_str().expect("utf-8"),
        ]),
        &log("train"),
    );
    let logs = || crate::common::read_logs(&["gen", "score", "train"], log);

    // Kill Redis once the trainer is a few steps in, keep it down for 2 s, restart it.
    let deadline = Instant::now() + Duration::from_secs(120);
    while steps(&url).await.len() < 5 {
        assert!(
            Instant::now() < deadline,
            "no steps before the restart:\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(redis);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _redis = start_redis(&data, port, &[]);

    // The trainer finishes all 60 steps; the others are still running.
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = train.try_wait() {
            break s;
        }
        if Instant::now() >= deadline {
            panic!(
                "the trainer did not finish:\n{}\n{}",
                stream_state(&url).await,
                logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(status.success(), "the trainer failed:\n{}", logs());
    let gen_out = interrupt(generator, "gen", &log("gen"));
    interrupt(score, "score", &log("score"));
    assert!(
        String::from_utf8_lossy(&gen_out.stdout).contains("generated"),
        "{}",
        logs()
    );
    for stage in ["gen", "score", "train"] {
        let text = std::fs::read_to_string(log(stage)).unwrap_or_default();
        assert!(
            text.contains("the bus is back"),
            "{stage} never saw the outage:\n{text}"
        );
    }

    // Versions went up by one per step, across the restart; nothing fed was lost; no group
    // was trained twice.
    let events = steps(&url).await;
    let versions: Vec<u64> = events.iter().map(|e| e.version).collect();
    assert_eq!(versions, (1..=60).collect::<Vec<u64>>(), "{versions:?}");
    let bus: SharedBus = Arc::new(RedisBus::connect(&url).await.expect("redis"));
    assert_eq!(bus.stats("rl:prompts").await.expect("stats").length, 1500);
    let trained = crate::common::trained_groups(&ckpt);
    let unique: std::collections::HashSet<&String> = trained.iter().collect();
    assert_eq!(unique.len(), trained.len(), "a group was trained twice");
    assert_eq!(trained.len(), 60 * 8);
    drop(train);
}

/// After Redis restarts from its append-only file it cannot report a consumer group's lag
/// until the group reads to the end of the stream; the in-flight bound must still see the
/// undelivered entries (it read 0 there, and the generator ran ahead of the trainer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_is_counted_when_redis_cannot_report_the_lag() {
    use rlstream::bus::{GroupStart, ReadFrom, Topology};
    use rlstream::roles::Stream;
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let redis = start_redis(dir.path(), port, &[]);
    let topo = Topology::default();
    let key = topo.key(Stream::Scored);
    let group = topo.group(Stream::Scored);
    let bus: SharedBus = Arc::new(RedisBus::connect(&url).await.expect("redis"));
    bus.create_group(&key, group, GroupStart::Beginning)
        .await
        .expect("group");
    let payloads: Vec<bytes::Bytes> = (0..20u8).map(|i| bytes::Bytes::from(vec![i])).collect();
    bus.publish(&key, &payloads, None).await.expect("publish");
    bus.read_group(&key, group, "train", ReadFrom::New, 5, None)
        .await
        .expect("read");
    let waiting = |bus: SharedBus, cap| {
        let topo = topo.clone();
        async move { rlstream::stages::waiting(bus.as_ref(), &topo, Stream::Scored, false, cap).await }
    };
    assert_eq!(waiting(bus.clone(), 100).await, 15);

    drop(redis);
    let _redis = start_redis(dir.path(), port, &[]);
    let bus: SharedBus = Arc::new(RedisBus::connect(&url).await.expect("redis"));
    let stats = bus.stats(&key).await.expect("stats");
    assert_eq!(
        stats.groups[0].lag, None,
        "Redis reports the lag again: {stats:?}"
    );
    assert_eq!(
        waiting(bus.clone(), 100).await,
        15,
        "counted from the entries"
    );
    assert_eq!(waiting(bus.clone(), 8).await, 8, "up to the cap");
}

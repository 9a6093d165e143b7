//! Redis comes back without its data (no persistence, `FLUSHALL`, a replica promoted before
//! it had the last writes): the stages notice, say so once, recreate their groups and go
//! on, or stop cleanly when told to. Real redis-servers on spare ports, the real binaries.

use crate::common::{free_port, interrupt, run_ok, spawn, start_redis};
use rlstream::bus::{Bus, Consumer, ConsumerOptions, RangeBound, RedisBus, SharedBus};
use rlstream::schema::{self, Event, Prompt, WeightsAnnounce};
use std::path::Path;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Events of `kind` on the events stream, oldest first.
async fn events(url: &str, kind: &str) -> Vec<Event> {
    let Ok(bus) = RedisBus::connect(url).await else {
        return Vec::new();
    };
    bus.range("rl:events", RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|e| schema::decode::<Event>(&e.payload).ok())
        .filter(|e| e.kind == kind)
        .collect()
}

/// How many times `log` says Redis lost a stream's data.
fn losses_told(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches("Redis lost the data of stream")
        .count()
}

/// Waits up to `secs` for `proc` to exit; its status.
async fn exited(proc: &mut crate::common::Proc, what: &str, log: &Path, secs: u64) -> ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(s) = proc.try_wait() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not finish:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Prompt `p{i}`, encoded.
fn prompt_bytes(i: u64) -> bytes::Bytes {
    let p = Prompt {
        schema: schema::SchemaVersion::CURRENT,
        prompt_id: format!("p{i}"),
        task: "sort".into(),
        text: format!("text {i}"),
        prompt_tokens: None,
        meta: Default::default(),
        created_us: 1,
    };
    bytes::Bytes::from(schema::encode(&p).expect("encode"))
}

/// No persistence (`--appendonly no`, as `.ci/run` starts Redis): a restart loses it all.
const EPHEMERAL: [&str; 2] = ["--appendonly", "no"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stages_go_on_when_redis_restarts_without_its_data() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let redis = start_redis(d, port, &EPHEMERAL);
    let model = d.join("model");
    let m = model.to_str().expect("utf-8");
    crate::common::warm_start("sort", &model, 10, &[]);
    let feed = |n: &str| run_ok(&["feed", "--redis", &url, "--task", "sort", "--count", n]);
    assert!(feed("400").starts_with("fed 400"));
    let log = |n: &str| d.join(format!("{n}.log"));
    let args = |v: &[&str]| crate::common::on_bus(v, &url, "rl");
    let generator = spawn(
        &args(&["gen", "--model", m, "--max-new-tokens", "9"]),
        &log("gen"),
    );
    let score = spawn(&args(&["score"]), &log("score"));
    let ckpt = d.join("ckpt");
    let metrics = crate::common::free_addr();
    let train = spawn(
        &args(&[
            "train",
            "--model",
            m,
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            ckpt.to_str().expect("utf-8"),
            "--metrics-addr",
            &metrics,
        ]),
        &log("train"),
    );
    let logs = || crate::common::read_logs(&["gen", "score", "train"], log);
    let wait_steps = |n: usize, what: &'static str| {
        let (url, logs) = (url.clone(), &logs);
        async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let steps = events(&url, "step").await;
                if steps.len() >= n {
                    return steps;
                }
                assert!(Instant::now() < deadline, "{what}:\n{}", logs());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let before = wait_steps(3, "no steps before the loss").await;
    let version_before = before.last().map_or(0, |e| e.version);

    // Redis stops and comes back empty, as one without persistence does.
    drop(redis);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _redis = start_redis(d, port, &EPHEMERAL);
    // Each consumer says so once; then the prompts are fed again, as the generator's line
    // says, and the pipeline trains on.
    crate::common::wait_until("every stage to see the loss", &log("train"), || {
        ["gen", "score", "train"]
            .iter()
            .all(|n| losses_told(&log(n)) > 0)
    });
    assert!(feed("200").starts_with("fed 200"));
    let after = wait_steps(3, "no steps after the loss").await;
    for n in ["gen", "score", "train"] {
        assert_eq!(losses_told(&log(n)), 1, "{n} says it once:\n{}", logs());
    }
    let versions: Vec<u64> = after.iter().map(|e| e.version).collect();
    assert!(
        versions.windows(2).all(|w| w[1] == w[0] + 1) && versions[0] > version_before,
        "versions go on from before the loss ({version_before}): {versions:?}"
    );

    // The trainer announced its weights again, so a generator that starts now finds them.
    let bus: SharedBus = Arc::new(RedisBus::connect(&url).await.expect("redis"));
    let announces: Vec<WeightsAnnounce> = crate::common::messages(&bus, "rl:weights").await;
    // (A step under way when Redis went down may have announced the next version first.)
    assert!(
        announces.first().is_some_and(|a| a.version <= versions[0]),
        "the weights stream holds the version trained on: {:?} {versions:?}",
        announces.iter().map(|a| a.version).collect::<Vec<_>>(),
    );
    let train_log = std::fs::read_to_string(log("train")).unwrap_or_default();
    assert!(
        train_log.contains("announcing the weights again"),
        "{train_log}"
    );

    // The loss is counted (a metric, `rlstream status`) and nothing was trained twice.
    let scrape = crate::common::scrape(&metrics);
    assert!(
        crate::common::metric(
            &scrape,
            r#"rlstream_bus_data_loss_total{stream="rl:scored",group="train"}"#
        ) == 1.0,
        "{scrape}"
    );
    let status = run_ok(&["status", "--redis", &url]);
    assert!(
        status.contains("LOST      Redis lost its data 3 times"),
        "{status}"
    );
    assert_eq!(events(&url, "data_loss").await.len(), 3);
    let gen_out = interrupt(generator, "gen", &log("gen"));
    assert!(gen_out.status.success(), "{}", logs());
    interrupt(score, "score", &log("score"));
    interrupt(train, "train", &log("train"));
    let trained = crate::common::trained_groups(&ckpt);
    let unique: std::collections::HashSet<&String> = trained.iter().collect();
    assert_eq!(unique.len(), trained.len(), "a group was trained twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_told_to_stop_on_data_loss_stops_with_what_was_lost() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let _redis = start_redis(dir.path(), port, &EPHEMERAL);
    let log = dir.path().join("score.log");
    let args: Vec<String> = [
        "score",
        "--redis",
        &url,
        "--redis-stop-on-data-loss",
        "true",
    ]
    .map(String::from)
    .to_vec();
    let mut score = spawn(&args, &log);
    crate::common::wait_until("the scorer to join its group", &log, || {
        redis_cli(port, &["EXISTS", "rl:rollouts"]).trim() == "1"
    });
    assert_eq!(redis_cli(port, &["FLUSHALL"]).trim(), "OK");
    let status = exited(&mut score, "the scorer", &log, 20).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "{text}");
    assert!(
        text.contains("Redis lost the data of stream `rl:rollouts`")
            && text.contains("redis_stop_on_data_loss")
            && !text.contains("panicked"),
        "{text}"
    );
}

/// A replica promoted before it had the group's last reads hands out again entries the
/// consumer handled: they are dropped (and acked), the loss is reported once, and new
/// entries flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_handed_out_again_are_dropped_once_reported() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let _redis = start_redis(dir.path(), port, &EPHEMERAL);
    let bus: SharedBus = Arc::new(RedisBus::connect(&url).await.expect("redis"));
    let prompt = |i: usize| prompt_bytes(i as u64);
    let opts = ConsumerOptions {
        block: Duration::from_millis(50),
        ..ConsumerOptions::default()
    };
    let mut c = Consumer::<Prompt>::join(bus.clone(), "s", "g", "c", "dead", opts)
        .await
        .expect("join");
    bus.publish("s", &(0..6).map(prompt).collect::<Vec<_>>(), None)
        .await
        .expect("publish");
    let first = c.poll().await.expect("poll");
    assert_eq!(first.len(), 6);
    let ids: Vec<_> = first.iter().map(|d| d.id).collect();
    c.ack(&ids).await.expect("ack");
    assert!(!c.take_loss());

    // The group forgets its last reads, as a promoted replica that lacked them would.
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("conn");
    let _: () = redis::cmd("XGROUP")
        .arg(&["SETID", "s", "g", "0"][..])
        .query_async(&mut conn)
        .await
        .expect("setid");
    bus.publish("s", &[prompt(6)], None).await.expect("publish");
    let mut again = Vec::new();
    for _ in 0..3 {
        again.extend(c.poll().await.expect("poll"));
    }
    assert_eq!(
        again
            .iter()
            .map(|d| d.message.prompt_id.as_str())
            .collect::<Vec<_>>(),
        ["p6"],
        "only the new entry is handed on"
    );
    assert!(c.take_loss(), "the loss is reported");
    let group = &bus.stats("s").await.expect("stats").groups[0];
    assert_eq!(
        group.pending, 1,
        "the replayed entries were acked, p6 is in hand: {group:?}"
    );
}

/// A full Redis (`maxmemory` reached, `noeviction`) refuses writes: the feed backs off and
/// says so while a consumer still reads and acks, and once there is room every prompt is
/// on the stream exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_wait_while_redis_is_full() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let full = ["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"];
    let _redis = start_redis(dir.path(), port, &[&EPHEMERAL[..], &full[..]].concat());
    let bus: SharedBus = Arc::new(RedisBus::connect(&url).await.expect("redis"));
    bus.create_group("rl:prompts", "gen", rlstream::bus::GroupStart::Beginning)
        .await
        .expect("group");
    let log = dir.path().join("feed.log");
    let count = 30_000;
    let args = [
        "feed",
        "--redis",
        &url,
        "--task",
        "sort",
        "--count",
        &count.to_string(),
    ]
    .map(String::from);
    let mut feed = spawn(&args, &log);
    crate::common::wait_until("the feed to find Redis full", &log, || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("Redis is full"))
    });
    let length = || async { bus.stats("rl:prompts").await.expect("stats").length };
    let held = length().await;
    assert!(held < count, "{held}");
    let read = bus
        .read_group(
            "rl:prompts",
            "gen",
            "c",
            rlstream::bus::ReadFrom::New,
            10,
            None,
        )
        .await
        .expect("a full Redis still serves reads");
    let ids: Vec<_> = read.iter().map(|e| e.id).collect();
    assert_eq!(
        bus.ack("rl:prompts", "gen", &ids).await.expect("and acks"),
        10
    );
    assert!(feed.try_wait().is_none(), "the feed waits");
    // A dead letter (an atomic XADD and XACK) is refused as full too, so it is retried.
    let letter = rlstream::bus::DeadLetterRecord {
        entry_id: ids[0],
        letter: bytes::Bytes::from_static(b"x"),
    };
    let refused = bus
        .dead_letter("rl:prompts", "gen", "rl:dead", &[letter])
        .await
        .expect_err("full");
    assert!(
        matches!(refused, rlstream::bus::BusError::Full { .. }),
        "{refused:?}"
    );

    assert_eq!(
        redis_cli(port, &["CONFIG", "SET", "maxmemory", "0"]).trim(),
        "OK"
    );
    let status = exited(&mut feed, "the feed", &log, 60).await;
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{said}");
    assert!(said.contains("the bus is back"), "{said}");
    let prompts: Vec<Prompt> = crate::common::messages(&bus, "rl:prompts").await;
    let unique: std::collections::HashSet<&str> =
        prompts.iter().map(|p| p.prompt_id.as_str()).collect();
    assert_eq!(
        (prompts.len(), unique.len()),
        (count as usize, count as usize)
    );
}

/// `redis-cli -p PORT ARGS`'s output.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A primary, a replica and three sentinels on loopback; `rlstream run` names Redis through
/// the sentinels. The primary is killed mid-run: the stages follow the replica the
/// sentinels promote and the run finishes its steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stages_follow_a_sentinel_failover() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let (primary_port, replica_port) = (free_port(), free_port());
    let primary = start_redis(d, primary_port, &EPHEMERAL);
    let port = replica_port.to_string();
    let replica_of = ["--replicaof", "127.0.0.1", &primary_port.to_string()];
    let _replica = start_redis(d, replica_port, &[&EPHEMERAL[..], &replica_of[..]].concat());
    let sentinel_ports = [free_port(), free_port(), free_port()];
    let _sentinels: Vec<_> = sentinel_ports
        .iter()
        .map(|&p| crate::common::start_sentinel(d, p, primary_port, "rlprim"))
        .collect();
    crate::common::wait_until("the sentinels to see the replica", &d.join("x"), || {
        sentinel_ports
            .iter()
            .all(|&s| redis_cli(s, &["SENTINEL", "replicas", "rlprim"]).contains(&port))
            && redis_cli(replica_port, &["INFO", "replication"]).contains("master_link_status:up")
    });
    let hosts: Vec<String> = sentinel_ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let url = format!("redis+sentinel://{}/rlprim", hosts.join(","));
    let out = d.join("run");
    let log = d.join("run.log");
    let args = [
        "run",
        "--task",
        "sort",
        "--sft-steps",
        "10",
        "--steps",
        "40",
        "--redis",
        &url,
        "--namespace",
        "rl",
        "--out",
        out.to_str().expect("utf-8"),
    ]
    .map(String::from);
    let mut run = spawn(&args, &log);
    let steps = || async {
        let Ok(bus) = RedisBus::connect(&url).await else {
            return 0;
        };
        bus.range("rl:events", RangeBound::Open, RangeBound::Open, 100_000)
            .await
            .unwrap_or_default()
            .iter()
            .filter_map(|e| schema::decode::<Event>(&e.payload).ok())
            .filter(|e| e.kind == "step")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while steps().await < 5 {
        assert!(
            Instant::now() < deadline && run.try_wait().is_none(),
            "no steps before the failover:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(primary);
    let killed = Instant::now();
    crate::common::wait_until("the run to follow the new primary", &log, || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("following the new primary"))
    });
    eprintln!(
        "followed the promoted replica {:?} after the kill",
        killed.elapsed()
    );

    let status = exited(&mut run, "the run", &log, 120).await;
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{said}");
    assert!(said.contains("following the new primary"), "{said}");
    assert!(
        redis_cli(replica_port, &["INFO", "replication"]).contains("role:master"),
        "the replica was promoted"
    );
    // What the replica had not received is bounded: at most one loss per consumer.
    assert!(
        said.matches("Redis lost the data of stream").count() <= 3,
        "{said}"
    );
    let summary = std::fs::read_to_string(out.join("report/summary.json")).expect("summary");
    assert!(summary.contains("\"steps\": 40"), "{summary}");
}

/// A paced feed finds its saved schedule gone after Redis lost its data: it says so, tops
/// the backlog up again and saves its schedule anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_feed_refills_its_backlog_after_redis_loses_its_data() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let _redis = start_redis(dir.path(), port, &EPHEMERAL);
    let log = dir.path().join("feed.log");
    let args = [
        "feed",
        "--redis",
        &url,
        "--task",
        "add",
        "--count",
        "1000",
        "--reoffer",
        "0.5",
        "--backlog",
        "8",
    ]
    .map(String::from);
    let feed = spawn(&args, &log);
    let exists = |key: &str| redis_cli(port, &["EXISTS", key]).trim() == "1";
    let length = || {
        redis_cli(port, &["XLEN", "rl:prompts"])
            .trim()
            .parse::<u64>()
            .unwrap_or(0)
    };
    crate::common::wait_until("the feed to save its schedule", &log, || {
        exists("rl:feed:difficulty") && length() >= 8
    });
    assert_eq!(redis_cli(port, &["FLUSHALL"]).trim(), "OK");
    crate::common::wait_until("the feed to refill its backlog", &log, || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("saved schedule"))
            && exists("rl:feed:difficulty")
            && length() >= 8
    });
    let out = interrupt(feed, "feed", &log);
    assert!(out.status.success());
}

/// A group recreated after a loss takes the new stream's entries whatever their ids: a
/// Redis that came back empty on a host whose clock is behind numbers them below what the
/// consumer read before, and they are new work, not a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_group_takes_entries_numbered_below_what_was_read() {
    use rlstream::bus::EntryId;
    let ns = crate::common::unique_ns("lowids");
    let bus = crate::common::redis_bus().await;
    let stream = format!("{ns}:s");
    let prompt = prompt_bytes;
    let opts = ConsumerOptions {
        block: Duration::from_millis(50),
        ..ConsumerOptions::default()
    };
    let mut c = Consumer::<Prompt>::join(bus.clone(), &stream, "g", "c", "dead", opts)
        .await
        .expect("join");
    let high: Vec<_> = (0..3)
        .map(|i| (EntryId::new(9_000_000_000_000, i), prompt(i)))
        .collect();
    bus.append(&stream, &high).await.expect("append");
    let read = c.poll().await.expect("poll");
    let ids: Vec<_> = read.iter().map(|d| d.id).collect();
    c.ack(&ids).await.expect("ack");

    // The stream is gone (a flush), and comes back with lower ids.
    bus.delete(std::slice::from_ref(&stream))
        .await
        .expect("delete");
    assert!(c.poll().await.expect("recovers").is_empty());
    let low: Vec<_> = (3..5)
        .map(|i| (EntryId::new(1_000, i), prompt(i)))
        .collect();
    bus.append(&stream, &low).await.expect("append");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(c.poll().await.expect("poll"));
    }
    assert_eq!(
        got.iter()
            .map(|d| d.message.prompt_id.as_str())
            .collect::<Vec<_>>(),
        ["p3", "p4"]
    );
    assert!(c.take_loss());
    crate::common::drop_namespace(&ns).await;
}

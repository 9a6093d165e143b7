//! Replay and archives against the real thing: a real trainer run on recorded scored
//! groups, archived, restored into the embedded bus and into a real Redis, read back through
//! the real binary, trimmed, and re-trained from a checkpoint bit for bit.

use crate::common::run_ok;
use bytes::Bytes;
use rlstream::archive;
use rlstream::bus::{MemoryBus, RangeBound, SharedBus, Topology};
use rlstream::commands::replay::{self, RetrainOptions, Source};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{self, ScoredGroup};
use rlstream::weights::Transport;
use std::path::Path;
use std::sync::Arc;

const STREAMS: [&str; 6] = ["dead", "events", "prompts", "rollouts", "scored", "weights"];

fn scored(model: &Policy<InferBackend>, i: u64) -> ScoredGroup {
    let rewards: Vec<f32> = (0..4).map(|k| ((i * 7 + k * 3) % 5) as f32 / 4.0).collect();
    crate::common::sampled_group(
        model,
        &format!("g{i}"),
        vec![(i % 20) as u32 + 1, 3],
        4,
        i,
        rewards,
    )
}

fn names() -> Vec<String> {
    STREAMS.iter().map(|s| s.to_string()).collect()
}

async fn dump_to(bus: &SharedBus, topo: &Topology, path: &Path) -> archive::Moved {
    archive::dump(
        bus.as_ref(),
        topo,
        &names(),
        RangeBound::Open,
        RangeBound::Open,
        path,
        |_, _| {},
    )
    .await
    .expect("dump")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archives_round_trip_and_retraining_reproduces_the_run() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let model = crate::common::tiny_llama(d, 4);
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology {
        block_ms: 50,
        ..Topology::default()
    };
    let mut payloads: Vec<Bytes> = (0..24)
        .map(|i| Bytes::from(schema::encode(&scored(&model, i)).expect("encode")))
        .collect();
    // A malformed entry among them: dead-lettered, and shown by replay with its bytes.
    payloads.insert(9, Bytes::from_static(b"\xc1garbage"));
    bus.publish(&topo.key("scored"), &payloads, None)
        .await
        .expect("publish");
    let mut tc = crate::common::small_trainer(d, 6, 2);
    tc.policy.max_lag = 1000;
    let original = crate::common::train_alone(
        &tc,
        (bus.clone(), &topo),
        Transport::Bus,
        std::future::pending::<()>(),
    )
    .await
    .expect("train");
    assert_eq!(original.history.len(), 6);

    // dump → load (embedded bus, and a real Redis) → dump gives identical files.
    let a = d.join("run.rla");
    let moved = dump_to(&bus, &topo, &a).await;
    assert_eq!(
        moved
            .streams
            .iter()
            .find(|(s, _)| s == "scored")
            .map(|x| x.1),
        Some(25)
    );
    let restored: SharedBus = Arc::new(MemoryBus::new());
    let other = topo.clone().with_namespace("restored").expect("ns");
    archive::load(restored.as_ref(), &other, &a, None, |_, _| {})
        .await
        .expect("load");
    let b = d.join("again.rla");
    dump_to(&restored, &other, &b).await;
    let bytes_a = std::fs::read(&a).expect("read");
    assert_eq!(
        bytes_a,
        std::fs::read(&b).expect("read"),
        "memory round trip"
    );
    // Loading again over the same streams is refused, not duplicated.
    let err = archive::load(restored.as_ref(), &other, &a, None, |_, _| {})
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("fresh --namespace"), "{err}");

    let url = crate::common::redis_url();
    let ns = crate::common::unique_ns("replay");
    let a_s = a.to_str().expect("utf-8");
    let loaded = run_ok(&["load", a_s, "--redis", &url, "--namespace", &ns]);
    assert!(loaded.contains("scored 25"), "{loaded}");
    let c = d.join("redis.rla");
    run_ok(&[
        "dump",
        "--redis",
        &url,
        "--namespace",
        &ns,
        "--out",
        c.to_str().expect("utf-8"),
    ]);
    assert_eq!(
        bytes_a,
        std::fs::read(&c).expect("read"),
        "Redis round trip"
    );

    // Re-training from the checkpoint after step 2 reproduces steps 3..6 bit for bit, from
    // the archive and from Redis.
    let ck = d.join("ckpt").join("step-00000002");
    for source in [
        Source::Archive(a.clone()),
        Source::Bus {
            bus: crate::common::redis_bus().await,
            topo: Topology::default().with_namespace(&ns).expect("ns"),
        },
    ] {
        let opts = RetrainOptions {
            checkpoint: ck.clone(),
            from: RangeBound::Open,
            to: RangeBound::Open,
            steps: None,
        };
        let s = replay::retrain(&source, &opts, |_| {})
            .await
            .expect("retrain");
        assert_eq!(s.start_step, 2);
        assert_eq!(
            (s.compared, s.identical, s.first_divergence),
            (4, 4, None),
            "{s:?}"
        );
        for (r, h) in s.steps.iter().zip(&original.history[2..]) {
            assert_eq!(r.step, h.step);
            assert_eq!(r.loss.to_bits(), h.loss.to_bits());
            assert_eq!(r.grad_norm.to_bits(), h.grad_norm.to_bits());
            assert_eq!(r.reward_mean.to_bits(), h.reward_mean.to_bits());
        }
        // The 8 groups trained before the checkpoint are recognised, not trained again.
        assert_eq!(s.dropped.get("duplicate"), Some(&8), "{:?}", s.dropped);
    }
    let cli = run_ok(&[
        "replay",
        "--train",
        "--archive",
        a_s,
        "--checkpoint",
        ck.to_str().expect("utf-8"),
        "--steps",
        "3",
    ]);
    assert!(
        cli.contains("re-ran 3 steps from checkpoint step 2; 3 of 3 recorded steps bit-identical"),
        "{cli}"
    );

    // Reading: JSON lines, filters, text with per-token versions and log-probs, dead letters.
    let first = crate::common::json_lines(&run_ok(&[
        "replay",
        "--archive",
        a_s,
        "--stream",
        "scored",
        "--count",
        "2",
    ]));
    assert_eq!(first.len(), 2);
    assert_eq!(first[0]["message"]["rollout"]["group_id"], "g0");
    let g7 = crate::common::json_lines(&run_ok(&["replay", "--archive", a_s, "--group-id", "g7"]));
    assert_eq!(g7.len(), 1);
    let low = crate::common::json_lines(&run_ok(&["replay", "--archive", a_s, "--reward", "<0.5"]));
    assert!(!low.is_empty() && low.len() < 24, "{}", low.len());
    for l in &low {
        let r: Vec<f64> = serde_json::from_value(l["message"]["rewards"].clone()).expect("rewards");
        assert!(r.iter().sum::<f64>() / (r.len() as f64) < 0.5);
    }
    let text = run_ok(&[
        "replay",
        "--archive",
        a_s,
        "--format",
        "text",
        "--count",
        "1",
    ]);
    assert!(text.contains("prompt:") && text.contains("(v0 -"), "{text}");
    let dead = crate::common::json_lines(&run_ok(&[
        "replay",
        "--redis",
        &url,
        "--namespace",
        &ns,
        "--stream",
        "dead",
    ]));
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["message"]["source_stream"], "rl:scored");
    assert_eq!(dead[0]["original_hex"], "c167617262616765");
    assert!(
        dead[0]["message"]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty())
    );
    let table = run_ok(&[
        "replay",
        "--archive",
        a_s,
        "--stream",
        "events",
        "--format",
        "table",
        "--from",
        "-1h",
    ]);
    assert!(table.contains("step train"), "{table}");

    // Trim: keep the newest 5 scored entries, archiving the 20 removed.
    let t = d.join("trimmed.rla");
    let out = run_ok(&[
        "trim",
        "--redis",
        &url,
        "--namespace",
        &ns,
        "--stream",
        "scored",
        "--keep-last",
        "5",
        "--archive",
        t.to_str().expect("utf-8"),
    ]);
    assert!(out.starts_with("removed 20 entries"), "{out}");
    let kept = crate::common::json_lines(&run_ok(&["replay", "--redis", &url, "--namespace", &ns]));
    assert_eq!(kept.len(), 5);
    assert_eq!(kept[4]["message"]["rollout"]["group_id"], "g23");
    let archived: Vec<_> = archive::Reader::open(&t).expect("open").collect();
    assert_eq!(archived.len(), 20);
    crate::common::drop_namespace(&ns).await;
}

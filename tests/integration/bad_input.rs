//! Bad input at a running stage (the real `score` binary on a real Redis): a malformed
//! MessagePack entry, a newer schema major version, a log-prob/token length mismatch, a
//! NaN log-prob and a message over the topology's size limit. Each goes to the dead-letter
//! stream with its reason, the original bytes and where it came from, and is counted in
//! `rlstream_dead_letters_total`; the good groups before and after are scored, and the
//! stage keeps running. The real `train` binary does the same with non-finite rewards and
//! advantages, and trains the good groups around them.

use crate::common::{free_addr, interrupt, scrape, spawn};
use bytes::Bytes;
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema::{self, RolloutGroup, SchemaVersion, examples};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

fn encoded(g: &RolloutGroup) -> Bytes {
    Bytes::from(schema::encode(g).expect("encode"))
}

use crate::common::dead_letters;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scorer_dead_letters_each_bad_message_and_keeps_going() {
    let dir = tempfile::tempdir().expect("tmp");
    let ns = crate::common::unique_ns("badinput");
    let url = crate::common::redis_url();
    let topology = dir.path().join("topology.toml");
    std::fs::write(
        &topology,
        rlstream::bus::topology::DEFAULT_TOPOLOGY
            .replace("max_message_bytes = 67108864", "max_message_bytes = 65536")
            .replace("block_ms = 1000", "block_ms = 200"),
    )
    .expect("topology");
    let good = |id: &str| {
        let mut g = examples::rollout_group(4, 6, 32, 0);
        g.group_id = id.to_string();
        g
    };
    let mut newer = good("newer");
    newer.schema = SchemaVersion {
        major: <schema::RolloutGroup as schema::Message>::SCHEMA.major + 1,
        minor: 0,
    };
    let mut short = good("short");
    short.samples[1].logprobs.0.pop();
    let mut nan = good("nan");
    nan.samples[0].logprobs.0[2] = f32::NAN;
    let mut huge = good("huge");
    huge.meta.insert("padding".into(), "x".repeat(100_000));
    let entries = vec![
        encoded(&good("first")),
        Bytes::from_static(b"\x92\xc1\xc1 not msgpack"),
        encoded(&newer),
        encoded(&short),
        encoded(&nan),
        encoded(&huge),
        encoded(&good("last")),
    ];
    let bus = crate::common::redis_bus().await;
    bus.publish(&format!("{ns}:rollouts"), &entries, None)
        .await
        .expect("publish");

    let metrics = free_addr();
    let log = dir.path().join("score.log");
    let score = spawn(
        &[
            "score",
            "--redis",
            &url,
            "--namespace",
            &ns,
            "--topology",
            topology.to_str().expect("utf-8"),
            "--metrics-addr",
            &metrics,
        ]
        .map(str::to_string),
        &log,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let scored = bus
            .stats(&format!("{ns}:scored"))
            .await
            .expect("stats")
            .length;
        let dead = bus
            .stats(&format!("{ns}:dead"))
            .await
            .expect("stats")
            .length;
        if scored == 2 && dead == 5 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "scored {scored}, dead {dead}:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = dead_letters(&bus, &format!("{ns}:dead")).await;
    let mut reasons = Vec::new();
    for (letter, original) in letters.iter().zip(&entries[1..6]) {
        assert_eq!(letter.source_stream, format!("{ns}:rollouts"));
        assert_eq!(
            (letter.group.as_str(), letter.consumer.as_str()),
            ("score", "score-0")
        );
        assert_eq!(&letter.payload[..], &original[..], "original bytes kept");
        assert!(!letter.error.is_empty());
        reasons.push(letter.reason.clone());
    }
    let errors: Vec<&str> = letters.iter().map(|l| l.error.as_str()).collect();
    for (i, want) in [
        (1, "schema"),
        (2, "expected 6 values, found 5"),
        (3, "NaN is not finite"),
        (4, "65536"),
    ] {
        assert!(errors[i].contains(want), "letter {i}: {}", errors[i]);
    }
    // Counted by reason.
    let text = scrape(&metrics);
    let mut counted: BTreeMap<String, f64> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("rlstream_dead_letters_total{"))
    {
        if let (Some(start), Some((_, v))) = (line.find("reason=\""), line.rsplit_once(' ')) {
            let reason = line[start + 8..].split('"').next().unwrap_or_default();
            *counted.entry(reason.to_string()).or_default() += v.parse::<f64>().unwrap_or(0.0);
        }
    }
    let mut expected: BTreeMap<String, f64> = BTreeMap::new();
    for r in &reasons {
        *expected.entry(r.clone()).or_default() += 1.0;
    }
    assert_eq!(counted, expected, "{text}");
    // Still running, and stops cleanly.
    let out = interrupt(score, "score", &log);
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("scored 2 groups"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    crate::common::drop_namespace(&ns).await;
}

/// Scored groups with a NaN reward, an infinite reward and a NaN advantage among eight good
/// ones, handed to the real trainer: each bad group is dead-lettered with its reason and its
/// bytes before it reaches a step, the eight good ones are trained in two steps, and
/// nothing is left pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_dead_letters_non_finite_rewards_and_trains_the_rest() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let ns = crate::common::unique_ns("badtrain");
    let cfg = ModelConfig::tiny(Architecture::Llama, 32);
    let model = Policy::<InferBackend>::random(&cfg, 4, &Default::default()).expect("model");
    let model_dir = d.join("model");
    model.save_hf(&model_dir).expect("save");
    let good = |i: u64| {
        crate::common::sampled_group(
            &model,
            &format!("g{i}"),
            vec![(i % 20) as u32 + 1, 3],
            4,
            i,
            vec![1.0, 0.0, 0.5, 0.25],
        )
    };
    let mut nan_reward = good(100);
    nan_reward.rewards[1] = f32::NAN;
    let mut inf_reward = good(101);
    inf_reward.rewards[0] = f32::INFINITY;
    let mut nan_advantage = good(102);
    nan_advantage.advantages[2] = f32::NAN;
    let bad = [
        (nan_reward, "rewards[1]: NaN is not finite"),
        (inf_reward, "rewards[0]: inf is not finite"),
        (nan_advantage, "advantages[2]: NaN is not finite"),
    ];
    let bytes = |g: &schema::ScoredGroup| Bytes::from(schema::encode(g).expect("encode"));
    let mut entries: Vec<Bytes> = (0..8).map(|i| bytes(&good(i))).collect();
    for (k, (g, _)) in bad.iter().enumerate() {
        entries.insert(2 + 3 * k, bytes(g));
    }
    let bus = crate::common::redis_bus().await;
    let scored = format!("{ns}:scored");
    bus.publish(&scored, &entries, None).await.expect("publish");

    let ckpt = d.join("ckpt");
    let out = crate::common::train_two_steps(&ns, &model_dir, &ckpt, &[]);
    assert!(out.starts_with("trained 2 steps"), "{out}");

    let letters = dead_letters(&bus, &format!("{ns}:dead")).await;
    assert_eq!(letters.len(), bad.len(), "{letters:?}");
    for (letter, (g, want)) in letters.iter().zip(&bad) {
        assert_eq!(letter.source_stream, scored);
        assert_eq!(letter.group, "train");
        assert!(letter.error.contains(want), "{}", letter.error);
        assert_eq!(&letter.payload[..], &bytes(g)[..], "original bytes kept");
    }
    // Every entry was trained, or dead-lettered, and acked.
    let stats = bus.stats(&scored).await.expect("stats");
    let train = stats
        .groups
        .iter()
        .find(|g| g.name == "train")
        .expect("train group");
    assert_eq!((train.pending, train.lag), (0, Some(0)), "{stats:?}");
    crate::common::drop_namespace(&ns).await;
}

/// A bad config (misspelt key, impossible value, wrong type, broken TOML, a bad
/// environment override, a missing file) stops a stage before it touches Redis, with a
/// message that names the file and the key, and no panic.
#[test]
fn a_bad_config_stops_a_stage_and_names_the_key() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write config");
        path.to_str().expect("utf-8").to_string()
    };
    let cases = [
        (
            file("typo.toml", "[gen]\ngroup_sise = 4\n"),
            None,
            vec!["unknown field `group_sise`", "in `gen`"],
        ),
        (
            file("zero.toml", "[train]\ncheckpoint_every = 0\n"),
            None,
            vec!["`train`", "must be at least 1"],
        ),
        (
            file("zero_batch.toml", "[policy]\ngroups_per_step = 0\n"),
            None,
            vec!["`policy.groups_per_step`", "must be at least 1"],
        ),
        (
            file("moved.toml", "[train]\nmax_lag = 2\n"),
            None,
            vec!["moved.toml", "`[train] max_lag` is now `[policy] max_lag`"],
        ),
        (
            file("type.toml", "redis = 5\n"),
            None,
            vec!["type.toml", "expected a string", "in `redis`"],
        ),
        (
            file("broken.toml", "[train\n"),
            None,
            vec!["broken.toml", "TOML parse error at line 1"],
        ),
        (
            file("empty.toml", ""),
            Some(("RLSTREAM__TRAIN__LR", "fast")),
            vec!["empty.toml with RLSTREAM__TRAIN__LR", "in `train.lr`"],
        ),
        (
            dir.path()
                .join("missing.toml")
                .to_str()
                .expect("utf-8")
                .to_string(),
            None,
            vec!["cannot read config", "missing.toml"],
        ),
    ];
    for (config, env, wants) in cases {
        let mut cmd = crate::common::bin();
        cmd.args(["train", "--config", &config, "--steps", "1"]);
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{config}: accepted");
        assert!(!err.contains("panicked"), "{config}: {err}");
        for want in wants {
            assert!(err.contains(want), "{config}: no `{want}` in {err}");
        }
    }
}

/// A generator whose model directory has a broken or no tokenizer stops at once, naming the
/// file, rather than encoding prompts with some other tokenizer.
#[test]
fn a_tokenizer_that_cannot_be_loaded_stops_gen_with_the_file_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama");
    for (name, tokenizer, wants) in [
        ("broken", Some("{not json"), "tokenizer.json"),
        ("none", None, "no tokenizer.json"),
    ] {
        let model = dir.path().join(name);
        std::fs::create_dir_all(&model).expect("mkdir");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture.join(f), model.join(f)).expect("copy");
        }
        if let Some(text) = tokenizer {
            std::fs::write(model.join("tokenizer.json"), text).expect("write");
        }
        let ns = crate::common::unique_ns("tokenizer");
        let out = crate::common::bin()
            .args(["gen", "--model", model.to_str().expect("utf-8")])
            .args(["--redis", &crate::common::redis_url(), "--namespace", &ns])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: gen kept going\n{err}");
        assert!(err.contains(wants), "{name}: no `{wants}` in\n{err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
}

//! Teacher scoring and on-policy distillation against the real thing: the real binary's
//! gen and two teacher scorers on a real Redis, `rlstream run` on the embedded bus, and the
//! trainer's gradient with per-token advantages.

use crate::common::{drop_namespace, read_logs, redis_url, run_ok, spawn, unique_ns};
use burn::tensor::{Int, Tensor, TensorData};
use rlstream::bus::{RangeBound, RedisBus};
use rlstream::model::config::{Architecture, ModelConfig};
use rlstream::model::tokenizer::{CharTokenizer, Tokenizer};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{self, Floats, SchemaVersion, ScoredGroup};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

/// A random model over the built-in character vocabulary, saved with its tokenizer.
fn char_model(dir: &Path, cfg: &ModelConfig, seed: u64) {
    let model = Policy::<InferBackend>::random(cfg, seed, &Default::default()).expect("model");
    model.save_hf(dir).expect("save");
    Tokenizer::save_char(&rlstream::tasks::char_tokenizer(), dir).expect("tokenizer");
}

fn student_config() -> ModelConfig {
    let vocab = rlstream::tasks::char_tokenizer().vocab_size();
    ModelConfig::tiny(Architecture::Llama, vocab)
}

/// Another architecture and shape than the student's: any supported checkpoint teaches.
fn teacher_config() -> ModelConfig {
    let vocab = rlstream::tasks::char_tokenizer().vocab_size();
    ModelConfig::new(Architecture::Qwen3, vocab, 96, 192, 3, 4, 2, 24)
        .with_qk_norm(true)
        .with_max_position(512)
}

/// Log-probs of `completion` after `prompt` under `model` at temperature 1, computed apart
/// from the scorer's path: the full logits of one forward pass, log-softmax in f64 on the
/// host.
fn reference_logprobs(
    model: &Policy<InferBackend>,
    prompt: &[u32],
    completion: &[u32],
) -> Vec<f32> {
    let ids: Vec<i64> = prompt
        .iter()
        .chain(completion)
        .map(|&t| i64::from(t))
        .collect();
    let l = ids.len();
    let tokens =
        Tensor::<InferBackend, 2, Int>::from_data(TensorData::new(ids, [1, l]), &model.device());
    let logits = model.forward(tokens);
    let v = logits.dims()[2];
    let host: Vec<f32> = logits
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("host logits");
    completion
        .iter()
        .enumerate()
        .map(|(j, &tok)| {
            let row = &host[(prompt.len() - 1 + j) * v..(prompt.len() + j) * v];
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
            let lse = max
                + row
                    .iter()
                    .map(|&x| (f64::from(x) - max).exp())
                    .sum::<f64>()
                    .ln();
            (f64::from(row[tok as usize]) - lse) as f32
        })
        .collect()
}

/// gen and two teacher scorers (`--distill reverse-kl --distill-coef 0.5 --outcome-coef 0`)
/// on Redis: every group is scored once, by one of the two; its `ref_logprobs` are the
/// teacher's log-probs and its `token_rewards` 0.5 · (teacher − behaviour), each within
/// 1e-4 of an independent computation; outcome advantages are zero; it is schema 2.0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teacher_scorers_on_redis_reward_teacher_minus_behaviour() {
    let dir = tempfile::tempdir().expect("tmp");
    let (student, teacher) = (dir.path().join("student"), dir.path().join("teacher"));
    char_model(&student, &student_config(), 1);
    char_model(&teacher, &teacher_config(), 2);
    let ns = unique_ns("distill");
    let url = redis_url();
    let logs = |n: &str| dir.path().join(format!("{n}.log"));
    let with_bus = |args: &[&str]| crate::common::on_bus(args, &url, &ns);
    const GROUPS: usize = 6;
    let fed = run_ok(
        &with_bus(&["feed", "--task", "sort", "--count", &GROUPS.to_string()])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(fed.starts_with(&format!("fed {GROUPS} prompts")), "{fed}");
    let (s, t) = (
        student.to_str().expect("utf-8"),
        teacher.to_str().expect("utf-8"),
    );
    let _gen = spawn(
        &with_bus(&[
            "gen",
            "--model",
            s,
            "--group-size",
            "3",
            "--max-new-tokens",
            "6",
        ]),
        &logs("gen"),
    );
    let scorers: Vec<_> = ["score-a", "score-b"]
        .iter()
        .map(|name| {
            spawn(
                &with_bus(&[
                    "score",
                    "--teacher",
                    t,
                    "--distill",
                    "reverse-kl",
                    "--distill-coef",
                    "0.5",
                    "--outcome-coef",
                    "0",
                    "--name",
                    name,
                ]),
                &logs(name),
            )
        })
        .collect();

    let bus = RedisBus::connect(&url).await.expect("redis");
    let key = format!("{ns}:scored");
    let deadline = Instant::now() + Duration::from_secs(120);
    let entries = loop {
        let e = rlstream::bus::Bus::range(&bus, &key, RangeBound::Open, RangeBound::Open, 100)
            .await
            .expect("range");
        if e.len() >= GROUPS {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {GROUPS} groups scored in time:\n{}",
            e.len(),
            read_logs(&["gen", "score-a", "score-b"], logs)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    drop(scorers);
    let scored: Vec<ScoredGroup> = entries
        .iter()
        .map(|e| schema::decode(&e.payload).expect("a scored group"))
        .collect();
    let ids: BTreeSet<&str> = scored.iter().map(|g| g.rollout.group_id.as_str()).collect();
    assert_eq!(ids.len(), GROUPS, "each group scored once");
    let teacher_model =
        rlstream::model::hf::load_hf::<InferBackend>(&teacher, &Default::default()).expect("load");
    let mut worst: f32 = 0.0;
    for g in &scored {
        assert_eq!(g.schema, SchemaVersion { major: 2, minor: 0 });
        assert!(["score-a", "score-b"].contains(&g.scorer_id.as_str()));
        assert!(g.advantages.iter().all(|&a| a == 0.0), "--outcome-coef 0");
        let (tl, tr): (&Vec<Floats>, &Vec<Floats>) = (
            g.ref_logprobs.as_ref().expect("teacher log-probs"),
            g.token_rewards.as_ref().expect("token rewards"),
        );
        for (i, s) in g.rollout.samples.iter().enumerate() {
            let want = reference_logprobs(&teacher_model, &g.rollout.prompt_tokens, &s.tokens);
            assert_eq!(tl[i].len(), s.tokens.len());
            for (j, &w) in want.iter().enumerate() {
                worst = worst.max((tl[i][j] - w).abs());
                let reward = 0.5 * (w - s.logprobs[j]);
                worst = worst.max((tr[i][j] - reward).abs());
            }
        }
    }
    assert!(worst < 1e-4, "largest difference {worst}");
    drop_namespace(&ns).await;
}

/// A teacher whose tokenizer is not the student's is refused at start, with what differs.
#[test]
fn a_teacher_with_another_tokenizer_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let other = dir.path().join("other");
    let mut cfg = student_config();
    let tok = CharTokenizer::new("0123456789abcdef");
    cfg.vocab_size = tok.vocab_size();
    let model = Policy::<InferBackend>::random(&cfg, 3, &Default::default()).expect("model");
    model.save_hf(&other).expect("save");
    Tokenizer::save_char(&tok, &other).expect("tokenizer");
    let hf = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&hf);
    for (teacher, why) in [
        (&other, "character vocabularies differ"),
        (&hf, "the other a Hugging Face tokenizer"),
    ] {
        let out = crate::common::bin()
            .args(["score", "--redis", &redis_url(), "--namespace"])
            .arg(unique_ns("teacher-tok"))
            .arg("--teacher")
            .arg(teacher)
            .output()
            .expect("run rlstream");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains("has another tokenizer than the student"),
            "{err}"
        );
        assert!(err.contains(why), "{err}");
    }
}

/// `rlstream run --sync` on the embedded bus (repeatable bit for bit) with a teacher that
/// knows the task (a short warm start) and a random student: the steps record KL(student ‖
/// teacher), which falls as the student distills.
#[test]
fn run_distills_on_the_embedded_bus() {
    let dir = tempfile::tempdir().expect("tmp");
    let (student, teacher) = (dir.path().join("student"), dir.path().join("teacher"));
    char_model(&student, &student_config(), 1);
    crate::common::warm_start("sort", &teacher, 100, &[]);
    let out = dir.path().join("run");
    run_ok(&[
        "run",
        "--task",
        "sort",
        "--model",
        student.to_str().expect("utf-8"),
        "--teacher",
        teacher.to_str().expect("utf-8"),
        "--distill",
        "reverse-kl",
        "--outcome-coef",
        "0",
        "--token-discount",
        "0",
        "--sync",
        "--lr",
        "3e-3",
        "--steps",
        "30",
        "--eval-prompts",
        "0",
        "--plain",
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    let text = std::fs::read_to_string(out.join("report/metrics.jsonl")).expect("metrics");
    let kl: Vec<f64> = text
        .lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).expect("json");
            row["teacher_kl"]
                .as_f64()
                .unwrap_or_else(|| panic!("no teacher_kl: {l}"))
        })
        .collect();
    assert_eq!(kl.len(), 30);
    let (first, last) = (
        kl[..5].iter().sum::<f64>() / 5.0,
        kl[kl.len() - 5..].iter().sum::<f64>() / 5.0,
    );
    eprintln!("KL(student ‖ teacher) {first:.3} → {last:.3}");
    assert!(
        last < 0.7 * first,
        "KL(student ‖ teacher) {first:.3} → {last:.3}"
    );
}

/// A group the teacher cannot run (longer than its context) is bad input: dead-lettered at
/// once with the reason `context`, and the next group is still scored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_longer_than_the_teachers_context_is_dead_lettered() {
    use bytes::Bytes;
    use rlstream::bus::{MemoryBus, SharedBus, Topology};
    use rlstream::config::ScoreConfig;
    use std::sync::Arc;
    let dir = tempfile::tempdir().expect("tmp");
    let teacher = dir.path().join("teacher");
    char_model(&teacher, &teacher_config().with_max_position(12), 2);
    let tok = rlstream::tasks::char_tokenizer();
    let group = |id: &str, completion: &str| {
        let mut g = schema::examples::rollout_group(2, 1, 40, 0);
        g.group_id = id.into();
        g.prompt_tokens = tok.encode("sort:321=").into();
        g.meta.insert("answer".into(), "123".into());
        for s in &mut g.samples {
            let ids = tok.encode(completion);
            s.logprobs = vec![-1.0; ids.len()].into();
            s.tokens = ids.into();
            s.mask = None;
        }
        Bytes::from(schema::encode(&g).expect("encode"))
    };
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology::default();
    bus.publish(
        &topo.key("rollouts"),
        &[group("long", "1234"), group("fits", "123")],
        None,
    )
    .await
    .expect("publish");
    let cfg = ScoreConfig {
        teacher: Some(teacher),
        ..ScoreConfig::default()
    };
    let (b, t) = (bus.clone(), topo.clone());
    crate::common::score_until(&cfg, (b, &t), tokio::time::sleep(Duration::from_secs(3)))
        .await
        .expect("score");
    let range = |key: String| {
        let bus = bus.clone();
        async move {
            bus.range(&key, RangeBound::Open, RangeBound::Open, 10)
                .await
                .expect("range")
        }
    };
    let scored = range(topo.key("scored")).await;
    assert_eq!(scored.len(), 1);
    let g: ScoredGroup = schema::decode(&scored[0].payload).expect("decode");
    assert_eq!(g.rollout.group_id, "fits");
    assert!(
        g.ref_logprobs.is_some() && g.token_rewards.is_none(),
        "no --distill"
    );
    assert_eq!(
        g.schema,
        SchemaVersion::CURRENT,
        "no token rewards: still 1.0"
    );
    let dead = range(topo.dead_key()).await;
    assert_eq!(dead.len(), 1);
    let letter: schema::DeadLetter = schema::decode(&dead[0].payload).expect("decode");
    assert_eq!(letter.reason, "context");
    assert!(
        letter.error.contains("the teacher cannot score this group"),
        "{}",
        letter.error
    );
}

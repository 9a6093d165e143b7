//! A property test at the stage boundaries: one seeded, mixed stream of a few hundred
//! generated messages that all decode (random shapes, lengths, ids, versions, rewards,
//! masks, expert routing; valid and invalid for the model mixed) is fed to real `gen`,
//! `score` and `train`
//! processes, started once against Redis. The model is a mixture of experts, so gen records
//! routing and the trainer replays it; routing shaped for another model must be refused. Every stage stays alive, every input is accounted
//! for (generated, scored, trained, dead-lettered with a reason, or in the trainer's last
//! partial batch), and every valid message is processed.
//!
//! The seed is printed; `RLSTREAM_PROPTEST_SEED=N` replays one. Validity is judged here by
//! rules written independently of `rlstream::schema::Limits`.

use crate::common::{free_addr, interrupt, scrape, spawn};
use bytes::Bytes;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rlstream::bus::{RangeBound, SharedBus};
use rlstream::model::tokenizer::Tokenizer;
use rlstream::model::{Architecture, InferBackend, ModelConfig, MoeConfig, Policy};
use rlstream::schema::{
    self, Event, FinishReason, Prompt, RolloutGroup, Routing, RoutingShape, Sample, SamplingMask,
    SchemaVersion, ScoredGroup, VersionRun,
};
use rlstream::stages::score::{AdvantageKind, advantages};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// The model's context.
const CONTEXT: usize = 24;
const GROUPS_PER_STEP: usize = 4;
/// Messages per input stream.
const PER_STREAM: usize = 100;
const ANSWER: &str = "abc";

fn vocab() -> u32 {
    rlstream::tasks::char_tokenizer().vocab_size() as u32
}

/// A token id, now and then one past the vocabulary.
fn id() -> impl Strategy<Value = u32> {
    let v = vocab();
    prop_oneof![30 => 0..v, 1 => v..v + 3]
}

fn ids(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(id(), 0..=max)
}

/// A completion as gen would write it, with random tokens, log-probs, version runs and
/// (sometimes) a sampling mask whose kept sets add one random id.
fn sample() -> impl Strategy<Value = Sample> {
    (
        ids(12),
        prop::collection::vec(-8.0f32..=0.0, 12),
        0usize..12,
        0u64..40,
        0u64..3,
        prop::option::weighted(0.3, prop::collection::vec(id(), 12)),
    )
        .prop_map(|(tokens, lp, split, v0, dv, extra)| {
            let n = tokens.len();
            let mut versions = Vec::new();
            if n > 0 {
                versions.push(VersionRun {
                    start: 0,
                    version: v0,
                });
                if split > 0 && split < n && dv > 0 {
                    versions.push(VersionRun {
                        start: split as u32,
                        version: v0 + dv,
                    });
                }
            }
            let mask = extra.filter(|_| n > 0).map(|extra| {
                let (mut offsets, mut kept) = (vec![0u32], Vec::new());
                for (i, &t) in tokens.iter().enumerate() {
                    kept.push(t);
                    if extra[i] != t {
                        kept.push(extra[i]);
                    }
                    offsets.push(kept.len() as u32);
                }
                SamplingMask {
                    offsets: offsets.into(),
                    ids: kept.into(),
                }
            });
            Sample {
                logprobs: lp[..n].to_vec().into(),
                tokens: tokens.into(),
                versions,
                finish: FinishReason::Length,
                mask,
                env: Vec::new(),
                turn_rewards: Vec::new(),
                routing: None,
            }
        })
}

/// The model's routing shape: 2 MoE layers, top-2 of 4 experts.
const ROUTING: RoutingShape = RoutingShape {
    layers: 2,
    k: 2,
    experts: 4,
};

/// Routing for `tokens` tokens of `shape`, ids drawn from `seed` (distinct per token and
/// layer, as a router's top-k are).
fn routing(shape: RoutingShape, tokens: usize, seed: &mut u64) -> Routing {
    let mut ids = Vec::new();
    for _ in 0..tokens * shape.layers as usize {
        let mut chosen: Vec<u16> = Vec::new();
        while chosen.len() < shape.k as usize {
            *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let id = ((*seed >> 33) % u64::from(shape.experts)) as u16;
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        ids.extend(chosen);
    }
    Routing::pack(shape, &ids)
}

/// Half the groups carry routing: mostly the model's shape, now and then another model's
/// (a layer more, or more experts, so ids past the model's).
fn routing_shape() -> impl Strategy<Value = Option<(RoutingShape, u64)>> {
    let shape = prop_oneof![
        8 => Just(ROUTING),
        1 => Just(RoutingShape { layers: 3, ..ROUTING }),
        1 => Just(RoutingShape { experts: 9, ..ROUTING }),
    ];
    prop::option::weighted(0.5, (shape, any::<u64>()))
}

/// A rollout group with 1–4 samples; one in ten has no answer to score against.
fn rollout(id: String) -> impl Strategy<Value = RolloutGroup> {
    (
        ids(CONTEXT + 2),
        prop::collection::vec(sample(), 1..=4),
        prop::bool::weighted(0.9),
        routing_shape(),
    )
        .prop_map(move |(prompt, mut samples, answered, routed)| {
            let mut g = schema::examples::rollout_group(1, 1, 2, 0);
            g.group_id = id.clone();
            g.prompt_id = format!("prompt-{id}");
            g.task = "test".into();
            if let Some((shape, mut seed)) = routed {
                g.prompt_routing = Some(routing(shape, prompt.len(), &mut seed));
                for s in &mut samples {
                    s.routing = Some(routing(shape, s.tokens.len().saturating_sub(1), &mut seed));
                }
            }
            g.schema = RolloutGroup::version_for(&samples);
            g.prompt_tokens = prompt.into();
            g.samples = samples;
            g.sampling.stop_tokens = vec![];
            g.meta = if answered {
                BTreeMap::from([("answer".to_string(), ANSWER.to_string())])
            } else {
                BTreeMap::new()
            };
            g
        })
}

fn scored(id: String) -> impl Strategy<Value = ScoredGroup> {
    (rollout(id), prop::collection::vec(-2.0f32..=2.0, 4)).prop_map(|(mut r, rewards)| {
        r.meta = BTreeMap::from([("answer".to_string(), ANSWER.to_string())]);
        let rewards = rewards[..r.samples.len()].to_vec();
        ScoredGroup {
            schema: ScoredGroup::version_for(&r, &None),
            advantages: advantages(&rewards, AdvantageKind::Grpo),
            rewards,
            rollout: r,
            token_rewards: None,
            ref_logprobs: None,
            scorer_id: "property".into(),
            scored_us: 0,
        }
    })
}

fn prompt(id: String) -> impl Strategy<Value = Prompt> {
    ids(CONTEXT + 2).prop_map(move |tokens| Prompt {
        prompt_id: id.clone(),
        task: "test".into(),
        text: String::new(),
        prompt_tokens: Some(tokens.into()),
        meta: BTreeMap::from([("answer".to_string(), ANSWER.to_string())]),
        ..schema::examples::prompt()
    })
}

// ---- what the model can run, by this test's own rules ----

fn in_vocab(ids: &[u32]) -> bool {
    ids.iter().all(|&t| t < vocab())
}

/// gen takes a prompt whose ids are in the vocabulary and that leaves room for a token (an
/// empty prompt stands as one BOS token).
fn gen_takes(p: &Prompt) -> bool {
    let t = p
        .prompt_tokens
        .as_ref()
        .map(|t| t.as_slice())
        .unwrap_or(&[]);
    in_vocab(t) && t.len().max(1) < CONTEXT
}

/// The built-in scorer needs an answer and completions it can detokenize.
fn score_takes(g: &RolloutGroup) -> bool {
    g.meta.contains_key("answer") && g.samples.iter().all(|s| in_vocab(&s.tokens))
}

/// The trainer needs a prompt, ids in the vocabulary (kept sets too), every sample
/// within the context, and routing (if any) of the model's shape.
fn train_takes(g: &RolloutGroup) -> bool {
    let p = g.prompt_tokens.as_slice();
    !p.is_empty()
        && g.prompt_routing.as_ref().is_none_or(|r| {
            (r.layers, r.k, r.experts) == (ROUTING.layers, ROUTING.k, ROUTING.experts)
        })
        && in_vocab(p)
        && g.samples.iter().all(|s| {
            in_vocab(&s.tokens)
                && s.mask.as_ref().is_none_or(|m| in_vocab(&m.ids))
                && p.len() + s.tokens.len() <= CONTEXT
        })
}

fn model(dir: &Path) {
    let mut cfg = ModelConfig::tiny(Architecture::Qwen3Moe, vocab() as usize)
        .with_qk_norm(true)
        .with_moe(Some(MoeConfig::new(
            ROUTING.experts as usize,
            ROUTING.k as usize,
            32,
        )));
    cfg.max_position = CONTEXT;
    let model = Policy::<InferBackend>::random(&cfg, 9, &Default::default()).expect("model");
    model.save_hf(dir).expect("save");
    Tokenizer::save_char(&rlstream::tasks::char_tokenizer(), dir).expect("tokenizer");
}

/// The seed: `RLSTREAM_PROPTEST_SEED`, else the clock.
fn seed() -> u64 {
    std::env::var("RLSTREAM_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rlstream::time::now_us)
}

/// One input: the stream it goes to and its bytes.
struct Input {
    stream: &'static str,
    bytes: Bytes,
}

struct Generated {
    prompts: Vec<Prompt>,
    rollouts: Vec<RolloutGroup>,
    scored: Vec<ScoredGroup>,
    /// All of them, interleaved in a seeded order.
    order: Vec<Input>,
}

fn bytes<M: schema::Message>(m: &M) -> Bytes {
    Bytes::from(schema::encode(m).expect("encode"))
}

/// One value of `strategy`, no shrinking.
fn draw<T: std::fmt::Debug>(runner: &mut TestRunner, strategy: impl Strategy<Value = T>) -> T {
    strategy.new_tree(runner).expect("a value").current()
}

fn generate(seed: u64) -> Generated {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &key);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let mut out = Generated {
        prompts: Vec::new(),
        rollouts: Vec::new(),
        scored: Vec::new(),
        order: Vec::new(),
    };
    let mut inputs = Vec::new();
    for i in 0..PER_STREAM {
        let p = draw(&mut runner, prompt(format!("p{i:03}")));
        inputs.push(Input {
            stream: "prompts",
            bytes: bytes(&p),
        });
        out.prompts.push(p);
        let r = draw(&mut runner, rollout(format!("r{i:03}")));
        inputs.push(Input {
            stream: "rollouts",
            bytes: bytes(&r),
        });
        out.rollouts.push(r);
        let g = draw(&mut runner, scored(format!("s{i:03}")));
        inputs.push(Input {
            stream: "scored",
            bytes: bytes(&g),
        });
        out.scored.push(g);
    }
    // A seeded feeding order across the three streams.
    let order = draw(
        &mut runner,
        Just((0..inputs.len()).collect::<Vec<usize>>()).prop_shuffle(),
    );
    let mut slots: Vec<Option<Input>> = inputs.into_iter().map(Some).collect();
    out.order = order.into_iter().filter_map(|i| slots[i].take()).collect();
    out
}

/// Dead letters by the stream they came from: (message id, reason).
async fn dead_by_stream(bus: &SharedBus, ns: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let mut out: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for l in crate::common::dead_letters(bus, &format!("{ns}:dead")).await {
        let stream = l.source_stream.rsplit(':').next().unwrap_or("").to_string();
        let id = match stream.as_str() {
            "prompts" => schema::decode::<Prompt>(&l.payload).map(|p| p.prompt_id),
            "rollouts" => schema::decode::<RolloutGroup>(&l.payload).map(|g| g.group_id),
            _ => schema::decode::<ScoredGroup>(&l.payload).map(|g| g.rollout.group_id),
        }
        .expect("a dead letter keeps the original message");
        out.entry(stream).or_default().push((id, l.reason));
    }
    out
}

/// (lag, pending) of `group` on `ns:stream`.
async fn progress(bus: &SharedBus, ns: &str, stream: &str, group: &str) -> (u64, u64) {
    let s = bus.stats(&format!("{ns}:{stream}")).await.expect("stats");
    s.groups
        .iter()
        .find(|g| g.name == group)
        .map_or((u64::MAX, 0), |g| (g.lag.unwrap_or(u64::MAX), g.pending))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_is_processed_or_refused_and_no_stage_stops() {
    let seed = seed();
    eprintln!(
        "stage boundary property test: seed {seed} (RLSTREAM_PROPTEST_SEED={seed} replays it)"
    );
    let generated = generate(seed);
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let ns = crate::common::unique_ns("boundaries");
    let model_dir = d.join("model");
    model(&model_dir);
    let m = model_dir.to_str().expect("utf-8");
    let url = crate::common::redis_url();
    let base = |v: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = v.iter().map(|s| s.to_string()).collect();
        a.extend(["--redis", &url, "--namespace", &ns].map(String::from));
        a
    };
    let log = |n: &str| d.join(format!("{n}.log"));
    let policy = ["--max-lag", "1000000", "--groups-per-step", "4"];
    let mut generator = spawn(
        &base(
            &[
                &[
                    "gen",
                    "--model",
                    m,
                    "--group-size",
                    "2",
                    "--max-new-tokens",
                    "6",
                    "--max-batch",
                    "8",
                ][..],
                &policy[..],
            ]
            .concat(),
        ),
        &log("gen"),
    );
    let mut score = spawn(&base(&["score"]), &log("score"));
    let ckpt = d.join("ckpt");
    let metrics = free_addr();
    let mut train = spawn(
        &base(
            &[
                &[
                    "train",
                    "--model",
                    m,
                    "--steps",
                    "0",
                    "--metrics-addr",
                    &metrics,
                    "--checkpoint-dir",
                    ckpt.to_str().expect("utf-8"),
                ][..],
                &policy[..],
            ]
            .concat(),
        ),
        &log("train"),
    );
    let logs = || crate::common::read_logs(&["gen", "score", "train"], log);

    // Feed the mixed stream in its seeded order, a few entries at a time.
    let bus = crate::common::redis_bus().await;
    for chunk in generated.order.chunks(5) {
        for input in chunk {
            bus.publish(
                &format!("{ns}:{}", input.stream),
                std::slice::from_ref(&input.bytes),
                None,
            )
            .await
            .expect("publish");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Wait until every stage has taken everything and the trainer has stopped stepping.
    let deadline = Instant::now() + Duration::from_secs(240);
    let (mut last_steps, mut still) = (usize::MAX, 0);
    loop {
        for (name, p) in [
            ("gen", &mut generator),
            ("score", &mut score),
            ("train", &mut train),
        ] {
            assert!(
                p.try_wait().is_none(),
                "{name} stopped (seed {seed}):\n{}",
                logs()
            );
        }
        let prompts = progress(&bus, &ns, "prompts", "gen").await;
        let rollouts = progress(&bus, &ns, "rollouts", "score").await;
        let scored = progress(&bus, &ns, "scored", "train").await;
        let steps = crate::common::messages::<Event>(&bus, &format!("{ns}:events"))
            .await
            .iter()
            .filter(|e| e.kind == "step")
            .count();
        let drained = prompts == (0, 0) && rollouts == (0, 0) && scored.0 == 0;
        still = if drained && steps == last_steps {
            still + 1
        } else {
            0
        };
        last_steps = steps;
        if still >= 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pipeline did not drain (seed {seed}): prompts {prompts:?}, rollouts {rollouts:?}, scored {scored:?}\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let exposition = scrape(&metrics);
    for (name, p, l) in [
        ("gen", generator, "gen"),
        ("score", score, "score"),
        ("train", train, "train"),
    ] {
        let out = interrupt(p, name, &log(l));
        assert!(out.status.success(), "{name} (seed {seed}):\n{}", logs());
    }

    let dead = dead_by_stream(&bus, &ns).await;
    let dead_ids = |stream: &str| -> BTreeMap<String, String> {
        dead.get(stream).into_iter().flatten().cloned().collect()
    };
    let rollouts: Vec<RolloutGroup> =
        crate::common::messages(&bus, &format!("{ns}:rollouts")).await;
    let scored: Vec<ScoredGroup> = crate::common::messages(&bus, &format!("{ns}:scored")).await;

    // gen: each prompt was generated or dead-lettered, by the rules.
    let generated_from: BTreeSet<&str> = rollouts.iter().map(|g| g.prompt_id.as_str()).collect();
    let gen_dead = dead_ids("prompts");
    for p in &generated.prompts {
        let id = p.prompt_id.as_str();
        let (made, refused) = (generated_from.contains(id), gen_dead.contains_key(id));
        assert!(
            made != refused,
            "prompt {id}: generated {made}, dead-lettered {refused} (seed {seed})"
        );
        assert_eq!(made, gen_takes(p), "prompt {id}: {p:?} (seed {seed})");
    }

    // score: each rollout (fed or generated) was scored or dead-lettered.
    let scored_ids: BTreeSet<&str> = scored.iter().map(|g| g.rollout.group_id.as_str()).collect();
    let score_dead = dead_ids("rollouts");
    for g in &rollouts {
        let id = g.group_id.as_str();
        let (done, refused) = (scored_ids.contains(id), score_dead.contains_key(id));
        assert!(
            done != refused,
            "rollout {id}: scored {done}, dead-lettered {refused} (seed {seed})"
        );
        assert_eq!(done, score_takes(g), "rollout {id}: {g:?} (seed {seed})");
    }

    // train: each scored group (fed or from the scorer) was trained, dead-lettered, or is in
    // the last partial batch; nothing was dropped (ids are unique, max_lag is wide).
    let trained: HashSet<String> = crate::common::trained_groups(&ckpt).into_iter().collect();
    let dropped: BTreeMap<String, u64> =
        serde_json::from_value(crate::common::checkpoint_state(&ckpt)["dropped"].clone())
            .unwrap_or_default();
    assert!(
        dropped.values().all(|&n| n == 0),
        "dropped {dropped:?} (seed {seed})"
    );
    let train_dead = dead_ids("scored");
    let pending_ids = crate::common::pending(&ns, "scored", "train").await;
    let all_scored = bus
        .range(
            &format!("{ns}:scored"),
            RangeBound::Open,
            RangeBound::Open,
            1_000_000,
        )
        .await
        .expect("range");
    let mut waiting = 0;
    for e in &all_scored {
        let g: ScoredGroup = schema::decode(&e.payload).expect("decodes");
        let id = g.rollout.group_id.as_str();
        let (t, refused, partial) = (
            trained.contains(id),
            train_dead.contains_key(id),
            pending_ids.contains(&e.id),
        );
        assert_eq!(
            [t, refused, partial].iter().filter(|&&b| b).count(),
            1,
            "scored {id}: trained {t}, dead-lettered {refused}, in the last batch {partial} (seed {seed})"
        );
        assert_eq!(
            !refused,
            train_takes(&g.rollout),
            "scored {id}: {g:?} (seed {seed})"
        );
        waiting += usize::from(partial);
    }
    assert!(
        waiting < GROUPS_PER_STEP,
        "{waiting} groups left untrained (seed {seed})"
    );

    // Every refusal has its reason, and the trainer's are counted by reason.
    let reasons: BTreeSet<&str> = dead.values().flatten().map(|(_, r)| r.as_str()).collect();
    for r in &reasons {
        assert!(
            [
                "vocabulary",
                "context",
                "shape",
                "routing",
                "detokenize",
                "no_answer"
            ]
            .contains(r),
            "unexpected reason {r} (seed {seed}): {dead:?}"
        );
    }
    // gen recorded the routing of what it generated, the trainer's refusals of another
    // model's routing say so, and its steps report the mismatch of the routing it replayed.
    let fed_prompts: BTreeSet<&str> = generated
        .prompts
        .iter()
        .map(|p| p.prompt_id.as_str())
        .collect();
    let from_gen: Vec<&RolloutGroup> = rollouts
        .iter()
        .filter(|g| fed_prompts.contains(g.prompt_id.as_str()))
        .collect();
    assert!(!from_gen.is_empty(), "gen generated nothing (seed {seed})");
    for g in &from_gen {
        let r = g.prompt_routing.as_ref().expect("gen records routing");
        assert_eq!(r.shape(), ROUTING);
        assert_eq!(g.schema, SchemaVersion { major: 2, minor: 2 });
    }
    let foreign = |g: &RolloutGroup| {
        g.prompt_routing
            .as_ref()
            .is_some_and(|r| r.shape() != ROUTING)
    };
    for e in &all_scored {
        let g: ScoredGroup = schema::decode(&e.payload).expect("decodes");
        if foreign(&g.rollout)
            && let Some(reason) = train_dead.get(&g.rollout.group_id)
        {
            assert_eq!(reason, "routing", "{} (seed {seed})", g.rollout.group_id);
        }
    }
    assert!(
        exposition.contains("rlstream_routing_mismatch_fraction "),
        "the trainer reports the routing mismatch (seed {seed})"
    );
    let counted: f64 = exposition
        .lines()
        .filter(|l| l.starts_with("rlstream_dead_letters_total{") && l.contains("group=\"train\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted as usize, train_dead.len(), "{exposition}");
    eprintln!(
        "seed {seed}: {} prompts, {} rollouts, {} scored fed; dead-lettered {:?}; trained {}",
        generated.prompts.len(),
        generated.rollouts.len(),
        generated.scored.len(),
        dead.iter()
            .map(|(s, v)| (s.as_str(), v.len()))
            .collect::<Vec<_>>(),
        trained.len()
    );
    crate::common::drop_namespace(&ns).await;
}

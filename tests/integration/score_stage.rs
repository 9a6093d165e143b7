//! The score stage on the embedded bus: built-in verifiers, the Python example verifier
//! over JSON lines, and a broken external scorer (retried, then dead-lettered).

use crate::common::dead_letters;
use bytes::Bytes;
use rlstream::bus::{MemoryBus, RangeBound, SharedBus, Topology};
use rlstream::config::ScoreConfig;
use rlstream::schema::{self, RolloutGroup, ScoredGroup, examples};
use rlstream::stages::score::{self, AdvantageKind};
use rlstream::tasks;
use std::sync::Arc;
use std::time::Duration;

/// A group of 3 completions of `rev:abc=`: right, right but upper-case, wrong.
fn group() -> RolloutGroup {
    let tok = tasks::char_tokenizer();
    let mut g = examples::rollout_group(3, 1, 40, 0);
    g.prompt_tokens = tok.encode("rev:abc=").into();
    g.meta.insert("answer".into(), "cba".into());
    g.meta.insert("verifier".into(), "exact".into());
    g.sampling.stop_tokens = vec![0];
    for (s, text) in g.samples.iter_mut().zip(["cba", " cba ", "abc"]) {
        let mut ids = tok.encode(text);
        ids.push(0);
        s.logprobs = vec![-0.5; ids.len()].into();
        s.tokens = ids.into();
        s.versions = vec![(0, 0).into()];
    }
    g
}

async fn score_one(cfg: ScoreConfig, topo: Topology) -> (SharedBus, Vec<ScoredGroup>) {
    score_groups(cfg, topo, &[group()]).await
}

/// Runs a scorer over `groups` for 3 s; the bus and what it published.
async fn score_groups(
    cfg: ScoreConfig,
    topo: Topology,
    groups: &[RolloutGroup],
) -> (SharedBus, Vec<ScoredGroup>) {
    score_waves(cfg, topo, &[groups], Duration::ZERO).await
}

/// Runs a scorer for 3 s over `waves` of groups: the first published before it starts,
/// each next one `gap` after the last; the bus and what it published.
async fn score_waves(
    cfg: ScoreConfig,
    topo: Topology,
    waves: &[&[RolloutGroup]],
    gap: Duration,
) -> (SharedBus, Vec<ScoredGroup>) {
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let rollouts = topo.key("rollouts");
    let publish = |groups: &[RolloutGroup]| {
        let payloads: Vec<Bytes> = groups
            .iter()
            .map(|g| Bytes::from(schema::encode(g).unwrap()))
            .collect();
        let (bus, key) = (bus.clone(), rollouts.clone());
        async move { bus.publish(&key, &payloads, None).await.unwrap() }
    };
    publish(waves[0]).await;
    let stage = {
        let (bus, topo) = (bus.clone(), topo.clone());
        tokio::spawn(async move {
            crate::common::score_until(
                &cfg,
                (bus, &topo),
                tokio::time::sleep(Duration::from_secs(3)),
            )
            .await
        })
    };
    for wave in &waves[1..] {
        tokio::time::sleep(gap).await;
        publish(wave).await;
    }
    stage.await.unwrap().unwrap();
    let out = bus
        .range(&topo.key("scored"), RangeBound::Open, RangeBound::Open, 10)
        .await
        .unwrap()
        .iter()
        .map(|e| schema::decode::<ScoredGroup>(&e.payload).unwrap())
        .collect();
    (bus, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_verifier_rewards_and_normalises() {
    let (_, out) = score_one(ScoreConfig::default(), Topology::default()).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].rewards, vec![1.0, 1.0, 0.0], "trimmed exact match");
    let adv = score::advantages(&out[0].rewards, AdvantageKind::Grpo);
    assert_eq!(out[0].advantages, adv);
    assert!(adv[0] > 0.0 && adv[2] < 0.0);
}

/// Reward shaping by length (DAPO's soft overlong penalty) lowers the rewards before the
/// advantages, and the outcomes event the scorer publishes counts the verifier's passes
/// before shaping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_penalty_shapes_rewards_and_outcomes_count_unshaped_passes() {
    let mut g = group();
    // Completions of 4, 6 and 4 tokens under a limit of 6 with a buffer of 4: free up to 2.
    g.sampling.max_new_tokens = 6;
    let cfg = ScoreConfig {
        overlong_buffer: 4,
        overlong_penalty: 1.0,
        ..ScoreConfig::default()
    };
    let topo = Topology::default();
    let (bus, out) = score_groups(cfg, topo.clone(), &[g]).await;
    assert_eq!(out[0].rewards, vec![0.5, 0.0, -0.5]);
    assert_eq!(
        out[0].advantages,
        score::advantages(&out[0].rewards, AdvantageKind::Grpo)
    );
    let events: Vec<schema::Event> = crate::common::messages(&bus, &topo.key("events")).await;
    let outcomes: Vec<&schema::Event> = events
        .iter()
        .filter(|e| e.kind == schema::Event::OUTCOMES)
        .collect();
    assert_eq!(outcomes.len(), 1, "{events:?}");
    assert_eq!(
        outcomes[0].schema,
        schema::SchemaVersion { major: 1, minor: 1 }
    );
    assert_eq!(
        outcomes[0].outcomes,
        vec![schema::PromptOutcome {
            prompt_id: group().prompt_id,
            passed: 2,
            samples: 3
        }]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_example_verifier_scores_over_json_lines() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/verifier.py");
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {script}")),
        advantage: AdvantageKind::Nostd,
        ..ScoreConfig::default()
    };
    let (_, out) = score_one(cfg, Topology::default()).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].rewards, vec![1.0, 0.5, 0.0]);
    assert_eq!(out[0].advantages, vec![0.5, 0.0, -0.5]);
}

/// A pool of three external scorers (each answering after 50 ms, so their calls overlap)
/// scores a batch of seven groups: every group gets its own rewards, in its own order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_scorers_answers_each_group_with_its_own_rewards() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/verifier.py");
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {script} --latency-ms 50")),
        scorers: 3,
        ..ScoreConfig::default()
    };
    let (_, out) = score_groups(cfg, Topology::default(), &seven_groups()).await;
    assert_eq!(rewards_by_group(&out), verifier_rewards());
}

/// Seven groups `g0`..`g6`, every other one with the answer `abc`.
fn seven_groups() -> Vec<RolloutGroup> {
    (0..7)
        .map(|i| {
            let mut g = group();
            g.group_id = format!("g{i}");
            if i % 2 == 1 {
                g.meta.insert("answer".into(), "abc".into());
            }
            g
        })
        .collect()
}

/// What the example verifier gives [`seven_groups`], in order.
fn verifier_rewards() -> Vec<(String, Vec<f32>)> {
    (0..7)
        .map(|i| {
            let r = if i % 2 == 1 {
                vec![0.0, 0.0, 1.0]
            } else {
                vec![1.0, 0.5, 0.0]
            };
            (format!("g{i}"), r)
        })
        .collect()
}

/// Each scored group's id and rewards, in the order published.
fn rewards_by_group(out: &[ScoredGroup]) -> Vec<(String, Vec<f32>)> {
    out.iter()
        .map(|g| (g.rollout.group_id.clone(), g.rewards.clone()))
        .collect()
}

/// Scorer processes that hold several groups each (`scorer_in_flight`): the example
/// verifier echoes each `request_id`, and every group gets its own rewards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scorers_holding_several_groups_each_answer_each_group() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/verifier.py");
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {script} --latency-ms 50")),
        scorers: 2,
        scorer_in_flight: 3,
        ..ScoreConfig::default()
    };
    let (_, out) = score_groups(cfg, Topology::default(), &seven_groups()).await;
    assert_eq!(rewards_by_group(&out), verifier_rewards());
}

/// A scorer that answers the groups it holds in reverse order (the later a group, the
/// sooner its answer): answers are matched by `request_id`, not by order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_out_of_order_reach_their_own_groups() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("reverse.py");
    std::fs::write(
        &script,
        r#"import json, sys, threading, time
lock = threading.Lock()
def answer(req):
    i = int(req["group_id"][1:])
    time.sleep(0.5 - 0.06 * i)
    with lock:
        print(json.dumps({"request_id": req["request_id"], "rewards": [float(i)] * len(req["completions"])}), flush=True)
for line in sys.stdin:
    threading.Thread(target=answer, args=(json.loads(line),)).start()
"#,
    )
    .unwrap();
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {}", script.display())),
        scorer_in_flight: 7,
        ..ScoreConfig::default()
    };
    let (bus, out) = score_groups(cfg, Topology::default(), &seven_groups()).await;
    let want: Vec<(String, Vec<f32>)> = (0..7)
        .map(|i| (format!("g{i}"), vec![i as f32; 3]))
        .collect();
    assert_eq!(rewards_by_group(&out), want);
    assert!(
        dead_letters(&bus, &Topology::default().dead_key())
            .await
            .is_empty()
    );
}

/// The stage polls while a batch is being scored: a scorer that answers nothing until it
/// holds all seven groups gets the three that arrive after the first four are out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_arriving_while_a_batch_is_scored_are_started_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("hold_seven.py");
    std::fs::write(
        &script,
        r#"import json, sys
held = []
for line in sys.stdin:
    held.append(json.loads(line))
    if len(held) == 7:
        for req in held:
            print(json.dumps({"request_id": req["request_id"], "rewards": [1.0] * len(req["completions"])}), flush=True)
"#,
    )
    .unwrap();
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {}", script.display())),
        scorer_in_flight: 8,
        ..ScoreConfig::default()
    };
    let groups = seven_groups();
    let waves: [&[RolloutGroup]; 2] = [&groups[..4], &groups[4..]];
    let gap = Duration::from_millis(300);
    let (_, out) = score_waves(cfg, Topology::default(), &waves, gap).await;
    assert_eq!(out.len(), 7, "all seven scored within the run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_scorer_is_retried_then_dead_lettered() {
    let topo = Topology {
        claim_idle_ms: 100,
        max_deliveries: 2,
        block_ms: 50,
        ..Topology::default()
    };
    let cfg = ScoreConfig {
        // Exits at once: every request fails.
        scorer_cmd: Some("false".into()),
        ..ScoreConfig::default()
    };
    let (bus, out) = score_one(cfg, topo.clone()).await;
    assert!(out.is_empty());
    let dead = dead_letters(&bus, &topo.dead_key()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].deliveries, 2);
    assert!(dead[0].error.contains("scorer"), "{}", dead[0].error);
}

/// A completion that is not the tokenizer's text is no empty string scored 0: its group is
/// dead-lettered at once with reason `detokenize`, and the next group is scored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_cannot_be_detokenized_dead_letters_its_group() {
    let topo = Topology::default();
    let past = tasks::char_tokenizer().vocab_size() as u32;
    let mut bad = group();
    bad.group_id = "bad".into();
    let mut ids = bad.samples[1].tokens.to_vec();
    ids[0] = past;
    bad.samples[1].tokens = ids.into();
    let (bus, out) = score_groups(ScoreConfig::default(), topo.clone(), &[bad, group()]).await;
    assert_eq!(out.len(), 1, "the good group is still scored");
    assert_ne!(out[0].rollout.group_id, "bad");
    let dead = dead_letters(&bus, &topo.dead_key()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, score::DETOKENIZE);
    assert_eq!(dead[0].deliveries, 1, "not retried: retrying cannot help");
    assert!(dead[0].error.contains("completion 1"), "{}", dead[0].error);
    assert!(
        dead[0].error.contains(&format!("token id {past}")),
        "{}",
        dead[0].error
    );
}

/// Completions of `rev:a,b,c=` (answer `c,b,a`), each ending with the stop token: all
/// three steps right, the first step right, nothing right.
fn stepped_group() -> RolloutGroup {
    let tok = tasks::char_tokenizer();
    let mut g = group();
    g.prompt_tokens = tok.encode("rev:a,b,c=").into();
    g.meta.insert("answer".into(), "c,b,a".into());
    for (s, text) in g.samples.iter_mut().zip(["c,b,a", "c,a,b", "abc"]) {
        let mut ids = tok.encode(text);
        ids.push(0);
        s.logprobs = vec![-0.5; ids.len()].into();
        s.tokens = ids.into();
    }
    g
}

fn token_rewards(g: &ScoredGroup) -> Vec<Vec<f32>> {
    g.token_rewards
        .as_ref()
        .expect("token rewards")
        .iter()
        .map(|r| r.to_vec())
        .collect()
}

/// Per-step rewards: the text is split after each `,`, and each step's reward sits on its
/// last token (the `,`, or the last character of the last step); the stop token gets none.
/// The group carries token rewards, so it is written as schema 2.0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_scorer_places_step_rewards_on_each_steps_last_token() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/step_verifier.py");
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {script} --per step --separator ,")),
        step_separator: Some(",".into()),
        ..ScoreConfig::default()
    };
    let (_, out) = score_groups(cfg, Topology::default(), &[stepped_group()]).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].schema, schema::SchemaVersion { major: 2, minor: 0 });
    assert_eq!(out[0].rewards, vec![1.0, 0.0, 0.0]);
    assert_eq!(
        token_rewards(&out[0]),
        vec![
            vec![0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
            vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
            vec![0.0, 0.0, 0.0, 0.0],
        ]
    );
}

/// Per-token rewards by index land on those tokens; an answer that names a token past the
/// completion is refused like any bad answer (retried, then dead-lettered with the reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_scorer_places_rewards_by_token_index_and_bad_ones_are_refused() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/step_verifier.py");
    let cfg = ScoreConfig {
        scorer_cmd: Some(format!("python3 {script} --per token")),
        ..ScoreConfig::default()
    };
    let (_, out) = score_groups(cfg, Topology::default(), &[stepped_group()]).await;
    assert_eq!(out.len(), 1);
    assert_eq!(
        token_rewards(&out[0]),
        vec![
            vec![0.1, 0.1, 0.1, 0.1, 0.1, 0.0],
            vec![0.1, 0.1, 0.0, 0.1, 0.0, 0.0],
            vec![0.0, 0.0, 0.0, 0.0],
        ]
    );

    let topo = Topology {
        claim_idle_ms: 100,
        max_deliveries: 2,
        block_ms: 50,
        ..Topology::default()
    };
    for (args, separator, want) in [
        (
            "--per token --bad index",
            None,
            "names token 6, but completion 0 has 6 tokens",
        ),
        (
            "--per step --separator , --bad steps",
            Some(","),
            "step_rewards[0] has 2 rewards for 3 steps",
        ),
        (
            "--per step",
            None,
            "step_rewards need steps: start score with --step-separator",
        ),
    ] {
        let cfg = ScoreConfig {
            scorer_cmd: Some(format!("python3 {script} {args}")),
            step_separator: separator.map(String::from),
            ..ScoreConfig::default()
        };
        let (bus, out) = score_groups(cfg, topo.clone(), &[stepped_group()]).await;
        assert!(out.is_empty(), "{args}");
        let dead = dead_letters(&bus, &topo.dead_key()).await;
        assert_eq!(dead.len(), 1, "{args}");
        assert!(dead[0].error.contains(want), "{args}: {}", dead[0].error);
    }
}

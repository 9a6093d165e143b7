//! Agents that bring their own loop: `examples/calc_agent.py`, an ordinary OpenAI client
//! loop (the `calc` task, tool calls as text), run by 16 concurrent clients against the real
//! `gen --serve` with the real `score` and `train` processes on Redis. Asserted from the
//! streams: every recorded token id, log-prob and version equals what the clients received,
//! the environment spans cover exactly the ids the clients added, each episode's return is
//! its reward, a weight version swapped in while agents played is on later episodes'
//! tokens, and the trainer trained groups. On a tiny Qwen3 with its chat template: history
//! sent back as it was sampled extends the episode (drift 0); edited history is counted
//! (drift > 0) and its group is dead-lettered instead of trained.

use crate::common::{
    interrupt, messages, on_bus, python_json, redis_url, serve_gen, spawn, unique_ns, wait_until,
};
use rlstream::schema::{DeadLetter, Event, RolloutGroup};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Runs `examples/calc_agent.py` with `args`; its summary.
fn agent(args: &[&str]) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/calc_agent.py");
    let script = script.to_str().expect("a UTF-8 path");
    let args: Vec<&str> = std::iter::once(script)
        .chain(args.iter().copied())
        .collect();
    python_json(&args)
}

fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Checks the published group of every recorded episode against what its client got.
fn check_recorded(episodes: &[Value], groups: &[RolloutGroup]) -> u64 {
    let mut newest = 0;
    for e in episodes {
        let want = &e["sample"];
        let id = format!("agent:{}", e["group"].as_str().unwrap());
        let g = groups
            .iter()
            .find(|g| g.group_id == id)
            .unwrap_or_else(|| panic!("group {id} was not published"));
        assert_eq!(g.meta.get("env").map(String::as_str), Some("agent"));
        let prompt: Vec<u64> = g.prompt_tokens.iter().map(|&t| u64::from(t)).collect();
        assert_eq!(prompt, ids(&want["prompt"]), "{id}: the group's prompt");
        let tokens = ids(&want["tokens"]);
        let s = g
            .samples
            .iter()
            .find(|s| {
                s.tokens
                    .iter()
                    .map(|&t| u64::from(t))
                    .eq(tokens.iter().copied())
            })
            .unwrap_or_else(|| panic!("{id}: no sample with the ids {} received", e["episode"]));
        // Log-probs are f32 on both sides; JSON carried them as decimals.
        let logprobs: Vec<f32> = want["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(
            s.logprobs.as_slice(),
            logprobs.as_slice(),
            "{id}: log-probs"
        );
        for (i, v) in want["versions"].as_array().unwrap().iter().enumerate() {
            if let Some(v) = v.as_u64() {
                assert_eq!(s.version_at(i), v, "{id}: version of token {i}");
                newest = newest.max(v);
            }
        }
        let spans: Vec<Value> = s
            .env
            .iter()
            .map(|sp| serde_json::json!([sp.start, sp.len]))
            .collect();
        assert_eq!(Value::Array(spans), want["env"], "{id}: environment spans");
        let ret: f32 = s.turn_rewards.iter().map(|r| r.reward).sum();
        assert_eq!(
            f64::from(ret),
            want["return"].as_f64().unwrap(),
            "{id}: return"
        );
    }
    newest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_agents_play_episodes_that_are_recorded_token_exactly_grouped_and_trained() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("calc");
    crate::common::warm_start("calc", &model, 60, &[]);
    let m = model.to_str().unwrap();
    let ns = unique_ns("agents");
    let url = redis_url();
    let args = |extra: &[&str]| on_bus(extra, &url, &ns);
    let log = |n: &str| dir.path().join(format!("{n}.log"));
    let ckpt = dir.path().join("ckpt");
    let shared = ["--groups-per-step", "2", "--max-lag", "8"];
    let gen_flags: Vec<&str> = ["--group-size", "4", "--max-batch", "32"]
        .into_iter()
        .chain(shared)
        .collect();
    let gen_env = [("RLSTREAM_SERVE_KEY", "k")];
    let serving = serve_gen(&model, &ns, &log("gen"), &gen_flags, &gen_env);
    let policy: Vec<&str> = ["--model", m].into_iter().chain(shared).collect();
    let score = spawn(&args(&["score", "--name", "score-0"]), &log("score"));
    let train_args: Vec<&str> = ["train", "--steps", "100", "--lr", "1e-3"]
        .into_iter()
        .chain(policy.iter().copied())
        .chain([
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
            "--checkpoint-every",
            "1000",
        ])
        .collect();
    let train = spawn(&args(&train_args), &log("train"));
    let base = &serving.base;
    let play = |seed: &str, record: &Path| {
        agent(&[
            "--base",
            base,
            "--model",
            "calc",
            "--key",
            "k",
            "--groups",
            "4",
            "--group-size",
            "4",
            "--clients",
            "16",
            "--seed",
            seed,
            "--record",
            record.to_str().unwrap(),
        ])
    };
    let first = play("1", &dir.path().join("first.jsonl"));
    assert_eq!(first["episodes"], 16, "{first}");
    assert_eq!(first["groups_published"], 4, "{first}");
    // The trainer steps on those groups and publishes; the generator swaps the version in.
    wait_until(
        "the generator never swapped in trained weights",
        &log("gen"),
        || {
            std::fs::read_to_string(log("gen"))
                .unwrap_or_default()
                .contains("new weights swapped in")
        },
    );
    let second = play("2", &dir.path().join("second.jsonl"));
    assert_eq!(second["groups_published"], 4, "{second}");

    let bus = crate::common::redis_bus().await;
    let mut steps = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    while steps < 4 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        steps = messages::<Event>(&bus, &format!("{ns}:events"))
            .await
            .iter()
            .filter(|e| e.kind == "step")
            .count();
    }
    interrupt(train, "train", &log("train"));
    interrupt(serving.proc, "gen", &log("gen"));
    interrupt(score, "score", &log("score"));
    assert!(
        steps >= 4,
        "the trainer trained {steps} steps of the 8 agent groups"
    );
    let groups = messages::<RolloutGroup>(&bus, &format!("{ns}:rollouts")).await;
    assert_eq!(groups.len(), 8);
    // Generation never waits for the trainer: its first step (after two of the first
    // round's four groups) may land while the round's last episodes still play, but the
    // second step needs the round's last group, so the first round sees version 1 at most.
    let first_newest = check_recorded(&read_jsonl(&dir.path().join("first.jsonl")), &groups);
    assert!(
        first_newest <= 1,
        "the first agents saw version {first_newest}"
    );
    let newest = check_recorded(&read_jsonl(&dir.path().join("second.jsonl")), &groups);
    assert!(
        newest >= 1,
        "no token of the second agents carries a trained version"
    );
    // Multi-turn episodes happened: some sample holds tokens the client added.
    assert!(
        groups
            .iter()
            .flat_map(|g| &g.samples)
            .any(|s| !s.env.is_empty())
    );
    crate::common::drop_namespace(&ns).await;
}

/// A chat episode of two calls on the Qwen3 fixture; `edit` rewrites the start of the
/// assistant's reply before sending it back (text appended after the reply would extend
/// the episode: the model read its own tokens, then the client's). The episode's JSON
/// after closing.
fn chat_episode(base: &str, episode: &str, group: &str, edit: bool) -> Value {
    let code = format!(
        r#"
import json, sys, urllib.request, openai
c = openai.OpenAI(base_url={base:?}, api_key="none", max_retries=0)
h = {{"X-Rlstream-Episode": {episode:?}, "X-Rlstream-Group": {group:?}}}
msgs = [{{"role": "user", "content": "What is 2+2?"}}]
r = c.chat.completions.create(model="qwen3", messages=msgs, max_tokens=4, seed=3, extra_headers=h)
reply = r.choices[0].message.content
msgs += [{{"role": "assistant", "content": ("Edited: " if {edit} else "") + reply}},
         {{"role": "user", "content": "Sure?"}}]
r2 = c.chat.completions.create(model="qwen3", messages=msgs, max_tokens=4, seed=4, extra_headers=h)
first = r.choices[0].model_extra["rlstream"]
second = r2.choices[0].model_extra["rlstream"]
seq = first["prompt_token_ids"] + first["token_ids"]
extends = second["prompt_token_ids"][:len(seq)] == seq
def post(path, body):
    req = urllib.request.Request({base:?} + path, data=json.dumps(body).encode(),
                                 headers={{"Content-Type": "application/json"}})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())
with urllib.request.urlopen({base:?} + "/rlstream/episodes/" + {episode:?}) as resp:
    record = json.loads(resp.read())
closed = post("/rlstream/episodes/" + {episode:?} + "/close", {{"reward": 1.0}})
print(json.dumps({{"extends": extends, "record": record, "closed": closed}}))
"#,
        edit = if edit { "True" } else { "False" }
    );
    python_json(&["-c", &code])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_history_sent_back_as_sampled_extends_the_episode_and_edited_history_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&model);
    let ns = unique_ns("agents-chat");
    let log = dir.path().join("gen.log");
    let serving = serve_gen(&model, &ns, &log, &["--group-size", "1"], &[]);
    let (base, metrics) = (&serving.base, &serving.metrics);
    let drift = || {
        crate::common::metric(
            &crate::common::scrape(metrics),
            "rlstream_serve_drift_total",
        )
    };
    let kept = chat_episode(base, "kept", "g-kept", false);
    assert_eq!(kept["extends"], true, "{kept}");
    assert_eq!(kept["record"]["drifted_calls"], 0, "{kept}");
    assert_eq!(kept["closed"]["published"], true, "{kept}");
    let edited = chat_episode(base, "edited", "g-edited", true);
    assert_eq!(edited["extends"], false, "{edited}");
    assert_eq!(edited["record"]["drifted_calls"], 1, "{edited}");
    assert_eq!(edited["closed"]["dead_lettered"], "drift", "{edited}");
    assert_eq!(drift(), 1.0);
    // The unedited episode's second call continued its first call's KV cache (no swap in
    // between); the edited one's, which does not extend it, prefilled its history whole.
    let scrape = crate::common::scrape(metrics);
    let cache = |outcome: &str| {
        crate::common::metric(
            &scrape,
            &format!("rlstream_serve_episode_cache_total{{outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(
        (cache("continued"), cache("prefilled")),
        (1.0, 3.0),
        "{scrape}"
    );

    let bus = crate::common::redis_bus().await;
    let groups = messages::<RolloutGroup>(&bus, &format!("{ns}:rollouts")).await;
    assert_eq!(groups.len(), 1, "only the unedited episode is trained");
    let s = &groups[0].samples[0];
    assert_eq!(
        s.env.len(),
        1,
        "the text between the two replies is the client's"
    );
    let dead = messages::<DeadLetter>(&bus, &format!("{ns}:dead")).await;
    assert!(
        dead.iter()
            .any(|d| d.reason == "drift" && d.source_id == "g-edited")
    );
    crate::common::drop_namespace(&ns).await;
}

/// `rlstream run --serve` with `run.feed = false`: the whole pipeline in one process on the
/// embedded bus, its only groups those `examples/calc_agent.py` plays through the endpoint.
/// The run trains every step on them and reports them; nothing else was fed.
#[test]
fn run_serve_trains_on_the_agents_groups_alone_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("calc");
    crate::common::warm_start("calc", &model, 2, &[]);
    let port = crate::common::free_port().to_string();
    let out = dir.path().join("run");
    let log = dir.path().join("run.log");
    let args: Vec<String> = [
        "run",
        "--task",
        "calc",
        "--model",
        model.to_str().unwrap(),
        "--feed",
        "false",
        "--serve",
        &port,
        "--out",
        out.to_str().unwrap(),
        "--group-size",
        "4",
        "--groups-per-step",
        "2",
        "--steps",
        "3",
        "--eval-prompts",
        "8",
        "--plain",
    ]
    .map(String::from)
    .into();
    let mut run = spawn(&args, &log);
    let base = format!("http://127.0.0.1:{port}/v1");
    let played = agent(&[
        "--base",
        &base,
        "--group-size",
        "4",
        "--clients",
        "8",
        "--groups",
        "6",
    ]);
    assert_eq!(played["groups_published"], 6, "{played}");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = run.try_wait() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not end after its steps"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{logged}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report/summary.json")).unwrap())
            .unwrap();
    assert_eq!(
        (
            &summary["steps"],
            &summary["trained_groups"],
            &summary["prompts_fed"]
        ),
        (&Value::from(3), &Value::from(6), &Value::from(0)),
        "{summary}"
    );
    assert!(
        summary["served_tokens"].as_u64() > Some(0),
        "the agents' tokens are counted: {summary}"
    );
    // Without --serve there would be nothing to train: refused with the setting's name.
    let refused = crate::common::bin()
        .args(["run", "--task", "calc", "--feed", "false", "--steps", "1"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("run.feed"),
        "{said}"
    );
}

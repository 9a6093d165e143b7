//! Episodes: the trainer sees exactly what the sampler saw, and learns only from the
//! model's own tokens.
//!
//! - Invariant: guess games played with weight swaps forced inside the first turn and
//!   between turns; every model token's teacher-forced log-prob under the version that
//!   sampled it (the trainer's code, the trainer's backend) equals its behaviour log-prob
//!   within 1e-4, with and without a top-k sampling mask: the tokens before the first
//!   swap, and every turn after the first (a resumed episode's cache is rebuilt under the
//!   weights that continue it). Tokens sampled inside the first turn after its swap
//!   attended to positions cached by the older weights (the in-flight update keeps the
//!   cache, as for single-turn rows): the test shows that they do differ, which is what
//!   the importance weights correct for. Re-tokenizing the transcript gives other ids (the
//!   model's stop tokens vanish from the text), so a trainer that re-tokenized would be
//!   caught here.
//! - The real binaries on Redis: gen, score and train play and train on guess games.
//! - An environment that fails (a step past its deadline, a prompt whose game cannot be
//!   set up) ends its episodes with counted reasons; nothing of it is trained.
//! - `rlstream run --task guess` on the embedded bus.
//! - Environments from outside: the Python example (`examples/calc_env.py`) plays tool-use
//!   episodes through the protocol with the real binaries, answering as the built-in
//!   calculator does; a process that crashes, hangs or writes garbage is restarted and
//!   its episodes end with counted reasons while gen goes on.

use crate::common::{free_addr, interrupt, metric, run_ok, scrape, spawn};
use rlstream::bus::RangeBound;
use rlstream::env::guess::{self, Guess};
use rlstream::env::play::{Answer, EpisodeLimits, answer};
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::sampler::{Completion, Generator, Request, Resumed, TurnLimits};
use rlstream::model::tokenizer::{CharTokenizer, Tokenizer};
use rlstream::model::{InferBackend, Kernels, Policy, TrainBackend};
use rlstream::schema::{self, RolloutGroup, Sample, SamplingParams, ScoredGroup};
use rlstream::tasks;
use std::time::{Duration, Instant};

const EOS: u32 = CharTokenizer::EOS;

/// The policies of versions 0, 1 and 2: a short warm start on the game (so turns end on
/// the stop token), then two different continuations of it.
fn versions(dir: &std::path::Path) -> Vec<Policy<InferBackend>> {
    use rlstream::commands::sft::{self, SftOptions};
    let opts = |out: &str, init: Option<std::path::PathBuf>, steps, seed| SftOptions {
        task: tasks::BuiltinTask::Guess,
        out: dir.join(out),
        steps,
        seed,
        hidden: 32,
        lr: 1e-2,
        eval: 4,
        init,
        ..SftOptions::default()
    };
    sft::run(&opts("v0", None, 60, 0), |_, _| {}).expect("warm start");
    for (v, seed) in [("v1", 1), ("v2", 2)] {
        sft::run(&opts(v, Some(dir.join("v0")), 3, seed), |_, _| {}).expect("continuation");
    }
    ["v0", "v1", "v2"]
        .iter()
        .map(|v| rlstream::model::hf::load_hf(&dir.join(v), &Default::default()).expect("load"))
        .collect()
}

/// Plays `n` episodes of `game` with top-k `top_k`: version 0 samples the first token and
/// runs the first decode pass, version 1 the passes after it (a swap inside the first
/// turn), and version 2 everything after the first environment answer (a swap between
/// turns).
fn play_with_swaps<B: Kernels>(
    models: &[Policy<B>],
    game: &Guess,
    n: usize,
    top_k: u32,
) -> Vec<Completion> {
    let tok = Tokenizer::Char(tasks::char_tokenizer());
    let limits = EpisodeLimits {
        turn: TurnLimits {
            turn_tokens: 5,
            episode_tokens: 200,
        },
        turns: 8,
    };
    let req = Request {
        id: 0,
        prompt: tok.encode(&Guess::prompt(game.top)).expect("prompt"),
        n,
        params: SamplingParams {
            temperature: 1.0,
            top_k,
            top_p: 1.0,
            max_new_tokens: 5,
            stop_tokens: vec![EOS],
            seed: 11,
        },
    };
    let mut g = Generator::new();
    g.admit_episode(&models[0], 0, &req, limits.turn)
        .expect("admit");
    let mut envs = vec![game.clone(); n];
    let (mut version, mut passes, mut done) = (0usize, 0, Vec::new());
    loop {
        for turn in g.take_turns() {
            version = 2;
            let env: &mut dyn rlstream::env::Environment = &mut envs[turn.index];
            match answer(env, &turn, &[EOS], &tok, &limits).expect("the game answers") {
                Answer::Continue {
                    reward,
                    observation,
                } => {
                    let r = g
                        .resume(0, turn.index, Some(reward), &observation, &models[2], 2)
                        .expect("resume");
                    if let Some(Resumed::Finished(c)) = r {
                        done.push(*c);
                    }
                }
                Answer::End { reward, finish, .. } => {
                    done.extend(g.end(0, turn.index, reward, finish));
                }
            }
        }
        if g.is_idle() {
            break;
        }
        passes += 1;
        if version == 0 && passes >= 2 {
            version = 1;
        }
        done.extend(g.step(&models[version], version as u64).expect("pass"));
    }
    done.sort_by_key(|c| c.index);
    done
}

/// The rollout message of `done`, through the codec (what the trainer reads).
fn through_the_wire(game: &Guess, done: Vec<Completion>, top_k: u32) -> RolloutGroup {
    let tok = tasks::char_tokenizer();
    let samples: Vec<Sample> = done.into_iter().map(Sample::from).collect();
    let mut g = schema::examples::rollout_group(1, 1, 2, 0);
    g.schema = RolloutGroup::version_for(&samples);
    g.prompt_tokens = tok.encode(&Guess::prompt(game.top)).into();
    g.samples = samples;
    g.sampling.top_k = top_k;
    g.sampling.stop_tokens = vec![EOS];
    g.meta = game.meta();
    schema::decode(&schema::encode(&g).expect("encode")).expect("a valid episode group")
}

/// `models` on backend `C`, through the published-weights bytes.
fn copies<C: Kernels>(models: &[Policy<InferBackend>]) -> Vec<Policy<C>> {
    models
        .iter()
        .map(|m| {
            Policy::from_bytes(
                m.config(),
                &m.to_bytes().expect("bytes"),
                &Default::default(),
            )
            .expect("copy on another backend")
        })
        .collect()
}

#[test]
fn the_trainer_scores_every_model_token_as_the_sampler_did_across_weight_swaps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = versions(dir.path());
    let train: Vec<Policy<TrainBackend>> = copies(&models);
    // Generation as burn's composed operations run it (no native kernel).
    let composed: Vec<Policy<crate::decode_kernels::Composed>> = copies(&models);
    let game = Guess::new(17, 30);
    let (mut swapped_inside, mut swapped_between, mut env_tokens, mut checked) = (0, 0, 0, 0);
    let mut stale_cache_gap = 0f32;
    for top_k in [0, 8] {
        let played = play_with_swaps(&models, &game, 6, top_k);
        crate::decode_kernels::assert_same_generation(
            &format!("episodes, top-k {top_k}"),
            &played,
            &play_with_swaps(&composed, &game, 6, top_k),
        );
        let group = through_the_wire(&game, played, top_k);
        // An episode is 2.1; with sampling masks (packed kept sets) 3.0.
        let (major, minor) = if top_k > 0 { (3, 0) } else { (2, 1) };
        assert_eq!(
            group.schema,
            rlstream::schema::SchemaVersion { major, minor }
        );
        let seqs: Vec<ScoredSeq<'_>> = group
            .samples
            .iter()
            .map(|s| ScoredSeq {
                prompt: &group.prompt_tokens,
                completion: &s.tokens,
                mask: s.mask.as_ref(),
                routing: None,
            })
            .collect();
        // Teacher-forced log-probs of the exact recorded ids under each version.
        let per_version: Vec<Vec<f32>> = train
            .iter()
            .map(|m| {
                let (lp, _) = completion_logprobs(m, &seqs, 1.0);
                lp.into_data().to_vec::<f32>().expect("f32")
            })
            .collect();
        let cmax = per_version[0].len() / seqs.len();
        for (i, s) in group.samples.iter().enumerate() {
            assert_eq!(s.mask.is_some(), top_k > 0, "sample {i}");
            let own = s.model_tokens();
            env_tokens += own.iter().filter(|o| !**o).count();
            let first_turn_end = s
                .env
                .first()
                .map_or(s.tokens.len(), |span| span.start as usize);
            swapped_inside += usize::from(s.version_at(0) != s.version_at(first_turn_end - 1));
            swapped_between += usize::from(
                !s.env.is_empty() && s.version_at(s.tokens.len() - 1) != s.version_at(0),
            );
            for (t, &is_own) in own.iter().enumerate() {
                if !is_own {
                    assert_eq!(
                        s.logprobs[t], 0.0,
                        "environment token {t} has no behaviour log-prob"
                    );
                    continue;
                }
                let v = s.version_at(t) as usize;
                let trainer = per_version[v][i * cmax + t];
                let behaviour = s.logprobs[t];
                if t < first_turn_end && v > 0 {
                    // Sampled after the in-turn swap, over a cache of version 0.
                    stale_cache_gap = stale_cache_gap.max((trainer - behaviour).abs());
                    continue;
                }
                assert!(
                    (trainer - behaviour).abs() < 1e-4,
                    "top-k {top_k}, sample {i}, token {t} (version {v}): trainer {trainer}, sampler {behaviour}"
                );
                checked += 1;
            }
            // The turn rewards sit on model tokens, the last on the episode's last token.
            for r in &s.turn_rewards {
                assert!(own[r.index as usize]);
            }
        }
        // Re-tokenizing the transcript does not give back the recorded ids: the model's
        // stop tokens end each of its turns in the ids but are not text.
        let tok = tasks::char_tokenizer();
        let mut stopped = 0;
        for s in group.samples.iter().filter(|s| s.tokens.contains(&EOS)) {
            let text = tok.decode(&s.tokens).expect("decodes");
            let again = tok.encode(&text);
            assert_ne!(again.as_slice(), s.tokens.as_slice(), "{text}");
            stopped += 1;
        }
        assert!(stopped > 0, "no turn ended on the stop token");
    }
    assert!(
        swapped_inside > 0,
        "no episode saw a swap inside its first turn"
    );
    assert!(
        stale_cache_gap > 1e-3,
        "tokens over a cache of older weights should differ from a recompute: {stale_cache_gap}"
    );
    assert!(swapped_between > 0, "no episode saw a swap between turns");
    assert!(
        env_tokens > 0 && checked > 50,
        "{env_tokens} environment tokens, {checked} checked"
    );
}

/// `rlstream sft --task TASK` for `steps` steps into `dir/model`.
fn warm_start(task: &str, dir: &std::path::Path, steps: u32) -> std::path::PathBuf {
    let model = dir.join("model");
    crate::common::warm_start(task, &model, steps, &[]);
    model
}

/// `rlstream train` of `model` for `steps` steps (4 groups each, checkpoints under `dir`)
/// on the bus `args` names, run to its end beside the running gen and score: its stdout.
/// `context` goes into the failure message.
async fn train(
    args: &dyn Fn(&[&str]) -> Vec<String>,
    model: &str,
    dir: &std::path::Path,
    steps: u32,
    context: &str,
) -> String {
    let ckpt = dir.join("ckpt");
    let train_args = args(&[
        "train",
        "--model",
        model,
        "--groups-per-step",
        "4",
        "--steps",
        &steps.to_string(),
        "--max-lag",
        "100",
        "--checkpoint-dir",
        ckpt.to_str().expect("utf-8"),
    ]);
    let o = tokio::task::spawn_blocking(move || {
        crate::common::bin()
            .args(&train_args)
            .output()
            .expect("train runs")
    })
    .await
    .expect("join");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    );
    assert!(
        o.status.success(),
        "train failed ({context}):\n{stdout}\n{stderr}"
    );
    stdout
}

/// A full run of the pipeline's stages as processes on Redis, playing guess games.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gen_score_and_train_play_guess_games_on_redis() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ns = crate::common::unique_ns("episodes");
    let url = crate::common::redis_url();
    let model = warm_start("guess", dir.path(), 60);
    let args = |extra: &[&str]| crate::common::on_bus(extra, &url, &ns);
    let strs = |v: &[String]| v.iter().map(String::as_str).collect::<Vec<_>>().join(" ");
    let fed = run_ok(
        &args(&["feed", "--task", "guess", "--count", "48"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(fed.starts_with("fed 48 prompts"), "{fed}");
    let m = model.to_str().expect("utf-8");
    let logs = |n: &str| dir.path().join(format!("{n}.log"));
    let gen_metrics = free_addr();
    let gen_args = args(&[
        "gen",
        "--model",
        m,
        "--group-size",
        "4",
        "--max-new-tokens",
        "5",
        "--metrics-addr",
        &gen_metrics,
    ]);
    let generator = spawn(&gen_args, &logs("gen"));
    let score = spawn(&args(&["score"]), &logs("score"));
    let trained = train(&args, m, dir.path(), 6, &strs(&gen_args)).await;
    assert!(trained.contains("to version 6"), "{trained}");
    let gen_scrape = scrape(&gen_metrics);
    assert!(
        metric(&gen_scrape, "rlstream_episodes_total{ended=\"done\"}") > 0.0,
        "{gen_scrape}"
    );
    assert!(
        metric(&gen_scrape, "rlstream_episode_turns_total") > 0.0,
        "{gen_scrape}"
    );
    interrupt(generator, "gen", &logs("gen"));
    interrupt(score, "score", &logs("score"));

    let bus = crate::common::redis_bus().await;
    let scored: Vec<ScoredGroup> = crate::common::messages(&bus, &format!("{ns}:scored")).await;
    assert!(scored.len() >= 24, "{} scored groups", scored.len());
    let mut turns_seen = 0;
    for s in &scored {
        assert_eq!(s.schema.major, 3);
        assert!(
            s.advantages.iter().all(|&a| a == 0.0),
            "the return is in the token rewards"
        );
        let token_rewards = s
            .token_rewards
            .as_ref()
            .expect("turn rewards placed on tokens");
        for ((sample, placed), &ret) in s.rollout.samples.iter().zip(token_rewards).zip(&s.rewards)
        {
            let sum: f32 = placed.iter().sum();
            assert!((sum - ret).abs() < 1e-5);
            for r in &sample.turn_rewards {
                assert_eq!(placed[r.index as usize], r.reward);
            }
            // Every model turn but the last is followed by the game's one-character clue.
            assert_eq!(sample.env.len() + 1, sample.turn_rewards.len());
            assert!(sample.env.iter().all(|span| span.len == 1));
            turns_seen += sample.turn_rewards.len();
        }
    }
    assert!(turns_seen > scored.len() * 4, "{turns_seen} turns");
}

/// A step slower than `--env-timeout-ms` ends its episode (counted, never trained); a
/// prompt whose game cannot be set up is dead-lettered; the generator keeps going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_failures_end_episodes_with_counted_reasons() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ns = crate::common::unique_ns("env-fail");
    let url = crate::common::redis_url();
    let model = warm_start("guess", dir.path(), 20);
    let bus = crate::common::redis_bus().await;
    let args = |extra: &[&str]| crate::common::on_bus(extra, &url, &ns);
    // One prompt whose secret lies outside its range, then four good games.
    let mut bad = Guess::new(5, 10).meta();
    bad.insert(guess::SECRET.into(), "99".into());
    let tok = tasks::char_tokenizer();
    let prompt = |id: &str, meta| rlstream::schema::Prompt {
        prompt_id: id.into(),
        task: "guess".into(),
        text: Guess::prompt(10),
        prompt_tokens: Some(tok.encode(&Guess::prompt(10)).into()),
        meta,
        ..schema::examples::prompt()
    };
    let mut payloads = vec![schema::encode(&prompt("bad", bad)).expect("encode")];
    for i in 0..4 {
        payloads.push(
            schema::encode(&prompt(&format!("slow-{i}"), Guess::new(3, 10).meta()))
                .expect("encode"),
        );
    }
    let payloads: Vec<bytes::Bytes> = payloads.into_iter().map(Into::into).collect();
    bus.publish(&format!("{ns}:prompts"), &payloads, None)
        .await
        .expect("publish");
    let metrics = free_addr();
    let generator = spawn(
        &args(&[
            "gen",
            "--model",
            model.to_str().expect("utf-8"),
            "--group-size",
            "2",
            "--max-new-tokens",
            "5",
            "--env-latency-ms",
            "400",
            "--env-timeout-ms",
            "100",
            "--metrics-addr",
            &metrics,
        ]),
        &dir.path().join("gen.log"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut dead = Vec::new();
    while Instant::now() < deadline {
        dead = crate::common::dead_letters(&bus, &format!("{ns}:dead")).await;
        if dead.len() >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let s = scrape(&metrics);
    interrupt(generator, "gen", &dir.path().join("gen.log"));
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason.as_str()).collect();
    assert!(reasons.contains(&"env_setup"), "{reasons:?}");
    // A game answered only after its deadline: no episode survives, so the groups are
    // dead-lettered, unless an episode won on its first guess (no step needed).
    let timed_out = reasons.iter().filter(|r| **r == "env_timeout").count();
    let rollouts = bus
        .range(
            &format!("{ns}:rollouts"),
            RangeBound::Open,
            RangeBound::Open,
            100,
        )
        .await
        .expect("range");
    assert_eq!(timed_out + rollouts.len(), 4, "{reasons:?}");
    for e in &rollouts {
        let g: RolloutGroup = schema::decode(&e.payload).expect("rollout");
        assert!(
            g.samples
                .iter()
                .all(|s| s.env.is_empty() && s.turn_rewards.len() == 1)
        );
    }
    assert!(
        metric(&s, "rlstream_env_failures_total{reason=\"env_timeout\"}") >= 1.0,
        "{s}"
    );
    assert_eq!(
        metric(&s, "rlstream_env_failures_total{reason=\"env_setup\"}"),
        1.0,
        "{s}"
    );
}

/// `rlstream run --task guess`: warm start on the bisection player's games, RL on the
/// embedded bus, held-out success rate and turns before and after.
#[test]
fn run_plays_guess_on_the_embedded_bus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run_ok(&[
        "run",
        "--task",
        "guess",
        "--out",
        dir.path().to_str().expect("utf-8"),
        "--sft-steps",
        "40",
        "--steps",
        "8",
        "--eval-prompts",
        "16",
        "--plain",
    ]);
    assert!(out.contains("async run of `guess`"), "{out}");
    assert!(out.contains("turns per episode"), "{out}");
}

fn python_env(script: &str) -> String {
    format!("python3 {}/{script}", env!("CARGO_MANIFEST_DIR"))
}

/// The Python example environment (`examples/calc_env.py`) plays tool-use episodes through
/// the protocol, with the real gen, score and train processes on Redis: every answer the
/// process gave is what the built-in calculator gives for the same turns, and the scored
/// rewards are its rewards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_environment_plays_through_the_real_binaries() {
    use rlstream::env::Environment;
    use rlstream::env::calc::{self, Calc};
    let dir = tempfile::tempdir().expect("tempdir");
    let ns = crate::common::unique_ns("env-process");
    let url = crate::common::redis_url();
    let model = warm_start("calc", dir.path(), 150);
    let args = |extra: &[&str]| crate::common::on_bus(extra, &url, &ns);
    let fed = run_ok(
        &args(&["feed", "--task", "calc", "--count", "32"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(fed.starts_with("fed 32 prompts"), "{fed}");
    let m = model.to_str().expect("utf-8");
    let logs = |n: &str| dir.path().join(format!("{n}.log"));
    let gen_metrics = free_addr();
    let env_cmd = python_env("examples/calc_env.py");
    let gen_args = args(&[
        "gen",
        "--model",
        m,
        "--group-size",
        "4",
        "--max-new-tokens",
        "13",
        "--env-cmd",
        &env_cmd,
        "--metrics-addr",
        &gen_metrics,
    ]);
    let generator = spawn(&gen_args, &logs("gen"));
    let score = spawn(&args(&["score"]), &logs("score"));
    let trained = train(&args, m, dir.path(), 4, &env_cmd).await;
    assert!(trained.contains("to version 4"), "{trained}");
    let s = scrape(&gen_metrics);
    interrupt(generator, "gen", &logs("gen"));
    interrupt(score, "score", &logs("score"));
    assert_eq!(metric(&s, "rlstream_env_process_starts_total"), 1.0, "{s}");
    assert!(metric(&s, "rlstream_env_step_seconds_count") > 0.0, "{s}");

    let bus = crate::common::redis_bus().await;
    let scored: Vec<ScoredGroup> = crate::common::messages(&bus, &format!("{ns}:scored")).await;
    assert!(scored.len() >= 16, "{} scored groups", scored.len());
    let tok = tasks::char_tokenizer();
    let text = |ids: &[u32]| -> String {
        let ids = match ids.split_last() {
            Some((&EOS, rest)) => rest,
            _ => ids,
        };
        tok.decode(ids).expect("char ids")
    };
    let (mut calls, mut episodes) = (0, 0);
    for s in &scored {
        for (sample, &reward) in s.rollout.samples.iter().zip(&s.rewards) {
            // Replay the turns on the built-in calculator: the process answered alike.
            let mut builtin = Calc::from_meta(&s.rollout.meta).expect("calc meta");
            let mut ret = 0.0;
            let turns = sample.turns();
            for (i, (range, env)) in turns.iter().enumerate() {
                if *env {
                    continue;
                }
                let action = text(&sample.tokens[range.clone()]);
                let step = builtin.step(&action).expect("step");
                ret += step.reward;
                match turns.get(i + 1) {
                    Some((next, true)) => {
                        assert_eq!(text(&sample.tokens[next.clone()]), step.observation);
                        assert!(!step.done, "{action:?}");
                    }
                    _ => assert!(
                        step.done || sample.finish == schema::FinishReason::Length,
                        "{action:?}"
                    ),
                }
                if matches!(calc::classify(&action), calc::Action::Call(_)) {
                    calls += 1;
                }
            }
            assert!((ret - reward).abs() < 1e-6, "{ret} vs {reward}");
            episodes += 1;
        }
    }
    // The warm start calls the tool about half the time: the protocol carried calls.
    assert!(
        calls > 0 && episodes >= 64,
        "{calls} calls in {episodes} episodes"
    );
}

/// An environment process that crashes, hangs or writes garbage ends the episodes it was
/// serving with counted reasons and is restarted; the generator goes on and every prompt
/// ends as a group or a dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_environment_process_is_restarted_and_gen_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = warm_start("calc", dir.path(), 60);
    let url = crate::common::redis_url();
    let bus = crate::common::redis_bus().await;
    for (fault, reason) in [
        ("crash 6", "env_crash"),
        ("hang 6", "env_timeout"),
        ("garbage 6", "env_protocol"),
    ] {
        let ns = crate::common::unique_ns("env-faults");
        let args = |extra: &[&str]| crate::common::on_bus(extra, &url, &ns);
        let fed = run_ok(
            &args(&["feed", "--task", "calc", "--count", "12"])
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        assert!(fed.starts_with("fed 12 prompts"), "{fed}");
        let metrics = free_addr();
        let env_cmd = python_env(&format!("tests/envs/faulty_env.py {fault}"));
        let log = dir.path().join(format!("gen-{reason}.log"));
        let generator = spawn(
            &args(&[
                "gen",
                "--model",
                model.to_str().expect("utf-8"),
                "--group-size",
                "2",
                "--max-batch",
                "4",
                "--max-new-tokens",
                "13",
                "--env-cmd",
                &env_cmd,
                "--env-timeout-ms",
                "1500",
                "--metrics-addr",
                &metrics,
            ]),
            &log,
        );
        let deadline = Instant::now() + Duration::from_secs(90);
        let (mut rollouts, mut dead) = (Vec::new(), Vec::new());
        while Instant::now() < deadline {
            rollouts = bus
                .range(
                    &format!("{ns}:rollouts"),
                    RangeBound::Open,
                    RangeBound::Open,
                    100,
                )
                .await
                .expect("range");
            dead = crate::common::dead_letters(&bus, &format!("{ns}:dead")).await;
            if rollouts.len() + dead.len() >= 12 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let s = scrape(&metrics);
        interrupt(generator, "gen", &log);
        assert_eq!(rollouts.len() + dead.len(), 12, "{fault}: {s}");
        assert!(
            dead.iter().all(|d| d.reason.starts_with("env_")),
            "{fault}: {:?}",
            dead.iter().map(|d| &d.reason).collect::<Vec<_>>()
        );
        assert!(!rollouts.is_empty(), "{fault}: nothing survived");
        assert!(
            metric(
                &s,
                &format!("rlstream_env_failures_total{{reason=\"{reason}\"}}")
            ) >= 1.0,
            "{fault}: {s}"
        );
        assert!(
            metric(&s, "rlstream_env_process_starts_total") >= 2.0,
            "{fault}: {s}"
        );
    }
}

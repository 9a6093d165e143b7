//! Messages that decode but that the model cannot run, pushed into the real `gen` and
//! `train` binaries on a real Redis: token ids past the vocabulary, prompts and samples
//! longer than the context, an empty prompt, and a forward pass that panics (the fault
//! hook). Each is dead-lettered with a reason naming the field and the limit; the stage
//! keeps going and processes the messages after it. The last id of the vocabulary and a
//! sample of exactly the context are accepted.

use crate::common::{interrupt, spawn};
use bytes::Bytes;
use rlstream::bus::RangeBound;
use rlstream::model::fault::FAULT_ENV;
use rlstream::model::tokenizer::Tokenizer;
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema::{self, DeadLetter, FinishReason, Prompt, RolloutGroup, ScoredGroup};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// The test model's context.
const CONTEXT: usize = 16;

/// A random model over the built-in character vocabulary with a context of [`CONTEXT`]
/// and no end-of-sequence token (completions end only by length), saved to `dir`.
fn small_context_model(dir: &Path) -> Policy<InferBackend> {
    let vocab = rlstream::tasks::char_tokenizer().vocab_size();
    let mut cfg = ModelConfig::tiny(Architecture::Llama, vocab);
    cfg.max_position = CONTEXT;
    cfg.eos_token_id = None;
    let model = Policy::<InferBackend>::random(&cfg, 5, &Default::default()).expect("model");
    model.save_hf(dir).expect("save");
    Tokenizer::save_char(&rlstream::tasks::char_tokenizer(), dir).expect("tokenizer");
    model
}

use crate::common::dead_letters;

/// Each dead letter's message id (`prompt_id` or `group_id`), with its reason and error.
fn letters_by_id<M: schema::Message>(
    letters: &[DeadLetter],
    id: impl Fn(&M) -> String,
) -> BTreeMap<String, (String, String)> {
    letters
        .iter()
        .map(|l| {
            let m: M = schema::decode(&l.payload).expect("the original message");
            (id(&m), (l.reason.clone(), l.error.clone()))
        })
        .collect()
}

fn prompt(id: &str, tokens: Vec<u32>) -> Bytes {
    let p = Prompt {
        prompt_id: id.into(),
        task: "test".into(),
        text: String::new(),
        prompt_tokens: Some(tokens.into()),
        meta: BTreeMap::new(),
        ..schema::examples::prompt()
    };
    Bytes::from(schema::encode(&p).expect("encode"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gen_fits_prompts_to_the_context_and_dead_letters_what_cannot_run() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let ns = crate::common::unique_ns("poisongen");
    let model_dir = d.join("model");
    small_context_model(&model_dir);
    let vocab = rlstream::tasks::char_tokenizer().vocab_size() as u32;
    let top = vocab - 1;
    let prompts = [
        ("fits", vec![1, 2, 3, 4, 5, 6, 7, 8, 9, top]),
        ("edge", vec![2; CONTEXT - 1]),
        ("over", vec![3; CONTEXT]),
        ("vocab", vec![1, vocab, 2]),
        ("panics", vec![4, 5]),
        ("after", vec![6, 7]),
    ];
    let bus = crate::common::redis_bus().await;
    let entries: Vec<Bytes> = prompts.iter().map(|(i, t)| prompt(i, t.clone())).collect();
    bus.publish(&format!("{ns}:prompts"), &entries, None)
        .await
        .expect("publish");

    // Default: no truncation. A fault makes every pass over `panics` panic.
    let log = d.join("gen.log");
    let args: Vec<String> = [
        "gen",
        "--redis",
        &crate::common::redis_url(),
        "--namespace",
        &ns,
        "--model",
        model_dir.to_str().expect("utf-8"),
        "--group-size",
        "2",
        "--max-new-tokens",
        "9",
    ]
    .map(String::from)
    .to_vec();
    let mut generator = crate::common::spawn_with_env(&args, &log, &[(FAULT_ENV, "panics")]);
    let rollouts = format!("{ns}:rollouts");
    let deadline = Instant::now() + Duration::from_secs(60);
    let groups: Vec<RolloutGroup> = loop {
        let got = bus
            .range(&rollouts, RangeBound::Open, RangeBound::Open, 100)
            .await
            .expect("range");
        let dead = dead_letters(&bus, &format!("{ns}:dead")).await;
        if got.len() + dead.len() >= prompts.len() {
            break got
                .iter()
                .map(|e| schema::decode(&e.payload).expect("rollout"))
                .collect();
        }
        assert!(
            generator.try_wait().is_none(),
            "gen exited:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        assert!(Instant::now() < deadline, "gen stalled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(generator.try_wait().is_none(), "gen is still running");
    let out = interrupt(generator, "gen", &log);
    assert!(out.status.success());

    let by_prompt: BTreeMap<&str, &RolloutGroup> =
        groups.iter().map(|g| (g.prompt_id.as_str(), g)).collect();
    let ids: Vec<&str> = by_prompt.keys().copied().collect();
    assert_eq!(ids, ["after", "edge", "fits"], "generated");
    for (id, completion) in [("fits", 6), ("edge", 1), ("after", 9)] {
        for s in &by_prompt[id].samples {
            assert_eq!(s.tokens.len(), completion, "{id}: the context ends it");
            assert_eq!(s.finish, FinishReason::Length, "{id}");
        }
    }
    let letters = letters_by_id::<Prompt>(&dead_letters(&bus, &format!("{ns}:dead")).await, |p| {
        p.prompt_id.clone()
    });
    let reasons: Vec<(&str, &str)> = letters
        .iter()
        .map(|(id, (r, _))| (id.as_str(), r.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("over", "context"),
            ("panics", "panic"),
            ("vocab", "vocabulary")
        ]
    );
    assert!(
        letters["over"].1.contains("16 tokens")
            && letters["over"].1.contains("context of 16")
            && letters["over"].1.contains("--truncate-prompt left"),
        "{}",
        letters["over"].1
    );
    assert!(
        letters["vocab"]
            .1
            .contains(&format!("prompt_tokens[1] = {vocab}")),
        "{}",
        letters["vocab"].1
    );
    assert!(
        letters["panics"].1.contains("injected fault"),
        "{}",
        letters["panics"].1
    );
    let stats = bus.stats(&format!("{ns}:prompts")).await.expect("stats");
    assert_eq!((stats.groups[0].pending, stats.groups[0].lag), (0, Some(0)));

    // Opt-in left truncation: the long prompt keeps its end, leaving room for every token.
    let ns2 = crate::common::unique_ns("poisongenleft");
    bus.publish(
        &format!("{ns2}:prompts"),
        &[prompt("over", (0..CONTEXT as u32).collect())],
        None,
    )
    .await
    .expect("publish");
    let mut args2 = args.clone();
    args2[4] = ns2.clone();
    args2.extend(["--truncate-prompt".into(), "left".into()]);
    let log2 = d.join("gen2.log");
    let generator = spawn(&args2, &log2);
    let deadline = Instant::now() + Duration::from_secs(60);
    let group: RolloutGroup = loop {
        let got = bus
            .range(
                &format!("{ns2}:rollouts"),
                RangeBound::Open,
                RangeBound::Open,
                1,
            )
            .await
            .expect("range");
        if let Some(e) = got.first() {
            break schema::decode(&e.payload).expect("rollout");
        }
        assert!(Instant::now() < deadline, "gen stalled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    interrupt(generator, "gen", &log2);
    assert_eq!(
        group.prompt_tokens.as_slice(),
        &(CONTEXT as u32 - 7..CONTEXT as u32).collect::<Vec<_>>()[..]
    );
    assert!(group.samples.iter().all(|s| s.tokens.len() == 9));
    crate::common::drop_namespace(&ns).await;
    crate::common::drop_namespace(&ns2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn train_dead_letters_what_the_model_cannot_run_and_trains_the_rest() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let ns = crate::common::unique_ns("poisontrain");
    let model_dir = d.join("model");
    let model = small_context_model(&model_dir);
    let vocab = rlstream::tasks::char_tokenizer().vocab_size() as u32;
    let good = |i: u64, prompt: Vec<u32>| {
        crate::common::sampled_group(
            &model,
            &format!("g{i}"),
            prompt,
            4,
            i,
            vec![1.0, 0.0, 0.5, 0.25],
        )
    };
    // Accepted at the limits: the vocabulary's last id, a sample of exactly the context.
    let mut last_id = good(0, vec![vocab - 1, 3]);
    last_id.rollout.samples[0].tokens.0[0] = vocab - 1;
    let at_context = good(1, vec![5; CONTEXT - 4]);
    let mut completion_past = good(100, vec![1, 3]);
    completion_past.rollout.samples[2].tokens.0[1] = vocab;
    let mut prompt_past = good(101, vec![1, 2]);
    prompt_past.rollout.prompt_tokens = vec![1, vocab].into();
    // Generated from 12 prompt tokens, then given a 13th: 17 tokens in all.
    let mut over_context = good(102, vec![5; CONTEXT - 4]);
    over_context.rollout.prompt_tokens = vec![5; CONTEXT - 3].into();
    let empty_prompt = good(103, vec![]);
    let mut entries: Vec<ScoredGroup> = vec![last_id, at_context];
    entries.extend((2..9).map(|i| good(i, vec![(i % 20) as u32 + 1, 3])));
    for (k, bad) in [completion_past, prompt_past, over_context, empty_prompt]
        .into_iter()
        .enumerate()
    {
        entries.insert(1 + 2 * k, bad);
    }
    let bytes: Vec<Bytes> = entries
        .iter()
        .map(|g| Bytes::from(schema::encode(g).expect("encode")))
        .collect();
    let bus = crate::common::redis_bus().await;
    let scored = format!("{ns}:scored");
    bus.publish(&scored, &bytes, None).await.expect("publish");

    // g3's training passes panic: its step is re-run without it.
    let ckpt = d.join("ckpt");
    let out = crate::common::train_two_steps(&ns, &model_dir, &ckpt, &[(FAULT_ENV, "g3")]);
    assert!(out.starts_with("trained 2 steps"), "{out}");

    let letters =
        letters_by_id::<ScoredGroup>(&dead_letters(&bus, &format!("{ns}:dead")).await, |g| {
            g.rollout.group_id.clone()
        });
    let reasons: Vec<(&str, &str)> = letters
        .iter()
        .map(|(id, (r, _))| (id.as_str(), r.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("g100", "vocabulary"),
            ("g101", "vocabulary"),
            ("g102", "context"),
            ("g103", "shape"),
            ("g3", "panic"),
        ]
    );
    let error = |id: &str| letters[id].1.as_str();
    assert!(
        error("g100").contains(&format!("samples[2].tokens[1] = {vocab}")),
        "{}",
        error("g100")
    );
    assert!(
        error("g101").contains(&format!("prompt_tokens[1] = {vocab}")),
        "{}",
        error("g101")
    );
    assert!(
        error("g102")
            .contains("13 prompt + 4 completion = 17 tokens, over the model's context of 16"),
        "{}",
        error("g102")
    );
    assert!(error("g3").contains("injected fault"), "{}", error("g3"));

    // Both steps were taken: the first on the three good groups of its batch, the second
    // on four; the limit cases among them.
    let trained = crate::common::trained_groups(&ckpt);
    assert_eq!(trained, ["g0", "g1", "g2", "g4", "g5", "g6", "g7"]);
    crate::common::drop_namespace(&ns).await;
}

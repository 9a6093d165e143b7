//! Routing replay, isolated: the training–inference mismatch of a mixture-of-experts policy
//! between the log-probs its sampler drew with and the ones the trainer computes for the
//! same tokens, with the recorded experts replayed and with the trainer's router routing
//! live.
//!
//! The policies are the checkpoints of an `rlstream run` of an MoE model (`--experts`,
//! `--checkpoint-every 1`). For each pair (sampler at step `s`, trainer at step `s + lag`)
//! the sampler generates as `gen` does (NdArray, weights `[out, in]`), either with the f32 weights or with them
//! rounded to bf16 (as `--wire-dtype bf16` ships them: the precision gap an inference engine
//! in bf16 has to an f32 trainer); the trainer scores on Autodiff over NdArray, in f32, as
//! `train` does. Printed per setting: the share of recorded (token, MoE layer) decisions
//! the trainer's live router makes differently, and the mean |log π − log μ| and the k3
//! estimate of KL(μ‖π) over the sampled tokens under replay and live routing.
//!
//! ```sh
//! rlstream sft --task sort --experts 8 --out W
//! rlstream run --model W --task longer --steps 12 --checkpoint-every 1 --out RUN
//! cargo bench --bench routing_mismatch -- RUN [PROMPTS=256] [LAGS=0,1,3]
//! ```

use burn::tensor::Tensor;
use rlstream::model::hf::{self, load_hf};
use rlstream::model::logprobs::{Routed, ScoredSeq, completion_logprobs_routed};
use rlstream::model::sampler::{Completion, Generator, Request};
use rlstream::model::tensors::TensorMap;
use rlstream::model::{InferBackend, Policy, TrainBackend};
use rlstream::schema::SamplingParams;
use rlstream::tasks::BuiltinTask;
use std::path::{Path, PathBuf};

const SAMPLES: usize = 4;
const MAX_NEW: u32 = 24;

fn checkpoints(run: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap_or_else(|e| panic!("{}/checkpoints: {e}", run.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step-"))
        })
        .collect();
    dirs.sort();
    dirs
}

fn rounded(t: &TensorMap) -> TensorMap {
    let mut out = t.clone();
    for v in out.values_mut() {
        v.data
            .iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
    }
    out
}

fn generate(sampler: &Policy<InferBackend>, prompts: &[Vec<u32>]) -> Vec<Completion> {
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            id: i as u64,
            prompt: p.clone(),
            n: SAMPLES,
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                max_new_tokens: MAX_NEW,
                stop_tokens: vec![rlstream::model::tokenizer::CharTokenizer::EOS],
                seed: 7 + i as u64,
            },
        })
        .collect();
    let mut out = Vec::new();
    for chunk in requests.chunks(16) {
        out.extend(Generator::generate(sampler, 0, chunk).expect("generate"));
    }
    out
}

#[derive(Default)]
struct Gap {
    abs: f64,
    kl: f64,
    n: f64,
}

fn host(t: Tensor<TrainBackend, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Mean |Δ log p| and k3 KL(μ‖π) of `done` scored by `trainer` routed as `routed`, and the
/// share of routing decisions that differ.
fn score(
    trainer: &Policy<TrainBackend>,
    prompts: &[Vec<u32>],
    done: &[Completion],
    routed: Routed,
) -> (Gap, f64) {
    let mut gap = Gap::default();
    let (mut compared, mut differ) = (0usize, 0usize);
    for chunk in done.chunks(32) {
        let seqs: Vec<ScoredSeq<'_>> = chunk
            .iter()
            .map(|c| ScoredSeq {
                prompt: &prompts[c.request_id as usize],
                completion: &c.tokens,
                mask: None,
                routing: c.prompt_routing.as_deref().zip(c.routing.as_ref()),
            })
            .collect();
        let (lp, valid, stats) = completion_logprobs_routed(trainer, &seqs, 1.0, routed);
        compared += stats.compared;
        differ += stats.differ;
        let (lp, valid) = (host(lp), host(valid));
        let width = lp.len() / chunk.len();
        for (r, c) in chunk.iter().enumerate() {
            for (j, &mu) in c.logprobs.iter().enumerate() {
                if valid[r * width + j] == 0.0 {
                    continue;
                }
                let d = f64::from(lp[r * width + j] - mu);
                gap.abs += d.abs();
                gap.kl += d.exp() - 1.0 - d;
                gap.n += 1.0;
            }
        }
    }
    (gap, differ as f64 / compared.max(1) as f64)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let Some(run) = args.first().map(PathBuf::from) else {
        eprintln!("usage: cargo bench --bench routing_mismatch -- RUN_DIR [PROMPTS] [LAGS]");
        std::process::exit(2);
    };
    let n_prompts: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let lags: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![0, 1, 3]);
    let ckpts = checkpoints(&run);
    assert!(
        ckpts.len() > lags.iter().max().copied().unwrap_or(0),
        "not enough checkpoints"
    );
    let tok = rlstream::tasks::char_tokenizer();
    let prompts: Vec<Vec<u32>> = (0..n_prompts)
        .map(|i| tok.encode(&BuiltinTask::Longer.item(99, i).prompt))
        .collect();
    let device = Default::default();
    println!(
        "{}: {} prompts × {SAMPLES} samples, up to {MAX_NEW} tokens, temperature 1\n",
        run.display(),
        prompts.len()
    );
    println!(
        "| sampler weights | lag (versions) | routing differs | mean \\|Δ log p\\| replay | live | KL replay | live |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for &lag in &lags {
        // Sampler at the last checkpoint that leaves room for the lag.
        let s = ckpts.len() - 1 - lag;
        let trainer: Policy<TrainBackend> = load_hf(&ckpts[s + lag], &device).expect("trainer");
        let tensors = hf::read_hf_tensors(&ckpts[s]).expect("sampler weights");
        let cfg = trainer.config().clone();
        assert!(
            cfg.moe.is_some(),
            "{} is not an MoE model",
            ckpts[s].display()
        );
        for (name, weights) in [("f32", tensors.clone()), ("bf16", rounded(&tensors))] {
            let sampler = Policy::<InferBackend>::from_tensors(&cfg, &weights, &Default::default())
                .expect("sampler");
            let done = generate(&sampler, &prompts);
            let (replay, differs) = score(&trainer, &prompts, &done, Routed::Replay);
            let (live, _) = score(&trainer, &prompts, &done, Routed::Live);
            let m = |g: &Gap| (g.abs / g.n.max(1.0), g.kl / g.n.max(1.0));
            let ((ra, rk), (la, lk)) = (m(&replay), m(&live));
            println!(
                "| {name} | {lag} | {:.2}% | {ra:.3e} | {la:.3e} | {rk:.3e} | {lk:.3e} |",
                100.0 * differs
            );
            json.push(serde_json::json!({
                "sampler": name, "lag": lag, "sampler_step": ckpts[s].display().to_string(),
                "tokens": replay.n, "routing_differs": differs,
                "abs_logprob_gap": {"replay": ra, "live": la},
                "kl": {"replay": rk, "live": lk},
            }));
        }
    }
    let out = run.join("routing_mismatch.json");
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .expect("write results");
    println!("\nwritten to {}", out.display());
}

//! Model speed on the CPU backends burn offers here (Flex and NdArray), side by side:
//!
//! - generation: batch 32, prompt 16, 128 new tokens, KV cache (tokens/s);
//! - one training step: batch 32 × 64 tokens, forward + backward + AdamW;
//! - weights as bytes: serialise and rebuild a ~25M-parameter model (bytes/s).
//!
//! The config is [`bench_config`]; `benches/model_vs_torch.sh` runs the same config in
//! PyTorch and prints the ratios.
//!
//! `cargo bench --features flex --bench model`

use burn::backend::{Autodiff, Flex, NdArray};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{Architecture, Kernels, ModelConfig, Policy};
use rlstream::schema::SamplingParams;
use std::time::Duration;

const BATCH: usize = 32;
const PROMPT: usize = 16;
const NEW_TOKENS: usize = 128;
const TRAIN_LEN: usize = 64;

/// The documented small config (~0.8M parameters), shared with benches/torch_baseline.py.
fn bench_config() -> ModelConfig {
    ModelConfig::new(Architecture::Llama, 128, 128, 384, 4, 4, 2, 32)
        .with_tie_embeddings(true)
        .with_max_position(512)
}

/// ~25M parameters, for the weight blob.
fn big_config() -> ModelConfig {
    ModelConfig::new(Architecture::Qwen2, 8192, 512, 1408, 7, 8, 8, 64).with_qkv_bias(true)
}

fn requests() -> Vec<Request> {
    (0..BATCH)
        .map(|i| Request {
            id: i as u64,
            prompt: (0..PROMPT)
                .map(|j| ((i * 31 + j * 7) % 128) as u32)
                .collect(),
            n: 1,
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                max_new_tokens: NEW_TOKENS as u32,
                stop_tokens: vec![],
                seed: i as u64,
            },
        })
        .collect()
}

fn bench_generate<B: Kernels>(c: &mut Criterion, name: &str) {
    let model = Policy::<B>::random(&bench_config(), 1, &Default::default()).unwrap();
    let reqs = requests();
    let mut g = c.benchmark_group("model/generate_b32_p16_t128");
    g.throughput(Throughput::Elements((BATCH * NEW_TOKENS) as u64));
    g.sample_size(10);
    g.bench_function(name, |b| {
        b.iter(|| Generator::generate(&model, 0, &reqs).expect("generate"))
    });
    g.finish();
}

fn bench_train<B: AutodiffBackend + Kernels>(c: &mut Criterion, name: &str) {
    let mut model = Policy::<B>::random(&bench_config(), 2, &Default::default()).unwrap();
    let mut optim = AdamWConfig::new().with_weight_decay(0.01).init();
    let seqs: Vec<(Vec<u32>, Vec<u32>)> = (0..BATCH)
        .map(|i| {
            let all: Vec<u32> = (0..TRAIN_LEN)
                .map(|j| ((i * 13 + j * 5) % 128) as u32)
                .collect();
            (all[..PROMPT].to_vec(), all[PROMPT..].to_vec())
        })
        .collect();
    let mut g = c.benchmark_group("model/train_step_b32_t64");
    g.throughput(Throughput::Elements((BATCH * TRAIN_LEN) as u64));
    g.sample_size(10);
    g.bench_function(name, |b| {
        b.iter(|| {
            let batch: Vec<ScoredSeq<'_>> =
                seqs.iter().map(|(p, c)| ScoredSeq::plain(p, c)).collect();
            let (lp, valid) = completion_logprobs(&model, &batch, 1.0);
            let loss = (lp * valid)
                .sum()
                .neg()
                .div_scalar((BATCH * (TRAIN_LEN - PROMPT)) as f32);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model.clone(), grads);
        })
    });
    g.finish();
}

fn weights(c: &mut Criterion) {
    let cfg = big_config();
    let model = Policy::<Flex>::random(&cfg, 3, &Default::default()).unwrap();
    let bytes = model.to_bytes().unwrap();
    println!(
        "weights: {} parameters, {} bytes",
        cfg.num_params(),
        bytes.len()
    );
    let mut g = c.benchmark_group("model/weights_25m");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.sample_size(10);
    g.bench_function("to_bytes", |b| b.iter(|| model.to_bytes().unwrap()));
    g.bench_function("from_bytes", |b| {
        b.iter(|| Policy::<Flex>::from_bytes(&cfg, &bytes, &Default::default()).unwrap())
    });
    g.finish();
}

fn model(c: &mut Criterion) {
    println!("bench config: {} parameters", bench_config().num_params());
    bench_generate::<Flex>(c, "flex");
    bench_generate::<NdArray>(c, "ndarray");
    bench_train::<Autodiff<Flex>>(c, "flex");
    bench_train::<Autodiff<NdArray>>(c, "ndarray");
    weights(c);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(10)).warm_up_time(Duration::from_secs(2));
    targets = model
}
criterion_main!(benches);

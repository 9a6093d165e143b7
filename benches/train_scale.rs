//! The trainer's step at two sizes, the rlstream side of `benches/scale_vs_torch.py`.
//!
//! ```text
//! cargo bench --bench train_scale -- write SIZE DIR          # a random checkpoint
//! cargo bench --bench train_scale -- step DIR MICRO STEPS    # time it; prints JSON
//! cargo bench --bench train_scale -- load DIR                # load time and peak memory
//! cargo bench --bench train_scale -- peak                    # measured f32 FMA peak and read GB/s
//! cargo bench --bench train_scale -- write-vocab SIZE VOCAB DIR   # SIZE's shape at another vocabulary
//! cargo bench --bench train_scale -- long DIR LEN SAMPLES    # one step on SAMPLES sequences of LEN tokens
//! cargo bench --bench train_scale -- generate DIR PROMPT NEW ROWS   # tokens/s, peak memory
//! cargo bench --features flex --bench train_scale -- generate-flex DIR PROMPT NEW ROWS   # on Flex, the sampler before
//! cargo bench --bench train_scale -- bf16 DIR OUT            # DIR's weights as bf16 in OUT
//! cargo bench --bench train_scale -- weights DIR LRS STEPS STORE ROWS   # publish-to-swap, a generator decoding
//! cargo bench --bench train_scale -- step-lora DIR MICRO STEPS RANK    # `step` training a LoRA adapter
//! cargo bench --bench train_scale -- generate-lora DIR PROMPT NEW ROWS RANK  # merged vs unmerged adapter
//! cargo bench --bench train_scale -- teacher SIZE DIR GROUPS # a teacher scorer's prefill per group
//! cargo bench --bench train_scale -- invariance ROWS         # per-row bits of a product by batch size
//! cargo bench --bench train_scale -- decode-products ROWS    # a decode step's products, f32 and bf16 weights
//! ```
//!
//! `step`, `step-lora` and `long` run with `train.keep_freed_memory` on when
//! `KEEP_FREED_MEMORY` is set in the environment (any value), and with
//! `train.gradient_checkpointing` on when `GRADIENT_CHECKPOINTING` is.
//!
//! `invariance` multiplies ROWS random rows by each of the 0.5B shape's linear weights
//! (896 → 896, 896 → 4864, 4864 → 896) two ways, the general matrix product
//! (`matrixmultiply`, or the system BLAS in a `--features blas` build) and the linear
//! kernel every forward pass uses (on the weight stored `[out, in]`, as a generation model
//! keeps it; the trainer's is transposed first), and for M = 1, 8 and ROWS counts the outputs of the first
//! M rows whose bits differ from the same rows' outputs at M = ROWS; then times each way at
//! M = ROWS (best of 3).
//!
//! `teacher` scores SIZE's batch (each group: its prompt and completions) with DIR as the
//! teacher, through the scorer's own code (`score --teacher`: one batched prefill per group,
//! log-probs over the full vocabulary), and prints the median seconds per group over GROUPS
//! groups after a warm-up one. DIR needs a tokenizer, which the student shares: copy one
//! next to a written checkpoint (`tests/fixtures/tokenizers/qwen3/tokenizer.json` for
//! `0.5b`).
//!
//! `step-lora` is `step` with a rank-RANK adapter (alpha 32) on every linear module and the
//! base frozen; it also prints the adapter's parameters and the bytes of one adapter version
//! on the wire in bf16 against a whole bf16 version. `generate-lora` times `generate` three
//! ways in one process: the base alone, the base with an adapter applied unmerged in every
//! forward pass, and the adapter merged into a copy of the base (plus the merge itself).
//!
//! `weights` trains, publishes and swaps versions at scale with a generator process
//! decoding all along: see `train_scale/weights.rs`.
//!
//! With `--features mpi`, under `mpirun -n N`: `step-ranks` is `step` over N trainer
//! ranks (each group of the fixed batch split into PARTS groups, so that every rank has
//! some; run it with `-n 1` for the one-rank time on the same batch; SHARD is `train.shard`,
//! `none` by default), printing rank 0's median step time and the ranks' peak memory;
//! `allreduce` times the bucketed all-reduce (BUCKET_MB MiB buckets) of VALUES f32 values in
//! f32 and in bf16, and the sharded path's reduce-scatter plus all-gather of the same values,
//! against a memcpy of the same bytes.
//!
//! SIZE is `small` (the 0.8M-parameter config of `benches/model.rs`, batch 32 × (16 prompt +
//! 48 completion) tokens) or `0.5b` (Qwen2.5-0.5B's shape: 494M parameters, batch 8 × (32 +
//! 64)). `step` loads DIR the way `rlstream train` does, takes one warm-up step and STEPS
//! timed ones on a fixed PPO batch (micro-batches of at most MICRO tokens; 0 for one pass),
//! and prints the median step time and the process's peak resident memory. Writing the
//! checkpoint in its own process keeps model construction out of that peak.

use burn::module::AutodiffModule;
use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::hf::load_hf;
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::tensors::WeightDtype;
use rlstream::model::{Architecture, InferBackend, Kernels, ModelConfig, Policy, WeightStorage};
use rlstream::schema::{
    self, FinishReason, Sample, SamplingParams, SchemaVersion, ScoredGroup, VersionRun,
};
use rlstream::stages::train::{Trainer, TrainerSettings};
use std::path::Path;

use std::time::Instant;

#[path = "train_scale/weights.rs"]
mod weights;

#[path = "train_scale/device.rs"]
mod device;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// (config, groups, samples per group, prompt tokens, completion tokens) of a size.
fn shape(size: &str) -> (ModelConfig, usize, usize, usize, usize) {
    match size {
        "small" => (
            ModelConfig::new(Architecture::Llama, 128, 128, 384, 4, 4, 2, 32)
                .with_tie_embeddings(true)
                .with_max_position(512),
            4,
            8,
            16,
            48,
        ),
        "0.5b" => (
            ModelConfig::new(Architecture::Qwen2, 151_936, 896, 4864, 24, 14, 2, 64)
                .with_qkv_bias(true)
                .with_tie_embeddings(true)
                .with_rope_theta(1_000_000.0)
                .with_max_position(32_768),
            1,
            8,
            32,
            64,
        ),
        other => panic!("unknown size {other}: small or 0.5b"),
    }
}

/// The fixed batch of a size.
fn batch(size: &str, vocab: u32) -> Vec<ScoredGroup> {
    let (_, groups, per, prompt, completion) = shape(size);
    batch_of(groups, per, prompt, completion, vocab)
}

/// `groups` groups of `per` completions of `completion` tokens after a `prompt`-token prompt:
/// alternating advantages, behaviour log-probs near a uniform policy's.
fn batch_of(
    groups: usize,
    per: usize,
    prompt: usize,
    completion: usize,
    vocab: u32,
) -> Vec<ScoredGroup> {
    let uniform = -(vocab as f32).ln();
    (0..groups)
        .map(|g| {
            let mut rollout = schema::examples::rollout_group(1, 1, 2, 0);
            rollout.group_id = format!("bench-{g}");
            rollout.prompt_tokens = (0..prompt)
                .map(|j| ((g * 31 + j * 7) as u32) % vocab)
                .collect::<Vec<_>>()
                .into();
            rollout.samples = (0..per)
                .map(|i| Sample {
                    tokens: (0..completion)
                        .map(|j| ((g * 13 + i * 17 + j * 5) as u32) % vocab)
                        .collect::<Vec<_>>()
                        .into(),
                    logprobs: vec![uniform; completion].into(),
                    versions: vec![VersionRun {
                        start: 0,
                        version: 0,
                    }],
                    finish: FinishReason::Length,
                    mask: None,
                    env: Vec::new(),
                    turn_rewards: Vec::new(),
                    routing: None,
                })
                .collect();
            ScoredGroup {
                schema: SchemaVersion::CURRENT,
                rollout,
                rewards: vec![0.0; per],
                advantages: (0..per)
                    .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
                    .collect(),
                token_rewards: None,
                ref_logprobs: None,
                scorer_id: "bench".into(),
                scored_us: 0,
            }
        })
        .collect()
}

/// Peak resident memory of this process in MB (VmHWM).
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn write(size: &str, dir: &Path) {
    let (cfg, ..) = shape(size);
    let model = Policy::<InferBackend>::random(&cfg, 7, &Default::default()).expect("model");
    model.save_hf(dir).expect("save");
    println!(
        "{{\"size\": \"{size}\", \"params\": {}, \"dir\": \"{}\"}}",
        cfg.num_params(),
        dir.display()
    );
}

/// SIZE's shape with a vocabulary of `vocab` ids and room for 8,192 positions, as a random
/// checkpoint in DIR.
fn write_vocab(size: &str, vocab: usize, dir: &Path) {
    let (mut cfg, ..) = shape(size);
    cfg.vocab_size = vocab;
    cfg.max_position = cfg.max_position.max(8192);
    let model = Policy::<InferBackend>::random(&cfg, 7, &Default::default()).expect("model");
    model.save_hf(dir).expect("save");
    println!(
        "{{\"size\": \"{size}\", \"vocab\": {vocab}, \"params\": {}, \"dir\": \"{}\"}}",
        cfg.num_params(),
        dir.display()
    );
}

/// One trainer step on SAMPLES sequences of LEN tokens each (a 32-token prompt, the rest
/// completion), one sequence a micro-batch, as a user would train long completions: the
/// step's time and the process's peak memory.
fn long(dir: &Path, len: usize, samples: usize) {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json")).expect("config.json"),
    )
    .expect("json");
    let vocab = config["vocab_size"].as_u64().expect("vocab_size") as u32;
    let ckpt = tempfile::tempdir().expect("tmp");
    let settings = trainer_settings(dir, ckpt.path(), 1e-5, len);
    let mut trainer = Trainer::start(&settings).expect("trainer");
    let groups = batch_of(1, samples, 32, len - 32, vocab);
    let refs: Vec<&ScoredGroup> = groups.iter().collect();
    let t = Instant::now();
    let record = trainer.step(&refs).expect("step");
    assert!(!record.skipped, "a skipped step measures nothing");
    println!(
        "{{\"len\": {len}, \"samples\": {samples}, \"vocab\": {vocab}, \"step_s\": {:.3}, \"peak_rss_mb\": {:.0}}}",
        t.elapsed().as_secs_f64(),
        peak_rss_mb()
    );
}

/// The machine's f32 fused multiply-add peak, measured: every core runs independent chains
/// of vector FMAs (12 accumulators, the widest vectors the CPU has) for a fixed count, and
/// the best of three rounds is reported in GFLOP/s (an FMA is two).
fn peak() {
    let cores = rayon::current_num_threads();
    const ITERS: u64 = 20_000_000;
    let mut best = 0f64;
    let mut width = 0;
    for _ in 0..3 {
        let t = Instant::now();
        let lanes: Vec<usize> = {
            use rayon::prelude::*;
            (0..cores)
                .into_par_iter()
                .map(|_| fma_chains(ITERS))
                .collect()
        };
        let secs = t.elapsed().as_secs_f64();
        width = lanes.first().copied().unwrap_or(0);
        let flops = 2.0 * 12.0 * ITERS as f64 * width as f64 * cores as f64;
        best = best.max(flops / secs / 1e9);
    }
    println!(
        "{{\"peak_gflops\": {best:.1}, \"cores\": {cores}, \"lanes\": {width}, \
         \"read_gbs\": {:.1}}}",
        read_bandwidth()
    );
}

/// The cores' measured rate of reading memory, in GB/s: the best of 5 passes summing a
/// 1 GiB buffer (far past every cache) split evenly over the cores.
fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let buffer: Vec<f32> = (0..1usize << 28).map(|i| (i % 7) as f32).collect();
    let part = buffer.len().div_ceil(rayon::current_num_threads());
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: f32 = buffer
            .par_chunks(part)
            .map(|chunk| {
                // 64 independent lanes: the compiler keeps them in vector registers.
                let mut acc = [0f32; 64];
                for block in chunk.chunks_exact(64) {
                    for (a, x) in acc.iter_mut().zip(block) {
                        *a += x;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(sum);
        best = best.max((buffer.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Runs `iters` rounds of 12 independent vector FMAs; returns the vector's f32 lanes.
fn fma_chains(iters: u64) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            unsafe { fma512(iters) };
            return 16;
        }
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { fma256(iters) };
            return 8;
        }
    }
    let mut acc = [1f32; 12];
    for _ in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(acc);
    1
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma512(iters: u64) {
    use std::arch::x86_64::*;
    let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in &mut acc {
            *x = _mm512_fmadd_ps(*x, m, a);
        }
    }
    std::hint::black_box(acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma256(iters: u64) {
    use std::arch::x86_64::*;
    let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in &mut acc {
            *x = _mm256_fmadd_ps(*x, m, a);
        }
    }
    std::hint::black_box(acc);
}

/// The size DIR's checkpoint has (by its vocabulary) and that vocabulary.
fn size_of(dir: &Path) -> (&'static str, u32) {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json")).expect("config.json"),
    )
    .expect("json");
    let vocab = config["vocab_size"].as_u64().expect("vocab_size") as u32;
    (if vocab > 1000 { "0.5b" } else { "small" }, vocab)
}

/// The trainer's settings for DIR's model at `lr`, checkpointing to `ckpt`.
fn trainer_settings(dir: &Path, ckpt: &Path, lr: f64, micro: usize) -> TrainerSettings {
    lora_settings(dir, ckpt, lr, micro, 0)
}

/// [`trainer_settings`] training a rank-`rank` adapter (0: every weight).
fn lora_settings(dir: &Path, ckpt: &Path, lr: f64, micro: usize, rank: usize) -> TrainerSettings {
    TrainerSettings {
        policy: PolicySettings {
            model: Some(dir.to_path_buf()),
            ..PolicySettings::default()
        },
        train: TrainConfig {
            micro_batch_tokens: micro,
            lr,
            checkpoint_dir: ckpt.to_path_buf(),
            lora_rank: rank,
            keep_freed_memory: std::env::var_os("KEEP_FREED_MEMORY").is_some(),
            gradient_checkpointing: std::env::var_os("GRADIENT_CHECKPOINTING").is_some(),
            ..TrainConfig::default()
        },
    }
}

fn step(dir: &Path, micro: usize, steps: usize, rank: usize) {
    let (size, vocab) = size_of(dir);
    let ckpt = tempfile::tempdir().expect("tmp");
    let settings = lora_settings(dir, ckpt.path(), 1e-5, micro, rank);
    let mut trainer = Trainer::start(&settings).expect("trainer");
    let groups = batch(size, vocab);
    let refs: Vec<&ScoredGroup> = groups.iter().collect();
    let mut times = Vec::new();
    if std::env::var_os("TRAIN_SCALE_PHASES").is_some() {
        for _ in 0..2 {
            let t = Instant::now();
            let _ = trainer.gradients(&refs).expect("gradients");
            eprintln!("gradients only: {:.3} s", t.elapsed().as_secs_f64());
        }
    }
    for i in 0..=steps {
        let t = Instant::now();
        let record = trainer.step(&refs).expect("step");
        assert!(!record.skipped, "a skipped step times nothing");
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        eprintln!("step {i}: {:.3} s", t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let cfg = trainer.model().config().clone();
    let lora = match trainer.adapter() {
        Some(a) => {
            let params = a.spec.num_params(&cfg);
            let blob = rlstream::model::tensors::tensors_to_safetensors_as(
                &trainer.model().valid().adapter_tensors().expect("adapter"),
                WeightDtype::Bf16,
            )
            .expect("encode");
            format!(
                ", \"lora_rank\": {rank}, \"trainable_params\": {params}, \
                 \"sync_bytes_bf16\": {}, \"full_bytes_bf16\": {}, \"sync_share\": {:.5}",
                blob.len(),
                cfg.num_params() * 2,
                blob.len() as f64 / (cfg.num_params() * 2) as f64
            )
        }
        None => format!(", \"trainable_params\": {}", cfg.num_params()),
    };
    println!(
        "{{\"size\": \"{size}\", \"micro_batch_tokens\": {micro}, \"steps\": {steps}, \
         \"step_s\": {:.4}, \"peak_rss_mb\": {:.0}, \"blas\": \"{}\"{lora}}}",
        times[times.len() / 2],
        peak_rss_mb(),
        rlstream::cpu::blas_core().unwrap_or_else(|| "none".into())
    );
}

/// Loads DIR for generation (as `rlstream gen` does) and reports the time
/// and the process's peak memory.
fn load(dir: &Path) {
    let base = peak_rss_mb();
    let t = Instant::now();
    let model: Policy<InferBackend> = load_hf(dir, &Default::default()).expect("load");
    let load_s = t.elapsed().as_secs_f64();
    println!(
        "{{\"load_s\": {load_s:.3}, \"peak_rss_mb\": {:.0}, \"base_rss_mb\": {base:.0}, \
         \"params\": {}}}",
        peak_rss_mb(),
        model.config().num_params()
    );
}

/// ROWS sequences of PROMPT tokens each, NEW sampled tokens per row at temperature 1 (no
/// stop token): one warm-up run of 4 tokens, then the timed run.
fn generate<B: Kernels>(dir: &Path, prompt: usize, new: usize, rows: usize) {
    let model: Policy<B> = load_hf(dir, &Default::default()).expect("load");
    let (secs, tokens) = time_generation(&model, prompt, new, rows);
    println!(
        "{{\"rows\": {rows}, \"prompt\": {prompt}, \"new\": {new}, \"tokens\": {tokens}, \
         \"seconds\": {secs:.3}, \"tokens_per_s\": {:.2}, \"peak_rss_mb\": {:.0}}}",
        tokens as f64 / secs,
        peak_rss_mb()
    );
}

/// Generation with a rank-`rank` adapter on every linear module (random, nonzero), applied
/// unmerged and merged, against the base alone; see the module docs.
fn generate_lora(dir: &Path, prompt: usize, new: usize, rows: usize, rank: usize) {
    use rlstream::model::layers::Target;
    use rlstream::model::lora::LoraSpec;
    let base: Policy<InferBackend> = load_hf(dir, &Default::default()).expect("load");
    let spec = LoraSpec {
        rank,
        alpha: 32.0,
        dropout: 0.0,
        targets: Target::ALL.to_vec(),
    };
    let fresh = base.clone().with_fresh_adapter(&spec, 1).expect("adapter");
    // A trained adapter's B is not zero; the timing does not depend on the values.
    let tensors = fresh.adapter_tensors().expect("tensors");
    let tensors = tensors
        .into_iter()
        .map(|(n, mut t)| {
            if n.contains(".lora_B.") {
                t.data
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = ((i % 7) as f32 - 3.0) * 1e-3);
            }
            (n, t)
        })
        .collect();
    let t = Instant::now();
    let unmerged = base.clone().with_adapter(&spec, &tensors).expect("adapter");
    let attach_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let merged = unmerged.merged();
    let merge_s = t.elapsed().as_secs_f64() + attach_s;
    let mut line = format!(
        "{{\"rows\": {rows}, \"prompt\": {prompt}, \"new\": {new}, \"rank\": {rank}, \
         \"attach_s\": {attach_s:.3}, \"merge_s\": {merge_s:.3}"
    );
    for (name, model) in [
        ("base", &base),
        ("unmerged", &unmerged),
        ("merged", &merged),
    ] {
        let (secs, tokens) = time_generation(model, prompt, new, rows);
        line += &format!(", \"{name}_tokens_per_s\": {:.2}", tokens as f64 / secs);
    }
    println!("{line}, \"peak_rss_mb\": {:.0}}}", peak_rss_mb());
}

/// The teacher scorer's prefill on SIZE's batch; see the module docs.
fn teacher(size: &str, dir: &Path, groups: usize) {
    use rlstream::model::tokenizer::Tokenizer;
    use rlstream::stages::score::teacher::Teacher;
    let student = Tokenizer::load(dir).expect("a tokenizer in DIR: see the module docs");
    let t = Instant::now();
    let teacher = Teacher::load(dir, &student).expect("teacher");
    let load_s = t.elapsed().as_secs_f64();
    let (cfg, _, per, prompt, completion) = shape(size);
    let group = batch(size, cfg.vocab_size as u32).remove(0).rollout;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut times = Vec::with_capacity(groups);
    for i in 0..=groups {
        let t = Instant::now();
        let out = rt.block_on(teacher.logprobs(&[&group]));
        let secs = t.elapsed().as_secs_f64();
        let lp = out.into_iter().next().expect("one group").expect("scored");
        assert_eq!(lp.len(), per);
        if i > 0 {
            times.push(secs);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "{{\"size\": \"{size}\", \"samples\": {per}, \"prompt\": {prompt}, \"completion\": {completion}, \
         \"load_s\": {load_s:.2}, \"teacher_s_per_group\": {median:.3}, \
         \"completion_tokens_per_s\": {:.1}, \"peak_rss_mb\": {:.0}}}",
        (per * completion) as f64 / median,
        peak_rss_mb()
    );
}

/// Seconds and tokens of generating NEW tokens for ROWS rows after a warm-up run.
fn time_generation<B: Kernels>(
    model: &Policy<B>,
    prompt: usize,
    new: usize,
    rows: usize,
) -> (f64, usize) {
    let vocab = model.config().vocab_size;
    let requests = |new: usize| -> Vec<Request> {
        (0..rows)
            .map(|i| Request {
                id: i as u64,
                prompt: (0..prompt)
                    .map(|j| ((i * 31 + j * 7) % vocab) as u32)
                    .collect(),
                n: 1,
                params: SamplingParams {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                    max_new_tokens: new as u32,
                    stop_tokens: vec![],
                    seed: i as u64,
                },
            })
            .collect()
    };
    Generator::generate(model, 0, &requests(4)).expect("warm-up");
    let t = Instant::now();
    let out = Generator::generate(model, 0, &requests(new)).expect("generate");
    let secs = t.elapsed().as_secs_f64();
    (secs, out.iter().map(|c| c.tokens.len()).sum())
}

/// See the module docs: per-row bits of a product at M = 1, 8 and `rows`, and its time.
fn invariance(rows: usize) {
    use burn::tensor::{Distribution, Tensor};
    use ndarray::Array2;
    let device = Default::default();
    for (k, n) in [(896usize, 896usize), (896, 4864), (4864, 896)] {
        let x =
            Tensor::<InferBackend, 2>::random([rows, k], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<InferBackend, 2>::random([k, n], Distribution::Normal(0.0, 0.05), &device);
        let xs: Vec<f32> = x.to_data().to_vec().expect("f32");
        let ws: Vec<f32> = w.to_data().to_vec().expect("f32");
        let wa = Array2::from_shape_vec((k, n), ws).expect("shape");
        // Each way's product, timed alone; its values for the comparison.
        let gemm = |m: usize| -> (f64, Vec<f32>) {
            let xa = Array2::from_shape_vec((m, k), xs[..m * k].to_vec()).expect("shape");
            let mut y = Array2::<f32>::zeros((m, n));
            let t = Instant::now();
            ndarray::linalg::general_mat_mul(1.0, &xa, &wa, 0.0, &mut y);
            (t.elapsed().as_secs_f64(), y.into_raw_vec_and_offset().0)
        };
        // As a generation model stores it: `[out, in]`, read through a transposed view.
        let w_stored = w.clone().transpose().into_data();
        let w_view = Tensor::<InferBackend, 2>::from_data(w_stored, &device).transpose();
        let kernel = |m: usize| -> (f64, Vec<f32>) {
            let xm = x.clone().slice([0..m, 0..k]);
            let t = Instant::now();
            let y = InferBackend::linear_rows(xm, w_view.clone(), None);
            let secs = t.elapsed().as_secs_f64();
            (secs, y.to_data().to_vec().expect("f32"))
        };
        type Product<'a> = &'a dyn Fn(usize) -> (f64, Vec<f32>);
        for (name, f) in [
            ("general product", &gemm as Product),
            ("linear kernel", &kernel),
        ] {
            let full = f(rows).1;
            let mut differ = Vec::new();
            for m in [1, 8, rows] {
                let y = f(m).1;
                let d = y
                    .iter()
                    .zip(&full)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                differ.push(format!("\"m{m}\": {d}"));
            }
            let secs = (0..3).map(|_| f(rows).0).fold(f64::INFINITY, f64::min);
            let gflops = 2.0 * (rows * k * n) as f64 / secs / 1e9;
            println!(
                "{{\"product\": \"{name}\", \"k\": {k}, \"n\": {n}, \"rows\": {rows}, \"outputs_differing_from_full\": {{{}}}, \"seconds\": {secs:.4}, \"gflops\": {gflops:.1}}}",
                differ.join(", ")
            );
        }
    }
}

/// A decode step's products at the 0.5B shape (the attention and MLP layers and the tied
/// head, `[out, in]` as a generation model holds them) on `rows` rows, with the weights in
/// f32 and in bf16 ([`WeightStorage::decode_weight`] keeps bf16 values in 16 bits): best of 5
/// seconds, GFLOP/s and the weight bytes streamed per second.
fn decode_products(rows: usize) {
    use burn::tensor::{Distribution, Tensor};
    let device = Default::default();
    for (k, n) in [
        (896usize, 896usize),
        (896, 4864),
        (4864, 896),
        (896, 151_936),
    ] {
        let x =
            Tensor::<InferBackend, 2>::random([rows, k], Distribution::Normal(0.0, 1.0), &device);
        let values: Vec<f32> = (0..n * k)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) % 1000) as f32 / 1e4 - 0.05)
            .collect();
        let half: Vec<f32> = values
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        let nudged: Vec<f32> = values
            .iter()
            .map(|v| f32::from_bits(v.to_bits() | 1))
            .collect();
        for (dtype, w, bytes) in [("f32", nudged, 4), ("bf16", half, 2)] {
            let w = InferBackend::decode_weight(w, [n, k], &device);
            let secs = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    let y = InferBackend::linear_rows(x.clone(), w.clone(), None);
                    drop(y);
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let gflops = 2.0 * (rows * k * n) as f64 / secs / 1e9;
            let gbs = (bytes * k * n) as f64 / secs / 1e9;
            println!(
                "{{\"k\": {k}, \"n\": {n}, \"rows\": {rows}, \"weights\": \"{dtype}\", \"seconds\": {secs:.5}, \"gflops\": {gflops:.1}, \"weight_gb_per_s\": {gbs:.1}}}"
            );
        }
    }
}

const USAGE: &str = "write SIZE DIR | step DIR MICRO STEPS | load DIR | \
             generate[-flex] DIR PROMPT NEW ROWS | bf16 DIR OUT | weights DIR LRS STEPS STORE ROWS | \
             step-lora DIR MICRO STEPS RANK | generate-lora DIR PROMPT NEW ROWS RANK | \
             teacher SIZE DIR GROUPS | invariance ROWS | decode-products ROWS | \
             (feature mpi, under mpirun) step-ranks DIR MICRO STEPS PARTS [SHARD] | \
             allreduce VALUES BUCKET_MB | transfers DIR | nccl VALUES | peak | \
             write-vocab SIZE VOCAB DIR | long DIR LEN SAMPLES";

/// The memory and FLOP-rate commands (`peak`, `write-vocab`, `long`); false for others.
fn memory(args: &[&str]) -> bool {
    match args[..] {
        ["peak"] => peak(),
        ["write-vocab", size, vocab, dir] => write_vocab(
            size,
            vocab.parse().expect("VOCAB: a vocabulary size"),
            Path::new(dir),
        ),
        ["long", dir, len, samples] => long(
            Path::new(dir),
            len.parse().expect("LEN: a token count"),
            samples.parse().expect("SAMPLES: a count"),
        ),
        _ => return false,
    }
    true
}

fn main() {
    // SAFETY: the first thing the process does; no other thread runs yet. The MPI modes
    // run with the collective settings `rlstream train` runs with.
    unsafe { rlstream::collective::choose_mpi_algorithms() };
    rlstream::cpu::select_blas_kernels();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    #[cfg(feature = "mpi")]
    if ranks::dispatch(&args) {
        return;
    }
    if weights::dispatch(&args) || memory(&args) {
        return;
    }
    match args[..] {
        ["write", size, dir] => write(size, Path::new(dir)),
        ["load", dir] => load(Path::new(dir)),
        ["transfers", dir] => device::measure(Path::new(dir)),
        ["nccl", values] => device::nccl(values.parse().expect("VALUES: a count")),
        ["generate", dir, prompt, new, rows] => generate::<InferBackend>(
            Path::new(dir),
            prompt.parse().expect("PROMPT: a token count"),
            new.parse().expect("NEW: a token count"),
            rows.parse().expect("ROWS: a count"),
        ),
        #[cfg(feature = "flex")]
        ["generate-flex", dir, prompt, new, rows] => generate::<burn::backend::Flex>(
            Path::new(dir),
            prompt.parse().expect("PROMPT: a token count"),
            new.parse().expect("NEW: a token count"),
            rows.parse().expect("ROWS: a count"),
        ),
        ["bf16", dir, out] => {
            let model: Policy<InferBackend> =
                load_hf(Path::new(dir), &Default::default()).expect("load");
            model
                .save_hf_as(Path::new(out), WeightDtype::Bf16)
                .expect("save");
            let weights = Path::new(out).join("model.safetensors");
            let bytes = std::fs::metadata(weights).map_or(0, |m| m.len());
            println!("{{\"bf16\": \"{out}\", \"bytes\": {bytes}}}");
        }
        ["step", dir, micro, steps] => step(
            Path::new(dir),
            micro.parse().expect("MICRO: a token count"),
            steps.parse().expect("STEPS: a count"),
            0,
        ),
        ["step-lora", dir, micro, steps, rank] => step(
            Path::new(dir),
            micro.parse().expect("MICRO: a token count"),
            steps.parse().expect("STEPS: a count"),
            rank.parse().expect("RANK: a LoRA rank"),
        ),
        ["generate-lora", dir, prompt, new, rows, rank] => generate_lora(
            Path::new(dir),
            prompt.parse().expect("PROMPT: a token count"),
            new.parse().expect("NEW: a token count"),
            rows.parse().expect("ROWS: a count"),
            rank.parse().expect("RANK: a LoRA rank"),
        ),
        ["teacher", size, dir, groups] => teacher(
            size,
            Path::new(dir),
            groups.parse().expect("GROUPS: a count"),
        ),
        ["invariance", rows] => invariance(rows.parse().expect("ROWS: a count")),
        ["decode-products", rows] => decode_products(rows.parse().expect("ROWS: a count")),
        // `cargo bench` with no arguments (as CI's build check runs it): a quick small run.
        [] => {
            let dir = tempfile::tempdir().expect("tmp");
            write("small", dir.path());
            step(dir.path(), 0, 2, 0);
            step(dir.path(), 0, 2, 16);
        }
        _ => panic!("usage: {USAGE}"),
    }
}

/// Trainer ranks under `mpirun` (feature `mpi`).
#[cfg(feature = "mpi")]
mod ranks {
    use super::{ScoredGroup, Trainer, batch, lora_settings, peak_rss_mb, size_of};
    use clap::ValueEnum;
    use rlstream::collective::shards::{self, JoinedPieces, Shards};
    use rlstream::collective::{self, Collective, Mpi, ReduceDtype, Solo};
    use rlstream::stages::train::Sharding;
    use std::path::Path;
    use std::time::Instant;

    fn world() -> Box<dyn Collective> {
        let mpi = Mpi::init().expect("MPI");
        if mpi.world() == 1 {
            return Box::new(Solo::default());
        }
        Box::new(mpi)
    }

    /// The modes that run under `mpirun`: `true` when `args` is one of them (and it ran).
    pub fn dispatch(args: &[&str]) -> bool {
        match args {
            ["step-ranks", dir, micro, steps, parts, rest @ ..] => step(
                Path::new(dir),
                micro.parse().expect("MICRO: a token count"),
                steps.parse().expect("STEPS: a count"),
                parts.parse().expect("PARTS: a count"),
                match rest {
                    [] => Sharding::None,
                    [mode] => {
                        Sharding::from_str(mode, true).expect("SHARD: none|optimizer|gradients")
                    }
                    _ => panic!("step-ranks DIR MICRO STEPS PARTS [SHARD]"),
                },
            ),
            ["allreduce", values, bucket_mb] => allreduce(
                values.parse().expect("VALUES: a count"),
                bucket_mb.parse().expect("BUCKET_MB: MiB"),
            ),
            _ => return false,
        }
        true
    }

    /// Each group's samples dealt into `parts` groups.
    fn split(groups: Vec<ScoredGroup>, parts: usize) -> Vec<ScoredGroup> {
        let mut out = Vec::new();
        for g in groups {
            let n = g.rollout.samples.len();
            let each = n.div_ceil(parts.max(1));
            for (p, start) in (0..n).step_by(each.max(1)).enumerate() {
                let end = (start + each).min(n);
                let mut part = g.clone();
                part.rollout.group_id = format!("{}-{p}", g.rollout.group_id);
                part.rollout.samples = g.rollout.samples[start..end].to_vec();
                part.rewards = g.rewards[start..end].to_vec();
                part.advantages = g.advantages[start..end].to_vec();
                out.push(part);
            }
        }
        out
    }

    pub fn step(dir: &Path, micro: usize, steps: usize, parts: usize, shard: Sharding) {
        let mut c = world();
        let (size, vocab) = size_of(dir);
        let ckpt = tempfile::tempdir().expect("tmp");
        let mut settings = lora_settings(dir, ckpt.path(), 1e-5, micro, 0);
        settings.train.shard = shard;
        let mut trainer = Trainer::start(&settings).expect("trainer");
        trainer
            .shard_over(c.rank(), c.world())
            .expect("sharded state");
        let groups = split(batch(size, vocab), parts);
        let refs: Vec<&ScoredGroup> = groups.iter().collect();
        let mut times = Vec::new();
        for i in 0..=steps {
            c.barrier("before a step");
            let t = Instant::now();
            let o = rlstream::stages::train::step_over_ranks(&mut trainer, c.as_mut(), &refs)
                .expect("step");
            let record = o.record.expect("a step");
            assert!(!record.skipped, "a skipped step times nothing");
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let peaks = c.all_gather("peaks", format!("{:.0}", peak_rss_mb()).as_bytes());
        if c.rank() == 0 {
            let peaks: Vec<String> = peaks
                .iter()
                .map(|p| String::from_utf8_lossy(p).into())
                .collect();
            println!(
                "{{\"size\": \"{size}\", \"ranks\": {}, \"shard\": \"{shard:?}\", \
                 \"threads\": \"{}\", \"groups\": {}, \"steps\": {steps}, \"step_s\": {:.4}, \
                 \"peak_rss_mb\": [{}]}}",
                c.world(),
                std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into()),
                groups.len(),
                times[times.len() / 2],
                peaks.join(", ")
            );
        }
    }

    pub fn allreduce(values: usize, bucket_mb: usize) {
        let mut c = world();
        let bucket = bucket_mb * (1 << 20) / 4;
        let mine = c.rank() as f32 + 0.5;
        let expect: f32 = (0..c.world()).map(|r| r as f32 + 0.5).sum();
        let mut out = format!(
            "{{\"ranks\": {}, \"values\": {values}, \"bytes_f32\": {}",
            c.world(),
            values * 4
        );
        for dtype in [ReduceDtype::F32, ReduceDtype::Bf16] {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let mut pieces = vec![vec![mine; values]];
                c.barrier("before an all-reduce");
                let t = Instant::now();
                collective::all_reduce_pieces(
                    c.as_mut(),
                    "the all-reduce",
                    &mut pieces,
                    dtype,
                    bucket,
                );
                best = best.min(t.elapsed().as_secs_f64());
                assert!(
                    pieces[0].iter().all(|&x| x == expect),
                    "the sum is {expect} everywhere"
                );
            }
            let name = format!("{dtype:?}").to_lowercase();
            out += &format!(
                ", \"{name}_s\": {best:.3}, \"{name}_gb_per_s\": {:.2}",
                (values * 4) as f64 / best / 1e9
            );
        }
        // The sharded path's pair: each rank's range of the sum, then every range to every
        // rank.
        let range = Shards::new(values, c.world()).range(c.rank());
        let (mut best, mut best_rs, mut best_ag) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..3 {
            let mut pieces = vec![vec![mine; values]];
            c.barrier("before a reduce-scatter");
            let t = Instant::now();
            let part = shards::reduce_scatter(
                c.as_mut(),
                "the reduce-scatter",
                &JoinedPieces::new(&mut pieces),
                ReduceDtype::F32,
                bucket,
            );
            let rs = t.elapsed().as_secs_f64();
            let mut joined = JoinedPieces::new(&mut pieces);
            joined.write(range.start, &part);
            let t_ag = Instant::now();
            shards::all_gather(c.as_mut(), "the all-gather", &mut joined, bucket);
            best_ag = best_ag.min(t_ag.elapsed().as_secs_f64());
            best_rs = best_rs.min(rs);
            best = best.min(t.elapsed().as_secs_f64());
            assert!(part.iter().all(|&x| x == expect), "the sum is {expect}");
        }
        out += &format!(
            ", \"reduce_scatter_s\": {best_rs:.3}, \"all_gather_s\": {best_ag:.3}, \
             \"reduce_scatter_all_gather_s\": {best:.3}, \"reduce_scatter_all_gather_gb_per_s\": {:.2}",
            (values * 4) as f64 / best / 1e9
        );
        let src = vec![mine; values];
        let mut dst = vec![0f32; values];
        dst.copy_from_slice(&src);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        out += &format!(
            ", \"memcpy_s\": {best:.3}, \"memcpy_gb_per_s\": {:.2}}}",
            (values * 4) as f64 / best / 1e9
        );
        if c.rank() == 0 {
            println!("{out}");
        }
    }
}

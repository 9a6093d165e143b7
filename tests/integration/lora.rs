//! LoRA: the adapter format against Python `peft`, adapter-only training, and adapter-only
//! weight sync through the real binaries.
//!
//! - `tests/fixtures/lora/NAME/` holds an adapter with nonzero `B` that rlstream wrote for the
//!   parity base `tests/fixtures/models/NAME`, and the logits `peft` computes with it
//!   (`scripts/make_lora_fixtures.py`). rlstream must give those logits within 1e-4 (adapter
//!   applied unmerged, merged, and on the trainer's backend), they must differ from the base's
//!   far beyond that, and re-writing the adapter from its seed must give the committed bytes.
//!   Regenerate with `RLSTREAM_BLESS=1 cargo test --test lora`, then the script.
//! - A LoRA trainer computes gradients for the adapter only, leaves the base untouched,
//!   checkpoints the adapter in PEFT's format and resumes it.
//! - gen, score and train as processes with `--lora-rank`: every token tagged with an adapter
//!   version has the behaviour log-prob of base + that adapter (the checkpoint of that
//!   version), not the base's.

use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use rlstream::model::hf::load_hf;
use rlstream::model::layers::Target;
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::lora::{self, LoraSpec};
use rlstream::model::tensors::{HostTensor, TensorMap, WeightDtype};
use rlstream::model::{InferBackend, Kernels, Policy};
use std::path::{Path, PathBuf};

const TOLERANCE: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The fixture adapter of base `name`: rank 4, alpha 8, on every linear module (qwen3) or on
/// q, v and down only (llama), `A` and `B` drawn from a fixed seed, so `B` is far from zero.
fn fixture_adapter(name: &str, cfg: &rlstream::model::ModelConfig) -> (LoraSpec, TensorMap) {
    use rand::{Rng, SeedableRng};
    let targets = match name {
        "llama" => vec![Target::Q, Target::V, Target::Down],
        _ => Target::ALL.to_vec(),
    };
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut tensors = TensorMap::new();
    for (name, shape) in spec.expected_tensors(cfg) {
        let n: usize = shape.iter().product();
        let bound = if name.contains(".lora_A.") {
            1.0 / (shape[1] as f64).sqrt()
        } else {
            0.3
        };
        let data = (0..n)
            .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
            .collect();
        tensors.insert(name, HostTensor { shape, data });
    }
    (spec, tensors)
}

struct Reference {
    inputs: Vec<Vec<u32>>,
    logits: Vec<f32>,
    base_logits: Vec<f32>,
}

fn reference(name: &str) -> Reference {
    let path = fixtures().join("lora").join(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/make_lora_fixtures.py)",
            path.display()
        )
    });
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let flat = |k: &str| -> Vec<f32> {
        let nested: Vec<Vec<Vec<f32>>> = serde_json::from_value(v[k].clone()).unwrap();
        nested.into_iter().flatten().flatten().collect()
    };
    Reference {
        inputs: serde_json::from_value(v["inputs"].clone()).unwrap(),
        logits: flat("logits"),
        base_logits: flat("base_logits"),
    }
}

fn logits<B: Kernels>(model: &Policy<B>, inputs: &[Vec<u32>]) -> Vec<f32> {
    let (b, l) = (inputs.len(), inputs[0].len());
    let ids: Vec<i64> = inputs.iter().flatten().map(|&t| i64::from(t)).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, l]), &model.device());
    model
        .forward(tokens)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Writes the fixture adapter of `name` through rlstream's writer into `dir`.
fn write_fixture_adapter(name: &str, dir: &Path) {
    let base_dir = fixtures().join("models").join(name);
    let base: Policy<NdArray> = load_hf(&base_dir, &Default::default()).unwrap();
    let (spec, tensors) = fixture_adapter(name, base.config());
    let adapted = base.with_adapter(&spec, &tensors).unwrap();
    adapted
        .save_adapter(
            dir,
            &spec,
            Some(&format!("tests/fixtures/models/{name}")),
            WeightDtype::F32,
        )
        .unwrap();
}

fn check_peft_parity(name: &str) {
    let committed = fixtures().join("lora").join(name);
    if std::env::var_os("RLSTREAM_BLESS").is_some() {
        write_fixture_adapter(name, &committed);
    }
    // The writer: the same adapter from the same seed is the committed bytes.
    let scratch = tempfile::tempdir().unwrap();
    write_fixture_adapter(name, scratch.path());
    for file in [lora::ADAPTER_FILE, lora::ADAPTER_CONFIG] {
        assert_eq!(
            std::fs::read(scratch.path().join(file)).unwrap(),
            std::fs::read(committed.join(file)).unwrap(),
            "{name}: re-written {file} differs from the committed one"
        );
    }
    // The reader and the forward pass: peft's logits.
    let r = reference(name);
    let base_dir = fixtures().join("models").join(name);
    let device = Default::default();
    let unmerged: Policy<InferBackend> =
        lora::load_with_adapter(&base_dir, &committed, &device).unwrap();
    assert!(unmerged.has_adapter());
    let got = logits(&unmerged, &r.inputs);
    let d = max_diff(&got, &r.logits);
    assert!(d < TOLERANCE, "{name}: unmerged adapter vs peft: {d}");
    let moved = max_diff(&r.logits, &r.base_logits);
    assert!(
        moved > 100.0 * TOLERANCE,
        "{name}: the adapter moves peft's logits by only {moved}"
    );
    let base: Policy<InferBackend> = load_hf(&base_dir, &device).unwrap();
    let d_base = max_diff(&logits(&base, &r.inputs), &r.base_logits);
    assert!(d_base < TOLERANCE, "{name}: base vs transformers: {d_base}");

    let merged = unmerged.merged();
    assert!(!merged.has_adapter());
    let d = max_diff(&logits(&merged, &r.inputs), &r.logits);
    assert!(d < TOLERANCE, "{name}: merged adapter vs peft: {d}");

    // The trainer's backend, whose linear layers run through the native kernel.
    let trainer: Policy<NdArray> =
        lora::load_with_adapter(&base_dir, &committed, &Default::default()).unwrap();
    let d = max_diff(&logits(&trainer, &r.inputs), &r.logits);
    assert!(d < TOLERANCE, "{name}: adapter on NdArray vs peft: {d}");

    // A full checkpoint of the adapted model is the merged model.
    let full = tempfile::tempdir().unwrap();
    trainer.save_hf(full.path()).unwrap();
    let reloaded: Policy<InferBackend> = load_hf(full.path(), &device).unwrap();
    let d = max_diff(&logits(&reloaded, &r.inputs), &r.logits);
    assert!(d < TOLERANCE, "{name}: saved merged model vs peft: {d}");
}

#[test]
fn peft_loads_what_rlstream_writes_qwen3_all_linear() {
    check_peft_parity("qwen3");
}

#[test]
fn peft_loads_what_rlstream_writes_llama_some_modules() {
    check_peft_parity("llama");
}

#[test]
fn bad_adapters_are_refused_with_the_reason() {
    let base_dir = fixtures().join("models").join("qwen3");
    let base: Policy<NdArray> = load_hf(&base_dir, &Default::default()).unwrap();
    let (spec, tensors) = fixture_adapter("qwen3", base.config());
    let name = lora::peft_name(0, Target::Q, 'A');

    let mut wrong_shape = tensors.clone();
    wrong_shape.get_mut(&name).unwrap().shape = vec![8, 16];
    let e = base.clone().with_adapter(&spec, &wrong_shape).unwrap_err();
    assert!(e.to_string().contains(&name), "{e}");

    let mut missing = tensors.clone();
    missing.remove(&name);
    let e = base.clone().with_adapter(&spec, &missing).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");

    let mut nan = tensors.clone();
    nan.get_mut(&name).unwrap().data[3] = f32::NAN;
    let e = base.clone().with_adapter(&spec, &nan).unwrap_err();
    assert!(e.to_string().contains("non-finite"), "{e}");

    let only_q = LoraSpec {
        targets: vec![Target::Q],
        ..spec.clone()
    };
    let e = base.clone().with_adapter(&only_q, &tensors).unwrap_err();
    assert!(
        e.to_string().contains("not one of the adapter's target"),
        "{e}"
    );

    for (config, what) in [
        (
            r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj"],"use_dora":true}"#,
            "use_dora",
        ),
        (
            r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj"],"use_rslora":true}"#,
            "use_rslora",
        ),
        (
            r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["lm_head"]}"#,
            "lm_head",
        ),
        (
            r#"{"peft_type":"LORA","r":0,"lora_alpha":8,"target_modules":["q_proj"]}"#,
            "rank",
        ),
        (r#"{"peft_type":"PREFIX_TUNING"}"#, "missing field"),
    ] {
        let e = LoraSpec::from_peft_json(config).unwrap_err();
        assert!(e.contains(what), "{config}: {e}");
    }
    // A directory that is not an adapter says what an adapter directory holds.
    let e = lora::read_adapter(&base_dir).unwrap_err();
    assert!(e.to_string().contains(lora::ADAPTER_CONFIG), "{e}");
}

/// The trainer's LoRA mode: gradients and optimizer state for the adapter only, the base
/// untouched by a step, the adapter checkpointed in PEFT's format and resumed exactly.
#[test]
fn a_lora_trainer_trains_and_checkpoints_only_the_adapter() {
    use rlstream::stages::train::{TrainConfig, Trainer, TrainerSettings};
    let dir = tempfile::tempdir().unwrap();
    let base_dir = fixtures().join("models").join("qwen3");
    let mut cfg = TrainerSettings::default();
    cfg.policy.model = Some(base_dir.clone());
    cfg.train = TrainConfig {
        lr: 1e-2,
        lora_rank: 4,
        lora_alpha: 8.0,
        lora_targets: "q,v,down".into(),
        checkpoint_dir: dir.path().join("ckpt"),
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::start(&cfg).unwrap();
    let adapter = trainer.adapter().expect("a LoRA trainer").clone();
    assert_eq!(
        adapter.spec.targets,
        vec![Target::Q, Target::V, Target::Down]
    );
    let sampler: Policy<InferBackend> = load_hf(&base_dir, &Default::default()).unwrap();
    assert_eq!(adapter.base_checksum, sampler.base_checksum().unwrap());
    let groups: Vec<_> = (0..2)
        .map(|i| {
            crate::common::sampled_group(
                &sampler,
                &format!("g{i}"),
                vec![1, 5, 9],
                6,
                i,
                vec![1.0, 0.0, 0.5, 0.0],
            )
        })
        .collect();
    let refs: Vec<_> = groups.iter().collect();

    let (grads, _) = trainer.gradients(&refs).unwrap();
    // Two factors per target per layer, and nothing else.
    let layers = trainer.model().config().num_layers;
    assert_eq!(grads.len(), 2 * 3 * layers, "gradients of the adapter only");

    let base_before = trainer.model().without_adapter().to_tensors().unwrap();
    let record = trainer.step(&refs).unwrap();
    assert!(!record.skipped && record.grad_norm > 0.0, "{record:?}");
    let base_after = trainer.model().without_adapter().to_tensors().unwrap();
    assert!(base_before == base_after, "a LoRA step changed the base");
    let trained = trainer.model().adapter_tensors().unwrap();
    let b = &trained[&lora::peft_name(0, Target::Q, 'B')];
    assert!(b.data.iter().any(|v| *v != 0.0), "B left the zero init");

    let ckpt = trainer.checkpoint().unwrap();
    for f in [lora::ADAPTER_FILE, lora::ADAPTER_CONFIG] {
        assert!(ckpt.join(f).exists(), "{f} in the checkpoint");
    }
    assert!(
        !ckpt.join("model.safetensors").exists(),
        "a LoRA checkpoint does not copy the base"
    );
    // AdamW's two moments of the adapter only: far less than one copy of the base.
    let optim = std::fs::metadata(ckpt.join("trainer_optim.mpk"))
        .unwrap()
        .len();
    let base_bytes = trainer.model().config().num_params() as u64 * 4;
    assert!(
        optim < base_bytes / 2,
        "optimizer record {optim} bytes against a base of {base_bytes}"
    );
    // PEFT's config names the modules and the base.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join(lora::ADAPTER_CONFIG)).unwrap())
            .unwrap();
    assert_eq!(config["r"], 4);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );

    // Resumed: the same adapter, and the next step equals the uninterrupted trainer's.
    let mut resumed = Trainer::start(&cfg).unwrap();
    assert_eq!(resumed.state.step, 1);
    assert!(resumed.model().adapter_tensors().unwrap() == trained);
    trainer.step(&refs).unwrap();
    resumed.step(&refs).unwrap();
    assert!(
        trainer.model().adapter_tensors().unwrap() == resumed.model().adapter_tensors().unwrap(),
        "a resumed LoRA trainer's step differs from the uninterrupted one (optimizer state lost?)"
    );

    // The checkpoint on another base is refused, as is full fine-tuning in its directory.
    let mut other = cfg.clone();
    other.policy.model = Some(fixtures().join("models").join("qwen2"));
    let e = Trainer::start(&other).err().expect("another base");
    assert!(e.to_string().contains("base"), "{e}");
    let mut full = cfg.clone();
    full.train.lora_rank = 0;
    let ok = Trainer::start(&full).expect("a LoRA checkpoint resumes as LoRA");
    assert!(ok.adapter().is_some());
    let fresh = tempfile::tempdir().unwrap();
    let mut full_first = cfg.clone();
    full_first.train.lora_rank = 0;
    full_first.train.checkpoint_dir = fresh.path().to_path_buf();
    Trainer::start(&full_first).unwrap().checkpoint().unwrap();
    let mut lora_after_full = full_first.clone();
    lora_after_full.train.lora_rank = 4;
    let e = Trainer::start(&lora_after_full)
        .err()
        .expect("full checkpoint");
    assert!(e.to_string().contains("full fine-tuning"), "{e}");
}

/// Teacher-forced log-probs of `completion` after `prompt` under `model`.
fn teacher_forced(model: &Policy<InferBackend>, prompt: &[u32], completion: &[u32]) -> Vec<f32> {
    let seq = ScoredSeq::plain(prompt, completion);
    let (lp, _) = completion_logprobs(model, &[seq], 1.0);
    lp.into_data().into_vec().unwrap()
}

/// gen, score and train as processes, the trainer training a LoRA adapter and publishing
/// only the adapter: every token the generator tagged with an adapter version has the
/// log-prob of base + that version's adapter, and the adapter moved the tokens away from
/// the base's log-probs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generators_sample_from_the_announced_adapter_never_the_base() {
    use rlstream::bus::RangeBound;
    use rlstream::schema::{self, RolloutGroup};
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("lora-sync");
    let url = crate::common::redis_url();
    let model = dir.path().join("model");
    let m = model.to_str().unwrap();
    crate::common::warm_start("reverse", &model, 200, &[]);
    let base_args = |extra: &[&str]| crate::common::on_bus(extra, &url, &ns);
    crate::common::run_ok(
        &base_args(&["feed", "--task", "reverse", "--count", "400", "--seed", "3"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let logs = |n: &str| dir.path().join(format!("{n}.log"));
    let ckpt = dir.path().join("ckpt");
    let generator = crate::common::spawn(
        &base_args(&[
            "gen",
            "--model",
            m,
            "--group-size",
            "4",
            "--max-new-tokens",
            "8",
            "--max-batch",
            "16",
            "--max-lag",
            "1",
        ]),
        &logs("gen"),
    );
    let score = crate::common::spawn(&base_args(&["score"]), &logs("score"));
    let train = crate::common::run_ok(
        &base_args(&[
            "train",
            "--model",
            m,
            "--lora-rank",
            "8",
            "--lr",
            "2e-2",
            "--steps",
            "6",
            "--groups-per-step",
            "4",
            "--max-lag",
            "1",
            "--checkpoint-every",
            "1",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    drop(generator);
    drop(score);
    assert!(train.contains("6 steps"), "{train}");
    let bus = crate::common::redis_bus().await;
    let groups: Vec<RolloutGroup> = bus
        .range(
            &format!("{ns}:rollouts"),
            RangeBound::Open,
            RangeBound::Open,
            1_000_000,
        )
        .await
        .unwrap()
        .iter()
        .map(|e| schema::decode(&e.payload).unwrap())
        .collect();
    let device = Default::default();
    let base: Policy<InferBackend> = load_hf(&model, &device).unwrap();
    let mut models = std::collections::BTreeMap::new();
    let (mut compared, mut swapped, mut worst, mut moved) = (0usize, 0usize, 0f32, 0f32);
    for g in &groups {
        for s in &g.samples {
            let tokens: Vec<u32> = s.tokens.to_vec();
            let behaviour = s.logprobs.to_vec();
            let base_lp = teacher_forced(&base, &g.prompt_tokens, &tokens);
            for i in 0..tokens.len() {
                let v = s.version_at(i);
                if v == 0 {
                    continue;
                }
                // A swap inside the completion keeps the row's cache: token `i` was then
                // sampled over keys and values an older version computed, which teacher
                // forcing with `v` does not reproduce (see `model::sampler`). Only tokens
                // whose whole completion prefix came from `v` are compared.
                if s.version_at(0) != v {
                    swapped += 1;
                    continue;
                }
                let adapter_dir = ckpt.join(format!("step-{v:08}"));
                if !adapter_dir.exists() {
                    continue;
                }
                let lp = models.entry(v).or_insert_with(|| {
                    lora::load_with_adapter::<InferBackend>(&model, &adapter_dir, &device).unwrap()
                });
                let tf = teacher_forced(lp, &g.prompt_tokens, &tokens);
                worst = worst.max((tf[i] - behaviour[i]).abs());
                moved = moved.max((base_lp[i] - behaviour[i]).abs());
                compared += 1;
            }
        }
    }
    eprintln!(
        "{compared} tokens under adapter versions: worst {worst}, moved from the base up to {moved}; {swapped} sampled after a swap inside their completion"
    );
    assert!(
        compared >= 20,
        "only {compared} tokens carried an adapter version"
    );
    assert!(
        worst < TOLERANCE,
        "behaviour vs base + adapter of the tagged version: {worst} over {compared} tokens"
    );
    assert!(
        moved > 100.0 * TOLERANCE,
        "the adapter versions barely moved the log-probs from the base's ({moved}): the test would not see sampling from the base\n{train}"
    );
}

/// Adapter versions through the weights protocol: a follower merges each whole adapter into
/// a fresh copy of its base (in bf16 on the bus, f32 in process), refuses one made for
/// another base and says so, and rejects a corrupt one, keeping its weights each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_take_adapter_versions_for_their_base_only() {
    use bytes::Bytes;
    use rlstream::bus::{MemoryBus, SharedBus, Topology};
    use rlstream::schema::WeightsKind;
    use rlstream::weights::{
        AdapterVersion, Follower, LocalWeights, ModelSlot, Payload, Publisher, Transport,
        Versioned, WeightsConfig,
    };
    use std::sync::Arc;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_millis(200);

    let base_dir = fixtures().join("models").join("qwen3");
    let base: Policy<InferBackend> = load_hf(&base_dir, &Default::default()).unwrap();
    let (spec, tensors) = fixture_adapter("qwen3", base.config());
    let checksum = base.base_checksum().unwrap();
    let version = |tensors: &TensorMap, base_checksum: &str| {
        Payload::Adapter(AdapterVersion {
            tensors: tensors.clone(),
            spec: spec.clone(),
            base_checksum: base_checksum.to_string(),
        })
    };
    let expected = base
        .clone()
        .with_adapter(&spec, &tensors)
        .unwrap()
        .merged()
        .to_tensors()
        .unwrap();
    let r = reference("qwen3");
    for transport in [
        Transport::Bus,
        Transport::InProcess(LocalWeights::default()),
    ] {
        let bus: SharedBus = Arc::new(MemoryBus::new());
        let topo = Topology::default();
        let slot = ModelSlot::new(Versioned {
            version: 0,
            policy: base.clone(),
        });
        let in_process = matches!(transport, Transport::InProcess(_));
        let mut f = Follower::new(
            bus.clone(),
            topo.clone(),
            base.config().clone(),
            slot.clone(),
        )
        .with_transport(transport.clone());
        let cfg = WeightsConfig::default();
        let mut publisher = Publisher::new(bus.clone(), topo.clone(), 2)
            .with_transport(transport.clone())
            .with_config(&cfg, WeightDtype::Bf16)
            .unwrap();

        let a = publisher
            .publish_payload(1, 1, version(&tensors, &checksum))
            .await
            .unwrap();
        assert_eq!(a.kind, WeightsKind::Lora);
        assert_eq!(a.lora.as_ref().unwrap().base_checksum, checksum);
        assert_eq!(f.poll(WAIT).await.unwrap(), Some(1));
        let swapped = slot.load();
        assert!(
            !swapped.policy.has_adapter(),
            "generators run the merged weights"
        );
        let got = logits(&swapped.policy, &r.inputs);
        if in_process {
            assert!(swapped.policy.to_tensors().unwrap() == expected);
            assert!(max_diff(&got, &r.logits) < TOLERANCE);
        } else {
            // bf16 on the wire: the adapter's values rounded, the base untouched.
            assert!(a.format.ends_with("bf16"), "{}", a.format);
            let d = max_diff(&got, &r.logits);
            assert!(d < 0.05 && d > 0.0, "bf16 adapter vs peft: {d}");
        }

        // Made for another base: refused, the slot keeps version 1.
        publisher
            .publish_payload(2, 2, version(&tensors, "0123456789abcdef"))
            .await
            .unwrap();
        assert_eq!(f.poll(WAIT).await.unwrap(), None);
        assert_eq!((f.rejected, slot.load().version), (1, 1));

        if !in_process {
            // Corrupt bytes after the announce: checksum mismatch, refused.
            publisher
                .publish_payload(3, 3, version(&tensors, &checksum))
                .await
                .unwrap();
            bus.put_blobs(&[(topo.weights_chunk_key(3, 0), Bytes::from(vec![0u8; 64]))])
                .await
                .unwrap();
            assert_eq!(f.poll(WAIT).await.unwrap(), None);
            assert_eq!((f.rejected, slot.load().version), (2, 1));
        }
        // A later good version is taken, merged into the pristine base (not onto version 1).
        let mut half = tensors.clone();
        for t in half.values_mut() {
            t.data.iter_mut().for_each(|v| *v *= 0.5);
        }
        publisher
            .publish_payload(4, 4, version(&half, &checksum))
            .await
            .unwrap();
        assert_eq!(f.poll(WAIT).await.unwrap(), Some(4));
        let want = base.clone().with_adapter(&spec, &half).unwrap().merged();
        let d = max_diff(
            &logits(&slot.load().policy, &r.inputs),
            &logits(&want, &r.inputs),
        );
        assert!(
            d < if in_process { TOLERANCE } else { 0.05 },
            "version 4: {d}"
        );
    }
}

/// `generate --adapter` samples from base + adapter: the log-prob of its first token is
/// peft's; a LoRA directory given as the model is refused with the way to load it; and
/// `train --lora-from` starts from that adapter.
#[test]
fn generate_and_train_take_an_adapter_directory() {
    let base_dir = fixtures().join("models").join("qwen3");
    let adapter_dir = fixtures().join("lora").join("qwen3");
    let r = reference("qwen3");
    let prompt = &r.inputs[0][..6];
    let ids = prompt
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let out = crate::common::bin()
        .args([
            "generate",
            "--model",
            base_dir.to_str().unwrap(),
            "--adapter",
            adapter_dir.to_str().unwrap(),
            "--prompt-ids",
            &ids,
            "--max-new-tokens",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let token = v["completions"][0]["ids"][0].as_u64().unwrap() as usize;
    let got = v["completions"][0]["logprobs"][0].as_f64().unwrap() as f32;
    // peft's logits at the prompt's last position, as a log-softmax.
    let vocab = r.logits.len() / (r.inputs.len() * r.inputs[0].len());
    let row = &r.logits[5 * vocab..6 * vocab];
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
    let want = row[token] - lse;
    assert!(
        (got - want).abs() < TOLERANCE,
        "generate --adapter: {got} vs peft {want}"
    );

    let out = crate::common::bin()
        .args([
            "generate",
            "--model",
            adapter_dir.to_str().unwrap(),
            "--prompt-ids",
            &ids,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--adapter"), "{err}");

    use rlstream::stages::train::{TrainConfig, Trainer, TrainerSettings};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = TrainerSettings::default();
    cfg.policy.model = Some(base_dir);
    cfg.train = TrainConfig {
        lora_from: Some(adapter_dir.clone()),
        checkpoint_dir: dir.path().join("ckpt"),
        ..TrainConfig::default()
    };
    let trainer = Trainer::start(&cfg).unwrap();
    let (spec, tensors) = lora::read_adapter(&adapter_dir).unwrap();
    assert_eq!(trainer.adapter().unwrap().spec, spec);
    assert!(trainer.model().adapter_tensors().unwrap() == tensors);
}

/// `rlstream run --lora-rank` on the embedded bus: adapter versions handed over in process,
/// LoRA checkpoints, and held-out evaluations of base + adapter in the report.
#[test]
fn run_trains_an_adapter_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    crate::common::run_ok(&[
        "run",
        "--task",
        "sort",
        "--sync",
        "--sft-steps",
        "20",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--eval-prompts",
        "64",
        "--lora-rank",
        "4",
        "--lr",
        "2e-3",
        "--out",
        out.to_str().unwrap(),
    ]);
    let last = out.join("checkpoints/step-00000004");
    assert!(last.join(lora::ADAPTER_FILE).exists());
    assert!(!last.join("model.safetensors").exists());
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report/summary.json")).unwrap())
            .unwrap();
    let held_out = summary["held_out"].as_array().unwrap();
    assert!(held_out.len() >= 2, "{held_out:?}");
    assert_eq!(summary["config"]["train"]["lora_rank"], 4);
}

//! Message size at real scale: bytes per group and per token of a RolloutGroup on the
//! wire, split by field, for a 0.5B-shaped workload (8 samples × 1,024 tokens over Qwen2.5's
//! 151,936-token vocabulary), with sampling masks in the CSR form written before schema 3.0
//! and in the packed kept sets written since, plus zstd and deflate of the whole message.
//!
//! The kept-set sizes come from the logits, so the policy only needs the vocabulary: a
//! random model with the real vocabulary and a narrow trunk (the trunk does not change the
//! message). A random model's distribution is flat; a sharpened temperature stands in for a
//! trained model's peaked one. Each case generates its group with the real sampler
//! (`Generator`), as `gen` does, with `gen.mask_cap` applied the way `gen` applies it.
//!
//! ```sh
//! cargo bench --bench wire_bytes [-- OUT.json]
//! ```

use flate2::Compression;
use flate2::write::DeflateEncoder;
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema::{
    self, CsrMask, RolloutGroup, Sample, SamplingMask, SamplingParams, SchemaVersion,
};
use rlstream::stages::generator::GenConfig;
use serde::Serialize;
use std::io::Write;
use std::time::Instant;

const VOCAB: usize = 151_936;
const SAMPLES: usize = 8;

struct Case {
    name: &'static str,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    mask_cap: u32,
    tokens: u32,
}

fn named<T: Serialize>(v: &T) -> usize {
    rmp_serde::to_vec_named(v).expect("encodes").len()
}

fn deflate(bytes: &[u8], level: u32) -> (usize, f64) {
    let t0 = Instant::now();
    let mut e = DeflateEncoder::new(Vec::new(), Compression::new(level));
    e.write_all(bytes).expect("deflate");
    let out = e.finish().expect("deflate");
    (out.len(), t0.elapsed().as_secs_f64())
}

fn zstd_level(bytes: &[u8], level: i32) -> (usize, f64, f64) {
    let t0 = Instant::now();
    let out = zstd::bulk::compress(bytes, level).expect("zstd");
    let c = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let back = zstd::bulk::decompress(&out, bytes.len()).expect("unzstd");
    let d = t0.elapsed().as_secs_f64();
    assert_eq!(back.len(), bytes.len());
    (out.len(), c, d)
}

/// The sampling settings measured: flat and peaked distributions, top-k and top-p, with
/// and without the mask cap.
fn cases() -> [Case; 5] {
    [
        Case {
            name: "top-k 50, top-p 0.95, T 1.0 (flat)",
            temperature: 1.0,
            top_k: 50,
            top_p: 0.95,
            mask_cap: 512,
            tokens: 1024,
        },
        Case {
            name: "top-k 50, top-p 0.95, T 0.05 (peaked)",
            temperature: 0.05,
            top_k: 50,
            top_p: 0.95,
            mask_cap: 512,
            tokens: 1024,
        },
        Case {
            name: "top-p 0.95, T 0.05 (peaked), cap 512",
            temperature: 0.05,
            top_p: 0.95,
            top_k: 0,
            mask_cap: 512,
            tokens: 1024,
        },
        Case {
            name: "top-p 0.95, T 1.0 (flat), cap 512",
            temperature: 1.0,
            top_p: 0.95,
            top_k: 0,
            mask_cap: 512,
            tokens: 1024,
        },
        // Uncapped top-p over a flat distribution keeps most of the vocabulary at every
        // step: measured on 16 tokens per sample, reported per token.
        Case {
            name: "top-p 0.95, T 1.0 (flat), no cap",
            temperature: 1.0,
            top_p: 0.95,
            top_k: 0,
            mask_cap: 0,
            tokens: 16,
        },
    ]
}

/// One group of [`SAMPLES`] completions of a fixed prompt sampled as `case` says, and the
/// seconds sampling took.
fn sampled_group(model: &Policy<InferBackend>, case: &Case) -> (RolloutGroup, GenConfig, f64) {
    let gen_cfg = GenConfig {
        top_k: case.top_k,
        top_p: case.top_p,
        mask_cap: case.mask_cap,
        ..GenConfig::default()
    };
    let params = SamplingParams {
        temperature: case.temperature,
        top_k: gen_cfg.sampling_top_k(),
        top_p: case.top_p,
        max_new_tokens: case.tokens,
        stop_tokens: Vec::new(),
        seed: 11,
    };
    let prompt: Vec<u32> = (0..32).map(|i| (i * 4_747) % VOCAB as u32).collect();
    let req = Request {
        id: 0,
        prompt: prompt.clone(),
        n: SAMPLES,
        params: params.clone(),
    };
    let t0 = Instant::now();
    let done = Generator::generate(model, 3, &[req]).expect("generate");
    let gen_s = t0.elapsed().as_secs_f64();
    let samples: Vec<Sample> = done.into_iter().map(Sample::from).collect();
    let group = RolloutGroup {
        schema: RolloutGroup::version_for(&samples),
        group_id: "gen-0-000001".into(),
        prompt_id: "p-1".into(),
        task: "bench".into(),
        prompt_tokens: prompt.into(),
        samples,
        sampling: params,
        gen_id: "gen-0".into(),
        started_us: 0,
        finished_us: 0,
        meta: Default::default(),
        prompt_routing: None,
    };
    (group, gen_cfg, gen_s)
}

/// Every size and time the bench reports for one group.
struct Measured {
    tokens: usize,
    kept: usize,
    tokens_b: usize,
    logprobs_b: usize,
    versions_b: usize,
    csr_b: usize,
    packed_b: usize,
    pack_s: f64,
    roundtrip_s: f64,
    /// The message with CSR masks (as a 2.x writer produced it) and packed.
    csr_total: usize,
    packed: usize,
    deflate: [(usize, f64); 2],
    zstd1: (usize, f64, f64),
    zstd3: (usize, f64),
}

fn measure(group: &RolloutGroup) -> Measured {
    let masks: Vec<&SamplingMask> = group
        .samples
        .iter()
        .filter_map(|s| s.mask.as_ref())
        .collect();
    let field = |f: &dyn Fn(&Sample) -> usize| -> usize { group.samples.iter().map(f).sum() };
    let csr_b: usize = masks.iter().map(|&m| named(&CsrMask::from(m))).sum();
    let t0 = Instant::now();
    let packed_b: usize = masks.iter().map(named).sum();
    let pack_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for m in &masks {
        let _ = SamplingMask::unpack(&m.pack()).expect("unpacks");
    }
    let roundtrip_s = t0.elapsed().as_secs_f64();
    let packed = schema::encode(group).expect("encodes");
    let (zstd3, zstd3_s, _) = zstd_level(&packed, 3);
    Measured {
        tokens: group.completion_tokens(),
        kept: masks.iter().map(|m| m.ids.len()).sum(),
        tokens_b: field(&|s| named(&s.tokens)),
        logprobs_b: field(&|s| named(&s.logprobs)),
        versions_b: field(&|s| named(&s.versions)),
        csr_b,
        packed_b,
        pack_s,
        roundtrip_s,
        csr_total: packed.len() - packed_b + csr_b,
        packed: packed.len(),
        deflate: [deflate(&packed, 1), deflate(&packed, 6)],
        zstd1: zstd_level(&packed, 1),
        zstd3: (zstd3, zstd3_s),
    }
}

impl Measured {
    fn per_tok(&self, b: usize) -> f64 {
        b as f64 / self.tokens as f64
    }

    /// The line printed for `case`.
    fn line(&self, case: &Case, gen_s: f64) -> String {
        let p = |b| self.per_tok(b);
        format!(
            "{:<40} {:>5} tokens, {:>7.1} kept ids/token | B/token: tokens {:.1} logprobs {:.1} versions {:.2} | mask CSR {:.1} packed {:.1} | message CSR {:.1} packed {:.1} zstd-1 {:.1} ({:.1} ms) deflate-1 {:.1} ({:.1} ms) | gen {gen_s:.1} s",
            case.name,
            self.tokens,
            p(self.kept),
            p(self.tokens_b),
            p(self.logprobs_b),
            p(self.versions_b),
            p(self.csr_b),
            p(self.packed_b),
            p(self.csr_total),
            p(self.packed),
            p(self.zstd1.0),
            self.zstd1.1 * 1e3,
            p(self.deflate[0].0),
            self.deflate[0].1 * 1e3,
        )
    }

    /// The JSON row of `case`.
    fn row(&self, case: &Case, gen_cfg: &GenConfig, gen_s: f64) -> serde_json::Value {
        let p = |b| self.per_tok(b);
        let [(deflate1, deflate1_s), (deflate6, deflate6_s)] = self.deflate;
        let (zstd1, zstd1_s, unzstd1_s) = self.zstd1;
        let (zstd3, zstd3_s) = self.zstd3;
        serde_json::json!({
            "case": case.name,
            "temperature": case.temperature,
            "top_k": case.top_k,
            "top_p": case.top_p,
            "mask_cap": case.mask_cap,
            "sampled_top_k": gen_cfg.sampling_top_k(),
            "samples": SAMPLES,
            "tokens": self.tokens,
            "kept_ids_per_token": p(self.kept),
            "bytes": {
                "tokens": self.tokens_b,
                "logprobs": self.logprobs_b,
                "versions": self.versions_b,
                "mask_csr": self.csr_b,
                "mask_packed": self.packed_b,
                "message_csr": self.csr_total,
                "message_packed": self.packed,
                "message_packed_deflate1": deflate1,
                "message_packed_deflate6": deflate6,
                "message_packed_zstd1": zstd1,
                "message_packed_zstd3": zstd3,
            },
            "bytes_per_token": {
                "message_csr": p(self.csr_total),
                "message_packed": p(self.packed),
                "mask_csr": p(self.csr_b),
                "mask_packed": p(self.packed_b),
                "message_packed_deflate1": p(deflate1),
                "message_packed_deflate6": p(deflate6),
                "message_packed_zstd1": p(zstd1),
                "message_packed_zstd3": p(zstd3),
            },
            "seconds": {
                "generate": gen_s,
                "pack_masks": self.pack_s,
                "pack_and_unpack_masks": self.roundtrip_s,
                "deflate1": deflate1_s,
                "deflate6": deflate6_s,
                "zstd1": zstd1_s,
                "zstd1_decompress": unzstd1_s,
                "zstd3": zstd3_s,
            },
        })
    }
}

fn main() {
    let out = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "benches/results/wire_bytes.json".into());
    let cfg = ModelConfig::new(Architecture::Qwen2, VOCAB, 64, 192, 2, 4, 2, 16);
    let model = Policy::<InferBackend>::random(&cfg, 7, &Default::default()).expect("model");
    let mut rows = Vec::new();
    for case in &cases() {
        let (group, gen_cfg, gen_s) = sampled_group(&model, case);
        let m = measure(&group);
        println!("{}", m.line(case, gen_s));
        let mut row = m.row(case, &gen_cfg, gen_s);
        row["schema"] = serde_json::Value::String(format!("{}", group.schema));
        rows.push(row);
        assert_eq!(group.schema, SchemaVersion { major: 3, minor: 0 });
    }
    let report = serde_json::json!({
        "bench": "wire_bytes",
        "machine": std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            }),
        "vocab": VOCAB,
        "cases": rows,
    });
    if let Some(dir) = std::path::Path::new(&out).parent() {
        std::fs::create_dir_all(dir).expect("results dir");
    }
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&report).expect("json") + "\n",
    )
    .expect("write results");
    println!("wrote {out}");
}

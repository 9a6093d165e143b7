//! Codec throughput on a realistic RolloutGroup (8 samples × 256 tokens, top-k 8 masks),
//! and the measurement behind the wire representation of per-token arrays: one `bin` of
//! little-endian values (what rlstream writes) against plain MessagePack arrays.
//!
//! `cargo bench --bench codec`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlstream::schema::{
    self, CsrMask, Floats, RolloutGroup, SamplingMask, ScoredGroup, Tokens, examples,
};
use serde::{Deserialize, Serialize};
use std::hint::black_box;

fn codec(c: &mut Criterion) {
    let group_msg = examples::realistic_rollout_group();
    let bytes = schema::encode(&group_msg).unwrap();
    let mut g = c.benchmark_group("codec/rollout_group_8x256_masked");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("encode", |b| {
        b.iter(|| schema::encode(black_box(&group_msg)).unwrap())
    });
    g.bench_function("decode", |b| {
        b.iter(|| schema::decode::<RolloutGroup>(black_box(&bytes)).unwrap())
    });
    g.finish();

    let scored = ScoredGroup {
        rollout: group_msg.clone(),
        rewards: vec![1.0; 8],
        advantages: vec![0.5; 8],
        token_rewards: None,
        ref_logprobs: None,
        ..examples::scored_group()
    };
    let scored_bytes = schema::encode(&scored).unwrap();
    let mut g = c.benchmark_group("codec/scored_group_8x256_masked");
    g.throughput(Throughput::Bytes(scored_bytes.len() as u64));
    g.bench_function("encode", |b| {
        b.iter(|| schema::encode(black_box(&scored)).unwrap())
    });
    g.bench_function("decode", |b| {
        b.iter(|| schema::decode::<ScoredGroup>(black_box(&scored_bytes)).unwrap())
    });
    g.finish();
}

/// The realistic group's sampling masks, packed kept sets (3.0) against CSR (2.x).
fn masks(c: &mut Criterion) {
    let src = examples::realistic_rollout_group();
    let masks: Vec<SamplingMask> = src.samples.iter().filter_map(|s| s.mask.clone()).collect();
    let csr: Vec<CsrMask> = masks.iter().map(CsrMask::from).collect();
    let csr_bytes = rmp_serde::to_vec_named(&csr).unwrap();
    let packed_bytes = rmp_serde::to_vec_named(&masks).unwrap();
    println!(
        "masks: {} kept ids; CSR {} bytes, packed {} bytes",
        masks.iter().map(|m| m.ids.len()).sum::<usize>(),
        csr_bytes.len(),
        packed_bytes.len()
    );
    let mut g = c.benchmark_group("masks");
    g.bench_function("packed/encode", |b| {
        b.iter(|| rmp_serde::to_vec_named(black_box(&masks)).unwrap())
    });
    g.bench_function("packed/decode", |b| {
        b.iter(|| rmp_serde::from_slice::<Vec<SamplingMask>>(black_box(&packed_bytes)).unwrap())
    });
    g.bench_function("csr/encode", |b| {
        b.iter(|| rmp_serde::to_vec_named(black_box(&csr)).unwrap())
    });
    g.bench_function("csr/decode", |b| {
        b.iter(|| rmp_serde::from_slice::<Vec<CsrMask>>(black_box(&csr_bytes)).unwrap())
    });
    g.finish();
}

/// The per-token arrays of a group in the two candidate wire forms.
#[derive(Serialize, Deserialize)]
struct AsBin {
    tokens: Vec<Tokens>,
    logprobs: Vec<Floats>,
    mask_ids: Vec<Tokens>,
}

#[derive(Serialize, Deserialize)]
struct AsArrays {
    tokens: Vec<Vec<u32>>,
    logprobs: Vec<Vec<f32>>,
    mask_ids: Vec<Vec<u32>>,
}

fn representation(c: &mut Criterion) {
    let src = examples::realistic_rollout_group();
    let arrays = AsArrays {
        tokens: src.samples.iter().map(|s| s.tokens.0.clone()).collect(),
        logprobs: src.samples.iter().map(|s| s.logprobs.0.clone()).collect(),
        mask_ids: src
            .samples
            .iter()
            .map(|s| s.mask.as_ref().unwrap().ids.0.clone())
            .collect(),
    };
    let bin = AsBin {
        tokens: arrays.tokens.iter().cloned().map(Tokens::from).collect(),
        logprobs: arrays.logprobs.iter().cloned().map(Floats::from).collect(),
        mask_ids: arrays.mask_ids.iter().cloned().map(Tokens::from).collect(),
    };
    let bin_bytes = rmp_serde::to_vec_named(&bin).unwrap();
    let array_bytes = rmp_serde::to_vec_named(&arrays).unwrap();
    let values = (arrays.tokens.iter().map(Vec::len).sum::<usize>() * 2
        + arrays.mask_ids.iter().map(Vec::len).sum::<usize>()) as u64;
    println!(
        "representation: {values} values; bin form {} bytes, array form {} bytes",
        bin_bytes.len(),
        array_bytes.len()
    );
    let mut g = c.benchmark_group("codec/representation");
    g.throughput(Throughput::Elements(values));
    g.bench_function("bin/encode", |b| {
        b.iter(|| rmp_serde::to_vec_named(black_box(&bin)).unwrap())
    });
    g.bench_function("bin/decode", |b| {
        b.iter(|| rmp_serde::from_slice::<AsBin>(black_box(&bin_bytes)).unwrap())
    });
    g.bench_function("arrays/encode", |b| {
        b.iter(|| rmp_serde::to_vec_named(black_box(&arrays)).unwrap())
    });
    g.bench_function("arrays/decode", |b| {
        b.iter(|| rmp_serde::from_slice::<AsArrays>(black_box(&array_bytes)).unwrap())
    });
    g.finish();
}

criterion_group!(benches, codec, representation, masks);
criterion_main!(benches);

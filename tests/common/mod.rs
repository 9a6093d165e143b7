//! Helpers shared by the integration tests: a real Redis on loopback and unique namespaces.
#![allow(dead_code)]

use rlstream::bus::{RedisBus, SharedBus};
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{RolloutGroup, Sample, SamplingParams, SchemaVersion, ScoredGroup};
use rlstream::stages::score::{AdvantageKind, advantages};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Redis the tests talk to; `RLSTREAM_TEST_REDIS` overrides.
pub fn redis_url() -> String {
    std::env::var("RLSTREAM_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string())
}

/// A namespace no other test (or earlier run) uses.
pub fn unique_ns(test: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "test-{test}-{}-{}-{}",
        std::process::id(),
        nanos % 1_000_000_000,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

pub async fn redis_bus() -> SharedBus {
    match RedisBus::connect(&redis_url()).await {
        Ok(bus) => Arc::new(bus),
        Err(e) => panic!("these tests need a real Redis: {e}"),
    }
}

/// Deletes every key of a namespace (tests clean up after themselves).
pub async fn drop_namespace(ns: &str) {
    let Ok(client) = redis::Client::open(redis_url()) else {
        return;
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    if !keys.is_empty() {
        let _: Result<u64, _> = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
    }
}

/// A scored group of `rewards.len()` completions of `prompt` sampled from `model` (at
/// temperature 1, `max_new_tokens`, seed `seed`), with GRPO advantages.
pub fn sampled_group(
    model: &Policy<InferBackend>,
    group_id: &str,
    prompt: Vec<u32>,
    max_new_tokens: u32,
    seed: u64,
    rewards: Vec<f32>,
) -> ScoredGroup {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        max_new_tokens,
        stop_tokens: vec![],
        seed,
    };
    let req = Request {
        id: 0,
        prompt: prompt.clone(),
        n: rewards.len(),
        params: params.clone(),
    };
    let done = Generator::generate(model, 0, &[req]);
    ScoredGroup {
        schema: SchemaVersion::CURRENT,
        rollout: RolloutGroup {
            schema: SchemaVersion::CURRENT,
            group_id: group_id.to_string(),
            prompt_id: format!("prompt-{group_id}"),
            task: "test".into(),
            prompt_tokens: prompt.into(),
            samples: done.into_iter().map(Sample::from).collect(),
            sampling: params,
            gen_id: "gen".into(),
            started_us: 0,
            finished_us: 0,
            meta: Default::default(),
        },
        advantages: advantages(&rewards, AdvantageKind::Grpo),
        rewards,
        token_rewards: None,
        ref_logprobs: None,
        scorer_id: "score".into(),
        scored_us: 0,
    }
}

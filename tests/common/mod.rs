//! Helpers shared by the integration tests: a real Redis on loopback and unique namespaces.
#![allow(dead_code)]

use rlstream::bus::{RedisBus, SharedBus};
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

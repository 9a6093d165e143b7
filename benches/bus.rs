//! Bus throughput against the real Redis (`RLSTREAM_BENCH_REDIS`, default
//! redis://127.0.0.1:6379) and the in-memory bus: pipelined publish in batches of
//! [`BATCH`], and group consume (XREADGROUP + XACK) of the same entries, in messages/s.
//! `benches/bus_vs_redis.sh` runs this beside `redis-benchmark` for the ratio.
//!
//! `cargo bench --bench bus`

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rlstream::bus::{GroupStart, MemoryBus, ReadFrom, RedisBus, SharedBus};
use rlstream::schema::{self, examples};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Entries per pipelined publish call (and redis-benchmark's `-P`).
const BATCH: usize = 100;
/// Publish trims the stream to about this many entries (`MAXLEN ~`), as redis-benchmark's
/// XADD does in `bus_vs_redis.sh`: without it the stream grows by gigabytes during a run
/// and the figures measure Redis allocating memory.
const MAX_LEN: u64 = 10_000;

fn payloads() -> Vec<(String, Bytes)> {
    let realistic = Bytes::from(schema::encode(&examples::realistic_rollout_group()).unwrap());
    vec![
        ("1KiB".to_string(), Bytes::from(vec![b'x'; 1024])),
        ("16KiB".to_string(), Bytes::from(vec![b'x'; 16 * 1024])),
        (format!("rollout_{}B", realistic.len()), realistic),
    ]
}

fn bench_backend(c: &mut Criterion, name: &str, bus: SharedBus, rt: &tokio::runtime::Runtime) {
    let stream = format!("bench:{name}:{}", std::process::id());
    for (label, payload) in payloads() {
        let batch: Vec<Bytes> = vec![payload.clone(); BATCH];
        let mut g = c.benchmark_group(format!("bus/{name}/publish"));
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(BenchmarkId::from_parameter(&label), |b| {
            b.to_async(rt).iter(|| async {
                bus.publish(&stream, &batch, Some(MAX_LEN)).await.unwrap();
            })
        });
        g.finish();
        rt.block_on(bus.delete(std::slice::from_ref(&stream)))
            .unwrap();

        let mut g = c.benchmark_group(format!("bus/{name}/consume"));
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(BenchmarkId::from_parameter(&label), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    bus.delete(std::slice::from_ref(&stream)).await.unwrap();
                    bus.create_group(&stream, "g", GroupStart::Beginning)
                        .await
                        .unwrap();
                    for _ in 0..iters {
                        bus.publish(&stream, &batch, None).await.unwrap();
                    }
                    let start = Instant::now();
                    for _ in 0..iters {
                        let got = bus
                            .read_group(
                                &stream,
                                "g",
                                "c",
                                ReadFrom::New,
                                BATCH,
                                Some(Duration::from_secs(1)),
                            )
                            .await
                            .unwrap();
                        let ids: Vec<_> = got.iter().map(|e| e.id).collect();
                        bus.ack(&stream, "g", &ids).await.unwrap();
                    }
                    start.elapsed()
                })
            })
        });
        g.finish();
        rt.block_on(bus.delete(std::slice::from_ref(&stream)))
            .unwrap();
    }
}

fn bus(c: &mut Criterion) {
    // Both tokio flavours: on a 2-core machine shared with redis-server, a multi-threaded
    // runtime moves the connection's driver task between threads and pays for it.
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let multi = tokio::runtime::Runtime::new().unwrap();
    let url =
        std::env::var("RLSTREAM_BENCH_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    for (name, rt) in [("redis", &current), ("redis-mt", &multi)] {
        match rt.block_on(RedisBus::connect(&url)) {
            Ok(redis) => bench_backend(c, name, Arc::new(redis), rt),
            Err(e) => eprintln!("skipping the Redis bus bench: {e}"),
        }
    }
    bench_backend(c, "memory", Arc::new(MemoryBus::new()), &current);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(4));
    targets = bus
}
criterion_main!(benches);

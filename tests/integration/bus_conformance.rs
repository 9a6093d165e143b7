//! One conformance suite, run unchanged against the Redis backend (a real Redis on
//! loopback) and the in-memory backend.

use crate::common::dead_letters;
use bytes::Bytes;
use rlstream::bus::{
    BusError, Consumer, ConsumerOptions, EntryId, GroupStart, MemoryBus, RangeBound, ReadFrom,
    SharedBus,
};
use rlstream::schema::{self, Prompt, examples};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

fn payloads(n: usize) -> Vec<Bytes> {
    (0..n).map(|i| Bytes::from(format!("entry-{i}"))).collect()
}

fn prompt_bytes(i: usize) -> Bytes {
    let mut p = examples::prompt();
    p.prompt_id = format!("p-{i}");
    Bytes::from(schema::encode(&p).unwrap())
}

fn opts(claim_idle_ms: u64, max_deliveries: u32) -> ConsumerOptions {
    ConsumerOptions {
        claim_idle: Duration::from_millis(claim_idle_ms),
        max_deliveries,
        block: Duration::from_millis(50),
        batch: 8,
        ..ConsumerOptions::default()
    }
}

async fn two_consumers_never_share_an_entry(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    bus.create_group(&stream, "g", GroupStart::Beginning)
        .await
        .unwrap();
    bus.publish(&stream, &payloads(300), None).await.unwrap();
    let read_all = |name: &'static str| {
        let (bus, stream) = (bus.clone(), stream.clone());
        tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let batch = bus
                    .read_group(
                        &stream,
                        "g",
                        name,
                        ReadFrom::New,
                        7,
                        Some(Duration::from_millis(100)),
                    )
                    .await
                    .unwrap();
                if batch.is_empty() {
                    return got;
                }
                // Yield between reads so both consumers interleave.
                tokio::task::yield_now().await;
                got.extend(batch.into_iter().map(|e| e.id));
            }
        })
    };
    let (a, b) = (read_all("a"), read_all("b"));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let sa: HashSet<EntryId> = a.iter().copied().collect();
    let sb: HashSet<EntryId> = b.iter().copied().collect();
    assert_eq!(sa.len(), a.len(), "a consumer got an entry twice");
    assert!(sa.is_disjoint(&sb), "an entry went to both consumers");
    assert_eq!(sa.len() + sb.len(), 300, "every entry was delivered");
    let stats = bus.stats(&stream).await.unwrap();
    assert_eq!(stats.groups[0].pending, 300);
    assert_eq!(stats.groups[0].lag, Some(0));
}

async fn unacked_entry_is_claimed_after_claim_idle(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    bus.create_group(&stream, "g", GroupStart::Beginning)
        .await
        .unwrap();
    let ids = bus.publish(&stream, &payloads(3), None).await.unwrap();
    let first = bus
        .read_group(&stream, "g", "dies", ReadFrom::New, 10, None)
        .await
        .unwrap();
    assert_eq!(first.len(), 3);
    bus.ack(&stream, "g", &ids[..1]).await.unwrap();
    let idle = Duration::from_millis(300);
    let early = bus
        .claim_idle(&stream, "g", "lives", idle, 10)
        .await
        .unwrap();
    assert!(early.is_empty(), "claimed before claim_idle: {early:?}");
    tokio::time::sleep(idle + Duration::from_millis(50)).await;
    let claimed = bus
        .claim_idle(&stream, "g", "lives", idle, 10)
        .await
        .unwrap();
    assert_eq!(
        claimed.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids[1..].to_vec()
    );
    assert!(claimed.iter().all(|e| e.deliveries == 2), "{claimed:?}");
    assert_eq!(claimed[0].payload, Bytes::from("entry-1"));
    let stats = bus.stats(&stream).await.unwrap();
    let lives = stats.groups[0]
        .consumers
        .iter()
        .find(|c| c.name == "lives")
        .unwrap();
    assert_eq!(lives.pending, 2);
}

async fn consumer_claims_for_a_dead_consumer(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    bus.create_group(&stream, "g", GroupStart::Beginning)
        .await
        .unwrap();
    bus.publish(&stream, &[prompt_bytes(0), prompt_bytes(1)], None)
        .await
        .unwrap();
    // A consumer takes both and dies without acking.
    bus.read_group(&stream, "g", "crashed", ReadFrom::New, 10, None)
        .await
        .unwrap();
    let mut c =
        Consumer::<Prompt>::join(bus.clone(), &stream, "g", "survivor", &dead, opts(200, 5))
            .await
            .unwrap();
    let mut got = Vec::new();
    for _ in 0..20 {
        let batch = c.poll().await.unwrap();
        c.ack(&batch.iter().map(|d| d.id).collect::<Vec<_>>())
            .await
            .unwrap();
        got.extend(batch.into_iter().map(|d| d.message.prompt_id));
        if got.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got, vec!["p-0", "p-1"]);
    assert_eq!(c.counts().claimed, 2);
    assert_eq!(bus.stats(&stream).await.unwrap().groups[0].pending, 0);
}

async fn held_entries_are_not_claimed_while_the_consumer_polls(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    bus.create_group(&stream, "g", GroupStart::Beginning)
        .await
        .unwrap();
    bus.publish(&stream, &[prompt_bytes(0)], None)
        .await
        .unwrap();
    // The trainer's pattern: take an entry, keep polling, ack much later than claim_idle.
    let mut c = Consumer::<Prompt>::join(bus.clone(), &stream, "g", "holder", &dead, opts(400, 2))
        .await
        .unwrap();
    let first = c.poll().await.unwrap();
    assert_eq!(first.len(), 1);
    let held = first[0].id;
    // 8 × 150 ms: three times claim_idle, so an entry nobody refreshed would be claimed.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(c.poll().await.unwrap().is_empty(), "a held entry came back");
        let other = bus
            .claim_idle(&stream, "g", "other", Duration::from_millis(400), 10)
            .await
            .unwrap();
        assert!(other.is_empty(), "claimed from a live holder: {other:?}");
    }
    assert!(dead_letters(&bus, &dead).await.is_empty());
    assert_eq!(c.ack(&[held]).await.unwrap(), 1);
}

async fn failing_entry_is_dead_lettered_with_its_error(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    let ids = bus
        .publish(&stream, &[prompt_bytes(7)], None)
        .await
        .unwrap();
    let mut c = Consumer::<Prompt>::join(bus.clone(), &stream, "g", "c", &dead, opts(100, 3))
        .await
        .unwrap();
    let mut attempts = 0;
    for _ in 0..100 {
        for d in c.poll().await.unwrap() {
            attempts += 1;
            assert_eq!(d.deliveries, attempts);
            let gave_up = c.fail(&d, "verifier crashed: boom").await.unwrap();
            assert_eq!(gave_up, attempts == 3);
        }
        if attempts == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(attempts, 3, "delivered exactly max_deliveries times");
    let letters = dead_letters(&bus, &dead).await;
    assert_eq!(letters.len(), 1);
    let l = &letters[0];
    assert_eq!(l.error, "verifier crashed: boom");
    assert_eq!(l.reason, "failed");
    assert_eq!(l.deliveries, 3);
    assert_eq!(l.source_stream, stream);
    assert_eq!(l.source_id, ids[0].to_string());
    assert_eq!(l.payload, prompt_bytes(7).to_vec());
    assert_eq!(bus.stats(&stream).await.unwrap().groups[0].pending, 0);
    // Nothing is handed out again.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(c.poll().await.unwrap().is_empty());
}

async fn entry_over_max_deliveries_is_dead_lettered(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    bus.create_group(&stream, "g", GroupStart::Beginning)
        .await
        .unwrap();
    bus.publish(&stream, &[prompt_bytes(3)], None)
        .await
        .unwrap();
    // Three consumers in turn take it and "crash" (never ack): deliveries 1, 2, 3.
    bus.read_group(&stream, "g", "x", ReadFrom::New, 1, None)
        .await
        .unwrap();
    for name in ["y", "z"] {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let got = bus
            .claim_idle(&stream, "g", name, Duration::from_millis(50), 1)
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
    }
    tokio::time::sleep(Duration::from_millis(60)).await;
    let mut c = Consumer::<Prompt>::join(bus.clone(), &stream, "g", "w", &dead, opts(50, 3))
        .await
        .unwrap();
    assert!(
        c.poll().await.unwrap().is_empty(),
        "the 4th delivery is not handed out"
    );
    let letters = dead_letters(&bus, &dead).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].reason, "max_deliveries");
    assert_eq!(letters[0].deliveries, 4);
    assert!(
        letters[0].error.contains("max_deliveries = 3"),
        "{}",
        letters[0].error
    );
    assert_eq!(bus.stats(&stream).await.unwrap().groups[0].pending, 0);
}

async fn undecodable_bytes_are_dead_lettered_and_consumer_goes_on(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    let garbage = Bytes::from_static(b"\xc1\xff not msgpack");
    let truncated = prompt_bytes(2).slice(..10);
    bus.publish(
        &stream,
        &[
            prompt_bytes(0),
            garbage.clone(),
            truncated.clone(),
            prompt_bytes(1),
        ],
        None,
    )
    .await
    .unwrap();
    let mut c = Consumer::<Prompt>::join(bus.clone(), &stream, "g", "c", &dead, opts(10_000, 5))
        .await
        .unwrap();
    let batch = c.poll().await.unwrap();
    let got: Vec<_> = batch.iter().map(|d| d.message.prompt_id.as_str()).collect();
    assert_eq!(got, vec!["p-0", "p-1"]);
    let letters = dead_letters(&bus, &dead).await;
    assert_eq!(letters.len(), 2);
    assert_eq!(letters[0].payload, garbage.to_vec());
    assert_eq!(letters[0].reason, "not_msgpack");
    assert!(
        letters[0].error.contains("not a MessagePack map"),
        "{}",
        letters[0].error
    );
    assert_eq!(letters[1].payload, truncated.to_vec());
    assert_eq!(letters[1].reason, "truncated");
    // Only the good ones are still pending, waiting for the stage's ack.
    assert_eq!(bus.stats(&stream).await.unwrap().groups[0].pending, 2);
    c.ack(&batch.iter().map(|d| d.id).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(bus.stats(&stream).await.unwrap().groups[0].pending, 0);
    assert_eq!(c.counts().dead_lettered, 2);
}

async fn range_reads_are_ordered(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    let mut ids = Vec::new();
    for chunk in payloads(60).chunks(20) {
        ids.extend(bus.publish(&stream, chunk, None).await.unwrap());
    }
    let all = bus
        .range(&stream, RangeBound::Open, RangeBound::Open, 1000)
        .await
        .unwrap();
    assert_eq!(all.iter().map(|e| e.id).collect::<Vec<_>>(), ids);
    assert_eq!(all[59].payload, Bytes::from("entry-59"));
    let mid = bus
        .range(
            &stream,
            RangeBound::Exclusive(ids[10]),
            RangeBound::Inclusive(ids[20]),
            1000,
        )
        .await
        .unwrap();
    assert_eq!(
        mid.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids[11..=20].to_vec()
    );
    let limited = bus
        .range(&stream, RangeBound::Inclusive(ids[5]), RangeBound::Open, 3)
        .await
        .unwrap();
    assert_eq!(
        limited.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids[5..8].to_vec()
    );
    let after = bus.read_after(&stream, ids[57], 100, None).await.unwrap();
    assert_eq!(
        after.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids[58..].to_vec()
    );
    let missing = bus
        .range(
            &format!("{ns}:none"),
            RangeBound::Open,
            RangeBound::Open,
            10,
        )
        .await
        .unwrap();
    assert!(missing.is_empty());
}

async fn blocking_reads_wake_on_publish_and_time_out_cleanly(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    bus.create_group(&stream, "g", GroupStart::End)
        .await
        .unwrap();
    // Longer than redis 1.x's 500 ms default response timeout: must come back empty, not fail.
    let empty = bus
        .read_group(
            &stream,
            "g",
            "c",
            ReadFrom::New,
            10,
            Some(Duration::from_millis(800)),
        )
        .await
        .unwrap();
    assert!(empty.is_empty());
    let publisher = {
        let (bus, stream) = (bus.clone(), stream.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            bus.publish(&stream, &payloads(1), None).await.unwrap();
        })
    };
    let (group_read, plain_read) = tokio::join!(
        bus.read_group(
            &stream,
            "g",
            "c",
            ReadFrom::New,
            10,
            Some(Duration::from_secs(10))
        ),
        bus.read_after(&stream, EntryId::ZERO, 10, Some(Duration::from_secs(10))),
    );
    publisher.await.unwrap();
    assert_eq!(group_read.unwrap().len(), 1);
    assert_eq!(plain_read.unwrap().len(), 1);
}

async fn own_pending_entries_come_back_after_restart(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    bus.publish(
        &stream,
        &[prompt_bytes(0), prompt_bytes(1), prompt_bytes(2)],
        None,
    )
    .await
    .unwrap();
    let mut before = Consumer::<Prompt>::join(
        bus.clone(),
        &stream,
        "g",
        "trainer-0",
        &dead,
        opts(60_000, 5),
    )
    .await
    .unwrap();
    let first = before.poll().await.unwrap();
    assert_eq!(first.len(), 3);
    before.ack(&[first[0].id]).await.unwrap();
    drop(before);
    // Same consumer name after a restart: its unacked entries come first, counted again.
    let mut after = Consumer::<Prompt>::join(
        bus.clone(),
        &stream,
        "g",
        "trainer-0",
        &dead,
        opts(60_000, 5),
    )
    .await
    .unwrap();
    let again = after.poll().await.unwrap();
    let ids: Vec<_> = again.iter().map(|d| d.message.prompt_id.as_str()).collect();
    assert_eq!(ids, vec!["p-1", "p-2"]);
    assert!(
        again.iter().all(|d| d.deliveries == 2),
        "{:?}",
        again.iter().map(|d| d.deliveries).collect::<Vec<_>>()
    );
    bus.publish(&stream, &[prompt_bytes(3)], None)
        .await
        .unwrap();
    let next = after.poll().await.unwrap();
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].message.prompt_id, "p-3");
}

/// A restarted consumer that holds everything it reads (the trainer, until its next
/// checkpoint) and had more pending than one batch: it pages through all of them once,
/// then goes on to new entries. (Re-reading from the start would hand it the same first
/// batch forever.)
async fn a_holder_pages_through_more_own_pending_than_a_batch(bus: SharedBus, ns: &str) {
    let (stream, dead) = (format!("{ns}:s"), format!("{ns}:dead"));
    let payloads: Vec<Bytes> = (0..20).map(prompt_bytes).collect();
    bus.publish(&stream, &payloads, None).await.unwrap();
    let join = || {
        Consumer::<Prompt>::join(
            bus.clone(),
            &stream,
            "g",
            "trainer-0",
            &dead,
            opts(60_000, 5),
        )
    };
    let mut before = join().await.unwrap();
    let mut held = 0;
    for _ in 0..10 {
        held += before.poll().await.unwrap().len();
    }
    assert_eq!(held, 20);
    drop(before);
    let mut after = join().await.unwrap();
    let mut again = Vec::new();
    for _ in 0..10 {
        again.extend(
            after
                .poll()
                .await
                .unwrap()
                .into_iter()
                .map(|d| d.message.prompt_id),
        );
    }
    let expected: Vec<String> = (0..20).map(|i| format!("p-{i}")).collect();
    assert_eq!(again, expected);
    bus.publish(&stream, &[prompt_bytes(20)], None)
        .await
        .unwrap();
    let mut next = Vec::new();
    for _ in 0..5 {
        next.extend(after.poll().await.unwrap());
    }
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].message.prompt_id, "p-20");
}

async fn stats_report_length_pending_and_lag(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    bus.create_group(&stream, "g", GroupStart::Beginning)
        .await
        .unwrap();
    let ids = bus.publish(&stream, &payloads(10), None).await.unwrap();
    bus.read_group(&stream, "g", "c", ReadFrom::New, 4, None)
        .await
        .unwrap();
    bus.ack(&stream, "g", &ids[..1]).await.unwrap();
    let s = bus.stats(&stream).await.unwrap();
    assert_eq!(s.length, 10);
    assert_eq!(s.first_id, Some(ids[0]));
    assert_eq!(s.last_id, Some(ids[9]));
    assert_eq!(s.groups.len(), 1);
    let g = &s.groups[0];
    assert_eq!(
        (g.name.as_str(), g.pending, g.lag, g.last_delivered),
        ("g", 3, Some(6), ids[3])
    );
    assert_eq!(g.consumers.len(), 1);
    assert_eq!(
        (g.consumers[0].name.as_str(), g.consumers[0].pending),
        ("c", 3)
    );
    assert_eq!(bus.stats(&format!("{ns}:none")).await.unwrap().length, 0);
}

async fn max_len_trims_as_it_publishes(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    for chunk in payloads(2000).chunks(100) {
        bus.publish(&stream, chunk, Some(100)).await.unwrap();
    }
    let len = bus.stats(&stream).await.unwrap().length;
    // `MAXLEN ~` trims whole radix-tree nodes: about 100, never everything, never unbounded.
    assert!((100..=300).contains(&len), "length {len}");
}

async fn blobs_round_trip_and_delete(bus: SharedBus, ns: &str) {
    let big = Bytes::from(vec![7u8; 3 << 20]);
    let keys = [format!("{ns}:w:1:0"), format!("{ns}:w:1:1")];
    bus.put_blobs(&[
        (keys[0].clone(), big.clone()),
        (keys[1].clone(), Bytes::from_static(b"x")),
    ])
    .await
    .unwrap();
    let got = bus
        .get_blobs(&[keys[0].clone(), keys[1].clone(), format!("{ns}:w:missing")])
        .await
        .unwrap();
    assert_eq!(got, vec![Some(big), Some(Bytes::from_static(b"x")), None]);
    assert_eq!(bus.delete(&keys).await.unwrap(), 2);
    assert_eq!(bus.get_blobs(&keys[..1]).await.unwrap(), vec![None]);
}

async fn reading_a_missing_group_is_a_clear_error(bus: SharedBus, ns: &str) {
    let stream = format!("{ns}:s");
    bus.publish(&stream, &payloads(1), None).await.unwrap();
    let err = bus
        .read_group(&stream, "nogroup", "c", ReadFrom::New, 1, None)
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::NoGroup { .. }), "{err:?}");
    assert!(err.to_string().contains("nogroup"), "{err}");
}

async fn append_keeps_ids_and_refuses_to_go_back(bus: SharedBus, ns: &str) {
    let s = format!("{ns}:restore");
    let entries: Vec<(EntryId, Bytes)> = (1..=3)
        .map(|i| (EntryId::new(1_000 + i, i), Bytes::from(format!("p{i}"))))
        .collect();
    bus.append(&s, &entries).await.unwrap();
    let read = bus
        .range(&s, RangeBound::Open, RangeBound::Open, 10)
        .await
        .unwrap();
    let got: Vec<(EntryId, Bytes)> = read.into_iter().map(|e| (e.id, e.payload)).collect();
    assert_eq!(got, entries);
    let err = bus
        .append(&s, &[(EntryId::new(1_002, 0), Bytes::from_static(b"old"))])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("XADD"), "{err}");
    // New entries go after the restored ones.
    let next = bus.publish(&s, &payloads(1), None).await.unwrap();
    assert!(next[0] > EntryId::new(1_003, 3));
}

async fn trim_before_removes_only_older_entries(bus: SharedBus, ns: &str) {
    let s = format!("{ns}:trim");
    let entries: Vec<(EntryId, Bytes)> = (1..=5)
        .map(|i| (EntryId::new(i, 0), Bytes::from(format!("p{i}"))))
        .collect();
    bus.append(&s, &entries).await.unwrap();
    assert_eq!(bus.trim_before(&s, EntryId::new(3, 0)).await.unwrap(), 2);
    let left: Vec<EntryId> = bus
        .range(&s, RangeBound::Open, RangeBound::Open, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        left,
        vec![EntryId::new(3, 0), EntryId::new(4, 0), EntryId::new(5, 0)]
    );
    assert_eq!(bus.trim_before(&s, EntryId::new(3, 0)).await.unwrap(), 0);
    assert_eq!(
        bus.trim_before(&format!("{ns}:none"), EntryId::new(9, 0))
            .await
            .unwrap(),
        0
    );
}

async fn oldest_pending_follows_acks(bus: SharedBus, ns: &str) {
    let s = format!("{ns}:pend");
    bus.create_group(&s, "g", GroupStart::Beginning)
        .await
        .unwrap();
    assert_eq!(bus.oldest_pending(&s, "g").await.unwrap(), None);
    let ids = bus.publish(&s, &payloads(3), None).await.unwrap();
    bus.read_group(&s, "g", "c", ReadFrom::New, 3, None)
        .await
        .unwrap();
    assert_eq!(bus.oldest_pending(&s, "g").await.unwrap(), Some(ids[0]));
    bus.ack(&s, "g", &ids[..2]).await.unwrap();
    assert_eq!(bus.oldest_pending(&s, "g").await.unwrap(), Some(ids[2]));
    let err = bus.oldest_pending(&s, "missing").await.unwrap_err();
    assert!(matches!(err, BusError::NoGroup { .. }), "{err}");
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let bus: SharedBus = Arc::new(MemoryBus::new());
                    super::$case(bus, "mem").await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let ns = crate::common::unique_ns(stringify!($case));
                    let bus = crate::common::redis_bus().await;
                    super::$case(bus, &ns).await;
                    crate::common::drop_namespace(&ns).await;
                }
            )*
        }
        /// The same cases on a redis-server that speaks only TLS and asks for a client
        /// certificate.
        mod redis_tls {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let server = crate::common::start_tls_redis(true);
                    let opts = rlstream::bus::RedisOptions {
                        tls: server.pki.client_files(),
                        ..Default::default()
                    };
                    let bus = rlstream::bus::RedisBus::connect_with(&server.url, opts)
                        .await
                        .expect("TLS redis");
                    super::$case(Arc::new(bus), "tls").await;
                }
            )*
        }
    };
}

conformance!(
    two_consumers_never_share_an_entry,
    unacked_entry_is_claimed_after_claim_idle,
    consumer_claims_for_a_dead_consumer,
    held_entries_are_not_claimed_while_the_consumer_polls,
    failing_entry_is_dead_lettered_with_its_error,
    entry_over_max_deliveries_is_dead_lettered,
    undecodable_bytes_are_dead_lettered_and_consumer_goes_on,
    range_reads_are_ordered,
    blocking_reads_wake_on_publish_and_time_out_cleanly,
    own_pending_entries_come_back_after_restart,
    a_holder_pages_through_more_own_pending_than_a_batch,
    stats_report_length_pending_and_lag,
    max_len_trims_as_it_publishes,
    blobs_round_trip_and_delete,
    reading_a_missing_group_is_a_clear_error,
    append_keeps_ids_and_refuses_to_go_back,
    trim_before_removes_only_older_entries,
    oldest_pending_follows_acks,
);

#[tokio::test]
async fn unreachable_redis_is_a_clear_error() {
    let err = match rlstream::bus::RedisBus::connect("redis://127.0.0.1:1").await {
        Ok(_) => panic!("connected to a closed port"),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(
        msg.contains("cannot reach Redis at redis://127.0.0.1:1"),
        "{msg}"
    );
    assert!(err.is_retryable());
}

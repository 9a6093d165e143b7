//! `rlstream feed --reoffer` on a real Redis, against a stand-in generator and scorer: the
//! feed paces itself, feeds prompts solved half the time again far more often than those
//! always or never solved, and a feed stopped and started again continues its schedule
//! (its new prompts pick up where the first run's stopped).

use crate::common::{drop_namespace, interrupt, on_bus, redis_bus, redis_url, spawn, unique_ns};
use bytes::Bytes;
use rlstream::bus::{GroupStart, ReadFrom, SharedBus, Topology};
use rlstream::schema::{self, Event, Prompt, PromptOutcome};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Prompts of the feed.
const COUNT: u64 = 40;

/// How prompt `id` (`add-000042`) fares: 0, 4 or 8 passes of 8 by its number mod 3.
fn passes(id: &str) -> u32 {
    let n: u32 = id
        .rsplit('-')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (n % 3) * 4
}

/// Stands in for the generators and scorers: takes prompts through the `gen` group, acks
/// them and publishes an outcomes event for each, until `limit` prompts were taken or
/// none is left once `until` says stop; returns the prompt ids taken, in order.
async fn consume(
    bus: &SharedBus,
    topo: &Topology,
    limit: usize,
    mut until: impl FnMut() -> bool,
) -> Vec<String> {
    let (prompts, events) = (topo.key("prompts"), topo.key("events"));
    bus.create_group(&prompts, "gen", GroupStart::Beginning)
        .await
        .unwrap();
    let mut taken = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while taken.len() < limit {
        assert!(Instant::now() < deadline, "the feed stalled at {taken:?}");
        let stop = until();
        let got = bus
            .read_group(
                &prompts,
                "gen",
                "g0",
                ReadFrom::New,
                4,
                Some(Duration::from_millis(100)),
            )
            .await
            .unwrap();
        if got.is_empty() && stop {
            break;
        }
        let mut outcomes = Vec::new();
        for e in &got {
            let p: Prompt = schema::decode(&e.payload).unwrap();
            outcomes.push(PromptOutcome {
                passed: passes(&p.prompt_id),
                samples: 8,
                prompt_id: p.prompt_id.clone(),
            });
            taken.push(p.prompt_id);
        }
        let ids: Vec<_> = got.iter().map(|e| e.id).collect();
        bus.ack(&prompts, "gen", &ids).await.unwrap();
        if !outcomes.is_empty() {
            let event = Event::outcomes("score", "score-0", outcomes);
            let bytes = Bytes::from(schema::encode(&event).unwrap());
            bus.publish(&events, &[bytes], None).await.unwrap();
        }
    }
    taken
}

/// `fed N prompts to ..., K of them fed again by difficulty` → (N, K).
fn fed(stdout: &[u8]) -> (u64, u64) {
    let out = String::from_utf8_lossy(stdout);
    let words: Vec<&str> = out.split_whitespace().collect();
    let n = words[1].parse().unwrap_or_else(|_| panic!("{out}"));
    let again = words
        .iter()
        .position(|w| *w == "of")
        .and_then(|i| words[i - 1].trim_start_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    (n, again)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reoffers_half_solved_prompts_and_resumes_its_schedule() {
    let ns = unique_ns("difficulty-feed");
    let url = redis_url();
    let topo = Topology::default().with_namespace(&ns).unwrap();
    let bus = redis_bus().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("feed.log");
    let count = COUNT.to_string();
    let args = on_bus(
        &[
            "feed",
            "--task",
            "add",
            "--count",
            &count,
            "--reoffer",
            "0.5",
            "--backlog",
            "4",
        ],
        &url,
        &ns,
    );
    // First run: stopped after 20 prompts.
    let feed = spawn(&args, &log);
    let first = consume(&bus, &topo, 20, || false).await;
    let out = interrupt(feed, "feed", &log);
    let (n1, again1) = fed(&out.stdout);
    // Second run: until the feed has fed its new prompts and stopped.
    let second_run = {
        let (args, log) = (args.clone(), log.clone());
        tokio::task::spawn_blocking(move || {
            let err = std::fs::File::create(log).unwrap();
            crate::common::bin()
                .args(&args)
                .stderr(err)
                .output()
                .unwrap()
        })
    };
    let second = consume(&bus, &topo, usize::MAX, || second_run.is_finished()).await;
    let out = second_run.await.unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(out.status.success(), "{logged}");
    let (n2, again2) = fed(&out.stdout);
    let all: Vec<&String> = first.iter().chain(&second).collect();
    let distinct: BTreeSet<&String> = all.iter().copied().collect();
    assert_eq!(
        distinct.len() as u64,
        COUNT,
        "every new prompt fed: {all:?}"
    );
    assert_eq!(n1 + n2, all.len() as u64, "{n1} + {n2}: {all:?}");
    // Each new prompt was fed once over both runs: the second resumed the schedule.
    assert_eq!(
        n1 - again1 + n2 - again2,
        COUNT,
        "{n1} {again1} {n2} {again2}"
    );
    let mut times = BTreeMap::<u32, u32>::new();
    for id in &all {
        *times.entry(passes(id)).or_default() += 1;
    }
    let again = all.len() - distinct.len();
    assert!(
        again >= 10,
        "about half of what is fed is fed again: {all:?}"
    );
    let (never, half, always) = (times[&0], times[&4], times[&8]);
    assert!(
        half > never + always,
        "half-solved prompts come back most: {times:?} {all:?}"
    );
    assert!(
        bus.get_blobs(&[topo.key("feed:difficulty")]).await.unwrap()[0].is_some(),
        "the schedule is kept on the bus"
    );
    drop_namespace(&ns).await;
}

//! The trainer resumes from its checkpoint: version and optimizer state continue, acked
//! groups are not read again, and nothing is trained twice.

use bytes::Bytes;
use rlstream::bus::{MemoryBus, SharedBus, Topology};
use rlstream::config::TrainConfig;
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{self, ScoredGroup};
use rlstream::stages::train;
use rlstream::stages::train::TrainerSettings;
use rlstream::weights::Transport;
use std::sync::Arc;

/// The versions on the weights stream, in order.
async fn announced_versions(bus: &SharedBus, topo: &Topology) -> Vec<u64> {
    bus.range(
        &topo.key("weights"),
        rlstream::bus::RangeBound::Open,
        rlstream::bus::RangeBound::Open,
        100,
    )
    .await
    .unwrap()
    .iter()
    .map(|e| {
        schema::decode::<schema::WeightsAnnounce>(&e.payload)
            .unwrap()
            .version
    })
    .collect()
}

fn scored(model: &Policy<InferBackend>, i: u64) -> ScoredGroup {
    let rewards: Vec<f32> = (0..4).map(|k| ((i + k) % 2) as f32).collect();
    crate::common::sampled_group(
        model,
        &format!("g{i}"),
        vec![(i % 20) as u32 + 1, 3],
        4,
        i,
        rewards,
    )
}

/// Scored groups `ids`, encoded.
fn groups(model: &Policy<InferBackend>, ids: std::ops::Range<u64>) -> Vec<Bytes> {
    ids.map(|i| Bytes::from(schema::encode(&scored(model, i)).unwrap()))
        .collect()
}

/// An embedded bus (50 ms reads) with `payloads` on its scored stream.
async fn bus_with(payloads: &[Bytes]) -> (SharedBus, Topology) {
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology {
        block_ms: 50,
        ..Topology::default()
    };
    bus.publish(&topo.key("scored"), payloads, None)
        .await
        .unwrap();
    (bus, topo)
}

/// [`small_trainer`](crate::common::small_trainer) with the lag unbounded for the test's
/// groups.
fn settings(dir: &std::path::Path, steps: u64, checkpoint_every: u64) -> TrainerSettings {
    let mut tc = crate::common::small_trainer(dir, steps, checkpoint_every);
    tc.policy.max_lag = 100;
    tc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_from_checkpoint_without_training_twice() {
    let dir = tempfile::tempdir().unwrap();
    let model = crate::common::tiny_llama(dir.path(), 4);
    // Group 5 is published twice (an upstream retry): it must be trained once.
    let mut payloads = groups(&model, 0..12);
    payloads.insert(7, payloads[5].clone());
    let (bus, topo) = bus_with(&payloads).await;

    let tc = crate::common::small_trainer(dir.path(), 2, 1);
    let never = std::future::pending::<()>();
    let first = crate::common::train_alone(&tc, (bus.clone(), &topo), Transport::Bus, never)
        .await
        .unwrap();
    assert_eq!(
        (first.steps, first.version, first.trained_groups),
        (2, 2, 8)
    );
    assert_eq!(first.dropped.get("duplicate"), Some(&1));
    let weights_v2 = train::Trainer::start(&tc).unwrap().weights_blob().unwrap();

    // A restart continues at version 2 and trains the remaining 4 groups.
    let again = TrainerSettings {
        train: TrainConfig {
            steps: 3,
            ..tc.train.clone()
        },
        ..tc.clone()
    };
    let second = crate::common::train_alone(
        &again,
        (bus.clone(), &topo),
        Transport::Bus,
        std::future::pending::<()>(),
    )
    .await
    .unwrap();
    assert_eq!(
        (second.steps, second.version, second.trained_groups),
        (3, 3, 12)
    );
    assert_eq!(second.history.len(), 1, "only the new step ran");
    // On resume the checkpoint's weights are published again, so generators catch up.
    let announced = announced_versions(&bus, &topo).await;
    assert_eq!(announced, vec![1, 2, 2, 3]);
    let resumed = train::Trainer::start(&again).unwrap();
    assert_ne!(
        resumed.weights_blob().unwrap(),
        weights_v2,
        "step 3 changed the weights"
    );
    let trained: Vec<&String> = resumed.state.recent_groups.iter().collect();
    let unique: std::collections::HashSet<&&String> = trained.iter().collect();
    assert_eq!((trained.len(), unique.len()), (12, 12), "{trained:?}");
    assert_eq!(
        bus.stats(&topo.key("scored")).await.unwrap().groups[0].pending,
        0,
        "all acked after the checkpoints"
    );
}

/// A trainer that died after publishing versions past its last checkpoint resumes above
/// them: versions on the weights stream never go backwards, and the lost steps' groups are
/// trained again in the surviving line (they were never acked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_continue_above_what_a_crashed_trainer_published() {
    let dir = tempfile::tempdir().unwrap();
    let model = crate::common::tiny_llama(dir.path(), 4);
    let payloads = groups(&model, 0..16);
    let (bus, topo) = bus_with(&payloads).await;
    let tc = settings(dir.path(), 3, 2);
    let never = || std::future::pending::<()>();
    crate::common::train_alone(&tc, (bus.clone(), &topo), Transport::Bus, never())
        .await
        .unwrap();
    // The crash: step 3 was published, but its checkpoint never happened.
    let ckpt = dir.path().join("ckpt");
    std::fs::remove_dir_all(ckpt.join("step-00000003")).unwrap();
    std::fs::write(ckpt.join("latest"), "step-00000002").unwrap();
    let scored_key = topo.key("scored");
    let stats = bus.stats(&scored_key).await.unwrap();
    assert_eq!(stats.groups[0].pending, 0);

    // Step 3's groups were acked by the clean stop above; a crash would have left them
    // unacked. Offer them again (same group ids): the resumed trainer must train them.
    bus.publish(&scored_key, &payloads[8..12], None)
        .await
        .unwrap();
    let again = TrainerSettings {
        train: TrainConfig {
            steps: 4,
            ..tc.train.clone()
        },
        ..tc.clone()
    };
    let resumed = crate::common::train_alone(&again, (bus.clone(), &topo), Transport::Bus, never())
        .await
        .unwrap();
    let announced = announced_versions(&bus, &topo).await;
    assert!(
        announced.windows(2).all(|w| w[1] >= w[0]),
        "versions went backwards: {announced:?}"
    );
    // 1, 2, 3 from the first run; the resumed checkpoint (step 2) republished as 4, then
    // steps 3 and 4 of the surviving line as 5 and 6.
    assert_eq!(announced, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!((resumed.steps, resumed.version), (4, 6));
}

/// When Redis lost the weights stream, generators' heartbeats still say what they hold: a
/// trainer that starts below that version numbers on above it, so the generators take its
/// weights instead of ignoring them as older.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_continue_above_what_generators_hold_when_the_announces_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let model = crate::common::tiny_llama(dir.path(), 4);
    let (bus, topo) = bus_with(&groups(&model, 0..4)).await;
    let beat = schema::Event::new("heartbeat", "gen", "gen-0", 5);
    bus.publish(
        &topo.key("events"),
        &[Bytes::from(schema::encode(&beat).unwrap())],
        None,
    )
    .await
    .unwrap();
    let tc = settings(dir.path(), 1, TrainConfig::default().checkpoint_every);
    let never = std::future::pending::<()>();
    let summary = crate::common::train_alone(&tc, (bus.clone(), &topo), Transport::Bus, never)
        .await
        .unwrap();
    // The fresh model announced as 6, above the generators' 5, then the step as 7.
    assert_eq!(announced_versions(&bus, &topo).await, vec![6, 7]);
    assert_eq!(summary.version, 7);
}

//! Weight handoff from trainer to generator, through the bus (serialized, checksummed
//! chunks) and in process (host tensors by reference): a new version is swapped in, a
//! corrupt one is rejected and the generator keeps its weights.

use bytes::Bytes;
use rlstream::bus::{EntryId, MemoryBus, SharedBus, Topology};
use rlstream::commands::sft::task_config;
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{self, WeightsAnnounce};
use rlstream::weights::{
    Follower, IN_PROCESS_FORMAT, LocalWeights, ModelSlot, Payload, Publisher, Transport, Versioned,
};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_millis(200);

fn policy(seed: u64) -> Policy<InferBackend> {
    Policy::random(&task_config(16, 1, 0), seed, &Default::default()).unwrap()
}

fn fresh_slot() -> ModelSlot<InferBackend> {
    ModelSlot::new(Versioned {
        version: 0,
        policy: policy(0),
    })
}

fn follower(
    bus: &SharedBus,
    slot: &ModelSlot<InferBackend>,
    t: Transport,
) -> Follower<InferBackend> {
    Follower::new(
        bus.clone(),
        Topology::default(),
        task_config(16, 1, 0),
        slot.clone(),
    )
    .with_transport(t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bus_transport_swaps_a_good_version_and_rejects_a_corrupt_one() {
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology::default();
    let slot = fresh_slot();
    let mut f = follower(&bus, &slot, Transport::Bus);
    let mut publisher = Publisher::new(bus.clone(), topo.clone(), 2).with_chunk_bytes(4096);
    let v1 = policy(1);
    let a = publisher
        .publish(1, 1, &v1.to_bytes().unwrap())
        .await
        .unwrap();
    assert!(a.chunks > 1);
    assert_eq!(f.poll(WAIT).await.unwrap(), Some(1));
    assert_eq!(
        slot.load().policy.to_tensors().unwrap(),
        v1.to_tensors().unwrap()
    );

    // Version 2 with one chunk overwritten after the announce: checksum mismatch.
    publisher
        .publish(2, 2, &policy(2).to_bytes().unwrap())
        .await
        .unwrap();
    bus.put_blobs(&[(topo.weights_chunk_key(2, 0), Bytes::from(vec![0u8; 4096]))])
        .await
        .unwrap();
    assert_eq!(f.poll(WAIT).await.unwrap(), None);
    assert_eq!(f.rejected, 1);
    assert_eq!(slot.load().version, 1);
    assert_eq!(
        slot.load().policy.to_tensors().unwrap(),
        v1.to_tensors().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_transport_hands_over_tensors_under_the_same_protocol() {
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology::default();
    let local = LocalWeights::default();
    let slot = fresh_slot();
    let mut f = follower(&bus, &slot, Transport::InProcess(local.clone()));
    let mut publisher =
        Publisher::new(bus.clone(), topo.clone(), 2).with_transport(Transport::InProcess(local));
    assert!(publisher.in_process());
    let v1 = policy(1);
    let a = publisher
        .publish_payload(1, 1, Payload::Tensors(v1.to_tensors().unwrap()))
        .await
        .unwrap();
    assert_eq!(a.format, IN_PROCESS_FORMAT);
    // The announce is a valid message on the weights stream, like any other version.
    let entries = bus
        .read_after(&topo.key("weights"), EntryId::ZERO, 10, None)
        .await
        .unwrap();
    let on_stream: WeightsAnnounce = schema::decode(&entries[0].payload).unwrap();
    assert_eq!(on_stream, a);
    // No blob was written.
    assert_eq!(
        bus.get_blobs(&[topo.weights_chunk_key(1, 0)])
            .await
            .unwrap(),
        vec![None]
    );
    assert_eq!(f.poll(WAIT).await.unwrap(), Some(1));
    assert_eq!(
        slot.load().policy.to_tensors().unwrap(),
        v1.to_tensors().unwrap()
    );

    // An announce whose checksum does not match the tensors handed over is rejected.
    publisher
        .publish_payload(2, 2, Payload::Tensors(policy(2).to_tensors().unwrap()))
        .await
        .unwrap();
    let mut forged = a.clone();
    forged.version = 3;
    forged.step = 3;
    publisher
        .publish_payload(3, 3, Payload::Tensors(policy(3).to_tensors().unwrap()))
        .await
        .unwrap();
    // Re-announce version 3 with version 1's checksum: the follower reads the newest.
    bus.publish(
        &topo.key("weights"),
        &[Bytes::from(schema::encode(&forged).unwrap())],
        None,
    )
    .await
    .unwrap();
    assert_eq!(f.poll(WAIT).await.unwrap(), None);
    assert_eq!(f.rejected, 1);
    assert_eq!(slot.load().version, 1);

    // A follower in another process (bus transport) cannot read in-process versions: it
    // says so and keeps its weights.
    let other_slot = fresh_slot();
    let mut other = follower(&bus, &other_slot, Transport::Bus);
    assert_eq!(other.poll(WAIT).await.unwrap(), None);
    assert_eq!(other.rejected, 1);
    assert_eq!(other_slot.load().version, 0);
}

/// A version with a valid checksum but the wrong shapes (a model of another width), and an
/// announce that claims an impossible size: both rejected, the generator keeps version 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_shapes_and_implausible_announces_are_rejected() {
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let topo = Topology::default();
    let slot = fresh_slot();
    let mut f = follower(&bus, &slot, Transport::Bus);
    let mut publisher = Publisher::new(bus.clone(), topo.clone(), 4);
    let v1 = policy(1);
    publisher
        .publish(1, 1, &v1.to_bytes().unwrap())
        .await
        .unwrap();
    assert_eq!(f.poll(WAIT).await.unwrap(), Some(1));

    let wider =
        Policy::<InferBackend>::random(&task_config(32, 1, 0), 2, &Default::default()).unwrap();
    publisher
        .publish(2, 2, &wider.to_bytes().unwrap())
        .await
        .unwrap();
    assert_eq!(f.poll(WAIT).await.unwrap(), None);
    assert_eq!(f.rejected, 1);

    let mut huge = rlstream::schema::examples::weights_announce_v1();
    huge.schema = rlstream::schema::examples::weights_announce().schema;
    huge.version = 3;
    huge.format = "safetensors-f32".into();
    huge.bytes = u64::MAX;
    huge.chunks = u32::MAX;
    bus.publish(
        &topo.key("weights"),
        &[Bytes::from(schema::encode(&huge).unwrap())],
        None,
    )
    .await
    .unwrap();
    assert_eq!(f.poll(WAIT).await.unwrap(), None);
    assert_eq!(f.rejected, 2);
    assert_eq!(slot.load().version, 1);
    assert_eq!(
        slot.load().policy.to_tensors().unwrap(),
        v1.to_tensors().unwrap()
    );
    let err = rlstream::weights::fetch(&bus, &topo, &huge)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("which no real model has"), "{err}");
}

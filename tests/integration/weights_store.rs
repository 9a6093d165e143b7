//! Weights through the stores on a real Redis: bf16 on the wire, delta versions with
//! keyframes, the shared-directory store, the bound on what the store holds, and every way
//! a version can fail to arrive (a corrupt delta, a missing base, a store that fills up or
//! disappears, a trainer killed halfway through writing). In each, no generator swaps in
//! weights that do not match their announce, and after a swap the generator samples with
//! exactly the announced weights.

use bytes::Bytes;
use rlstream::bus::{RangeBound, RedisBus, SharedBus, Topology};
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::tensors::{TensorMap, WeightDtype, tensors_to_safetensors_as};
use rlstream::model::{Architecture, InferBackend, ModelConfig, Policy};
use rlstream::schema::{self, WeightsAnnounce};
use rlstream::weights::{
    BlobStore, DirStore, Follower, ModelSlot, PublishDtype, Publisher, StoreKind, Transport,
    Versioned, WeightsConfig, WeightsError,
};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const WAIT: Duration = Duration::from_millis(100);

fn model_config() -> ModelConfig {
    ModelConfig::tiny(Architecture::Qwen2, 32)
}

async fn redis(ns: &str) -> (SharedBus, Topology) {
    let bus: SharedBus = Arc::new(
        RedisBus::connect(&crate::common::redis_url())
            .await
            .unwrap(),
    );
    let topo = Topology::default().with_namespace(ns).unwrap();
    (bus, topo)
}

fn settings(store: StoreKind, dir: &Path) -> WeightsConfig {
    WeightsConfig {
        store,
        store_dir: Some(dir.to_path_buf()),
        wire_dtype: PublishDtype::Bf16,
        keyframe_every: 3,
        chunk_bytes: 4096,
        ..WeightsConfig::default()
    }
}

/// Version `v` of a slowly trained model: each version nudges every value by a relative
/// 1e-3 step, so most bf16 values stay bit-identical from one version to the next.
fn version_tensors(v: u64) -> TensorMap {
    let mut t = Policy::<InferBackend>::random(&model_config(), 7, &Default::default())
        .unwrap()
        .to_tensors()
        .unwrap();
    for (i, h) in t.values_mut().enumerate() {
        for (j, x) in h.data.iter_mut().enumerate() {
            let wiggle = ((i * 31 + j * 17) as f32 * 0.618).sin();
            *x *= 1.0 + 1e-3 * v as f32 * wiggle;
        }
    }
    t
}

/// The bytes a generator must end up with for version `v`.
fn wire(v: u64) -> Vec<u8> {
    tensors_to_safetensors_as(&version_tensors(v), WeightDtype::Bf16).unwrap()
}

fn follower(
    bus: &SharedBus,
    topo: &Topology,
    cfg: &WeightsConfig,
) -> (Follower<InferBackend>, ModelSlot<InferBackend>) {
    let slot = ModelSlot::new(Versioned {
        version: 0,
        policy: Policy::random(&model_config(), 0, &Default::default()).unwrap(),
    });
    let f = Follower::new(bus.clone(), topo.clone(), model_config(), slot.clone())
        .with_transport(Transport::Store(cfg.clone()));
    (f, slot)
}

async fn publisher(
    bus: &SharedBus,
    topo: &Topology,
    cfg: &WeightsConfig,
    keep: usize,
) -> Publisher {
    let mut p = Publisher::new(bus.clone(), topo.clone(), keep)
        .with_config(cfg, WeightDtype::Bf16)
        .unwrap();
    p.adopt().await.unwrap();
    p
}

/// Polls until the follower reports nothing new.
async fn settle(f: &mut Follower<InferBackend>) -> Option<u64> {
    let mut last = None;
    while let Some(v) = f.poll(WAIT).await.unwrap() {
        last = Some(v);
    }
    last
}

fn holds(slot: &ModelSlot<InferBackend>, v: u64) {
    let got = slot.load();
    assert_eq!(got.version, v);
    let want =
        Policy::<InferBackend>::from_bytes(&model_config(), &wire(v), &Default::default()).unwrap();
    assert_eq!(
        got.policy.to_tensors().unwrap(),
        want.to_tensors().unwrap(),
        "version {v}: the weights are not the announced ones"
    );
}

/// Samples from the generator's model and checks each behaviour log-prob against the
/// teacher-forced log-prob under the announced weights of version `v`.
fn samples_under_announced_weights(slot: &ModelSlot<InferBackend>, v: u64) {
    let held = slot.load();
    let g = crate::common::sampled_group(
        &held.policy,
        "g",
        vec![3, 5, 7],
        8,
        v,
        vec![1.0, 0.0, 0.5, 0.25],
    );
    let announced =
        Policy::<InferBackend>::from_bytes(&model_config(), &wire(v), &Default::default()).unwrap();
    let lp = crate::common::teacher_forced(&announced, &g);
    let mut checked = 0;
    for (r, s) in g.rollout.samples.iter().enumerate() {
        for (j, &behaviour) in s.logprobs.iter().enumerate() {
            let teacher = lp[r][j];
            assert!(
                (behaviour - teacher).abs() < 1e-4,
                "version {v}, sample {r}, token {j}: sampled with log-prob {behaviour}, announced weights give {teacher}"
            );
            checked += 1;
        }
    }
    assert!(checked > 8, "only {checked} tokens checked");
}

async fn announces(bus: &SharedBus, topo: &Topology) -> Vec<WeightsAnnounce> {
    bus.range(
        &topo.key("weights"),
        RangeBound::Open,
        RangeBound::Open,
        1000,
    )
    .await
    .unwrap()
    .iter()
    .map(|e| schema::decode(&e.payload).unwrap())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_reach_steady_lagging_and_late_generators_through_each_store() {
    for store in [StoreKind::Redis, StoreKind::Dir] {
        let dir = tempfile::tempdir().unwrap();
        let ns = crate::common::unique_ns("wdelta");
        let (bus, topo) = redis(&ns).await;
        let cfg = settings(store, dir.path());
        let mut p = publisher(&bus, &topo, &cfg, 2).await;
        let (mut steady, steady_slot) = follower(&bus, &topo, &cfg);
        let (mut lagging, lagging_slot) = follower(&bus, &topo, &cfg);
        for v in 1..=7 {
            let a = p.publish(v, v, &wire(v)).await.unwrap();
            assert_eq!(a.dtype, "bf16");
            assert_eq!(a.store, store.as_str());
            assert_eq!(settle(&mut steady).await, Some(v), "{store:?}");
            holds(&steady_slot, v);
            if v == 1 {
                assert_eq!(settle(&mut lagging).await, Some(1));
            }
        }
        let all = announces(&bus, &topo).await;
        let kinds: Vec<Option<u64>> = all.iter().map(|a| a.base).collect();
        assert_eq!(
            kinds,
            vec![None, Some(1), Some(2), None, Some(4), Some(5), None],
            "{store:?}: a keyframe every 3 versions, deltas between"
        );
        for a in all.iter().filter(|a| a.is_delta()) {
            assert!(
                a.object_bytes() * 4 < a.bytes,
                "{store:?}: version {} delta of {} bytes for a {}-byte version",
                a.version,
                a.object_bytes(),
                a.bytes
            );
        }
        // Lagging: held 1, missed 2..=6; late: held nothing. Both take the newest.
        let v8 = p.publish(8, 8, &wire(8)).await.unwrap();
        assert_eq!(v8.base, Some(7));
        assert_eq!(settle(&mut lagging).await, Some(8));
        holds(&lagging_slot, 8);
        let (mut late, late_slot) = follower(&bus, &topo, &cfg);
        assert_eq!(settle(&mut late).await, Some(8));
        holds(&late_slot, 8);
        assert_eq!(settle(&mut steady).await, Some(8));
        for f in [&steady, &lagging, &late] {
            assert_eq!(f.rejected, 0);
        }
        samples_under_announced_weights(&late_slot, 8);
        // keep = 2: versions 7 and 8 and their chain (keyframe 7) are all that is held.
        assert_eq!(p.held_bytes(), all[6].bytes + v8.object_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_delta_is_rejected_and_the_next_version_is_a_keyframe() {
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("wcorrupt");
    let (bus, topo) = redis(&ns).await;
    let cfg = WeightsConfig {
        keyframe_every: 100,
        ..settings(StoreKind::Redis, dir.path())
    };
    let mut p = publisher(&bus, &topo, &cfg, 3).await;
    let (mut f, slot) = follower(&bus, &topo, &cfg);
    p.publish(1, 1, &wire(1)).await.unwrap();
    assert_eq!(settle(&mut f).await, Some(1));

    // The stored delta of version 2 is overwritten after its announce.
    let a2 = p.publish(2, 2, &wire(2)).await.unwrap();
    assert!(a2.is_delta());
    bus.put_blobs(&[(topo.weights_chunk_key(2, 0), Bytes::from(vec![7u8; 64]))])
        .await
        .unwrap();
    assert_eq!(settle(&mut f).await, None);
    assert_eq!(f.rejected, 1);
    holds(&slot, 1);
    let a3 = p.publish(3, 3, &wire(3)).await.unwrap();
    assert_eq!(a3.base, None, "the generator asked for a keyframe");
    assert_eq!(settle(&mut f).await, Some(3));
    holds(&slot, 3);

    // A delta whose own bytes are intact but assemble to other weights than announced:
    // version 4's delta re-announced as version 5 on top of 4 gives version 3's bytes back.
    let a4 = p.publish(4, 4, &wire(4)).await.unwrap();
    assert!(a4.is_delta());
    assert_eq!(settle(&mut f).await, Some(4));
    for c in 0..a4.chunks {
        let chunk = bus
            .get_blobs(&[topo.weights_chunk_key(4, c)])
            .await
            .unwrap()
            .remove(0)
            .unwrap();
        bus.put_blobs(&[(topo.weights_chunk_key(5, c), chunk)])
            .await
            .unwrap();
    }
    let forged = WeightsAnnounce {
        version: 5,
        step: 5,
        base: Some(4),
        ..a4.clone()
    };
    bus.publish(
        &topo.key("weights"),
        &[Bytes::from(schema::encode(&forged).unwrap())],
        None,
    )
    .await
    .unwrap();
    assert_eq!(settle(&mut f).await, None);
    assert_eq!(
        f.rejected, 2,
        "assembled bytes fail the whole-version checksum"
    );
    holds(&slot, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_base_or_a_deleted_keyframe_asks_for_a_keyframe() {
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("wbase");
    let (bus, topo) = redis(&ns).await;
    let cfg = WeightsConfig {
        keyframe_every: 100,
        ..settings(StoreKind::Dir, dir.path())
    };
    let mut p = publisher(&bus, &topo, &cfg, 3).await;
    p.publish(1, 1, &wire(1)).await.unwrap();
    p.publish(2, 2, &wire(2)).await.unwrap();
    // The weights stream lost the keyframe's announce (trimmed): a generator joining now
    // sees only a delta whose base it cannot know.
    let all = bus
        .range(&topo.key("weights"), RangeBound::Open, RangeBound::Open, 10)
        .await
        .unwrap();
    bus.trim_before(&topo.key("weights"), all[1].id)
        .await
        .unwrap();
    let (mut f, slot) = follower(&bus, &topo, &cfg);
    assert_eq!(settle(&mut f).await, None);
    assert_eq!(f.rejected, 0, "nothing corrupt was offered");
    assert_eq!(slot.load().version, 0);
    let a3 = p.publish(3, 3, &wire(3)).await.unwrap();
    assert_eq!(a3.base, None);
    assert_eq!(settle(&mut f).await, Some(3));
    holds(&slot, 3);

    // The keyframe's file is deleted under a generator that joins late: it cannot
    // assemble version 4, asks, and takes the keyframe that follows.
    p.publish(4, 4, &wire(4)).await.unwrap();
    std::fs::remove_file(DirStore::new(dir.path(), &ns, 1).path(3)).unwrap();
    let (mut late, late_slot) = follower(&bus, &topo, &cfg);
    assert_eq!(settle(&mut late).await, None);
    assert_eq!(late_slot.load().version, 0);
    assert_eq!(p.publish(5, 5, &wire(5)).await.unwrap().base, None);
    assert_eq!(settle(&mut late).await, Some(5));
    holds(&late_slot, 5);
    samples_under_announced_weights(&late_slot, 5);
}

/// A store that fails writes with EFBIG once `budget` bytes are written, like a filesystem
/// under `ulimit -f` or a full quota.
struct Filling {
    inner: Arc<dyn BlobStore>,
    budget: AtomicU64,
}

#[async_trait::async_trait]
impl BlobStore for Filling {
    fn kind(&self) -> StoreKind {
        self.inner.kind()
    }
    async fn put(&self, version: u64, bytes: Arc<Vec<u8>>) -> Result<u32, WeightsError> {
        let n = bytes.len() as u64;
        if self.budget.load(Ordering::SeqCst) < n {
            return Err(WeightsError::Store {
                store: "dir",
                reason: format!(
                    "cannot write v{version}: {}",
                    std::io::Error::from_raw_os_error(27)
                ),
            });
        }
        self.budget.fetch_sub(n, Ordering::SeqCst);
        self.inner.put(version, bytes).await
    }
    async fn get(&self, version: u64, chunks: u32) -> Result<Vec<u8>, WeightsError> {
        self.inner.get(version, chunks).await
    }
    async fn remove(&self, version: u64, chunks: u32) -> Result<(), WeightsError> {
        self.inner.remove(version, chunks).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_fills_up_or_disappears_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("wfull");
    let (bus, topo) = redis(&ns).await;
    let root = dir.path().join("shared");
    std::fs::create_dir(&root).unwrap();
    let cfg = WeightsConfig {
        delta: false,
        ..settings(StoreKind::Dir, &root)
    };
    let filling = Arc::new(Filling {
        inner: Arc::new(DirStore::new(&root, &ns, 4096)),
        budget: AtomicU64::new(wire(1).len() as u64 + 10),
    });
    let mut p = publisher(&bus, &topo, &cfg, 2)
        .await
        .with_store(filling.clone());
    let (mut f, slot) = follower(&bus, &topo, &cfg);
    p.publish(1, 1, &wire(1)).await.unwrap();
    assert_eq!(settle(&mut f).await, Some(1));
    let err = p.publish(2, 2, &wire(2)).await.unwrap_err().to_string();
    assert!(err.contains("File too large"), "{err}");
    assert_eq!(
        announces(&bus, &topo).await.len(),
        1,
        "no announce without its object"
    );
    assert_eq!(settle(&mut f).await, None);
    holds(&slot, 1);
    // Space again: the same version goes out whole.
    filling.budget.store(u64::MAX / 2, Ordering::SeqCst);
    p.publish(2, 2, &wire(2)).await.unwrap();
    assert_eq!(settle(&mut f).await, Some(2));
    holds(&slot, 2);

    // The shared directory disappears (unmounted) after version 3 is announced.
    p.publish(3, 3, &wire(3)).await.unwrap();
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(settle(&mut f).await, None);
    assert_eq!(f.rejected, 0);
    holds(&slot, 2);
    let err = p.publish(4, 4, &wire(4)).await.unwrap_err().to_string();
    assert!(err.contains("is the shared filesystem mounted"), "{err}");
    std::fs::create_dir(&root).unwrap();
    p.publish(5, 5, &wire(5)).await.unwrap();
    assert_eq!(settle(&mut f).await, Some(5));
    holds(&slot, 5);
}

/// Bytes of `ns`'s weight chunks that exist in Redis for versions `1..=last`.
async fn redis_store_bytes(bus: &SharedBus, topo: &Topology, last: u64) -> u64 {
    let mut total = 0;
    for v in 1..=last {
        let keys: Vec<String> = (0..64).map(|c| topo.weights_chunk_key(v, c)).collect();
        for b in bus.get_blobs(&keys).await.unwrap().into_iter().flatten() {
            total += b.len() as u64;
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_bytes_bounds_what_the_store_holds() {
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("wbound");
    let (bus, topo) = redis(&ns).await;
    let full = wire(1).len() as u64;
    let too_small = WeightsConfig {
        max_bytes: 2 * full - 1,
        ..settings(StoreKind::Redis, dir.path())
    };
    let err = Publisher::new(bus.clone(), topo.clone(), 3)
        .with_config(&too_small, WeightDtype::Bf16)
        .unwrap()
        .check_fits(full)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{}", 2 * full - 1)) && err.contains(&format!("{}", 2 * full)),
        "{err}"
    );
    // Room for two and a half versions, keep 3: deltas until the bound, then keyframes and
    // older versions deleted. Every version still reaches the generator, published whole or
    // streamed from the trainer's tensors.
    for (delta, streamed) in [(true, false), (false, false), (true, true), (false, true)] {
        let cfg = WeightsConfig {
            max_bytes: full * 5 / 2,
            keyframe_every: 100,
            delta,
            ..settings(StoreKind::Redis, dir.path())
        };
        let topo = topo
            .clone()
            .with_namespace(&format!("{ns}-{delta}-{streamed}"))
            .unwrap();
        let mut p = publisher(&bus, &topo, &cfg, 3).await;
        let (mut f, slot) = follower(&bus, &topo, &cfg);
        let mut deltas = 0;
        for v in 1..=8 {
            let a = if streamed {
                let t = rlstream::weights::Payload::Tensors(version_tensors(v));
                p.publish_payload(v, v, t).await.unwrap()
            } else {
                p.publish(v, v, &wire(v)).await.unwrap()
            };
            deltas += usize::from(a.is_delta());
            let held = p.held_bytes();
            assert!(held <= cfg.max_bytes, "v{v}: {held} > {}", cfg.max_bytes);
            assert_eq!(redis_store_bytes(&bus, &topo, v).await, held, "v{v}");
            assert_eq!(settle(&mut f).await, Some(v));
            holds(&slot, v);
        }
        assert_eq!(deltas > 0, delta, "delta {delta}, streamed {streamed}");
    }
}

/// `rlstream train` killed (abort) after a fixed number of weight chunks, halfway through
/// its second version, then restarted: generators only ever see whole, verified versions,
/// and the restarted trainer's versions arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_killed_halfway_through_a_version_leaves_nothing_wrong() {
    for store in [StoreKind::Redis, StoreKind::Dir] {
        let dir = tempfile::tempdir().unwrap();
        let ns = crate::common::unique_ns("wkill");
        let (bus, topo) = redis(&ns).await;
        let model =
            Policy::<InferBackend>::random(&model_config(), 4, &Default::default()).unwrap();
        let model_dir = dir.path().join("model");
        model.save_hf(&model_dir).unwrap();
        let payloads: Vec<Bytes> = (0..16)
            .map(|i| {
                let g = crate::common::sampled_group(
                    &model,
                    &format!("g{i}"),
                    vec![(i % 20) + 1, 3],
                    4,
                    u64::from(i),
                    (0..4).map(|k| ((i + k) % 2) as f32).collect(),
                );
                Bytes::from(schema::encode(&g).unwrap())
            })
            .collect();
        bus.publish(&topo.key("scored"), &payloads, None)
            .await
            .unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        let per_version = model.to_bytes().unwrap().len().div_ceil(4096);
        let abort_after = (per_version + per_version / 2).to_string();
        let train = |steps: &str, fault: Option<&str>| {
            let mut cmd = crate::common::bin();
            cmd.args([
                "train",
                "--redis",
                &crate::common::redis_url(),
                "--namespace",
                &ns,
                "--model",
                model_dir.to_str().unwrap(),
                "--steps",
                steps,
                "--groups-per-step",
                "4",
                "--max-lag",
                "1000",
                "--checkpoint-dir",
                dir.path().join("ckpt").to_str().unwrap(),
                "--store",
                store.as_str(),
                "--store-dir",
                shared.to_str().unwrap(),
                "--delta",
                "false",
                "--chunk-bytes",
                "4096",
            ]);
            if let Some(n) = fault {
                cmd.env(rlstream::weights::store::FAULT_EXIT_ENV, n);
            }
            cmd.output().unwrap()
        };
        let out = train("2", Some(&abort_after));
        assert!(
            !out.status.success(),
            "{store:?}: the trainer was to die: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cfg = WeightsConfig {
            store,
            store_dir: Some(shared.clone()),
            ..WeightsConfig::default()
        };
        let seen: Vec<u64> = announces(&bus, &topo)
            .await
            .iter()
            .map(|a| a.version)
            .collect();
        assert_eq!(seen, vec![1], "{store:?}: version 2 was never announced");
        let (mut f, slot) = follower(&bus, &topo, &cfg);
        assert_eq!(settle(&mut f).await, Some(1));
        assert_eq!(f.rejected, 0);
        if store == StoreKind::Dir {
            let partial = std::fs::read_dir(shared.join(&ns))
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .ends_with(".partial")
                })
                .count();
            assert_eq!(partial, 1, "the half-written version is a temporary file");
        }
        let out = train("2", None);
        assert!(
            out.status.success(),
            "{store:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let newest = announces(&bus, &topo).await.last().unwrap().version;
        assert!(newest > 2, "{store:?}: versions go on after the restart");
        assert_eq!(settle(&mut f).await, Some(newest));
        assert_eq!(f.rejected, 0);
        // The generator holds the trainer's final weights (f32 on the wire: the model's
        // config.json says float32), as its last checkpoint saved them.
        let ckpt = dir.path().join("ckpt");
        let name = std::fs::read_to_string(ckpt.join("latest")).unwrap();
        let saved = rlstream::model::hf::load_hf::<InferBackend>(
            &ckpt.join(name.trim()),
            &Default::default(),
        )
        .unwrap();
        assert_eq!(
            slot.load().policy.to_tensors().unwrap(),
            saved.to_tensors().unwrap()
        );
        if store == StoreKind::Dir {
            let left: Vec<String> = std::fs::read_dir(shared.join(&ns))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert!(
                left.iter().all(|n| !n.ends_with(".partial")),
                "the restarted trainer removed the partial file: {left:?}"
            );
        }
    }
}

/// A trainer started from a bf16 checkpoint publishes bf16 (its config.json says so) while
/// it trains in f32; the generator holds exactly the bf16 rounding of the trainer's weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_checkpoint_is_published_in_bf16() {
    use rlstream::config::{PolicySettings, TrainConfig};
    use rlstream::stages::train::TrainerSettings;
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("wbf16");
    let (bus, topo) = redis(&ns).await;
    let model = Policy::<InferBackend>::random(&model_config(), 5, &Default::default()).unwrap();
    let model_dir = dir.path().join("model");
    model.save_hf_as(&model_dir, WeightDtype::Bf16).unwrap();
    let start =
        rlstream::model::hf::load_hf::<InferBackend>(&model_dir, &Default::default()).unwrap();
    let payloads: Vec<Bytes> = (0..4u32)
        .map(|i| {
            let g = crate::common::sampled_group(
                &start,
                &format!("g{i}"),
                vec![i + 1, 3],
                4,
                u64::from(i),
                vec![1.0, 0.0, 0.0, 1.0],
            );
            Bytes::from(schema::encode(&g).unwrap())
        })
        .collect();
    bus.publish(&topo.key("scored"), &payloads, None)
        .await
        .unwrap();
    let settings = TrainerSettings {
        policy: PolicySettings {
            model: Some(model_dir),
            groups_per_step: 4,
            max_lag: 1000,
            ..PolicySettings::default()
        },
        train: TrainConfig {
            steps: 1,
            lr: 1e-2,
            checkpoint_dir: dir.path().join("ckpt"),
            ..TrainConfig::default()
        },
    };
    let cfg = WeightsConfig::default();
    let done = crate::common::train_alone(
        &settings,
        (bus.clone(), &topo),
        Transport::Store(cfg.clone()),
        std::future::pending::<()>(),
    )
    .await
    .unwrap();
    assert_eq!(done.version, 1);
    let a = announces(&bus, &topo).await;
    assert_eq!(a.len(), 1);
    assert_eq!(
        (a[0].dtype.as_str(), a[0].format.as_str()),
        ("bf16", "safetensors-bf16")
    );
    let (mut f, slot) = follower(&bus, &topo, &cfg);
    assert_eq!(settle(&mut f).await, Some(1));
    // The trainer's f32 weights after its step, from its checkpoint, rounded to bf16.
    let ckpt = dir.path().join("ckpt");
    let name = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    let trained =
        rlstream::model::hf::load_hf::<InferBackend>(&ckpt.join(name.trim()), &Default::default())
            .unwrap()
            .to_tensors()
            .unwrap();
    let rounded = tensors_to_safetensors_as(&trained, WeightDtype::Bf16).unwrap();
    let want =
        Policy::<InferBackend>::from_bytes(&model_config(), &rounded, &Default::default()).unwrap();
    assert_eq!(
        slot.load().policy.to_tensors().unwrap(),
        want.to_tensors().unwrap()
    );
    assert_ne!(
        trained,
        want.to_tensors().unwrap(),
        "the trainer keeps f32 weights that bf16 does not hold"
    );
}

/// The generator's decode loop keeps sampling while the follower applies each delta in
/// place to the model the slot retired and swaps it in (published as the trainer does,
/// streamed from its tensors, through each store): every completion's tokens up to its
/// first swap match teacher forcing under the version they are tagged with, completions
/// span swaps, and after the first delta no version copies or builds a model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapping_in_place_while_decoding_keeps_every_token_on_its_version() {
    use rlstream::model::sampler::{Completion, Generator, Request};
    use rlstream::schema::SamplingParams;
    use rlstream::weights::Payload;
    use std::sync::atomic::AtomicBool;
    for store in [StoreKind::Redis, StoreKind::Dir] {
        let dir = tempfile::tempdir().unwrap();
        let ns = crate::common::unique_ns("wswap");
        let (bus, topo) = redis(&ns).await;
        let cfg = WeightsConfig {
            keyframe_every: 100,
            ..settings(store, dir.path())
        };
        let mut p = publisher(&bus, &topo, &cfg, 3).await;
        let (mut f, slot) = follower(&bus, &topo, &cfg);
        let first = p
            .publish_payload(1, 1, Payload::Tensors(version_tensors(1)))
            .await
            .unwrap();
        assert_eq!((first.base, first.dtype.as_str()), (None, "bf16"));
        assert_eq!(settle(&mut f).await, Some(1));

        let stop = Arc::new(AtomicBool::new(false));
        let steps = Arc::new(AtomicU64::new(0));
        let decode = {
            let (slot, stop, steps) = (slot.clone(), stop.clone(), steps.clone());
            std::thread::spawn(move || {
                let mut g = Generator::new();
                let mut done: Vec<(Vec<u32>, Completion)> = Vec::new();
                let mut prompts = std::collections::HashMap::new();
                let mut id = 0u64;
                while !stop.load(Ordering::SeqCst) || !g.is_idle() {
                    // One load per pass, as the decode loop does.
                    let m = slot.load();
                    if !stop.load(Ordering::SeqCst) && g.active() < 4 {
                        let prompt = vec![3, 5, 7 + (id % 11) as u32];
                        let params = SamplingParams {
                            temperature: 1.0,
                            top_k: 0,
                            top_p: 1.0,
                            max_new_tokens: 6,
                            stop_tokens: vec![],
                            seed: id,
                        };
                        let req = Request {
                            id,
                            prompt: prompt.clone(),
                            n: 2,
                            params,
                        };
                        g.admit(&m.policy, m.version, &req).unwrap();
                        prompts.insert(id, prompt);
                        id += 1;
                    }
                    for c in g.step(&m.policy, m.version).unwrap() {
                        done.push((prompts[&c.request_id].clone(), c));
                    }
                    steps.fetch_add(1, Ordering::SeqCst);
                }
                done
            })
        };
        let wait_steps = |n: u64| {
            let steps = steps.clone();
            async move {
                let from = steps.load(Ordering::SeqCst);
                while steps.load(Ordering::SeqCst) < from + n {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        for v in 2..=6 {
            wait_steps(40).await;
            let a = p
                .publish_payload(v, v, Payload::Tensors(version_tensors(v)))
                .await
                .unwrap();
            assert_eq!(a.base, Some(v - 1), "{store:?}: version {v} is a delta");
            assert_eq!(settle(&mut f).await, Some(v), "{store:?}");
            let phases: Vec<&str> = f.last_phases().iter().map(|(n, _)| *n).collect();
            if v >= 3 {
                assert!(
                    phases.contains(&"decode") && !phases.contains(&"copy"),
                    "{store:?}: version {v} was not applied in place: {phases:?}"
                );
            }
        }
        wait_steps(40).await;
        stop.store(true, Ordering::SeqCst);
        let done = decode.join().unwrap();
        assert_eq!(f.rejected, 0);
        holds(&slot, 6);

        let announced: Vec<Policy<InferBackend>> = (0..=6)
            .map(|v| {
                Policy::from_bytes(&model_config(), &wire(v.max(1)), &Default::default()).unwrap()
            })
            .collect();
        let (mut versions, mut spanning, mut checked) = (std::collections::BTreeSet::new(), 0, 0);
        for (prompt, c) in &done {
            let v = c.versions[0].version;
            let end = c
                .versions
                .get(1)
                .map_or(c.tokens.len(), |r| r.start as usize);
            versions.insert(v);
            spanning += usize::from(c.versions.len() > 1);
            let seqs = [ScoredSeq::plain(prompt, &c.tokens)];
            let (lp, _) = completion_logprobs(&announced[v as usize], &seqs, 1.0);
            let lp: Vec<f32> = lp.into_data().into_vec().unwrap();
            for (j, (behaviour, teacher)) in c.logprobs.iter().zip(&lp).take(end).enumerate() {
                assert!(
                    (behaviour - teacher).abs() < 1e-4,
                    "{store:?}: token {j} tagged version {v} was sampled with log-prob \
                     {behaviour}, the version gives {teacher}"
                );
                checked += 1;
            }
        }
        assert!(
            versions.len() >= 4,
            "{store:?}: completions began under versions {versions:?} only"
        );
        assert!(spanning > 0, "{store:?}: no completion spanned a swap");
        assert!(checked > 100, "{store:?}: only {checked} tokens checked");
    }
}

/// A store that fails a version once `budget` of its bytes are written, in the middle of
/// the stream (a disk that fills up while the trainer writes).
struct Breaking {
    inner: Arc<dyn BlobStore>,
    budget: AtomicU64,
}

#[async_trait::async_trait]
impl BlobStore for Breaking {
    fn kind(&self) -> StoreKind {
        self.inner.kind()
    }
    async fn put(&self, version: u64, bytes: Arc<Vec<u8>>) -> Result<u32, WeightsError> {
        self.inner.put(version, bytes).await
    }
    async fn put_stream(
        &self,
        version: u64,
        mut pieces: rlstream::weights::store::Pieces,
    ) -> Result<(u32, u64), WeightsError> {
        use rlstream::weights::store::Piece;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let inner = self.inner.clone();
        let writer = tokio::spawn(async move { inner.put_stream(version, rx).await });
        let mut left = self.budget.load(Ordering::SeqCst);
        while let Some(p) = pieces.recv().await {
            if let Piece::Bytes(b) = &p {
                if b.len() as u64 > left {
                    // The inner writer sees its stream end without the last piece.
                    drop(tx);
                    assert!(writer.await.unwrap().is_err());
                    return Err(WeightsError::Store {
                        store: "dir",
                        reason: std::io::Error::from_raw_os_error(27).to_string(),
                    });
                }
                left -= b.len() as u64;
            }
            let _ = tx.send(p).await;
        }
        drop(tx);
        writer.await.unwrap()
    }
    async fn get(&self, version: u64, chunks: u32) -> Result<Vec<u8>, WeightsError> {
        self.inner.get(version, chunks).await
    }
    async fn remove(&self, version: u64, chunks: u32) -> Result<(), WeightsError> {
        self.inner.remove(version, chunks).await
    }
}

/// A version streamed to a store that fails halfway is not announced, leaves no file and
/// no previous version behind it (the next is a keyframe), and the generator keeps its
/// weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_halfway_leaves_nothing() {
    use rlstream::weights::Payload;
    let dir = tempfile::tempdir().unwrap();
    let ns = crate::common::unique_ns("wbreak");
    let (bus, topo) = redis(&ns).await;
    let root = dir.path().join("shared");
    std::fs::create_dir(&root).unwrap();
    let cfg = WeightsConfig {
        // Segments of 16 MiB: the tiny model's version is one; a keyframe of it is one piece.
        delta: true,
        keyframe_every: 100,
        ..settings(StoreKind::Dir, &root)
    };
    let breaking = Arc::new(Breaking {
        inner: Arc::new(DirStore::new(&root, &ns, 4096)),
        budget: AtomicU64::new(u64::MAX),
    });
    let mut p = publisher(&bus, &topo, &cfg, 2)
        .await
        .with_store(breaking.clone());
    let (mut f, slot) = follower(&bus, &topo, &cfg);
    p.publish_payload(1, 1, Payload::Tensors(version_tensors(1)))
        .await
        .unwrap();
    assert_eq!(settle(&mut f).await, Some(1));
    // Version 2's delta: its header goes through, its frame does not.
    breaking.budget.store(30, Ordering::SeqCst);
    let err = p
        .publish_payload(2, 2, Payload::Tensors(version_tensors(2)))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("File too large"), "{err}");
    assert_eq!(
        announces(&bus, &topo).await.len(),
        1,
        "no announce without its object"
    );
    let files: Vec<String> = std::fs::read_dir(root.join(&ns))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files.len(), 1, "only version 1 is in the store: {files:?}");
    assert_eq!(settle(&mut f).await, None);
    holds(&slot, 1);
    breaking.budget.store(u64::MAX, Ordering::SeqCst);
    let a = p
        .publish_payload(2, 2, Payload::Tensors(version_tensors(2)))
        .await
        .unwrap();
    assert_eq!(a.base, None, "no previous version to make a delta on");
    assert_eq!(settle(&mut f).await, Some(2));
    holds(&slot, 2);
    let a = p
        .publish_payload(3, 3, Payload::Tensors(version_tensors(3)))
        .await
        .unwrap();
    assert_eq!(a.base, Some(2));
    assert_eq!(settle(&mut f).await, Some(3));
    holds(&slot, 3);
}

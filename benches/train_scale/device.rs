//! The GPU check's device measurements: what crosses between host and device in a training
//! step and a decode step on the build's backend (counted by `Counted`), and NCCL with one
//! rank (feature `cuda`).

use rlstream::model::counted::{Counted, Transfers, transfers};
use rlstream::model::hf::load_hf;
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{SamplingParams, ScoredGroup};
use rlstream::stages::train::TrainerOn;
use std::path::Path;

type Device = Counted<InferBackend>;

fn json(t: Transfers) -> String {
    format!(
        "{{\"reads\": {}, \"read_bytes\": {}, \"writes\": {}, \"write_bytes\": {}}}",
        t.reads, t.read_bytes, t.writes, t.write_bytes
    )
}

/// `transfers DIR`: the host↔device transfers of the second training step on the bench's
/// batch (the first makes the optimizer state) and of one decode step of 8 rows, against
/// the model's parameter bytes.
pub fn measure(dir: &Path) {
    let (size, vocab) = super::size_of(dir);
    let ckpt = tempfile::tempdir().expect("tmp");
    let settings = super::trainer_settings(dir, ckpt.path(), 1e-5, 0);
    let mut trainer =
        TrainerOn::<burn::backend::Autodiff<Device>>::start(&settings).expect("trainer");
    let groups = super::batch(size, vocab);
    let refs: Vec<&ScoredGroup> = groups.iter().collect();
    let tokens: usize = groups
        .iter()
        .flat_map(|g| {
            g.rollout
                .samples
                .iter()
                .map(|s| g.rollout.prompt_tokens.len() + s.tokens.len())
        })
        .sum();
    trainer.step(&refs).expect("step");
    let before = transfers();
    let record = trainer.step(&refs).expect("step");
    let train = transfers().since(before);
    assert!(!record.skipped, "a skipped step measures nothing");
    let param_bytes = trainer.model().config().num_params() * 4;
    drop(trainer);

    let model: Policy<Device> = load_hf(dir, &Default::default()).expect("load");
    let rows = 8;
    let req = Request {
        id: 0,
        prompt: (0..16).map(|j| (j * 7 + 1) % vocab).collect(),
        n: rows,
        params: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 8,
            stop_tokens: vec![],
            seed: 1,
        },
    };
    let mut g = Generator::<Device>::new();
    g.admit(&model, 0, &req).expect("admit");
    g.step(&model, 0).expect("step");
    let before = transfers();
    g.step(&model, 0).expect("step");
    let decode = transfers().since(before);
    let logits = rows * vocab as usize * 4;
    println!(
        "{{\"size\": \"{size}\", \"param_bytes\": {param_bytes}, \"train_tokens\": {tokens}, \
         \"train_step\": {}, \"decode_rows\": {rows}, \"decode_logit_bytes\": {logits}, \
         \"decode_step\": {}}}",
        json(train),
        json(decode)
    );
}

/// `nccl VALUES`: one NCCL rank on GPU 0 sums VALUES floats (a gradient's worth) with
/// itself, as the trainer's all-reduce does, both ways it can: from host buffers (each
/// bucket read from the device, copied to the GPU by the collective and back, and written to
/// the device again: `--grad-buffers host`) and in place in the backend's CUDA memory
/// (`--grad-buffers device`). The times and whether the values came back.
#[cfg(feature = "cuda")]
pub fn nccl(values: usize) {
    use burn::tensor::backend::Backend;
    use burn::tensor::{Tensor, TensorData};
    use rlstream::collective::{Collective, DeviceBuffer, Nccl, ReduceDtype};
    use rlstream::model::host_f32;
    use rlstream::stages::train::exchange::Bucket;
    use std::time::{Duration, Instant};
    let t = Instant::now();
    let id = Nccl::new_id().expect("an NCCL id");
    let mut c = Nccl::join(0, 1, &id, 0, Duration::from_secs(60)).expect("NCCL join");
    let join_s = t.elapsed().as_secs_f64();
    let want: Vec<f32> = (0..values).map(|i| (i % 1000) as f32 * 0.5).collect();
    let device = Default::default();
    let on_device =
        || Tensor::<InferBackend, 1>::from_data(TensorData::new(want.clone(), [values]), &device);
    let what = "the check's all-reduce";
    // From host buffers, as the host path runs it on a device backend.
    let host_path = |t: Tensor<InferBackend, 1>, c: &mut Nccl| {
        let mut buf = host_f32(t.into_data()).expect("read");
        c.all_reduce_sum(what, &mut buf, ReduceDtype::F32);
        Tensor::<InferBackend, 1>::from_data(TensorData::new(buf, [values]), &device)
    };
    let mut t = host_path(on_device(), &mut c);
    InferBackend::sync(&device).expect("sync");
    let start = Instant::now();
    t = host_path(t, &mut c);
    InferBackend::sync(&device).expect("sync");
    let host_s = start.elapsed().as_secs_f64();
    let host_kept = host_f32(t.into_data()).expect("read") == want;
    // In place on the device.
    let mut bucket = Bucket::new(on_device());
    let in_place = bucket.cuda_address().is_some();
    c.all_reduce_device(what, &mut bucket, ReduceDtype::F32)
        .expect("device all-reduce");
    let start = Instant::now();
    c.all_reduce_device(what, &mut bucket, ReduceDtype::F32)
        .expect("device all-reduce");
    InferBackend::sync(&device).expect("sync");
    let device_s = start.elapsed().as_secs_f64();
    let device_kept = host_f32(bucket.into_values().into_data()).expect("read") == want;
    let rate = |s: f64| (values * 4) as f64 / s / 1e9;
    println!(
        "{{\"nccl_world\": 1, \"values\": {values}, \"join_s\": {join_s:.3}, \
         \"all_reduce_s\": {host_s:.4}, \"gb_per_s\": {:.2}, \"values_kept\": {host_kept}, \
         \"device_in_place\": {in_place}, \"device_all_reduce_s\": {device_s:.4}, \
         \"device_gb_per_s\": {:.2}, \"device_values_kept\": {device_kept}, \
         \"device_speedup\": {:.2}}}",
        rate(host_s),
        rate(device_s),
        host_s / device_s
    );
    assert!(
        host_kept,
        "a one-rank all-reduce from host buffers changed the values"
    );
    assert!(
        device_kept,
        "a one-rank all-reduce in device memory changed the values"
    );
}

/// Without `cuda` there is no NCCL: says so, for the check to record.
#[cfg(not(feature = "cuda"))]
pub fn nccl(values: usize) {
    println!(
        "{{\"nccl_world\": 1, \"values\": {values}, \"skipped\": \"a build without --features cuda has no NCCL\"}}"
    );
}

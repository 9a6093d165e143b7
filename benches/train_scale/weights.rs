//! `weights` and `follow`: versions trained, published and swapped in at scale.
//!
//! `weights DIR LRS STEPS STORE ROWS` (ROWS 0: a generator that only follows) trains DIR's model for STEPS steps at each learning
//! rate of LRS on the fixed batch and publishes every version as the trainer stage does (its
//! host tensors, bf16 with deltas, streamed to STORE while they are encoded). A generator
//! runs in its own process (`follow`, this binary again): the weights follower of
//! `rlstream gen` swapping versions into its model slot, and a decode loop of ROWS rows
//! sampling from the slot all along. Before each publication the trainer idles a few
//! seconds, so the decode rate before it is the generator's own; the generator reports each
//! swap: its phases, the time from the start of publication to the swap (and from the
//! trainer's first copy of its weights), its tokens/s before and while the version was
//! applied, and its peak resident memory since the previous swap.

use super::{batch, size_of, trainer_settings};
use burn::module::AutodiffModule;
use rlstream::bus::{RedisBus, SharedBus, Topology};
use rlstream::model::hf::load_hf;
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::tensors::{WeightDtype, tensors_to_safetensors_as};
use rlstream::model::{InferBackend, Policy};
use rlstream::schema::{self, SamplingParams, ScoredGroup};
use rlstream::stages::train::Trainer;
use rlstream::weights::{
    Follower, ModelSlot, Publisher, StoreKind, Transport, Versioned, WeightsConfig,
};
use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Seconds the trainer idles before publishing: the generator's decode rate then is the
/// baseline a swap is compared with.
const QUIET_S: f64 = 4.0;

fn redis_url() -> String {
    std::env::var("RLSTREAM_BENCH_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn settings(store: &str, shared: &Path) -> WeightsConfig {
    WeightsConfig {
        store: if store == "dir" {
            StoreKind::Dir
        } else {
            StoreKind::Redis
        },
        store_dir: Some(shared.to_path_buf()),
        // Every third version a keyframe: a run of five versions or more shows a keyframe
        // written over the spare model and the deltas after one.
        keyframe_every: 3,
        ..WeightsConfig::default()
    }
}

/// VmHWM and VmRSS of this process in MB.
fn memory_mb() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Starts a new peak: VmHWM is the peak since this call.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Tokens per second decoded in `[from, to)` (unix µs), from the decode loop's log of
/// (end of pass, tokens).
fn rate(log: &[(u64, usize)], from: u64, to: u64) -> f64 {
    let tokens: usize = log
        .iter()
        .filter(|(at, _)| *at >= from && *at < to)
        .map(|(_, n)| n)
        .sum();
    tokens as f64 / ((to.saturating_sub(from)) as f64 / 1e6).max(1e-9)
}

/// The generator: follows the weights stream of namespace `ns` in `store` and decodes
/// `rows` rows from its slot; one JSON line per swap on stdout. Stops when stdin closes.
fn follow(dir: &Path, store: &str, shared: &Path, ns: &str, rows: usize) {
    let model: Policy<InferBackend> = load_hf(dir, &Default::default()).expect("load");
    let model_cfg = model.config().clone();
    let slot = ModelSlot::new(Versioned {
        version: 0,
        policy: model,
    });
    let log: Arc<Mutex<Vec<(u64, usize)>>> = Arc::default();
    if rows > 0 {
        let (slot, log) = (slot.clone(), log.clone());
        std::thread::spawn(move || decode(&slot, &log, rows));
    }
    std::thread::spawn(|| {
        // The bench closes stdin to stop this process.
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        std::process::exit(0);
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let bus: SharedBus = Arc::new(RedisBus::connect(&redis_url()).await.expect("redis"));
        let topo = Topology::default().with_namespace(ns).expect("ns");
        let mut f = Follower::new(bus.clone(), topo.clone(), model_cfg, slot.clone())
            .with_transport(Transport::Store(settings(store, shared)));
        println!("{{\"ready\": true}}");
        reset_peak();
        loop {
            let Some(v) = f.poll(Duration::from_millis(20)).await.expect("follower") else {
                continue;
            };
            let swapped_us = schema::now_us();
            let (peak, rss) = memory_mb();
            reset_peak();
            let a = rlstream::weights::newest_announce(bus.as_ref(), &topo)
                .await
                .expect("announce")
                .expect("an announce");
            assert_eq!(a.version, v, "the bench waits for each swap before the next version");
            let phases: Vec<String> = f
                .last_phases()
                .iter()
                .map(|(p, s)| format!("[\"{p}\", {s:.3}]"))
                .collect();
            let log = log.lock().expect("log").clone();
            let quiet = (QUIET_S * 0.75 * 1e6) as u64;
            println!(
                "{{\"version\": {v}, \"published_as\": \"{}\", \"started_us\": {}, \"swapped_us\": {swapped_us}, \
                 \"publish_to_swap_s\": {:.3}, \"phases_s\": [{}], \"tokens_per_s_before\": {:.2}, \
                 \"tokens_per_s_during\": {:.2}, \"peak_rss_mb\": {peak:.0}, \"rss_mb\": {rss:.0}}}",
                if a.is_delta() { "delta" } else { "keyframe" },
                a.started_us,
                (swapped_us.saturating_sub(a.started_us)) as f64 / 1e6,
                phases.join(", "),
                rate(&log, a.started_us.saturating_sub(quiet), a.started_us),
                rate(&log, a.started_us, swapped_us),
            );
            std::io::stdout().flush().expect("stdout");
        }
    });
}

/// Decodes `rows` rows from the slot for ever, one load of the slot per pass (as the
/// generator's decode loop does), logging each pass's end and tokens.
fn decode(slot: &ModelSlot<InferBackend>, log: &Mutex<Vec<(u64, usize)>>, rows: usize) {
    let mut g = Generator::new();
    for id in 0u64.. {
        let m = slot.load();
        let req = Request {
            id,
            prompt: (1..=16).collect(),
            n: rows,
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                max_new_tokens: 32,
                stop_tokens: vec![],
                seed: id,
            },
        };
        g.admit(&m.policy, m.version, &req).expect("admit");
        drop(m);
        while !g.is_idle() {
            let m = slot.load();
            let active = g.active();
            g.step(&m.policy, m.version).expect("step");
            drop(m);
            log.lock().expect("log").push((schema::now_us(), active));
        }
    }
}

/// The `weights` and `follow` commands; `false` for any other.
pub fn dispatch(args: &[&str]) -> bool {
    let count = |s: &str| -> usize { s.parse().expect("a count") };
    match *args {
        ["weights", dir, lrs, steps, store, rows] => weights(
            Path::new(dir),
            &lrs.split(',')
                .map(|x| x.parse().expect("LRS: learning rates, comma separated"))
                .collect::<Vec<f64>>(),
            count(steps),
            store,
            count(rows),
        ),
        ["follow", dir, store, shared, ns, rows] => {
            follow(Path::new(dir), store, Path::new(shared), ns, count(rows));
        }
        _ => return false,
    }
    true
}

type Lines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

/// The generator process (`follow`), once it is ready, and its stdout's lines.
fn spawn_generator(
    dir: &Path,
    store: &str,
    shared: &Path,
    ns: &str,
    rows: usize,
) -> (std::process::Child, Lines) {
    let mut generator = std::process::Command::new(std::env::current_exe().expect("this binary"))
        .args(["follow", &dir.display().to_string(), store])
        .arg(shared)
        .args([ns, &rows.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("generator process");
    let mut lines = std::io::BufReader::new(generator.stdout.take().expect("stdout")).lines();
    let ready = lines.next().expect("ready line").expect("read");
    assert!(ready.contains("ready"), "{ready}");
    (generator, lines)
}

/// The trainer's weights as a bf16 version (made apart from the publisher, outside the
/// timing), the size of its delta on `prev`, and the share of bf16 values unchanged.
fn sizes(trainer: &Trainer, prev: Option<&[u8]>) -> (Vec<u8>, usize, f64) {
    let tensors = trainer.model().valid().to_tensors().expect("tensors");
    let bf16 = tensors_to_safetensors_as(&tensors, WeightDtype::Bf16).expect("bf16");
    let Some(p) = prev else { return (bf16, 0, 0.0) };
    let delta = rlstream::weights::delta::encode(p, &bf16).map_or(0, |d| d.len());
    let same = p
        .chunks_exact(2)
        .zip(bf16.chunks_exact(2))
        .filter(|(a, b)| a == b)
        .count();
    (bf16, delta, same as f64 / (p.len() / 2) as f64)
}

/// Trains and publishes versions to a generator process; see the module docs.
fn weights(dir: &Path, lrs: &[f64], steps: usize, store: &str, rows: usize) {
    let (size, vocab) = size_of(dir);
    let groups = batch(size, vocab);
    let refs: Vec<&ScoredGroup> = groups.iter().collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let shared = tempfile::tempdir().expect("tmp");
    for &lr in lrs {
        let ns = format!("bench-weights-{}-{lr:e}", std::process::id());
        let cfg = settings(store, shared.path());
        let ckpt = tempfile::tempdir().expect("tmp");
        let mut trainer =
            Trainer::start(&trainer_settings(dir, ckpt.path(), lr, 0)).expect("trainer");
        let (bus, topo) = rt.block_on(async {
            let bus: SharedBus = Arc::new(RedisBus::connect(&redis_url()).await.expect("redis"));
            (bus, Topology::default().with_namespace(&ns).expect("ns"))
        });
        let mut publisher = Publisher::new(bus.clone(), topo.clone(), 2)
            .with_config(&cfg, WeightDtype::Bf16)
            .expect("publisher");
        let (mut generator, mut lines) = spawn_generator(dir, store, shared.path(), &ns, rows);
        let mut prev: Option<Vec<u8>> = None;
        for version in 1..=steps as u64 + 1 {
            if version > 1 {
                let t = Instant::now();
                let record = trainer.step(&refs).expect("step");
                assert!(!record.skipped, "a skipped step changes nothing");
                eprintln!(
                    "lr {lr:e}: step {} in {:.1} s",
                    version - 1,
                    t.elapsed().as_secs_f64()
                );
            }
            let (bf16, delta_bytes, unchanged) = sizes(&trainer, prev.as_deref());
            std::thread::sleep(Duration::from_secs_f64(QUIET_S));
            // Publication as the trainer stage does it: its weights to the host, then the
            // publisher (whose announce starts the clock of publish_to_swap_s).
            let from_copy_us = schema::now_us();
            let t = Instant::now();
            let payload = trainer.payload().expect("payload");
            let copy_s = t.elapsed().as_secs_f64();
            let a = rt
                .block_on(publisher.publish_payload(version, version, payload))
                .expect("publish");
            let publish_s = t.elapsed().as_secs_f64() - copy_s;
            let line = lines.next().expect("a swap").expect("read");
            let swapped_us: u64 = line
                .split("\"swapped_us\": ")
                .nth(1)
                .and_then(|s| s.split(',').next())
                .and_then(|s| s.parse().ok())
                .expect("swapped_us");
            println!(
                "{{\"lr\": {lr:e}, \"store\": \"{store}\", \"rows\": {rows}, \"bf16_bytes\": {}, \
                 \"delta_bytes\": {delta_bytes}, \"stored_bytes\": {}, \"bf16_unchanged\": {unchanged:.4}, \
                 \"weights_copy_s\": {copy_s:.3}, \"publish_s\": {publish_s:.3}, \
                 \"from_weights_copy_to_swap_s\": {:.3}, \
                 \"store_held_bytes\": {}, \"trainer_peak_rss_mb\": {:.0}, \"generator\": {line}}}",
                bf16.len(),
                a.object_bytes(),
                (swapped_us.saturating_sub(from_copy_us)) as f64 / 1e6,
                publisher.held_bytes(),
                super::peak_rss_mb(),
            );
            std::io::stdout().flush().expect("stdout");
            prev = Some(bf16);
        }
        drop(generator.stdin.take());
        let _ = generator.wait();
        let keys: Vec<String> = (1..=steps as u64 + 1)
            .flat_map(|v| (0..1024).map(move |c| (v, c)))
            .map(|(v, c)| topo.weights_chunk_key(v, c))
            .collect();
        let _ = rt.block_on(bus.delete(&keys));
    }
}

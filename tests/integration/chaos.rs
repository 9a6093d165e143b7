//! Chaos: feed, two generators, two scorers and a trainer (the real binary) on a real
//! Redis; stages are killed with SIGKILL at random moments and restarted, for a fixed number
//! of rounds. At the end every prompt fed is accounted for exactly once (trained, dropped
//! with a reason, dead-lettered, or in the trainer's last partial batch), no group was trained twice in the
//! surviving line, weights versions never went backwards, entries left by dead consumers
//! were claimed and processed, and the run still learned.
//!
//! The kill schedule comes from a seed (printed; `RLSTREAM_CHAOS_SEED` sets it).

use crate::common::{Proc, interrupt_via, run_ok, spawn};
use rlstream::bus::{RangeBound, SharedBus};
use rlstream::schema::{self, DeadLetter, Event, Prompt, WeightsAnnounce};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const WORDS: [&str; 8] = [
    "abc", "hello", "rust", "stream", "queue", "gpu", "redis", "token",
];
const EPOCHS: usize = 60;
const ROUNDS: usize = 8;
/// The trainer's batch: at the end, fewer groups than this may wait for a step.
const GROUPS_PER_STEP: usize = 8;
const STAGES: [&str; 5] = ["gen-a", "gen-b", "score-a", "score-b", "train"];

/// xorshift64*: the kill schedule, reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Pipeline {
    dir: PathBuf,
    /// The trainer's ranks: 1 is one `rlstream train`; more run under `mpirun -n`.
    ranks: u64,
    args: HashMap<&'static str, Vec<String>>,
    procs: HashMap<&'static str, Proc>,
    starts: HashMap<&'static str, usize>,
}

impl Pipeline {
    fn log(&self, name: &str, start: usize) -> PathBuf {
        self.dir.join(format!("{name}.{start}.log"))
    }

    fn start(&mut self, name: &'static str) {
        let n = self.starts.entry(name).or_default();
        *n += 1;
        let log = self.dir.join(format!("{name}.{n}.log"));
        let p = if name == "train" && self.ranks > 1 {
            self.spawn_ranks(&log)
        } else {
            spawn(&self.args[name], &log)
        };
        self.procs.insert(name, p);
    }

    #[cfg(feature = "mpi")]
    fn spawn_ranks(&self, log: &std::path::Path) -> Proc {
        let ranks = usize::try_from(self.ranks).expect("ranks");
        crate::common::spawn_command(
            crate::common::mpirun(&[(ranks, self.args["train"].clone())]),
            log,
        )
    }

    #[cfg(not(feature = "mpi"))]
    fn spawn_ranks(&self, _: &std::path::Path) -> Proc {
        panic!("trainer ranks need the mpi feature")
    }

    /// SIGKILL `stage`; for trainer ranks, one rank (the others stop with it).
    fn kill(&mut self, stage: &str, rng: &mut Rng) {
        let Some(proc) = self.procs.get_mut(stage) else {
            return;
        };
        if stage != "train" || self.ranks == 1 {
            proc.kill();
            return;
        }
        #[cfg(feature = "mpi")]
        {
            let rank = rng.below(self.ranks);
            let mpirun = proc.id().expect("running");
            let pid = crate::common::rank_pid(mpirun, rank).expect("a rank's process");
            std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status()
                .expect("kill");
            let killed = Instant::now();
            while proc.try_wait().is_none() {
                assert!(
                    killed.elapsed() < Duration::from_secs(30),
                    "trainer ranks still running 30 s after rank {rank} was killed"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            proc.kill();
        }
        #[cfg(not(feature = "mpi"))]
        let _ = rng;
    }

    /// SIGINT, then a clean exit; trainer ranks are stopped through rank 0, which
    /// checkpoints and then stops the others.
    fn interrupt(&mut self, stage: &'static str) {
        let proc = self.procs.remove(stage).expect("running");
        let log = self.log(stage, self.starts[stage]);
        let pid = proc.id().expect("running");
        #[cfg(feature = "mpi")]
        let pid = if stage == "train" && self.ranks > 1 {
            crate::common::rank_pid(pid, 0).expect("rank 0's process")
        } else {
            pid
        };
        interrupt_via(proc, pid, stage, &log);
    }

    /// The next start of `stage` joins under a new consumer name: a replacement process.
    /// What the old one held can then only come back through claims.
    fn rename(&mut self, stage: &'static str) -> String {
        let n = self.starts.get(stage).copied().unwrap_or(0) + 1;
        let args = self.args.get_mut(stage).expect("stage");
        let i = args.iter().position(|a| a == "--name").expect("--name");
        args[i + 1] = format!("{stage}-{n}");
        args[i + 1].clone()
    }

    /// The consumer name the stage runs under now.
    fn name(&self, stage: &str) -> String {
        let args = &self.args[stage];
        let i = args.iter().position(|a| a == "--name").expect("--name");
        args[i + 1].clone()
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for (name, &n) in &self.starts {
            for i in 1..=n {
                let text = std::fs::read_to_string(self.log(name, i)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                out += &format!("--- {name} #{i}\n");
                for l in tail.iter().rev() {
                    out += l;
                    out.push('\n');
                }
            }
        }
        out
    }

    /// Lines mentioning `what` across every log of every start.
    fn count_in_logs(&self, what: &str) -> usize {
        let mut n = 0;
        for (name, &starts) in &self.starts {
            for i in 1..=starts {
                n += std::fs::read_to_string(self.log(name, i))
                    .unwrap_or_default()
                    .matches(what)
                    .count();
            }
        }
        n
    }
}

async fn decoded<M: schema::Message>(
    bus: &SharedBus,
    key: &str,
) -> Vec<(rlstream::bus::EntryId, M)> {
    bus.range(key, RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .expect("range")
        .into_iter()
        .filter_map(|e| schema::decode::<M>(&e.payload).ok().map(|m| (e.id, m)))
        .collect()
}

/// Entries `consumer` of `stage` holds (delivered, not acked).
async fn holds(bus: &SharedBus, ns: &str, stage: &str, consumer: &str) -> u64 {
    let (stream, group) = if stage.starts_with("gen") {
        ("prompts", "gen")
    } else {
        ("rollouts", "score")
    };
    let Ok(s) = bus.stats(&format!("{ns}:{stream}")).await else {
        return 0;
    };
    s.groups
        .iter()
        .filter(|g| g.name == group)
        .flat_map(|g| &g.consumers)
        .find(|c| c.name == consumer)
        .map_or(0, |c| c.pending)
}

async fn settled(bus: &SharedBus, ns: &str) -> bool {
    for (stream, group) in [("prompts", "gen"), ("rollouts", "score")] {
        let Ok(s) = bus.stats(&format!("{ns}:{stream}")).await else {
            return false;
        };
        let Some(g) = s.groups.iter().find(|g| g.name == group) else {
            return false;
        };
        if g.pending > 0 || g.lag != Some(0) {
            return false;
        }
    }
    match bus.stats(&format!("{ns}:scored")).await {
        Ok(s) => s
            .groups
            .iter()
            .any(|g| g.name == "train" && g.lag == Some(0)),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_any_stage_lose_nothing() {
    chaos(1).await;
}

/// The trainer as two ranks under `mpirun`, sharding their optimizer state and gradients:
/// killing one rank stops both, and the pair is restarted from its sharded checkpoint.
#[cfg(feature = "mpi")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_any_stage_or_trainer_rank_lose_nothing() {
    chaos(2).await;
}

async fn chaos(ranks: u64) {
    let seed: u64 = std::env::var("RLSTREAM_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x0005_EEDC_4A05);
    eprintln!("chaos seed {seed} (RLSTREAM_CHAOS_SEED={seed} repeats the schedule)");
    let mut rng = Rng(seed.max(1));
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().to_path_buf();
    let ns = crate::common::unique_ns("chaos");
    let url = crate::common::redis_url();

    // Claims after 1.5 s instead of 30, so entries of killed consumers move within the test.
    let topology = d.join("topology.toml");
    let text = rlstream::bus::topology::DEFAULT_TOPOLOGY
        .replace("claim_idle_ms = 30000", "claim_idle_ms = 1500")
        .replace("block_ms = 1000", "block_ms = 200");
    std::fs::write(&topology, text).expect("topology");
    let topo_s = topology.to_str().expect("utf-8").to_string();
    let data = d.join("words.jsonl");
    let lines: Vec<String> = WORDS
        .iter()
        .map(|w| {
            serde_json::json!({"prompt": format!("rev:{w}="), "answer": w.chars().rev().collect::<String>()})
                .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).expect("data");
    let model = d.join("model");
    let m = model.to_str().expect("utf-8").to_string();
    crate::common::warm_start("reverse", &model, 300, &[]);
    let with_bus = |v: &[&str]| -> Vec<String> {
        let mut a = crate::common::on_bus(v, &url, &ns);
        a.extend(["--topology".into(), topo_s.clone()]);
        a
    };
    let fed = run_ok(
        &with_bus(&[
            "feed",
            "--dataset",
            data.to_str().expect("utf-8"),
            "--epochs",
            &EPOCHS.to_string(),
            "--shuffle",
            "--seed",
            "3",
        ])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    let total = WORDS.len() * EPOCHS;
    assert!(fed.starts_with(&format!("fed {total} prompts")), "{fed}");

    let ckpt = d.join("ckpt");
    let ckpt_s = ckpt.to_str().expect("utf-8").to_string();
    let generator = |name: &str| {
        with_bus(&[
            "gen",
            "--model",
            &m,
            "--group-size",
            "8",
            "--max-new-tokens",
            "10",
            "--name",
            name,
        ])
    };
    let score = |name: &str| with_bus(&["score", "--name", name]);
    let mut args = HashMap::new();
    args.insert("gen-a", generator("gen-a"));
    args.insert("gen-b", generator("gen-b"));
    args.insert("score-a", score("score-a"));
    args.insert("score-b", score("score-b"));
    args.insert(
        "train",
        with_bus(&[
            "train",
            "--model",
            &m,
            "--lr",
            "5e-4",
            "--groups-per-step",
            &GROUPS_PER_STEP.to_string(),
            "--max-lag",
            "6",
            "--checkpoint-every",
            "5",
            "--checkpoint-dir",
            &ckpt_s,
            "--name",
            "train-0",
            // Trainer ranks shard their optimizer state and gradients: each restart reads
            // its range back from every rank's shard of the last checkpoint.
            "--shard",
            if ranks > 1 { "gradients" } else { "none" },
        ]),
    );
    let mut p = Pipeline {
        dir: d.clone(),
        ranks,
        args,
        procs: HashMap::new(),
        starts: HashMap::new(),
    };
    for s in STAGES {
        p.start(s);
    }

    // Rounds: every stage is killed at least once (in an order from the seed), then random
    // ones. Wait 1-3 s, SIGKILL the stage, leave it dead: every other round past claim_idle,
    // so the others claim what it held; then start it again under the same name, so it
    // resumes its own pending entries.
    let mut victims: Vec<&'static str> = STAGES.to_vec();
    for i in (1..victims.len()).rev() {
        victims.swap(i, rng.below(i as u64 + 1) as usize);
    }
    while victims.len() < ROUNDS {
        victims.push(STAGES[rng.below(STAGES.len() as u64) as usize]);
    }
    let watch = crate::common::redis_bus().await;
    let mut kills: BTreeMap<&str, u32> = BTreeMap::new();
    let mut replaced: Vec<String> = Vec::new();
    let mut orphaned = 0u64;
    for (round, victim) in victims.into_iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(1000 + rng.below(2000))).await;
        let long = round % 2 == 0;
        if long && victim != "train" {
            // A replacement round: kill it while it holds entries (up to 3 s of looking),
            // so there is something for the others to claim.
            let wait = Instant::now();
            let mut held = 0;
            while held == 0 && wait.elapsed() < Duration::from_secs(3) {
                held = holds(&watch, &ns, victim, &p.name(victim)).await;
                if held == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            orphaned += held;
        }
        p.kill(victim, &mut rng);
        *kills.entry(victim).or_default() += 1;
        let dead_ms = if long { 2500 } else { rng.below(1000) };
        tokio::time::sleep(Duration::from_millis(dead_ms)).await;
        // After a long outage a gen or scorer comes back as a replacement with a new name.
        if long && victim != "train" {
            replaced.push(p.rename(victim));
        }
        p.start(victim);
    }

    // Drain: every prompt generated and scored, the trainer handed everything.
    let bus = crate::common::redis_bus().await;
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut quiet_since: Option<Instant> = None;
    while quiet_since.is_none_or(|t| t.elapsed() < Duration::from_secs(3)) {
        assert!(
            Instant::now() < deadline,
            "the pipeline did not drain:\n{}",
            p.logs()
        );
        for s in STAGES {
            if let Some(status) = p.procs.get_mut(s).and_then(Proc::try_wait) {
                panic!("{s} exited by itself ({status}):\n{}", p.logs());
            }
        }
        if settled(&bus, &ns).await {
            quiet_since.get_or_insert_with(Instant::now);
        } else {
            quiet_since = None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for s in STAGES {
        p.interrupt(s);
    }

    // Weights versions never went backwards; step versions always rose.
    let announced: Vec<u64> = decoded::<WeightsAnnounce>(&bus, &format!("{ns}:weights"))
        .await
        .into_iter()
        .map(|(_, a)| a.version)
        .collect();
    assert!(
        announced.windows(2).all(|w| w[1] >= w[0]),
        "weights versions went backwards: {announced:?}"
    );
    let steps: Vec<Event> = decoded::<Event>(&bus, &format!("{ns}:events"))
        .await
        .into_iter()
        .map(|(_, e)| e)
        .filter(|e| e.kind == "step")
        .collect();
    assert!(
        steps.windows(2).all(|w| w[1].version > w[0].version),
        "step versions went backwards: {:?}",
        steps.iter().map(|e| e.version).collect::<Vec<_>>()
    );

    // Accounting, from the surviving line's final checkpoint.
    let state = crate::common::checkpoint_state(&ckpt);
    let trained: Vec<String> =
        serde_json::from_value(state["recent_groups"].clone()).expect("trained");
    let dropped: Vec<(String, String)> =
        serde_json::from_value(state["recent_dropped"].clone()).expect("dropped");
    let trained_set: HashSet<&String> = trained.iter().collect();
    let duplicates = trained.len() - trained_set.len();
    assert_eq!(
        duplicates, 0,
        "a group was trained twice in the surviving line"
    );
    let dropped_reason: HashMap<&String, &String> = dropped.iter().map(|(g, r)| (g, r)).collect();
    let dead: Vec<DeadLetter> = decoded::<DeadLetter>(&bus, &format!("{ns}:dead"))
        .await
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    let dead_ids: HashSet<String> = dead.iter().map(|l| l.source_id.clone()).collect();
    let prompts = decoded::<Prompt>(&bus, &format!("{ns}:prompts")).await;
    assert_eq!(prompts.len(), total, "prompts were lost from the stream");
    let in_flight = crate::common::pending_groups(&bus, &ns, &prompts).await;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut lost = Vec::new();
    for (id, pr) in &prompts {
        let group = format!("{}@{}", pr.prompt_id, id);
        let place = if trained_set.contains(&group) {
            "trained".to_string()
        } else if let Some(reason) = dropped_reason.get(&group) {
            format!("dropped:{reason}")
        } else if in_flight.contains(&group) || in_flight.contains(&id.to_string()) {
            "in flight".to_string()
        } else if dead_ids.contains(&id.to_string()) {
            "dead-lettered".to_string()
        } else {
            lost.push(group);
            continue;
        };
        *counts.entry(place).or_default() += 1;
    }
    let claimed = p.count_in_logs("claimed entries left idle by another consumer");
    // Consumers that died and were replaced hold nothing: the others claimed it all.
    for (stream, group) in [("prompts", "gen"), ("rollouts", "score")] {
        let s = bus.stats(&format!("{ns}:{stream}")).await.expect("stats");
        for g in s.groups.iter().filter(|g| g.name == group) {
            for c in &g.consumers {
                assert_eq!(c.pending, 0, "{stream}: {} still holds entries", c.name);
            }
        }
    }
    let mean =
        |s: &[Event]| s.iter().map(|e| e.fields["reward_mean"]).sum::<f64>() / s.len() as f64;
    assert!(
        steps.len() >= 20,
        "only {} steps:\n{}",
        steps.len(),
        p.logs()
    );
    let (first, last) = (mean(&steps[..10]), mean(&steps[steps.len() - 10..]));
    eprintln!(
        "chaos ({ranks} trainer ranks): {ROUNDS} rounds, kills {kills:?}, replacements {replaced:?}, entries orphaned \
         {orphaned}, claims {claimed}, \
         duplicates {duplicates}, lost {}, prompts {counts:?}, {} steps to version {}, \
         reward {first:.3} -> {last:.3}",
        lost.len(),
        steps.len(),
        steps.last().map_or(0, |e| e.version)
    );
    assert!(lost.is_empty(), "lost prompts: {lost:?}\n{}", p.logs());
    // What is still in flight is only the trainer's last partial batch: a restarted
    // trainer that stopped reading its own pending entries would leave more here.
    let waiting = counts.get("in flight").copied().unwrap_or(0);
    assert!(
        waiting < GROUPS_PER_STEP,
        "{waiting} groups still in flight after draining:\n{}",
        p.logs()
    );
    if orphaned > 0 {
        assert!(
            claimed > 0,
            "{orphaned} entries of killed consumers, never claimed"
        );
    }
    assert!(
        counts.get("trained").copied().unwrap_or(0) >= total / 2,
        "{counts:?}"
    );
    assert!(
        last > first,
        "the run did not learn: reward {first:.3} -> {last:.3}"
    );
    crate::common::drop_namespace(&ns).await;
}

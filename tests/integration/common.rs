//! Helpers shared by the integration tests: a real Redis on loopback and unique namespaces.
#![allow(dead_code)]

use rlstream::bus::{EntryId, RangeBound, RedisBus, SharedBus};
use rlstream::config::{PolicySettings, TrainConfig};
use rlstream::model::logprobs::{ScoredSeq, completion_logprobs};
use rlstream::model::sampler::{Generator, Request};
use rlstream::model::{Architecture, InferBackend, Kernels, ModelConfig, Policy};
use rlstream::schema::{
    self as schema_mod, Prompt, RolloutGroup, Sample, SamplingParams, SchemaVersion, ScoredGroup,
};
use rlstream::stages::score::{AdvantageKind, advantages};
use rlstream::stages::train::TrainerSettings;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

/// A scored group of `rewards.len()` completions of `prompt` sampled from `model` (at
/// temperature 1, `max_new_tokens`, seed `seed`), with GRPO advantages.
pub fn sampled_group(
    model: &Policy<InferBackend>,
    group_id: &str,
    prompt: Vec<u32>,
    max_new_tokens: u32,
    seed: u64,
    rewards: Vec<f32>,
) -> ScoredGroup {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        max_new_tokens,
        stop_tokens: vec![],
        seed,
    };
    group_sampled_with(model, group_id, prompt, params, rewards)
}

/// [`sampled_group`] on any backend, with any sampling settings.
pub fn group_sampled_with<B: Kernels>(
    model: &Policy<B>,
    group_id: &str,
    prompt: Vec<u32>,
    params: SamplingParams,
    rewards: Vec<f32>,
) -> ScoredGroup {
    let req = Request {
        id: 0,
        prompt: prompt.clone(),
        n: rewards.len(),
        params: params.clone(),
    };
    let done = Generator::generate(model, 0, &[req]).unwrap();
    let prompt_routing = done
        .first()
        .and_then(|c| c.prompt_routing.as_deref().cloned());
    ScoredGroup {
        schema: SchemaVersion::CURRENT,
        rollout: RolloutGroup {
            schema: SchemaVersion::CURRENT,
            group_id: group_id.to_string(),
            prompt_id: format!("prompt-{group_id}"),
            task: "test".into(),
            prompt_tokens: prompt.into(),
            samples: done.into_iter().map(Sample::from).collect(),
            sampling: params,
            gen_id: "gen".into(),
            started_us: 0,
            finished_us: 0,
            meta: Default::default(),
            prompt_routing,
        },
        advantages: advantages(&rewards, AdvantageKind::Grpo),
        rewards,
        token_rewards: None,
        ref_logprobs: None,
        scorer_id: "score".into(),
        scored_us: 0,
    }
}

// ---- the real binary as a child process, and its metrics endpoint ----

/// A command's arguments `args` with the bus flags `--redis URL --namespace NS` after them.
pub fn on_bus(args: &[&str], url: &str, ns: &str) -> Vec<String> {
    args.iter()
        .copied()
        .chain(["--redis", url, "--namespace", ns])
        .map(String::from)
        .collect()
}

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rlstream"))
}

/// Each line of `out` as JSON (`replay`'s output).
pub fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

pub fn run_ok(args: &[&str]) -> String {
    run_ok_with_env(args, &[])
}

/// [`run_ok`] with extra environment variables.
pub fn run_ok_with_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = bin()
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run rlstream");
    assert!(
        out.status.success(),
        "rlstream {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A stage process that is killed if the test ends without stopping it (a failed
/// assertion must not leave processes running).
pub struct Proc(Option<Child>);

impl Proc {
    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The process id, while it runs.
    pub fn id(&self) -> Option<u32> {
        self.0.as_ref().map(Child::id)
    }

    /// The exit status, if the process has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn spawn(args: &[String], log: &Path) -> Proc {
    spawn_with_env(args, log, &[])
}

/// [`spawn`] with extra environment variables.
pub fn spawn_with_env(args: &[String], log: &Path, env: &[(&str, &str)]) -> Proc {
    let err = std::fs::File::create(log).expect("log file");
    Proc(Some(
        bin()
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("spawn rlstream"),
    ))
}

/// Each named log in full, headed `--- NAME`, for a failure message.
pub fn read_logs(names: &[&str], path: impl Fn(&str) -> PathBuf) -> String {
    names
        .iter()
        .map(|n| {
            format!(
                "--- {n}\n{}",
                std::fs::read_to_string(path(n)).unwrap_or_default()
            )
        })
        .collect()
}

/// SIGINT (Ctrl-C), then wait for a clean exit.
pub fn interrupt(proc: Proc, name: &str, log: &Path) -> Output {
    let pid = proc.id().expect("a running process");
    interrupt_via(proc, pid, name, log)
}

/// SIGINT to process `pid` (`proc` itself, or one of its children), then wait for `proc`'s
/// clean exit.
pub fn interrupt_via(mut proc: Proc, pid: u32, name: &str, log: &Path) -> Output {
    let child = proc.0.take().expect("a running process");
    let _ = Command::new("kill")
        .arg("-INT")
        .arg(pid.to_string())
        .status();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut child = child;
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "{name} did not stop on SIGINT:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    assert!(
        out.status.success(),
        "{name} exited with {:?}:\n{}",
        out.status,
        std::fs::read_to_string(log).unwrap_or_default()
    );
    out
}

/// `mpirun` with one program per entry of `apps` (`-n N rlstream ARGS`, `:`-separated).
#[cfg(feature = "mpi")]
pub fn mpirun(apps: &[(usize, Vec<String>)]) -> Command {
    let mut c = Command::new("mpirun");
    // Ranks share the cores of a small machine; CI runs as root.
    c.args([
        "--oversubscribe",
        "--allow-run-as-root",
        "--bind-to",
        "none",
    ]);
    for (i, (n, args)) in apps.iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-n", &n.to_string()]);
        c.arg(bin().get_program());
        c.args(args);
    }
    c
}

/// `cmd` started with its stderr in `log`: a [`Proc`] (killed if the test ends first).
#[cfg(feature = "mpi")]
pub fn spawn_command(mut cmd: Command, log: &Path) -> Proc {
    let err = std::fs::File::create(log).expect("log file");
    Proc(Some(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("spawn"),
    ))
}

/// The PID of MPI rank `rank` among the children of process `parent` (`mpirun`; Open MPI
/// sets `OMPI_COMM_WORLD_RANK` in each rank's environment), waiting up to 10 s for it.
#[cfg(feature = "mpi")]
pub fn rank_pid(parent: u32, rank: u64) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    let find = || {
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid: u32 = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let has = env.split(|&b| b == 0).any(|v| v == want.as_bytes());
            (ppid == parent && has).then_some(pid)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = find() {
            return Some(pid);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A loopback address with a port nothing listens on.
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// GET `path` over plain HTTP/1.0 (no chunked bodies); the status code and the body.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)
        .unwrap_or_else(|e| panic!("nothing listens on {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// The body of `http://addr/metrics`.
pub fn scrape(addr: &str) -> String {
    let (status, body) = http_get(addr, "/metrics");
    assert_eq!(status, 200, "GET http://{addr}/metrics: {body}");
    body
}

/// The value of one sample line (`name{labels} value`).
pub fn metric(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {series} in:\n{scrape}"))
}

/// A loopback port nothing listens on.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// A redis-server child; killed on drop.
pub struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// redis-server on `port` with AOF (`appendfsync always`) in `dir`, plus `extra` arguments;
/// waits until it accepts connections.
pub fn start_redis(dir: &Path, port: u16, extra: &[&str]) -> Redis {
    let log_path = dir.join(format!("redis-{port}.log"));
    let log = std::fs::File::create(&log_path).expect("redis log");
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(log)
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is needed (.ci/run installs it)");
    listening(child, port, &log_path)
}

/// `child` (a redis-server) once it accepts connections on `port`; its log at `log_path`
/// if it exits first.
fn listening(mut child: Child, port: u16, log_path: &Path) -> Redis {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "redis-server exited ({status}):\n{}",
                std::fs::read_to_string(log_path).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Redis(child)
}

/// A Redis Sentinel on `port` (config in `dir`, which it rewrites) monitoring the primary
/// on `primary` as `name`, with a quorum of 2 and a 1 s `down-after-milliseconds`; waits
/// until it accepts connections.
pub fn start_sentinel(dir: &Path, port: u16, primary: u16, name: &str) -> Redis {
    let conf = dir.join(format!("sentinel-{port}.conf"));
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndir {}\n\
             sentinel monitor {name} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {name} 1000\n\
             sentinel failover-timeout {name} 10000\n",
            dir.display()
        ),
    )
    .expect("sentinel conf");
    let log_path = dir.join(format!("sentinel-{port}.log"));
    let log = std::fs::File::create(&log_path).expect("log");
    let child = Command::new("redis-server")
        .arg(&conf)
        .arg("--sentinel")
        .stdout(log)
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is needed (.ci/run installs it)");
    listening(child, port, &log_path)
}

/// PEM files of a test PKI in one directory: a CA, a server certificate for 127.0.0.1
/// (only: `localhost` is a name it does not hold), and a client certificate, each signed
/// by the CA.
pub struct TestPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestPki {
    pub fn create(dir: &Path) -> TestPki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).expect("write pem");
            path
        };
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca.distinguished_name
            .push(DnType::CommonName, "rlstream test CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().expect("ca key");
        let ca_pem = ca.self_signed(&ca_key).expect("ca cert").pem();
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let mut p = CertificateParams::new(names).expect("params");
            p.distinguished_name
                .push(DnType::CommonName, "rlstream test");
            p.extended_key_usages = vec![usage];
            let key = KeyPair::generate().expect("key");
            let cert = p.signed_by(&key, &issuer).expect("sign");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) = leaf(vec![], ExtendedKeyUsagePurpose::ClientAuth);
        TestPki {
            ca: write("ca.pem", ca_pem),
            server_cert: write("server.pem", server_cert),
            server_key: write("server.key", server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client.key", client_key),
        }
    }

    /// The client side, as the bus takes it.
    pub fn client_files(&self) -> rlstream::bus::TlsFiles {
        rlstream::bus::TlsFiles {
            ca: Some(self.ca.clone()),
            cert: Some(self.client_cert.clone()),
            key: Some(self.client_key.clone()),
        }
    }
}

/// A redis-server that speaks only TLS, on a spare port, with its PKI; `auth_clients`
/// makes it ask for a client certificate (`tls-auth-clients yes`).
pub struct TlsRedis {
    pub url: String,
    pub pki: TestPki,
    _redis: Redis,
    _dir: tempfile::TempDir,
}

pub fn start_tls_redis(auth_clients: bool) -> TlsRedis {
    let dir = tempfile::tempdir().expect("tmp");
    let pki = TestPki::create(dir.path());
    let port = free_port();
    let path = |p: &Path| p.to_str().expect("utf-8").to_string();
    let port_s = port.to_string();
    let args = [
        "--port".to_string(),
        "0".into(),
        "--tls-port".into(),
        port_s,
        "--tls-cert-file".into(),
        path(&pki.server_cert),
        "--tls-key-file".into(),
        path(&pki.server_key),
        "--tls-ca-cert-file".into(),
        path(&pki.ca),
        "--tls-auth-clients".into(),
        if auth_clients { "yes" } else { "no" }.into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = start_redis(dir.path(), port, &args);
    TlsRedis {
        url: format!("rediss://127.0.0.1:{port}"),
        pki,
        _redis: redis,
        _dir: dir,
    }
}

/// Group ids (and prompt entry ids) of work still pending anywhere in the pipeline.
pub async fn pending_groups(
    bus: &SharedBus,
    ns: &str,
    prompts: &[(EntryId, Prompt)],
) -> HashSet<String> {
    let mut out = HashSet::new();
    // Prompts not delivered to the generators, or delivered and not acked.
    let stats = bus.stats(&format!("{ns}:prompts")).await.unwrap();
    let g = stats.groups.iter().find(|g| g.name == "gen").unwrap();
    let mut pending_ids: HashSet<EntryId> = HashSet::new();
    for (stream, group) in [
        ("prompts", "gen"),
        ("rollouts", "score"),
        ("scored", "train"),
    ] {
        pending_ids.extend(pending(ns, stream, group).await);
    }
    for (id, _) in prompts {
        if *id > g.last_delivered || pending_ids.contains(id) {
            out.insert(id.to_string());
        }
    }
    // Rollouts not yet scored and scored groups not yet acked by the trainer.
    for (stream, group) in [("rollouts", "score"), ("scored", "train")] {
        let s = bus.stats(&format!("{ns}:{stream}")).await.unwrap();
        let last = s
            .groups
            .iter()
            .find(|x| x.name == group)
            .map(|x| x.last_delivered)
            .unwrap_or_default();
        for e in bus
            .range(
                &format!("{ns}:{stream}"),
                RangeBound::Open,
                RangeBound::Open,
                1_000_000,
            )
            .await
            .unwrap()
        {
            if e.id > last || pending_ids.contains(&e.id) {
                let group_id = match stream {
                    "rollouts" => {
                        schema_mod::decode::<RolloutGroup>(&e.payload)
                            .unwrap()
                            .group_id
                    }
                    _ => {
                        schema_mod::decode::<ScoredGroup>(&e.payload)
                            .unwrap()
                            .rollout
                            .group_id
                    }
                };
                out.insert(group_id);
            }
        }
    }
    out
}

/// `rlstream train` on the scored stream of `ns` for two steps of four groups (any age),
/// from `model`, checkpointing to `ckpt`, with `env` set; its stdout.
pub fn train_two_steps(ns: &str, model: &Path, ckpt: &Path, env: &[(&str, &str)]) -> String {
    run_ok_with_env(
        &[
            "train",
            "--redis",
            &redis_url(),
            "--namespace",
            ns,
            "--model",
            model.to_str().expect("utf-8"),
            "--steps",
            "2",
            "--groups-per-step",
            "4",
            "--max-lag",
            "1000",
            "--checkpoint-dir",
            ckpt.to_str().expect("utf-8"),
        ],
        env,
    )
}

/// `state.json` of the newest checkpoint under `ckpt`.
pub fn checkpoint_state(ckpt: &Path) -> serde_json::Value {
    let name = std::fs::read_to_string(ckpt.join("latest")).expect("latest");
    let text = std::fs::read_to_string(ckpt.join(name.trim()).join("state.json")).expect("state");
    serde_json::from_str(&text).expect("state.json")
}

/// The group ids the newest checkpoint under `ckpt` remembers training, in order.
pub fn trained_groups(ckpt: &Path) -> Vec<String> {
    serde_json::from_value(checkpoint_state(ckpt)["recent_groups"].clone()).expect("groups")
}

/// A warm start: `rlstream sft --task TASK --out OUT --steps STEPS` plus `extra` flags,
/// checked to have ended with its held-out accuracy. Its stdout.
pub fn warm_start(task: &str, out: &Path, steps: u32, extra: &[&str]) -> String {
    let out = out.to_str().expect("a UTF-8 path");
    let steps = steps.to_string();
    let mut args = vec!["sft", "--task", task, "--out", out, "--steps", &steps];
    args.extend_from_slice(extra);
    let stdout = run_ok(&args);
    assert!(stdout.contains("held-out greedy accuracy"), "{stdout}");
    stdout
}

/// A random tiny Llama-shaped policy (vocabulary 32, seed `seed`), saved to `dir/model`.
pub fn tiny_llama(dir: &Path, seed: u64) -> Policy<InferBackend> {
    let cfg = ModelConfig::tiny(Architecture::Llama, 32);
    let model = Policy::<InferBackend>::random(&cfg, seed, &Default::default()).expect("model");
    model.save_hf(&dir.join("model")).expect("save");
    model
}

/// Trainer settings from the model saved under `dir/model`: 4 groups a step at lr 1e-3,
/// `steps` steps, a checkpoint every `checkpoint_every` under `dir/ckpt`.
pub fn small_trainer(dir: &Path, steps: u64, checkpoint_every: u64) -> TrainerSettings {
    TrainerSettings {
        policy: PolicySettings {
            model: Some(dir.join("model")),
            groups_per_step: 4,
            ..PolicySettings::default()
        },
        train: TrainConfig {
            checkpoint_every,
            checkpoint_dir: dir.join("ckpt"),
            lr: 1e-3,
            steps,
            ..TrainConfig::default()
        },
    }
}

/// Teacher-forced log-probs of each completion of `g` under `model`, one row per sample
/// (as long as the longest completion; padding past a sample's end).
pub fn teacher_forced(model: &Policy<InferBackend>, g: &ScoredGroup) -> Vec<Vec<f32>> {
    let seqs: Vec<ScoredSeq<'_>> = g
        .rollout
        .samples
        .iter()
        .map(|s| ScoredSeq::plain(&g.rollout.prompt_tokens, &s.tokens))
        .collect();
    let (lp, _) = completion_logprobs(model, &seqs, 1.0);
    let c = lp.dims()[1];
    let flat: Vec<f32> = lp.into_data().into_vec().expect("f32 log-probs");
    flat.chunks(c).map(<[f32]>::to_vec).collect()
}

/// Every message of stream `key`, decoded (a test fails on one that does not decode).
pub async fn messages<M: schema_mod::Message>(bus: &SharedBus, key: &str) -> Vec<M> {
    bus.range(key, RangeBound::Open, RangeBound::Open, 1_000_000)
        .await
        .expect("range")
        .iter()
        .map(|e| schema_mod::decode(&e.payload).expect("a message of the stream's type"))
        .collect()
}

/// Every entry of the dead-letter stream `key` (`{namespace}:dead`), decoded.
pub async fn dead_letters(bus: &SharedBus, key: &str) -> Vec<schema_mod::DeadLetter> {
    messages(bus, key).await
}

/// Entry ids pending in a consumer group (XPENDING).
pub async fn pending(ns: &str, stream: &str, group: &str) -> HashSet<EntryId> {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(format!("{ns}:{stream}"))
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(1_000_000)
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    rows.into_iter()
        .filter_map(|(id, ..)| id.parse().ok())
        .collect()
}

/// A tiny random Qwen3 in `dir` (2.5M parameters, almost all of them the 151,936-entry
/// embedding) with the real Qwen3 tokenizer, chat template and generation config.
pub fn tiny_qwen3(dir: &Path) -> rlstream::model::config::ModelConfig {
    use rlstream::model::config::{Architecture, ModelConfig};
    let cfg = ModelConfig::new(Architecture::Qwen3, 151_936, 16, 32, 1, 2, 1, 8)
        .with_qk_norm(true)
        .with_tie_embeddings(true)
        .with_max_position(512)
        .with_eos_token_id(Some(151_645));
    let model = Policy::<InferBackend>::random(&cfg, 5, &Default::default()).unwrap();
    model.save_hf(dir).unwrap();
    let tokenizers =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen3");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizers.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [151645, 151643]}"#,
    )
    .unwrap();
    cfg
}

/// The Python of `scripts/setup-python.sh` (`.venv`, with schemas/requirements.txt), or
/// `RLSTREAM_PYTHON`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("RLSTREAM_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python environment for the Python tests: run scripts/setup-python.sh (or set RLSTREAM_PYTHON)"
    );
    venv
}

/// Runs the test Python with `args` (a script and its arguments, or `-c CODE`): its
/// standard output. The test fails with both outputs when Python does.
pub fn python_ok(args: &[&str]) -> String {
    let out = Command::new(python())
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python {:?} failed:\n{}{}",
        args.first(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// [`python_ok`], whose output is one JSON value.
pub fn python_json(args: &[&str]) -> serde_json::Value {
    let out = python_ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// Waits (up to 90 s) until `done`; fails with `what` and the log at `log` otherwise.
pub fn wait_until(what: &str, log: &Path, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what}:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `gen --serve` process, up: where its endpoint and its metrics are.
pub struct Serving {
    pub proc: Proc,
    /// `127.0.0.1:PORT`, and the endpoint's `http://127.0.0.1:PORT/v1`.
    pub addr: String,
    pub base: String,
    pub metrics: String,
}

/// Starts `gen --model MODEL --serve` on a free loopback port, with metrics on another,
/// `extra` flags and `env`, on the test Redis in namespace `ns`; returns once the endpoint
/// takes connections.
pub fn serve_gen(
    model: &Path,
    ns: &str,
    log: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Serving {
    let (port, metrics) = (
        free_port().to_string(),
        format!("127.0.0.1:{}", free_port()),
    );
    let mut args = vec!["gen", "--model", model.to_str().expect("a UTF-8 path")];
    args.extend(["--serve", &port, "--metrics-addr", &metrics]);
    args.extend_from_slice(extra);
    let proc = spawn_with_env(&on_bus(&args, &redis_url(), ns), log, env);
    let addr = format!("127.0.0.1:{port}");
    wait_until("the endpoint never came up", log, || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    Serving {
        proc,
        base: format!("http://{addr}/v1"),
        addr,
        metrics,
    }
}

/// The trainer stage alone (one rank) on `bus` until its steps or `shutdown`.
pub async fn train_alone(
    tc: &TrainerSettings,
    (bus, topo): (SharedBus, &rlstream::bus::Topology),
    transport: rlstream::weights::Transport,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<rlstream::stages::train::TrainSummary, rlstream::stages::StageError> {
    use rlstream::stages::{StageContext, train};
    let job = train::TrainJob::new(tc).transport(transport);
    let role = (rlstream::roles::Stage::Train, tc.train.name.as_str());
    train::run(job, StageContext::new(role, bus, topo, shutdown)).await
}

/// The score stage on `bus` until `shutdown`.
pub async fn score_until(
    cfg: &rlstream::stages::score::ScoreConfig,
    (bus, topo): (SharedBus, &rlstream::bus::Topology),
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<rlstream::stages::score::ScoreSummary, rlstream::stages::StageError> {
    use rlstream::stages::StageContext;
    let role = (rlstream::roles::Stage::Score, cfg.name.as_str());
    rlstream::stages::score::run(cfg, StageContext::new(role, bus, topo, shutdown)).await
}

/// `rlstream run` in this process, one trainer rank, on `bus` and the default topology,
/// until its steps.
pub async fn run_alone(
    opts: &rlstream::commands::run::RunOptions,
    cfg: rlstream::config::Config,
    bus: SharedBus,
) -> rlstream::commands::run::RunOutcome {
    rlstream::commands::run::run(
        opts,
        cfg,
        bus,
        rlstream::bus::Topology::default(),
        Box::new(rlstream::collective::Solo::default()),
        std::future::pending(),
    )
    .await
    .expect("the run")
}

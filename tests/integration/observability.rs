//! Observability against the real thing: a short pipeline of real stage processes on a real
//! Redis, each serving `/metrics`.
//!
//! - Every metric the Grafana dashboard queries is exported by some stage, and the counters
//!   moved (tokens at every stage, a dead letter for an injected malformed prompt).
//! - Each scrape passes `promtool check metrics`.
//! - A real Prometheus scrapes the stages and answers `rate(rlstream_tokens_total[..])`.
//! - `rlstream status` (JSON and table) shows the live pipeline.
//!
//! And, without processes: the dashboard JSON is well formed for provisioning.

use crate::common::{free_addr, http_get, interrupt, run_ok, scrape, spawn};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/grafana/dashboards/rlstream.json"
);

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(DASHBOARD).expect("read the dashboard");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel, rows' nested panels included.
fn panels(d: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner);
        }
    }
    out
}

fn exprs(d: &serde_json::Value) -> Vec<String> {
    panels(d)
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect()
}

/// Metric names in PromQL expressions (`rlstream_*`; Prometheus's own `up` aside).
fn metric_names(exprs: &[String]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for e in exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("rlstream_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            out.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn dashboard_is_ready_for_provisioning() {
    let d = dashboard();
    assert_eq!(d["uid"].as_str(), Some("rlstream"));
    assert!(d["schemaVersion"].as_u64().is_some_and(|v| v >= 36));
    let text = std::fs::read_to_string(DASHBOARD).expect("read");
    assert!(
        !text.contains("${DS_"),
        "import placeholders break file provisioning"
    );
    let all = panels(&d);
    let mut ids = BTreeSet::new();
    for p in &all {
        let id = p["id"].as_u64().expect("every panel has an id");
        assert!(ids.insert(id), "panel id {id} is used twice");
    }
    let mut rows = Vec::new();
    for p in &all {
        let title = p["title"].as_str().unwrap_or_default();
        if p["type"] == "row" {
            rows.push(title.to_string());
            continue;
        }
        assert_eq!(
            p["datasource"]["uid"].as_str(),
            Some("${datasource}"),
            "panel {title} must use the datasource variable"
        );
        assert!(
            p["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .is_some_and(|u| !u.is_empty()),
            "panel {title} has no unit"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title} queries nothing");
        for t in targets {
            let e = t["expr"].as_str().expect("expr");
            if e.contains("rate(") {
                assert!(
                    e.contains("[$__rate_interval]"),
                    "panel {title}: rate() over a fixed window: {e}"
                );
            }
        }
    }
    for want in [
        "Flow",
        "Backlog",
        "Freshness",
        "Latency",
        "Learning",
        "Health",
    ] {
        assert!(rows.contains(&want.to_string()), "no {want} row: {rows:?}");
    }
    let vars = d["templating"]["list"].as_array().expect("templating");
    assert!(
        vars.iter()
            .any(|v| v["name"] == "datasource" && v["type"] == "datasource"),
        "no datasource variable"
    );
    // Every name the dashboard queries is declared in src/metrics.rs.
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/metrics.rs"))
        .expect("read metrics.rs");
    for name in metric_names(&exprs(&d)) {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        assert!(
            source.contains(&format!("\"{base}\"")),
            "the dashboard queries {name}, which src/metrics.rs does not define"
        );
    }
}

/// `# TYPE name kind` lines of a scrape, and the samples per series name.
struct Scrape {
    types: HashMap<String, String>,
    samples: Vec<(String, f64)>,
    text: String,
}

fn parse(text: String) -> Scrape {
    let mut types = HashMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(n), Some(k)) = (it.next(), it.next()) {
                types.insert(n.to_string(), k.to_string());
            }
        } else if !line.starts_with('#')
            && let Some((series, value)) = line.rsplit_once(' ')
            && let Ok(v) = value.parse::<f64>()
        {
            samples.push((series.to_string(), v));
        }
    }
    Scrape {
        types,
        samples,
        text,
    }
}

impl Scrape {
    /// Sum of the samples whose series starts with `prefix` (a name, or name{labels...).
    fn sum(&self, prefix: &str) -> f64 {
        self.samples
            .iter()
            .filter(|(s, _)| s.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    }

    fn has(&self, name: &str) -> bool {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|b| self.types.get(*b).is_some_and(|k| k == "histogram"));
        self.types.contains_key(base.unwrap_or(name))
    }
}

fn promtool_check(text: &str, what: &str) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed (scripts/setup-prometheus.sh installs it)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics rejects the {what} scrape:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A real Prometheus scraping `targets` every second; killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_prometheus(dir: &Path, targets: &[&str]) -> Prometheus {
    let config = dir.join("prometheus.yml");
    let list = targets
        .iter()
        .map(|t| format!("\"{t}\""))
        .collect::<Vec<_>>()
        .join(", ");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: rlstream\n    static_configs:\n      - targets: [{list}]\n"
        ),
    )
    .expect("write prometheus.yml");
    let addr = free_addr();
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("prometheus is needed (scripts/setup-prometheus.sh installs it)");
    Prometheus { child, addr }
}

/// Percent-encodes a PromQL query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Values of an instant query's result vector (empty while Prometheus is not up or has no
/// data yet).
fn query(prom: &Prometheus, q: &str) -> Vec<(serde_json::Value, f64)> {
    if std::net::TcpStream::connect(&prom.addr).is_err() {
        return Vec::new();
    }
    let (status, body) = http_get(&prom.addr, &format!("/api/v1/query?query={}", encode(q)));
    if status != 200 {
        return Vec::new();
    }
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|r| {
            let value = r["value"][1].as_str()?.parse().ok()?;
            Some((r["metric"].clone(), value))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_export_what_the_dashboard_shows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ns = crate::common::unique_ns("observe");
    let url = crate::common::redis_url();
    let model = dir.path().join("model");
    let m = model.to_str().expect("utf-8 path");
    let log = |n: &str| dir.path().join(format!("{n}.log"));
    // A mixture-of-experts policy: gen records routing and the trainer replays it, so the
    // routing panels fill too.
    crate::common::warm_start("sort", &model, 30, &["--experts", "4"]);
    let with_bus = |args: &[&str]| crate::common::on_bus(args, &url, &ns);
    let as_str = |v: &[String]| v.iter().map(String::clone).collect::<Vec<_>>();
    // A malformed prompt first in line: the generator must dead-letter it, count it and
    // keep going.
    let client = redis::Client::open(url.clone()).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let _: String = redis::cmd("XADD")
        .arg(format!("{ns}:prompts"))
        .arg("*")
        .arg("m")
        .arg(&b"\xc1 not msgpack"[..])
        .query_async(&mut conn)
        .await
        .expect("xadd");

    // Tool-use episodes first, played by an environment process that fails every 20th
    // step: the episode panels fill, failures included.
    let fed = run_ok(
        &as_str(&with_bus(&["feed", "--task", "calc", "--count", "100"]))
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(fed.starts_with("fed 100 prompts"), "{fed}");
    let fed = run_ok(
        &as_str(&with_bus(&["feed", "--task", "sort", "--count", "3000"]))
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(fed.starts_with("fed 3000 prompts"), "{fed}");
    let addrs: HashMap<&str, String> = ["gen", "score", "train"]
        .into_iter()
        .map(|s| (s, free_addr()))
        .collect();
    let env_cmd = format!(
        "python3 {}/tests/envs/faulty_env.py error 20",
        env!("CARGO_MANIFEST_DIR")
    );
    let gen_args = with_bus(&[
        "gen",
        "--model",
        m,
        "--group-size",
        "8",
        "--max-new-tokens",
        "9",
        "--name",
        "gen-a",
        "--metrics-addr",
        &addrs["gen"],
        "--env-cmd",
        &env_cmd,
    ]);
    // The model as its own teacher: the teacher-KL panel fills too.
    let score_args = with_bus(&[
        "score",
        "--teacher",
        m,
        "--name",
        "score-a",
        "--metrics-addr",
        &addrs["score"],
    ]);
    let ckpt = dir.path().join("ckpt");
    let train_args = with_bus(&[
        "train",
        "--model",
        m,
        "--lr",
        "5e-4",
        "--checkpoint-dir",
        ckpt.to_str().expect("utf-8 path"),
        "--name",
        "train-a",
        "--metrics-addr",
        &addrs["train"],
    ]);
    let children = vec![
        ("gen", spawn(&gen_args, &log("gen"))),
        ("score", spawn(&score_args, &log("score"))),
        ("train", spawn(&train_args, &log("train"))),
    ];
    let prom = start_prometheus(
        dir.path(),
        &[&addrs["gen"], &addrs["score"], &addrs["train"]],
    );

    // Until the trainer has stepped a few times and Prometheus has seen tokens flow.
    let deadline = Instant::now() + Duration::from_secs(150);
    let (rate, up) = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let logs = || crate::common::read_logs(&["gen", "score", "train", "prometheus"], log);
        assert!(Instant::now() < deadline, "no flow in time:\n{}", logs());
        let trained = if std::net::TcpStream::connect(&addrs["train"]).is_ok() {
            parse(scrape(&addrs["train"])).sum("rlstream_policy_version{stage=\"train\"}")
        } else {
            0.0
        };
        if trained < 5.0 {
            continue;
        }
        let rate = query(&prom, "sum by (stage) (rate(rlstream_tokens_total[10s]))");
        let up = query(&prom, "up");
        let flowing = ["gen", "score", "train"]
            .iter()
            .all(|s| rate.iter().any(|(m, v)| m["stage"] == *s && *v > 0.0));
        if flowing && up.len() == 3 {
            break (rate, up);
        }
    };
    assert!(up.iter().all(|(_, v)| *v == 1.0), "{up:?}");
    eprintln!("prometheus: tokens/s by stage {rate:?}");
    // Every panel fills: each dashboard query returns series from the real Prometheus
    // (Grafana's $__rate_interval is at least 4 scrape intervals; 10s here).
    let all_exprs = exprs(&dashboard());
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut empty: Vec<&String> = all_exprs.iter().collect();
    while !empty.is_empty() && Instant::now() < deadline {
        empty.retain(|e| query(&prom, &e.replace("$__rate_interval", "10s")).is_empty());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data: {empty:#?}"
    );

    let scrapes: HashMap<&str, Scrape> =
        addrs.iter().map(|(s, a)| (*s, parse(scrape(a)))).collect();
    for (stage, s) in &scrapes {
        promtool_check(&s.text, stage);
        let info = s
            .samples
            .iter()
            .find(|(series, _)| series.starts_with("rlstream_build_info{"))
            .unwrap_or_else(|| panic!("{stage}: no build info"));
        assert!(info.0.contains("git_sha=\""), "{info:?}");
    }
    // Every metric the dashboard queries is exported by at least one stage.
    for name in metric_names(&exprs(&dashboard())) {
        assert!(
            scrapes.values().any(|s| s.has(&name)),
            "the dashboard queries {name}, which no stage exports"
        );
    }
    // Counters moved where the work happened.
    let (g, sc, t) = (&scrapes["gen"], &scrapes["score"], &scrapes["train"]);
    assert!(g.sum("rlstream_tokens_total{stage=\"gen\"") > 0.0);
    assert!(sc.sum("rlstream_tokens_total{stage=\"score\"") > 0.0);
    assert!(t.sum("rlstream_tokens_total{stage=\"train\"") > 0.0);
    assert!(t.sum("rlstream_train_step_seconds_count") >= 5.0);
    assert!(g.sum("rlstream_weight_sync_seconds_count{stage=\"gen\"") >= 1.0);
    assert!(sc.sum("rlstream_score_seconds_count") > 0.0);
    assert!(g.sum("rlstream_episodes_total") > 0.0, "{}", g.text);
    assert!(g.sum("rlstream_env_step_seconds_count") > 0.0);
    assert!(g.sum("rlstream_env_failures_total{reason=\"env_error\"") > 0.0);
    assert_eq!(g.sum("rlstream_env_process_starts_total"), 1.0);
    assert_eq!(
        g.sum(&format!(
            "rlstream_dead_letters_total{{stream=\"{ns}:prompts\",group=\"gen\""
        )),
        1.0,
        "the malformed prompt is counted once:\n{}",
        g.text
    );
    assert!(
        g.sum(&format!(
            "rlstream_stream_length{{stream=\"{ns}:prompts\"}}"
        )) >= 3000.0
    );

    // `rlstream status` sees the same pipeline.
    let status_args = |extra: &[&str]| {
        let mut v = vec!["status", "--redis", &url, "--namespace", &ns];
        v.extend_from_slice(extra);
        v.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    let json = run_ok(
        &status_args(&["--json"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let st: serde_json::Value = serde_json::from_str(json.trim()).expect("status --json");
    let prompts = st["streams"]
        .as_array()
        .expect("streams")
        .iter()
        .find(|s| s["name"] == "prompts")
        .expect("prompts stream");
    assert_eq!(prompts["groups"][0]["name"], "gen");
    assert_eq!(prompts["groups"][0]["consumers"][0]["name"], "gen-a");
    for (stage, source) in [("gen", "gen-a"), ("score", "score-a"), ("train", "train-a")] {
        assert!(
            st["processes"]
                .as_array()
                .expect("processes")
                .iter()
                .any(|p| p["stage"] == stage && p["source"] == source && p["silent"] == false),
            "{stage} {source} missing or silent in {st}"
        );
    }
    assert!(
        st["trainer"]["step"].as_u64().is_some_and(|s| s >= 5),
        "{st}"
    );
    assert!(
        st["weights"]["version"].as_u64().is_some_and(|v| v >= 1),
        "{st}"
    );
    assert_eq!(st["dead_letters"], 1);
    assert_eq!(
        st["last_dead_letter"]["source_stream"],
        format!("{ns}:prompts")
    );
    assert!(
        st["generated_tokens_per_s"]
            .as_f64()
            .is_some_and(|r| r > 0.0),
        "{st}"
    );
    let table = run_ok(
        &status_args(&[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    for want in [
        format!("{ns}:scored"),
        "train-a".into(),
        "tok/s generated".into(),
        "dead      1 entries".into(),
    ] {
        assert!(table.contains(&want), "status lacks {want:?}:\n{table}");
    }

    drop(prom);
    for (name, child) in children {
        interrupt(child, name, &log(name));
    }
    crate::common::drop_namespace(&ns).await;
}

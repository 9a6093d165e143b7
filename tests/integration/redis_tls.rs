//! TLS to Redis (`rediss://`) against a real redis-server that speaks only TLS and asks
//! for client certificates, with a CA, a server and a client certificate made by the test:
//! the pipeline runs over it with the certificates given by flags or by the environment,
//! and every way of getting it wrong stops at once with a message that says what to give.
//! (The bus conformance suite also runs whole over TLS: `tests/integration/bus_conformance.rs`.)

use crate::common::{TestPki, bin, run_ok, start_tls_redis};
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The CA and the client certificate and key, as flags.
fn client_flags(pki: &TestPki) -> [&str; 6] {
    [
        "--redis-tls-ca",
        s(&pki.ca),
        "--redis-tls-cert",
        s(&pki.client_cert),
        "--redis-tls-key",
        s(&pki.client_key),
    ]
}

#[test]
fn the_pipeline_runs_over_tls_with_client_certificates() {
    let redis = start_tls_redis(true);
    let pki = &redis.pki;
    let tls = client_flags(pki);

    let mut feed = vec![
        "feed", "--redis", &redis.url, "--task", "add", "--count", "5",
    ];
    feed.extend(tls);
    assert!(run_ok(&feed).starts_with("fed 5 prompts"));

    // The same certificates from the environment, as a container would give them.
    let out = bin()
        .args(["status"])
        .env("RLSTREAM__REDIS", &redis.url)
        .env("RLSTREAM__REDIS_TLS_CA", &pki.ca)
        .env("RLSTREAM__REDIS_TLS_CERT", &pki.client_cert)
        .env("RLSTREAM__REDIS_TLS_KEY", &pki.client_key)
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("rl:prompts"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The whole pipeline (feed, gen, score, train, weights) on the TLS bus: blocking reads
    // on their own connections, weight chunks, acks and events all cross TLS.
    let dir = tempfile::tempdir().expect("tmp");
    let out_dir = dir.path().join("run");
    let mut run = vec![
        "run",
        "--task",
        "reverse",
        "--sft-steps",
        "20",
        "--steps",
        "3",
        "--namespace",
        "tls",
        "--redis",
        &redis.url,
        "--out",
        s(&out_dir),
    ];
    run.extend(tls);
    let stdout = run_ok(&run);
    assert!(stdout.contains("on the redis bus: 3 steps"), "{stdout}");
}

/// Runs `feed` against `url` with `extra` arguments and returns its error output; the
/// command must fail.
fn refused(url: &str, extra: &[&str]) -> String {
    let out = bin()
        .args(["feed", "--redis", url, "--task", "add", "--count", "1"])
        .args(extra)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{extra:?} was accepted");
    err
}

#[test]
fn each_tls_mistake_stops_with_what_to_give() {
    let redis = start_tls_redis(true);
    let pki = &redis.pki;
    let dir = tempfile::tempdir().expect("tmp");
    let url = redis.url.as_str();
    let (ca, cert, key) = (s(&pki.ca), s(&pki.client_cert), s(&pki.client_key));
    let all = client_flags(pki);

    // The server's CA is not among the system's roots.
    let err = refused(url, &[]);
    assert!(err.contains("--redis-tls-ca FILE"), "{err}");

    // The server asks for a client certificate.
    let err = refused(url, &["--redis-tls-ca", ca]);
    assert!(err.contains("--redis-tls-cert FILE"), "{err}");

    // A certificate without its key.
    let err = refused(url, &["--redis-tls-ca", ca, "--redis-tls-cert", cert]);
    assert!(
        err.contains("give both --redis-tls-cert and --redis-tls-key"),
        "{err}"
    );

    // A client key that is not the certificate's.
    let mut wrong_key = all;
    wrong_key[5] = s(&pki.server_key);
    let err = refused(url, &wrong_key);
    assert!(err.contains("the private key of --redis-tls-cert"), "{err}");

    // A host name the server's certificate does not hold.
    let by_name = url.replace("127.0.0.1", "localhost");
    let err = refused(&by_name, &all);
    assert!(err.contains("does not name the host"), "{err}");

    // Skipping verification is not offered.
    let err = refused(&format!("{url}/#insecure"), &all);
    assert!(err.contains("drop #insecure"), "{err}");

    // Certificates with a plain URL.
    let plain = url.replace("rediss://", "redis://");
    let err = refused(&plain, &["--redis-tls-ca", ca]);
    assert!(err.contains("the URL is not rediss://"), "{err}");

    // A CA file that is missing, or that holds no certificate (a key given by mistake).
    let missing = dir.path().join("missing.pem");
    let err = refused(url, &["--redis-tls-ca", s(&missing)]);
    assert!(err.contains("cannot read the CA certificate"), "{err}");
    let err = refused(url, &["--redis-tls-ca", key]);
    assert!(err.contains("holds no PEM certificate"), "{err}");

    // A plain client on the TLS port, and a TLS client on a plain port.
    let err = refused(&plain, &[]);
    assert!(err.contains("rediss:// if it speaks TLS"), "{err}");
    let plain_port = crate::common::redis_url().replace("redis://", "rediss://");
    let err = refused(&plain_port, &["--redis-tls-ca", ca]);
    assert!(err.contains("use redis://"), "{err}");

    // With everything given, the same command works.
    let mut feed = vec!["feed", "--redis", url, "--task", "add", "--count", "1"];
    feed.extend(all);
    let ok = run_ok(&feed);
    assert!(ok.starts_with("fed 1 prompts"), "{ok}");
}

/// A server that does not ask for client certificates needs only the CA.
#[test]
fn server_only_tls_needs_only_the_ca() {
    let redis = start_tls_redis(false);
    let ok = run_ok(&[
        "feed",
        "--redis",
        &redis.url,
        "--task",
        "add",
        "--count",
        "2",
        "--redis-tls-ca",
        s(&redis.pki.ca),
    ]);
    assert!(ok.starts_with("fed 2 prompts"), "{ok}");
}

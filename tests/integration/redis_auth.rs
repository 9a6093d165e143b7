//! Redis AUTH and ACL users through the URL, against real redis-servers started with
//! `requirepass` and with the shipped ACL file:
//! the right password works for stages and tools, a wrong or missing one stops them at once
//! with a message that says how to give credentials, and the password never appears in
//! output.

use crate::common::{bin, free_port, interrupt, run_ok, spawn, start_redis};

#[test]
fn credentials_come_from_the_url() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let _redis = start_redis(dir.path(), port, &["--requirepass", "s3cret-pw"]);
    let good = format!("redis://:s3cret-pw@127.0.0.1:{port}");
    let out = bin()
        .args(["feed", "--redis", &good, "--task", "add", "--count", "5"])
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("fed 5 prompts"));
    let status = bin()
        .args(["status", "--redis", &good])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success() && text.contains("rl:prompts"),
        "{text}"
    );
    assert!(
        text.contains(":***@") && !text.contains("s3cret-pw"),
        "{text}"
    );

    for (url, why) in [
        (format!("redis://:wrong@127.0.0.1:{port}"), "wrong password"),
        (format!("redis://127.0.0.1:{port}"), "no password"),
    ] {
        let out = bin()
            .args(["feed", "--redis", &url, "--task", "add", "--count", "5"])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{why}: accepted");
        assert!(err.contains("refused the credentials"), "{why}: {err}");
        assert!(err.contains("redis://:PASSWORD@HOST:PORT"), "{why}: {err}");
        assert!(!err.contains("s3cret-pw"), "{why}: {err}");
    }
}

/// The shipped ACL (`ops/users.acl.example`): each stage, as its own user, runs the
/// pipeline; a stage cannot write another stage's stream, and the error says so.
#[test]
fn each_stage_runs_under_its_acl_user_and_no_further() {
    let dir = tempfile::tempdir().expect("tmp");
    let acl = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/users.acl.example"
    ))
    .expect("ops/users.acl.example")
    .replace("CHANGE-ME-", "pw-");
    let acl_path = dir.path().join("users.acl");
    std::fs::write(&acl_path, acl).expect("write acl");
    let port = free_port();
    let _redis = start_redis(
        dir.path(),
        port,
        &["--aclfile", acl_path.to_str().expect("utf-8")],
    );
    let url = |user: &str| format!("redis://{user}:pw-{user}@127.0.0.1:{port}");
    let model = dir.path().join("model");
    let m = model.to_str().expect("utf-8");
    crate::common::warm_start("sort", &model, 20, &[]);
    run_ok(&[
        "feed",
        "--redis",
        &url("feed"),
        "--task",
        "sort",
        "--count",
        "200",
    ]);
    let log = |n: &str| dir.path().join(format!("{n}.log"));
    let generator = spawn(
        &[
            "gen",
            "--redis",
            &url("gen"),
            "--model",
            m,
            "--max-new-tokens",
            "9",
        ]
        .map(str::to_string),
        &log("gen"),
    );
    let score = spawn(
        &["score", "--redis", &url("score")].map(str::to_string),
        &log("score"),
    );
    let ckpt = dir.path().join("ckpt");
    let trained = run_ok(&[
        "train",
        "--redis",
        &url("train"),
        "--model",
        m,
        "--steps",
        "3",
        "--checkpoint-dir",
        ckpt.to_str().expect("utf-8"),
    ]);
    assert!(trained.starts_with("trained 3 steps"), "{trained}");
    interrupt(generator, "gen", &log("gen"));
    interrupt(score, "score", &log("score"));
    // Each user may read its streams' memory and trim them: the standing trims ran.
    for stage in ["gen", "score"] {
        let text = std::fs::read_to_string(log(stage)).expect("log");
        assert!(!text.contains("standing trim failed"), "{stage}: {text}");
    }
    let status = run_ok(&["status", "--redis", &url("watch")]);
    assert!(
        status.contains("rl:scored") && status.contains("GiB budget"),
        "{status}"
    );
    // The read-only user cannot write a stream.
    let out = bin()
        .args([
            "feed",
            "--redis",
            &url("watch"),
            "--task",
            "sort",
            "--count",
            "1",
        ])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the watch user fed prompts");
    assert!(err.contains("no permissions"), "{err}");
}

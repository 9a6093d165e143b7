//! Redis AUTH through the URL, against a real redis-server started with `requirepass`:
//! the right password works for stages and tools, a wrong or missing one stops them at once
//! with a message that says how to give credentials, and the password never appears in
//! output.

mod common;

use common::{bin, free_port, start_redis};

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

//! Stamps the binary with the commit it was built from, for `rlstream_build_info` and
//! `rlstream --version`-style reports. `RLSTREAM_GIT_SHA` overrides (container builds
//! without `.git`); outside a checkout the sha is `unknown`.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=RLSTREAM_GIT_SHA");
    let sha = std::env::var("RLSTREAM_GIT_SHA")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        // A new commit moves HEAD or the branch it points at.
        println!("cargo:rerun-if-changed={dir}/HEAD");
        // A missing path would rerun this script on every build: name only files that exist.
        let branch = git(&["symbolic-ref", "-q", "HEAD"]).map(|h| format!("{dir}/{h}"));
        for path in branch.into_iter().chain([format!("{dir}/packed-refs")]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    println!("cargo:rustc-env=RLSTREAM_GIT_SHA={sha}");
}

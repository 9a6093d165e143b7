//! The docs as tests.
//!
//! - The reference pages made from the code (`docs/settings.md` from the `settings!`
//!   definitions, `docs/cli.md` from the clap definitions) are regenerated and must match
//!   the committed files: `RLSTREAM_BLESS=1 cargo test --test integration docs::` rewrites
//!   them.
//! - Every `sh` block of README.md and `docs/*.md` runs, in order, in one bash session per
//!   file (`set -euo pipefail`; what a block starts in the background runs until the file's
//!   last block ends), in a scratch directory that sees the repository's files, with the
//!   built `rlstream` first on `PATH`, the test Redis, and a namespace of its own. The line
//!   before a block may change how it runs, and must say why:
//!   - `<!-- skip: REASON -->`: not run (a GPU, a cluster, Docker, a release build);
//!   - `<!-- ci: FROM => TO; FROM => TO -->`: run with each FROM (which must occur in the
//!     block) replaced by TO: tiny step counts, so that CI runs the commands as written,
//!     only shorter.
//!
//!   Blocks fenced as `bash` or `shell` fail the test: they would escape it.

use crate::common::{bin, drop_namespace, unique_ns};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Compares `path` with `generated`, or writes it under `RLSTREAM_BLESS`.
fn check_generated(path: &Path, generated: &str) {
    if std::env::var_os("RLSTREAM_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if committed != generated {
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(generated.lines().count()));
        panic!(
            "{} is out of date with the code (first difference at line {}: {:?} vs {:?}); \
             regenerate with `RLSTREAM_BLESS=1 cargo test --test integration docs::`",
            path.display(),
            first + 1,
            committed.lines().nth(first),
            generated.lines().nth(first),
        );
    }
}

#[test]
fn the_reference_pages_are_the_codes() {
    check_generated(
        &repo().join("docs/settings.md"),
        &rlstream::cli::reference::settings_markdown(),
    );
    check_generated(
        &repo().join("docs/cli.md"),
        &rlstream::cli::reference::cli_markdown(),
    );
}

/// How a block runs.
#[derive(Debug, Clone, PartialEq)]
enum Marker {
    Plain,
    Skip(String),
    Ci(Vec<(String, String)>),
}

#[derive(Debug)]
struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    text: String,
    marker: Marker,
}

fn marker(line: &str, at: &str) -> Marker {
    let inner = |m: &str| {
        line.trim()
            .strip_prefix(m)
            .and_then(|r| r.strip_suffix("-->"))
            .map(|r| r.trim().to_string())
    };
    if let Some(reason) = inner("<!-- skip:") {
        assert!(!reason.is_empty(), "{at}: a skip marker needs its reason");
        return Marker::Skip(reason);
    }
    if let Some(spec) = inner("<!-- ci:") {
        let pairs = spec
            .split(';')
            .map(|p| {
                let (from, to) = p
                    .split_once("=>")
                    .unwrap_or_else(|| panic!("{at}: `{p}` is not FROM => TO"));
                (from.trim().to_string(), to.trim().to_string())
            })
            .collect();
        return Marker::Ci(pairs);
    }
    Marker::Plain
}

/// The `sh` blocks of a Markdown file, with their markers.
fn blocks(path: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path.display();
    let mut out = Vec::new();
    let mut prev = "";
    let mut open: Option<(usize, Marker, String)> = None;
    let mut other_fence = false;
    for (i, line) in text.lines().enumerate() {
        let at = format!("{name}:{}", i + 1);
        // A fence closes on a line of backticks alone (CommonMark: no info string).
        let closes = line.trim() == "```";
        if let Some((start, m, body)) = &mut open {
            if closes {
                out.push(Block {
                    line: *start,
                    text: std::mem::take(body),
                    marker: m.clone(),
                });
                open = None;
            } else {
                body.push_str(line);
                body.push('\n');
            }
            continue;
        }
        let fence = line.trim_start();
        if other_fence {
            other_fence = !closes;
        } else if let Some(lang) = fence.strip_prefix("```") {
            if lang.trim() == "sh" {
                open = Some((i + 1, marker(prev, &at), String::new()));
            } else {
                assert!(
                    !matches!(lang.trim(), "bash" | "shell" | "console" | "zsh"),
                    "{at}: fence shell commands as ```sh (the docs test runs those)"
                );
                other_fence = true;
            }
        }
        if !line.trim().is_empty() {
            prev = line;
        }
    }
    assert!(open.is_none(), "{name}: an sh block is not closed");
    out
}

/// The bash script of a file's runnable blocks, each announced on stderr.
fn script(file: &str, blocks: &[Block]) -> String {
    let mut s = String::from("set -euo pipefail\n");
    for b in blocks {
        let text = match &b.marker {
            Marker::Skip(_) => continue,
            Marker::Plain => b.text.clone(),
            Marker::Ci(pairs) => {
                let mut t = b.text.clone();
                for (from, to) in pairs {
                    assert!(
                        t.contains(from.as_str()),
                        "{file}:{}: the ci marker replaces `{from}`, which the block does not hold",
                        b.line
                    );
                    t = t.replace(from.as_str(), to);
                }
                t
            }
        };
        s.push_str(&format!(
            "echo \">>> {file}:{} (at ${{SECONDS}} s)\" >&2\n{text}\n",
            b.line
        ));
    }
    s
}

/// Runs the `sh` blocks of `md` (relative to the repository) as one bash session, then
/// `check` on its scratch directory; returns what it printed (stdout and stderr).
fn run_blocks(md: &str, check: impl FnOnce(&Path)) -> String {
    let path = repo().join(md);
    let blocks = blocks(&path);
    let runnable = blocks
        .iter()
        .filter(|b| !matches!(b.marker, Marker::Skip(_)))
        .count();
    if runnable == 0 {
        return String::new();
    }
    let work = tempfile::tempdir().unwrap();
    // The repository's files as a user's checkout has them; what the commands write
    // (runs/, data) stays in the scratch directory.
    for entry in std::fs::read_dir(repo()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if [".git", "target", "runs", ".venv"].contains(&name.to_str().unwrap_or("")) {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), work.path().join(&name)).unwrap();
    }
    let exe = PathBuf::from(bin().get_program());
    let path_var = format!(
        "{}:{}",
        exe.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let ns = unique_ns("docs");
    let log = work.path().join("session.log");
    let out = std::fs::File::create(&log).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(script(md, &blocks))
        .current_dir(work.path())
        .env("PATH", path_var)
        .env("RLSTREAM__NAMESPACE", &ns)
        // The real chat model scripts/test.sh converted: the README's conversion command
        // links to it in CI (its `ci:` marker) instead of converting it again. Only that
        // block needs it, so a page without it runs where the model was not made.
        .env("RLSTREAM_SMOLLM2", crate::smollm2::model_path())
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .env_remove("RLSTREAM_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let started = Instant::now();
    let mut child = cmd.spawn().expect("bash");
    let limit = Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if started.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // What the blocks left running in the background (stages started with `&`).
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
    std::thread::sleep(Duration::from_millis(300));
    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
    let _ = child.wait();
    let printed = std::fs::read_to_string(&log).unwrap_or_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(drop_namespace(&ns));
    let last = printed
        .lines()
        .rfind(|l| l.starts_with(">>> "))
        .unwrap_or(">>> (before the first block)");
    if std::env::var_os("RLSTREAM_DOCS_TIMES").is_some() {
        for l in printed.lines().filter(|l| l.starts_with(">>> ")) {
            eprintln!("{l}");
        }
    }
    let tail: Vec<&str> = printed.lines().rev().take(40).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    match status {
        Some(s) if s.success() => {
            check(work.path());
            printed
        }
        Some(s) => panic!(
            "{md}: the block at {} failed ({s}); the session's last lines:\n{}",
            last.trim_start_matches(">>> "),
            tail.join("\n")
        ),
        None => panic!(
            "{md}: the blocks ran past {limit:?}, at {}; the session's last lines:\n{}",
            last.trim_start_matches(">>> "),
            tail.join("\n")
        ),
    }
}

#[test]
fn markers_are_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("x.md");
    std::fs::write(
        &md,
        "text\n\n<!-- ci: --steps 200 => --steps 2; runs/a => runs/b -->\n```sh\nrlstream run --steps 200 --out runs/a\n```\n\
         <!-- skip: needs a GPU -->\n\n```sh\nrlstream train --features cuda\n```\n\
         ```text\n```sh inside a text block is text\n```\n```sh\necho plain\n```\n",
    )
    .unwrap();
    let b = blocks(&md);
    assert_eq!(b.len(), 3);
    assert_eq!(
        b[0].marker,
        Marker::Ci(vec![
            ("--steps 200".into(), "--steps 2".into()),
            ("runs/a".into(), "runs/b".into())
        ])
    );
    assert_eq!(b[1].marker, Marker::Skip("needs a GPU".into()));
    assert_eq!(b[2].marker, Marker::Plain);
    assert_eq!(b[2].text, "echo plain\n");
    let s = script("x.md", &b);
    assert!(s.contains("rlstream run --steps 2 --out runs/b\n"), "{s}");
    assert!(!s.contains("cuda"), "{s}");
    // A replacement of text the block does not hold is an error, not a silent no-op.
    std::fs::write(
        &md,
        "<!-- ci: --steps 9 => --steps 1 -->\n```sh\nrlstream run\n```\n",
    )
    .unwrap();
    let b = blocks(&md);
    assert!(std::panic::catch_unwind(|| script("x.md", &b)).is_err());
}

#[test]
fn the_readmes_commands_run() {
    // The by-hand how-to runs at full length: its held-out pass@1 must rise.
    let printed = run_blocks("README.md", |work| {
        let pass = |f: &str| {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(work.join(f)).unwrap()).unwrap();
            v["pass_at_1"]["mean"].as_f64().unwrap()
        };
        let (before, after) = (pass("runs/before.json"), pass("runs/after.json"));
        assert!(
            after > before,
            "the by-hand how-to did not learn: pass@1 {before} -> {after}"
        );
    });
    assert!(printed.contains(">>> README.md:"), "{printed}");
}

#[test]
fn the_docs_pages_commands_run() {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty());
    for page in pages {
        let rel = page.strip_prefix(repo()).unwrap().display().to_string();
        run_blocks(&rel, |_| {});
    }
}

/// Every relative link of README.md and `docs/*.md` names a file that exists, and every
/// `#anchor` into a Markdown file names one of its headings.
#[test]
fn links_point_to_files_and_headings() {
    let mut pages = vec![repo().join("README.md")];
    pages.extend(
        std::fs::read_dir(repo().join("docs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md")),
    );
    // GitHub's heading anchors: lower case, spaces to dashes, punctuation dropped.
    let anchors = |path: &Path| -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix('#'))
            .map(|h| {
                h.trim_start_matches('#')
                    .trim()
                    .to_lowercase()
                    .chars()
                    .filter_map(|c| match c {
                        ' ' => Some('-'),
                        c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                        _ => None,
                    })
                    .collect()
            })
            .collect()
    };
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let dest = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !dest.exists() {
                broken.push(format!("{}: {target} (no such file)", page.display()));
            } else if !anchor.is_empty()
                && dest.extension().is_some_and(|e| e == "md")
                && !anchors(&dest).iter().any(|a| a == anchor)
            {
                broken.push(format!("{}: {target} (no such heading)", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

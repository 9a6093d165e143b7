//! What a first run trips on, each as the real binary answers it: user errors as one plain
//! line (no backtrace, no cause said twice, the missing thing named, no colour codes in a
//! pipe), a trainer's `checkpoints/latest` taken as a model, `--steps 0` and `--group-size 1`
//! refused with the reason before anything is created, and an empty replay said so.

use crate::common::{bin, redis_url, unique_ns};
use std::path::{Path, PathBuf};
use std::process::Output;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// `rlstream ARGS` as a shell with `RUST_BACKTRACE=1` set runs it.
fn rlstream(args: &[&str]) -> Output {
    bin()
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// The stderr of a command that must fail.
fn refused(args: &[&str]) -> String {
    let out = rlstream(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(out.status.code(), Some(1), "{args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The one `error:` line of `stderr`, which must be plain: no backtrace, no "Caused by"
/// block, no ANSI escape.
fn error_line(stderr: &str) -> String {
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a pipe: {stderr:?}"
    );
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert!(!stderr.contains("Caused by"), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    errors[0].to_string()
}

#[test]
fn user_errors_are_one_plain_line_even_with_rust_backtrace_set() {
    let e = error_line(&refused(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt-ids",
        "1",
    ]));
    assert_eq!(
        e,
        "error: no model at /nonexistent/model: the directory does not exist"
    );

    let empty = tempfile::tempdir().unwrap();
    let d = empty.path().to_str().unwrap();
    let e = error_line(&refused(&["generate", "--model", d, "--prompt-ids", "1"]));
    assert!(
        e.starts_with(&format!("error: no model at {d}: config.json not found")),
        "{e}"
    );

    // An unreachable Redis: the refusal is said once, however many layers carry it.
    let e = error_line(&refused(&["status", "--redis", "redis://127.0.0.1:1"]));
    assert!(e.contains("127.0.0.1:1"), "{e}");
    let said = e.matches("refused").count();
    assert!(said <= 1, "said {said} times: {e}");
}

#[test]
fn log_lines_carry_no_colour_codes_when_stderr_is_not_a_terminal() {
    let m = fixture("qwen2");
    let out = rlstream(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains('\x1b'), "{stderr:?}");
}

/// Copies the files of model directory `from` into `to`.
fn copy_model(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in std::fs::read_dir(from).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
        }
    }
}

#[test]
fn a_trainers_latest_file_is_taken_for_the_checkpoint_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoints");
    copy_model(&fixture("qwen2"), &ckpt.join("step-000007"));
    // As the trainer marks its newest checkpoint: the directory's name, in a file.
    std::fs::write(ckpt.join("latest"), "step-000007\n").unwrap();
    let greedy = |model: &Path| {
        rlstream(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,12,5,7,30",
            "--temperature",
            "0",
            "--max-new-tokens",
            "3",
            "--json",
        ])
    };
    let out = greedy(&ckpt.join("latest"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let direct = greedy(&ckpt.join("step-000007"));
    assert_eq!(out.stdout, direct.stdout);
}

#[test]
fn commands_that_would_do_nothing_say_so_before_creating_anything() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run-dir");
    let o = out.to_str().unwrap();
    let e = error_line(&refused(&["run", "--steps", "0", "--out", o]));
    assert!(e.contains("run needs --steps of at least 1"), "{e}");
    let stderr = refused(&["run", "--steps", "0", "--out", o]);
    assert!(!stderr.contains("run directory"), "{stderr}");
    let e = error_line(&refused(&[
        "run",
        "--steps",
        "3",
        "--group-size",
        "1",
        "--out",
        o,
    ]));
    assert!(e.contains("--group-size 1 trains nothing"), "{e}");
    assert!(!out.exists(), "a refused run created {o}");

    let sft_out = dir.path().join("sft");
    let e = error_line(&refused(&[
        "sft",
        "--steps",
        "0",
        "--out",
        sft_out.to_str().unwrap(),
    ]));
    assert!(e.contains("sft needs --steps of at least 1"), "{e}");
    assert!(!sft_out.exists());
}

#[test]
fn an_empty_replay_says_so_and_fails() {
    let ns = unique_ns("empty-replay");
    let url = redis_url();
    let e = error_line(&refused(&[
        "replay",
        "--redis",
        &url,
        "--namespace",
        &ns,
        "--stream",
        "scored",
    ]));
    assert!(
        e.contains(&format!(
            "nothing to replay: no scored entries in namespace `{ns}`"
        )),
        "{e}"
    );
}

fn dataset(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/datasets")
        .join(name)
        .display()
        .to_string()
}

/// A Parquet file as the hubs serve them (pyarrow's, GSM8K's column names) is fed with its
/// columns named by flags; its bad rows are counted and listed by row number, never fed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feed_reads_parquet_with_named_columns_and_skips_bad_rows() {
    let ns = unique_ns("parquet-feed");
    let url = redis_url();
    let data = dataset("gsm8k_style.parquet");
    let args = crate::common::on_bus(&["feed", "--dataset", &data], &url, &ns);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let e = error_line(&refused(&args));
    assert!(e.contains("no `prompt` or `messages` column"), "{e}");
    assert!(e.contains("--prompt-column"), "{e}");

    let mut named = args.clone();
    named.extend(["--prompt-column", "question"]);
    let out = rlstream(&named);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("fed 4 prompts to") && stdout.contains("(2 bad dataset rows skipped"),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "skipped 2 bad rows of 6 (never fed): row 2: empty prompt; row 4: `answer` is null"
        ),
        "{stderr}"
    );
    let bus = crate::common::redis_bus().await;
    let prompts: Vec<rlstream::schema::Prompt> =
        crate::common::messages(&bus, &format!("{ns}:prompts")).await;
    let fed: Vec<(&str, &str, &str)> = prompts
        .iter()
        .map(|p| {
            (
                p.prompt_id.as_str(),
                p.text.as_str(),
                p.meta["answer"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        fed,
        [
            ("gsm8k_style-e0-r0", "What is 2+3?", "5"),
            ("gsm8k_style-e0-r1", "What is 7*6?", "42"),
            ("gsm8k_style-e0-r3", "What is 9-4?", "5"),
            ("gsm8k_style-e0-r5", "What is 1+1?", "2"),
        ]
    );
    crate::common::drop_namespace(&ns).await;
}

/// `eval --dataset` reads a Parquet chat dataset (zstd, a `messages` column of structs) the
/// same way, rendered with the model's chat template.
#[test]
fn eval_reads_a_parquet_chat_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3");
    crate::common::tiny_qwen3(&model);
    let data = dataset("chat_rows.parquet");
    let out = rlstream(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        &data,
        "--samples",
        "1",
        "--max-new-tokens",
        "2",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("eval chat_rows: pass@1"), "{stdout}");
    assert!(stdout.contains("3 prompts × 1 samples"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("row 1: the last message is the assistant's")
            && stderr.contains("row 3: `messages` is null"),
        "{stderr}"
    );
}

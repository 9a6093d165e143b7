//! A child process that speaks JSON lines: one JSON object per line on its stdin, one per
//! line on its stdout, its stderr passed through. The score stage's external scorers
//! (`--scorer-cmd`) and the generator's environment process (`--env-cmd`) both run on it.
//!
//! **Concurrency model: threads.** Each started process has one reader thread that hands
//! every answer to the request waiting for it; a request blocks its caller until its answer
//! or its deadline. The environment's callers are the generator's step threads (blocking
//! already, many episodes at once on one process); the scorer is async and calls through
//! `spawn_blocking`, one request per process at a time. Threads keep the process's life
//! independent of any async runtime (a reader blocked on a pipe needs no executor), and a
//! timeout can kill a hung process without holding the lock a blocked writer holds.
//!
//! **Matching answers to requests** ([`Matching`]): by a key field that each request and
//! its answer carry (`episode_id`: answers may come in any order), or in order (the next
//! line answers the oldest request).
//!
//! **What goes wrong** ends requests, never the caller:
//! - the process exits: every request out gets [`ChildError::Exited`], and the next
//!   request starts a new process, no sooner than the backoff allows: starts are at least
//!   [`RESTART_EVERY`] apart, and the wait doubles while processes keep dying young, up to
//!   [`MAX_BACKOFF`] (a process that lived [`HEALTHY_AFTER`] resets it). A request waits
//!   out the first [`RESTART_EVERY`]; one whose deadline ends before a longer wait is over
//!   fails at once with [`ChildError::Backoff`];
//! - an answer does not come within the deadline ([`ChildError::Timeout`]): matched in
//!   order, the process is killed (its next line would answer the wrong request); matched
//!   by key, it is killed only when it said nothing at all since the request went out
//!   (hung);
//! - a line that is not a JSON object (naming a request, when matched by key) is
//!   [`ChildError::Protocol`]: the stream can no longer be trusted, so the process is
//!   killed and every request out ends.
//!
//! A request may name the process it expects (its incarnation, see [`Response::incarnation`]):
//! state kept by a process that has since been replaced is gone, so such a request fails
//! with [`ChildError::Replaced`] rather than reaching a process that never saw it.

use serde_json::{Map, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

/// The shortest time between two starts of a process.
pub const RESTART_EVERY: Duration = Duration::from_secs(1);
/// The longest wait between two starts while processes keep dying.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A process that lived this long resets the backoff.
pub const HEALTHY_AFTER: Duration = Duration::from_secs(30);

/// Longest part of a bad line kept in an error message.
const SHOWN: usize = 200;

/// How answers are matched to requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matching {
    /// Each request and its answer carry this string field; answers come in any order.
    ByKey(&'static str),
    /// The next line answers the oldest request out.
    InOrder,
}

/// What went wrong with a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChildError {
    /// The command is empty or cannot be started.
    #[error("cannot start the {what} command `{cmd}`: {reason}")]
    Start {
        what: &'static str,
        cmd: String,
        reason: String,
    },
    /// The process exited (or its pipe broke) with the request out.
    #[error("the {what} process exited ({status})")]
    Exited { what: &'static str, status: String },
    /// The process the request expected was replaced: what it kept is gone.
    #[error("the {what} process was restarted; what it kept for this request went with it")]
    Replaced { what: &'static str },
    /// The process restarts too often for the request's deadline.
    #[error("the {what} process keeps exiting; its next start is in {wait_ms} ms")]
    Backoff { what: &'static str, wait_ms: u64 },
    /// No answer within the deadline.
    #[error("the {what} process gave no answer within {ms} ms")]
    Timeout { what: &'static str, ms: u64 },
    /// A line that is not an answer; the process was killed.
    #[error("the {what} process wrote {line:?}, {expected}")]
    Protocol {
        what: &'static str,
        line: String,
        expected: String,
    },
}

/// An answer, and the process that gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    pub fields: Map<String, Value>,
    /// Which start of the process answered (1 for the first): name it in later requests
    /// that depend on state this process keeps.
    pub incarnation: u64,
}

/// How a child process is started and spoken to.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    /// What the process is, for messages ("scorer", "environment").
    pub what: &'static str,
    /// The command, split on whitespace and run without a shell.
    pub command: String,
    pub matching: Matching,
    /// How long a request waits for its answer.
    pub timeout: Duration,
}

/// What the reader thread hands a waiting request.
type Reply = Result<Map<String, Value>, ChildError>;

/// Requests out, by key or in order.
#[derive(Default)]
struct WaitingRequests {
    by_key: HashMap<String, mpsc::Sender<Reply>>,
    in_order: VecDeque<(u64, mpsc::Sender<Reply>)>,
}

impl WaitingRequests {
    fn drain(&mut self) -> Vec<mpsc::Sender<Reply>> {
        let mut out: Vec<_> = self.by_key.drain().map(|(_, tx)| tx).collect();
        out.extend(self.in_order.drain(..).map(|(_, tx)| tx));
        out
    }
}

/// What the reader thread and a request share about one started process.
struct ProcessShared {
    child: Mutex<Child>,
    waiting: Mutex<WaitingRequests>,
    /// Lines read from the process (any): a hung process reads none.
    heard: AtomicU64,
    alive: AtomicBool,
}

impl ProcessShared {
    fn kill(&self) {
        self.alive.store(false, Ordering::SeqCst);
        let _ = lock(&self.child).kill();
    }
}

/// One started process.
struct RunningProcess {
    shared: Arc<ProcessShared>,
    stdin: ChildStdin,
    incarnation: u64,
    started: Instant,
}

impl Drop for RunningProcess {
    fn drop(&mut self) {
        self.shared.kill();
        let _ = lock(&self.shared.child).wait();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct ChildState {
    running: Option<RunningProcess>,
    incarnations: u64,
    /// When the next start may happen.
    next_start: Instant,
    /// The wait after the next early death.
    backoff: Duration,
    /// Numbers requests matched in order.
    sent: u64,
}

/// A child process speaking JSON lines, started on demand and restarted when it dies.
pub struct JsonLinesChild {
    spec: ChildSpec,
    argv: Vec<String>,
    state: Mutex<ChildState>,
    on_start: Box<dyn Fn(u64) + Send + Sync>,
}

impl JsonLinesChild {
    /// Starts the process now: an error when the command is empty or cannot start.
    /// `on_start` is told each start's incarnation (1 for the first).
    pub fn start(
        spec: ChildSpec,
        on_start: impl Fn(u64) + Send + Sync + 'static,
    ) -> Result<Arc<Self>, ChildError> {
        let argv: Vec<String> = spec.command.split_whitespace().map(String::from).collect();
        if argv.is_empty() {
            return Err(ChildError::Start {
                what: spec.what,
                cmd: spec.command.clone(),
                reason: "the command is empty".into(),
            });
        }
        let child = Arc::new(JsonLinesChild {
            spec,
            argv,
            state: Mutex::new(ChildState {
                running: None,
                incarnations: 0,
                next_start: Instant::now(),
                backoff: RESTART_EVERY,
                sent: 0,
            }),
            on_start: Box::new(on_start),
        });
        {
            let mut st = lock(&child.state);
            child.spawn(&mut st)?;
        }
        Ok(child)
    }

    /// The command, as started.
    pub fn command(&self) -> String {
        self.argv.join(" ")
    }

    /// How many processes were started so far (1 + restarts).
    pub fn starts(&self) -> u64 {
        lock(&self.state).incarnations
    }

    fn spawn(&self, st: &mut ChildState) -> Result<(), ChildError> {
        let what = self.spec.what;
        let mut child = Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| ChildError::Start {
                what,
                cmd: self.command(),
                reason: e.to_string(),
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(ChildError::Exited {
                what,
                status: "started without pipes".into(),
            });
        };
        st.incarnations += 1;
        let now = Instant::now();
        // Dying young doubles the wait before the next start; a long life resets it.
        if let Some(prev) = &st.running
            && prev.started.elapsed() >= HEALTHY_AFTER
        {
            st.backoff = RESTART_EVERY;
        }
        st.next_start = now + st.backoff;
        st.backoff = (st.backoff * 2).min(MAX_BACKOFF);
        let shared = Arc::new(ProcessShared {
            child: Mutex::new(child),
            waiting: Mutex::default(),
            heard: AtomicU64::new(0),
            alive: AtomicBool::new(true),
        });
        let reader = ReaderThread {
            shared: shared.clone(),
            what,
            matching: self.spec.matching,
        };
        std::thread::Builder::new()
            .name(format!("{what}-read"))
            .spawn(move || reader.run(BufReader::new(stdout)))
            .map_err(|e| ChildError::Start {
                what,
                cmd: self.command(),
                reason: format!("no reader thread: {e}"),
            })?;
        st.running = Some(RunningProcess {
            shared,
            stdin,
            incarnation: st.incarnations,
            started: now,
        });
        (self.on_start)(st.incarnations);
        Ok(())
    }

    /// A live process for a request that expects `on` (or any, for `None`), started anew
    /// when the last one died and the backoff allows a start before `deadline`.
    fn ensure_running<'a>(
        &self,
        st: &'a mut MutexGuard<'_, ChildState>,
        on: Option<u64>,
        deadline: Instant,
    ) -> Result<&'a mut RunningProcess, ChildError> {
        let what = self.spec.what;
        let dead = st
            .running
            .as_ref()
            .is_none_or(|r| !r.shared.alive.load(Ordering::SeqCst));
        if dead {
            if on.is_some() {
                return Err(ChildError::Replaced { what });
            }
            // The first restarts only keep starts RESTART_EVERY apart; a crash loop's longer
            // waits are not slept through past the request's deadline.
            let wait = st.next_start.saturating_duration_since(Instant::now());
            if wait > RESTART_EVERY && Instant::now() + wait >= deadline {
                return Err(ChildError::Backoff {
                    what,
                    wait_ms: wait.as_millis() as u64,
                });
            }
            std::thread::sleep(wait);
            tracing::warn!(cmd = %self.command(), "restarting the {what} process");
            self.spawn(st)?;
        }
        let Some(running) = st.running.as_mut() else {
            return Err(ChildError::Replaced { what });
        };
        if on.is_some_and(|i| i != running.incarnation) {
            return Err(ChildError::Replaced { what });
        }
        Ok(running)
    }

    /// Sends `msg` and waits for its answer. With [`Matching::ByKey`], `key` is the value
    /// of the key field `msg` carries. `on` is the process the request depends on (`None`:
    /// any, starting one when needed).
    pub fn request(&self, key: &str, on: Option<u64>, msg: &Value) -> Result<Response, ChildError> {
        let what = self.spec.what;
        let deadline = Instant::now() + self.spec.timeout;
        let (rx, shared, sent_heard, incarnation, order) = {
            let mut st = lock(&self.state);
            st.sent += 1;
            let order = st.sent;
            let running = self.ensure_running(&mut st, on, deadline)?;
            let (tx, rx) = mpsc::channel();
            {
                let mut waiting = lock(&running.shared.waiting);
                match self.spec.matching {
                    Matching::ByKey(_) => {
                        waiting.by_key.insert(key.to_string(), tx);
                    }
                    Matching::InOrder => waiting.in_order.push_back((order, tx)),
                }
            }
            let sent_heard = running.shared.heard.load(Ordering::SeqCst);
            if let Err(e) = write_line(&mut running.stdin, msg) {
                self.forget(&running.shared, key, order);
                running.shared.kill();
                return Err(ChildError::Exited {
                    what,
                    status: format!("its stdin failed: {e}"),
                });
            }
            (
                rx,
                running.shared.clone(),
                sent_heard,
                running.incarnation,
                order,
            )
        };
        // The answer has the whole timeout from when the request went out.
        match rx.recv_timeout(self.spec.timeout) {
            Ok(Ok(fields)) => Ok(Response {
                fields,
                incarnation,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                // Without the state lock: a writer blocked on a full pipe to a hung process
                // holds it, and killing the process is what frees that writer.
                self.forget(&shared, key, order);
                let hung = match self.spec.matching {
                    Matching::InOrder => true,
                    Matching::ByKey(_) => shared.heard.load(Ordering::SeqCst) == sent_heard,
                };
                if hung && shared.alive.load(Ordering::SeqCst) {
                    tracing::warn!(
                        cmd = %self.command(),
                        "the {what} process gave no answer for {} ms; killing it",
                        self.spec.timeout.as_millis()
                    );
                    shared.kill();
                }
                Err(ChildError::Timeout {
                    what,
                    ms: self.spec.timeout.as_millis() as u64,
                })
            }
        }
    }

    /// Removes a request from the waiting list.
    fn forget(&self, shared: &ProcessShared, key: &str, order: u64) {
        let mut waiting = lock(&shared.waiting);
        match self.spec.matching {
            Matching::ByKey(_) => {
                waiting.by_key.remove(key);
            }
            Matching::InOrder => waiting.in_order.retain(|(n, _)| *n != order),
        }
    }

    /// Sends `msg` to the process `on` expecting no answer (a close); nothing when that
    /// process is gone, and errors are ignored.
    pub fn tell(&self, on: u64, msg: &Value) {
        let mut st = lock(&self.state);
        if let Some(r) = st.running.as_mut().filter(|r| r.incarnation == on) {
            let _ = write_line(&mut r.stdin, msg);
        }
    }
}

/// Writes `msg` as one line and flushes it.
fn write_line(stdin: &mut ChildStdin, msg: &Value) -> std::io::Result<()> {
    let mut line = msg.to_string();
    line.push('\n');
    stdin.write_all(line.as_bytes())?;
    stdin.flush()
}

/// `line`, cut to [`SHOWN`] characters.
pub fn shown(line: &str) -> String {
    match line.char_indices().nth(SHOWN) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_string(),
    }
}

/// The reader thread of one process.
struct ReaderThread {
    shared: Arc<ProcessShared>,
    what: &'static str,
    matching: Matching,
}

impl ReaderThread {
    /// Hands each answer to its request; on the process's end or a bad line, ends every
    /// request out.
    fn run(self, stdout: BufReader<std::process::ChildStdout>) {
        let mut lost = None;
        for line in stdout.lines() {
            let line = match line {
                Ok(l) => l,
                Err(e) => {
                    lost = Some(self.protocol(&e.to_string(), "which is not UTF-8"));
                    break;
                }
            };
            self.shared.heard.fetch_add(1, Ordering::SeqCst);
            if line.trim().is_empty() {
                continue;
            }
            if let Err(e) = self.deliver(&line) {
                lost = Some(e);
                break;
            }
        }
        self.shared.alive.store(false, Ordering::SeqCst);
        let lost = match lost {
            Some(e) => {
                tracing::warn!(error = %e, "killing the {} process", self.what);
                let _ = lock(&self.shared.child).kill();
                e
            }
            None => {
                let status = self.exit_status();
                tracing::warn!(%status, "the {} process exited", self.what);
                ChildError::Exited {
                    what: self.what,
                    status,
                }
            }
        };
        for tx in lock(&self.shared.waiting).drain() {
            let _ = tx.send(Err(lost.clone()));
        }
    }

    fn protocol(&self, line: &str, expected: &str) -> ChildError {
        ChildError::Protocol {
            what: self.what,
            line: shown(line),
            expected: expected.to_string(),
        }
    }

    /// Hands one line to the request it answers.
    fn deliver(&self, line: &str) -> Result<(), ChildError> {
        let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(line) else {
            return Err(self.protocol(line, "not a JSON object"));
        };
        let mut waiting = lock(&self.shared.waiting);
        let tx = match self.matching {
            Matching::ByKey(field) => {
                let Some(Value::String(key)) = fields.get(field) else {
                    return Err(self.protocol(line, &format!("not an answer naming its `{field}`")));
                };
                let tx = waiting.by_key.remove(key);
                if tx.is_none() {
                    tracing::debug!(key = %key, "an answer no one waits for (late)");
                }
                tx
            }
            Matching::InOrder => match waiting.in_order.pop_front() {
                Some((_, tx)) => Some(tx),
                None => return Err(self.protocol(line, "with no request out")),
            },
        };
        if let Some(tx) = tx {
            let _ = tx.send(Ok(fields));
        }
        Ok(())
    }

    /// How the process ended once its stdout closed: it exited, or is about to, or closed
    /// stdout and runs on (then it is killed, so that waiting on it cannot hang).
    fn exit_status(&self) -> String {
        let mut c = lock(&self.shared.child);
        let mut exited = c.try_wait();
        if matches!(exited, Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
            exited = c.try_wait();
        }
        if matches!(exited, Ok(None)) {
            let _ = c.kill();
            exited = c.wait().map(Some);
        }
        match exited {
            Ok(Some(s)) => s.to_string(),
            Ok(None) => "still running".to_string(),
            Err(e) => e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(command: &str, matching: Matching, timeout_ms: u64) -> ChildSpec {
        ChildSpec {
            what: "test",
            command: command.into(),
            matching,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    /// `cat` echoes each request back: an answer to itself, in order and by key.
    #[test]
    fn answers_reach_their_requests() {
        let c = JsonLinesChild::start(spec("cat", Matching::InOrder, 5_000), |_| {}).expect("cat");
        for i in 0..3 {
            let a = c.request("", None, &json!({"n": i})).expect("echo");
            assert_eq!(a.fields["n"], json!(i));
            assert_eq!(a.incarnation, 1);
        }
        let c =
            JsonLinesChild::start(spec("cat", Matching::ByKey("id"), 5_000), |_| {}).expect("cat");
        let a = c
            .request("x", None, &json!({"id": "x", "v": 1}))
            .expect("echo");
        assert_eq!(a.fields["v"], json!(1));
    }

    #[test]
    fn a_process_that_keeps_dying_is_restarted_with_backoff_within_the_deadline() {
        let starts = Arc::new(AtomicU64::new(0));
        let counted = starts.clone();
        // Reads one byte of a request and exits without answering.
        let c = JsonLinesChild::start(
            spec(
                "dd bs=1 count=1 of=/dev/null status=none",
                Matching::InOrder,
                1_500,
            ),
            move |n| counted.store(n, Ordering::SeqCst),
        )
        .expect("dd");
        let first = c.request("", None, &json!({}));
        assert!(matches!(first, Err(ChildError::Exited { .. })), "{first:?}");
        // The next start is allowed 1 s after the first: within this request's deadline.
        let t = Instant::now();
        let second = c.request("", None, &json!({}));
        assert!(
            matches!(second, Err(ChildError::Exited { .. })),
            "{second:?}"
        );
        assert!(
            t.elapsed() >= Duration::from_millis(800),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(starts.load(Ordering::SeqCst), 2);
        // The one after waits 2 s: past the 1.5 s deadline, so the request fails at once.
        let t = Instant::now();
        let third = c.request("", None, &json!({}));
        assert!(
            matches!(third, Err(ChildError::Backoff { .. })),
            "{third:?}"
        );
        assert!(t.elapsed() < Duration::from_millis(500));
        assert_eq!(c.starts(), 2);
    }

    #[test]
    fn a_request_on_a_replaced_process_fails() {
        let c = JsonLinesChild::start(spec("cat", Matching::InOrder, 5_000), |_| {}).expect("cat");
        assert_eq!(
            c.request("", Some(2), &json!({})),
            Err(ChildError::Replaced { what: "test" })
        );
        assert!(c.request("", Some(1), &json!({})).is_ok());
    }

    #[test]
    fn in_order_a_timeout_kills_the_process_and_a_garbage_line_ends_it() {
        let c =
            JsonLinesChild::start(spec("sleep 30", Matching::InOrder, 200), |_| {}).expect("sleep");
        let r = c.request("", None, &json!({}));
        assert_eq!(
            r,
            Err(ChildError::Timeout {
                what: "test",
                ms: 200
            })
        );
        let st = lock(&c.state);
        let running = st.running.as_ref().expect("started");
        assert!(!running.shared.alive.load(Ordering::SeqCst), "killed");
        drop(st);
        let c = JsonLinesChild::start(spec("echo not-json", Matching::InOrder, 5_000), |_| {})
            .expect("echo");
        let r = c.request("", None, &json!({}));
        assert!(
            matches!(&r, Err(ChildError::Protocol { line, .. }) if line == "not-json")
                || matches!(&r, Err(ChildError::Exited { .. })),
            "{r:?}"
        );
    }

    #[test]
    fn a_command_that_cannot_start_is_an_error() {
        let missing = JsonLinesChild::start(
            spec("rlstream-no-such-program", Matching::InOrder, 100),
            |_| {},
        );
        assert!(matches!(missing, Err(ChildError::Start { .. })));
        let empty = JsonLinesChild::start(spec("  ", Matching::InOrder, 100), |_| {});
        assert!(matches!(empty, Err(ChildError::Start { .. })));
    }
}

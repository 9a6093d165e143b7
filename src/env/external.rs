//! Environments from outside: one process speaking JSON lines on stdin/stdout serves every
//! episode of a generator at once.
//!
//! The protocol (one JSON object per line, UTF-8; see README "Environments from outside"):
//!
//! ```text
//! → {"op":"reset","episode_id":"add-000042#17","env":"calc","prompt":"37*48=","meta":{…}}
//! ← {"episode_id":"add-000042#17","ok":true}                  (or "error": "…")
//! → {"op":"step","episode_id":"add-000042#17","action":"calc 37*48"}
//! ← {"episode_id":"add-000042#17","observation":"=1776.","reward":0.0,"done":false}
//! → {"op":"close","episode_id":"add-000042#17"}              (no answer)
//! ```
//!
//! A step's answer may also carry `"success": true|false` (read when `done`) or
//! `"error": "…"`. Answers may come in any order: each names its episode, and an episode
//! has at most one request out at a time.
//!
//! What goes wrong ends episodes, never the generator:
//! - the process exits (`env_crash`): every episode it was serving ends, and the next
//!   request starts a new process (waiting so that starts are at least [`RESTART_EVERY`]
//!   apart);
//! - a step is not answered within the generator's `env_timeout_ms` (`env_timeout`); when
//!   the process said nothing at all in that time it is taken as hung, killed and
//!   restarted;
//! - the process writes a line that is not a JSON object naming an episode
//!   (`env_protocol`): its stream can no longer be trusted, so it is killed and restarted;
//!   an answer to a known episode with a missing or mistyped field ends that episode alone.
//!
//! An episode reset on a process that has since been replaced cannot go on (its state died
//! with the process) and ends as `env_crash` at its next step.

use super::{EnvError, Environment, Step};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

/// Most one start of the environment process per this long: a process that dies at once
/// is not restarted in a loop.
pub const RESTART_EVERY: Duration = Duration::from_secs(1);

/// Longest line of an environment's answer kept in an error message.
const SHOWN: usize = 200;

/// What the reader thread hands a waiting request.
enum Reply {
    Answer(serde_json::Map<String, Value>),
    Lost(EnvError),
}

type Waiting = Arc<Mutex<HashMap<String, mpsc::Sender<Reply>>>>;

/// What a request keeps of the process it was sent to, to act on a timeout without the
/// state lock.
struct Handle {
    child: Arc<Mutex<Child>>,
    alive: Arc<AtomicBool>,
    waiting: Waiting,
    heard: Arc<AtomicU64>,
}

/// One started process.
struct Running {
    child: Arc<Mutex<Child>>,
    stdin: ChildStdin,
    /// Requests out, by episode id.
    waiting: Waiting,
    /// Lines read from the process (any): a hung process reads none.
    heard: Arc<AtomicU64>,
    alive: Arc<AtomicBool>,
    incarnation: u64,
}

impl Running {
    fn kill(&self) {
        self.alive.store(false, Ordering::SeqCst);
        let mut child = lock(&self.child);
        let _ = child.kill();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
        let _ = lock(&self.child).wait();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct State {
    running: Option<Running>,
    started: Option<Instant>,
    incarnations: u64,
}

/// The environment process of a generator, started on demand and restarted when it dies.
pub struct EnvProcess {
    argv: Vec<String>,
    timeout: Duration,
    state: Mutex<State>,
    episodes: AtomicU64,
}

impl EnvProcess {
    /// Starts `cmd` (split on whitespace, run without a shell); steps not answered within
    /// `timeout` end their episode. An error when the command cannot start at all.
    pub fn start(cmd: &str, timeout: Duration) -> Result<Arc<Self>, EnvError> {
        let argv: Vec<String> = cmd.split_whitespace().map(String::from).collect();
        if argv.is_empty() {
            return Err(EnvError::Setup("the environment command is empty".into()));
        }
        let p = Arc::new(EnvProcess {
            argv,
            timeout,
            state: Mutex::new(State {
                running: None,
                started: None,
                incarnations: 0,
            }),
            episodes: AtomicU64::new(0),
        });
        {
            let mut st = lock(&p.state);
            p.spawn(&mut st)?;
        }
        Ok(p)
    }

    /// The command, as started.
    pub fn command(&self) -> String {
        self.argv.join(" ")
    }

    /// How many processes were started so far (1 + restarts).
    pub fn starts(&self) -> u64 {
        lock(&self.state).incarnations
    }

    /// A new episode of the prompt `prompt` (its id `prompt_id`, its meta `meta`): reset
    /// at its first step.
    pub fn episode(
        self: &Arc<Self>,
        prompt_id: &str,
        prompt: &str,
        meta: &BTreeMap<String, String>,
    ) -> External {
        let n = self.episodes.fetch_add(1, Ordering::Relaxed);
        let id = format!("{prompt_id}#{n}");
        External {
            process: self.clone(),
            reset: Some(json!({
                "op": "reset",
                "episode_id": id,
                "env": meta.get(super::ENV).cloned().unwrap_or_default(),
                "prompt": prompt,
                "meta": meta,
            })),
            id,
            incarnation: None,
        }
    }

    fn spawn(&self, st: &mut State) -> Result<(), EnvError> {
        let mut child = Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                EnvError::Setup(format!(
                    "cannot start the environment command `{}`: {e}",
                    self.command()
                ))
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(EnvError::Crash(
                "the environment process has no pipes".into(),
            ));
        };
        st.incarnations += 1;
        st.started = Some(Instant::now());
        let running = Running {
            child: Arc::new(Mutex::new(child)),
            stdin,
            waiting: Arc::default(),
            heard: Arc::default(),
            alive: Arc::new(AtomicBool::new(true)),
            incarnation: st.incarnations,
        };
        let (waiting, heard, alive, child) = (
            running.waiting.clone(),
            running.heard.clone(),
            running.alive.clone(),
            running.child.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("env-read".into())
            .spawn(move || read(BufReader::new(stdout), waiting, heard, alive, child));
        if let Err(e) = spawned {
            return Err(EnvError::Crash(format!(
                "cannot start a reader thread: {e}"
            )));
        }
        crate::metrics::env_started(st.incarnations);
        st.running = Some(running);
        Ok(())
    }

    /// Sends `msg` for `episode` and waits for its answer. `on` is the process the episode
    /// was reset on (`None` for a reset). Returns the answer and the process it came from.
    fn request(
        &self,
        episode: &str,
        on: Option<u64>,
        msg: &Value,
    ) -> Result<(serde_json::Map<String, Value>, u64), EnvError> {
        let (rx, handle, sent_heard, incarnation) = {
            let mut st = lock(&self.state);
            let dead = st
                .running
                .as_ref()
                .is_none_or(|r| !r.alive.load(Ordering::SeqCst));
            if dead {
                st.running = None;
                if on.is_some() {
                    return Err(EnvError::Crash(
                        "the environment process exited; the episode's state went with it".into(),
                    ));
                }
                // A process that dies at once is not restarted in a loop: the request
                // waits (on its step thread, within its deadline) for the next start.
                if let Some(wait) = st
                    .started
                    .and_then(|t| RESTART_EVERY.checked_sub(t.elapsed()))
                {
                    std::thread::sleep(wait);
                }
                tracing::warn!(cmd = %self.command(), "restarting the environment process");
                self.spawn(&mut st)?;
            }
            let Some(running) = st.running.as_mut() else {
                return Err(EnvError::Crash(
                    "the environment process is not running".into(),
                ));
            };
            if on.is_some_and(|i| i != running.incarnation) {
                return Err(EnvError::Crash(
                    "the environment process was restarted; the episode's state went with it"
                        .into(),
                ));
            }
            let (tx, rx) = mpsc::channel();
            lock(&running.waiting).insert(episode.to_string(), tx);
            let sent_heard = running.heard.load(Ordering::SeqCst);
            if let Err(e) = write_line(&mut running.stdin, msg) {
                lock(&running.waiting).remove(episode);
                running.kill();
                return Err(EnvError::Crash(format!(
                    "cannot write to the environment process: {e}"
                )));
            }
            let handle = Handle {
                child: running.child.clone(),
                alive: running.alive.clone(),
                waiting: running.waiting.clone(),
                heard: running.heard.clone(),
            };
            (rx, handle, sent_heard, running.incarnation)
        };
        match rx.recv_timeout(self.timeout) {
            Ok(Reply::Answer(a)) => Ok((a, incarnation)),
            Ok(Reply::Lost(e)) => Err(e),
            Err(_) => {
                // Without the state lock: a writer blocked on a full pipe to a hung process
                // holds it, and killing the process is what frees that writer.
                lock(&handle.waiting).remove(episode);
                if handle.heard.load(Ordering::SeqCst) == sent_heard
                    && handle.alive.swap(false, Ordering::SeqCst)
                {
                    tracing::warn!(
                        cmd = %self.command(),
                        "the environment process said nothing for {} ms; killing it",
                        self.timeout.as_millis()
                    );
                    let _ = lock(&handle.child).kill();
                }
                Err(EnvError::Timeout(self.timeout.as_millis() as u64))
            }
        }
    }

    /// Sends `msg` expecting no answer (a close); errors are ignored.
    fn tell(&self, on: u64, msg: &Value) {
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

/// The reader thread of one process: hands each answer to its episode; on the process's
/// end or a garbage line, ends every episode it was serving.
fn read(
    stdout: BufReader<std::process::ChildStdout>,
    waiting: Waiting,
    heard: Arc<AtomicU64>,
    alive: Arc<AtomicBool>,
    child: Arc<Mutex<Child>>,
) {
    let mut lost = None;
    for line in stdout.lines() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                lost = Some(EnvError::Protocol(format!(
                    "the environment process wrote a line that is not UTF-8: {e}"
                )));
                break;
            }
        };
        heard.fetch_add(1, Ordering::SeqCst);
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Option<(String, serde_json::Map<String, Value>)> =
            match serde_json::from_str::<Value>(&line) {
                Ok(Value::Object(map)) => match map.get("episode_id") {
                    Some(Value::String(id)) => Some((id.clone(), map)),
                    _ => None,
                },
                _ => None,
            };
        let Some((id, answer)) = parsed else {
            lost = Some(EnvError::Protocol(format!(
                "the environment process wrote {:?}, not a JSON object with an `episode_id`",
                shown(&line)
            )));
            break;
        };
        match lock(&waiting).remove(&id) {
            Some(tx) => {
                let _ = tx.send(Reply::Answer(answer));
            }
            None => tracing::debug!(episode = %id, "an answer no one waits for (late)"),
        }
    }
    alive.store(false, Ordering::SeqCst);
    let lost = match lost {
        Some(e) => {
            tracing::warn!(error = %e, "killing the environment process");
            let _ = lock(&child).kill();
            e
        }
        None => {
            // Its stdout closed: it exited, or is about to, or closed stdout and runs on
            // (then it is killed, so that waiting on it cannot hang).
            let mut c = lock(&child);
            let mut exited = c.try_wait();
            if matches!(exited, Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
                exited = c.try_wait();
            }
            if matches!(exited, Ok(None)) {
                let _ = c.kill();
                exited = c.wait().map(Some);
            }
            drop(c);
            let status = match exited {
                Ok(Some(s)) => s.to_string(),
                Ok(None) => "still running".to_string(),
                Err(e) => e.to_string(),
            };
            tracing::warn!(%status, "the environment process exited");
            EnvError::Crash(format!("the environment process exited ({status})"))
        }
    };
    for (_, tx) in lock(&waiting).drain() {
        let _ = tx.send(Reply::Lost(lost.clone()));
    }
}

fn shown(line: &str) -> String {
    match line.char_indices().nth(SHOWN) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_string(),
    }
}

/// One episode played by the environment process.
pub struct External {
    process: Arc<EnvProcess>,
    id: String,
    /// The reset request, until it is sent (at the first step).
    reset: Option<Value>,
    /// The process the episode was reset on.
    incarnation: Option<u64>,
}

impl External {
    /// The episode's id in the protocol.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Environment for External {
    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        if let Some(reset) = self.reset.take() {
            let (a, on) = self.process.request(&self.id, None, &reset)?;
            if let Some(e) = a.get("error") {
                return Err(EnvError::Setup(format!(
                    "the environment refused the episode: {e}"
                )));
            }
            if a.get("ok") != Some(&Value::Bool(true)) {
                return Err(EnvError::Protocol(format!(
                    "a reset is answered with \"ok\": true or \"error\"; got {}",
                    shown(&Value::Object(a).to_string())
                )));
            }
            self.incarnation = Some(on);
        }
        let msg = json!({"op": "step", "episode_id": self.id, "action": action});
        let (a, _) = self.process.request(&self.id, self.incarnation, &msg)?;
        parse_step(a)
    }
}

impl Drop for External {
    fn drop(&mut self) {
        if let Some(on) = self.incarnation {
            self.process
                .tell(on, &json!({"op": "close", "episode_id": self.id}));
        }
    }
}

/// A step's answer as a [`Step`].
fn parse_step(a: serde_json::Map<String, Value>) -> Result<Step, EnvError> {
    if let Some(e) = a.get("error") {
        return Err(EnvError::Step(match e {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }));
    }
    let bad = |field: &str, want: &str| {
        EnvError::Protocol(format!(
            "a step's answer needs `{field}` ({want}); got {}",
            shown(&Value::Object(a.clone()).to_string())
        ))
    };
    let reward = a
        .get("reward")
        .and_then(Value::as_f64)
        .ok_or_else(|| bad("reward", "a number"))?;
    let done = a
        .get("done")
        .and_then(Value::as_bool)
        .ok_or_else(|| bad("done", "true or false"))?;
    let observation = match a.get("observation") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) if done => String::new(),
        _ => return Err(bad("observation", "a string")),
    };
    let success = match a.get("success") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("success", "true or false")),
    };
    Ok(Step {
        observation,
        reward: reward as f32,
        done,
        success,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_answers_are_read_strictly() {
        let obj = |v: Value| match v {
            Value::Object(m) => m,
            _ => unreachable!("an object literal"),
        };
        let s = parse_step(obj(
            json!({"episode_id": "e", "observation": "=4.", "reward": 0.5, "done": false}),
        ))
        .expect("a step");
        assert_eq!(
            (s.observation.as_str(), s.reward, s.done),
            ("=4.", 0.5, false)
        );
        let s = parse_step(obj(
            json!({"episode_id": "e", "reward": 1, "done": true, "success": true}),
        ))
        .expect("a last step");
        assert!(s.done && s.success && s.observation.is_empty());
        for bad in [
            json!({"episode_id": "e", "reward": "1", "done": true}),
            json!({"episode_id": "e", "reward": 1.0}),
            json!({"episode_id": "e", "reward": 1.0, "done": false}),
            json!({"episode_id": "e", "reward": 1.0, "done": true, "success": 1}),
        ] {
            assert!(
                matches!(parse_step(obj(bad.clone())), Err(EnvError::Protocol(_))),
                "{bad}"
            );
        }
        assert_eq!(
            parse_step(obj(json!({"episode_id": "e", "error": "no such tool"}))),
            Err(EnvError::Step("no such tool".into()))
        );
    }

    fn script(path: &str) -> String {
        format!("python3 {}/{path}", env!("CARGO_MANIFEST_DIR"))
    }

    fn calc_meta(expr: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (super::super::ENV.to_string(), "calc".to_string()),
            ("expr".to_string(), expr.to_string()),
        ])
    }

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// The Python example and the built-in environment give the same answers to the same
    /// turns, with episodes interleaved on one process.
    #[test]
    fn the_python_calculator_answers_as_the_builtin_one() {
        let p = EnvProcess::start(&script("examples/calc_env.py"), TIMEOUT).expect("start");
        let plays: [(&str, &[&str]); 6] = [
            ("37*48", &["calc 37*48", "1776"]),
            ("12*34", &["calc 12*", "calc12*34", "408"]),
            ("99*99", &["calc 1+2", "calc 3-4", "calc 5*6"]),
            ("10*10", &[" 100 "]),
            ("10*11", &["+110"]),
            ("21*43", &["calc -5*-3", "calc 1234567*2", "903x"]),
        ];
        let mut episodes: Vec<(External, super::super::calc::Calc)> = plays
            .iter()
            .map(|(expr, _)| {
                let meta = calc_meta(expr);
                let builtin = super::super::calc::Calc::from_meta(&meta).expect("meta");
                (p.episode("t", &format!("{expr}="), &meta), builtin)
            })
            .collect();
        let longest = plays.iter().map(|(_, a)| a.len()).max().unwrap_or(0);
        for turn in 0..longest {
            for ((ext, builtin), (_, actions)) in episodes.iter_mut().zip(&plays) {
                if let Some(a) = actions.get(turn) {
                    assert_eq!(ext.step(a), builtin.step(a), "{a:?}");
                }
            }
        }
        assert_eq!(p.starts(), 1);
    }

    #[test]
    fn out_of_order_answers_reach_their_episodes() {
        let p = EnvProcess::start(&script("tests/envs/faulty_env.py slow 100"), TIMEOUT)
            .expect("start");
        let threads: Vec<_> = (0..6)
            .map(|i| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let expr = format!("{}*3", 10 + i);
                    let mut e = p.episode("t", "", &calc_meta(&expr));
                    let call = e.step(&format!("calc {expr}")).expect("call");
                    (call.observation, (10 + i) * 3)
                })
            })
            .collect();
        for t in threads {
            let (obs, want) = t.join().expect("thread");
            assert_eq!(obs, format!("={want}."));
        }
    }

    /// Checks that a new episode plays on a new process.
    fn restarted(p: &Arc<EnvProcess>, starts: u64) {
        let mut e = p.episode("t", "", &calc_meta("11*11"));
        assert_eq!(e.step("121").map(|s| s.success), Ok(true));
        assert_eq!(p.starts(), starts);
    }

    #[test]
    fn a_crashed_process_ends_its_episodes_and_is_restarted() {
        let p =
            EnvProcess::start(&script("tests/envs/faulty_env.py crash 3"), TIMEOUT).expect("start");
        let (mut a, mut b) = (
            p.episode("t", "", &calc_meta("12*12")),
            p.episode("t", "", &calc_meta("13*13")),
        );
        assert!(a.step("calc 12*12").is_ok());
        assert!(b.step("calc 13*13").is_ok());
        let crashed = a.step("144");
        assert!(matches!(crashed, Err(EnvError::Crash(_))), "{crashed:?}");
        assert_eq!(crashed.map_err(|e| e.reason()), Err("env_crash"));
        // b was reset on the process that died: its state is gone.
        assert!(matches!(b.step("169"), Err(EnvError::Crash(_))));
        restarted(&p, 2);
    }

    #[test]
    fn a_hung_process_times_out_and_is_killed_and_restarted() {
        let p = EnvProcess::start(
            &script("tests/envs/faulty_env.py hang 2"),
            Duration::from_millis(300),
        )
        .expect("start");
        let mut a = p.episode("t", "", &calc_meta("12*12"));
        assert!(a.step("calc 12*12").is_ok());
        let hung = a.step("144");
        assert_eq!(hung, Err(EnvError::Timeout(300)));
        restarted(&p, 2);
    }

    #[test]
    fn a_garbage_line_ends_the_episodes_out_and_restarts_the_process() {
        let p = EnvProcess::start(&script("tests/envs/faulty_env.py garbage 2"), TIMEOUT)
            .expect("start");
        let mut a = p.episode("t", "", &calc_meta("12*12"));
        assert!(a.step("calc 12*12").is_ok());
        let garbled = a.step("144");
        assert!(matches!(garbled, Err(EnvError::Protocol(_))), "{garbled:?}");
        restarted(&p, 2);
    }

    #[test]
    fn refusals_and_bad_commands_are_setup_errors() {
        let p = EnvProcess::start(&script("examples/calc_env.py"), TIMEOUT).expect("start");
        let mut e = p.episode("t", "", &calc_meta("12*"));
        let refused = e.step("calc 1+1");
        assert!(matches!(refused, Err(EnvError::Setup(_))), "{refused:?}");
        let missing = EnvProcess::start("rlstream-no-such-environment --x", TIMEOUT);
        assert!(matches!(missing, Err(EnvError::Setup(_))));
        assert!(EnvProcess::start("  ", TIMEOUT).is_err());
    }
}

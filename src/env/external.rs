//! Environments from outside: one process speaking JSON lines on stdin/stdout serves every
//! episode of a generator at once.
//!
//! The protocol (one JSON object per line, UTF-8; see docs/episodes.md, "Environments from outside"):
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
//! The process is a [`JsonLinesChild`] matched by `episode_id`; what goes wrong ends
//! episodes, never the generator:
//! - the process exits (`env_crash`): every episode it was serving ends, and the next
//!   request starts a new process (with the child's restart backoff);
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
use crate::child::{ChildError, ChildSpec, JsonLinesChild, Matching, shown};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The field that names an episode in every request and answer.
const EPISODE_ID: &str = "episode_id";

impl From<ChildError> for EnvError {
    fn from(e: ChildError) -> Self {
        match e {
            ChildError::Start { .. } => EnvError::Setup(e.to_string()),
            ChildError::Timeout { ms, .. } => EnvError::Timeout(ms),
            ChildError::Protocol { .. } => EnvError::Protocol(e.to_string()),
            ChildError::Exited { .. }
            | ChildError::Replaced { .. }
            | ChildError::Backoff { .. } => EnvError::Crash(e.to_string()),
        }
    }
}

/// The environment process of a generator, started on demand and restarted when it dies.
pub struct EnvProcess {
    child: Arc<JsonLinesChild>,
    episodes: AtomicU64,
}

impl EnvProcess {
    /// Starts `cmd` (split on whitespace, run without a shell); steps not answered within
    /// `timeout` end their episode. An error when the command cannot start at all.
    pub fn start(cmd: &str, timeout: Duration) -> Result<Arc<Self>, EnvError> {
        let spec = ChildSpec {
            what: "environment",
            command: cmd.to_string(),
            matching: Matching::ByKey(EPISODE_ID),
            timeout,
        };
        let child = JsonLinesChild::start(spec, crate::metrics::env_started)?;
        Ok(Arc::new(EnvProcess {
            child,
            episodes: AtomicU64::new(0),
        }))
    }

    /// The command, as started.
    pub fn command(&self) -> String {
        self.child.command()
    }

    /// How many processes were started so far (1 + restarts).
    pub fn starts(&self) -> u64 {
        self.child.starts()
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
                EPISODE_ID: id,
                "env": meta.get(super::ENV).cloned().unwrap_or_default(),
                "prompt": prompt,
                "meta": meta,
            })),
            id,
            incarnation: None,
        }
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
            let answer = self.process.child.request(&self.id, None, &reset)?;
            let (a, on) = (answer.fields, answer.incarnation);
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
        let msg = json!({"op": "step", EPISODE_ID: self.id, "action": action});
        let answer = self
            .process
            .child
            .request(&self.id, self.incarnation, &msg)?;
        parse_step(answer.fields)
    }
}

impl Drop for External {
    fn drop(&mut self) {
        if let Some(on) = self.incarnation {
            let close = json!({"op": "close", EPISODE_ID: self.id});
            self.process.child.tell(on, &close);
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
        // The deadline also covers the restarted process's start-up (a Python interpreter):
        // long enough for that on a loaded machine, short enough to keep the test quick.
        let p = EnvProcess::start(
            &script("tests/envs/faulty_env.py hang 2"),
            Duration::from_millis(1500),
        )
        .expect("start");
        let mut a = p.episode("t", "", &calc_meta("12*12"));
        assert!(a.step("calc 12*12").is_ok());
        let hung = a.step("144");
        assert_eq!(hung, Err(EnvError::Timeout(1500)));
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

//! Environments: the other side of a multi-turn episode.
//!
//! An episode alternates model turns and environment turns. The generator samples a model
//! turn until a stop token (or the turn's token budget), hands the turn's text to the
//! episode's [`Environment`], and appends the environment's observation as tokens, never
//! re-tokenizing what came before. The environment's reward for the turn is placed on the
//! turn's last model token.
//!
//! Which environment a prompt plays is named by its meta key [`ENV`]; the built-in ones
//! ([`make`]) need nothing outside the process. A step that fails or takes longer than the
//! generator's `env_timeout_ms` ends the episode with a counted reason
//! ([`EnvError::reason`]): it is never trained as if the environment had answered.

pub mod calc;
pub mod external;
pub mod guess;
pub mod play;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Meta key naming a prompt's environment: such a prompt is played as episodes.
pub const ENV: &str = "env";

/// The environment's answer to one model turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Text appended after the turn (tokenized on its own); empty when `done`.
    pub observation: String,
    /// The turn's reward, placed on its last model token.
    pub reward: f32,
    /// The episode is over.
    pub done: bool,
    /// When `done`: whether the episode reached its goal (what `eval` counts).
    pub success: bool,
}

/// Why an environment could not answer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvError {
    /// The prompt names an environment this build has no such of, or its meta lacks what
    /// the environment needs: the prompt is dead-lettered.
    #[error("{0}")]
    Setup(String),
    /// A step failed.
    #[error("environment step failed: {0}")]
    Step(String),
    /// A step took longer than the limit.
    #[error("environment step took longer than {0} ms")]
    Timeout(u64),
    /// The environment panicked.
    #[error("environment panicked: {0}")]
    Panic(String),
    /// The observation could not be turned into tokens the model can take.
    #[error("environment observation: {0}")]
    Observation(String),
    /// The environment process exited (or was replaced) while serving the episode.
    #[error("environment process: {0}")]
    Crash(String),
    /// The environment process answered something the protocol does not allow.
    #[error("environment protocol: {0}")]
    Protocol(String),
}

impl EnvError {
    /// The `reason` label of `rlstream_env_failures_total`, and the dead-letter reason.
    pub fn reason(&self) -> &'static str {
        match self {
            EnvError::Setup(_) => "env_setup",
            EnvError::Step(_) => "env_error",
            EnvError::Timeout(_) => "env_timeout",
            EnvError::Panic(_) => "env_panic",
            EnvError::Observation(_) => "env_observation",
            EnvError::Crash(_) => "env_crash",
            EnvError::Protocol(_) => "env_protocol",
        }
    }
}

/// One episode's environment.
pub trait Environment: Send {
    /// The environment's answer to the model's turn, given as text (its stop token left
    /// out). Called once per turn, in order.
    fn step(&mut self, action: &str) -> Result<Step, EnvError>;
}

/// Where episodes' environments come from: the built-in ones, or one external process
/// that serves every episode ([`external`]).
#[derive(Clone, Default)]
pub struct Environments {
    external: Option<Arc<external::EnvProcess>>,
}

impl Environments {
    /// The built-in environments only.
    pub fn builtin() -> Self {
        Environments { external: None }
    }

    /// Every episode played by the process `cmd` (started now; an error when it cannot
    /// start), whose steps are answered within `timeout`.
    pub fn external(cmd: &str, timeout: Duration) -> Result<Self, EnvError> {
        Ok(Environments {
            external: Some(external::EnvProcess::start(cmd, timeout)?),
        })
    }

    /// The external process, when there is one.
    pub fn process(&self) -> Option<&Arc<external::EnvProcess>> {
        self.external.as_ref()
    }

    /// The environment of a new episode of the prompt `prompt_id` (text `prompt`, meta
    /// `meta`): `None` for a single-turn prompt (no [`ENV`] key).
    pub fn make(
        &self,
        prompt_id: &str,
        prompt: &str,
        meta: &BTreeMap<String, String>,
    ) -> Result<Option<Box<dyn Environment>>, EnvError> {
        if !is_episode(meta) {
            return Ok(None);
        }
        match &self.external {
            Some(p) => Ok(Some(Box::new(p.episode(prompt_id, prompt, meta)))),
            None => make(meta),
        }
    }
}

/// The built-in environment a prompt with `meta` plays: `None` for a single-turn prompt
/// (no [`ENV`] key).
pub fn make(meta: &BTreeMap<String, String>) -> Result<Option<Box<dyn Environment>>, EnvError> {
    let Some(name) = meta.get(ENV) else {
        return Ok(None);
    };
    match name.as_str() {
        guess::NAME => Ok(Some(Box::new(guess::Guess::from_meta(meta)?))),
        calc::NAME => Ok(Some(Box::new(calc::Calc::from_meta(meta)?))),
        other => Err(EnvError::Setup(format!(
            "the prompt names environment `{other}`; this build has `{}` and `{}` (others run as a process: gen --env-cmd)",
            guess::NAME,
            calc::NAME
        ))),
    }
}

/// The completion an episode records when a scripted player says `turns` to `env`: each
/// turn and the stop token `stop` (the model's), then the environment's answer (the
/// environment's). Returns the tokens and, per token, whether it is the model's. What a
/// warm start imitates.
pub fn transcript(
    env: &mut dyn Environment,
    turns: &[String],
    encode: impl Fn(&str) -> Vec<u32>,
    stop: u32,
) -> (Vec<u32>, Vec<bool>) {
    let (mut tokens, mut own) = (Vec::new(), Vec::new());
    for t in turns {
        let mut turn = encode(t);
        turn.push(stop);
        own.extend(std::iter::repeat_n(true, turn.len()));
        tokens.extend(turn);
        // The built-in players' environments cannot fail; the last answer is empty (done).
        if let Ok(step) = env.step(t) {
            let obs = encode(&step.observation);
            own.extend(std::iter::repeat_n(false, obs.len()));
            tokens.extend(obs);
        }
    }
    (tokens, own)
}

/// Whether a prompt with `meta` is played as episodes.
pub fn is_episode(meta: &BTreeMap<String, String>) -> bool {
    meta.contains_key(ENV)
}

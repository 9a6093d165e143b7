//! What an environment is ([`Environment`]), what it answers a turn with ([`Step`]), how it
//! fails ([`EnvError`]), the meta key that names it, and the transcript of a scripted
//! episode. The environments beside it implement it; `mod.rs` picks one for a prompt.

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

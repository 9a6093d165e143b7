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
mod contract;
pub mod external;
pub mod guess;
pub mod play;

pub use contract::{ENV, EnvError, Environment, Step, transcript};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

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

/// Whether a prompt with `meta` is played as episodes.
pub fn is_episode(meta: &BTreeMap<String, String>) -> bool {
    meta.contains_key(ENV)
}

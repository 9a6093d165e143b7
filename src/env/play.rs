//! Episodes played to the end in the calling thread, with a fixed model: what `eval`
//! measures and what the invariant tests drive. (The generator stage plays them with the
//! environment off its decode thread, so a slow step holds up only its own row.)

use super::{EnvError, Environment};
use crate::model::sampler::{Completion, Generator, Request, Resumed, Turn, TurnLimits};
use crate::model::tokenizer::Tokenizer;
use crate::model::{Kernels, ModelError, Policy};
use crate::schema::FinishReason;
use std::collections::HashMap;

/// One played episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub completion: Completion,
    /// The environment ended it and said it reached its goal.
    pub success: bool,
}

impl Episode {
    /// The sum of the turn rewards.
    pub fn ret(&self) -> f32 {
        self.completion.turn_rewards.iter().map(|r| r.reward).sum()
    }
}

/// Limits of an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpisodeLimits {
    pub turn: TurnLimits,
    /// Most model turns; the environment still judges the last one.
    pub turns: u32,
}

/// What the environment's answer to `turn` does to the episode.
pub enum Answer {
    /// Appended, then the model's next turn.
    Continue { reward: f32, observation: Vec<u32> },
    /// The episode is over.
    End {
        reward: Option<f32>,
        finish: FinishReason,
        success: bool,
    },
}

/// Asks `env` about `turn` (its text, the stop token left out) under `limits`, tokenizing
/// the observation alone with `tokenizer`.
pub fn answer(
    env: &mut dyn Environment,
    turn: &Turn,
    stop_tokens: &[u32],
    tokenizer: &Tokenizer,
    limits: &EpisodeLimits,
) -> Result<Answer, EnvError> {
    let action = turn_text(turn, stop_tokens, tokenizer)?;
    let step = match crate::model::fault::contain(|| env.step(&action)) {
        Ok(step) => step?,
        Err(panic) => return Err(EnvError::Panic(panic)),
    };
    into_answer(step, turn, tokenizer, limits)
}

/// The text of `turn` as the environment reads it: the stop token left out. A turn that
/// does not decode is an environment-side failure of the episode.
pub fn turn_text(
    turn: &Turn,
    stop_tokens: &[u32],
    tokenizer: &Tokenizer,
) -> Result<String, EnvError> {
    tokenizer
        .decode(without_stop(&turn.tokens, stop_tokens))
        .map_err(|e| EnvError::Observation(format!("the model's turn does not decode: {e}")))
}

/// A turn's ids with its final stop token (one of `stop_tokens`) left out.
pub fn without_stop<'a>(ids: &'a [u32], stop_tokens: &[u32]) -> &'a [u32] {
    match ids.split_last() {
        Some((last, rest)) if stop_tokens.contains(last) => rest,
        _ => ids,
    }
}

/// What a step of the environment does to the episode of `turn`.
pub fn into_answer(
    step: super::Step,
    turn: &Turn,
    tokenizer: &Tokenizer,
    limits: &EpisodeLimits,
) -> Result<Answer, EnvError> {
    if !step.reward.is_finite() {
        return Err(EnvError::Step(format!(
            "reward {} is not finite",
            step.reward
        )));
    }
    if step.done {
        return Ok(Answer::End {
            reward: Some(step.reward),
            finish: FinishReason::Stop,
            success: step.success,
        });
    }
    if turn.number >= limits.turns {
        return Ok(Answer::End {
            reward: Some(step.reward),
            finish: FinishReason::Length,
            success: false,
        });
    }
    let observation = tokenizer
        .encode(&step.observation)
        .map_err(|e| EnvError::Observation(e.to_string()))?;
    if observation.is_empty() {
        return Err(EnvError::Observation(
            "an episode that goes on needs a non-empty observation".into(),
        ));
    }
    Ok(Answer::Continue {
        reward: step.reward,
        observation,
    })
}

/// Plays `games` (a request of `n` episodes, and a maker of one environment per episode)
/// to the end with `model` at `version`. An environment that fails ends its episode, which
/// is left out of the result (its reason in the second list).
#[allow(clippy::type_complexity)]
pub fn play<B: Kernels>(
    model: &Policy<B>,
    version: u64,
    games: &[(Request, &dyn Fn() -> Result<Box<dyn Environment>, EnvError>)],
    limits: &EpisodeLimits,
    tokenizer: &Tokenizer,
) -> Result<(Vec<Episode>, Vec<EnvError>), ModelError> {
    let mut g = Generator::new();
    let mut envs: HashMap<(u64, usize), Box<dyn Environment>> = HashMap::new();
    let mut stops: HashMap<u64, Vec<u32>> = HashMap::new();
    let (mut out, mut failed) = (Vec::new(), Vec::new());
    for (req, make) in games {
        stops.insert(req.id, req.params.stop_tokens.clone());
        for i in 0..req.n {
            match make() {
                Ok(env) => {
                    envs.insert((req.id, i), env);
                }
                Err(e) => return Err(ModelError::Unsupported(e.to_string())),
            }
        }
        g.admit_episode(model, version, req, limits.turn)?;
    }
    loop {
        let turns = g.take_turns();
        for turn in turns {
            let key = (turn.request_id, turn.index);
            let Some(env) = envs.get_mut(&key) else {
                continue;
            };
            let stop = stops.get(&turn.request_id).map_or(&[][..], Vec::as_slice);
            match answer(env.as_mut(), &turn, stop, tokenizer, limits) {
                Ok(Answer::Continue {
                    reward,
                    observation,
                }) => {
                    let r = g.resume(key.0, key.1, Some(reward), &observation, model, version)?;
                    if let Some(Resumed::Finished(c)) = r {
                        out.push(Episode {
                            completion: *c,
                            success: false,
                        });
                    }
                }
                Ok(Answer::End {
                    reward,
                    finish,
                    success,
                }) => {
                    if let Some(c) = g.end(key.0, key.1, reward, finish) {
                        out.push(Episode {
                            completion: c,
                            success,
                        });
                    }
                }
                Err(e) => {
                    g.end(key.0, key.1, None, FinishReason::Length);
                    failed.push(e);
                }
            }
        }
        if g.is_idle() {
            break;
        }
        // Rows that ran out of room end here; parked rows wait for the loop's next round.
        out.extend(g.step(model, version)?.into_iter().map(|c| Episode {
            completion: c,
            success: false,
        }));
    }
    out.sort_by_key(|e| (e.completion.request_id, e.completion.index));
    Ok((out, failed))
}

//! `guess`: a number-guessing game a small character model can learn on a CPU.
//!
//! The prompt is `guess 1-N:` (N from 10 to 30); the secret is drawn from 1..=N and kept
//! in the prompt's meta, out of the model's sight. Each model turn is a number and a stop
//! token. The game answers `+` (the secret is higher), `-` (lower) or `?` (not a number in
//! 1..=N), each worth −0.1; the right number is worth +1 and ends the game, as does the
//! [`MAX_TURNS`]-th wrong guess. An episode's return is `1 − 0.1·(turns − 1)` when solved,
//! so the reward falls with the turns used, and perfect bisection needs at most 5.
//!
//! A transcript, with `|` for the model's stop token: `guess 1-20:10|-5|+7|`.

use super::{EnvError, Environment, Step};
use rand::Rng;
use std::collections::BTreeMap;

/// The environment's name (meta `env`).
pub const NAME: &str = "guess";
/// Meta keys of the game.
pub const SECRET: &str = "secret";
pub const TOP: &str = "top";
/// Wrong guesses that end the game.
pub const MAX_TURNS: u32 = 6;
/// Reward of a wrong guess, and of the right one.
pub const MISS: f32 = -0.1;
pub const HIT: f32 = 1.0;
/// Range of N.
pub const TOPS: std::ops::RangeInclusive<u32> = 10..=30;
/// Most tokens of one guess: two digits and the stop token.
pub const TURN_TOKENS: u32 = 3;

/// One game.
#[derive(Debug, Clone, PartialEq)]
pub struct Guess {
    pub secret: u32,
    pub top: u32,
    turns: u32,
}

/// The answer to a guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clue {
    Higher,
    Lower,
    Invalid,
    Right,
}

impl Clue {
    fn text(self) -> &'static str {
        match self {
            Clue::Higher => "+",
            Clue::Lower => "-",
            Clue::Invalid => "?",
            Clue::Right => "",
        }
    }
}

impl Guess {
    pub fn new(secret: u32, top: u32) -> Self {
        Guess {
            secret,
            top,
            turns: 0,
        }
    }

    /// The game a prompt's meta describes.
    pub fn from_meta(meta: &BTreeMap<String, String>) -> Result<Self, EnvError> {
        let get = |key: &str| -> Result<u32, EnvError> {
            let v = meta
                .get(key)
                .ok_or_else(|| EnvError::Setup(format!("a `{NAME}` prompt needs meta `{key}`")))?;
            v.parse()
                .map_err(|_| EnvError::Setup(format!("meta `{key}` = {v:?} is not a whole number")))
        };
        let (secret, top) = (get(SECRET)?, get(TOP)?);
        if !(1..=top).contains(&secret) {
            return Err(EnvError::Setup(format!(
                "meta `{SECRET}` = {secret} is outside 1..={top}"
            )));
        }
        Ok(Guess::new(secret, top))
    }

    /// The prompt of a game over 1..=top.
    pub fn prompt(top: u32) -> String {
        format!("guess 1-{top}:")
    }

    /// The meta of a game.
    pub fn meta(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (super::ENV.to_string(), NAME.to_string()),
            (SECRET.to_string(), self.secret.to_string()),
            (TOP.to_string(), self.top.to_string()),
        ])
    }

    /// What the game says to `action`, without playing it.
    pub fn clue(&self, action: &str) -> Clue {
        match action.trim().parse::<u32>() {
            Ok(g) if g == self.secret => Clue::Right,
            Ok(g) if (1..=self.top).contains(&g) && g < self.secret => Clue::Higher,
            Ok(g) if (1..=self.top).contains(&g) => Clue::Lower,
            _ => Clue::Invalid,
        }
    }
}

impl Environment for Guess {
    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        self.turns += 1;
        let clue = self.clue(action);
        let right = clue == Clue::Right;
        let done = right || self.turns >= MAX_TURNS;
        Ok(Step {
            observation: if done {
                String::new()
            } else {
                clue.text().to_string()
            },
            reward: if right { HIT } else { MISS },
            done,
            success: right,
        })
    }
}

/// A scripted, noisy bisection player: the warm start's demonstrations. It keeps the
/// interval the clues leave and guesses its middle, except that with probability `noise`
/// it guesses anywhere in the interval. Returns its guesses, the last one right.
pub fn noisy_bisection(game: &Guess, noise: f64, rng: &mut impl Rng) -> Vec<u32> {
    let (mut lo, mut hi) = (1, game.top);
    let mut guesses = Vec::new();
    loop {
        let g = if rng.random_bool(noise) {
            rng.random_range(lo..=hi)
        } else {
            (lo + hi) / 2
        };
        guesses.push(g);
        match g.cmp(&game.secret) {
            std::cmp::Ordering::Equal => return guesses,
            std::cmp::Ordering::Less => lo = g + 1,
            std::cmp::Ordering::Greater => hi = g - 1,
        }
    }
}

/// Share of a demonstration player's guesses made anywhere in the interval instead of its
/// middle.
pub const DEMO_NOISE: f64 = 0.3;

/// A game played by [`noisy_bisection`] (replayed until it wins within [`MAX_TURNS`]),
/// written as the completion an episode would record: each guess and the stop token
/// `stop` (the model's), then the game's answer (the environment's). Returns the tokens
/// and, per token, whether it is the model's.
pub fn demonstration(
    game: &Guess,
    noise: f64,
    rng: &mut impl Rng,
    encode: impl Fn(&str) -> Vec<u32>,
    stop: u32,
) -> (Vec<u32>, Vec<bool>) {
    let guesses = loop {
        let g = noisy_bisection(game, noise, rng);
        if g.len() <= MAX_TURNS as usize {
            break g;
        }
    };
    let turns: Vec<String> = guesses.iter().map(u32::to_string).collect();
    super::transcript(&mut game.clone(), &turns, encode, stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_game_answers_and_ends() {
        let mut g = Guess::new(7, 20);
        let s = g.step("10").expect("step");
        assert_eq!(
            (s.observation.as_str(), s.reward, s.done),
            ("-", MISS, false)
        );
        assert_eq!(g.step("3").expect("step").observation, "+");
        assert_eq!(g.step("x").expect("step").observation, "?");
        assert_eq!(g.step("21").expect("step").observation, "?");
        let s = g.step(" 7 ").expect("step");
        assert!(s.done && s.success && s.reward == HIT && s.observation.is_empty());
        let mut g = Guess::new(7, 20);
        for t in 1..=MAX_TURNS {
            let s = g.step("1").expect("step");
            assert_eq!(s.done, t == MAX_TURNS, "turn {t}");
            assert!(!s.success);
        }
    }

    #[test]
    fn meta_round_trips_and_bad_meta_is_refused() {
        let g = Guess::new(12, 30);
        assert_eq!(Guess::from_meta(&g.meta()), Ok(g.clone()));
        for (key, value) in [(SECRET, "31"), (SECRET, "x"), (TOP, "0")] {
            let mut meta = g.meta();
            meta.insert(key.into(), value.into());
            assert!(Guess::from_meta(&meta).is_err(), "{key}={value}");
        }
        let mut meta = g.meta();
        meta.remove(SECRET);
        assert!(matches!(
            super::super::make(&meta).err(),
            Some(EnvError::Setup(_))
        ));
    }

    #[test]
    fn a_demonstration_is_the_transcript_of_a_won_game() {
        let tok = crate::model::tokenizer::CharTokenizer::new("0123456789+-?");
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let game = Guess::new(13, 20);
        let (tokens, own) = demonstration(&game, 0.0, &mut rng, |t| tok.encode(t), 0);
        // 10 (lower) → 15 (higher) → 12 (lower) … bisection of 1..=20 for 13: 10, 15, 12, 13.
        let text: String = tokens
            .iter()
            .map(|&t| {
                if t == 0 {
                    '|'
                } else {
                    tok.decode(&[t])
                        .expect("char")
                        .chars()
                        .next()
                        .unwrap_or('?')
                }
            })
            .collect();
        assert_eq!(text, "10|+15|-12|+13|");
        let env_chars: String = text
            .chars()
            .zip(&own)
            .filter(|(_, o)| !**o)
            .map(|(c, _)| c)
            .collect();
        assert_eq!(env_chars, "+-+");
    }

    #[test]
    fn bisection_without_noise_needs_at_most_five_guesses() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for top in TOPS {
            for secret in 1..=top {
                let game = Guess::new(secret, top);
                let guesses = noisy_bisection(&game, 0.0, &mut rng);
                assert!(guesses.len() <= 5, "{top} {secret}: {guesses:?}");
                assert_eq!(guesses.last(), Some(&secret));
                let noisy = noisy_bisection(&game, 0.5, &mut rng);
                assert_eq!(noisy.last(), Some(&secret));
            }
        }
    }
}

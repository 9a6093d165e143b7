//! `calc`: a tool-use task. The question is a product of two 2-digit numbers, which a small
//! character model cannot work out in its head; it can call a calculator and copy the
//! result.
//!
//! The prompt is `37*48=`; the meta holds the expression. Each model turn is either a tool
//! call, `calc ` and an expression `<a><op><b>` (op `+`, `-` or `*`, whole numbers), or the
//! final answer (anything else). A valid call is answered `=<result>.`, an invalid one
//! (`calc ` and no expression) `?`; both are worth 0 and the model goes on. The answer ends
//! the episode: 1 when it is the product, 0 otherwise. The [`MAX_CALLS`]+1-th call ends it
//! with 0.
//!
//! A transcript, with `|` for the model's stop token: `37*48=calc 37*48|=1776.1776|`.
//!
//! `examples/calc_env.py` is the same environment as a process speaking the external
//! protocol ([`super::external`]); a test checks that both answer alike.

use super::{EnvError, Environment, Step};
use rand::Rng;
use std::collections::BTreeMap;

/// The environment's name (meta `env`).
pub const NAME: &str = "calc";
/// Meta key of the question's expression.
pub const EXPR: &str = "expr";
/// What starts a tool call.
pub const CALL: &str = "calc ";
/// Calls allowed before the answer.
pub const MAX_CALLS: u32 = 2;
/// Range of the operands.
pub const OPERANDS: std::ops::RangeInclusive<i64> = 10..=99;
/// Most tokens of one turn: `calc 99*99` and the stop token.
pub const TURN_TOKENS: u32 = 11;

/// What a model turn is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A call whose expression parses: its value.
    Call(i64),
    /// A call whose expression does not parse.
    BadCall,
    /// The final answer.
    Answer(String),
}

/// Reads a model turn.
pub fn classify(action: &str) -> Action {
    let action = action.trim_start();
    let Some(expr) = action.strip_prefix(CALL.trim_end()) else {
        return Action::Answer(action.trim().to_string());
    };
    match eval(expr.trim()) {
        Some(v) => Action::Call(v),
        None => Action::BadCall,
    }
}

/// The value of `<a><op><b>` (whole numbers of at most 6 digits, op `+ - *`).
pub fn eval(expr: &str) -> Option<i64> {
    let at = expr
        .char_indices()
        .skip(1)
        .find(|(_, c)| matches!(c, '+' | '-' | '*'))?;
    let (a, b) = (&expr[..at.0], &expr[at.0 + 1..]);
    let num = |s: &str| -> Option<i64> {
        let digits = s.strip_prefix('-').unwrap_or(s);
        if digits.is_empty() || digits.len() > 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let (a, b) = (num(a)?, num(b)?);
    Some(match at.1 {
        '+' => a + b,
        '-' => a - b,
        _ => a * b,
    })
}

/// One question.
#[derive(Debug, Clone, PartialEq)]
pub struct Calc {
    pub expr: String,
    answer: i64,
    calls: u32,
}

impl Calc {
    /// The question `a*b`.
    pub fn new(a: i64, b: i64) -> Self {
        Calc {
            expr: format!("{a}*{b}"),
            answer: a * b,
            calls: 0,
        }
    }

    /// A question drawn from `rng`.
    pub fn draw(rng: &mut impl Rng) -> Self {
        Calc::new(rng.random_range(OPERANDS), rng.random_range(OPERANDS))
    }

    /// The question a prompt's meta describes.
    pub fn from_meta(meta: &BTreeMap<String, String>) -> Result<Self, EnvError> {
        let expr = meta
            .get(EXPR)
            .ok_or_else(|| EnvError::Setup(format!("a `{NAME}` prompt needs meta `{EXPR}`")))?;
        let answer = eval(expr).ok_or_else(|| {
            EnvError::Setup(format!("meta `{EXPR}` = {expr:?} is not `<a><op><b>`"))
        })?;
        Ok(Calc {
            expr: expr.clone(),
            answer,
            calls: 0,
        })
    }

    pub fn prompt(&self) -> String {
        format!("{}=", self.expr)
    }

    pub fn answer(&self) -> i64 {
        self.answer
    }

    pub fn meta(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (super::ENV.to_string(), NAME.to_string()),
            (EXPR.to_string(), self.expr.clone()),
        ])
    }
}

impl Environment for Calc {
    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        let go_on = |observation: String| Step {
            observation,
            reward: 0.0,
            done: false,
            success: false,
        };
        match classify(action) {
            Action::Answer(a) => {
                let right = a == self.answer.to_string();
                Ok(Step {
                    observation: String::new(),
                    reward: if right { 1.0 } else { 0.0 },
                    done: true,
                    success: right,
                })
            }
            _ if self.calls >= MAX_CALLS => Ok(Step {
                observation: String::new(),
                reward: 0.0,
                done: true,
                success: false,
            }),
            Action::Call(v) => {
                self.calls += 1;
                Ok(go_on(format!("={v}.")))
            }
            Action::BadCall => {
                self.calls += 1;
                Ok(go_on("?".into()))
            }
        }
    }
}

/// How a demonstration player plays: it calls the tool with probability `call`; a call
/// is garbled (the second operand left out) with probability `garble`, after which the
/// player answers from its head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Player {
    pub call: f64,
    pub garble: f64,
}

/// The warm start's player: half its answers come from its head, and a quarter of its
/// calls are garbled, so RL has calls to learn and calls to mend.
pub const DEMO_PLAYER: Player = Player {
    call: 0.5,
    garble: 0.25,
};

/// A question played by `player`, written as the completion an episode records: each turn
/// and the stop token `stop` (the model's), the calculator's answers (the environment's).
/// An answer from the head is the right product: what a demonstrator knows, and what the
/// model cannot learn. Returns the tokens and, per token, whether it is the model's.
pub fn demonstration(
    q: &Calc,
    player: Player,
    rng: &mut impl Rng,
    encode: impl Fn(&str) -> Vec<u32>,
    stop: u32,
) -> (Vec<u32>, Vec<bool>) {
    let mut turns = Vec::new();
    if rng.random_bool(player.call) {
        if rng.random_bool(player.garble) {
            let first = q.expr.split('*').next().unwrap_or_default();
            turns.push(format!("{CALL}{first}*"));
        } else {
            turns.push(format!("{CALL}{}", q.expr));
        }
    }
    turns.push(q.answer.to_string());
    super::transcript(&mut q.clone(), &turns, encode, stop)
}

/// Tool use in one episode: calls made and valid, read off the model's turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolUse {
    pub calls: u32,
    pub valid: u32,
}

impl ToolUse {
    /// Of the turns' texts.
    pub fn of<'a>(turns: impl IntoIterator<Item = &'a str>) -> Self {
        let mut t = ToolUse::default();
        for turn in turns {
            match classify(turn) {
                Action::Call(_) => {
                    t.calls += 1;
                    t.valid += 1;
                }
                Action::BadCall => t.calls += 1,
                Action::Answer(_) => {}
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn calls_are_answered_and_the_answer_ends_the_episode() {
        let mut q = Calc::new(37, 48);
        assert_eq!(q.prompt(), "37*48=");
        let s = q.step("calc 37*48").expect("step");
        assert_eq!(
            (s.observation.as_str(), s.reward, s.done),
            ("=1776.", 0.0, false)
        );
        let s = q.step("calc 37*").expect("step");
        assert_eq!((s.observation.as_str(), s.done), ("?", false));
        // Calls used up: the next call ends it.
        let mut spent = q.clone();
        let s = spent.step("calc 1+1").expect("step");
        assert!(s.done && !s.success && s.reward == 0.0);
        let s = q.step(" 1776 ").expect("step");
        assert!(s.done && s.success && s.reward == 1.0 && s.observation.is_empty());
        let s = Calc::new(37, 48).step("1777").expect("step");
        assert!(s.done && !s.success && s.reward == 0.0);
    }

    #[test]
    fn expressions_parse_strictly() {
        assert_eq!(eval("12+30"), Some(42));
        assert_eq!(eval("-5*3"), Some(-15));
        assert_eq!(eval("10-99"), Some(-89));
        for bad in ["", "12", "12*", "*3", "1 2*3", "12*3x", "1234567*2", "2**3"] {
            assert_eq!(eval(bad), None, "{bad:?}");
        }
        assert_eq!(classify("calc 2*3"), Action::Call(6));
        assert_eq!(classify("calc2*3"), Action::Call(6));
        assert_eq!(classify("calc 2*"), Action::BadCall);
        assert_eq!(classify("6"), Action::Answer("6".into()));
        assert_eq!(
            ToolUse::of(["calc 2*3", "calc 2*", "6"]),
            ToolUse { calls: 2, valid: 1 }
        );
    }

    #[test]
    fn meta_round_trips_and_bad_meta_is_refused() {
        let q = Calc::new(12, 34);
        assert_eq!(Calc::from_meta(&q.meta()), Ok(q.clone()));
        let mut meta = q.meta();
        meta.insert(EXPR.into(), "12*".into());
        assert!(matches!(Calc::from_meta(&meta), Err(EnvError::Setup(_))));
        meta.remove(EXPR);
        assert!(matches!(super::super::make(&meta), Err(EnvError::Setup(_))));
    }

    #[test]
    fn demonstrations_call_answer_and_garble_as_told() {
        let tok = crate::model::tokenizer::CharTokenizer::new("0123456789+-*=.? acl");
        let text = |tokens: &[u32]| -> String {
            tokens
                .iter()
                .map(|&t| {
                    if t == 0 {
                        "|".to_string()
                    } else {
                        tok.decode(&[t]).unwrap_or_default()
                    }
                })
                .collect()
        };
        let q = Calc::new(37, 48);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let always = Player {
            call: 1.0,
            garble: 0.0,
        };
        let (tokens, own) = demonstration(&q, always, &mut rng, |t| tok.encode(t), 0);
        assert_eq!(text(&tokens), "calc 37*48|=1776.1776|");
        let env: String = text(&tokens)
            .chars()
            .zip(&own)
            .filter(|(_, o)| !**o)
            .map(|(c, _)| c)
            .collect();
        assert_eq!(env, "=1776.");
        let garbled = Player {
            call: 1.0,
            garble: 1.0,
        };
        let (tokens, _) = demonstration(&q, garbled, &mut rng, |t| tok.encode(t), 0);
        assert_eq!(text(&tokens), "calc 37*|?1776|");
        let head = Player {
            call: 0.0,
            garble: 0.0,
        };
        let (tokens, _) = demonstration(&q, head, &mut rng, |t| tok.encode(t), 0);
        assert_eq!(text(&tokens), "1776|");
        // Every call fits a turn.
        let longest = format!("{CALL}99*99");
        assert_eq!(tok.encode(&longest).len() as u32 + 1, TURN_TOKENS);
    }
}

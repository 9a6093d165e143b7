//! Built-in tasks (prompt generators with verifiers) and datasets (JSONL, Parquet).
//!
//! A task turns an index into a prompt with a reference answer, and scores a completion
//! against the answer with a reward in [0, 1]. Built-in tasks share one character alphabet
//! ([`ALPHABET`]) so one small character-level policy can learn any of them.

mod dataset;
mod item;
mod verify;

pub use dataset::{Columns, Dataset, DatasetError, DatasetItem, Unit, held_out_share};
pub use item::{ANSWER, TaskItem, VERIFIER};
pub use verify::Verifier;

use crate::model::tokenizer::CharTokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

/// Characters of the built-in tasks' tokenizer (ids 0 and 1 are end-of-sequence and unknown).
pub const ALPHABET: &str = "0123456789+-=*abcdefghijklmnopqrstuvwxyz .,?!:";

/// The character tokenizer every built-in task uses.
pub fn char_tokenizer() -> CharTokenizer {
    CharTokenizer::new(ALPHABET)
}

/// One prompt in this many belongs to the held-out split.
pub const HELD_OUT_EVERY: u64 = 10;
/// Seed of the held-out stream ([`BuiltinTask::held_out_item`]).
const EVAL_SEED: u64 = 0x0e7a_15e7;

/// Whether `prompt` is held out: a property of its text alone (a stable hash, see
/// [`crate::seed`]), so no training stream of any seed or task shares a prompt with the
/// evaluation set.
pub fn held_out(prompt: &str) -> bool {
    crate::seed::mix(crate::seed::fnv1a(prompt.as_bytes())).is_multiple_of(HELD_OUT_EVERY)
}

/// Built-in tasks.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum BuiltinTask {
    /// `a+b=` → the sum; exact match. Operands up to `digits` digits.
    Add,
    /// `rev:word=` → the word reversed; exact match. Words of 1 to 8 letters, so completion
    /// lengths vary.
    Reverse,
    /// `sort:digits=` → the digits sorted; partial credit per position.
    Sort,
    /// `sort:digits=` with 2 to 16 digits: completion lengths vary eightfold, so a batch
    /// that waits for its longest completion wastes most of its rows.
    Longsort,
    /// `sort:digits=` with 7 to 9 digits, warm-started on `sort`'s 3 to 6: demonstrations
    /// exist only for shorter inputs, the reward for these. More supervised training on the
    /// demonstrations cannot reach what RL reaches here.
    Longer,
    /// `guess 1-N:` → a multi-turn number-guessing game ([`crate::env::guess`]): the
    /// environment answers each guess with higher/lower, the reward falls with the turns
    /// used. Warm-started on a noisy bisection player's games.
    Guess,
    /// `37*48=` → a tool-use episode ([`crate::env::calc`]): the model may call a
    /// calculator (`calc 37*48`), reads its answer, then answers; 1 for the right product.
    /// Warm-started on a player that calls the tool for half the questions and garbles a
    /// quarter of its calls.
    Calc,
}

crate::enum_setting!(BuiltinTask);

impl BuiltinTask {
    pub const ALL: [BuiltinTask; 7] = [
        BuiltinTask::Add,
        BuiltinTask::Reverse,
        BuiltinTask::Sort,
        BuiltinTask::Longsort,
        BuiltinTask::Longer,
        BuiltinTask::Guess,
        BuiltinTask::Calc,
    ];

    /// Whether the task is played as multi-turn episodes with an environment.
    pub fn is_episode(self) -> bool {
        matches!(self, BuiltinTask::Guess | BuiltinTask::Calc)
    }

    /// Longest reference answer in tokens, end-of-sequence included (for an episode task:
    /// the longest model turn).
    pub fn max_answer_tokens(self) -> u32 {
        match self {
            BuiltinTask::Guess => crate::env::guess::TURN_TOKENS,
            BuiltinTask::Calc => crate::env::calc::TURN_TOKENS,
            BuiltinTask::Add => 4,
            BuiltinTask::Reverse => 9,
            BuiltinTask::Sort => 7,
            BuiltinTask::Longsort => 17,
            BuiltinTask::Longer => 10,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BuiltinTask::Add => "add",
            BuiltinTask::Reverse => "reverse",
            BuiltinTask::Sort => "sort",
            BuiltinTask::Longsort => "longsort",
            BuiltinTask::Longer => "longer",
            BuiltinTask::Guess => "guess",
            BuiltinTask::Calc => "calc",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    fn verifier(self) -> Verifier {
        match self {
            BuiltinTask::Add | BuiltinTask::Reverse | BuiltinTask::Guess | BuiltinTask::Calc => {
                Verifier::Exact
            }
            BuiltinTask::Sort | BuiltinTask::Longsort | BuiltinTask::Longer => Verifier::Positional,
        }
    }

    /// The task whose reference answers a warm start imitates: `sort` for `longer`, the
    /// task itself otherwise.
    pub fn demonstrations(self) -> BuiltinTask {
        match self {
            BuiltinTask::Longer => BuiltinTask::Sort,
            t => t,
        }
    }

    /// The id of prompt number `index` of this task's stream (`sort-000042`).
    pub fn prompt_id(self, index: u64) -> String {
        format!("{}-{index:06}", self.name())
    }

    /// Training prompt number `index` of the stream seeded by `seed` (deterministic): never
    /// a held-out prompt ([`held_out`]), whatever the seed.
    pub fn item(self, seed: u64, index: u64) -> TaskItem {
        self.draw(seed, index, false)
    }

    /// Held-out prompt number `index`: the evaluation set, the same for every run.
    pub fn held_out_item(self, index: u64) -> TaskItem {
        self.draw(EVAL_SEED, index, true)
    }

    /// The first prompt of the stream at `(seed, index)` on the chosen side of the split.
    ///
    /// `guess` has no split: its 420 games (21 ranges × their secrets) are all played in
    /// training, and the policy never sees a game's secret, so a game cannot be learned by
    /// heart; it is evaluated on fresh draws of the same games from the evaluation stream.
    fn draw(self, seed: u64, index: u64, held: bool) -> TaskItem {
        let mut rng = StdRng::seed_from_u64(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        loop {
            let (prompt, answer) = self.sample(&mut rng);
            if self == BuiltinTask::Guess || held_out(&prompt) == held {
                return self.with_meta(prompt, answer);
            }
        }
    }

    fn sample(self, rng: &mut StdRng) -> (String, String) {
        match self {
            BuiltinTask::Guess => {
                let top = rng.random_range(crate::env::guess::TOPS);
                let secret = rng.random_range(1..=top);
                (crate::env::guess::Guess::prompt(top), secret.to_string())
            }
            BuiltinTask::Calc => {
                let q = crate::env::calc::Calc::draw(rng);
                (q.prompt(), q.answer().to_string())
            }
            BuiltinTask::Add => {
                let (a, b) = (rng.random_range(0..100u32), rng.random_range(0..100u32));
                (format!("{a}+{b}="), (a + b).to_string())
            }
            BuiltinTask::Reverse => {
                let len = rng.random_range(1..=8);
                let word: String = (0..len)
                    .map(|_| (b'a' + rng.random_range(0..26u8)) as char)
                    .collect();
                (format!("rev:{word}="), word.chars().rev().collect())
            }
            BuiltinTask::Sort | BuiltinTask::Longsort | BuiltinTask::Longer => {
                let len = match self {
                    BuiltinTask::Sort => rng.random_range(3..=6),
                    BuiltinTask::Longer => rng.random_range(7..=9),
                    _ => rng.random_range(2..=16),
                };
                let digits: String = (0..len)
                    .map(|_| (b'0' + rng.random_range(0..10u8)) as char)
                    .collect();
                let mut sorted: Vec<char> = digits.chars().collect();
                sorted.sort_unstable();
                (format!("sort:{digits}="), sorted.into_iter().collect())
            }
        }
    }

    fn with_meta(self, prompt: String, answer: String) -> TaskItem {
        if self == BuiltinTask::Calc {
            // The calculator environment scores it: the meta names it and the question.
            let expr = prompt.strip_suffix('=').unwrap_or(&prompt).to_string();
            let meta = BTreeMap::from([
                (
                    crate::env::ENV.to_string(),
                    crate::env::calc::NAME.to_string(),
                ),
                (crate::env::calc::EXPR.to_string(), expr),
            ]);
            return TaskItem {
                prompt,
                answer,
                meta,
            };
        }
        if self == BuiltinTask::Guess {
            // The game, not a verifier, scores it: the meta names the environment.
            let top = prompt
                .strip_prefix("guess 1-")
                .and_then(|r| r.strip_suffix(':'))
                .and_then(|n| n.parse().ok())
                .unwrap_or(*crate::env::guess::TOPS.end());
            let secret = answer.parse().unwrap_or(1);
            let meta = crate::env::guess::Guess::new(secret, top).meta();
            return TaskItem {
                prompt,
                answer,
                meta,
            };
        }
        let meta = BTreeMap::from([
            (ANSWER.to_string(), answer.clone()),
            (VERIFIER.to_string(), self.verifier().name().to_string()),
        ]);
        TaskItem {
            prompt,
            answer,
            meta,
        }
    }
}

/// Reward of `completion` for a prompt whose meta is `meta`: the meta's verifier (or exact
/// match) against its answer. Missing answer → `None` (the scorer reports it).
pub fn score(completion: &str, meta: &BTreeMap<String, String>) -> Option<f32> {
    let answer = meta.get(ANSWER)?;
    let verifier = meta
        .get(VERIFIER)
        .and_then(|v| Verifier::from_name(v))
        .unwrap_or(Verifier::Exact);
    Some(verifier.score(completion, answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_deterministic_and_scored_by_their_verifier() {
        for task in BuiltinTask::ALL {
            let a = task.item(7, 3);
            let tokens = char_tokenizer().encode(&a.answer).len() as u32 + 1;
            assert!(tokens <= task.max_answer_tokens(), "{task:?}");
            assert_eq!(a, task.item(7, 3));
            assert_ne!(task.item(7, 3), task.item(7, 4));
            if task == BuiltinTask::Guess {
                // The game scores it: its meta describes the game, the answer its secret.
                let game = crate::env::guess::Guess::from_meta(&a.meta).expect("game meta");
                assert_eq!(game.secret.to_string(), a.answer);
                assert_eq!(score(&a.answer, &a.meta), None);
                continue;
            }
            if task == BuiltinTask::Calc {
                let q = crate::env::calc::Calc::from_meta(&a.meta).expect("calc meta");
                assert_eq!(
                    (q.prompt(), q.answer().to_string()),
                    (a.prompt.clone(), a.answer.clone())
                );
                assert_eq!(score(&a.answer, &a.meta), None);
                continue;
            }
            assert_eq!(score(&a.answer, &a.meta), Some(1.0), "{task:?}");
            let tok = char_tokenizer();
            assert!(
                !tok.encode(&a.prompt).contains(&CharTokenizer::UNK),
                "{}",
                a.prompt
            );
        }
        let s = BuiltinTask::Sort.item(1, 1);
        let mut wrong: Vec<char> = s.answer.chars().collect();
        wrong[0] = if wrong[0] == '9' { '0' } else { '9' };
        let partial = score(&wrong.into_iter().collect::<String>(), &s.meta).unwrap();
        assert!(partial > 0.0 && partial < 1.0, "{partial}");
        assert_eq!(
            score("12", &BuiltinTask::Add.item(0, 0).meta).map(|r| r <= 1.0),
            Some(true)
        );
    }

    #[test]
    fn a_dataset_share_is_held_out_by_its_rows_alone() {
        let keys: Vec<String> = (0..20_000).map(|i| format!("row {i}")).collect();
        for share in [0.0, 0.1, 0.25] {
            let held = keys.iter().filter(|k| held_out_share(k, share)).count();
            let want = share * keys.len() as f64;
            assert!(
                (held as f64 - want).abs() <= 0.01 * keys.len() as f64,
                "{share}: {held}"
            );
        }
        // A larger share holds out every row a smaller one did.
        assert!(
            keys.iter()
                .filter(|k| held_out_share(k, 0.1))
                .all(|k| held_out_share(k, 0.25))
        );
    }

    #[test]
    fn held_out_prompts_never_reach_a_training_stream() {
        use std::collections::HashSet;
        // `guess` hides its secret from the policy: it has no split (see `draw`).
        for task in BuiltinTask::ALL
            .into_iter()
            .filter(|t| *t != BuiltinTask::Guess)
        {
            let held: HashSet<String> = (0..1000).map(|i| task.held_out_item(i).prompt).collect();
            assert!(held.iter().all(|p| held_out(p)), "{task:?}");
            // Enough distinct prompts to be a real evaluation set (add has about 1,000 in
            // all, calc about 810: 1,000 draws find 63% and 57% of them).
            assert!(held.len() >= 550, "{task:?}: {}", held.len());
            for seed in [0, 1, 7, 0x0005_eed0_fa11] {
                for i in 0..5000 {
                    let p = task.item(seed, i).prompt;
                    assert!(!held.contains(&p), "{task:?} seed {seed} item {i}: {p}");
                }
            }
        }
        let games: HashSet<(String, String)> = (0..1000)
            .map(|i| {
                let it = BuiltinTask::Guess.held_out_item(i);
                (it.prompt, it.answer)
            })
            .collect();
        assert!(games.len() > 300, "{}", games.len());
        // The split is about a tenth of the prompts, and fixed by the text alone.
        let all: Vec<String> = (0..10_000u32).map(|n| format!("sort:{n:04}=")).collect();
        let share = all.iter().filter(|p| held_out(p)).count();
        assert!((800..1200).contains(&share), "{share}");
        assert_eq!(held_out("sort:0123="), held_out("sort:0123="));
    }
}

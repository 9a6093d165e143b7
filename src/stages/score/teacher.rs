//! A teacher scorer (`score --teacher DIR`): the teacher's log-prob of every sampled token.
//!
//! Each group is one batched prefill of prompt + completions through the teacher. A token's
//! log-prob is at temperature 1 over the teacher's full vocabulary: no top-k or top-p, no
//! truncation, whatever the student sampled with. With `--distill reverse-kl` they become
//! per-token rewards `coef · (teacher − behaviour log-prob)`, the negated single-sample
//! estimate of KL(student ‖ teacher) at each token (on-policy distillation as PRIME-RL's
//! `opd` and slime do it); the behaviour log-prob is the one the generator recorded, so it
//! is the student's own log-prob when it sampled at temperature 1.

use super::ScoreError;
use crate::model::logprobs::{ScoredSeq, completion_logprobs};
use crate::model::tokenizer::Tokenizer;
use crate::model::{ModelError, Policy, TrainBackend};
use crate::schema::{Floats, RolloutGroup};
use burn::tensor::backend::AutodiffBackend;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The backend the teacher runs on: the trainer's without autodiff (its fused log-prob
/// kernel on CPU).
type TeacherBackend = <TrainBackend as AutodiffBackend>::InnerBackend;

/// Why a teacher cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    #[error("teacher {dir}: {source}")]
    Load {
        dir: String,
        #[source]
        source: ModelError,
    },
    #[error(
        "teacher {dir} has another tokenizer than the student ({why}); a teacher scores the \
         student's token ids, so both must share one tokenizer (the student's is --tokenizer \
         DIR, or the built-in character tokenizer without it)"
    )]
    Tokenizer { dir: String, why: String },
}

/// A teacher model, shared by the scorer's batches.
pub struct Teacher {
    model: Arc<Mutex<Policy<TeacherBackend>>>,
}

impl Teacher {
    /// Loads the teacher in `dir` and checks that its tokenizer is the student's.
    pub fn load(dir: &Path, student: &Tokenizer) -> Result<Self, TeacherError> {
        let shown = dir.display().to_string();
        let load = |source| TeacherError::Load {
            dir: shown.clone(),
            source,
        };
        let own = Tokenizer::load(dir).map_err(load)?;
        student
            .same_as(&own)
            .map_err(|why| TeacherError::Tokenizer {
                dir: shown.clone(),
                why,
            })?;
        let model =
            crate::model::hf::load_hf::<TeacherBackend>(dir, &Default::default()).map_err(load)?;
        tracing::info!(teacher = %shown, params = model.config().num_params(), "teacher loaded");
        Ok(Teacher {
            model: Arc::new(Mutex::new(model)),
        })
    }

    /// The teacher's log-prob of every completion token of each group, in order: one
    /// prefill per group, off the async runtime. A group the teacher cannot run (an id past
    /// its vocabulary, longer than its context) is refused with the reason.
    pub async fn logprobs(&self, groups: &[&RolloutGroup]) -> Vec<Result<Vec<Floats>, ScoreError>> {
        let owned: Vec<RolloutGroup> = groups.iter().map(|g| (*g).clone()).collect();
        let model = self.model.clone();
        let n = owned.len();
        let work = tokio::task::spawn_blocking(move || {
            let Ok(model) = model.lock() else {
                return (0..owned.len())
                    .map(|_| {
                        Err(ScoreError::TeacherFailed(
                            "the teacher's lock is poisoned".into(),
                        ))
                    })
                    .collect();
            };
            owned.iter().map(|g| group_logprobs(&model, g)).collect()
        });
        match work.await {
            Ok(out) => out,
            Err(e) => (0..n)
                .map(|_| Err(ScoreError::TeacherFailed(e.to_string())))
                .collect(),
        }
    }
}

/// One group's prefill.
fn group_logprobs(
    model: &Policy<TeacherBackend>,
    g: &RolloutGroup,
) -> Result<Vec<Floats>, ScoreError> {
    model
        .config()
        .limits()
        .rollout(g)
        .map_err(ScoreError::TeacherInput)?;
    let seqs: Vec<ScoredSeq> = g
        .samples
        .iter()
        .map(|s| ScoredSeq::plain(&g.prompt_tokens, &s.tokens))
        .collect();
    let (lp, _) = completion_logprobs(model, &seqs, 1.0);
    let c = lp.dims()[1];
    let host = crate::model::host_f32(lp.into_data())
        .map_err(|e| ScoreError::TeacherFailed(e.to_string()))?;
    Ok(g.samples
        .iter()
        .enumerate()
        .map(|(i, s)| host[i * c..i * c + s.tokens.len()].to_vec().into())
        .collect())
}

/// Per-token reverse-KL rewards: `coef · (teacher − behaviour)` for each token.
pub fn reverse_kl_rewards(g: &RolloutGroup, teacher: &[Floats], coef: f32) -> Vec<Floats> {
    g.samples
        .iter()
        .zip(teacher)
        .map(|(s, t)| {
            s.logprobs
                .iter()
                .zip(t.iter())
                .map(|(&b, &t)| coef * (t - b))
                .collect::<Vec<f32>>()
                .into()
        })
        .collect()
}

//! The trainer's checkpoint layout, in one place for the trainer, `rlstream run` and
//! `rlstream replay --train`.
//!
//! Under the checkpoint root, one `step-NNNNNNNN` directory per checkpoint holds the
//! Hugging Face weights (so any checkpoint loads as a model), burn records of the model and
//! the optimizer, the trainer state (`state.json`) and the settings it ran with
//! (`train_config.toml`). `latest` names the newest complete directory; it is written last,
//! by rename, so a crash mid-checkpoint leaves the previous one in charge.

use super::{TrainerSettings, TrainerState};
use crate::model::ModelError;
use std::path::{Path, PathBuf};

/// The burn record of the model, in a checkpoint directory.
pub const MODEL_RECORD: &str = "trainer_model";
/// The burn record of the optimizer.
pub const OPTIM_RECORD: &str = "trainer_optim";
/// The trainer state, as JSON.
pub const STATE_FILE: &str = "state.json";
/// The settings the trainer ran with, as TOML.
pub const CONFIG_FILE: &str = "train_config.toml";
/// The file in the root naming the newest complete checkpoint.
pub const LATEST: &str = "latest";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {}: {what}: {source}", .dir.display())]
    Io {
        dir: PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {}: {what}: {reason}", .dir.display())]
    Format {
        dir: PathBuf,
        what: String,
        reason: String,
    },
    #[error(
        "{} is not a trainer checkpoint (no {file}); pass a step-* directory from --checkpoint-dir",
        .dir.display()
    )]
    NotACheckpoint { dir: PathBuf, file: &'static str },
    #[error("train needs --model DIR (or a checkpoint in --checkpoint-dir {})", .0.display())]
    NoModel(PathBuf),
    #[error("--kl-coef needs --model (the reference policy)")]
    NoReference,
    #[error(
        "{} is a LoRA checkpoint: it holds the adapter, not the model; pass the base it was trained on with --model DIR",
        .0.display()
    )]
    LoraBase(PathBuf),
    #[error(
        "{} holds a full fine-tuning checkpoint but LoRA was asked for (--lora-rank/--lora-from); use another --checkpoint-dir",
        .0.display()
    )]
    NotLora(PathBuf),
    #[error(
        "the LoRA checkpoint was trained on base {saved} but --model is base {found}: pass the base it was trained on"
    )]
    BaseMismatch { saved: String, found: String },
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl From<CheckpointError> for crate::stages::StageError {
    fn from(e: CheckpointError) -> Self {
        crate::stages::StageError::Own(Box::new(e))
    }
}

impl CheckpointError {
    fn io(dir: &Path, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let (dir, what) = (dir.to_path_buf(), what.into());
        move |source| CheckpointError::Io { dir, what, source }
    }

    /// A file of `dir` that did not read as what it should be.
    pub fn format(dir: &Path, what: impl Into<String>, reason: impl ToString) -> Self {
        CheckpointError::Format {
            dir: dir.to_path_buf(),
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}

/// The directory of the checkpoint taken after `step` steps.
pub fn dir_for(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// The step of a checkpoint directory named by [`dir_for`].
pub fn step_of(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// The newest complete checkpoint under `root`, if any.
pub fn latest(root: &Path) -> Option<PathBuf> {
    let name = std::fs::read_to_string(root.join(LATEST)).ok()?;
    let dir = root.join(name.trim());
    dir.join(STATE_FILE).exists().then_some(dir)
}

/// Writes the state and settings into `dir` (the weights and records are already there).
/// Files of a model directory that are not weights but that make a checkpoint a model
/// directory of its own: its tokenizer and generation settings.
const MODEL_SIDE_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    crate::model::tokenizer::CHAR_TOKENIZER_FILE,
];

/// Copies the tokenizer and generation settings of the model directory `from` (those it
/// has) into the checkpoint `dir`, so that a checkpoint serves as `--model`, `--teacher` or
/// `eval --model` as it is.
pub fn copy_tokenizer(from: &Path, dir: &Path) -> Result<(), CheckpointError> {
    for name in MODEL_SIDE_FILES {
        let src = from.join(name);
        if src.is_file() && src != dir.join(name) {
            std::fs::copy(&src, dir.join(name)).map_err(|source| CheckpointError::Io {
                dir: dir.to_path_buf(),
                what: format!("copy {}", src.display()),
                source,
            })?;
        }
    }
    Ok(())
}

pub fn write_state(
    dir: &Path,
    state: &TrainerState,
    cfg: &TrainerSettings,
) -> Result<(), CheckpointError> {
    let state = serde_json::to_string_pretty(state)
        .map_err(|e| CheckpointError::format(dir, STATE_FILE, e))?;
    std::fs::write(dir.join(STATE_FILE), state).map_err(CheckpointError::io(dir, STATE_FILE))?;
    let config =
        toml::to_string_pretty(cfg).map_err(|e| CheckpointError::format(dir, CONFIG_FILE, e))?;
    std::fs::write(dir.join(CONFIG_FILE), config).map_err(CheckpointError::io(dir, CONFIG_FILE))
}

/// The trainer state saved in `dir`.
pub fn read_state(dir: &Path) -> Result<TrainerState, CheckpointError> {
    let text = std::fs::read_to_string(dir.join(STATE_FILE))
        .map_err(CheckpointError::io(dir, STATE_FILE))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::format(dir, STATE_FILE, e))
}

/// The settings saved in `dir`.
pub fn read_settings(dir: &Path) -> Result<TrainerSettings, CheckpointError> {
    let text = std::fs::read_to_string(dir.join(CONFIG_FILE))
        .map_err(CheckpointError::io(dir, CONFIG_FILE))?;
    toml::from_str(&text).map_err(|e| CheckpointError::format(dir, CONFIG_FILE, e))
}

/// Makes `dir` the newest checkpoint of `root`: `latest` is written aside, then renamed
/// over the old one.
pub fn mark_latest(root: &Path, dir: &Path) -> Result<(), CheckpointError> {
    let name = dir
        .file_name()
        .ok_or_else(|| CheckpointError::format(dir, "name", "not a directory name"))?;
    let tmp = root.join(format!("{LATEST}.tmp"));
    std::fs::write(&tmp, name.to_string_lossy().as_bytes())
        .map_err(CheckpointError::io(root, LATEST))?;
    std::fs::rename(&tmp, root.join(LATEST)).map_err(CheckpointError::io(root, LATEST))
}

/// Makes `checkpoint` (one `step-*` directory) the newest checkpoint of a fresh checkpoint
/// root `root` (copying its files), and returns the settings it was written with, pointed
/// at `root`, and the trainer state saved in it: a trainer started on them resumes exactly
/// where that checkpoint was taken. Used to re-run training offline
/// (`rlstream replay --train`).
pub fn stage(
    checkpoint: &Path,
    root: &Path,
) -> Result<(TrainerSettings, TrainerState), CheckpointError> {
    for file in [STATE_FILE, CONFIG_FILE] {
        if !checkpoint.join(file).exists() {
            return Err(CheckpointError::NotACheckpoint {
                dir: checkpoint.to_path_buf(),
                file,
            });
        }
    }
    let mut cfg = read_settings(checkpoint)?;
    let state = read_state(checkpoint)?;
    let name = checkpoint
        .file_name()
        .ok_or_else(|| CheckpointError::format(checkpoint, "name", "not a directory name"))?;
    let dest = root.join(name);
    std::fs::create_dir_all(&dest).map_err(CheckpointError::io(&dest, "create"))?;
    let read = CheckpointError::io(checkpoint, "read");
    for entry in std::fs::read_dir(checkpoint).map_err(read)? {
        let entry = entry.map_err(CheckpointError::io(checkpoint, "read"))?;
        let is_file = entry
            .file_type()
            .map_err(CheckpointError::io(checkpoint, "read"))?
            .is_file();
        if is_file {
            std::fs::copy(entry.path(), dest.join(entry.file_name()))
                .map_err(CheckpointError::io(&dest, "copy"))?;
        }
    }
    mark_latest(root, &dest)?;
    cfg.train.checkpoint_dir = root.to_path_buf();
    Ok((cfg, state))
}

/// The policy checkpoint `dir` holds, for generation: its model, or, for a LoRA checkpoint,
/// `base` with the adapter merged in.
pub fn load_policy<B: crate::model::Kernels>(
    dir: &Path,
    base: &Path,
) -> Result<crate::model::Policy<B>, CheckpointError> {
    let device = Default::default();
    if dir.join(crate::model::lora::ADAPTER_FILE).exists() {
        Ok(crate::model::lora::load_with_adapter::<B>(base, dir, &device)?.merged())
    } else {
        Ok(crate::model::hf::load_hf(dir, &device)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_names_the_newest_complete_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(latest(root.path()), None);
        let dir = dir_for(root.path(), 3);
        assert_eq!(step_of(&dir), Some(3));
        assert_eq!(step_of(root.path()), None);
        std::fs::create_dir_all(&dir).unwrap();
        let state = TrainerState {
            step: 3,
            ..TrainerState::default()
        };
        write_state(&dir, &state, &TrainerSettings::default()).unwrap();
        assert_eq!(latest(root.path()), None, "not marked yet");
        mark_latest(root.path(), &dir).unwrap();
        assert_eq!(latest(root.path()), Some(dir.clone()));
        assert_eq!(read_state(&dir).unwrap(), state);
        assert_eq!(read_settings(&dir).unwrap(), TrainerSettings::default());
        let e = stage(root.path(), root.path()).unwrap_err().to_string();
        assert!(e.contains("is not a trainer checkpoint"), "{e}");
        std::fs::write(dir.join(STATE_FILE), "{").unwrap();
        let e = read_state(&dir).unwrap_err().to_string();
        assert!(e.contains("state.json"), "{e}");
    }
}

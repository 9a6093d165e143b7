//! `rlstream train`: reads scored groups through the `train` group, drops groups older than
//! `max_lag` versions, optimises an importance-weighted policy-gradient objective, publishes
//! weights, and checkpoints.
//!
//! Delivery: entries are acked only after the checkpoint that contains their effect is on
//! disk. On restart the trainer loads its newest checkpoint and, under the same consumer
//! name, re-reads the entries it had taken but not acked, so a crash at any point loses
//! nothing and trains nothing twice. Group ids trained since the checkpoint are remembered
//! in it, so a group published twice upstream (a scorer that crashed between publish and
//! ack) is not trained twice either.

mod config;
pub use config::*;

use super::policy::PolicySettings;
use crate::roles::{Stage, Stream};

/// What a trainer runs with: its own `[train]` section and the shared `[policy]` one. Saved
/// beside each checkpoint as `train_config.toml`, in the same sections as the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerSettings {
    pub policy: PolicySettings,
    pub train: TrainConfig,
}

use super::StageError;
use crate::bus::{Consumer, Delivery, EntryId, SharedBus, Topology};
use crate::model::hf::load_hf;
use crate::model::logprobs::{ScoredSeq, completion_logprobs};
use crate::model::{ModelError, Policy, TrainBackend};
use crate::schema::{self, Event, SchemaVersion, ScoredGroup, StepRecord};
use crate::weights::{Payload, Publisher, Transport};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Group ids remembered for de-duplication.
const REMEMBERED_GROUPS: usize = 100_000;

/// Persistent trainer state, saved as `state.json` in each checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub version: u64,
    pub step: u64,
    pub trained_groups: u64,
    pub dropped: BTreeMap<String, u64>,
    /// Recently trained group ids (de-duplication across restarts).
    pub recent_groups: VecDeque<String>,
    /// Recently dropped group ids with the reason, for accounting.
    pub recent_dropped: VecDeque<(String, String)>,
}

/// Global L2 norm of the gradients, and scaling them.
struct GradNorm<'a> {
    grads: &'a GradientsParams,
    sum_sq: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.sum_sq += g.square().sum().into_scalar().elem::<f64>();
        }
    }
}

struct GradScale<'a> {
    grads: &'a mut GradientsParams,
    factor: f32,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradScale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads
                .register::<B::InnerBackend, D>(param.id, g.mul_scalar(self.factor));
        }
    }
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, ModelError> {
    crate::model::host_f32(t.into_data())
}

/// The one value of a reduced tensor.
fn scalar<B: Backend>(t: Tensor<B, 1>) -> Result<f32, ModelError> {
    host(t)?
        .first()
        .copied()
        .ok_or_else(|| ModelError::HostCopy("a reduced tensor holds no value".into()))
}

/// The loss of a batch of groups and its statistics (everything but timing and grad norm).
pub fn loss<B: AutodiffBackend>(
    model: &Policy<B>,
    reference: Option<&Policy<B::InnerBackend>>,
    groups: &[&ScoredGroup],
    cfg: &TrainerSettings,
) -> Result<(Tensor<B, 1>, StepRecord), ModelError> {
    let device = model.device();
    let mut seqs = Vec::new();
    let mut adv = Vec::new();
    let mut behaviour = Vec::new();
    for g in groups {
        for (s, a) in g.rollout.samples.iter().zip(&g.advantages) {
            seqs.push(ScoredSeq {
                prompt: &g.rollout.prompt_tokens,
                completion: &s.tokens,
                mask: s.mask.as_ref(),
            });
            adv.push(*a);
            behaviour.push(s.logprobs.as_slice());
        }
    }
    let b = seqs.len();
    let (lp, valid) = completion_logprobs(model, &seqs, cfg.policy.temperature);
    let c = lp.dims()[1];
    let mut mu = vec![0f32; b * c];
    let mut a_tok = vec![0f32; b * c];
    for (i, (m, a)) in behaviour.iter().zip(&adv).enumerate() {
        mu[i * c..i * c + m.len()].copy_from_slice(m);
        a_tok[i * c..(i + 1) * c].fill(*a);
    }
    let mu = Tensor::<B, 2>::from_data(TensorData::new(mu, [b, c]), &device);
    let a_tok = Tensor::<B, 2>::from_data(TensorData::new(a_tok, [b, c]), &device);
    let log_ratio = (lp.clone() - mu) * valid.clone();
    let ratio = log_ratio.clone().exp();
    let per_token = match cfg.train.loss {
        LossKind::Ppo => {
            let unclipped = ratio.clone() * a_tok.clone();
            let clipped = ratio
                .clone()
                .clamp(1.0 - cfg.train.clip_eps, 1.0 + cfg.train.clip_eps_high)
                * a_tok;
            unclipped.min_pair(clipped).neg()
        }
        LossKind::Tis => {
            (ratio.clone().detach().clamp_max(cfg.train.is_cap) * a_tok * lp.clone()).neg()
        }
        LossKind::Reinforce => (ratio.clone().clamp_max(cfg.train.is_cap) * a_tok).neg(),
    };
    let n_tokens: f32 = scalar(valid.clone().sum())?.max(1.0);
    let mut total = (per_token * valid.clone()).sum().div_scalar(n_tokens);
    let mut ref_kl = 0.0;
    if let (Some(reference), true) = (reference, cfg.train.kl_coef > 0.0) {
        let (ref_lp, _) = completion_logprobs(reference, &seqs, cfg.policy.temperature);
        let ref_lp = Tensor::<B, 2>::from_inner(ref_lp);
        let d = (ref_lp - lp.clone()) * valid.clone();
        let k3 = (d.clone().exp() - d - 1.0) * valid.clone();
        let kl = k3.sum().div_scalar(n_tokens);
        ref_kl = f64::from(scalar(kl.clone().detach())?);
        total = total + kl.mul_scalar(cfg.train.kl_coef);
    }
    // Host-side statistics over real tokens.
    let (r, v, l) = (host(ratio.detach())?, host(valid)?, host(lp.detach())?);
    let (mut sum_r, mut sum_r2, mut n, mut clipped, mut r_max, mut mkl, mut nll) =
        (0f64, 0f64, 0f64, 0f64, 0f64, 0f64, 0f64);
    for i in 0..r.len() {
        if v[i] == 0.0 {
            continue;
        }
        let ri = f64::from(r[i]);
        sum_r += ri;
        sum_r2 += ri * ri;
        n += 1.0;
        r_max = r_max.max(ri);
        let out = match cfg.train.loss {
            LossKind::Ppo => {
                ri < f64::from(1.0 - cfg.train.clip_eps)
                    || ri > f64::from(1.0 + cfg.train.clip_eps_high)
            }
            LossKind::Tis | LossKind::Reinforce => ri > f64::from(cfg.train.is_cap),
        };
        clipped += f64::from(u8::from(out));
        mkl += ri - 1.0 - ri.ln();
        nll -= f64::from(l[i]);
    }
    let n = n.max(1.0);
    let rewards: Vec<f32> = groups
        .iter()
        .flat_map(|g| g.rewards.iter().copied())
        .collect();
    let stats = StepRecord {
        loss: f64::from(scalar(total.clone().detach())?),
        reward_mean: rewards.iter().map(|&x| f64::from(x)).sum::<f64>()
            / rewards.len().max(1) as f64,
        accuracy: rewards.iter().filter(|&&x| x >= 1.0).count() as f64
            / rewards.len().max(1) as f64,
        ess: if sum_r2 > 0.0 {
            sum_r * sum_r / (n * sum_r2)
        } else {
            0.0
        },
        clip_fraction: clipped / n,
        ratio_mean: sum_r / n,
        ratio_max: r_max,
        mismatch_kl: mkl / n,
        ref_kl,
        entropy: nll / n,
        groups: groups.len() as u64,
        tokens: n as u64,
        ..StepRecord::default()
    };
    Ok((total, stats))
}

/// Model, optimizer and state; one `step` per batch of groups.
pub struct Trainer {
    pub model: Policy<TrainBackend>,
    optim: burn::optim::adaptor::OptimizerAdaptor<
        burn::optim::AdamW,
        Policy<TrainBackend>,
        TrainBackend,
    >,
    reference: Option<Policy<<TrainBackend as AutodiffBackend>::InnerBackend>>,
    pub state: TrainerState,
    /// `state.recent_groups` as a set: the duplicate check runs for every incoming group.
    trained_ids: HashSet<String>,
    cfg: TrainerSettings,
}

const MODEL_RECORD: &str = "trainer_model";
const OPTIM_RECORD: &str = "trainer_optim";
const STATE_FILE: &str = "state.json";
const CONFIG_FILE: &str = "train_config.toml";
/// File in the checkpoint directory naming the newest complete checkpoint.
const LATEST: &str = "latest";

impl Trainer {
    fn optimizer(
        cfg: &TrainerSettings,
    ) -> burn::optim::adaptor::OptimizerAdaptor<
        burn::optim::AdamW,
        Policy<TrainBackend>,
        TrainBackend,
    > {
        AdamWConfig::new()
            .with_weight_decay(cfg.train.weight_decay as f32)
            .init()
    }

    /// From the newest checkpoint in `checkpoint_dir` if there is one, else from `model`.
    pub fn start(cfg: &TrainerSettings) -> Result<Self, StageError> {
        let device = Default::default();
        let (model, state, optim) = match latest_checkpoint(&cfg.train.checkpoint_dir) {
            Some(dir) => {
                let model: Policy<TrainBackend> = load_hf(&dir, &device)?;
                let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
                let record = recorder
                    .load(dir.join(MODEL_RECORD), &device)
                    .map_err(|e| {
                        StageError::Other(format!(
                            "checkpoint {}: model record: {e}",
                            dir.display()
                        ))
                    })?;
                let model = model.load_record(record);
                let optim_record = recorder
                    .load(dir.join(OPTIM_RECORD), &device)
                    .map_err(|e| {
                        StageError::Other(format!(
                            "checkpoint {}: optimizer record: {e}",
                            dir.display()
                        ))
                    })?;
                let optim = Self::optimizer(cfg).load_record(optim_record);
                let text = std::fs::read_to_string(dir.join(STATE_FILE))
                    .map_err(|e| StageError::Other(format!("checkpoint {}: {e}", dir.display())))?;
                let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
                    StageError::Other(format!("checkpoint {}: state.json: {e}", dir.display()))
                })?;
                tracing::info!(checkpoint = %dir.display(), version = state.version, "resuming");
                (model, state, optim)
            }
            None => {
                let dir = cfg.policy.model.as_ref().ok_or_else(|| {
                    StageError::Other(
                        "train needs --model DIR (or a checkpoint in --checkpoint-dir)".into(),
                    )
                })?;
                (
                    load_hf(dir, &device)?,
                    TrainerState::default(),
                    Self::optimizer(cfg),
                )
            }
        };
        let reference = if cfg.train.kl_coef > 0.0 {
            let dir = cfg.policy.model.as_ref().ok_or_else(|| {
                StageError::Other("--kl-coef needs --model (the reference)".into())
            })?;
            Some(load_hf(dir, &device)?)
        } else {
            None
        };
        Ok(Trainer {
            model,
            optim,
            reference,
            trained_ids: state.recent_groups.iter().cloned().collect(),
            state,
            cfg: cfg.clone(),
        })
    }

    /// One optimizer step on `groups`. A non-finite loss or gradient skips the step and
    /// leaves the weights untouched.
    pub fn step(&mut self, groups: &[&ScoredGroup]) -> Result<StepRecord, ModelError> {
        let started = Instant::now();
        let (loss, mut stats) = loss(&self.model, self.reference.as_ref(), groups, &self.cfg)?;
        let mut grads = GradientsParams::from_grads(loss.backward(), &self.model);
        let mut norm = GradNorm {
            grads: &grads,
            sum_sq: 0.0,
        };
        self.model.visit(&mut norm);
        let grad_norm = norm.sum_sq.sqrt();
        stats.grad_norm = grad_norm;
        if !(stats.loss.is_finite() && grad_norm.is_finite()) {
            stats.skipped = true;
            tracing::warn!(
                loss = stats.loss,
                grad_norm,
                "non-finite loss or gradient: step skipped, weights kept"
            );
        } else {
            if grad_norm > f64::from(self.cfg.train.max_grad_norm) {
                let mut scale = GradScale {
                    grads: &mut grads,
                    factor: (f64::from(self.cfg.train.max_grad_norm) / grad_norm) as f32,
                };
                self.model.visit(&mut scale);
            }
            self.model = self
                .optim
                .step(self.cfg.train.lr, self.model.clone(), grads);
            self.state.version += 1;
            self.state.step += 1;
            self.state.trained_groups += groups.len() as u64;
            for g in groups {
                self.state
                    .recent_groups
                    .push_back(g.rollout.group_id.clone());
                self.trained_ids.insert(g.rollout.group_id.clone());
            }
            while self.state.recent_groups.len() > REMEMBERED_GROUPS {
                if let Some(old) = self.state.recent_groups.pop_front() {
                    self.trained_ids.remove(&old);
                }
            }
        }
        stats.step = self.state.step;
        stats.version = self.state.version;
        stats.step_s = started.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Weights as a blob for publication.
    pub fn weights_blob(&self) -> Result<Vec<u8>, ModelError> {
        self.model.valid().to_bytes()
    }

    /// Writes a complete checkpoint, then points `latest` at it.
    pub fn checkpoint(&self) -> Result<PathBuf, StageError> {
        let root = &self.cfg.train.checkpoint_dir;
        let dir = root.join(format!("step-{:08}", self.state.step));
        let io =
            |e: std::io::Error| StageError::Other(format!("checkpoint {}: {e}", dir.display()));
        self.model.valid().save_hf(&dir)?;
        let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        recorder
            .record(self.model.clone().into_record(), dir.join(MODEL_RECORD))
            .map_err(|e| StageError::Other(format!("checkpoint {}: {e}", dir.display())))?;
        recorder
            .record(self.optim.to_record(), dir.join(OPTIM_RECORD))
            .map_err(|e| StageError::Other(format!("checkpoint {}: {e}", dir.display())))?;
        let state = serde_json::to_string_pretty(&self.state)
            .map_err(|e| StageError::Other(e.to_string()))?;
        std::fs::write(dir.join(STATE_FILE), state).map_err(io)?;
        let config =
            toml::to_string_pretty(&self.cfg).map_err(|e| StageError::Other(e.to_string()))?;
        std::fs::write(dir.join(CONFIG_FILE), config).map_err(io)?;
        let tmp = root.join(format!("{LATEST}.tmp"));
        std::fs::write(
            &tmp,
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
        .map_err(io)?;
        std::fs::rename(&tmp, root.join(LATEST)).map_err(io)?;
        Ok(dir)
    }

    fn seen(&self, group_id: &str) -> bool {
        self.trained_ids.contains(group_id)
    }
}

/// Publishes the trainer's current weights in the form the transport takes.
async fn publish_weights(trainer: &Trainer, publisher: &mut Publisher) -> Result<(), StageError> {
    let began = Instant::now();
    let payload = tokio::task::block_in_place(|| {
        if publisher.in_process() {
            trainer.model.valid().to_tensors().map(Payload::Tensors)
        } else {
            trainer.weights_blob().map(Payload::Blob)
        }
    })?;
    publisher
        .publish_payload(trainer.state.version, trainer.state.step, payload)
        .await?;
    crate::metrics::weight_sync(Stage::Train, began.elapsed().as_secs_f64());
    Ok(())
}

/// Counts a group the trainer will not train on, with the reason.
fn drop_group(state: &mut TrainerState, g: &ScoredGroup, reason: &str) {
    *state.dropped.entry(reason.to_string()).or_default() += 1;
    crate::metrics::dropped(reason, g.rollout.samples.len() as u64);
    state
        .recent_dropped
        .push_back((g.rollout.group_id.clone(), reason.to_string()));
    while state.recent_dropped.len() > REMEMBERED_GROUPS {
        state.recent_dropped.pop_front();
    }
}

/// A `step` event on the events stream: what `rlstream status` and tests read.
async fn publish_step_event(
    bus: &SharedBus,
    topo: &Topology,
    source: &str,
    s: &StepRecord,
) -> Result<(), StageError> {
    let event = Event {
        schema: SchemaVersion::CURRENT,
        kind: "step".into(),
        stage: Stage::Train.as_str().into(),
        source: source.to_string(),
        version: s.version,
        fields: s.to_fields(),
        text: None,
        time_us: schema::now_us(),
    };
    let bytes = Bytes::from(schema::encode(&event)?);
    bus.publish(
        &topo.key(Stream::Events),
        &[bytes],
        topo.max_len(Stream::Events),
    )
    .await?;
    Ok(())
}

/// Makes `checkpoint` (one `step-*` directory) the newest checkpoint of a fresh checkpoint
/// root `root` (copying its files), and returns the training config it was written with,
/// pointed at `root`: a trainer started on it resumes exactly where that checkpoint was
/// taken, and the trainer state saved in it. Used to re-run training offline
/// (`rlstream replay --train`).
pub fn stage_checkpoint(
    checkpoint: &Path,
    root: &Path,
) -> Result<(TrainerSettings, TrainerState), StageError> {
    let shown = checkpoint.display();
    let err = |what: &str, e: &dyn std::fmt::Display| {
        StageError::Other(format!("checkpoint {shown}: {what}: {e}"))
    };
    for file in [STATE_FILE, CONFIG_FILE] {
        if !checkpoint.join(file).exists() {
            return Err(StageError::Other(format!(
                "{shown} is not a trainer checkpoint (no {file}); pass a step-* directory from --checkpoint-dir"
            )));
        }
    }
    let text =
        std::fs::read_to_string(checkpoint.join(CONFIG_FILE)).map_err(|e| err(CONFIG_FILE, &e))?;
    let mut cfg: TrainerSettings = toml::from_str(&text).map_err(|e| err(CONFIG_FILE, &e))?;
    let state =
        std::fs::read_to_string(checkpoint.join(STATE_FILE)).map_err(|e| err(STATE_FILE, &e))?;
    let state: TrainerState = serde_json::from_str(&state).map_err(|e| err(STATE_FILE, &e))?;
    let name = checkpoint
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| StageError::Other(format!("{shown}: not a directory name")))?;
    let dest = root.join(&name);
    std::fs::create_dir_all(&dest).map_err(|e| err("copy", &e))?;
    for entry in std::fs::read_dir(checkpoint).map_err(|e| err("read", &e))? {
        let entry = entry.map_err(|e| err("read", &e))?;
        if entry.file_type().map_err(|e| err("read", &e))?.is_file() {
            std::fs::copy(entry.path(), dest.join(entry.file_name()))
                .map_err(|e| err("copy", &e))?;
        }
    }
    std::fs::write(root.join(LATEST), &name).map_err(|e| err("copy", &e))?;
    cfg.train.checkpoint_dir = root.to_path_buf();
    Ok((cfg, state))
}

/// The newest complete checkpoint under `root`, if any.
pub fn latest_checkpoint(root: &Path) -> Option<PathBuf> {
    let name = std::fs::read_to_string(root.join(LATEST)).ok()?;
    let dir = root.join(name.trim());
    dir.join(STATE_FILE).exists().then_some(dir)
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TrainSummary {
    pub steps: u64,
    pub version: u64,
    pub trained_groups: u64,
    pub dropped: BTreeMap<String, u64>,
    pub history: Vec<StepRecord>,
}

/// Runs the trainer until `cfg.train.steps` steps (0: until shutdown). `on_step` sees each step's
/// statistics (for progress displays and reports). `transport` says how weights reach the
/// generators ([`Transport::Bus`] unless they share this process).
pub async fn run(
    cfg: &TrainerSettings,
    bus: SharedBus,
    topo: &Topology,
    transport: Transport,
    shutdown: impl Future<Output = ()>,
    mut on_step: impl FnMut(&StepRecord),
) -> Result<TrainSummary, StageError> {
    let mut trainer = tokio::task::block_in_place(|| Trainer::start(cfg))?;
    let mut publisher = Publisher::new(bus.clone(), topo.clone(), cfg.train.keep_versions)
        .with_transport(transport);
    // Read no more than a step's worth: what the trainer has not taken stays visible as lag
    // to the generators' in-flight bound.
    let opts = crate::bus::ConsumerOptions {
        batch: cfg.policy.groups_per_step,
        ..topo.consumer_options()
    };
    let mut consumer = Consumer::<ScoredGroup>::join(
        bus.clone(),
        topo.key(Stream::Scored),
        topo.group(Stream::Scored),
        &cfg.train.name,
        topo.dead_key(),
        opts,
    )
    .await?;
    // A trainer that died after its last checkpoint may have published versions whose
    // steps are now lost; generators hold them and ignore anything not newer. Number on
    // from above them, so versions never go backwards and generators take the resumed
    // weights at once.
    if let Some(newest) = crate::weights::newest_announce(bus.as_ref(), topo).await?
        && newest.version > trainer.state.version
    {
        tracing::warn!(
            checkpoint_version = trainer.state.version,
            published = newest.version,
            "versions past the checkpoint were published before a restart; continuing at {}",
            newest.version + 1
        );
        trainer.state.version = newest.version + 1;
    }
    if trainer.state.version > 0 {
        // Resumed: publish the checkpoint's weights so generators that start from the
        // initial model (or whose weights stream was trimmed) catch up instead of producing
        // groups that are all too stale to train on.
        publish_weights(&trainer, &mut publisher).await?;
    }
    let mut summary = TrainSummary::default();
    let mut buffer: Vec<Delivery<ScoredGroup>> = Vec::new();
    let mut unacked: Vec<EntryId> = Vec::new();
    let mut waiting = Instant::now();
    let mut last_checkpoint = trainer.state.step;
    let mut heartbeat = super::Heartbeat::new(bus.clone(), topo, Stage::Train, &cfg.train.name);
    crate::metrics::started(Stage::Train);
    let _retention = crate::retention::spawn_standing(
        bus.clone(),
        topo,
        &[
            Stream::Scored.as_str(),
            Stream::Weights.as_str(),
            Stream::Events.as_str(),
            topo.dead_letter.as_str(),
        ],
        Stage::Train,
    );
    crate::metrics::holds(Stage::Train, trainer.state.version);
    tokio::pin!(shutdown);
    'outer: loop {
        if cfg.train.steps > 0 && trainer.state.step >= cfg.train.steps {
            break;
        }
        let fields = [
            ("step", trainer.state.step as f64),
            ("trained_groups", trainer.state.trained_groups as f64),
            ("buffered_groups", buffer.len() as f64),
        ];
        heartbeat.beat(trainer.state.version, &fields).await;
        let batch = tokio::select! {
            biased;
            _ = &mut shutdown => break 'outer,
            b = consumer.poll() => b?,
        };
        for d in batch {
            let g = &d.message;
            let lag = g
                .rollout
                .oldest_version()
                .map_or(0, |v| trainer.state.version.saturating_sub(v));
            let reason = if lag > cfg.policy.max_lag {
                Some("stale")
            } else if trainer.seen(&g.rollout.group_id)
                || buffer
                    .iter()
                    .any(|b| b.message.rollout.group_id == g.rollout.group_id)
            {
                Some("duplicate")
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    tracing::debug!(group = %g.rollout.group_id, lag, reason, "dropped");
                    drop_group(&mut trainer.state, g, reason);
                    unacked.push(d.id);
                }
                None => buffer.push(d),
            }
        }
        loop {
            // Staleness is judged again before each step: groups buffered across steps age.
            let version = trainer.state.version;
            let (fresh, aged): (Vec<_>, Vec<_>) = buffer.drain(..).partition(|d| {
                d.message
                    .rollout
                    .oldest_version()
                    .is_none_or(|v| version.saturating_sub(v) <= cfg.policy.max_lag)
            });
            buffer = fresh;
            for d in aged {
                drop_group(&mut trainer.state, &d.message, "stale");
                unacked.push(d.id);
            }
            if buffer.len() < cfg.policy.groups_per_step {
                break;
            }
            let taken: Vec<Delivery<ScoredGroup>> =
                buffer.drain(..cfg.policy.groups_per_step).collect();
            let groups: Vec<&ScoredGroup> = taken.iter().map(|d| &d.message).collect();
            let wait_s = waiting.elapsed().as_secs_f64();
            let version_before = trainer.state.version;
            let mut stats = tokio::task::block_in_place(|| trainer.step(&groups))?;
            stats.wait_s = wait_s;
            stats.staleness = groups
                .iter()
                .map(|g| {
                    g.rollout
                        .oldest_version()
                        .map_or(0, |v| version_before.saturating_sub(v))
                })
                .collect();
            stats.staleness_max = stats.staleness.iter().copied().max().unwrap_or(0);
            stats.staleness_mean =
                stats.staleness.iter().sum::<u64>() as f64 / stats.staleness.len().max(1) as f64;
            unacked.extend(taken.iter().map(|d| d.id));
            if stats.skipped {
                *trainer
                    .state
                    .dropped
                    .entry("nonfinite".to_string())
                    .or_default() += groups.len() as u64;
                for g in &groups {
                    crate::metrics::dropped("nonfinite", g.rollout.samples.len() as u64);
                }
            }
            stats.trained_groups = trainer.state.trained_groups;
            stats.dropped_groups = trainer.state.dropped.values().sum();
            tracing::info!(
                step = stats.step,
                version = stats.version,
                loss = format!("{:.4}", stats.loss),
                reward = format!("{:.3}", stats.reward_mean),
                ess = format!("{:.3}", stats.ess),
                clip = format!("{:.3}", stats.clip_fraction),
                grad_norm = format!("{:.3}", stats.grad_norm),
                step_s = format!("{:.3}", stats.step_s),
                "train step"
            );
            on_step(&stats);
            record_step(
                &stats,
                groups.iter().map(|g| g.rollout.samples.len() as u64).sum(),
            );
            publish_step_event(&bus, topo, &cfg.train.name, &stats).await?;
            summary.history.push(stats);
            let stepped = trainer.state.version != version_before;
            if stepped
                && trainer
                    .state
                    .version
                    .is_multiple_of(cfg.train.publish_every)
            {
                publish_weights(&trainer, &mut publisher).await?;
            }
            if trainer.state.step - last_checkpoint >= cfg.train.checkpoint_every {
                tokio::task::block_in_place(|| trainer.checkpoint())?;
                consumer.ack(&unacked).await?;
                unacked.clear();
                last_checkpoint = trainer.state.step;
            }
            waiting = Instant::now();
            if cfg.train.steps > 0 && trainer.state.step >= cfg.train.steps {
                break 'outer;
            }
        }
    }
    // Stopping: make what was trained durable, then ack it. Groups still in the buffer were
    // not trained: they stay pending and come back to this consumer after a restart.
    if trainer.state.step > last_checkpoint || !unacked.is_empty() {
        tokio::task::block_in_place(|| trainer.checkpoint())?;
        consumer.ack(&unacked).await?;
    }
    summary.steps = trainer.state.step;
    summary.version = trainer.state.version;
    summary.trained_groups = trainer.state.trained_groups;
    summary.dropped = trainer.state.dropped.clone();
    tracing::info!(
        steps = summary.steps,
        version = summary.version,
        "train stopped"
    );
    Ok(summary)
}

/// The trainer took a step (or skipped one: `s.skipped`).
fn record_step(s: &StepRecord, samples: u64) {
    use crate::metrics::*;
    use ::metrics::{counter, gauge, histogram};
    histogram!(TRAIN_WAIT_SECONDS).record(s.wait_s);
    histogram!(TRAIN_STEP_SECONDS).record(s.step_s);
    if s.skipped {
        error(Stage::Train, "nonfinite_step");
        return;
    }
    counter!(SAMPLES_TOTAL, "stage" => Stage::Train.as_str()).increment(samples);
    counter!(TOKENS_TOTAL, "stage" => Stage::Train.as_str(), "kind" => "trained")
        .increment(s.tokens);
    gauge!(POLICY_VERSION, "stage" => Stage::Train.as_str()).set(s.version as f64);
    for &lag in &s.staleness {
        histogram!(SAMPLE_STALENESS_VERSIONS).record(lag as f64);
    }
    gauge!(REWARD_MEAN).set(s.reward_mean);
    gauge!(ACCURACY).set(s.accuracy);
    gauge!(LOSS).set(s.loss);
    gauge!(IS_ESS).set(s.ess);
    gauge!(CLIP_FRACTION).set(s.clip_fraction);
    gauge!(KL).set(s.mismatch_kl);
    gauge!(ENTROPY).set(s.entropy);
    gauge!(GRAD_NORM).set(s.grad_norm);
}

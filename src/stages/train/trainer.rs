//! The trainer proper: the model, the optimizer and the persistent state; one `step` per
//! batch of groups, checkpoints written and resumed through [`super::checkpoint`].

use super::TrainerSettings;
use super::adamw::{FusedAdamW, GradScaleHandle, SquaredNorm};
use super::checkpoint::{self, CheckpointError, MODEL_RECORD, OPTIM_RECORD};
use super::config::{GradBuffers, Sharding};
use super::loss::{self, Pass, Proximal, Samples};
use super::sharded::{self, ShardedAdamW, ShardedStep};
use super::state::{REMEMBERED_GROUPS, TrainerState};
use super::sums::TokenSums;
use crate::collective::{self, Collective, ReduceDtype};
use crate::model::hf::load_hf;
use crate::model::kernels::{HEAD_CHUNK_ROWS, PackOnce};
use crate::model::layers;
use crate::model::lora::{self, LoraSpec};
use crate::model::tensors::WeightDtype;
use crate::model::{Kernels, ModelError, Policy, TrainBackend};
use crate::schema::{ScoredGroup, StepRecord};
use crate::weights::{AdapterVersion, Payload};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

/// A backend the trainer runs on: autodiff over a [`Kernels`] backend.
pub trait TrainOn: AutodiffBackend<InnerBackend: Kernels> + Kernels {}
impl<B: AutodiffBackend<InnerBackend: Kernels> + Kernels> TrainOn for B {}

type Optim<B> = OptimizerAdaptor<FusedAdamW, Policy<B>, B>;
/// The optimizer and the handle that sets its gradient factor (clipping).
type OptimParts<B> = (Optim<B>, GradScaleHandle);
type Reference<B> = Policy<<B as AutodiffBackend>::InnerBackend>;

/// Global L2 norm of the gradients, read where they are (each gradient is handed back to
/// `grads`, on the host around the same buffer).
struct GradNorm<'a, B: Backend> {
    grads: &'a mut GradientsParams,
    norm: SquaredNorm<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradNorm<'_, B::InnerBackend>
where
    B::InnerBackend: Kernels,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let g = self.norm.add(g);
            self.grads.register::<B::InnerBackend, D>(param.id, g);
        }
    }
}

/// Which parameters have a gradient (1) or none (0), in visiting order.
struct Presence<'a> {
    grads: &'a GradientsParams,
    has: Vec<f32>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Presence<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let has = self.grads.get::<B::InnerBackend, D>(param.id).is_some();
        self.has.push(f32::from(u8::from(has)));
    }
}

/// The gradients of the parameters some rank has one for, taken out of `grads` as host
/// vectors in visiting order (zeros where this rank has none).
struct TakeGrads<'a> {
    grads: &'a mut GradientsParams,
    /// Whether any rank has each parameter's gradient, in visiting order.
    has: std::slice::Iter<'a, f32>,
    pieces: Vec<Vec<f32>>,
    error: Option<ModelError>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.has.next().is_some_and(|&h| h > 0.0) {
            return;
        }
        let piece = match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => crate::model::host_f32(g.into_data()).unwrap_or_else(|e| {
                self.error = Some(e);
                Vec::new()
            }),
            None => vec![0.0; param.shape().num_elements()],
        };
        self.pieces.push(piece);
    }
}

/// The summed pieces handed back to `grads` as tensors of their parameters' shapes.
struct PutGrads<'a> {
    grads: &'a mut GradientsParams,
    has: std::slice::Iter<'a, f32>,
    pieces: std::vec::IntoIter<Vec<f32>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.has.next().is_some_and(|&h| h > 0.0) {
            return;
        }
        if let Some(piece) = self.pieces.next() {
            let data = burn::tensor::TensorData::new(piece, param.shape().dims::<D>());
            let g = Tensor::<B::InnerBackend, D>::from_data(data, &param.device());
            self.grads.register::<B::InnerBackend, D>(param.id, g);
        }
    }
}

/// The optimizer's per-parameter record written in parameter-id order. Burn keeps it in a
/// hash map, whose order (and so the checkpoint's bytes) changes from process to process;
/// a sorted map is the same MessagePack map to read back, as that hash map.
struct SortedRecord<T>(Vec<(burn::module::ParamId, T)>);

impl<T> SortedRecord<T> {
    fn new(record: impl IntoIterator<Item = (burn::module::ParamId, T)>) -> Self {
        SortedRecord(record.into_iter().collect())
    }
}

impl<T: burn::record::Record<B>, B: burn::tensor::backend::Backend> burn::record::Record<B>
    for SortedRecord<T>
{
    type Item<S: burn::record::PrecisionSettings> = BTreeMap<String, T::Item<S>>;

    fn into_item<S: burn::record::PrecisionSettings>(self) -> Self::Item<S> {
        self.0
            .into_iter()
            .map(|(id, r)| (id.serialize(), r.into_item()))
            .collect()
    }

    fn from_item<S: burn::record::PrecisionSettings>(
        item: Self::Item<S>,
        device: &B::Device,
    ) -> Self {
        SortedRecord(
            item.into_iter()
                .map(|(id, r)| {
                    (
                        burn::module::ParamId::deserialize(&id),
                        T::from_item(r, device),
                    )
                })
                .collect(),
        )
    }
}

/// Replaces each parameter by its gradient (zero where it has none), so a model's export
/// names and lays out its gradients.
struct GradsAsWeights<'a> {
    grads: &'a GradientsParams,
}

impl<B: burn::tensor::backend::Backend> burn::module::ModuleMapper<B> for GradsAsWeights<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, _) = param.consume();
        let grad = self
            .grads
            .get::<B, D>(id)
            .unwrap_or_else(|| value.zeros_like());
        Param::initialized(id, grad)
    }
}

/// The trainer on the build's backend.
pub type Trainer = TrainerOn<TrainBackend>;

/// Model, optimizer and state; one `step` per batch of groups, on backend `B`.
pub struct TrainerOn<B: TrainOn> {
    /// `None` only while the optimizer holds it: handed over rather than cloned, so the
    /// update can reuse the parameters' buffers (see [`super::adamw`]).
    model: Option<Policy<B>>,
    optim: Optim<B>,
    grad_scale: GradScaleHandle,
    reference: Option<Reference<B>>,
    pub state: TrainerState,
    /// `state.recent_groups` as a set: the duplicate check runs for every incoming group.
    trained_ids: HashSet<String>,
    cfg: TrainerSettings,
    /// LoRA: the adapter's shape and the checksum of the frozen base.
    lora: Option<Adapter>,
    /// This rank's share of the optimizer (`train.shard`), once it knows its ranks.
    sharded: Option<ShardedAdamW>,
    /// The checkpoint this trainer resumed from.
    resumed: Option<PathBuf>,
}

/// What a LoRA trainer knows of its adapter.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub spec: LoraSpec,
    /// [`Policy::base_checksum`] of the frozen base.
    pub base_checksum: String,
}

impl<B: TrainOn> TrainerOn<B> {
    fn optimizer(cfg: &TrainerSettings) -> OptimParts<B> {
        let adamw = FusedAdamW::new(cfg.train.weight_decay as f32);
        let handle = adamw.grad_scale_handle();
        (adamw.adaptor(), handle)
    }

    /// The model being trained.
    pub fn model(&self) -> &Policy<B> {
        self.model
            .as_ref()
            .expect("the trainer's model is only absent during an optimizer step")
    }

    /// From the newest checkpoint in `checkpoint_dir` if there is one, else from `model`
    /// (with a fresh adapter, or the one in `lora_from`, when training LoRA).
    pub fn start(cfg: &TrainerSettings) -> Result<Self, CheckpointError> {
        let resumed = checkpoint::latest(&cfg.train.checkpoint_dir);
        let (model, mut state, (optim, grad_scale)) = match &resumed {
            Some(dir) => Self::resume(cfg, dir)?,
            None => {
                let dir =
                    cfg.policy.model.as_ref().ok_or_else(|| {
                        CheckpointError::NoModel(cfg.train.checkpoint_dir.clone())
                    })?;
                let model = load_hf(dir, &Default::default())?;
                let model = match (&cfg.train.lora_from, cfg.train.lora()) {
                    (Some(from), _) => {
                        let (spec, tensors) = lora::read_adapter(from)?;
                        tracing::info!(adapter = %from.display(), rank = spec.rank, alpha = spec.alpha, "starting from an adapter");
                        model.with_adapter(&spec, &tensors)?
                    }
                    (None, true) => {
                        let spec = cfg.train.lora_spec().map_err(|reason| ModelError::Config {
                            field: "train.lora_targets".into(),
                            reason,
                        })?;
                        model.with_fresh_adapter(&spec, cfg.policy.seed)?
                    }
                    (None, false) => model,
                };
                (model, TrainerState::default(), Self::optimizer(cfg))
            }
        };
        let lora = match adapter_spec(&model) {
            Some(spec) => {
                let base_checksum = model.valid().base_checksum()?;
                if let Some(saved) = &state.base_checksum
                    && *saved != base_checksum
                {
                    return Err(CheckpointError::BaseMismatch {
                        saved: saved.clone(),
                        found: base_checksum,
                    });
                }
                state.base_checksum = Some(base_checksum.clone());
                tracing::info!(
                    rank = spec.rank,
                    alpha = spec.alpha,
                    adapter_params = spec.num_params(model.config()),
                    base = %base_checksum,
                    "training a LoRA adapter on a frozen base"
                );
                Some(Adapter {
                    spec,
                    base_checksum,
                })
            }
            None => None,
        };
        let reference = match (&cfg.policy.model, cfg.train.kl_coef > 0.0) {
            // The base under the adapter is the initial policy; its tensors are shared.
            (_, true) if lora.is_some() => Some(model.valid().without_adapter()),
            (Some(dir), true) => Some(load_hf(dir, &Default::default())?),
            (None, true) => return Err(CheckpointError::NoReference),
            (_, false) => None,
        };
        Ok(TrainerOn {
            model: Some(model),
            optim,
            grad_scale,
            reference,
            trained_ids: state.recent_groups.iter().cloned().collect(),
            state,
            cfg: cfg.clone(),
            lora,
            sharded: None,
            resumed,
        })
    }

    /// The adapter being trained, if this trainer trains LoRA.
    pub fn adapter(&self) -> Option<&Adapter> {
        self.lora.as_ref()
    }

    /// Model, state and optimizer as checkpoint `dir` saved them.
    fn resume(
        cfg: &TrainerSettings,
        dir: &std::path::Path,
    ) -> Result<(Policy<B>, TrainerState, OptimParts<B>), CheckpointError> {
        let device = Default::default();
        let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        if dir.join(lora::ADAPTER_FILE).exists() {
            // A LoRA checkpoint holds the adapter; the base comes from --model.
            let base = cfg
                .policy
                .model
                .as_ref()
                .ok_or_else(|| CheckpointError::LoraBase(dir.to_path_buf()))?;
            let (spec, tensors) = lora::read_adapter(dir)?;
            let model = load_hf::<B>(base, &device)?.with_adapter(&spec, &tensors)?;
            let optim = Self::optimizer_from(cfg, dir)?;
            let state = checkpoint::read_state(dir)?;
            tracing::info!(checkpoint = %dir.display(), version = state.version, "resuming a LoRA adapter");
            return Ok((model, state, optim));
        }
        if cfg.train.lora() {
            return Err(CheckpointError::NotLora(dir.to_path_buf()));
        }
        let model: Policy<B> = load_hf(dir, &device)?;
        let record = recorder
            .load(dir.join(MODEL_RECORD), &device)
            .map_err(|e| CheckpointError::format(dir, "model record", e))?;
        let optim = Self::optimizer_from(cfg, dir)?;
        let state = checkpoint::read_state(dir)?;
        tracing::info!(checkpoint = %dir.display(), version = state.version, "resuming");
        Ok((model.load_record(record), state, optim))
    }

    /// The optimizer as checkpoint `dir` saved it: burn's record of it, or, for a checkpoint
    /// written by sharded ranks, a fresh one (each rank reads its shard in
    /// [`TrainerOn::shard_over`]).
    fn optimizer_from(
        cfg: &TrainerSettings,
        dir: &std::path::Path,
    ) -> Result<OptimParts<B>, CheckpointError> {
        let (optim, grad_scale) = Self::optimizer(cfg);
        let shards = sharded::written_shards(dir)?;
        if shards > 0 {
            if cfg.train.shard == Sharding::None {
                return Err(CheckpointError::format(
                    dir,
                    "optimizer",
                    format!(
                        "written by trainer ranks with sharded optimizer state ({shards} shard \
                         files): resume with --shard optimizer or --shard gradients, at any \
                         number of ranks"
                    ),
                ));
            }
            return Ok((optim, grad_scale));
        }
        let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        let record = recorder
            .load(dir.join(OPTIM_RECORD), &Default::default())
            .map_err(|e| CheckpointError::format(dir, "optimizer record", e))?;
        Ok((optim.load_record(record), grad_scale))
    }

    /// Shards the optimizer over `world` ranks as rank `rank`, when `train.shard` asks for
    /// it: from the shard files of the checkpoint this trainer resumed, from its whole
    /// optimizer record (which is then dropped), or fresh. Every rank calls it before its
    /// first step.
    pub fn shard_over(&mut self, rank: usize, world: usize) -> Result<(), CheckpointError> {
        if self.cfg.train.shard == Sharding::None
            || self.sharded.as_ref().is_some_and(|s| s.world() == world)
        {
            return Ok(());
        }
        let decay = self.cfg.train.weight_decay as f32;
        let lens = sharded::trainable_lens(self.model());
        let from_files = match &self.resumed {
            Some(dir) => ShardedAdamW::load(dir, decay, lens.clone(), rank, world)?,
            None => None,
        };
        let state = match from_files {
            Some(s) => s,
            None => {
                let (fresh, grad_scale) = Self::optimizer(&self.cfg);
                let whole = std::mem::replace(&mut self.optim, fresh);
                self.grad_scale = grad_scale;
                let records = whole.to_record();
                if records.is_empty() {
                    ShardedAdamW::fresh(decay, lens, rank, world)
                } else {
                    ShardedAdamW::from_records(self.model(), records, decay, rank, world)
                }
            }
        };
        tracing::info!(
            rank,
            ranks = world,
            shard = ?self.cfg.train.shard,
            moments_held = state.held(),
            "optimizer state sharded"
        );
        self.sharded = Some(state);
        Ok(())
    }

    /// One optimizer update from this rank's gradient `grads` of an update whose loss is
    /// `loss`, over the ranks of `c`: the gradients summed (all-reduced, or reduce-scattered
    /// when sharded), clipped by their global norm, the update applied. Its gradient norm,
    /// and whether it was applied.
    pub fn apply(
        &mut self,
        mut grads: GradientsParams,
        c: &mut dyn Collective,
        what: &str,
        loss: f64,
    ) -> Result<(f64, bool), ModelError> {
        let bucket = self.cfg.train.allreduce_bucket_mb * (1 << 20) / 4;
        if self.cfg.train.shard == Sharding::None {
            let dtype = self.cfg.train.allreduce_dtype;
            self.all_reduce(&mut grads, c, what, dtype, bucket)?;
            return Ok(self.update(grads, loss));
        }
        self.shard_over(c.rank(), c.world())
            .map_err(|e| ModelError::Unsupported(e.to_string()))?;
        let t = &self.cfg.train;
        let step = ShardedStep {
            what,
            mode: t.shard,
            dtype: t.allreduce_dtype,
            bucket_values: bucket,
            lr: t.lr,
            max_grad_norm: f64::from(t.max_grad_norm),
            loss,
        };
        match self.sharded.as_mut() {
            Some(s) => s.update(&mut self.model, grads, c, &step),
            None => Err(ModelError::Unsupported(
                "the optimizer is not sharded".into(),
            )),
        }
    }

    /// One optimizer update from the gradient `grads` (clipped by its global norm) of an
    /// update whose loss is `loss`: its gradient norm, and whether it was applied (not for
    /// a non-finite loss or gradient, which leave the weights untouched).
    pub fn update(&mut self, mut grads: GradientsParams, loss: f64) -> (f64, bool) {
        let mut norm = GradNorm {
            grads: &mut grads,
            norm: SquaredNorm::<B::InnerBackend>::default(),
        };
        self.model().visit(&mut norm);
        let grad_norm = norm.norm.total().sqrt();
        if !(loss.is_finite() && grad_norm.is_finite()) {
            tracing::warn!(
                loss,
                grad_norm,
                "non-finite loss or gradient: update skipped, weights kept"
            );
            return (grad_norm, false);
        }
        let max = f64::from(self.cfg.train.max_grad_norm);
        self.grad_scale.set(if grad_norm > max {
            (max / grad_norm) as f32
        } else {
            1.0
        });
        let model = self
            .model
            .take()
            .expect("the model is present between steps");
        self.model = Some(self.optim.step(self.cfg.train.lr, model, grads));
        (grad_norm, true)
    }

    /// Ends a step on `groups` whose statistics are `stats`: unless it was skipped (no
    /// update applied), the version and step advance and the groups are remembered. The
    /// record of the step is returned.
    pub fn finish(
        &mut self,
        mut stats: StepRecord,
        groups: &[&ScoredGroup],
        started: Instant,
    ) -> StepRecord {
        if !stats.skipped {
            self.trained(groups);
        }
        // The first step settles what stays allocated (the optimizer's moments) with the
        // loading's temporaries handed back; from then on what a step frees, the next reuses.
        if self.cfg.train.keep_freed_memory
            && <B::InnerBackend as crate::model::WeightStorage>::HOST_MEMORY
        {
            crate::cpu::keep_freed_memory();
        }
        stats.step = self.state.step;
        stats.version = self.state.version;
        stats.step_s = started.elapsed().as_secs_f64();
        stats
    }

    /// The step's forward and backward passes on `groups` without the update: how the
    /// stage finds which group made a step fail. Changes nothing.
    pub fn probe(&self, groups: &[&ScoredGroup]) -> Result<(), ModelError> {
        self.gradients(groups).map(|_| ())
    }

    /// The gradient of the loss on `groups` and the step's statistics, without stepping:
    /// micro-batch by micro-batch (`micro_batch_tokens`), each part's gradient added up, as
    /// the step's first update.
    pub fn gradients(
        &self,
        groups: &[&ScoredGroup],
    ) -> Result<(GradientsParams, StepRecord), ModelError> {
        let (grads, sums) = self.gradients_over(groups, &Pass::whole(groups, &self.cfg), None)?;
        Ok((grads, sums.record(groups, 1)))
    }

    /// [`Trainer::gradients`] of `groups` as one share of an update `pass` describes (its
    /// norm counts the tokens and sequences of every share), so the shares' gradients add
    /// up to the update's gradient; `proximal` holds decoupled PPO's recomputed log-probs.
    /// No share, no gradient.
    pub fn gradients_over(
        &self,
        groups: &[&ScoredGroup],
        pass: &Pass,
        proximal: Option<&Proximal>,
    ) -> Result<(GradientsParams, TokenSums), ModelError> {
        if groups.is_empty() {
            return Ok((GradientsParams::new(), TokenSums::default()));
        }
        let samples = Samples::of(groups, self.cfg.train.token_discount, proximal)?;
        let batches = samples.micro_batches(self.cfg.train.micro_batch_tokens);
        // Each weight packed for the CPU's products once for all the micro-batches and the
        // head's chunks, forward and backward, where it is used more than once (the kept
        // packings cost about the model's size until the gradients are taken).
        let reused = batches.len() > 1 || samples.completion_tokens() > HEAD_CHUNK_ROWS;
        let _packed = reused.then(PackOnce::open);
        let mut sum = GradientsAccumulator::<Policy<B>>::new();
        let mut parts = Vec::new();
        let (model, reference) = (self.model(), self.reference.as_ref());
        for range in batches {
            let (l, part, saved) = loss::part(model, reference, &samples, range, pass, &self.cfg)?;
            let grads = l.backward();
            match saved {
                None => sum.accumulate(model, GradientsParams::from_grads(grads, model)),
                Some(saved) => saved.backward(model, grads, |g| sum.accumulate(model, g)),
            }
            parts.push(part);
        }
        Ok((sum.grads(), TokenSums::of(&parts, &self.cfg)))
    }

    /// The log-probs of `group`'s completions under the policy as it is now, without
    /// gradient: decoupled PPO's proximal log-probs, taken before a step's first update.
    pub fn proximal_logprobs(&self, group: &ScoredGroup) -> Result<Vec<Vec<f32>>, ModelError> {
        let samples = Samples::of(&[group], self.cfg.train.token_discount, None)?;
        loss::logprobs(&self.model().valid(), &samples, &self.cfg)
    }

    /// Sums `grads` over the trainer ranks of `c`, in buckets of `bucket_values` values:
    /// every parameter that has a gradient on any rank has the sum of them on every rank
    /// afterwards (a rank without one adds zeros), as one trainer would have from all the
    /// step's groups. The buckets are filled in host memory, or on the device
    /// (`train.grad_buffers`, [`super::exchange`]). `what` names the step in errors.
    pub fn all_reduce(
        &self,
        grads: &mut GradientsParams,
        c: &mut dyn Collective,
        what: &str,
        dtype: ReduceDtype,
        bucket_values: usize,
    ) -> Result<(), ModelError> {
        if c.world() == 1 {
            return Ok(());
        }
        let mut present = Presence {
            grads,
            has: Vec::new(),
        };
        self.model().visit(&mut present);
        let mut has = present.has;
        c.all_reduce_sum(
            &format!("{what}: which gradients exist"),
            &mut has,
            ReduceDtype::F32,
        );
        let on_device = match self.cfg.train.grad_buffers {
            GradBuffers::Auto => !B::HOST_MEMORY,
            GradBuffers::Host => false,
            GradBuffers::Device => true,
        };
        if on_device {
            let model = self.model();
            return super::exchange::all_reduce_on_device(
                model,
                grads,
                &has,
                c,
                what,
                dtype,
                bucket_values,
            );
        }
        let mut take = TakeGrads {
            grads,
            has: has.iter(),
            pieces: Vec::new(),
            error: None,
        };
        self.model().visit(&mut take);
        if let Some(e) = take.error {
            return Err(e);
        }
        let mut pieces = take.pieces;
        collective::all_reduce_pieces(c, what, &mut pieces, dtype, bucket_values);
        let mut put = PutGrads {
            grads,
            has: has.iter(),
            pieces: pieces.into_iter(),
        };
        self.model().visit(&mut put);
        Ok(())
    }

    /// [`Trainer::gradients`] by Hugging Face parameter name, in the checkpoint layout
    /// (linear weights `[out, in]`): for comparing with another implementation.
    pub fn named_gradients(
        &self,
        groups: &[&ScoredGroup],
    ) -> Result<(crate::model::tensors::TensorMap, StepRecord), ModelError> {
        let (grads, stats) = self.gradients(groups)?;
        let as_weights = self
            .model()
            .valid()
            .map(&mut GradsAsWeights { grads: &grads });
        Ok((as_weights.to_tensors()?, stats))
    }

    /// Counts a step taken on `groups` and remembers their ids.
    fn trained(&mut self, groups: &[&ScoredGroup]) {
        self.state.version += 1;
        self.state.step += 1;
        self.state.trained_groups += groups.len() as u64;
        for g in groups {
            let id = &g.rollout.group_id;
            self.state.recent_groups.push_back(id.clone());
            self.trained_ids.insert(id.clone());
        }
        while self.state.recent_groups.len() > REMEMBERED_GROUPS {
            if let Some(old) = self.state.recent_groups.pop_front() {
                self.trained_ids.remove(&old);
            }
        }
    }

    /// Weights as a blob for publication.
    pub fn weights_blob(&self) -> Result<Vec<u8>, ModelError> {
        self.model().valid().to_bytes()
    }

    /// What a version publishes: every weight, or only the adapter with the base it
    /// applies to.
    pub fn payload(&self) -> Result<Payload, ModelError> {
        let model = self.model().valid();
        Ok(match &self.lora {
            Some(a) => Payload::Adapter(AdapterVersion {
                tensors: model.adapter_tensors()?,
                spec: a.spec.clone(),
                base_checksum: a.base_checksum.clone(),
            }),
            None => Payload::Tensors(model.to_tensors()?),
        })
    }

    /// Writes a complete checkpoint, then points `latest` at it. A LoRA trainer writes the
    /// adapter in PEFT's format (f32, so a resume is exact) instead of the model.
    pub fn checkpoint(&mut self) -> Result<PathBuf, CheckpointError> {
        let dir = self.write_checkpoint()?;
        checkpoint::mark_latest(&self.cfg.train.checkpoint_dir, &dir)?;
        Ok(dir)
    }

    /// [`TrainerOn::checkpoint`] without pointing `latest` at it: trainer ranks mark it
    /// once every rank has written its optimizer shard.
    pub fn write_checkpoint(&mut self) -> Result<PathBuf, CheckpointError> {
        let root = &self.cfg.train.checkpoint_dir;
        let dir = checkpoint::dir_for(root, self.state.step);
        // A directory of this step left by ranks that stopped before marking it may hold
        // their shards, of another number of ranks: they are not this checkpoint's.
        sharded::remove_shards(&dir)?;
        let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        if let Some(a) = &self.lora {
            let base = self
                .cfg
                .policy
                .model
                .as_ref()
                .map(|p| p.display().to_string());
            self.model()
                .valid()
                .save_adapter(&dir, &a.spec, base.as_deref(), WeightDtype::F32)?;
        } else {
            self.model()
                .valid()
                .save_hf_as(&dir, self.cfg.train.save_dtype)?;
            recorder
                .record(self.model().clone().into_record(), dir.join(MODEL_RECORD))
                .map_err(|e| CheckpointError::format(&dir, "model record", e))?;
            if let Some(from) = &self.cfg.policy.model {
                checkpoint::copy_tokenizer(from, &dir)?;
            }
        }
        if self.cfg.train.shard == Sharding::None {
            recorder
                .record(
                    SortedRecord::new(self.optim.to_record()),
                    dir.join(OPTIM_RECORD),
                )
                .map_err(|e| CheckpointError::format(&dir, "optimizer record", e))?;
        } else {
            self.write_shard(&dir)?;
        }
        checkpoint::write_state(&dir, &self.state, &self.cfg)?;
        Ok(dir)
    }

    /// Writes this rank's optimizer shard into checkpoint `dir`, when sharded.
    pub fn write_shard(&mut self, dir: &std::path::Path) -> Result<(), CheckpointError> {
        if self.cfg.train.shard == Sharding::None {
            return Ok(());
        }
        if self.sharded.is_none() {
            self.shard_over(0, 1)?;
        }
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::format(dir, "create", e))?;
        match &self.sharded {
            Some(s) => s.write(dir),
            None => Ok(()),
        }
    }

    /// The settings this trainer runs with.
    pub fn settings(&self) -> &TrainerSettings {
        &self.cfg
    }

    /// A checksum of the weights being trained (every tensor, adapters included).
    pub fn weights_checksum(&self) -> Result<String, ModelError> {
        Ok(crate::model::tensors::tensors_checksum(
            &self.model().valid().to_tensors()?,
        ))
    }

    /// Whether group `id` was trained (within the remembered window).
    pub fn seen(&self, group_id: &str) -> bool {
        self.trained_ids.contains(group_id)
    }
}

/// The spec of the adapter `model` carries (read back from its first adapted layer).
fn adapter_spec<B: burn::tensor::backend::Backend>(model: &Policy<B>) -> Option<LoraSpec> {
    let block = model.blocks.iter().find_map(|b| b.lora.as_ref())?;
    let targets: Vec<layers::Target> = layers::Target::ALL
        .into_iter()
        .filter(|&t| block.get(t).is_some())
        .collect();
    let first = block.get(*targets.first()?)?;
    let rank = first.a.val().dims()[1];
    Some(LoraSpec {
        rank,
        alpha: (first.scale * rank as f64) as f32,
        dropout: first.dropout as f32,
        targets,
    })
}

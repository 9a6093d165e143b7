//! The `[train]` settings, and the objectives.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// PPO clipped surrogate: −min(r·A, clip(r, 1−ε, 1+ε_high)·A).
    Ppo,
    /// Truncated importance sampling: −min(r, C)·A·log π, the weight without gradient.
    Tis,
    /// REINFORCE with the ratio capped: −min(r, C)·A.
    Reinforce,
    /// GSPO: PPO's clipped surrogate on each sequence's ratio exp(mean log π/μ) (arXiv 2507.18071); use it with loss_agg_mode seq-mean-token-mean and a small clip range (3e-4 / 4e-4 in the paper).
    Gspo,
    /// CISPO: −sg(clip(r, 1−ε, 1+ε_high))·A·log π, every token keeping its gradient (MiniMax-M1, arXiv 2506.13585); the paper bounds only above, so give a large clip_eps_high.
    Cispo,
}
crate::enum_setting!(LossKind);

/// How a step's per-token losses become its loss (verl's `loss_agg_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// Every token of the step alike: Σ loss / tokens (DAPO's token-level loss).
    TokenMean,
    /// Each sequence's mean over its tokens, averaged over sequences (GRPO's original form).
    SeqMeanTokenMean,
    /// Each sequence's sum over its tokens, averaged over sequences.
    SeqMeanTokenSum,
    /// Each sequence's sum divided by one constant length (loss_scale_factor, else the step's longest completion), averaged over sequences (Dr. GRPO).
    SeqMeanTokenSumNorm,
}
crate::enum_setting!(LossAgg);

/// The estimator of KL(π_θ ‖ π_ref) in the loss (verl's `kl_loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum KlKind {
    /// log π − log π_ref.
    K1,
    /// (log π − log π_ref)² / 2.
    K2,
    /// π_ref/π − log(π_ref/π) − 1: unbiased and never negative.
    K3,
    /// k3 clamped to [−10, 10].
    LowVarKl,
}
crate::enum_setting!(KlKind);

/// Off-policy masking: what drops out of the loss when its ratio π_θ/μ leaves
/// [is_mask_low, is_mask_high].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IsMask {
    /// Nothing.
    None,
    /// Each token whose own ratio is outside the band (IcePop; TRL's token_mask).
    Token,
    /// Every token of a sequence whose geometric-mean ratio exp(mean log π_θ/μ) is outside the band (verl's geometric rejection; TRL's sequence_mask).
    Sequence,
}
crate::enum_setting!(IsMask);

/// How decoupled PPO finds the proximal policy's log-probs (AReaL's `prox_logp_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProxMethod {
    /// A forward pass of the policy as it was before the step, over the step's groups.
    Recompute,
    /// No forward pass: log π_prox = log μ + α·(log π_θ − log μ) per token, α = (v_prox − v_μ) / (v_θ − v_μ) from the versions that sampled it (AReaL's approximation).
    Loglinear,
}
crate::enum_setting!(ProxMethod);

/// What trainer ranks shard among themselves (ZeRO's stages 1 and 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    /// Every rank holds the whole model, its summed gradients and both AdamW moments.
    None,
    /// Each rank keeps the AdamW moments of its range of the parameters only, updates that range after the gradients' all-reduce, and all-gathers the updated parameters.
    Optimizer,
    /// As `optimizer`, with the gradients reduce-scattered instead of all-reduced: each rank receives only its range of the summed gradients (half the bytes on the wire).
    Gradients,
}
crate::enum_setting!(Sharding);

/// Where unsharded trainer ranks gather their gradients for the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GradBuffers {
    /// On the device for a GPU backend, in host memory for the CPU's.
    Auto,
    /// Each gradient copied to host memory, the buckets filled there (what MPI reads).
    Host,
    /// The buckets concatenated on the backend's device; NCCL on CUDA sums them where they are, a collective that cannot read device memory (MPI) copies each bucket through the host.
    Device,
}
crate::enum_setting!(GradBuffers);

/// Which experts a mixture-of-experts policy's tokens run through in the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RoutingMode {
    /// The experts the generator recorded (the rollout's routing); the gate weights come
    /// from the live router at those experts, so the router still learns.
    Replay,
    /// The trainer's own router picks the experts again.
    Live,
}
crate::enum_setting!(RoutingMode);

crate::settings! {
    /// The `[train]` section.
    pub struct TrainConfig, flags TrainArgs, section "train" {
        /// The objective.
        pub loss: LossKind = LossKind::Ppo,
        /// Learning rate (AdamW).
        pub lr: f64 = 1e-4,
        /// AdamW weight decay.
        pub weight_decay: f64 = 0.0,
        /// Gradient clipping by global norm.
        pub max_grad_norm: f32 = 1.0,
        /// Keep only each decoder layer's input from the forward and recompute the layer's activations in the backward, one layer at a time (gradient checkpointing): the trunk's activation memory falls to one hidden state per layer and token, for about one more forward. Log-probs are unchanged bit for bit.
        pub gradient_checkpointing: bool = false,
        /// Run each step in micro-batches of at most this many prompt + completion tokens, accumulating gradients (0: one pass); bounds activation memory.
        pub micro_batch_tokens: usize = 0,
        /// How per-token losses become the step's loss: token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm (verl's loss_agg_mode).
        pub loss_agg_mode: LossAgg = LossAgg::TokenMean,
        /// seq-mean-token-sum-norm: the length each sequence's loss sum is divided by (Dr. GRPO's generation budget); 0: the step's longest completion.
        pub loss_scale_factor: f32 = 0.0,
        /// Clip range below 1 (ppo, gspo, cispo).
        pub clip_eps: f32 = 0.2,
        /// Clip range above 1 (ppo, gspo, cispo).
        pub clip_eps_high: f32 = 0.28,
        /// Dual clip (ppo, gspo): a token with a negative advantage loses at most clip_ratio_c · |A| however large its ratio (verl's clip_ratio_c, 3 there); 0 disables, else it must exceed 1.
        pub clip_ratio_c: f32 = 0.0,
        /// Truncation of the importance weight (tis) and cap of the ratio (reinforce).
        pub is_cap: f32 = 2.0,
        /// Off-policy masking: none, token (drop each token whose ratio π_θ/μ leaves [is_mask_low, is_mask_high]) or sequence (drop every token of a sequence whose geometric-mean ratio does); dropped tokens keep their place in the aggregation's counts.
        pub is_mask: IsMask = IsMask::None,
        /// Off-policy masking: the lowest ratio kept.
        pub is_mask_low: f32 = 0.5,
        /// Off-policy masking: the highest ratio kept.
        pub is_mask_high: f32 = 2.0,
        /// Groups per optimizer update: a step's groups split into mini-batches of this many, one update each (verl's ppo_mini_batch_size); 0: the whole step in one update.
        pub ppo_mini_batch_size: usize = 0,
        /// Passes over a step's mini-batches (verl's ppo_epochs); the step publishes one version however many updates it takes.
        pub ppo_epochs: usize = 1,
        /// Decoupled PPO (AReaL): the ratio is taken against a proximal policy, the one before the step, and each token's loss weighed by π_prox/μ (no gradient) for the behaviour's staleness.
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub use_decoupled_loss: bool = false,
        /// Decoupled PPO: how the proximal log-probs are found, recompute (a forward pass) or loglinear (interpolated from the behaviour's and the current log-probs by version).
        pub prox_logp_method: ProxMethod = ProxMethod::Recompute,
        /// Decoupled PPO: a token whose behaviour weight π_prox/μ exceeds this leaves the loss (AReaL's behav_imp_weight_cap); 0: no cap.
        pub behav_imp_weight_cap: f32 = 0.0,
        /// Entropy bonus: the loss subtracts this times the policy's entropy on the completion tokens, aggregated as the surrogate is (verl's entropy_coeff); 0 disables.
        pub entropy_coeff: f32 = 0.0,
        /// Record the policy's entropy on each step's first update (`policy_entropy`): one more pass of the output head over its tokens, without gradient (verl's calculate_entropy); always computed when entropy_coeff is set.
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub calculate_entropy: bool = true,
        /// KL penalty to the initial policy in the loss (0 disables; verl's kl_loss_coef).
        pub kl_coef: f32 = 0.0,
        /// The KL estimator: k1, k2, k3 or low-var-kl (verl's kl_loss_type).
        pub kl_loss_type: KlKind = KlKind::K3,
        /// Discount γ of rewards placed on tokens (a scorer's token_rewards): each token's advantage adds its return Σ γ^k·r over the rewards at or after it, less the group's mean; 1 credits a step's reward to every token before it, 0 keeps each reward on its own token.
        pub token_discount: f32 = 1.0,
        /// Dynamic sampling (DAPO; verl's filter_groups): a group whose rewards are all equal, and whose token rewards (if any) are all 0, has advantage 0 on every token under grpo, loo and nostd; it is acknowledged and counted (reason zero_variance), never trained, and the step fills its groups_per_step from the stream.
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub filter_groups: bool = false,
        /// Dynamic sampling: also filter a group whose every |advantage| is below this (reason low_advantage; 0: zero-variance groups only).
        pub filter_min_abs_advantage: f32 = 0.0,
        /// Dynamic sampling: a step that has waited this many seconds for informative groups is taken with the groups it has, fewer than groups_per_step, with a warning (0: it waits for a full step).
        pub max_fill_wait_s: f64 = 0.0,
        /// Overlong handling (TRL's mask_truncated_completions, PipelineRL's overlong_filtering): a completion cut at max_new_tokens is kept out of the loss and its denominator (its group's other completions keep the advantages the scorer gave them); a group whose every completion was cut is dropped (reason truncated). Counted per step (masked_samples).
        #[arg(num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
        pub mask_truncated: bool = false,
        /// Publish weights every this many steps.
        pub publish_every: u64 = 1,
        /// Versions of weights kept on the bus.
        pub keep_versions: usize = 3,
        /// Checkpoint every this many steps (entries are acked only after a checkpoint).
        pub checkpoint_every: u64 = 10,
        /// Dtype of each checkpoint's model.safetensors: f32 or bf16 (half the size; the trainer resumes from its own f32 record either way).
        pub save_dtype: crate::model::tensors::WeightDtype = crate::model::tensors::WeightDtype::F32,
        /// Where checkpoints go.
        #[arg(value_name = "DIR")]
        pub checkpoint_dir: PathBuf = PathBuf::from("checkpoints"),
        /// Stop after this many steps; 0: the trainer stage (`rlstream train`) runs until stopped, while `run` needs at least 1.
        pub steps: u64 = 0,
        /// LoRA: train rank-r adapters on a frozen base instead of every weight, and publish only the adapter (0: full fine-tuning; 16-32 is usual for RL).
        pub lora_rank: usize = 0,
        /// LoRA scaling numerator: the update is (alpha / rank) · A · B.
        pub lora_alpha: f32 = 32.0,
        /// Dropout on the adapters' input while training (0 for RL, so the trainer's forward is the sampler's).
        pub lora_dropout: f32 = 0.0,
        /// Modules the adapters sit on: all-linear, or a list of q,k,v,o,gate,up,down.
        pub lora_targets: String = "all-linear".into(),
        /// Start from this PEFT adapter directory (its adapter_config.json sets rank, alpha and targets) instead of a fresh adapter.
        #[arg(value_name = "DIR")]
        pub lora_from: Option<PathBuf> = None,
        /// Mixture-of-experts policies: replay the experts the generator recorded for each token (the router's gate weights stay live and keep their gradient), or route live. Groups without routing route live either way; dense models ignore it.
        pub routing: RoutingMode = RoutingMode::Replay,
        /// Trainer ranks: the collective library, auto (MPI under mpirun; NCCL when --world or a launcher's WORLD_SIZE / SLURM_NTASKS gives more than one rank), mpi, or nccl (GPUs; feature cuda).
        pub collective: crate::collective::CollectiveKind = crate::collective::CollectiveKind::Auto,
        /// Trainer ranks over NCCL: how many (0: the launcher's WORLD_SIZE or SLURM_NTASKS; under mpirun, MPI's).
        pub world: usize = 0,
        /// Trainer ranks over NCCL: this process's rank, from 0 (with --world; else the launcher's RANK or SLURM_PROCID).
        pub rank: usize = 0,
        /// Trainer ranks over NCCL: the name the ranks meet under on Redis (unset: the launcher's SLURM_JOB_ID or TORCHELASTIC_RUN_ID, else "default"); give each concurrent job under one namespace its own.
        #[arg(value_name = "NAME")]
        pub rendezvous: Option<String> = None,
        /// Trainer ranks (`mpirun -n N rlstream train`): how long one rank waits for the others in a collective call before it names those that do not answer and ends every rank; start-up waits ten times as long (loading, a warm start in `run`).
        pub collective_timeout_s: f64 = 300.0,
        /// Trainer ranks: the type gradients are summed in across ranks, f32 (exact, as one trainer) or bf16 (half the bytes; each partial sum rounded).
        pub allreduce_dtype: crate::collective::ReduceDtype = crate::collective::ReduceDtype::F32,
        /// Trainer ranks: gradients are summed in buckets of this many MiB, one collective call each.
        pub allreduce_bucket_mb: usize = 64,
        /// Trainer ranks, unsharded: where the gradient buckets are filled, auto (on a GPU backend's device, where NCCL sums them in place; in host memory on the CPU), host or device.
        pub grad_buffers: GradBuffers = GradBuffers::Auto,
        /// Trainer ranks: what each rank keeps of the optimizer's state and of the gradients. `none` (every rank all of it), `optimizer` (each rank the AdamW moments of its 1/N of the parameters; checkpoints hold one optimizer file per rank and resume at any number of ranks) or `gradients` (also the gradients reduce-scattered, each rank receiving its 1/N).
        pub shard: Sharding = Sharding::None,
        /// CPU trainers: from the second step on, keep the memory a step frees for the next one instead of handing it back to the kernel (the allocator's purging off), so no step pays for faulting in and zeroing fresh pages. Faster steps for more resident memory: 1.47x at the 135M chat model for 3-7% more peak, 10-16% more peak at 0.5B (BENCHMARKS.md).
        pub keep_freed_memory: bool = false,
        /// Consumer name, unique per trainer process.
        pub name: String = "train-0".into(),
    }
}

impl TrainConfig {
    /// Checks values the types cannot.
    pub fn validate(&self) -> Result<(), crate::settings::InvalidSetting> {
        use crate::settings::invalid;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid("train.lr", "must be > 0"));
        }
        self.validate_objective()?;
        if !(0.0..=1.0).contains(&self.token_discount) {
            return Err(invalid("train.token_discount", "must be in [0, 1]"));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm > 0.0) {
            return Err(invalid("train.max_grad_norm", "must be > 0"));
        }
        if !(self.collective_timeout_s.is_finite() && self.collective_timeout_s > 0.0) {
            return Err(invalid("train.collective_timeout_s", "must be > 0"));
        }
        if !(self.filter_min_abs_advantage.is_finite() && self.filter_min_abs_advantage >= 0.0) {
            return Err(invalid("train.filter_min_abs_advantage", "must be >= 0"));
        }
        if !(self.max_fill_wait_s.is_finite() && self.max_fill_wait_s >= 0.0) {
            return Err(invalid("train.max_fill_wait_s", "must be >= 0"));
        }
        if self.ppo_epochs == 0 {
            return Err(invalid("train.ppo_epochs", "must be at least 1"));
        }
        if !(self.behav_imp_weight_cap == 0.0
            || (self.behav_imp_weight_cap.is_finite() && self.behav_imp_weight_cap > 1.0))
        {
            return Err(invalid(
                "train.behav_imp_weight_cap",
                "must be 0 (no cap) or more than 1",
            ));
        }
        if !self.entropy_coeff.is_finite() {
            return Err(invalid("train.entropy_coeff", "must be a finite number"));
        }
        if self.allreduce_bucket_mb == 0 {
            return Err(invalid("train.allreduce_bucket_mb", "must be at least 1"));
        }
        if self.publish_every == 0 || self.checkpoint_every == 0 || self.keep_versions == 0 {
            return Err(invalid(
                "train",
                "publish_every, checkpoint_every and keep_versions must be at least 1",
            ));
        }
        if self.lora_from.is_none() && self.lora_rank > 0 {
            self.lora_spec()
                .map_err(|reason| invalid("train.lora_targets", reason))?;
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(invalid("train.lora_dropout", "must be in [0, 1)"));
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return Err(invalid("train.lora_alpha", "must be > 0"));
        }
        Ok(())
    }

    /// The objective's and the intake's values.
    fn validate_objective(&self) -> Result<(), crate::settings::InvalidSetting> {
        use crate::settings::invalid;
        if !(self.clip_eps.is_finite() && self.clip_eps > 0.0 && self.clip_eps < 1.0) {
            return Err(invalid("train.clip_eps", "must be in (0, 1)"));
        }
        if !(self.clip_eps_high.is_finite() && self.clip_eps_high > 0.0) {
            return Err(invalid("train.clip_eps_high", "must be > 0"));
        }
        if !(self.clip_ratio_c == 0.0 || (self.clip_ratio_c.is_finite() && self.clip_ratio_c > 1.0))
        {
            return Err(invalid(
                "train.clip_ratio_c",
                "must be 0 (off) or more than 1",
            ));
        }
        if !(self.is_mask_low > 0.0
            && self.is_mask_low < 1.0
            && self.is_mask_high > 1.0
            && self.is_mask_high.is_finite())
        {
            return Err(invalid(
                "train.is_mask_low",
                "the kept band must hold 1: 0 < is_mask_low < 1 < is_mask_high",
            ));
        }
        if !(self.loss_scale_factor.is_finite() && self.loss_scale_factor >= 0.0) {
            return Err(invalid("train.loss_scale_factor", "must be >= 0"));
        }
        if !(self.is_cap.is_finite() && self.is_cap >= 1.0) {
            return Err(invalid("train.is_cap", "must be >= 1"));
        }
        Ok(())
    }

    /// Whether the trainer trains adapters (a rank, or an adapter to start from).
    pub fn lora(&self) -> bool {
        self.lora_rank > 0 || self.lora_from.is_some()
    }

    /// The adapter these settings describe (a fresh one's shape).
    pub fn lora_spec(&self) -> Result<crate::model::lora::LoraSpec, String> {
        let spec = crate::model::lora::LoraSpec {
            rank: self.lora_rank,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets: crate::model::layers::Target::parse_list(&self.lora_targets)?,
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// What a trainer runs with: its own `[train]` section and the shared `[policy]` one. Saved
/// beside each checkpoint as `train_config.toml`, in the same sections as the config file.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerSettings {
    pub policy: crate::stages::policy::PolicySettings,
    pub train: TrainConfig,
}

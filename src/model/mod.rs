//! The policy model: a Llama/Qwen2-family decoder in burn, generic over the backend.
//!
//! - [`config`]: shape and numerics ([`ModelConfig`]), and the Hugging Face `config.json`
//!   mapping.
//! - [`llama`]: the decoder (RMSNorm, rotary embedding in the HF half-rotation layout,
//!   grouped-query attention, SwiGLU), its forward pass with or without a KV cache;
//!   [`layers`]: its linear layers (with LoRA adapters), MLP and RMSNorm; [`moe`]:
//!   mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE) and routing replay.
//! - [`hf`]: safetensors checkpoints (single file or sharded) in and out, and the weights
//!   as one byte blob for publication; [`tensors`]: host tensors, safetensors I/O,
//!   checksums; [`params`]: parameters by Hugging Face name, moved out and back in place.
//! - [`kernels`]: the arithmetic: RMSNorm, rotary positions, attention, SwiGLU and the
//!   token log-prob as fused backend operations with their own backward (native on
//!   NdArray); [`storage`]: how a backend stores parameters (generation weights, values in
//!   Hugging Face order, host memory), apart from the arithmetic.
//! - [`sampler`]: batched generation with an incremental KV cache and continuous batching,
//!   returning per-token behaviour log-probs and sampling masks; [`draw`]: one token drawn
//!   from logits.
//! - [`logprobs`]: the trainer's teacher-forced log-probs, optionally renormalised over a
//!   recorded sampling mask, with gradients.
//! - [`lora`]: LoRA adapters (frozen base, low-rank updates), in PEFT's format on disk.
//! - [`fault`]: catching a panicking forward pass, and the hook that injects one.
//! - [`tokenizer`]: Hugging Face `tokenizer.json` and a built-in character tokenizer;
//!   [`chat`]: chat templates.
//! - [`counted`]: a backend wrapper that counts host-device transfers (tests and benches).
//! - [`ModelError`] (`error.rs`) and [`model_dir`] (`dir.rs`): what goes wrong, and model
//!   directories as users name them.

pub mod chat;
pub mod config;
pub mod counted;
mod dir;
pub mod draw;
mod error;
pub mod fault;
pub mod hf;
pub mod kernels;
pub mod layers;
pub mod llama;
pub mod logprobs;
pub mod lora;
pub mod moe;
pub mod params;
pub mod recompute;
pub mod sampler;
pub mod storage;
pub mod tensors;
pub mod tokenizer;

pub use config::{Architecture, ModelConfig, MoeConfig};
pub use dir::model_dir;
pub use error::ModelError;
pub use kernels::Kernels;
pub use llama::{KvCache, Policy};
pub use storage::WeightStorage;
pub use tensors::host_f32;

/// The CPU backend generation runs on: NdArray with the trainer's native kernels
/// ([`Kernels`]), its linear weights kept `[out, in]` so that a decode step streams each
/// once, in 16 bits when its values are bf16 ([`WeightStorage::decode_weight`]). Measured against Flex and PyTorch in BENCHMARKS.md.
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
pub type InferBackend = burn::backend::NdArray;
/// The backend training runs on: autodiff over NdArray, whose train step measured 1.26×
/// faster than Flex's. Weights move between the two as bytes, as they do between processes.
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
pub type TrainBackend = burn::backend::Autodiff<burn::backend::NdArray>;

/// With the `wgpu` feature (and not `cuda`), generation and training run on burn's CubeCL
/// backend over wgpu: a GPU's Vulkan, Metal or DX12, or Mesa's lavapipe on the CPU.
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
pub type InferBackend = burn::backend::Wgpu;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
pub type TrainBackend = burn::backend::Autodiff<burn::backend::Wgpu>;

/// With the `cuda` feature, generation and training run on the first CUDA device.
#[cfg(feature = "cuda")]
pub type InferBackend = burn::backend::Cuda;
#[cfg(feature = "cuda")]
pub type TrainBackend = burn::backend::Autodiff<burn::backend::Cuda>;

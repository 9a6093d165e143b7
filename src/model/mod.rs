//! The policy model: a Llama/Qwen2-family decoder in burn, generic over the backend.
//!
//! - [`config`]: shape and numerics, and the Hugging Face `config.json` mapping.
//! - [`llama`]: the decoder (RMSNorm, rotary embedding in the HF half-rotation layout,
//!   grouped-query attention, SwiGLU), its forward pass with or without a KV cache.
//! - [`hf`]: safetensors checkpoints (single file or sharded) in and out, and the weights
//!   as one byte blob for publication.
//! - [`sampler`]: batched generation with an incremental KV cache and continuous batching,
//!   returning per-token behaviour log-probs and sampling masks.
//! - [`kernels`]: RMSNorm, rotary positions, the attention softmax, SwiGLU and the token
//!   log-prob as fused backend operations with their own backward (native on NdArray).
//! - [`logprobs`]: the trainer's teacher-forced log-probs, optionally renormalised over a
//!   recorded sampling mask, with gradients.
//! - [`lora`]: LoRA adapters (frozen base, low-rank updates), in PEFT's format on disk.
//! - [`moe`]: mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE) and routing replay.
//! - [`fault`]: catching a panicking forward pass, and the hook that injects one.
//! - [`tokenizer`]: Hugging Face `tokenizer.json` and a built-in character tokenizer.

pub mod chat;
pub mod config;
pub mod counted;
pub mod draw;
pub mod fault;
pub mod hf;
pub mod kernels;
pub mod layers;
pub mod llama;
pub mod logprobs;
pub mod lora;
pub mod moe;
pub mod params;
pub mod sampler;
pub mod tensors;
pub mod tokenizer;

pub use config::{Architecture, MoeConfig, PolicyConfig};
pub use kernels::Kernels;
pub use llama::{KvCache, Policy};

/// The CPU backend generation runs on: NdArray with the trainer's native kernels
/// ([`Kernels`]), its linear weights kept `[out, in]` so that a decode step streams each
/// once, in 16 bits when its values are bf16 ([`Kernels::decode_weight`]). Measured against Flex and PyTorch in BENCHMARKS.md.
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

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model config: `{field}` {reason}")]
    Config { field: String, reason: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("missing file {path}: {reason}")]
    MissingFile { path: String, reason: String },
    #[error("no model at {dir}: {reason}")]
    NoModel { dir: String, reason: String },
    #[error("checkpoint is missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {dtype}; rlstream reads F32, F16 and BF16")]
    Dtype { name: String, dtype: String },
    #[error("bad safetensors data{}: {reason}", .path.as_ref().map(|p| format!(" in {p}")).unwrap_or_default())]
    Safetensors {
        path: Option<String>,
        reason: String,
    },
    #[error("weights checksum mismatch: expected {expected}, got {found}")]
    Checksum { expected: String, found: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("cannot copy a tensor to the host: {0}")]
    HostCopy(String),
    /// Input the model cannot run (an id past the vocabulary, too long for the context).
    #[error("{0}")]
    Refused(crate::schema::Refusal),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ModelError {
    /// A failed read or write of `path`.
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// A model directory as given on a command line: a directory, or a file that names one
/// beside it (a trainer's `checkpoints/latest`), followed.
pub fn model_dir(path: &std::path::Path) -> std::path::PathBuf {
    if path.is_file()
        && let Ok(name) = std::fs::read_to_string(path)
    {
        let name = name.trim();
        let dir = path
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join(name);
        if !name.is_empty() && !name.contains('\n') && dir.is_dir() {
            return dir;
        }
    }
    path.to_path_buf()
}

/// A tensor's values on the host as f32.
pub fn host_f32(data: burn::tensor::TensorData) -> Result<Vec<f32>, ModelError> {
    data.convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| ModelError::HostCopy(format!("{e:?}")))
}

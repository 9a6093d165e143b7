//! Model configuration: the burn `Config` of the policy, and the Hugging Face `config.json`
//! it is read from and written to.

use super::ModelError;
use burn::config::Config;
use serde::{Deserialize, Serialize};

/// Which Hugging Face architecture a checkpoint declares. Both share the decoder; Qwen2
/// adds q/k/v biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Llama,
    Qwen2,
}

impl Architecture {
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
        }
    }
    fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
        }
    }
}

/// Shape and numerics of the policy decoder.
#[derive(Config, Debug, PartialEq)]
pub struct PolicyConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention: each serves `num_heads / num_kv_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    #[config(default = 1e-6)]
    pub rms_norm_eps: f64,
    /// Base of the rotary position embedding.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// Biases on the q/k/v projections (Qwen2).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// The output head reuses the token embedding.
    #[config(default = true)]
    pub tie_embeddings: bool,
    /// Longest sequence (prompt + completion) the rotary tables cover.
    #[config(default = 2048)]
    pub max_position: usize,
    #[config(default = "None")]
    pub bos_token_id: Option<u32>,
    #[config(default = "None")]
    pub eos_token_id: Option<u32>,
}

impl PolicyConfig {
    /// What messages run on this model must fit: its vocabulary and context.
    pub fn limits(&self) -> crate::schema::Limits {
        crate::schema::Limits {
            vocab: self.vocab_size,
            context: self.max_position,
        }
    }

    /// A small config for built-in tasks and tests.
    pub fn tiny(architecture: Architecture, vocab_size: usize) -> Self {
        PolicyConfig::new(architecture, vocab_size, 64, 128, 2, 4, 2, 16)
            .with_qkv_bias(architecture == Architecture::Qwen2)
            .with_max_position(512)
    }

    /// Parameters, counting a tied head once.
    pub fn num_params(&self) -> usize {
        let (d, hd) = (self.hidden_size, self.head_dim);
        let q = d * self.num_heads * hd;
        let kv = 2 * d * self.num_kv_heads * hd;
        let bias = if self.qkv_bias {
            (self.num_heads + 2 * self.num_kv_heads) * hd
        } else {
            0
        };
        let attn = q + kv + bias + self.num_heads * hd * d;
        let mlp = 3 * d * self.intermediate_size;
        let layer = attn + mlp + 2 * d;
        let embed = self.vocab_size * d;
        let head = if self.tie_embeddings { 0 } else { embed };
        embed + head + d + self.num_layers * layer
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field: &str, reason: String| ModelError::Config {
            field: field.to_string(),
            reason,
        };
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position),
        ] {
            if v == 0 {
                return Err(bad(field, "must be greater than 0".into()));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!("{} is odd; rotary embedding needs pairs", self.head_dim),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(bad(
                "rope_theta",
                format!("{} must be positive", self.rope_theta),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                format!("{} must be positive", self.rms_norm_eps),
            ));
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let hf: HfConfig = serde_json::from_str(text).map_err(|e| ModelError::Config {
            field: "config.json".into(),
            reason: e.to_string(),
        })?;
        hf.into_policy()
    }

    /// Writes a Hugging Face `config.json` that `transformers` loads.
    pub fn to_hf_json(&self) -> String {
        let mut v = serde_json::json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position,
            "torch_dtype": "float32",
            "use_cache": true,
        });
        if self.architecture == Architecture::Llama {
            v["attention_bias"] = self.qkv_bias.into();
            v["mlp_bias"] = false.into();
        } else {
            v["use_sliding_window"] = false.into();
        }
        if let Some(b) = self.bos_token_id {
            v["bos_token_id"] = b.into();
        }
        if let Some(e) = self.eos_token_id {
            v["eos_token_id"] = e.into();
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }
}

/// The fields of a Hugging Face `config.json` rlstream understands; others are ignored.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5 writes `{"rope_theta": ..., "rope_type": "default"}` here instead.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: Option<bool>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    max_position_embeddings: Option<usize>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

fn default_act() -> String {
    "silu".into()
}
fn default_eps() -> f64 {
    1e-6
}
/// transformers' default rotary base.
const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// A token id field that may be a number, a list (first wins) or null.
fn token_id(v: &Option<serde_json::Value>) -> Option<u32> {
    match v.as_ref()? {
        serde_json::Value::Number(n) => n.as_u64().map(|n| n as u32),
        serde_json::Value::Array(a) => a.first().and_then(|n| n.as_u64()).map(|n| n as u32),
        _ => None,
    }
}

impl HfConfig {
    fn into_policy(self) -> Result<PolicyConfig, ModelError> {
        let arch = match self.architectures.first().map(String::as_str) {
            Some("Qwen2ForCausalLM") => Architecture::Qwen2,
            Some("LlamaForCausalLM") => Architecture::Llama,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "architecture {other:?}; rlstream reads LlamaForCausalLM and Qwen2ForCausalLM"
                )));
            }
        };
        if self.hidden_act != "silu" {
            return Err(ModelError::Unsupported(format!(
                "hidden_act `{}` (only silu)",
                self.hidden_act
            )));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ModelError::Unsupported(
                "rope_scaling (only plain rotary embedding)".into(),
            ));
        }
        let mut rope_theta = self.rope_theta.unwrap_or(DEFAULT_ROPE_THETA);
        if let Some(p) = self.rope_parameters.as_ref().filter(|v| !v.is_null()) {
            let kind = p
                .get("rope_type")
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            if kind != "default" {
                return Err(ModelError::Unsupported(format!(
                    "rope_parameters.rope_type `{kind}` (only plain rotary embedding)"
                )));
            }
            if let Some(theta) = p.get("rope_theta").and_then(|t| t.as_f64()) {
                rope_theta = theta;
            }
        }
        if self.mlp_bias == Some(true) {
            return Err(ModelError::Unsupported("mlp_bias = true".into()));
        }
        if self.use_sliding_window == Some(true) {
            return Err(ModelError::Unsupported("use_sliding_window = true".into()));
        }
        if self.num_attention_heads == 0 {
            return Err(ModelError::Config {
                field: "num_attention_heads".into(),
                reason: "must be greater than 0".into(),
            });
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        let cfg = PolicyConfig {
            architecture: arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            qkv_bias: match arch {
                Architecture::Qwen2 => true,
                Architecture::Llama => self.attention_bias.unwrap_or(false),
            },
            tie_embeddings: self
                .tie_word_embeddings
                .unwrap_or(arch == Architecture::Qwen2),
            max_position: self.max_position_embeddings.unwrap_or(2048).min(1 << 16),
            bos_token_id: token_id(&self.bos_token_id),
            eos_token_id: token_id(&self.eos_token_id),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

//! Model configuration: the burn `Config` of the policy, and the Hugging Face `config.json`
//! it is read from and written to.

use super::ModelError;
use burn::config::Config;
use serde::{Deserialize, Serialize};

/// Which Hugging Face architecture a checkpoint declares. All share the decoder; Qwen2
/// adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k (and a free head width). The MoE
/// variants replace the MLP of their sparse layers with routed experts ([`MoeConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    /// Qwen2-MoE: Qwen2's attention; experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: Qwen3's attention; experts only.
    Qwen3Moe,
}

impl Architecture {
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
    fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Whether the architecture routes tokens to experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Architecture::Qwen2Moe | Architecture::Qwen3Moe)
    }

    /// Whether q and k get a per-head RMSNorm (the Qwen3 family).
    fn qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Qwen3Moe)
    }
}

/// The mixture-of-experts layers of a Qwen2-MoE / Qwen3-MoE model: a softmax router picks
/// `top_k` of `num_experts` SwiGLU experts per token, weighted by their router
/// probabilities (renormalised over the chosen ones when `norm_topk_prob`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Width of one expert's SwiGLU (`moe_intermediate_size`).
    pub expert_size: usize,
    pub norm_topk_prob: bool,
    /// Width of the shared expert every token also goes through, gated by a sigmoid
    /// (Qwen2-MoE's `shared_expert_intermediate_size`); `None` for none.
    pub shared_expert_size: Option<usize>,
    /// Layer `i` is sparse when `(i + 1) % sparse_step == 0` and it is not in
    /// `dense_layers` (`decoder_sparse_step`, `mlp_only_layers`); the others keep a dense
    /// MLP of `intermediate_size`.
    pub sparse_step: usize,
    pub dense_layers: Vec<usize>,
}

impl MoeConfig {
    /// A config with every layer sparse and no shared expert.
    pub fn new(num_experts: usize, top_k: usize, expert_size: usize) -> Self {
        MoeConfig {
            num_experts,
            top_k,
            expert_size,
            norm_topk_prob: true,
            shared_expert_size: None,
            sparse_step: 1,
            dense_layers: Vec::new(),
        }
    }

    /// Whether layer `i` routes to experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.sparse_step > 0
            && (i + 1).is_multiple_of(self.sparse_step)
            && !self.dense_layers.contains(&i)
    }
}

/// Llama 3's rotary scaling (`rope_type: llama3`): wavelengths longer than the original
/// context divided by `low_freq_factor` are stretched by `factor`, those shorter than it
/// divided by `high_freq_factor` are kept, and the band between is interpolated.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3Rope {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position: usize,
}

impl Llama3Rope {
    /// The scaled inverse frequency (transformers' `_compute_llama3_parameters`).
    pub fn scale(&self, inv_freq: f64) -> f64 {
        let old = self.original_max_position as f64;
        let low_wavelen = old / self.low_freq_factor;
        let high_wavelen = old / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen < high_wavelen {
            inv_freq
        } else if wavelen > low_wavelen {
            inv_freq / self.factor
        } else {
            let smooth = (old / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }

    /// Reads a `rope_scaling` / `rope_parameters` object whose type is `llama3`.
    fn from_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let num = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| ModelError::Config {
                    field: format!("rope_scaling.{k}"),
                    reason: "a positive number is required for rope_type llama3".into(),
                })
        };
        let r = Llama3Rope {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")? as usize,
        };
        if r.high_freq_factor <= r.low_freq_factor {
            return Err(ModelError::Config {
                field: "rope_scaling.high_freq_factor".into(),
                reason: format!(
                    "{} must be greater than low_freq_factor {}",
                    r.high_freq_factor, r.low_freq_factor
                ),
            });
        }
        Ok(r)
    }

    fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position,
        })
    }
}

/// Shape and numerics of the policy decoder.
#[derive(Config, Debug, PartialEq)]
pub struct ModelConfig {
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
    /// RMSNorm over each head of q and k before the rotary embedding (Qwen3).
    #[config(default = false)]
    pub qk_norm: bool,
    /// Rotary scaling (Llama 3.x); `None` is the plain rotary embedding.
    #[config(default = "None")]
    pub rope_scaling: Option<Llama3Rope>,
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
    /// Routed experts (the MoE architectures); `None` for a dense model.
    #[config(default = "None")]
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// What messages run on this model must fit: its vocabulary and context.
    pub fn limits(&self) -> crate::schema::Limits {
        crate::schema::Limits {
            vocab: self.vocab_size,
            context: self.max_position,
            routing: self.routing_shape(),
        }
    }

    /// A small config for built-in tasks and tests.
    pub fn tiny(architecture: Architecture, vocab_size: usize) -> Self {
        ModelConfig::new(architecture, vocab_size, 64, 128, 2, 4, 2, 16)
            .with_qkv_bias(architecture == Architecture::Qwen2)
            .with_max_position(512)
    }

    /// The indices of the layers that route to experts, in order (empty for a dense model).
    pub fn moe_layers(&self) -> Vec<usize> {
        match &self.moe {
            Some(m) => (0..self.num_layers).filter(|&i| m.is_sparse(i)).collect(),
            None => Vec::new(),
        }
    }

    /// What routing data for this model must look like: MoE layers, experts per token and
    /// experts per layer; `None` for a dense model.
    pub fn routing_shape(&self) -> Option<crate::schema::RoutingShape> {
        let m = self.moe.as_ref()?;
        Some(crate::schema::RoutingShape {
            layers: self.moe_layers().len() as u32,
            k: m.top_k as u32,
            experts: m.num_experts as u32,
        })
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
        let qk_norm = if self.qk_norm { 2 * hd } else { 0 };
        let attn = q + kv + bias + qk_norm + self.num_heads * hd * d;
        let dense = 3 * d * self.intermediate_size;
        let mlps: usize = (0..self.num_layers)
            .map(|i| match &self.moe {
                Some(m) if m.is_sparse(i) => {
                    m.num_experts * (3 * d * m.expert_size + d)
                        + m.shared_expert_size.map_or(0, |s| 3 * d * s + d)
                }
                _ => dense,
            })
            .sum();
        let embed = self.vocab_size * d;
        let head = if self.tie_embeddings { 0 } else { embed };
        embed + head + d + self.num_layers * (attn + 2 * d) + mlps
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
        self.validate_experts()
    }

    /// The expert fields: present exactly for a mixture-of-experts architecture, in range.
    fn validate_experts(&self) -> Result<(), ModelError> {
        let bad = |field: &str, reason: String| ModelError::Config {
            field: field.to_string(),
            reason,
        };
        match (&self.moe, self.architecture.is_moe()) {
            (Some(m), true) => {
                if m.num_experts == 0 || m.num_experts > usize::from(u16::MAX) {
                    return Err(bad(
                        "num_experts",
                        format!("{} must be between 1 and 65535", m.num_experts),
                    ));
                }
                if m.top_k == 0 || m.top_k > m.num_experts {
                    return Err(bad(
                        "num_experts_per_tok",
                        format!(
                            "{} must be between 1 and num_experts {}",
                            m.top_k, m.num_experts
                        ),
                    ));
                }
                if m.expert_size == 0 || m.shared_expert_size == Some(0) || m.sparse_step == 0 {
                    return Err(bad(
                        "moe_intermediate_size",
                        "expert widths and decoder_sparse_step must be greater than 0".into(),
                    ));
                }
            }
            (None, true) => {
                return Err(bad(
                    "num_experts",
                    format!("{} needs its experts", self.architecture.hf_name()),
                ));
            }
            (Some(_), false) => {
                return Err(bad(
                    "num_experts",
                    format!("{} is a dense architecture", self.architecture.hf_name()),
                ));
            }
            (None, false) => {}
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
        self.to_hf_json_as("float32")
    }

    /// [`ModelConfig::to_hf_json`] with `torch_dtype` set to `torch_dtype`.
    pub fn to_hf_json_as(&self, torch_dtype: &str) -> String {
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
            "rope_scaling": self.rope_scaling.map(Llama3Rope::to_json),
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position,
            "torch_dtype": torch_dtype,
            "use_cache": true,
        });
        match self.architecture {
            Architecture::Llama => {
                v["attention_bias"] = self.qkv_bias.into();
                v["mlp_bias"] = false.into();
            }
            Architecture::Qwen2 => v["use_sliding_window"] = false.into(),
            Architecture::Qwen3 | Architecture::Qwen3Moe => {
                v["attention_bias"] = self.qkv_bias.into();
                v["use_sliding_window"] = false.into();
            }
            Architecture::Qwen2Moe => {
                v["qkv_bias"] = self.qkv_bias.into();
                v["use_sliding_window"] = false.into();
            }
        }
        if let Some(m) = &self.moe {
            v["num_experts"] = m.num_experts.into();
            v["num_experts_per_tok"] = m.top_k.into();
            v["moe_intermediate_size"] = m.expert_size.into();
            v["norm_topk_prob"] = m.norm_topk_prob.into();
            v["decoder_sparse_step"] = m.sparse_step.into();
            v["mlp_only_layers"] = m.dense_layers.clone().into();
            v["output_router_logits"] = false.into();
            if let Some(s) = m.shared_expert_size {
                v["shared_expert_intermediate_size"] = s.into();
            }
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
    /// transformers 5 names each layer's attention (`full_attention`, `sliding_attention`).
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    /// Mixture-of-experts configs carry these; a dense architecture name with them is refused.
    /// transformers 5 writes Qwen3-MoE's as `num_local_experts`.
    #[serde(default, alias = "num_local_experts")]
    num_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default)]
    shared_expert_intermediate_size: Option<usize>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
    /// Qwen2-MoE's name for the q/k/v biases.
    #[serde(default)]
    qkv_bias: Option<bool>,
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
    fn into_policy(self) -> Result<ModelConfig, ModelError> {
        let arch = self.architecture()?;
        if !arch.is_moe() && self.num_experts.is_some_and(|n| n > 0) {
            return Err(ModelError::Unsupported(format!(
                "num_experts (mixture-of-experts layers) on {}, a dense architecture",
                arch.hf_name()
            )));
        }
        let moe = self.experts(arch)?;
        if self.hidden_act != "silu" {
            return Err(ModelError::Unsupported(format!(
                "hidden_act `{}` (only silu)",
                self.hidden_act
            )));
        }
        let (rope_theta, rope_scaling) = self.rope()?;
        self.check_supported()?;
        if self.num_attention_heads == 0 {
            return Err(ModelError::Config {
                field: "num_attention_heads".into(),
                reason: "must be greater than 0".into(),
            });
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        let cfg = ModelConfig {
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
                Architecture::Qwen2Moe => self.qkv_bias.unwrap_or(true),
                Architecture::Llama | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                    self.attention_bias.unwrap_or(false)
                }
            },
            qk_norm: arch.qk_norm(),
            rope_scaling,
            tie_embeddings: self
                .tie_word_embeddings
                .unwrap_or(matches!(arch, Architecture::Qwen2)),
            max_position: self.max_position_embeddings.unwrap_or(2048).min(1 << 16),
            bos_token_id: token_id(&self.bos_token_id),
            eos_token_id: token_id(&self.eos_token_id),
            moe,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The architecture `architectures` names, if rlstream runs it.
    fn architecture(&self) -> Result<Architecture, ModelError> {
        Ok(match self.architectures.first().map(String::as_str) {
            Some("Qwen2ForCausalLM") => Architecture::Qwen2,
            Some("Qwen3ForCausalLM") => Architecture::Qwen3,
            Some("LlamaForCausalLM") => Architecture::Llama,
            Some("Qwen2MoeForCausalLM") => Architecture::Qwen2Moe,
            Some("Qwen3MoeForCausalLM") => Architecture::Qwen3Moe,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "architecture {other:?}; rlstream reads LlamaForCausalLM, Qwen2ForCausalLM, \
                     Qwen3ForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM"
                )));
            }
        })
    }

    /// The mixture-of-experts fields of `arch` (all required), `None` for a dense one.
    fn experts(&self, arch: Architecture) -> Result<Option<MoeConfig>, ModelError> {
        if !arch.is_moe() {
            return Ok(None);
        }
        let need = |field: &str, v: Option<usize>| {
            v.ok_or_else(|| ModelError::Config {
                field: field.into(),
                reason: format!("is required for {}", arch.hf_name()),
            })
        };
        Ok(Some(MoeConfig {
            num_experts: need("num_experts", self.num_experts)?,
            top_k: need("num_experts_per_tok", self.num_experts_per_tok)?,
            expert_size: need("moe_intermediate_size", self.moe_intermediate_size)?,
            norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
            shared_expert_size: match arch {
                Architecture::Qwen2Moe => Some(need(
                    "shared_expert_intermediate_size",
                    self.shared_expert_intermediate_size,
                )?),
                _ => None,
            },
            sparse_step: self.decoder_sparse_step.unwrap_or(1),
            dense_layers: self.mlp_only_layers.clone().unwrap_or_default(),
        }))
    }

    /// The rotary base and scaling, from `rope_theta` and `rope_scaling` or
    /// `rope_parameters` (transformers 5).
    fn rope(&self) -> Result<(f64, Option<Llama3Rope>), ModelError> {
        let mut rope_theta = self.rope_theta.unwrap_or(DEFAULT_ROPE_THETA);
        let mut rope_scaling = None;
        for (field, v) in [
            ("rope_scaling", &self.rope_scaling),
            ("rope_parameters", &self.rope_parameters),
        ] {
            let Some(p) = v.as_ref().filter(|v| !v.is_null()) else {
                continue;
            };
            // transformers 4 wrote `type`, later versions `rope_type`.
            let kind = p
                .get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            match kind {
                "default" => {}
                "llama3" => rope_scaling = Some(Llama3Rope::from_json(p)?),
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "{field}.rope_type `{other}`; rlstream supports the plain rotary \
                         embedding and llama3 scaling"
                    )));
                }
            }
            if let Some(theta) = p.get("rope_theta").and_then(|t| t.as_f64()) {
                rope_theta = theta;
            }
        }
        Ok((rope_theta, rope_scaling))
    }

    /// Layer variants rlstream does not run (MLP bias, sliding or other attention).
    fn check_supported(&self) -> Result<(), ModelError> {
        if self.mlp_bias == Some(true) {
            return Err(ModelError::Unsupported("mlp_bias = true".into()));
        }
        if self.use_sliding_window == Some(true) {
            return Err(ModelError::Unsupported(
                "use_sliding_window = true (sliding-window attention)".into(),
            ));
        }
        if let Some(t) = self
            .layer_types
            .iter()
            .flatten()
            .find(|t| t.as_str() != "full_attention")
        {
            return Err(ModelError::Unsupported(format!(
                "layer_types `{t}` (rlstream runs full attention in every layer)"
            )));
        }
        Ok(())
    }
}

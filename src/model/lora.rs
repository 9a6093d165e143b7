//! LoRA adapters: low-rank updates `W + (α / r) · A · B` on chosen linear layers, with the
//! base weights frozen.
//!
//! An adapter is rank-`r` factors `A` `[in, r]` and `B` `[r, out]` (burn's layout) on each
//! target module of each layer. The trainer holds gradients and AdamW state for those only;
//! the generators receive the whole adapter (never a delta) and apply it to a pristine copy
//! of the base. On disk it is PEFT's format, `adapter_model.safetensors` with
//! `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and
//! `lora_B.weight` `[out, r]`, plus `adapter_config.json`, so Python `peft` loads it onto
//! the Hugging Face base model (`tests/integration/lora.rs` checks the logits against `peft`'s).
//!
//! A fresh adapter is PEFT's default initialisation: `A` uniform in `±1/√in` (Kaiming
//! uniform with `a = √5`), `B` zero, so the adapted model starts as the base.

use super::layers::{BlockLora, Lora, Target};
use super::llama::Policy;
use super::tensors::{HostTensor, TensorMap, WeightDtype, tensors_checksum};
use super::{Kernels, ModelError, host_f32};
use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde::Deserialize;
use std::path::Path;

/// The file of an adapter's tensors.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The file of an adapter's settings.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// Prefix of every tensor name PEFT writes for a causal LM.
const PEFT_PREFIX: &str = "base_model.model.model.layers";

/// An adapter's shape and scaling: what `adapter_config.json` says.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f32,
    /// Dropout on the adapter's input while training (0 for RL: the trainer's forward
    /// then equals the sampler's).
    pub dropout: f32,
    pub targets: Vec<Target>,
}

impl LoraSpec {
    /// `alpha / rank`, PEFT's scaling without rsLoRA.
    pub fn scale(&self) -> f64 {
        f64::from(self.alpha) / self.rank as f64
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("rank must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err("alpha must be > 0".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err("dropout must be in [0, 1)".into());
        }
        if self.targets.is_empty() {
            return Err("no target modules".into());
        }
        Ok(())
    }

    /// `adapter_config.json` as PEFT writes it for a causal LM.
    pub fn to_peft_json(&self, base_model: Option<&str>) -> String {
        let v = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": false,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Reads `adapter_config.json`; refuses what rlstream does not apply the way PEFT would
    /// (rsLoRA, DoRA, per-module ranks, trained biases, extra saved modules).
    pub fn from_peft_json(text: &str) -> Result<LoraSpec, String> {
        #[derive(Deserialize)]
        struct Peft {
            peft_type: Option<String>,
            r: usize,
            lora_alpha: f32,
            #[serde(default)]
            lora_dropout: f32,
            target_modules: serde_json::Value,
            #[serde(default)]
            bias: Option<String>,
            #[serde(default)]
            use_rslora: bool,
            #[serde(default)]
            use_dora: bool,
            #[serde(default)]
            fan_in_fan_out: bool,
            #[serde(default)]
            rank_pattern: Option<serde_json::Map<String, serde_json::Value>>,
            #[serde(default)]
            alpha_pattern: Option<serde_json::Map<String, serde_json::Value>>,
            #[serde(default)]
            modules_to_save: Option<serde_json::Value>,
            #[serde(default)]
            layers_to_transform: Option<serde_json::Value>,
        }
        let p: Peft = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if p.peft_type.as_deref().is_some_and(|t| t != "LORA") {
            return Err(format!("peft_type {:?} is not LORA", p.peft_type));
        }
        let unsupported = [
            (p.use_rslora, "use_rslora"),
            (p.use_dora, "use_dora"),
            (p.fan_in_fan_out, "fan_in_fan_out"),
            (
                p.rank_pattern.is_some_and(|m| !m.is_empty()),
                "rank_pattern",
            ),
            (
                p.alpha_pattern.is_some_and(|m| !m.is_empty()),
                "alpha_pattern",
            ),
            (
                p.modules_to_save.is_some_and(|m| !m.is_null()),
                "modules_to_save",
            ),
            (
                p.layers_to_transform.is_some_and(|m| !m.is_null()),
                "layers_to_transform",
            ),
            (
                p.bias.as_deref().is_some_and(|b| b != "none"),
                "bias other than none",
            ),
        ];
        if let Some((_, what)) = unsupported.iter().find(|(on, _)| *on) {
            return Err(format!("{what} is not supported"));
        }
        let targets = match &p.target_modules {
            serde_json::Value::String(s) => Target::parse_list(s)?,
            serde_json::Value::Array(a) => {
                let names: Vec<&str> = a.iter().filter_map(|v| v.as_str()).collect();
                Target::parse_list(&names.join(","))?
            }
            other => return Err(format!("target_modules {other} is not a list")),
        };
        let spec = LoraSpec {
            rank: p.r,
            alpha: p.lora_alpha,
            dropout: p.lora_dropout,
            targets,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The adapter's tensors by PEFT name with their shapes, for a model of `cfg`.
    pub fn expected_tensors(&self, cfg: &super::ModelConfig) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for layer in 0..cfg.num_layers {
            for &t in &self.targets {
                let (d_in, d_out) = dims(cfg, t);
                out.push((peft_name(layer, t, 'A'), vec![self.rank, d_in]));
                out.push((peft_name(layer, t, 'B'), vec![d_out, self.rank]));
            }
        }
        out
    }

    /// Adapter parameters of a model of `cfg`.
    pub fn num_params(&self, cfg: &super::ModelConfig) -> usize {
        self.expected_tensors(cfg)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// `(in, out)` of target `t` in a model of `cfg`.
fn dims(cfg: &super::ModelConfig, t: Target) -> (usize, usize) {
    let (d, ff) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    match t {
        Target::Q => (d, q),
        Target::K | Target::V => (d, kv),
        Target::O => (q, d),
        Target::Gate | Target::Up => (d, ff),
        Target::Down => (ff, d),
    }
}

/// `base_model.model.model.layers.{layer}.{parent}.{module}.lora_{A|B}.weight`.
pub fn peft_name(layer: usize, t: Target, which: char) -> String {
    format!(
        "{PEFT_PREFIX}.{layer}.{}.{}.lora_{which}.weight",
        t.parent(),
        t.module()
    )
}

/// A trainable parameter whose id is fixed by its place in the adapter, so that a resumed
/// trainer's optimizer state finds its parameters.
fn param<B: Backend>(value: Tensor<B, 2>, name: &str) -> Param<Tensor<B, 2>> {
    let id = crate::seed::derive(0, &format!("lora/{name}"));
    Param::initialized(id.into(), value.require_grad())
}

impl<B: Backend> Policy<B> {
    /// Whether the model carries an adapter.
    pub fn has_adapter(&self) -> bool {
        self.blocks.iter().any(|b| b.lora.is_some())
    }

    /// The model with its base parameters frozen (no gradients, no optimizer state) and a
    /// fresh adapter of `spec`: `A` uniform in `±1/√in` from `seed`, `B` zero.
    pub fn with_fresh_adapter(self, spec: &LoraSpec, seed: u64) -> Result<Self, ModelError> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let cfg = self.config().clone();
        let mut tensors = TensorMap::new();
        for (name, shape) in spec.expected_tensors(&cfg) {
            let n: usize = shape.iter().product();
            let data = if name.contains(".lora_A.") {
                let bound = 1.0 / (shape[1] as f64).sqrt();
                (0..n)
                    .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
                    .collect()
            } else {
                vec![0.0; n]
            };
            tensors.insert(name, HostTensor { shape, data });
        }
        self.with_adapter(spec, &tensors)
    }

    /// The model with its base parameters frozen and the adapter `tensors` (PEFT names
    /// and layout) of `spec`, every name and shape checked.
    pub fn with_adapter(self, spec: &LoraSpec, tensors: &TensorMap) -> Result<Self, ModelError> {
        spec.validate().map_err(|reason| ModelError::Config {
            field: "lora".into(),
            reason,
        })?;
        let cfg = self.config().clone();
        if cfg.moe.is_some() {
            return Err(ModelError::Unsupported(format!(
                "LoRA on {}, a mixture-of-experts model: rlstream adapts dense models only \
                 (train the MoE model's full weights instead)",
                cfg.architecture.hf_name()
            )));
        }
        let expected: std::collections::HashMap<String, Vec<usize>> =
            spec.expected_tensors(&cfg).into_iter().collect();
        if let Some(extra) = tensors.keys().find(|k| !expected.contains_key(*k)) {
            return Err(ModelError::Unsupported(format!(
                "adapter tensor `{extra}` is not one of the adapter's target modules ({}) of a {}-layer model",
                spec.targets
                    .iter()
                    .map(|t| t.short())
                    .collect::<Vec<_>>()
                    .join(","),
                cfg.num_layers
            )));
        }
        let device = self.device();
        let mut model = self.no_grad();
        for (layer, block) in model.blocks.iter_mut().enumerate() {
            let mut adapters = BlockLora::empty();
            for &t in &spec.targets {
                let get = |which: char| -> Result<Tensor<B, 2>, ModelError> {
                    let name = peft_name(layer, t, which);
                    let h = tensors
                        .get(&name)
                        .ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
                    if h.shape != expected[&name] {
                        return Err(ModelError::Shape {
                            expected: expected[&name].clone(),
                            name,
                            found: h.shape.clone(),
                        });
                    }
                    if let Some(i) = h.data.iter().position(|v| !v.is_finite()) {
                        return Err(ModelError::Unsupported(format!(
                            "adapter tensor `{name}` holds a non-finite value at {i}"
                        )));
                    }
                    // PEFT's [r, in] and [out, r] are the transposes of burn's layout.
                    let (rows, cols) = (h.shape[0], h.shape[1]);
                    Ok(Tensor::from_data(
                        TensorData::new(
                            super::tensors::transpose(&h.data, rows, cols),
                            [cols, rows],
                        ),
                        &device,
                    ))
                };
                let key = format!("{layer}/{}", t.short());
                *adapters.slot(t) = Some(Lora {
                    a: param(get('A')?, &format!("{key}/A")),
                    b: param(get('B')?, &format!("{key}/B")),
                    scale: spec.scale(),
                    dropout: f64::from(spec.dropout),
                });
            }
            block.lora = Some(adapters);
        }
        Ok(model)
    }

    /// The model without its adapter (the base it applies to; tensors are shared).
    pub fn without_adapter(&self) -> Self {
        let mut base = self.clone();
        for block in &mut base.blocks {
            block.lora = None;
        }
        base
    }

    /// The adapter's tensors by PEFT name and layout (empty without one).
    pub fn adapter_tensors(&self) -> Result<TensorMap, ModelError> {
        let mut out = TensorMap::new();
        for (layer, block) in self.blocks.iter().enumerate() {
            let Some(adapters) = &block.lora else {
                continue;
            };
            for t in Target::ALL {
                let Some(l) = adapters.get(t) else { continue };
                for (which, w) in [('A', l.a.val()), ('B', l.b.val())] {
                    let w = w.transpose();
                    let shape = w.dims().to_vec();
                    out.insert(
                        peft_name(layer, t, which),
                        HostTensor {
                            shape,
                            data: host_f32(w.into_data())?,
                        },
                    );
                }
            }
        }
        Ok(out)
    }

    /// The adapter merged into a copy of the weights: each target's `W + scale · A · B`,
    /// every other tensor shared with `self`. Without an adapter, `self` as it is.
    pub fn merged(&self) -> Self {
        let mut out = self.without_adapter();
        for (block, src) in out.blocks.iter_mut().zip(&self.blocks) {
            let Some(adapters) = &src.lora else { continue };
            for t in Target::ALL {
                let Some(l) = adapters.get(t) else { continue };
                let linear = match t {
                    Target::Q => &mut block.attn.q,
                    Target::K => &mut block.attn.k,
                    Target::V => &mut block.attn.v,
                    Target::O => &mut block.attn.o,
                    Target::Gate | Target::Up | Target::Down => {
                        let Some(mlp) = block.mlp.as_mut() else {
                            continue;
                        };
                        match t {
                            Target::Gate => &mut mlp.gate,
                            Target::Up => &mut mlp.up,
                            _ => &mut mlp.down,
                        }
                    }
                };
                let delta = l.a.val().matmul(l.b.val()).mul_scalar(l.scale);
                // Summed `[out, in]` and read back as the `[in, out]` view, so that a
                // generation model's merged weight keeps the layout its decode steps
                // stream (see `WeightStorage::decode_weight`).
                let w = super::storage::widened(linear.weight.val()).transpose();
                let w = (w + delta.transpose()).transpose();
                linear.weight = Param::initialized(linear.weight.id, w);
            }
        }
        out
    }

    /// Writes the adapter as PEFT does: `adapter_model.safetensors` in `dtype` and
    /// `adapter_config.json` naming `base_model` (written aside and renamed).
    pub fn save_adapter(
        &self,
        dir: &Path,
        spec: &LoraSpec,
        base_model: Option<&str>,
        dtype: WeightDtype,
    ) -> Result<(), ModelError> {
        write_adapter(dir, spec, &self.adapter_tensors()?, base_model, dtype)
    }
}

/// A tensor name without the adapter's name some writers keep in it
/// (`...q_proj.lora_A.default.weight` is `...q_proj.lora_A.weight`, as `save_pretrained`
/// writes it).
fn plain_name(name: String) -> String {
    for which in ["lora_A", "lora_B"] {
        let named = format!(".{which}.default.weight");
        if let Some(stem) = name.strip_suffix(&named) {
            return format!("{stem}.{which}.weight");
        }
    }
    name
}

/// Writes `tensors` (PEFT names) and `spec` as a PEFT adapter directory.
pub fn write_adapter(
    dir: &Path,
    spec: &LoraSpec,
    tensors: &TensorMap,
    base_model: Option<&str>,
    dtype: WeightDtype,
) -> Result<(), ModelError> {
    let io = |path: &Path, source| ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let bytes = super::tensors::tensors_to_safetensors_as(tensors, dtype)?;
    for (name, contents) in [
        (ADAPTER_FILE, bytes),
        (ADAPTER_CONFIG, spec.to_peft_json(base_model).into_bytes()),
    ] {
        let path = dir.join(name);
        let tmp = dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, contents).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// Reads a PEFT adapter directory (or a trainer's `checkpoints/latest`, which names one):
/// its spec and tensors (f32).
pub fn read_adapter(dir: &Path) -> Result<(LoraSpec, TensorMap), ModelError> {
    let dir = &super::model_dir(dir);
    let config = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&config).map_err(|e| ModelError::MissingFile {
        path: config.display().to_string(),
        reason: format!("{e} (an adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_FILE})"),
    })?;
    let spec = LoraSpec::from_peft_json(&text).map_err(|reason| ModelError::Config {
        field: config.display().to_string(),
        reason,
    })?;
    let tensors = super::tensors::read_safetensors_file(&dir.join(ADAPTER_FILE))?
        .into_iter()
        .map(|(name, t)| (plain_name(name), t))
        .collect();
    Ok((spec, tensors))
}

/// Loads the base model in `model_dir` with the adapter in `adapter_dir` applied.
pub fn load_with_adapter<B: Kernels>(
    model_dir: &Path,
    adapter_dir: &Path,
    device: &B::Device,
) -> Result<Policy<B>, ModelError> {
    let base = super::hf::load_hf::<B>(model_dir, device)?;
    let (spec, tensors) = read_adapter(adapter_dir)?;
    base.with_adapter(&spec, &tensors)
}

impl<B: Kernels> Policy<B> {
    /// xxh3 over the base weights (every tensor by HF name, f32, adapter excluded): what
    /// an adapter version says it applies to, and a generator checks before taking one.
    pub fn base_checksum(&self) -> Result<String, ModelError> {
        Ok(tensors_checksum(&self.without_adapter().to_tensors()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_lists_and_tensor_names() {
        assert_eq!(
            Target::parse_list("all-linear").unwrap(),
            Target::ALL.to_vec()
        );
        assert_eq!(
            Target::parse_list("v_proj, q ,q").unwrap(),
            vec![Target::Q, Target::V]
        );
        assert!(Target::parse_list("q,embed").unwrap_err().contains("embed"));
        assert!(Target::parse_list(" ").is_err());
        assert_eq!(
            peft_name(3, Target::Down, 'B'),
            "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
        );
        assert_eq!(
            plain_name(
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight".into()
            ),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        let plain = peft_name(0, Target::Q, 'A');
        assert_eq!(plain_name(plain.clone()), plain);
    }

    #[test]
    fn peft_config_round_trips() {
        let spec = LoraSpec {
            rank: 16,
            alpha: 32.0,
            dropout: 0.05,
            targets: vec![Target::Q, Target::Up],
        };
        let back = LoraSpec::from_peft_json(&spec.to_peft_json(Some("base"))).unwrap();
        assert_eq!(back, spec);
        assert_eq!(spec.scale(), 2.0);
    }
}

//! Hugging Face checkpoints and weight blobs.
//!
//! Tensor names and layouts are exactly those of `transformers`' Llama/Qwen2
//! (`model.layers.{i}.self_attn.q_proj.weight` as `[out, in]`, ...), so a checkpoint
//! written here loads in `transformers` and the other way round. The same named tensors,
//! serialised as one safetensors buffer, are the weight blob the trainer publishes.

use super::config::{ModelConfig, MoeConfig};
use super::layers::Mlp;
use super::llama::{Assembler, Attention, Block, Policy};
use super::moe::Moe;
use super::tensors::{
    HostTensor, TensorMap, WeightDtype, read_safetensors_file, safetensors_to_tensors,
    tensors_to_safetensors, tensors_to_safetensors_as, transpose,
};
use super::{Kernels, ModelError};
use burn::tensor::{Tensor, TensorData};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

/// Every tensor a policy of this config has, with its HF name and shape.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (d, hd, ff) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, d],
    )];
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        out.push((format!("{p}.input_layernorm.weight"), vec![d]));
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![q_out, d]));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv_out, d]));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv_out, d]));
        if cfg.qkv_bias {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![q_out]));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv_out]));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv_out]));
        }
        if cfg.qk_norm {
            out.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            out.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![d, q_out]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
        let mut swiglu = |prefix: String, width: usize| {
            out.push((format!("{prefix}.gate_proj.weight"), vec![width, d]));
            out.push((format!("{prefix}.up_proj.weight"), vec![width, d]));
            out.push((format!("{prefix}.down_proj.weight"), vec![d, width]));
        };
        match &cfg.moe {
            Some(m) if m.is_sparse(i) => {
                for j in 0..m.num_experts {
                    swiglu(format!("{p}.mlp.experts.{j}"), m.expert_size);
                }
                if let Some(s) = m.shared_expert_size {
                    swiglu(format!("{p}.mlp.shared_expert"), s);
                    out.push((format!("{p}.mlp.shared_expert_gate.weight"), vec![1, d]));
                }
                out.push((format!("{p}.mlp.gate.weight"), vec![m.num_experts, d]));
            }
            _ => swiglu(format!("{p}.mlp"), ff),
        }
    }
    out.push(("model.norm.weight".to_string(), vec![d]));
    if !cfg.tie_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, d]));
    }
    out
}

impl<B: Kernels> Policy<B> {
    /// Builds the policy from named tensors, checking every name and shape. The tensors
    /// are copied; [`Policy::from_owned_tensors`] moves them instead.
    pub fn from_tensors(
        cfg: &ModelConfig,
        tensors: &TensorMap,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::assemble(cfg, |name| tensors.get(name).map(Cow::Borrowed), device)
    }

    /// [`Policy::from_tensors`] taking the tensors: each host buffer becomes its parameter
    /// without a copy (linear weights are transposed one at a time), so building the model
    /// needs no second copy of the weights.
    pub fn from_owned_tensors(
        cfg: &ModelConfig,
        tensors: TensorMap,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let tensors = std::cell::RefCell::new(tensors);
        Self::assemble(
            cfg,
            |name| tensors.borrow_mut().remove(name).map(Cow::Owned),
            device,
        )
    }

    fn assemble<'a>(
        cfg: &ModelConfig,
        take: impl Fn(&str) -> Option<Cow<'a, HostTensor>>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        cfg.validate()?;
        let load = Loader {
            source: std::marker::PhantomData,
            cfg,
            shapes: expected_tensors(cfg).into_iter().collect(),
            take,
            device,
            asm: Assembler::<B>::new(device),
        };
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        let mut moe_index = 0;
        for i in 0..cfg.num_layers {
            blocks.push(load.block(i, &mut moe_index)?);
        }
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(load.asm.linear(load.linear_weight("lm_head.weight")?, None))
        };
        Ok(load.asm.policy(
            cfg,
            load.matrix("model.embed_tokens.weight")?,
            blocks,
            load.norm("model.norm.weight")?,
            head,
        ))
    }

    /// A randomly initialised policy (normal(0, 0.02) weights, unit norms, zero biases),
    /// reproducible from `seed`.
    pub fn random(cfg: &ModelConfig, seed: u64, device: &B::Device) -> Result<Self, ModelError> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = TensorMap::new();
        for (name, shape) in expected_tensors(cfg) {
            let n: usize = shape.iter().product();
            let data = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else if name.ends_with(".bias") {
                vec![0.0; n]
            } else {
                (0..n)
                    .map(|_| {
                        // Box-Muller: two uniforms to one normal draw.
                        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
                        (0.02 * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
                    })
                    .collect()
            };
            tensors.insert(name, HostTensor { shape, data });
        }
        Self::from_owned_tensors(cfg, tensors, device)
    }

    /// A fresh policy from a weight blob; the running model is not touched.
    pub fn from_bytes(
        cfg: &ModelConfig,
        bytes: &[u8],
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::from_owned_tensors(cfg, safetensors_to_tensors(bytes, None)?, device)
    }
}

impl<B: Kernels> Policy<B> {
    /// Every parameter by HF name, copied to the host. A model with an adapter gives its
    /// merged weights (what a plain Hugging Face model of it holds).
    pub fn to_tensors(&self) -> Result<TensorMap, ModelError> {
        if self.has_adapter() {
            return self.merged().to_tensors();
        }
        super::params::collect(self)
    }

    /// All parameters as one safetensors buffer (f32): the published weight blob.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        tensors_to_safetensors(&self.to_tensors()?)
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if missing), f32.
    pub fn save_hf(&self, dir: &Path) -> Result<(), ModelError> {
        self.save_hf_as(dir, WeightDtype::F32)
    }

    /// Writes `config.json` (with `torch_dtype`) and `model.safetensors` in `dtype`.
    pub fn save_hf_as(&self, dir: &Path, dtype: WeightDtype) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::io(dir, source))?;
        let config = dir.join("config.json");
        std::fs::write(&config, self.config().to_hf_json_as(dtype.torch_name()))
            .map_err(|source| ModelError::io(&config, source))?;
        let weights = dir.join("model.safetensors");
        let tmp = dir.join("model.safetensors.tmp");
        let bytes = tensors_to_safetensors_as(&self.to_tensors()?, dtype)?;
        std::fs::write(&tmp, bytes).map_err(|source| ModelError::io(&tmp, source))?;
        std::fs::rename(&tmp, &weights).map_err(|source| ModelError::io(&weights, source))
    }
}

/// Named host tensors, checked against the shapes a config expects and made into burn
/// tensors and modules on `device`.
struct Loader<'a, 'd, B: Kernels, F> {
    /// Where the tensors `take` hands out live (borrowed from a map, or owned).
    source: std::marker::PhantomData<Cow<'a, HostTensor>>,
    cfg: &'d ModelConfig,
    shapes: HashMap<String, Vec<usize>>,
    take: F,
    device: &'d B::Device,
    asm: Assembler<'d, B>,
}

impl<'a, 'd, B, F> Loader<'a, 'd, B, F>
where
    B: Kernels,
    F: Fn(&str) -> Option<Cow<'a, HostTensor>>,
{
    fn get(&self, name: &str) -> Result<Cow<'a, HostTensor>, ModelError> {
        let t = (self.take)(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let expected = &self.shapes[name];
        if &t.shape != expected {
            return Err(ModelError::Shape {
                name: name.to_string(),
                expected: expected.clone(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    fn matrix(&self, name: &str) -> Result<Tensor<B, 2>, ModelError> {
        let t = self.get(name)?.into_owned();
        let shape = [t.shape[0], t.shape[1]];
        Ok(Tensor::from_data(
            TensorData::new(t.data, shape),
            self.device,
        ))
    }

    /// A linear weight: HF stores `[out, in]`, burn's `Linear` wants `[in, out]`. A model
    /// built for generation takes the backend's [`WeightStorage::decode_weight`] (the stored order
    /// read as a transposed view, bf16 values in 16 bits on the CPU); otherwise the weight is
    /// transposed on the host so the parameter is contiguous (the backward's products read
    /// it row-major).
    fn linear_weight(&self, name: &str) -> Result<Tensor<B, 2>, ModelError> {
        let t = self.get(name)?;
        let (rows, cols) = (t.shape[0], t.shape[1]);
        if !B::ad_enabled(self.device) {
            return Ok(B::decode_weight(
                t.into_owned().data,
                [rows, cols],
                self.device,
            ));
        }
        Ok(Tensor::from_data(
            TensorData::new(transpose(&t.data, rows, cols), [cols, rows]),
            self.device,
        ))
    }

    fn vector(&self, name: &str) -> Result<Tensor<B, 1>, ModelError> {
        let t = self.get(name)?.into_owned();
        let shape = [t.shape[0]];
        Ok(Tensor::from_data(
            TensorData::new(t.data, shape),
            self.device,
        ))
    }

    fn norm(&self, name: &str) -> Result<burn::nn::RmsNorm<B>, ModelError> {
        Ok(self.asm.norm(self.vector(name)?, self.cfg.rms_norm_eps))
    }

    /// A bias-free linear layer.
    fn plain_linear(&self, name: &str) -> Result<burn::nn::Linear<B>, ModelError> {
        Ok(self.asm.linear(self.linear_weight(name)?, None))
    }

    /// The SwiGLU MLP under `prefix` (`model.layers.3.mlp`, an expert, the shared expert).
    fn swiglu(&self, prefix: &str) -> Result<Mlp<B>, ModelError> {
        let w = |n: &str| self.plain_linear(&format!("{prefix}.{n}_proj.weight"));
        Ok(Mlp {
            gate: w("gate")?,
            up: w("up")?,
            down: w("down")?,
        })
    }

    /// The attention of layer `p` (`model.layers.3`).
    fn attention(&self, p: &str) -> Result<Attention<B>, ModelError> {
        let proj = |n: &str| -> Result<burn::nn::Linear<B>, ModelError> {
            let weight = self.linear_weight(&format!("{p}.self_attn.{n}_proj.weight"))?;
            let bias = if self.cfg.qkv_bias && n != "o" {
                Some(self.vector(&format!("{p}.self_attn.{n}_proj.bias"))?)
            } else {
                None
            };
            Ok(self.asm.linear(weight, bias))
        };
        let qk_norm = if self.cfg.qk_norm {
            let norm = |n: &str| self.norm(&format!("{p}.self_attn.{n}_norm.weight"));
            Some((norm("q")?, norm("k")?))
        } else {
            None
        };
        let projections = [proj("q")?, proj("k")?, proj("v")?, proj("o")?];
        Ok(self.asm.attention(self.cfg, projections, qk_norm))
    }

    /// The routed experts of layer `p`, the `index`-th MoE layer.
    fn experts(&self, p: &str, m: &MoeConfig, index: usize) -> Result<Moe<B>, ModelError> {
        let experts = (0..m.num_experts)
            .map(|j| self.swiglu(&format!("{p}.mlp.experts.{j}")))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = match m.shared_expert_size {
            Some(_) => Some((
                self.swiglu(&format!("{p}.mlp.shared_expert"))?,
                self.plain_linear(&format!("{p}.mlp.shared_expert_gate.weight"))?,
            )),
            None => None,
        };
        let router = self.plain_linear(&format!("{p}.mlp.gate.weight"))?;
        Ok(Moe::new(
            router,
            experts,
            shared,
            m.top_k,
            m.norm_topk_prob,
            index,
        ))
    }

    /// Decoder layer `i`; `moe_index` counts the MoE layers built so far.
    fn block(&self, i: usize, moe_index: &mut usize) -> Result<Block<B>, ModelError> {
        let p = format!("model.layers.{i}");
        let (mlp, moe) = match &self.cfg.moe {
            Some(m) if m.is_sparse(i) => {
                let moe = self.experts(&p, m, *moe_index)?;
                *moe_index += 1;
                (None, Some(moe))
            }
            _ => (Some(self.swiglu(&format!("{p}.mlp"))?), None),
        };
        Ok(Block {
            attn_norm: self.norm(&format!("{p}.input_layernorm.weight"))?,
            attn: self.attention(&p)?,
            mlp_norm: self.norm(&format!("{p}.post_attention_layernorm.weight"))?,
            mlp,
            moe,
            lora: None,
        })
    }
}

/// Loads `config.json` plus `model.safetensors` or a sharded
/// `model.safetensors.index.json` from a Hugging Face model directory.
pub fn load_hf<B: Kernels>(dir: &Path, device: &B::Device) -> Result<Policy<B>, ModelError> {
    let dir = &super::model_dir(dir);
    let no_model = |reason: String| ModelError::NoModel {
        dir: dir.display().to_string(),
        reason,
    };
    if !dir.is_dir() {
        return Err(no_model(if dir.exists() {
            "not a directory (a model directory holds config.json and model.safetensors)".into()
        } else {
            "the directory does not exist".into()
        }));
    }
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => no_model(
            "config.json not found (a Hugging Face model directory holds config.json and \
             model.safetensors)"
                .into(),
        ),
        _ => ModelError::io(&config_path, e),
    })?;
    let cfg = ModelConfig::from_hf_json(&text)?;
    let mut tensors = read_hf_tensors(dir)?;
    unfuse_experts(&mut tensors)?;
    Policy::from_owned_tensors(&cfg, tensors, device)
}

/// Splits fused 3-D expert tensors, as `transformers` 5 holds them
/// (`mlp.experts.gate_up_proj` `[experts, 2 × width, hidden]` with the gate rows first, and
/// `mlp.experts.down_proj` `[experts, hidden, width]`), into the per-expert tensors of the
/// hub layout (`mlp.experts.{j}.gate_proj.weight` ...) that rlstream reads and writes.
pub fn unfuse_experts(tensors: &mut TensorMap) -> Result<(), ModelError> {
    let fused: Vec<String> = tensors
        .keys()
        .filter(|k| {
            k.ends_with(".mlp.experts.gate_up_proj") || k.ends_with(".mlp.experts.down_proj")
        })
        .cloned()
        .collect();
    for name in fused {
        let Some(t) = tensors.remove(&name) else {
            continue;
        };
        let &[experts, rows, cols] = t.shape.as_slice() else {
            return Err(ModelError::Shape {
                name,
                expected: vec![0, 0, 0],
                found: t.shape,
            });
        };
        let (prefix, gate_up) = match name.strip_suffix("gate_up_proj") {
            Some(p) => (p.to_string(), true),
            None => (name.trim_end_matches("down_proj").to_string(), false),
        };
        if gate_up && !rows.is_multiple_of(2) {
            return Err(ModelError::Shape {
                name,
                expected: vec![experts, rows + 1, cols],
                found: t.shape,
            });
        }
        let per = rows * cols;
        for j in 0..experts {
            let block = &t.data[j * per..(j + 1) * per];
            if gate_up {
                let half = rows / 2;
                for (part, range) in [("gate", 0..half * cols), ("up", half * cols..per)] {
                    tensors.insert(
                        format!("{prefix}{j}.{part}_proj.weight"),
                        HostTensor {
                            shape: vec![half, cols],
                            data: block[range].to_vec(),
                        },
                    );
                }
            } else {
                tensors.insert(
                    format!("{prefix}{j}.down_proj.weight"),
                    HostTensor {
                        shape: vec![rows, cols],
                        data: block.to_vec(),
                    },
                );
            }
        }
    }
    Ok(())
}

/// The ids that end a completion: `config.json`'s `eos_token_id` and every id of
/// `generation_config.json`'s (a chat model lists its end-of-turn token there, e.g. Qwen3's
/// `<|im_end|>` and `<|endoftext|>`). A missing or unreadable generation config adds none.
pub fn stop_tokens(dir: &Path, cfg: &ModelConfig) -> Vec<u32> {
    let mut ids: Vec<u32> = cfg.eos_token_id.into_iter().collect();
    let generation = std::fs::read_to_string(dir.join("generation_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let listed = match generation.as_ref().and_then(|g| g.get("eos_token_id")) {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).collect(),
        Some(v) => v.as_u64().into_iter().collect(),
        None => Vec::new(),
    };
    for id in listed {
        let id = id as u32;
        if (id as usize) < cfg.vocab_size && !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Reads every tensor of a model directory into host memory (f32).
pub fn read_hf_tensors(dir: &Path) -> Result<TensorMap, ModelError> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let text =
            std::fs::read_to_string(&index).map_err(|source| ModelError::io(&index, source))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::Safetensors {
                path: Some(index.display().to_string()),
                reason: e.to_string(),
            })?;
        let map = v["weight_map"]
            .as_object()
            .ok_or_else(|| ModelError::Safetensors {
                path: Some(index.display().to_string()),
                reason: "no `weight_map` object".into(),
            })?;
        let mut shards: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        shards.sort();
        shards.dedup();
        shards.into_iter().map(|s| dir.join(s)).collect()
    } else {
        return Err(ModelError::MissingFile {
            path: single.display().to_string(),
            reason: "neither model.safetensors nor model.safetensors.index.json exists".into(),
        });
    };
    let mut out = TensorMap::new();
    for f in files {
        out.extend(read_safetensors_file(&f)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Architecture;
    use crate::model::storage::HfValues;
    use burn::backend::NdArray;

    fn tiny() -> Policy<NdArray> {
        let cfg = ModelConfig::tiny(Architecture::Qwen2, 50).with_qkv_bias(true);
        Policy::random(&cfg, 3, &Default::default()).expect("random policy")
    }

    /// Values moved out of a generation model, changed and put back are its weights; one
    /// model's values copied into another's make it the same model; names and shapes are
    /// the Hugging Face tensors'.
    #[test]
    fn values_move_out_and_back_in_place() {
        let model = tiny();
        let before = model.to_tensors().expect("tensors");
        let (hollow, mut params) = model.clone().take_values().expect("take");
        let want: HashMap<String, Vec<usize>> =
            expected_tensors(model.config()).into_iter().collect();
        assert_eq!(params.len(), want.len());
        for p in &params {
            assert_eq!(Some(&p.shape), want.get(&p.name), "{}", p.name);
        }
        let norm = params
            .iter_mut()
            .find(|p| p.name == "model.norm.weight")
            .expect("norm");
        match &mut norm.values {
            HfValues::F32(v) => v[3] = 7.5,
            HfValues::Bf16(_) => panic!("a norm is held in f32"),
        }
        let changed = hollow
            .fill(params)
            .expect("fill")
            .to_tensors()
            .expect("tensors");
        for (name, t) in &before {
            if name == "model.norm.weight" {
                assert_eq!(changed[name].data[3], 7.5);
                assert_eq!(changed[name].data[..3], t.data[..3]);
            } else {
                assert_eq!(&changed[name], t, "{name}");
            }
        }
        let other = Policy::<NdArray>::random(model.config(), 9, &Default::default()).unwrap();
        let (hollow, mut params) = other.take_values().expect("take");
        model.copy_values_into(&mut params).expect("copy");
        let copied = hollow.fill(params).expect("fill");
        assert_eq!(copied.to_tensors().expect("tensors"), before);
    }

    /// A bf16 checkpoint: half the bytes, `torch_dtype` says so, every value is its f32
    /// rounded to bf16, and the streaming reader agrees with the whole-buffer decoder.
    #[test]
    fn bf16_checkpoints_round_trip() {
        let model = tiny();
        let dir = tempfile::tempdir().expect("tmp");
        let (f32_dir, bf16_dir) = (dir.path().join("f32"), dir.path().join("bf16"));
        model.save_hf(&f32_dir).expect("save f32");
        model
            .save_hf_as(&bf16_dir, WeightDtype::Bf16)
            .expect("save bf16");
        let size = |d: &Path| {
            std::fs::metadata(d.join("model.safetensors"))
                .expect("weights")
                .len() as f64
        };
        let ratio = size(&bf16_dir) / size(&f32_dir);
        assert!((0.49..0.55).contains(&ratio), "bf16/f32 size {ratio}");
        let config = std::fs::read_to_string(bf16_dir.join("config.json")).expect("config");
        assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");

        let exact = model.to_tensors().expect("tensors");
        let streamed = read_hf_tensors(&bf16_dir).expect("read bf16");
        let whole = std::fs::read(bf16_dir.join("model.safetensors")).expect("bytes");
        assert_eq!(
            streamed,
            safetensors_to_tensors(&whole, None).expect("decode")
        );
        assert_eq!(streamed.len(), exact.len());
        for (name, t) in &exact {
            let back = &streamed[name];
            assert_eq!(back.shape, t.shape, "{name}");
            for (a, b) in t.data.iter().zip(&back.data) {
                assert_eq!(half::bf16::from_f32(*a).to_f32(), *b, "{name}");
            }
        }
        let reloaded: Policy<NdArray> = load_hf(&bf16_dir, &Default::default()).expect("load");
        assert_eq!(reloaded.to_tensors().expect("tensors"), streamed);
        assert_eq!(read_hf_tensors(&f32_dir).expect("read f32"), exact);
    }

    /// A file cut short or with offsets past its end is refused with the file named.
    #[test]
    fn damaged_files_are_refused_by_name() {
        let dir = tempfile::tempdir().expect("tmp");
        tiny().save_hf(dir.path()).expect("save");
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).expect("bytes");
        std::fs::write(&path, &bytes[..bytes.len() - 10]).expect("truncate");
        let err = read_hf_tensors(dir.path())
            .expect_err("truncated")
            .to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("offsets"),
            "{err}"
        );
        std::fs::write(&path, &bytes[..6]).expect("truncate");
        let err = read_hf_tensors(dir.path())
            .expect_err("no header")
            .to_string();
        assert!(err.contains("header"), "{err}");
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&path, &huge).expect("write");
        let err = read_hf_tensors(dir.path())
            .expect_err("header length")
            .to_string();
        assert!(err.contains("header length"), "{err}");
    }

    /// Whether an NdArray matrix is stored row-major (not a transposed view).
    fn row_major(t: Tensor<NdArray, 2>) -> bool {
        match t.into_primitive().tensor() {
            burn::backend::ndarray::NdArrayTensor::F32(s) => s.into_shared().is_standard_layout(),
            _ => panic!("an f32 weight"),
        }
    }

    /// A model built for generation on NdArray keeps its linear weights as checkpoints store
    /// them (`[out, in]`, read as transposed views), so a decode step takes the few-row kernel;
    /// the trainer's copy (autodiff) holds them `[in, out]` row-major. Both are the same model,
    /// and the few-row and general products of a layer agree.
    #[test]
    fn generation_models_keep_linear_weights_as_checkpoints_store_them() {
        let cfg = ModelConfig::tiny(Architecture::Qwen2, 40);
        let generation = Policy::<NdArray>::random(&cfg, 1, &Default::default()).expect("policy");
        let trainer =
            Policy::<burn::backend::Autodiff<NdArray>>::random(&cfg, 1, &Default::default())
                .expect("policy");
        let (g, t) = (&generation.blocks[0].attn.q, &trainer.blocks[0].attn.q);
        assert!(!row_major(g.weight.val()));
        assert!(row_major(t.weight.val().inner()));
        assert_eq!(
            generation.to_tensors().expect("tensors"),
            trainer.to_tensors().expect("tensors")
        );
        let x = Tensor::<NdArray, 2>::random(
            [5, cfg.hidden_size],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &Default::default(),
        );
        let bias = || g.bias.as_ref().map(|b| b.val());
        let few = <NdArray as Kernels>::linear_rows(x.clone(), g.weight.val(), bias());
        let general = <NdArray as Kernels>::linear_rows(x, t.weight.val().inner(), bias());
        let (few, general) = (
            few.into_data().to_vec::<f32>().unwrap_or_default(),
            general.into_data().to_vec::<f32>().unwrap_or_default(),
        );
        for (a, b) in few.iter().zip(&general) {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "few-row {a} vs general {b}"
            );
        }
        assert_eq!(few.len(), 5 * cfg.hidden_size);
    }
}

//! Hugging Face checkpoints and weight blobs.
//!
//! Tensor names and layouts are exactly those of `transformers`' Llama/Qwen2
//! (`model.layers.{i}.self_attn.q_proj.weight` as `[out, in]`, ...), so a checkpoint
//! written here loads in `transformers` and the other way round. The same named tensors,
//! serialised as one safetensors buffer, are the weight blob the trainer publishes.

use super::config::PolicyConfig;
use super::llama::{Assembler, Block, Mlp, Policy};
use super::moe::Moe;
use super::{ModelError, host_f32};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// A tensor on the host: shape and row-major f32 values.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Named host tensors, in name order.
pub type TensorMap = BTreeMap<String, HostTensor>;

/// The dtype a checkpoint's `model.safetensors` is written in. Computation is f32 either
/// way; bf16 halves the file, and a trainer resumes from its own f32 record.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// 32-bit floats, exactly the trainer's weights.
    F32,
    /// bfloat16, rounded to nearest even from f32 (as `torch.Tensor.to(torch.bfloat16)`).
    Bf16,
}
crate::enum_setting!(WeightDtype);

impl WeightDtype {
    /// The `torch_dtype` of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }
}

/// Every tensor a policy of this config has, with its HF name and shape.
pub fn expected_tensors(cfg: &PolicyConfig) -> Vec<(String, Vec<usize>)> {
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

impl<B: Backend> Policy<B> {
    /// Builds the policy from named tensors, checking every name and shape. The tensors
    /// are copied; [`Policy::from_owned_tensors`] moves them instead.
    pub fn from_tensors(
        cfg: &PolicyConfig,
        tensors: &TensorMap,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::assemble(cfg, |name| tensors.get(name).map(Cow::Borrowed), device)
    }

    /// [`Policy::from_tensors`] taking the tensors: each host buffer becomes its parameter
    /// without a copy (linear weights are transposed one at a time), so building the model
    /// needs no second copy of the weights.
    pub fn from_owned_tensors(
        cfg: &PolicyConfig,
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
        cfg: &PolicyConfig,
        take: impl Fn(&str) -> Option<Cow<'a, HostTensor>>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        cfg.validate()?;
        let shapes: HashMap<String, Vec<usize>> = expected_tensors(cfg).into_iter().collect();
        let get = |name: &str| -> Result<Cow<'a, HostTensor>, ModelError> {
            let t = take(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            let expected = &shapes[name];
            if &t.shape != expected {
                return Err(ModelError::Shape {
                    name: name.to_string(),
                    expected: expected.clone(),
                    found: t.shape.clone(),
                });
            }
            Ok(t)
        };
        let t2 = |name: &str| -> Result<Tensor<B, 2>, ModelError> {
            let t = get(name)?.into_owned();
            let shape = [t.shape[0], t.shape[1]];
            Ok(Tensor::from_data(TensorData::new(t.data, shape), device))
        };
        // Linear weights: HF stores [out, in], burn's Linear wants [in, out]. Transpose on
        // the host so the parameter is contiguous (a transposed view would be copied on
        // every forward pass).
        let lin_w = |name: &str| -> Result<Tensor<B, 2>, ModelError> {
            let t = get(name)?;
            let (rows, cols) = (t.shape[0], t.shape[1]);
            Ok(Tensor::from_data(
                TensorData::new(transpose(&t.data, rows, cols), [cols, rows]),
                device,
            ))
        };
        let t1 = |name: &str| -> Result<Tensor<B, 1>, ModelError> {
            let t = get(name)?.into_owned();
            let shape = [t.shape[0]];
            Ok(Tensor::from_data(TensorData::new(t.data, shape), device))
        };
        let asm = Assembler::<B>::new(device);
        let eps = cfg.rms_norm_eps;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        let mut moe_index = 0;
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let bias = |n: &str| -> Result<Option<Tensor<B, 1>>, ModelError> {
                if cfg.qkv_bias {
                    t1(&format!("{p}.self_attn.{n}_proj.bias")).map(Some)
                } else {
                    Ok(None)
                }
            };
            let proj = |n: &str| lin_w(&format!("{p}.self_attn.{n}_proj.weight"));
            let qk_norm = if cfg.qk_norm {
                let norm = |n: &str| -> Result<_, ModelError> {
                    Ok(asm.norm(t1(&format!("{p}.self_attn.{n}_norm.weight"))?, eps))
                };
                Some((norm("q")?, norm("k")?))
            } else {
                None
            };
            let attn = asm.attention(
                cfg,
                [
                    asm.linear(proj("q")?, bias("q")?),
                    asm.linear(proj("k")?, bias("k")?),
                    asm.linear(proj("v")?, bias("v")?),
                    asm.linear(proj("o")?, None),
                ],
                qk_norm,
            );
            let swiglu = |prefix: &str| -> Result<Mlp<B>, ModelError> {
                let w = |n: &str| lin_w(&format!("{prefix}.{n}_proj.weight"));
                Ok(Mlp {
                    gate: asm.linear(w("gate")?, None),
                    up: asm.linear(w("up")?, None),
                    down: asm.linear(w("down")?, None),
                })
            };
            let (mlp, moe) = match &cfg.moe {
                Some(m) if m.is_sparse(i) => {
                    let experts = (0..m.num_experts)
                        .map(|j| swiglu(&format!("{p}.mlp.experts.{j}")))
                        .collect::<Result<Vec<_>, _>>()?;
                    let shared = match m.shared_expert_size {
                        Some(_) => Some((
                            swiglu(&format!("{p}.mlp.shared_expert"))?,
                            asm.linear(lin_w(&format!("{p}.mlp.shared_expert_gate.weight"))?, None),
                        )),
                        None => None,
                    };
                    let router = asm.linear(lin_w(&format!("{p}.mlp.gate.weight"))?, None);
                    let index = moe_index;
                    moe_index += 1;
                    let moe = Moe::new(router, experts, shared, m.top_k, m.norm_topk_prob, index);
                    (None, Some(moe))
                }
                _ => (Some(swiglu(&format!("{p}.mlp"))?), None),
            };
            blocks.push(Block {
                attn_norm: asm.norm(t1(&format!("{p}.input_layernorm.weight"))?, eps),
                attn,
                mlp_norm: asm.norm(t1(&format!("{p}.post_attention_layernorm.weight"))?, eps),
                mlp,
                moe,
                lora: None,
            });
        }
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(asm.linear(lin_w("lm_head.weight")?, None))
        };
        Ok(asm.policy(
            cfg,
            t2("model.embed_tokens.weight")?,
            blocks,
            asm.norm(t1("model.norm.weight")?, eps),
            head,
        ))
    }

    /// A randomly initialised policy (normal(0, 0.02) weights, unit norms, zero biases),
    /// reproducible from `seed`.
    pub fn random(cfg: &PolicyConfig, seed: u64, device: &B::Device) -> Result<Self, ModelError> {
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

    /// Every parameter by HF name, copied to the host. A model with an adapter gives its
    /// merged weights (what a plain Hugging Face model of it holds).
    pub fn to_tensors(&self) -> Result<TensorMap, ModelError> {
        if self.has_adapter() {
            return self.merged().to_tensors();
        }
        let mut on_device: Vec<(String, Vec<usize>, TensorData)> = Vec::new();
        let mut put2 = |name: String, t: Tensor<B, 2>, transpose: bool| {
            let t = if transpose { t.transpose() } else { t };
            on_device.push((name, t.dims().to_vec(), t.into_data()));
        };
        put2(
            "model.embed_tokens.weight".into(),
            self.embed.weight.val(),
            false,
        );
        if let Some(head) = &self.head {
            put2("lm_head.weight".into(), head.weight.val(), true);
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (n, lin) in [
                ("q", &b.attn.q),
                ("k", &b.attn.k),
                ("v", &b.attn.v),
                ("o", &b.attn.o),
            ] {
                put2(
                    format!("{p}.self_attn.{n}_proj.weight"),
                    lin.weight.val(),
                    true,
                );
            }
            let mut swiglu = |prefix: String, mlp: &Mlp<B>| {
                for (n, lin) in [("gate", &mlp.gate), ("up", &mlp.up), ("down", &mlp.down)] {
                    put2(format!("{prefix}.{n}_proj.weight"), lin.weight.val(), true);
                }
            };
            if let Some(mlp) = &b.mlp {
                swiglu(format!("{p}.mlp"), mlp);
            }
            if let Some(moe) = &b.moe {
                for (j, expert) in moe.experts.iter().enumerate() {
                    swiglu(format!("{p}.mlp.experts.{j}"), expert);
                }
                if let Some(shared) = &moe.shared {
                    swiglu(format!("{p}.mlp.shared_expert"), shared);
                }
                if let Some(gate) = &moe.shared_gate {
                    put2(
                        format!("{p}.mlp.shared_expert_gate.weight"),
                        gate.weight.val(),
                        true,
                    );
                }
                put2(
                    format!("{p}.mlp.gate.weight"),
                    moe.router.weight.val(),
                    true,
                );
            }
        }
        let mut put1 = |name: String, t: Tensor<B, 1>| {
            on_device.push((name, t.dims().to_vec(), t.into_data()));
        };
        put1("model.norm.weight".into(), self.norm.gamma.val());
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            put1(
                format!("{p}.input_layernorm.weight"),
                b.attn_norm.gamma.val(),
            );
            put1(
                format!("{p}.post_attention_layernorm.weight"),
                b.mlp_norm.gamma.val(),
            );
            for (n, norm) in [("q", &b.attn.q_norm), ("k", &b.attn.k_norm)] {
                if let Some(norm) = norm {
                    put1(format!("{p}.self_attn.{n}_norm.weight"), norm.gamma.val());
                }
            }
            for (n, lin) in [("q", &b.attn.q), ("k", &b.attn.k), ("v", &b.attn.v)] {
                if let Some(bias) = &lin.bias {
                    put1(format!("{p}.self_attn.{n}_proj.bias"), bias.val());
                }
            }
        }
        on_device
            .into_iter()
            .map(|(name, shape, data)| {
                Ok((
                    name,
                    HostTensor {
                        shape,
                        data: host_f32(data)?,
                    },
                ))
            })
            .collect()
    }

    /// All parameters as one safetensors buffer (f32): the published weight blob.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        tensors_to_safetensors(&self.to_tensors()?)
    }

    /// A fresh policy from a weight blob; the running model is not touched.
    pub fn from_bytes(
        cfg: &PolicyConfig,
        bytes: &[u8],
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::from_owned_tensors(cfg, safetensors_to_tensors(bytes, None)?, device)
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if missing), f32.
    pub fn save_hf(&self, dir: &Path) -> Result<(), ModelError> {
        self.save_hf_as(dir, WeightDtype::F32)
    }

    /// Writes `config.json` (with `torch_dtype`) and `model.safetensors` in `dtype`.
    pub fn save_hf_as(&self, dir: &Path, dtype: WeightDtype) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|source| io_err(dir, source))?;
        let config = dir.join("config.json");
        std::fs::write(&config, self.config().to_hf_json_as(dtype.torch_name()))
            .map_err(|source| io_err(&config, source))?;
        let weights = dir.join("model.safetensors");
        let tmp = dir.join("model.safetensors.tmp");
        let bytes = tensors_to_safetensors_as(&self.to_tensors()?, dtype)?;
        std::fs::write(&tmp, bytes).map_err(|source| io_err(&tmp, source))?;
        std::fs::rename(&tmp, &weights).map_err(|source| io_err(&weights, source))
    }
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` matrix, in 32 × 32 tiles so
/// that reads and writes both stay in cache (a 0.5B model's linear weights are 358M values).
pub(crate) fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const TILE: usize = 32;
    let mut out = vec![0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return out;
    }
    // Each band of TILE output rows (input columns) is contiguous: the bands go to the
    // cores in parallel, each written in cache tiles.
    out.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(band, chunk)| {
            let c0 = band * TILE;
            let c1 = (c0 + TILE).min(cols);
            for r0 in (0..rows).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    let row = &data[r * cols..(r + 1) * cols];
                    for c in c0..c1 {
                        chunk[(c - c0) * rows + r] = row[c];
                    }
                }
            }
        });
    out
}

fn io_err(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Loads `config.json` plus `model.safetensors` or a sharded
/// `model.safetensors.index.json` from a Hugging Face model directory.
pub fn load_hf<B: Backend>(dir: &Path, device: &B::Device) -> Result<Policy<B>, ModelError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::MissingFile {
        path: config_path.display().to_string(),
        reason: e.to_string(),
    })?;
    let cfg = PolicyConfig::from_hf_json(&text)?;
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
pub fn stop_tokens(dir: &Path, cfg: &PolicyConfig) -> Vec<u32> {
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
        let text = std::fs::read_to_string(&index).map_err(|source| io_err(&index, source))?;
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

/// Reads a safetensors file tensor by tensor, each straight into its f32 buffer: the file
/// is never held whole, so loading needs the model's f32 size plus one tensor (a bf16
/// tensor is read, then widened). Offsets, sizes and dtypes are checked against the header
/// and the file's length before anything is read.
pub fn read_safetensors_file(path: &Path) -> Result<TensorMap, ModelError> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = |reason: String| ModelError::Safetensors {
        path: Some(path.display().to_string()),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|e| ModelError::MissingFile {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let file_len = file
        .metadata()
        .map_err(|source| io_err(path, source))?
        .len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|e| bad(format!("no header: {e}")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > 100 << 20 || 8 + header_len > file_len {
        return Err(bad(format!(
            "header length {header_len} does not fit a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(format!("truncated header: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let data_start = 8 + header_len;
    let mut entries = Vec::with_capacity(header.len());
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap_or_default();
        let width = match dtype {
            "F32" => 4,
            "BF16" | "F16" => 2,
            other => {
                return Err(ModelError::Dtype {
                    name: name.clone(),
                    dtype: other.to_string(),
                });
            }
        };
        let shape: Vec<usize> = info["shape"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_u64().map(|d| d as usize))
                    .collect()
            })
            .ok_or_else(|| bad(format!("{name}: no shape")))?;
        let offsets = info["data_offsets"]
            .as_array()
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("{name}: no data_offsets")))?;
        let count: usize = shape.iter().product();
        if offsets.1 < offsets.0
            || offsets.1 - offsets.0 != (count * width) as u64
            || data_start + offsets.1 > file_len
        {
            return Err(bad(format!(
                "{name}: offsets {offsets:?} do not hold {count} {dtype} values inside the file"
            )));
        }
        entries.push((offsets.0, name.clone(), dtype, shape, count));
    }
    entries.sort_by_key(|e| e.0);
    let mut out = TensorMap::new();
    for (begin, name, dtype, shape, count) in entries {
        file.seek(SeekFrom::Start(data_start + begin))
            .map_err(|source| io_err(path, source))?;
        let read_err = |e: std::io::Error| bad(format!("{name}: {e}"));
        let data = if dtype == "F32" {
            let mut data = vec![0f32; count];
            file.read_exact(bytemuck::cast_slice_mut(&mut data))
                .map_err(read_err)?;
            if cfg!(target_endian = "big") {
                data.iter_mut()
                    .for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
            }
            data
        } else {
            let mut raw = vec![0u16; count];
            file.read_exact(bytemuck::cast_slice_mut(&mut raw))
                .map_err(read_err)?;
            if dtype == "BF16" {
                // bf16 is the top half of an f32: widening is a shift (exact, NaNs kept).
                raw.into_iter()
                    .map(|b| f32::from_bits(u32::from(u16::from_le(b)) << 16))
                    .collect()
            } else {
                raw.into_iter()
                    .map(|b| half::f16::from_bits(u16::from_le(b)).to_f32())
                    .collect()
            }
        };
        out.insert(name, HostTensor { shape, data });
    }
    Ok(out)
}

/// Decodes a safetensors buffer; F32, F16 and BF16 become f32.
pub fn safetensors_to_tensors(bytes: &[u8], path: Option<&Path>) -> Result<TensorMap, ModelError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Safetensors {
        path: path.map(|p| p.display().to_string()),
        reason: e.to_string(),
    })?;
    use rayon::prelude::*;
    let mut out = TensorMap::new();
    for (name, view) in st.tensors() {
        // Widened on every core: a 0.5B-parameter version is a billion values.
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .par_chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => raw
                .par_chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            Dtype::F16 => raw
                .par_chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Dtype {
                    name,
                    dtype: format!("{other:?}"),
                });
            }
        };
        out.insert(
            name,
            HostTensor {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(out)
}

/// Encodes named tensors as one safetensors buffer (f32, `format = pt` metadata so
/// `transformers` accepts it).
pub fn tensors_to_safetensors(tensors: &TensorMap) -> Result<Vec<u8>, ModelError> {
    tensors_to_safetensors_as(tensors, WeightDtype::F32)
}

/// [`tensors_to_safetensors`] in `dtype`.
pub fn tensors_to_safetensors_as(
    tensors: &TensorMap,
    dtype: WeightDtype,
) -> Result<Vec<u8>, ModelError> {
    let bytes: Vec<(&String, Vec<u8>, &Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| {
            let b = match dtype {
                WeightDtype::F32 => bytemuck::cast_slice::<f32, u8>(&t.data).to_vec(),
                WeightDtype::Bf16 => t
                    .data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            (n, b, &t.shape)
        })
        .collect();
    let st_dtype = match dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::Bf16 => Dtype::BF16,
    };
    let views = bytes
        .iter()
        .map(|(n, b, s)| {
            TensorView::new(st_dtype, s.to_vec(), b)
                .map(|v| (n.as_str(), v))
                .map_err(|e| ModelError::Safetensors {
                    path: None,
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(|e| ModelError::Safetensors {
        path: None,
        reason: e.to_string(),
    })
}

/// xxh3-64 of a weight blob as 16 hex digits (the `checksum` of a WeightsAnnounce).
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// xxh3-64 over named host tensors (name, shape, then the f32 values, in name order), as
/// 16 hex digits: the checksum of a version handed over in process.
pub fn tensors_checksum(tensors: &TensorMap) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (name, t) in tensors {
        h.update(name.as_bytes());
        for d in &t.shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(bytemuck::cast_slice(&t.data));
    }
    format!("{:016x}", h.digest())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Architecture;
    use burn::backend::NdArray;

    fn tiny() -> Policy<NdArray> {
        let cfg = PolicyConfig::tiny(Architecture::Qwen2, 50).with_qkv_bias(true);
        Policy::random(&cfg, 3, &Default::default()).expect("random policy")
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

    #[test]
    fn transpose_swaps_rows_and_columns() {
        let (rows, cols) = (37, 70);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let t = transpose(&data, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(t[c * rows + r], data[r * cols + c]);
            }
        }
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
}

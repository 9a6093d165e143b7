//! A policy's parameters by Hugging Face name, on the host: one walk over them ([`Named`])
//! that copies them out as f32 tensors ([`Policy::to_tensors`]), moves a generation
//! model's values out to be changed in place and puts them back ([`Policy::take_values`],
//! [`Hollow::fill`]), and copies one model's values into another's buffers
//! ([`Policy::copy_values_into`]).

use super::layers::Mlp;
use super::llama::{Block, Policy};
use super::storage::HfValues;
use super::tensors::{HostTensor, TensorMap};
use super::{Kernels, ModelError};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use std::collections::HashMap;

/// Every parameter of `policy` (without an adapter) copied to the host as f32, by HF name.
pub(super) fn collect<B: Kernels>(policy: &Policy<B>) -> Result<TensorMap, ModelError> {
    let mut out = Collected::default();
    Named::<B>::policy(&mut out, policy);
    out.error.map_or(Ok(out.tensors), Err)
}

/// Visits a policy's parameters by Hugging Face name: the one walk that copying them to the
/// host and changing them in place share.
trait Named<B: Backend> {
    /// A matrix: a linear layer's weight (`linear`: burn holds it `[in, out]`, the HF
    /// tensor is `[out, in]`) or the embedding (`[vocab, hidden]` in both).
    fn matrix(&mut self, name: &str, p: &Param<Tensor<B, 2>>, linear: bool);
    fn vector(&mut self, name: &str, p: &Param<Tensor<B, 1>>);

    fn linear(&mut self, name: &str, lin: &burn::nn::Linear<B>) {
        self.matrix(name, &lin.weight, true);
    }

    fn swiglu(&mut self, prefix: &str, mlp: &Mlp<B>) {
        for (n, lin) in [("gate", &mlp.gate), ("up", &mlp.up), ("down", &mlp.down)] {
            self.linear(&format!("{prefix}.{n}_proj.weight"), lin);
        }
    }

    /// Every parameter of a policy without an adapter.
    fn policy(&mut self, policy: &Policy<B>) {
        self.matrix("model.embed_tokens.weight", &policy.embed.weight, false);
        if let Some(head) = &policy.head {
            self.linear("lm_head.weight", head);
        }
        self.vector("model.norm.weight", &policy.norm.gamma);
        for (i, b) in policy.blocks.iter().enumerate() {
            self.block(&format!("model.layers.{i}"), b);
        }
    }

    /// Every parameter of the decoder layer `p` (`model.layers.3`).
    fn block(&mut self, p: &str, b: &Block<B>) {
        let attn = &b.attn;
        for (n, lin) in [
            ("q", &attn.q),
            ("k", &attn.k),
            ("v", &attn.v),
            ("o", &attn.o),
        ] {
            self.linear(&format!("{p}.self_attn.{n}_proj.weight"), lin);
            if let Some(bias) = &lin.bias {
                self.vector(&format!("{p}.self_attn.{n}_proj.bias"), bias);
            }
        }
        for (n, norm) in [("q", &attn.q_norm), ("k", &attn.k_norm)] {
            if let Some(norm) = norm {
                self.vector(&format!("{p}.self_attn.{n}_norm.weight"), &norm.gamma);
            }
        }
        self.vector(&format!("{p}.input_layernorm.weight"), &b.attn_norm.gamma);
        let post = format!("{p}.post_attention_layernorm.weight");
        self.vector(&post, &b.mlp_norm.gamma);
        if let Some(mlp) = &b.mlp {
            self.swiglu(&format!("{p}.mlp"), mlp);
        }
        if let Some(moe) = &b.moe {
            for (j, expert) in moe.experts.iter().enumerate() {
                self.swiglu(&format!("{p}.mlp.experts.{j}"), expert);
            }
            if let Some(shared) = &moe.shared {
                self.swiglu(&format!("{p}.mlp.shared_expert"), shared);
            }
            if let Some(gate) = &moe.shared_gate {
                self.linear(&format!("{p}.mlp.shared_expert_gate.weight"), gate);
            }
            self.linear(&format!("{p}.mlp.gate.weight"), &moe.router);
        }
    }
}

/// A model's parameters by HF name, copied to the host as f32.
#[derive(Default)]
struct Collected {
    tensors: TensorMap,
    error: Option<ModelError>,
}

impl Collected {
    fn collect<B: Kernels, const D: usize>(&mut self, name: &str, t: &Tensor<B, D>, linear: bool) {
        let mut shape = t.dims().to_vec();
        if linear {
            shape.reverse();
        }
        match B::into_hf_values(t.clone(), linear) {
            Ok(v) => {
                let data = v.into_f32();
                self.tensors
                    .insert(name.to_string(), HostTensor { shape, data });
            }
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }
}

impl<B: Kernels> Named<B> for Collected {
    fn matrix(&mut self, name: &str, p: &Param<Tensor<B, 2>>, linear: bool) {
        self.collect(name, &p.val(), linear);
    }

    fn vector(&mut self, name: &str, p: &Param<Tensor<B, 1>>) {
        self.collect(name, &p.val(), false);
    }
}

/// One parameter of a generation model moved to the host in Hugging Face order (see
/// [`Policy::take_values`]).
#[derive(Debug)]
pub struct HostParam {
    pub name: String,
    /// The HF tensor's shape (`[out, in]` for a linear weight).
    pub shape: Vec<usize>,
    /// A linear layer's weight (burn holds it transposed).
    pub linear: bool,
    pub values: HfValues,
}

/// Each parameter's id, HF name and whether it is a linear weight.
#[derive(Default)]
struct Names(HashMap<ParamId, (String, bool)>);

impl<B: Backend> Named<B> for Names {
    fn matrix(&mut self, name: &str, p: &Param<Tensor<B, 2>>, linear: bool) {
        self.0.insert(p.id, (name.to_string(), linear));
    }

    fn vector(&mut self, name: &str, p: &Param<Tensor<B, 1>>) {
        self.0.insert(p.id, (name.to_string(), false));
    }
}

/// Moves every parameter's values out, leaving a one-value placeholder in its place.
struct Take<B: Kernels> {
    names: Names,
    out: Vec<HostParam>,
    error: Option<ModelError>,
    device: std::marker::PhantomData<B>,
}

impl<B: Kernels> ModuleMapper<B> for Take<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let device = tensor.device();
        let Some((name, linear)) = self.names.0.get(&id).cloned() else {
            self.error.get_or_insert(ModelError::Unsupported(
                "a parameter outside the Hugging Face layout".into(),
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let mut shape = tensor.dims().to_vec();
        if linear {
            shape.reverse();
        }
        match B::into_hf_values(tensor, linear) {
            Ok(values) => self.out.push(HostParam {
                name,
                shape,
                linear,
                values,
            }),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
        Param::from_mapped_value(id, Tensor::zeros([1; D], &device), mapper)
    }
}

/// Puts the values [`Take`] moved out back, by name.
struct Fill<B: Kernels> {
    names: Names,
    params: HashMap<String, HostParam>,
    error: Option<ModelError>,
    device: std::marker::PhantomData<B>,
}

impl<B: Kernels> ModuleMapper<B> for Fill<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let found = self
            .names
            .0
            .get(&id)
            .and_then(|(name, _)| self.params.remove(name));
        let Some(p) = found else {
            self.error.get_or_insert(ModelError::Unsupported(
                "a parameter was not handed back".into(),
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let value = B::from_hf_values::<D>(p.values, &p.shape, p.linear, &tensor.device());
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Copies each parameter's values into the host parameter of its name.
struct CopyInto<'a> {
    at: HashMap<String, usize>,
    params: &'a mut [HostParam],
    error: Option<ModelError>,
}

impl CopyInto<'_> {
    fn copy<B: Kernels, const D: usize>(&mut self, name: &str, t: &Tensor<B, D>, linear: bool) {
        let Some(&i) = self.at.get(name) else {
            self.error
                .get_or_insert(ModelError::MissingTensor(name.to_string()));
            return;
        };
        let dst = &mut self.params[i].values;
        if let Err(e) = B::read_hf_values(t, linear, &mut |src| dst.copy_from(src)) {
            self.error.get_or_insert(e);
        }
    }
}

impl<B: Kernels> Named<B> for CopyInto<'_> {
    fn matrix(&mut self, name: &str, p: &Param<Tensor<B, 2>>, linear: bool) {
        self.copy(name, &p.val(), linear);
    }

    fn vector(&mut self, name: &str, p: &Param<Tensor<B, 1>>) {
        self.copy(name, &p.val(), false);
    }
}

/// A generation model whose parameters were moved out ([`Policy::take_values`]): it runs
/// nothing until [`Hollow::fill`] puts them back.
pub struct Hollow<B: Kernels> {
    policy: Policy<B>,
    names: Names,
}

impl<B: Kernels> Policy<B> {
    fn names(&self) -> Names {
        let mut names = Names::default();
        names.policy(self);
        names
    }

    /// Moves every parameter's values to the host in Hugging Face order, without a copy
    /// where the backend holds them so and this model is their only holder (a generation
    /// model on the CPU), to be changed in place and put back with [`Hollow::fill`]. A model
    /// with an adapter is refused (its weights are merged first).
    pub fn take_values(self) -> Result<(Hollow<B>, Vec<HostParam>), ModelError> {
        if self.has_adapter() {
            return Err(ModelError::Unsupported(
                "a model with an adapter has no values of its own to change in place".into(),
            ));
        }
        let names = self.names();
        let mut take = Take {
            names,
            out: Vec::new(),
            error: None,
            device: std::marker::PhantomData,
        };
        let policy = self.map(&mut take);
        if let Some(e) = take.error {
            return Err(e);
        }
        Ok((
            Hollow {
                policy,
                names: take.names,
            },
            take.out,
        ))
    }
}

impl<B: Kernels> Policy<B> {
    /// Copies every parameter's values into `params` (taken from a model of the same
    /// shape by [`Policy::take_values`]), into their own buffers where the kinds match: a
    /// spare model made this one without allocating.
    pub fn copy_values_into(&self, params: &mut [HostParam]) -> Result<(), ModelError> {
        if self.has_adapter() {
            return Err(ModelError::Unsupported(
                "a model with an adapter has no values of its own to copy".into(),
            ));
        }
        let at = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        let mut copy = CopyInto {
            at,
            params,
            error: None,
        };
        copy.policy(self);
        copy.error.map_or(Ok(()), Err)
    }
}

impl<B: Kernels> Hollow<B> {
    /// The model with `params` (every one [`Policy::take_values`] took, by name) back in.
    pub fn fill(self, params: Vec<HostParam>) -> Result<Policy<B>, ModelError> {
        let mut fill = Fill {
            names: self.names,
            params: params.into_iter().map(|p| (p.name.clone(), p)).collect(),
            error: None,
            device: std::marker::PhantomData,
        };
        let policy = self.policy.map(&mut fill);
        if let Some(e) = fill.error {
            return Err(e);
        }
        if let Some(name) = fill.params.keys().next() {
            return Err(ModelError::Unsupported(format!(
                "`{name}` is not a parameter of this model"
            )));
        }
        Ok(policy)
    }
}

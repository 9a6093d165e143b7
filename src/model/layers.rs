//! The layers a decoder block is made of, shared by the dense and the mixture-of-experts
//! blocks: linear projections on rows (through the fused kernel where the backend has one),
//! the LoRA adapters that can sit on them, the SwiGLU MLP and RMSNorm.

use super::kernels::{Kernels, reshape};
use burn::module::{Module, Param};
use burn::nn::{Linear, RmsNorm};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// A linear layer an adapter can sit on, by its Hugging Face module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module's name in a checkpoint (`q_proj`).
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The module's parent in a layer (`self_attn` or `mlp`).
    pub(crate) fn parent(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            Target::Gate | Target::Up | Target::Down => "mlp",
        }
    }

    /// The short name of the `lora_targets` setting (`q`, `gate`).
    pub fn short(self) -> &'static str {
        self.module().trim_end_matches("_proj")
    }

    fn from_name(name: &str) -> Option<Target> {
        Target::ALL
            .into_iter()
            .find(|t| t.short() == name || t.module() == name)
    }

    /// Parses `all-linear` or a comma-separated list of `q,k,v,o,gate,up,down` (the
    /// `_proj` names too).
    pub fn parse_list(s: &str) -> Result<Vec<Target>, String> {
        let s = s.trim();
        if s == "all-linear" {
            return Ok(Target::ALL.to_vec());
        }
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let t = Target::from_name(name).ok_or_else(|| {
                format!("unknown target module `{name}`: use all-linear or a list of q,k,v,o,gate,up,down")
            })?;
            if !out.contains(&t) {
                out.push(t);
            }
        }
        if out.is_empty() {
            return Err(
                "no target modules: use all-linear or a list of q,k,v,o,gate,up,down".into(),
            );
        }
        out.sort();
        Ok(out)
    }
}

/// One adapted linear layer: `x · A · B · scale`, added to the layer's output.
#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// `[in, r]`.
    pub a: Param<Tensor<B, 2>>,
    /// `[r, out]`.
    pub b: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub scale: f64,
    #[module(skip)]
    pub dropout: f64,
}

/// The adapters of one decoder layer, by target.
#[derive(Module, Debug)]
pub struct BlockLora<B: Backend> {
    pub q: Option<Lora<B>>,
    pub k: Option<Lora<B>>,
    pub v: Option<Lora<B>>,
    pub o: Option<Lora<B>>,
    pub gate: Option<Lora<B>>,
    pub up: Option<Lora<B>>,
    pub down: Option<Lora<B>>,
}

impl<B: Backend> BlockLora<B> {
    pub fn get(&self, t: Target) -> Option<&Lora<B>> {
        match t {
            Target::Q => self.q.as_ref(),
            Target::K => self.k.as_ref(),
            Target::V => self.v.as_ref(),
            Target::O => self.o.as_ref(),
            Target::Gate => self.gate.as_ref(),
            Target::Up => self.up.as_ref(),
            Target::Down => self.down.as_ref(),
        }
    }

    pub(crate) fn slot(&mut self, t: Target) -> &mut Option<Lora<B>> {
        match t {
            Target::Q => &mut self.q,
            Target::K => &mut self.k,
            Target::V => &mut self.v,
            Target::O => &mut self.o,
            Target::Gate => &mut self.gate,
            Target::Up => &mut self.up,
            Target::Down => &mut self.down,
        }
    }

    pub(crate) fn empty() -> Self {
        BlockLora {
            q: None,
            k: None,
            v: None,
            o: None,
            gate: None,
            up: None,
            down: None,
        }
    }
}

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

impl<B: Kernels> Mlp<B> {
    /// On the rows `[b × l, hidden]` of a `[b, l]` batch, with the layer's adapters.
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 2>,
        bl: [usize; 2],
        lora: Option<&BlockLora<B>>,
    ) -> Tensor<B, 2> {
        let gate = adapted(
            &self.gate,
            lora.and_then(|l| l.gate.as_ref()),
            x.clone(),
            bl,
        );
        let up = adapted(&self.up, lora.and_then(|l| l.up.as_ref()), x, bl);
        let down = lora.and_then(|l| l.down.as_ref());
        adapted(&self.down, down, B::swiglu(gate, up), bl)
    }
}

/// `layer` on the rows `[b × l, in]` of a `[b, l]` batch: through the fused kernel where
/// the backend has a native one (one matrix product each way), else burn's `Linear` on
/// `[b, l, in]` (Flex's matrix product parallelises, and rounds, by that shape).
pub(crate) fn linear<B: Kernels>(
    layer: &Linear<B>,
    x: Tensor<B, 2>,
    [b, l]: [usize; 2],
) -> Tensor<B, 2> {
    if B::NATIVE_LINEAR {
        return native_linear(layer, x);
    }
    let d = x.dims()[1];
    let y = layer.forward(x.reshape([b, l, d]));
    let out = y.dims()[2];
    y.reshape([b * l, out])
}

/// [`linear`] plus the adapter's `x · A · B · scale` when there is one (unmerged, as
/// PEFT computes it; dropout on the adapter's input while training).
pub(crate) fn adapted<B: Kernels>(
    layer: &Linear<B>,
    lora: Option<&Lora<B>>,
    x: Tensor<B, 2>,
    bl: [usize; 2],
) -> Tensor<B, 2> {
    let Some(lora) = lora else {
        return linear(layer, x, bl);
    };
    let y = linear(layer, x.clone(), bl);
    let x = if lora.dropout > 0.0 && B::ad_enabled(&x.device()) {
        burn::nn::DropoutConfig::new(lora.dropout).init().forward(x)
    } else {
        x
    };
    let down = B::linear_rows(x, lora.a.val(), None).mul_scalar(lora.scale);
    y + B::linear_rows(down, lora.b.val(), None)
}

/// `layer` on rows through [`Kernels::linear_rows`].
pub(crate) fn native_linear<B: Kernels>(layer: &Linear<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
    B::linear_rows(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()))
}

/// `norm` over the last dimension of `x` (the fused kernel on rows).
pub(crate) fn rms_norm<B: Kernels, const D: usize>(
    norm: &RmsNorm<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let d = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    reshape(
        B::rms_norm(reshape(x, [rows, d]), norm.gamma.val(), norm.epsilon),
        dims,
    )
}

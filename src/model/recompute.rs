//! The trainer's pass with its activations recomputed layer by layer (gradient
//! checkpointing, `train.gradient_checkpointing`).
//!
//! The forward runs the decoder's layers without a graph, keeping only each layer's input
//! (`[batch, len, hidden]`, one hidden state per layer and token); the graph starts at the
//! last layer's output, so the loss's backward ends there. [`Checkpoints::backward`] then
//! walks the layers from the last: it runs the layer again on its saved input with a graph,
//! takes the backward of that one layer from the gradient of its output, and hands on the
//! gradient of its input. Only one layer's activations exist at a time, for about one more
//! forward of the trunk.
//!
//! The forward is the same arithmetic in the same order as [`Policy::hidden_routed`]'s, so
//! the log-probs are equal bit for bit (bitwise on-policy holds); the gradients equal the
//! whole graph's but for the order in which a tied embedding's two parts are added. This is
//! also the unit a parameter-sharded trainer gathers and frees: one layer at a time.

use super::kernels::Kernels;
use super::layers::rms_norm;
use super::llama::{Policy, causal_bias, from_start};
use super::moe::Routes;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};

/// What the backward of a checkpointed trunk needs: the ids, the rotary rows, each layer's
/// input, and the routing the forward's MoE layers ran (replayed so the recompute runs the
/// same experts).
pub struct Checkpoints<B: AutodiffBackend> {
    tokens: Tensor<B, 2, Int>,
    /// The forward's rotary rows (cos, sin), `[batch, len, head_dim]` each.
    rotary: (Tensor<B::InnerBackend, 3>, Tensor<B::InnerBackend, 3>),
    inputs: Vec<Tensor<B::InnerBackend, 3>>,
    /// The last layer's output, the leaf the loss's graph starts from.
    top: Tensor<B, 3>,
    /// The experts each token ran through (`Routes::used`); empty for a dense model.
    routes: Vec<u16>,
}

impl<B> Policy<B>
where
    B: AutodiffBackend + Kernels,
    B::InnerBackend: Kernels,
{
    /// [`Policy::hidden_routed`] keeping each layer's input instead of its activations:
    /// the final hidden states (their graph starts after the last layer) and what
    /// [`Checkpoints::backward`] needs. `routes` is read and counted as by the plain pass.
    pub fn hidden_checkpointed(
        &self,
        tokens: Tensor<B, 2, Int>,
        routes: &mut Routes,
    ) -> (Tensor<B, 3>, Checkpoints<B>) {
        let inner = self.valid();
        let [b, l] = tokens.dims();
        let record = std::mem::replace(&mut routes.record, true);
        routes.begin(b * l, self.moe_layers());
        let (cos, sin) = inner.rotary_at(&from_start([b, l]), [b, l]);
        let bias = causal_bias::<B::InnerBackend>(l, &tokens.device()).reshape([1, 1, l, l]);
        let mut x = inner.embed.forward(tokens.clone().inner());
        let mut inputs = Vec::with_capacity(inner.blocks.len());
        for block in &inner.blocks {
            inputs.push(x.clone());
            let attend = (bias.clone(), None);
            x = block.forward(x, cos.clone(), sin.clone(), attend, None, routes);
        }
        routes.record = record;
        let used = match record {
            true => routes.used.clone(),
            false => std::mem::take(&mut routes.used),
        };
        let top = Tensor::<B, 3>::from_inner(x).require_grad();
        let hidden = rms_norm(&self.norm, top.clone());
        let saved = Checkpoints {
            tokens,
            rotary: (cos, sin),
            inputs,
            top,
            routes: used,
        };
        (hidden, saved)
    }
}

impl<B> Checkpoints<B>
where
    B: AutodiffBackend + Kernels,
    B::InnerBackend: Kernels,
{
    /// The backward of a loss whose graph came from [`Policy::hidden_checkpointed`]:
    /// `grads` (the loss's) first, then each layer's from the last, then the embedding's,
    /// each handed to `add` as the gradients of `model`'s parameters it reaches.
    pub fn backward(
        self,
        model: &Policy<B>,
        grads: B::Gradients,
        mut add: impl FnMut(GradientsParams),
    ) {
        let mut g = self.top.grad(&grads);
        add(GradientsParams::from_grads(grads, model));
        let [b, l] = self.tokens.dims();
        let (cos, sin) = self.rotary;
        let (cos, sin) = (Tensor::<B, 3>::from_inner(cos), Tensor::from_inner(sin));
        let bias = causal_bias::<B>(l, &self.tokens.device()).reshape([1, 1, l, l]);
        let mut routes = match self.routes.is_empty() {
            true => Routes::default(),
            false => Routes::replaying(self.routes),
        };
        routes.begin(b * l, model.moe_layers());
        for (block, input) in model.blocks.iter().zip(self.inputs).rev() {
            // No gradient reached the layer's output (nothing after it is trained).
            let Some(out) = g.take() else { return };
            let x = Tensor::<B, 3>::from_inner(input).require_grad();
            let attend = (bias.clone(), None);
            let y = block.forward(
                x.clone(),
                cos.clone(),
                sin.clone(),
                attend,
                None,
                &mut routes,
            );
            let grads = (y * Tensor::from_inner(out)).sum().backward();
            g = x.grad(&grads);
            add(GradientsParams::from_grads(grads, block));
        }
        let (Some(out), true) = (g, model.embed.weight.is_require_grad()) else {
            return;
        };
        let x = model.embed.forward(self.tokens);
        let grads = (x * Tensor::from_inner(out)).sum().backward();
        add(GradientsParams::from_grads(grads, &model.embed));
    }
}

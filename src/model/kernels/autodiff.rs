//! [`Kernels`] on [`Autodiff`]: each block is one graph node. The forward runs the inner
//! backend's kernel and keeps what the backward needs (the inputs, and the row statistic
//! where there is one); the backward runs the inner backend's backward kernel and hands
//! each tracked parent its gradient.

use super::Kernels;
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use std::sync::Arc;

/// A primitive of the inner backend as a tensor.
fn t<B: Kernels, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn p<B: Kernels, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

#[derive(Debug)]
struct LinearBackward;

impl<B: Kernels> Backward<B, 2> for LinearBackward {
    /// x, weight.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let (dx, dw, _) = B::linear_rows_backward(t(x), t(w), false, t(dy));
        if let Some(node) = px {
            grads.register::<B>(node.id, p(dx));
        }
        if let Some(node) = pw {
            grads.register::<B>(node.id, p(dw));
        }
    }
}

#[derive(Debug)]
struct LinearBiasBackward;

impl<B: Kernels> Backward<B, 3> for LinearBiasBackward {
    /// x, weight.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let (dx, dw, db) = B::linear_rows_backward(t(x), t(w), true, t(dy));
        if let Some(node) = px {
            grads.register::<B>(node.id, p(dx));
        }
        if let Some(node) = pw {
            grads.register::<B>(node.id, p(dw));
        }
        if let (Some(node), Some(db)) = (pb, db) {
            grads.register::<B>(node.id, p(db));
        }
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: Kernels> Backward<B, 2> for RmsNormBackward {
    /// x, gamma, inverse RMS per row.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma, inv_rms) = ops.state;
        let (dx, dg) = B::rms_norm_backward(t(x), t(gamma), t(inv_rms), t(dy));
        if let Some(node) = px {
            grads.register::<B>(node.id, p(dx));
        }
        if let Some(node) = pg {
            grads.register::<B>(node.id, p(dg));
        }
    }
}

#[derive(Debug)]
struct RopeBackward;

impl<B: Kernels> Backward<B, 1> for RopeBackward {
    /// The tables.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        if let Some(node) = px {
            grads.register::<B>(node.id, p(B::rope_backward(t(dy), t(cos), t(sin))));
        }
    }
}

#[derive(Debug)]
struct SoftmaxBackward;

impl<B: Kernels> Backward<B, 1> for SoftmaxBackward {
    /// The probabilities and the scale.
    type State = (FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [ps] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (probs, scale) = ops.state;
        if let Some(node) = ps {
            let ds = B::attn_softmax_backward(t(probs), t(dy), scale);
            grads.register::<B>(node.id, p(ds));
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: Kernels> Backward<B, 2> for SwigluBackward {
    /// gate, up.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pg, pu] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (dg, du) = B::swiglu_backward(t(gate), t(up), t(dy));
        if let Some(node) = pg {
            grads.register::<B>(node.id, p(dg));
        }
        if let Some(node) = pu {
            grads.register::<B>(node.id, p(du));
        }
    }
}

#[derive(Debug)]
struct TokenLogprobsBackward;

impl<B: Kernels> Backward<B, 1> for TokenLogprobsBackward {
    /// logits, log-sum-exp per row, targets, temperature.
    type State = (FloatTensor<B>, FloatTensor<B>, Arc<[u32]>, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pl] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (logits, lse, targets, temperature) = ops.state;
        if let Some(node) = pl {
            let dl = B::token_logprobs_backward(t(logits), t(lse), &targets, temperature, t(dy));
            grads.register::<B>(node.id, p(dl));
        }
    }
}

impl<B: Kernels, C: CheckpointStrategy> Kernels for Autodiff<B, C> {
    const NATIVE_LINEAR: bool = B::NATIVE_LINEAR;

    fn linear_rows(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let (x, w) = (
            x.into_primitive().tensor(),
            weight.into_primitive().tensor(),
        );
        let state = (x.primitive.clone(), w.primitive.clone());
        let out = match bias {
            None => {
                let y = p(B::linear_rows(t(x.primitive), t(w.primitive), None));
                match LinearBackward
                    .prepare::<C>([x.node.clone(), w.node.clone()])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(state, y),
                    OpsKind::UnTracked(prep) => prep.finish(y),
                }
            }
            Some(bias) => {
                let bias = bias.into_primitive().tensor();
                let y = p(B::linear_rows(
                    t(x.primitive),
                    t(w.primitive),
                    Some(t(bias.primitive)),
                ));
                match LinearBiasBackward
                    .prepare::<C>([x.node.clone(), w.node.clone(), bias.node.clone()])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(state, y),
                    OpsKind::UnTracked(prep) => prep.finish(y),
                }
            }
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn rms_norm(x: Tensor<Self, 2>, gamma: Tensor<Self, 1>, eps: f64) -> Tensor<Self, 2> {
        let (x, gamma) = (x.into_primitive().tensor(), gamma.into_primitive().tensor());
        let (y, inv_rms) =
            B::rms_norm_saved(t(x.primitive.clone()), t(gamma.primitive.clone()), eps);
        let out = match RmsNormBackward
            .prepare::<C>([x.node.clone(), gamma.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, gamma.primitive, p(inv_rms)), p(y)),
            OpsKind::UnTracked(prep) => prep.finish(p(y)),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn rope(x: Tensor<Self, 4>, cos: Tensor<Self, 3>, sin: Tensor<Self, 3>) -> Tensor<Self, 4> {
        let x = x.into_primitive().tensor();
        // The tables are constants: their inner values only.
        let cos = p::<B, 3>(cos.inner());
        let sin = p::<B, 3>(sin.inner());
        let y = B::rope(t(x.primitive), t(cos.clone()), t(sin.clone()));
        let out = match RopeBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((cos, sin), p(y)),
            OpsKind::UnTracked(prep) => prep.finish(p(y)),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn attn_softmax(scores: Tensor<Self, 4>, bias: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
        let scores = scores.into_primitive().tensor();
        let bias = bias.inner();
        let probs = p(B::attn_softmax(t(scores.primitive), bias, scale));
        let out = match SoftmaxBackward
            .prepare::<C>([scores.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((probs.clone(), scale), probs),
            OpsKind::UnTracked(prep) => prep.finish(probs),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Tensor<Self, 2> {
        let (gate, up) = (gate.into_primitive().tensor(), up.into_primitive().tensor());
        let y = p(B::swiglu(
            t(gate.primitive.clone()),
            t(up.primitive.clone()),
        ));
        let out = match SwigluBackward
            .prepare::<C>([gate.node.clone(), up.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn token_logprobs(
        logits: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
    ) -> Tensor<Self, 2> {
        let logits = logits.into_primitive().tensor();
        let (lp, lse) = B::token_logprobs_saved(t(logits.primitive.clone()), targets, temperature);
        let out = match TokenLogprobsBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (logits.primitive, p(lse), Arc::from(targets), temperature),
                p(lp),
            ),
            OpsKind::UnTracked(prep) => prep.finish(p(lp)),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

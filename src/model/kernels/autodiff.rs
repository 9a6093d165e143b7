//! [`Kernels`] on [`Autodiff`]: each block is one graph node. The forward runs the inner
//! backend's kernel and keeps what the backward needs (the inputs, and the row statistic
//! where there is one); the backward runs the inner backend's backward kernel and hands
//! each tracked parent its gradient.

use super::{HeadTargets, Kept, Kernels};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorPrimitive};
use burn_backend::TensorMetadata;
use std::sync::Arc;

/// A primitive of the inner backend as a tensor.
fn t<B: Kernels, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn p<B: Kernels, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// The output `y` of a block as one graph node over `parents` whose backward is `op`,
/// keeping `state` for it when any parent needs a gradient.
fn record<B, C, O, const N: usize, const D: usize>(
    op: O,
    parents: [&FloatTensor<Autodiff<B, C>>; N],
    state: O::State,
    y: FloatTensor<B>,
) -> Tensor<Autodiff<B, C>, D>
where
    B: Kernels,
    C: CheckpointStrategy,
    O: Backward<B, N>,
{
    let out = match op
        .prepare::<C>(parents.map(|t| t.node.clone()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
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
        let (dx, dw, _) = B::linear_rows_backward(t(x), t(w), pw.is_some(), false, t(dy));
        if let Some(node) = px {
            grads.register::<B>(node.id, p(dx));
        }
        if let (Some(node), Some(dw)) = (pw, dw) {
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
        let (dx, dw, db) = B::linear_rows_backward(t(x), t(w), pw.is_some(), true, t(dy));
        if let Some(node) = px {
            grads.register::<B>(node.id, p(dx));
        }
        if let (Some(node), Some(dw)) = (pw, dw) {
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

/// What attention's backward reads: q, k, v, the bias, the output, each query's
/// log-sum-exp (not the probabilities: linear in the length), the scale.
type AttentionState<B> = ([FloatTensor<B>; 4], FloatTensor<B>, FloatTensor<B>, f64);

#[derive(Debug)]
struct AttentionBackward;

impl<B: Kernels> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pq, pk, pv] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let ([q, k, v, bias], out, lse, scale) = ops.state;
        let (dq, dk, dv) =
            B::attn_backward((t(q), t(k), t(v)), t(bias), t(out), t(lse), t(dy), scale);
        for (node, grad) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, p(grad));
            }
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
    /// logits, log-sum-exp per row, targets, temperature, kept ids.
    type State = (FloatTensor<B>, FloatTensor<B>, Arc<[u32]>, f32, Arc<Kept>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pl] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (logits, lse, targets, temperature, kept) = ops.state;
        if let Some(node) = pl {
            let (logits, lse, dy) = (t(logits), t(lse), t(dy));
            let dl = B::token_logprobs_backward(logits, lse, &targets, temperature, &kept, dy);
            grads.register::<B>(node.id, p(dl));
        }
    }
}

/// What the chunked head's backward reads: the rows and the head, each row's
/// log-sum-exp (not the logits), the targets, the temperature, the kept ids, the chunk.
#[derive(Clone, Debug)]
struct HeadState<B: Kernels> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    lse: FloatTensor<B>,
    targets: Arc<[u32]>,
    temperature: f32,
    kept: Arc<Kept>,
    chunk: usize,
}

#[derive(Debug)]
struct HeadLogprobsBackward;

impl<B: Kernels> Backward<B, 2> for HeadLogprobsBackward {
    type State = HeadState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let targets = HeadTargets {
            targets: &s.targets,
            temperature: s.temperature,
            kept: &s.kept,
            chunk: s.chunk,
        };
        let (dx, dw) = B::head_logprobs_backward(
            (t(s.x), t(s.weight)),
            pw.is_some(),
            t(s.lse),
            targets,
            t(dy),
        );
        if let Some(node) = px {
            grads.register::<B>(node.id, p(dx));
        }
        if let (Some(node), Some(dw)) = (pw, dw) {
            grads.register::<B>(node.id, p(dw));
        }
    }
}

#[derive(Debug)]
struct ReshapeBackward;

impl<B: Kernels> Backward<B, 1> for ReshapeBackward {
    /// The input's shape.
    type State = Shape;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        if let Some(node) = px {
            grads.register::<B>(node.id, B::reshape_values(dy, ops.state));
        }
    }
}

impl<B: Kernels, C: CheckpointStrategy> Kernels for Autodiff<B, C> {
    const NATIVE_LINEAR: bool = B::NATIVE_LINEAR;

    /// One node whose backward reshapes the gradient back through the inner backend's
    /// [`Kernels::reshape_values`], so neither direction copies on NdArray.
    fn reshape_values(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        let from = x.primitive.shape();
        let node = x.node.clone();
        let y = B::reshape_values(x.primitive, shape);
        match ReshapeBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(from, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

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
        match bias {
            None => {
                let y = B::linear_rows(t(x.primitive.clone()), t(w.primitive.clone()), None);
                record(LinearBackward, [&x, &w], state, p(y))
            }
            Some(bias) => {
                let bias = bias.into_primitive().tensor();
                let y = B::linear_rows(
                    t(x.primitive.clone()),
                    t(w.primitive.clone()),
                    Some(t(bias.primitive.clone())),
                );
                record(LinearBiasBackward, [&x, &w, &bias], state, p(y))
            }
        }
    }

    fn rms_norm(x: Tensor<Self, 2>, gamma: Tensor<Self, 1>, eps: f64) -> Tensor<Self, 2> {
        let (x, gamma) = (x.into_primitive().tensor(), gamma.into_primitive().tensor());
        let (y, inv_rms) =
            B::rms_norm_saved(t(x.primitive.clone()), t(gamma.primitive.clone()), eps);
        let state = (x.primitive.clone(), gamma.primitive.clone(), p(inv_rms));
        record(RmsNormBackward, [&x, &gamma], state, p(y))
    }

    fn rope(x: Tensor<Self, 4>, cos: Tensor<Self, 3>, sin: Tensor<Self, 3>) -> Tensor<Self, 4> {
        let x = x.into_primitive().tensor();
        // The tables are constants: their inner values only.
        let cos = p::<B, 3>(cos.inner());
        let sin = p::<B, 3>(sin.inner());
        let y = B::rope(t(x.primitive.clone()), t(cos.clone()), t(sin.clone()));
        record(RopeBackward, [&x], (cos, sin), p(y))
    }

    fn attn_softmax(scores: Tensor<Self, 4>, bias: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
        let scores = scores.into_primitive().tensor();
        let probs = p(B::attn_softmax(
            t(scores.primitive.clone()),
            bias.inner(),
            scale,
        ));
        record(SoftmaxBackward, [&scores], (probs.clone(), scale), probs)
    }

    fn attn(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        bias: Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        let [q, k, v] = [q, k, v].map(|x| x.into_primitive().tensor());
        let bias = p::<B, 4>(bias.inner());
        let (y, lse) = B::attn_saved(
            t(q.primitive.clone()),
            t(k.primitive.clone()),
            t(v.primitive.clone()),
            t(bias.clone()),
            scale,
        );
        let y = p(y);
        let inputs = [
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            bias,
        ];
        let state = (inputs, y.clone(), p(lse), scale);
        record(AttentionBackward, [&q, &k, &v], state, y)
    }

    fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Tensor<Self, 2> {
        let (gate, up) = (gate.into_primitive().tensor(), up.into_primitive().tensor());
        let y = B::swiglu(t(gate.primitive.clone()), t(up.primitive.clone()));
        let state = (gate.primitive.clone(), up.primitive.clone());
        record(SwigluBackward, [&gate, &up], state, p(y))
    }

    fn token_logprobs(
        logits: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
    ) -> Tensor<Self, 2> {
        let logits = logits.into_primitive().tensor();
        let inner = t(logits.primitive.clone());
        let (lp, lse) = B::token_logprobs_saved(inner, targets, temperature, kept);
        let state = (
            logits.primitive.clone(),
            p(lse),
            Arc::from(targets),
            temperature,
            Arc::new(kept.clone()),
        );
        record(TokenLogprobsBackward, [&logits], state, p(lp))
    }

    /// Up to one chunk of rows, the head and the log-prob as two nodes, the logits kept
    /// for the backward (one chunk's, no more); more rows, one node that keeps each row's
    /// log-sum-exp and recomputes the logits chunk by chunk in the backward.
    fn head_logprobs(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        h: HeadTargets<'_>,
    ) -> Tensor<Self, 2> {
        if x.dims()[0] <= h.chunk {
            super::head::note_logits(x.dims()[0]);
            let logits = Self::linear_rows(x, weight, None);
            return Self::token_logprobs(logits, h.targets, h.temperature, h.kept);
        }
        let (x, w) = (
            x.into_primitive().tensor(),
            weight.into_primitive().tensor(),
        );
        let (lp, lse) = B::head_logprobs_saved(t(x.primitive.clone()), t(w.primitive.clone()), h);
        let state = HeadState {
            x: x.primitive.clone(),
            weight: w.primitive.clone(),
            lse: p(lse),
            targets: Arc::from(h.targets),
            temperature: h.temperature,
            kept: Arc::new(h.kept.clone()),
            chunk: h.chunk,
        };
        record(HeadLogprobsBackward, [&x, &w], state, p(lp))
    }
}

//! [`Kernels`]: the decoder's fused blocks as backend operations, each with the composed
//! default from [`reference`](super::reference).

use super::head;
use super::logprob::{HeadTargets, Kept};
use super::reference::{self, LinearGrads};
use crate::model::storage::WeightStorage;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorPrimitive};

/// `x` under `shape` through [`Kernels::reshape_values`]: on the CPU trainer, without
/// copying a contiguous tensor (forward or, on `Autodiff`, backward). The model reshapes
/// between `[b, l, d]` and `[b * l, d]` several times a layer.
pub fn reshape<B: Kernels, const D: usize, const E: usize>(
    x: Tensor<B, D>,
    shape: [usize; E],
) -> Tensor<B, E> {
    let from = x.dims();
    assert_eq!(
        from.iter().product::<usize>(),
        shape.iter().product::<usize>(),
        "reshape {from:?} to {shape:?}: not as many values"
    );
    let values = x.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(B::reshape_values(
        values,
        Shape::from(shape),
    )))
}

/// The decoder's fused blocks. Shapes are fixed by the caller (the model flattens leading
/// dimensions into rows). Every method has the composed default; a backend overrides the
/// ones it has native kernels for.
pub trait Kernels: WeightStorage {
    /// Whether [`Kernels::linear_rows`] is a native kernel that reads its operands as stored,
    /// transposed views included. The model then runs every linear layer on rows through
    /// it, and the tied output head at any number of rows; otherwise it keeps burn's
    /// `Linear` on the input's own rank (Flex's matrix product parallelises, and rounds,
    /// by that shape).
    const NATIVE_LINEAR: bool = false;

    /// `x`'s values, in row-major order, under `shape` (as many values): burn's reshape.
    /// NdArray's copies every tensor it reshapes, a contiguous one too; a backend that can
    /// share the buffer overrides this ([`reshape`] is the tensor-level call).
    fn reshape_values(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        Self::float_reshape(x, shape)
    }

    /// `x · weight + bias` for `x` `[n, in]` and `weight` `[in, out]` (burn's layout).
    fn linear_rows(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        reference::linear(x, weight, bias)
    }

    /// Gradients of `x`, of `weight` (when `weight_grad`: a frozen weight, such as a LoRA
    /// base, needs none) and of the bias (when `bias`) from the output's gradient `dy`
    /// `[n, out]`.
    fn linear_rows_backward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        weight_grad: bool,
        bias: bool,
        dy: Tensor<Self, 2>,
    ) -> LinearGrads<Self> {
        reference::linear_backward(x, weight, weight_grad, bias, dy)
    }

    /// RMSNorm over the rows of `x` `[n, d]`: `x / sqrt(mean(x²) + eps) * gamma`.
    fn rms_norm(x: Tensor<Self, 2>, gamma: Tensor<Self, 1>, eps: f64) -> Tensor<Self, 2> {
        reference::rms_norm(x, gamma, eps)
    }

    /// [`Kernels::rms_norm`] and the inverse RMS of each row `[n, 1]`, for the backward.
    fn rms_norm_saved(
        x: Tensor<Self, 2>,
        gamma: Tensor<Self, 1>,
        eps: f64,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        reference::rms_norm_saved(x, gamma, eps)
    }

    /// Gradients of `x` and `gamma` from the output's gradient `dy`.
    fn rms_norm_backward(
        x: Tensor<Self, 2>,
        gamma: Tensor<Self, 1>,
        inv_rms: Tensor<Self, 2>,
        dy: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        reference::rms_norm_backward(x, gamma, inv_rms, dy)
    }

    /// `a` `[r, h, ta, d]` and `b` `[r, h, tb, d]` joined along the third dimension: a layer's
    /// cached keys or values and a forward pass's new columns.
    fn cat_columns(a: Tensor<Self, 4>, b: Tensor<Self, 4>) -> Tensor<Self, 4> {
        // An empty side (a fresh cache before its prefill) is the other side as it is: a
        // copy kernel over no columns is a launch with no blocks, which CUDA refuses.
        match (a.dims()[2], b.dims()[2]) {
            (0, _) => b,
            (_, 0) => a,
            _ => Tensor::cat(vec![a, b], 2),
        }
    }

    /// Rotary positions in the Hugging Face half-rotation layout, `x · cos + rotate_half(x)
    /// · sin`, on `x` `[b, l, heads, hd]` with each row's tables `cos`, `sin` `[b, l, hd]`;
    /// the result is laid out `[b, heads, l, hd]`, as attention reads it.
    fn rope(x: Tensor<Self, 4>, cos: Tensor<Self, 3>, sin: Tensor<Self, 3>) -> Tensor<Self, 4> {
        reference::rope(x, cos, sin)
    }

    /// The gradient `[b, l, heads, hd]` of [`Kernels::rope`]'s input from the output's
    /// gradient `dy` `[b, heads, l, hd]`.
    fn rope_backward(
        dy: Tensor<Self, 4>,
        cos: Tensor<Self, 3>,
        sin: Tensor<Self, 3>,
    ) -> Tensor<Self, 4> {
        reference::rope_backward(dy, cos, sin)
    }

    /// Attention probabilities `softmax(scores · scale + bias)` over the last dimension of
    /// `scores` `[b, heads, l, t]`, with `bias` `[1 or b, 1, l, t]` (0 or
    /// [`MASKED`]) broadcast over heads.
    fn attn_softmax(scores: Tensor<Self, 4>, bias: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
        reference::attn_softmax(scores, bias, scale)
    }

    /// The gradient of the scores from the probabilities and their gradient.
    fn attn_softmax_backward(
        probs: Tensor<Self, 4>,
        dprobs: Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        reference::attn_softmax_backward(probs, dprobs, scale)
    }

    /// Attention of queries `q` `[b, kv_heads, g·l, hd]` (each kv head's `g` query heads
    /// grouped, as HF's `repeat_kv` pairs them) over keys and values `k`, `v` `[b,
    /// kv_heads, t, hd]`: `softmax(q · kᵀ · scale + bias) · v`, `[b, kv_heads, g·l, hd]`,
    /// with `bias` as [`Kernels::attn_softmax`] takes it.
    fn attn(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        bias: Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        reference::attention((q, k, v), bias, scale, Self::attn_softmax)
    }

    /// [`Kernels::attn`] and each query's log-sum-exp `[b, kv_heads, g·l, 1]` of its scaled,
    /// biased scores: what the backward recomputes the probabilities from, so the state an
    /// attention keeps for its backward is linear in the length (flash attention's).
    fn attn_saved(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        bias: Tensor<Self, 4>,
        scale: f64,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        reference::attn_lse((q, k, v), bias, scale)
    }

    /// Gradients of `q`, `k` and `v` from the output's gradient `dy`, the probabilities
    /// recomputed from the scores and the saved log-sum-exp `lse`; `out` is the forward's
    /// output.
    fn attn_backward(
        (q, k, v): (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>),
        bias: Tensor<Self, 4>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 4>,
        dy: Tensor<Self, 4>,
        scale: f64,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>) {
        drop(out);
        let softmax_backward = Self::attn_softmax_backward;
        reference::attn_backward_lse((q, k, v), (bias, lse), dy, scale, softmax_backward)
    }

    /// SwiGLU's gate: `silu(gate) · up` on `[n, f]`.
    fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Tensor<Self, 2> {
        reference::swiglu(gate, up)
    }

    /// Gradients of `gate` and `up` from the output's gradient `dy`.
    fn swiglu_backward(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        dy: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        reference::swiglu_backward(gate, up, dy)
    }

    /// The log-prob `[n, 1]` of `targets[i]` for logits `[n, vocab]`, as
    /// [`token_logprob`] defines it: tempered, renormalised over row `i` of `kept`. Every
    /// target and kept id is below the vocabulary size (the trainer refuses other messages
    /// first).
    fn token_logprobs(
        logits: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
    ) -> Tensor<Self, 2> {
        reference::token_logprobs(logits, targets, temperature, kept)
    }

    /// [`Kernels::token_logprobs`] and each row's log-sum-exp `[n, 1]` of the scaled
    /// logits (over its kept ids), for the backward.
    fn token_logprobs_saved(
        logits: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        reference::token_logprobs_saved(logits, targets, temperature, kept)
    }

    /// The gradient of the logits from the log-probs' gradient `dy` `[n, 1]`.
    fn token_logprobs_backward(
        logits: Tensor<Self, 2>,
        lse: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
        dy: Tensor<Self, 2>,
    ) -> Tensor<Self, 2> {
        reference::token_logprobs_backward(logits, lse, targets, temperature, kept, dy)
    }

    /// The log-prob `[n, 1]` of `t.targets[i]` under the output head `weight` `[hidden,
    /// vocab]` applied to `x` `[n, hidden]`, as [`Kernels::token_logprobs`] of
    /// [`Kernels::linear_rows`] defines it, computed `t.chunk` rows at a time: logits never
    /// exist for more rows than that (see [`super::head`]).
    fn head_logprobs(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        t: HeadTargets<'_>,
    ) -> Tensor<Self, 2> {
        Self::head_logprobs_saved(x, weight, t).0
    }

    /// [`Kernels::head_logprobs`] and each row's log-sum-exp `[n, 1]`, for the backward.
    fn head_logprobs_saved(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        t: HeadTargets<'_>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let n = x.dims()[0];
        let (mut lps, mut lses) = (Vec::new(), Vec::new());
        for rows in head::chunks(n, t.chunk) {
            head::note_logits(rows.len());
            let logits = Self::linear_rows(x.clone().slice(rows.clone()), weight.clone(), None);
            let targets = &t.targets[rows.clone()];
            let (lp, lse) =
                Self::token_logprobs_saved(logits, targets, t.temperature, &t.kept.range(rows));
            lps.push(lp);
            lses.push(lse);
        }
        if lps.is_empty() {
            let empty = Tensor::empty([0, 1], &x.device());
            return (empty.clone(), empty);
        }
        (Tensor::cat(lps, 0), Tensor::cat(lses, 0))
    }

    /// Gradients of `x` and (when `weight_grad`) of `weight` from the log-probs' gradient
    /// `dy` `[n, 1]`, each chunk's logits recomputed from `x` and the saved `lse`.
    fn head_logprobs_backward(
        (x, weight): (Tensor<Self, 2>, Tensor<Self, 2>),
        weight_grad: bool,
        lse: Tensor<Self, 2>,
        t: HeadTargets<'_>,
        dy: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Option<Tensor<Self, 2>>) {
        head_backward_chunks::<Self>((x, weight), weight_grad, lse, t, dy)
    }
}

/// The decoder's blocks as their compositions of tensor operations, as on every backend
/// without native kernels: what the native kernels are checked against.
impl<B: burn::tensor::backend::Backend> Kernels for crate::model::counted::Counted<B> {}
#[cfg(feature = "flex")]
impl Kernels for burn::backend::Flex {}

#[cfg(feature = "cuda")]
impl Kernels for burn::backend::Cuda {}
#[cfg(feature = "wgpu")]
impl Kernels for burn::backend::Wgpu {}

/// [`Kernels::head_logprobs_backward`] as `B`'s kernels compose it: per chunk, the logits
/// recomputed, their gradient, and the linear layer's backward, the weight's gradients
/// summed.
pub(super) fn head_backward_chunks<B: Kernels>(
    (x, weight): (Tensor<B, 2>, Tensor<B, 2>),
    weight_grad: bool,
    lse: Tensor<B, 2>,
    t: HeadTargets<'_>,
    dy: Tensor<B, 2>,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let (mut dxs, mut dw) = (Vec::new(), None::<Tensor<B, 2>>);
    for rows in head::chunks(x.dims()[0], t.chunk) {
        head::note_logits(rows.len());
        let xc = x.clone().slice(rows.clone());
        let logits = B::linear_rows(xc.clone(), weight.clone(), None);
        let dz = B::token_logprobs_backward(
            logits,
            lse.clone().slice(rows.clone()),
            &t.targets[rows.clone()],
            t.temperature,
            &t.kept.range(rows.clone()),
            dy.clone().slice(rows),
        );
        let (dx, dwc, _) = B::linear_rows_backward(xc, weight.clone(), weight_grad, false, dz);
        dxs.push(dx);
        dw = match (dw, dwc) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
    let dx = if dxs.is_empty() {
        x.zeros_like()
    } else {
        Tensor::cat(dxs, 0)
    };
    let dw = dw.or_else(|| weight_grad.then(|| weight.zeros_like()));
    (dx, dw)
}

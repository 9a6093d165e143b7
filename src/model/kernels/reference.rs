//! The composed form of each kernel: burn's tensor operations, on any backend. These are
//! the defaults of [`Kernels`](super::Kernels) and what the native kernels are tested
//! against. Forward functions are the arithmetic the model used before fused kernels;
//! backward functions are their derivatives written out.

use burn::tensor::activation::{sigmoid, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};

/// burn's `Linear::forward` on rows.
pub fn linear<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    let y = x.matmul(weight);
    match bias {
        Some(bias) => y + bias.unsqueeze(),
        None => y,
    }
}

/// `dx = dy · weightᵀ`, `dweight = xᵀ · dy`, `dbias = Σ_rows dy`.
pub fn linear_backward<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    weight_grad: bool,
    bias: bool,
    dy: Tensor<B, 2>,
) -> super::LinearGrads<B> {
    let db = bias.then(|| dy.clone().sum_dim(0).squeeze_dim(0));
    let dx = dy.clone().matmul(weight.transpose());
    let dw = weight_grad.then(|| x.transpose().matmul(dy));
    (dx, dw, db)
}

/// burn's `RmsNorm::forward`, the statistics in f32 whatever the tensor's dtype.
pub fn rms_norm<B: Backend>(x: Tensor<B, 2>, gamma: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let rms = (x.clone().cast(DType::F32).square().mean_dim(1) + eps).sqrt();
    (x / rms.cast(dtype)) * gamma.unsqueeze()
}

pub fn rms_norm_saved<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let inv_rms = (x.clone().square().mean_dim(1) + eps).sqrt().recip();
    (x * inv_rms.clone() * gamma.unsqueeze(), inv_rms)
}

/// With `g = dy · gamma`: `dx = r · g − x · r³ · mean(g · x)`, `dgamma = Σ_rows dy · x · r`.
pub fn rms_norm_backward<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    inv_rms: Tensor<B, 2>,
    dy: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let normed = x.clone() * inv_rms.clone();
    let dgamma = (dy.clone() * normed).sum_dim(0).squeeze_dim(0);
    let g = dy * gamma.unsqueeze();
    let mean_gx = (g.clone() * x.clone()).mean_dim(1);
    let r3 = inv_rms.clone().powi_scalar(3);
    let dx = g * inv_rms - x * (r3 * mean_gx);
    (dx, dgamma)
}

/// `[b, l, heads, hd]` with tables `[b, l, hd]` → `[b, heads, l, hd]`.
pub fn rope<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 3>, sin: Tensor<B, 3>) -> Tensor<B, 4> {
    let [b, l, h, hd] = x.dims();
    let half = hd / 2;
    let x1 = x.clone().slice([0..b, 0..l, 0..h, 0..half]);
    let x2 = x.clone().slice([0..b, 0..l, 0..h, half..hd]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let cos = cos.unsqueeze_dim::<4>(2);
    let sin = sin.unsqueeze_dim::<4>(2);
    (x * cos + rotated * sin).swap_dims(1, 2)
}

/// The transpose of the rotation: `dx = dy · cos + rotate_halfᵀ(dy · sin)` with
/// `rotate_halfᵀ([a, b]) = [b, −a]`.
pub fn rope_backward<B: Backend>(
    dy: Tensor<B, 4>,
    cos: Tensor<B, 3>,
    sin: Tensor<B, 3>,
) -> Tensor<B, 4> {
    let dy = dy.swap_dims(1, 2);
    let [b, l, h, hd] = dy.dims();
    let half = hd / 2;
    let ds = dy.clone() * sin.unsqueeze_dim::<4>(2);
    let s1 = ds.clone().slice([0..b, 0..l, 0..h, 0..half]);
    let s2 = ds.slice([0..b, 0..l, 0..h, half..hd]);
    let back = Tensor::cat(vec![s2, s1.neg()], 3);
    dy * cos.unsqueeze_dim::<4>(2) + back
}

pub fn attn_softmax<B: Backend>(
    scores: Tensor<B, 4>,
    bias: Tensor<B, 4>,
    scale: f64,
) -> Tensor<B, 4> {
    softmax(scores.mul_scalar(scale) + bias, 3)
}

/// `dscores = scale · p · (dp − Σ dp · p)`.
pub fn attn_softmax_backward<B: Backend>(
    probs: Tensor<B, 4>,
    dprobs: Tensor<B, 4>,
    scale: f64,
) -> Tensor<B, 4> {
    let dot = (dprobs.clone() * probs.clone()).sum_dim(3);
    (probs * (dprobs - dot)).mul_scalar(scale)
}

pub fn swiglu<B: Backend>(gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Tensor<B, 2> {
    silu(gate) * up
}

/// With `s = σ(gate)`: `dgate = dy · up · s · (1 + gate · (1 − s))`, `dup = dy · gate · s`.
pub fn swiglu_backward<B: Backend>(
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
    dy: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let s = sigmoid(gate.clone());
    let silu = gate.clone() * s.clone();
    let dsilu = s.clone() * (gate * (s.neg() + 1.0) + 1.0);
    let dgate = dy.clone() * up * dsilu;
    let dup = dy * silu;
    (dgate, dup)
}

/// The logits divided by the temperature where [`tempered`](super::tempered).
pub(crate) fn scaled<B: Backend>(logits: Tensor<B, 2>, temperature: f32) -> Tensor<B, 2> {
    if super::tempered(temperature) {
        logits.div_scalar(temperature)
    } else {
        logits
    }
}

/// Token ids as a `[n, 1]` index tensor.
pub(crate) fn target_ids<B: Backend>(targets: &[u32], device: &B::Device) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = targets.iter().map(|&t| i64::from(t)).collect();
    Tensor::from_data(TensorData::new(ids, [targets.len(), 1]), device)
}

/// `log Σ exp(x)` over the last dimension of `[rows, n]`, as `[rows, 1]`; the shift by the
/// row maximum carries no gradient (it cancels).
pub fn logsumexp<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let m = x.clone().max_dim(1).detach();
    (x - m.clone()).exp().sum_dim(1).log() + m
}

pub fn token_logprobs<B: Backend>(
    logits: Tensor<B, 2>,
    targets: &[u32],
    temperature: f32,
) -> Tensor<B, 2> {
    token_logprobs_saved(logits, targets, temperature).0
}

pub fn token_logprobs_saved<B: Backend>(
    logits: Tensor<B, 2>,
    targets: &[u32],
    temperature: f32,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let ids = target_ids::<B>(targets, &logits.device());
    let z = scaled(logits, temperature);
    let lse = logsumexp(z.clone());
    (z.gather(1, ids) - lse.clone(), lse)
}

/// `dlogits = dy · k · (onehot(target) − softmax(k · logits))` with `k = 1 / temperature`.
pub fn token_logprobs_backward<B: Backend>(
    logits: Tensor<B, 2>,
    lse: Tensor<B, 2>,
    targets: &[u32],
    temperature: f32,
    dy: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let k = f64::from(super::inv_temperature(temperature));
    let ids = target_ids::<B>(targets, &logits.device());
    let probs = (scaled(logits, temperature) - lse).exp();
    let dyk = dy.mul_scalar(k);
    (probs * dyk.clone())
        .neg()
        .scatter(1, ids, dyk, IndexingUpdateOp::Add)
}

//! The composed form of each kernel: burn's tensor operations, on any backend. These are
//! the defaults of [`Kernels`](super::Kernels) and what the native kernels are tested
//! against. Forward functions are the arithmetic the model used before fused kernels;
//! backward functions are their derivatives written out.

use super::logprob::Kept;
use burn::tensor::activation::{sigmoid, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};

/// The gradients of a linear layer on rows: input, weight (when wanted), bias (when it
/// has one).
pub type LinearGrads<B> = (Tensor<B, 2>, Option<Tensor<B, 2>>, Option<Tensor<B, 1>>);

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
) -> LinearGrads<B> {
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

/// Attention as products and the backend's masked softmax `softmax` (its
/// [`attn_softmax`](super::Kernels::attn_softmax)): the output (see
/// [`super::Kernels::attn`]).
pub fn attention<B: Backend>(
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    bias: Tensor<B, 4>,
    scale: f64,
    softmax: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, f64) -> Tensor<B, 4>,
) -> Tensor<B, 4> {
    let [b, kvh, gl, _] = q.dims();
    let (l, t) = (bias.dims()[2], k.dims()[2]);
    let g = gl / l.max(1);
    let scores = q.matmul(k.swap_dims(2, 3)).reshape([b, kvh * g, l, t]);
    softmax(scores, bias, scale)
        .reshape([b, kvh, gl, t])
        .matmul(v)
}

/// The scaled, biased scores `[b, kv_heads, g·l, t]` of queries `q` `[b, kv_heads, g·l,
/// hd]` over keys `k`, the bias `[1 or b, 1, l, t]` broadcast over heads.
fn biased_scores<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    bias: Tensor<B, 4>,
    scale: f64,
) -> Tensor<B, 4> {
    let [b, kvh, gl, _] = q.dims();
    let (l, t) = (bias.dims()[2], k.dims()[2]);
    let g = gl / l.max(1);
    let scores = q
        .clone()
        .matmul(k.clone().swap_dims(2, 3))
        .reshape([b, kvh * g, l, t]);
    (scores.mul_scalar(scale) + bias).reshape([b, kvh, gl, t])
}

/// Attention's output and each query's log-sum-exp `[b, kv_heads, g·l, 1]` (see
/// [`super::Kernels::attn_saved`]).
pub fn attn_lse<B: Backend>(
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    bias: Tensor<B, 4>,
    scale: f64,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let z = biased_scores(&q, &k, bias, scale);
    let max = z.clone().max_dim(3);
    let lse = max.clone() + (z.clone() - max).exp().sum_dim(3).log();
    ((z - lse.clone()).exp().matmul(v), lse)
}

/// The attention probabilities recomputed from the scores and the saved log-sum-exp.
pub fn attn_probs<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    bias: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    scale: f64,
) -> Tensor<B, 4> {
    (biased_scores(q, k, bias, scale) - lse).exp()
}

/// Gradients of `q`, `k` and `v` of attention with probabilities `probs` from the
/// output's gradient `dy`, the softmax's backward `softmax_backward` (the backend's
/// [`attn_softmax_backward`](super::Kernels::attn_softmax_backward)).
pub fn attn_backward_of<B: Backend>(
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    probs: Tensor<B, 4>,
    dy: Tensor<B, 4>,
    scale: f64,
    softmax_backward: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, f64) -> Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let dprobs = dy.clone().matmul(v.swap_dims(2, 3));
    let dv = probs.clone().swap_dims(2, 3).matmul(dy);
    let ds = softmax_backward(probs, dprobs, scale);
    let dq = ds.clone().matmul(k);
    let dk = ds.swap_dims(2, 3).matmul(q);
    (dq, dk, dv)
}

/// [`attn_backward_of`] with the probabilities recomputed from the scores and the saved
/// log-sum-exp `lse` (see [`super::Kernels::attn_backward`]).
pub fn attn_backward_lse<B: Backend>(
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    (bias, lse): (Tensor<B, 4>, Tensor<B, 4>),
    dy: Tensor<B, 4>,
    scale: f64,
    softmax_backward: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, f64) -> Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let probs = attn_probs(&q, &k, bias, lse, scale);
    attn_backward_of((q, k, v), probs, dy, scale, softmax_backward)
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

/// The logits times [`inv_temperature`](super::inv_temperature) (the sampler's scaling).
pub(crate) fn scaled<B: Backend>(logits: Tensor<B, 2>, temperature: f32) -> Tensor<B, 2> {
    if super::logprob::tempered(temperature) {
        logits.mul_scalar(super::logprob::inv_temperature(temperature))
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

/// `[n, vocab]`: 0 at each row's kept ids (every id for a row without a set), masked
/// elsewhere; `None` when no row has a set. Made on the device: only the sets' ids cross
/// (`[n, widest set]`), not `n × vocab` values.
fn kept_bias<B: Backend>(
    kept: &Kept,
    n: usize,
    vocab: usize,
    device: &B::Device,
) -> Option<Tensor<B, 2>> {
    if !kept.any() {
        return None;
    }
    let row = |i: usize| -> &[u32] { if i < kept.rows() { kept.row(i) } else { &[] } };
    let in_vocab = |id: &&u32| (**id as usize) < vocab;
    let width = (0..n)
        .map(|i| row(i).iter().filter(in_vocab).count())
        .max()
        .unwrap_or(0)
        .max(1);
    // Each row's ids padded to `width` with id 0 carrying nothing (a 0 added).
    let (mut ids, mut hit, mut whole) = (Vec::with_capacity(n * width), Vec::new(), Vec::new());
    for i in 0..n {
        let set = row(i);
        whole.push(f32::from(u8::from(set.is_empty())));
        let mut k = 0;
        for &id in set.iter().filter(in_vocab) {
            ids.push(i64::from(id));
            hit.push(1f32);
            k += 1;
        }
        ids.extend(std::iter::repeat_n(0i64, width - k));
        hit.extend(std::iter::repeat_n(0f32, width - k));
    }
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, width]), device);
    let hit = Tensor::<B, 2>::from_data(TensorData::new(hit, [n, width]), device);
    let whole = Tensor::<B, 2>::from_data(TensorData::new(whole, [n, 1]), device);
    let kept =
        Tensor::<B, 2>::zeros([n, vocab], device).scatter(1, ids, hit, IndexingUpdateOp::Add)
            + whole.expand([n, vocab]);
    let masked = kept.lower_equal_elem(0.0);
    Some(Tensor::zeros([n, vocab], device).mask_fill(masked, super::logprob::MASKED))
}

/// The scaled logits, masked outside each row's kept ids.
fn supported<B: Backend>(logits: Tensor<B, 2>, temperature: f32, kept: &Kept) -> Tensor<B, 2> {
    let [n, vocab] = logits.dims();
    let bias = kept_bias::<B>(kept, n, vocab, &logits.device());
    let z = scaled(logits, temperature);
    match bias {
        Some(bias) => z + bias,
        None => z,
    }
}

/// Each row's entropy `[n, 1]` of the distribution a token's log-prob is taken under:
/// `softmax(k · logits)` over the row's kept ids (`k` = [`inv_temperature`](super::inv_temperature)),
/// as `lse − Σ p·z` with `z` the scaled logits. Through tensor operations, so on an
/// autodiff backend its gradient `−k·p·(log p + H)` flows to the logits.
pub fn entropy<B: Backend>(logits: Tensor<B, 2>, temperature: f32, kept: &Kept) -> Tensor<B, 2> {
    let z = supported(logits, temperature, kept);
    let lse = logsumexp(z.clone());
    let p = (z.clone() - lse.clone()).exp();
    lse - (p * z).sum_dim(1)
}

pub fn token_logprobs<B: Backend>(
    logits: Tensor<B, 2>,
    targets: &[u32],
    temperature: f32,
    kept: &Kept,
) -> Tensor<B, 2> {
    token_logprobs_saved(logits, targets, temperature, kept).0
}

pub fn token_logprobs_saved<B: Backend>(
    logits: Tensor<B, 2>,
    targets: &[u32],
    temperature: f32,
    kept: &Kept,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let ids = target_ids::<B>(targets, &logits.device());
    let lse = logsumexp(supported(logits.clone(), temperature, kept));
    (
        scaled(logits, temperature).gather(1, ids) - lse.clone(),
        lse,
    )
}

/// `dlogits = dy · k · (onehot(target) − softmax(k · logits))` with `k = 1 / temperature`,
/// the softmax over each row's kept ids.
pub fn token_logprobs_backward<B: Backend>(
    logits: Tensor<B, 2>,
    lse: Tensor<B, 2>,
    targets: &[u32],
    temperature: f32,
    kept: &Kept,
    dy: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let k = f64::from(super::logprob::inv_temperature(temperature));
    let ids = target_ids::<B>(targets, &logits.device());
    let probs = (supported(logits, temperature, kept) - lse).exp();
    let dyk = dy.mul_scalar(k);
    (probs * dyk.clone())
        .neg()
        .scatter(1, ids, dyk, IndexingUpdateOp::Add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TrainBackend;

    /// Uniform logits over four ids: ln 4, or ln 2 over a kept set of two; logits
    /// (0, ln 9 / 2) at temperature 0.5 are (0, ln 9) scaled: p = (0.1, 0.9).
    #[test]
    fn entropy_by_hand() {
        let row = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<TrainBackend, 2>::from_data(TensorData::new(v, [1, n]), &Default::default())
        };
        let h = |t: Tensor<TrainBackend, 2>| crate::model::host_f32(t.into_data()).unwrap()[0];
        let uniform = row(vec![0.5; 4]);
        assert!((h(entropy(uniform.clone(), 1.0, &Kept::whole(1))) - 4f32.ln()).abs() < 1e-6);
        let two = Kept::of([&[1u32, 3][..]]);
        assert!((h(entropy(uniform, 1.0, &two)) - 2f32.ln()).abs() < 1e-6);
        let p = [0.1f32, 0.9];
        let want = -(p[0] * p[0].ln() + p[1] * p[1].ln());
        let got = h(entropy(
            row(vec![0.0, 9f32.ln() / 2.0]),
            0.5,
            &Kept::whole(1),
        ));
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}

//! Fused kernels for the decoder's element-wise work, each with its own backward.
//!
//! Composed from burn's tensor operations, a linear layer on `[batch, len, in]` runs one
//! matrix product per row in its backward and copies every transposed operand; an RMSNorm is six operations forward and about
//! twice as many backward, each allocating a whole tensor; rotary positions, the masked
//! attention softmax, SwiGLU and the token log-prob are similar. On a CPU at small sizes
//! that per-operation cost, not the matrix products, is most of a training step. [`Kernels`]
//! names these blocks, and attention as a whole (scores, masked softmax, values), as
//! backend operations:
//!
//! - every backend gets the composition in [`reference`] (burn's own operations, the exact
//!   arithmetic the model had before these kernels existed), forward and backward;
//! - [`NdArray`](burn::backend::NdArray), the trainer's CPU backend, overrides them with
//!   one-pass kernels over both cores ([`cpu`]);
//! - [`Autodiff`](burn::backend::Autodiff) over any `Kernels` backend records each block as
//!   one node whose backward calls the inner backend's backward kernel ([`autodiff`]), so
//!   the graph holds one saved tensor per block instead of a dozen.
//!
//! The CPU kernels are also what makes the sampler's and the trainer's log-probs agree bit
//! for bit: a linear layer's forward ([`rows`]) and attention ([`attend`]) sum every output
//! in one fixed order whatever the batch, padding or cache, and [`token_logprob`] is the one
//! definition of a token's log-prob.
//!
//! `tests/integration/grad_parity.rs` checks the loss and every gradient against PyTorch through these
//! kernels; the unit tests below check each native kernel, forward and backward, against
//! the composition on random inputs.

mod attend;
mod autodiff;
mod cpu;
pub mod reference;
mod rows;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// `w` `[in, out]` in f32: a weight [`Kernels::decode_weight`] keeps in 16 bits (a float
/// tensor whose primitive holds bf16 bits as `u16`, which only [`Kernels::linear_rows`]
/// reads) widened, in the same layout (the `[in, out]` view of `[out, in]` values, which a
/// decode step streams), anything else as it is. Everything that reads a generation
/// model's linear weights other than through `linear_rows` (merging an adapter, copying them
/// to the host) goes through this.
pub fn widened<B: Backend>(w: Tensor<B, 2>) -> Tensor<B, 2> {
    if w.dtype() != burn::tensor::DType::U16 {
        return w;
    }
    let (device, [d_in, out]) = (w.device(), w.dims());
    let data = w.into_data();
    let bits = data
        .as_slice::<u16>()
        .unwrap_or_else(|e| unreachable!("a u16 tensor's data: {e:?}"));
    let values: Vec<f32> = bits
        .iter()
        .map(|h| f32::from_bits(u32::from(*h) << 16))
        .collect();
    let stored = crate::model::tensors::transpose(&values, d_in, out);
    Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(stored, [out, d_in]), &device)
        .transpose()
}

/// A parameter's values in its Hugging Face tensor's order, as a backend holds them: bf16
/// bits (a weight [`Kernels::decode_weight`] keeps in 16 bits) or f32.
#[derive(Debug, Clone, PartialEq)]
pub enum HfValues {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

/// [`HfValues`] borrowed.
#[derive(Debug, Clone, Copy)]
pub enum HfSlice<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

impl HfValues {
    /// Becomes a copy of `src`, in its buffer when the kind and length match.
    pub fn copy_from(&mut self, src: HfSlice<'_>) {
        match (self, src) {
            (HfValues::Bf16(d), HfSlice::Bf16(s)) if d.len() == s.len() => d.copy_from_slice(s),
            (HfValues::F32(d), HfSlice::F32(s)) if d.len() == s.len() => d.copy_from_slice(s),
            (d, HfSlice::Bf16(s)) => *d = HfValues::Bf16(s.to_vec()),
            (d, HfSlice::F32(s)) => *d = HfValues::F32(s.to_vec()),
        }
    }

    pub fn as_slice(&self) -> HfSlice<'_> {
        match self {
            HfValues::Bf16(v) => HfSlice::Bf16(v),
            HfValues::F32(v) => HfSlice::F32(v),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HfValues::Bf16(v) => v.len(),
            HfValues::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 (bf16 widened exactly).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            HfValues::F32(v) => v,
            HfValues::Bf16(v) => v
                .into_iter()
                .map(|h| f32::from_bits(u32::from(h) << 16))
                .collect(),
        }
    }
}

/// [`widened`] for a tensor of any rank (only matrices are ever held in 16 bits).
fn widened_any<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if D != 2 || t.dtype() != burn::tensor::DType::U16 {
        return t;
    }
    let dims = t.dims();
    let w: Tensor<B, 2> = t.reshape([dims[0], dims[1]]);
    widened(w).reshape(dims)
}

/// The gradients of a linear layer on rows: input, weight (when wanted), bias (when it
/// has one).
pub type LinearGrads<B> = (Tensor<B, 2>, Option<Tensor<B, 2>>, Option<Tensor<B, 1>>);

/// The decoder's fused blocks. Shapes are fixed by the caller (the model flattens leading
/// dimensions into rows). Every method has the composed default; a backend overrides the
/// ones it has native kernels for.
pub trait Kernels: Backend {
    /// Whether [`Kernels::linear_rows`] is a native kernel that reads its operands as stored,
    /// transposed views included. The model then runs every linear layer on rows through
    /// it, and the tied output head at any number of rows; otherwise it keeps burn's
    /// `Linear` on the input's own rank (Flex's matrix product parallelises, and rounds,
    /// by that shape).
    const NATIVE_LINEAR: bool = false;

    /// Whether tensors live in host memory, where reading one is free: the trainer's
    /// optimizer and gradient norm then run as one fused pass over the host buffers
    /// (`stages::train::adamw`). Elsewhere (a device) they stay in tensor operations on the
    /// device, and a step reads back its statistics only.
    const HOST_MEMORY: bool = false;

    /// A linear weight of a model built for generation (no gradients), `[in, out]`, from
    /// the checkpoint's row-major `[out, in]` values. By default a contiguous `[in, out]`
    /// copy, as every model gets; the native CPU kernels keep the stored order instead, read
    /// as a transposed view, so that [`Kernels::linear_rows`] streams each weight once for a
    /// few rows (a decode step) instead of packing it, and keep a large weight whose every
    /// value is a bf16 (a bf16 checkpoint, a bf16 weight version) in 16 bits ([`widened`] gives
    /// its f32 tensor back): half the memory and half the bytes a decode step streams, with
    /// the same bits, since widening is exact.
    fn decode_weight(
        values: Vec<f32>,
        [rows, cols]: [usize; 2],
        device: &Self::Device,
    ) -> Tensor<Self, 2> {
        let t = crate::model::tensors::transpose(&values, rows, cols);
        Tensor::from_data(burn::tensor::TensorData::new(t, [cols, rows]), device)
    }

    /// A generation model's parameter moved out as its values in Hugging Face order (`[out,
    /// in]` for a linear weight: `linear`, which burn holds as `[in, out]`), to be changed in
    /// place and put back with [`Kernels::from_hf_values`]. A backend that keeps the values
    /// in host memory in that order hands its buffer over without a copy when the tensor is
    /// its only holder; the default copies them to the host as f32.
    fn into_hf_values<const D: usize>(
        t: Tensor<Self, D>,
        linear: bool,
    ) -> Result<HfValues, crate::model::ModelError> {
        let t = if linear && D == 2 {
            widened_any(t).swap_dims(0, 1)
        } else {
            t
        };
        let data = t.into_data().convert::<f32>();
        data.into_vec::<f32>()
            .map(HfValues::F32)
            .map_err(|e| crate::model::ModelError::Unsupported(format!("{e:?}")))
    }

    /// Runs `f` on a parameter's values in Hugging Face order (see
    /// [`Kernels::into_hf_values`]), read where they are when the backend holds them in host
    /// memory in that order; the default copies them to the host first.
    fn read_hf_values<const D: usize>(
        t: &Tensor<Self, D>,
        linear: bool,
        f: &mut dyn FnMut(HfSlice<'_>),
    ) -> Result<(), crate::model::ModelError> {
        f(Self::into_hf_values(t.clone(), linear)?.as_slice());
        Ok(())
    }

    /// The parameter of `hf_shape` holding `values` (see [`Kernels::into_hf_values`]): a
    /// linear weight as [`Kernels::decode_weight`] holds it, anything else as a row-major
    /// f32 tensor.
    fn from_hf_values<const D: usize>(
        values: HfValues,
        hf_shape: &[usize],
        linear: bool,
        device: &Self::Device,
    ) -> Tensor<Self, D> {
        let values = values.into_f32();
        if linear && D == 2 {
            let t = Self::decode_weight(values, [hf_shape[0], hf_shape[1]], device);
            return Tensor::from_primitive(t.into_primitive());
        }
        Tensor::from_data(
            burn::tensor::TensorData::new(values, hf_shape.to_vec()),
            device,
        )
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
        Self::attn_saved(q, k, v, bias, scale).0
    }

    /// [`Kernels::attn`] and its probabilities `[b, kv_heads, g·l, t]`, for the
    /// backward.
    fn attn_saved(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        bias: Tensor<Self, 4>,
        scale: f64,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        reference::attn_saved(q, k, v, bias, scale)
    }

    /// Gradients of `q`, `k` and `v` from the output's gradient `dy`.
    fn attn_backward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        probs: Tensor<Self, 4>,
        dy: Tensor<Self, 4>,
        scale: f64,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>) {
        let dprobs = dy.clone().matmul(v.swap_dims(2, 3));
        let dv = probs.clone().swap_dims(2, 3).matmul(dy);
        let ds = Self::attn_softmax_backward(probs, dprobs, scale);
        let dq = ds.clone().matmul(k);
        let dk = ds.swap_dims(2, 3).matmul(q);
        (dq, dk, dv)
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
}

/// Additive attention bias for masked positions. Finite, so a fully masked row (never
/// produced here) would not turn into NaN, and gradients stay clean.
pub(crate) const MASKED: f32 = -1e9;

/// Whether log-probs at `temperature` are of the logits divided by it: not at 1, and not
/// when it is not positive (greedy decoding records log-probs of the unscaled distribution).
pub(crate) fn tempered(temperature: f32) -> bool {
    temperature > 0.0 && temperature != 1.0
}

/// The factor the native kernels multiply the logits by: `1 / temperature` where
/// [`tempered`], else 1.
pub(crate) fn inv_temperature(temperature: f32) -> f32 {
    if tempered(temperature) {
        1.0 / temperature
    } else {
        1.0
    }
}

/// The ids each row's log-prob is renormalised over: a sampling mask's kept set (top-k,
/// top-p), or for a row without one (an untruncated draw, an episode's environment token)
/// the whole vocabulary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kept {
    /// Row `i`'s ids are `ids[offsets[i]..offsets[i + 1]]`, ascending; none: the vocabulary.
    offsets: Vec<usize>,
    ids: Vec<u32>,
}

impl Kept {
    /// `rows` rows over the whole vocabulary.
    pub fn whole(rows: usize) -> Self {
        Kept {
            offsets: vec![0; rows + 1],
            ids: Vec::new(),
        }
    }

    /// One row per set (an empty one: the whole vocabulary); each set's ids sorted.
    pub fn of<'a>(sets: impl IntoIterator<Item = &'a [u32]>) -> Self {
        let mut kept = Kept {
            offsets: vec![0],
            ids: Vec::new(),
        };
        for set in sets {
            let at = kept.ids.len();
            kept.ids.extend_from_slice(set);
            kept.ids[at..].sort_unstable();
            kept.offsets.push(kept.ids.len());
        }
        kept
    }

    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Row `i`'s kept ids, ascending; empty for the whole vocabulary.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.ids[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Whether any row is renormalised over fewer ids than the vocabulary.
    pub fn any(&self) -> bool {
        !self.ids.is_empty()
    }
}

/// The log-prob of `target` under `softmax(row · k)` renormalised over `kept` (ascending
/// ids; empty: the whole vocabulary), with `k` = [`inv_temperature`], and that log-sum-exp.
///
/// The one definition of a token's log-prob: the sampler records it as the behaviour
/// log-prob, and the trainer's kernel ([`Kernels::token_logprobs`] on the CPU) computes
/// it row by row, so with the same logits the two agree bit for bit. The maximum and the
/// sum of exponentials run in f32 over the ids in ascending order.
pub fn token_logprob(row: &[f32], target: usize, temperature: f32, kept: &[u32]) -> (f32, f32) {
    let k = inv_temperature(temperature);
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    if kept.is_empty() {
        row.iter().for_each(|&z| max = max.max(z * k));
        row.iter().for_each(|&z| sum += (z * k - max).exp());
    } else {
        let at = |i: &u32| row.get(*i as usize).copied().unwrap_or(f32::NEG_INFINITY);
        kept.iter().for_each(|i| max = max.max(at(i) * k));
        kept.iter().for_each(|i| sum += (at(i) * k - max).exp());
    }
    let lse = max + sum.ln();
    (
        row.get(target).copied().unwrap_or(f32::NEG_INFINITY) * k - lse,
        lse,
    )
}

impl Kernels for burn::backend::Flex {
    const HOST_MEMORY: bool = true;
}

#[cfg(feature = "cuda")]
impl Kernels for burn::backend::Cuda {}
#[cfg(feature = "wgpu")]
impl Kernels for burn::backend::Wgpu {}

#[cfg(test)]
mod tests;

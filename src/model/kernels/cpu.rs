//! Native [`Kernels`] for [`NdArray`]: one pass over contiguous f32 rows, split over the
//! cores by rayon, each output written once into a fresh buffer. A tensor of another dtype
//! takes the composed path.

use super::exp::{exp, exp_in_place};
use super::fused::head_backward_chunks;
use super::logprob::{HeadTargets, Kept, inv_temperature, token_logprob};
use super::products::{mat_mul, product};
use super::rows::PackedWeight;
use super::{Kernels, attend, head, pack_once, reference, rows};
use burn::backend::NdArray;
use burn::backend::ndarray::NdArrayTensor;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use ndarray::{ArcArray, Array2, ArrayView2, Ix2, IxDyn};
use rayon::prelude::*;
use std::borrow::Cow;

/// Rows handed to one rayon task: about 16k values, so small tensors stay on one core.
fn min_rows(row_len: usize) -> usize {
    (16_384 / row_len.max(1)).max(1)
}

/// A tensor's values as an f32 array: contiguous in row-major order ([`Host::of`], a copy
/// only if it is a strided view), or for matrix products also a transposed one
/// ([`Host::matrix_of`]: BLAS reads either order).
struct Host(ArcArray<f32, IxDyn>);

impl Host {
    fn array<const D: usize>(t: Tensor<NdArray, D>) -> ArcArray<f32, IxDyn> {
        match t.into_primitive().tensor() {
            NdArrayTensor::F32(storage) => storage.into_shared(),
            // `all_f32` was checked first.
            _ => unreachable!("the f32 kernel was handed a tensor of another dtype"),
        }
    }

    fn of<const D: usize>(t: Tensor<NdArray, D>) -> Host {
        let a = Self::array(t);
        if a.is_standard_layout() {
            Host(a)
        } else {
            Host(a.as_standard_layout().into_owned().into_shared())
        }
    }

    /// A matrix as stored when it is row- or column-major (a transposed view is not
    /// copied), otherwise a row-major copy.
    fn matrix_of(t: Tensor<NdArray, 2>) -> Host {
        let a = Self::array(t);
        if a.is_standard_layout() || a.t().is_standard_layout() {
            Host(a)
        } else {
            Host(a.as_standard_layout().into_owned().into_shared())
        }
    }

    /// Whether the matrix is stored column-major (the transpose of a row-major one).
    fn is_transposed(&self) -> bool {
        !self.0.is_standard_layout()
    }

    fn matrix(&self) -> ArrayView2<'_, f32> {
        self.0
            .view()
            .into_dimensionality::<Ix2>()
            .unwrap_or_else(|e| unreachable!("a rank-2 tensor: {e}"))
    }

    /// A matrix's values in memory order: row-major, or for a transposed view the
    /// row-major values of the matrix it transposes.
    fn memory(&self) -> &[f32] {
        self.0
            .as_slice_memory_order()
            .unwrap_or_else(|| unreachable!("a row- or column-major matrix is contiguous"))
    }

    fn slice(&self) -> &[f32] {
        self.0
            .as_slice()
            .unwrap_or_else(|| unreachable!("standard layout is contiguous"))
    }
}

fn all_f32(dtypes: &[DType]) -> bool {
    dtypes.iter().all(|d| *d == DType::F32)
}

fn tensor<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<NdArray, D> {
    let array = ArcArray::from_shape_vec(IxDyn(&shape), values)
        .unwrap_or_else(|e| unreachable!("kernel output sized to its shape: {e}"));
    Tensor::from_primitive(TensorPrimitive::Float(NdArrayTensor::from(array)))
}

fn matrix_tensor(a: Array2<f32>) -> Tensor<NdArray, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(NdArrayTensor::from(
        a.into_dyn().into_shared(),
    )))
}

/// Whether every target and kept id is below `vocab`, with one target and one kept row for
/// each of the `n` rows.
fn fits_vocabulary(targets: &[u32], kept: &Kept, n: usize, vocab: usize) -> bool {
    let below = |id: &u32| (*id as usize) < vocab;
    targets.len() == n
        && kept.rows() == n
        && targets.iter().all(below)
        && (0..n).all(|i| kept.row(i).iter().all(below))
}

/// `σ(x) = 1 / (1 + e^-x)` from `e^-x` ([`exp_in_place`] takes those a block at a time).
fn sigmoid_of(exp_minus_x: f32) -> f32 {
    1.0 / (1.0 + exp_minus_x)
}

type Four = Tensor<NdArray, 4>;

/// The layout of an attention call the native kernel takes: f32 operands of the shapes
/// [`Kernels::attn`] names.
fn attention_shape(q: &Four, k: &Four, v: &Four, bias: &Four) -> Option<attend::Shape> {
    let [b, kv_heads, rows, hd] = q.dims();
    let [bias_b, _, l, t] = bias.dims();
    let fits = all_f32(&[q.dtype(), k.dtype(), v.dtype(), bias.dtype()])
        && k.dims() == [b, kv_heads, t, hd]
        && v.dims() == k.dims()
        && bias.dims()[1] == 1
        && (bias_b == 1 || bias_b == b)
        && l > 0
        && rows.is_multiple_of(l);
    fits.then_some(attend::Shape {
        b,
        kv_heads,
        rows,
        l,
        t,
        hd,
        bias_b,
    })
}

/// [`attend::attend`] on tensors of `shape`: the output and each query's log-sum-exp.
fn native_attention([q, k, v, bias]: [Four; 4], shape: attend::Shape, scale: f64) -> (Four, Four) {
    let [q, k, v, bias] = [q, k, v, bias].map(Host::of);
    let (out, lse) = attend::attend(
        q.slice(),
        k.slice(),
        v.slice(),
        bias.slice(),
        shape,
        scale as f32,
    );
    let attend::Shape {
        b,
        kv_heads,
        rows,
        hd,
        ..
    } = shape;
    (
        tensor(out, [b, kv_heads, rows, hd]),
        tensor(lse, [b, kv_heads, rows, 1]),
    )
}

/// A generation model's bf16 weight ([`WeightStorage::decode_weight`]): its `[out, in]` bits in
/// memory order, when it is the transposed view that builds.
fn bf16_stored(weight: &Tensor<NdArray, 2>) -> Option<ArcArray<u16, IxDyn>> {
    match weight.clone().into_primitive().tensor() {
        NdArrayTensor::U16(storage) => {
            let a = storage.into_shared();
            (a.ndim() == 2 && a.t().is_standard_layout()).then_some(a)
        }
        _ => None,
    }
}

impl Kernels for NdArray {
    const NATIVE_LINEAR: bool = true;

    /// A contiguous f32 tensor keeps its buffer (shared, copied on a later write as every
    /// NdArray buffer is); anything else goes through burn's reshape.
    fn reshape_values(x: NdArrayTensor, shape: Shape) -> NdArrayTensor {
        match x {
            NdArrayTensor::F32(s) if s.is_owned() && s.view().is_standard_layout() => {
                match s
                    .into_shared()
                    .into_shape_with_order(IxDyn(shape.as_slice()))
                {
                    Ok(a) => NdArrayTensor::from(a),
                    Err(e) => panic!("reshape to {:?}: {e}", shape.as_slice()),
                }
            }
            x => Self::float_reshape(x, shape),
        }
    }

    /// Every output one dot product in a fixed order ([`rows`]), whatever the number of
    /// rows: a weight stored `[out, in]` (a generation model's, in f32 or bf16; a tied
    /// embedding read as the output head) as stored, a row-major `[in, out]` one (the
    /// trainer's) transposed first, as a matrix product packs its operand. The bias is added
    /// after.
    fn linear_rows(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let bias_f32 = bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
        let half = bf16_stored(&weight);
        let weight_f32 = half.is_some() || weight.dtype() == DType::F32;
        if x.dtype() != DType::F32 || !bias_f32 || !weight_f32 {
            return reference::linear(x, crate::model::storage::widened(weight), bias);
        }
        let [n, d_in] = x.dims();
        let out = weight.dims()[1];
        let x = Host::of(x);
        let mut y = match half {
            Some(bits) => {
                let bits = bits
                    .as_slice_memory_order()
                    .unwrap_or_else(|| unreachable!("a transposed view of a row-major matrix"));
                rows::rows_by_transposed(x.slice(), n, bits, out, d_in)
            }
            None => {
                let w = Host::matrix_of(weight);
                let transposed = || match w.is_transposed() {
                    true => Cow::Borrowed(w.memory()),
                    false => Cow::Owned(crate::model::tensors::transpose(w.memory(), d_in, out)),
                };
                // A weight the model holds (not a copy made for this call) is packed once
                // while a step keeps packings open.
                let kept = (!w.0.is_unique() && rows::packs(d_in))
                    .then(|| {
                        pack_once::packed(&w.0, || PackedWeight::new(&transposed(), out, d_in))
                    })
                    .flatten();
                match kept {
                    Some(p) => rows::rows_by_packed(x.slice(), n, &p),
                    None => rows::rows_by_transposed(x.slice(), n, &transposed(), out, d_in),
                }
            }
        };
        if let Some(bias) = bias {
            let bias = Host::of(bias);
            for row in y.chunks_exact_mut(out.max(1)) {
                row.iter_mut().zip(bias.slice()).for_each(|(v, b)| *v += b);
            }
        }
        tensor(y, [n, out])
    }

    fn linear_rows_backward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        weight_grad: bool,
        bias: bool,
        dy: Tensor<Self, 2>,
    ) -> super::LinearGrads<Self> {
        if !all_f32(&[x.dtype(), weight.dtype(), dy.dtype()]) {
            return reference::linear_backward(x, weight, weight_grad, bias, dy);
        }
        let d_out = weight.dims()[1];
        let (x, w, dy) = (
            Host::matrix_of(x),
            Host::matrix_of(weight),
            Host::matrix_of(dy),
        );
        let dx = product(&dy.matrix(), &w.matrix().t());
        // The weight's gradient in the weight's own order: a transposed view (a tied
        // embedding read as the output head) gets `(dyᵀ · x)ᵀ`, so the gradient reaches the
        // embedding row-major, without a transposing copy.
        let dw = if !weight_grad {
            None
        } else if w.is_transposed() {
            let dwt = product(&dy.matrix().t(), &x.matrix());
            Some(dwt.reversed_axes())
        } else {
            Some(product(&x.matrix().t(), &dy.matrix()))
        };
        let db = bias.then(|| tensor(dy.matrix().sum_axis(ndarray::Axis(0)).to_vec(), [d_out]));
        (matrix_tensor(dx), dw.map(matrix_tensor), db)
    }

    fn rms_norm(x: Tensor<Self, 2>, gamma: Tensor<Self, 1>, eps: f64) -> Tensor<Self, 2> {
        Self::rms_norm_saved(x, gamma, eps).0
    }

    fn rms_norm_saved(
        x: Tensor<Self, 2>,
        gamma: Tensor<Self, 1>,
        eps: f64,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        if !all_f32(&[x.dtype(), gamma.dtype()]) {
            return reference::rms_norm_saved(x, gamma, eps);
        }
        let [n, d] = x.dims();
        let (x, gamma) = (Host::of(x), Host::of(gamma));
        let (xs, g) = (x.slice(), gamma.slice());
        let mut y = vec![0f32; n * d];
        let mut inv = vec![0f32; n];
        y.par_chunks_mut(d.max(1))
            .zip(inv.par_iter_mut())
            .enumerate()
            .with_min_len(min_rows(d))
            .for_each(|(i, (yr, r))| {
                let xr = &xs[i * d..(i + 1) * d];
                let ss: f32 = xr.iter().map(|v| v * v).sum();
                *r = 1.0 / (ss / d as f32 + eps as f32).sqrt();
                for ((o, &v), &w) in yr.iter_mut().zip(xr).zip(g) {
                    *o = v * *r * w;
                }
            });
        (tensor(y, [n, d]), tensor(inv, [n, 1]))
    }

    fn rms_norm_backward(
        x: Tensor<Self, 2>,
        gamma: Tensor<Self, 1>,
        inv_rms: Tensor<Self, 2>,
        dy: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        if !all_f32(&[x.dtype(), gamma.dtype(), inv_rms.dtype(), dy.dtype()]) {
            return reference::rms_norm_backward(x, gamma, inv_rms, dy);
        }
        let [n, d] = x.dims();
        let (x, gamma, inv, dy) = (
            Host::of(x),
            Host::of(gamma),
            Host::of(inv_rms),
            Host::of(dy),
        );
        let (xs, g, r, dys) = (x.slice(), gamma.slice(), inv.slice(), dy.slice());
        let mut dx = vec![0f32; n * d];
        let chunk = min_rows(d);
        // dgamma: partial sums per fixed chunk of rows, added up in chunk order after, so
        // the result does not depend on how rayon scheduled the chunks (runs repeat bit for
        // bit).
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(d.max(1) * chunk)
            .enumerate()
            .map(|(c, block)| {
                let mut dg = vec![0f32; d];
                for (k, dxr) in block.chunks_mut(d.max(1)).enumerate() {
                    let i = c * chunk + k;
                    let (xr, dyr, ri) = (&xs[i * d..(i + 1) * d], &dys[i * d..(i + 1) * d], r[i]);
                    let mut dot = 0f32;
                    for j in 0..d {
                        dot += dyr[j] * g[j] * xr[j];
                        dg[j] += dyr[j] * xr[j] * ri;
                    }
                    let c3 = ri * ri * ri * dot / d as f32;
                    for j in 0..d {
                        dxr[j] = ri * dyr[j] * g[j] - xr[j] * c3;
                    }
                }
                dg
            })
            .collect();
        let mut dgamma = vec![0f32; d];
        for part in &partials {
            dgamma.iter_mut().zip(part).for_each(|(a, b)| *a += b);
        }
        (tensor(dx, [n, d]), tensor(dgamma, [d]))
    }

    /// One copy of each `(row, head)` run of both (burn's concatenation walks them value by
    /// value, and a decode step joins the whole cache with its new column on every layer).
    fn cat_columns(a: Tensor<Self, 4>, b: Tensor<Self, 4>) -> Tensor<Self, 4> {
        let ([r, h, ta, d], [rb, hb, tb, db]) = (a.dims(), b.dims());
        if !all_f32(&[a.dtype(), b.dtype()]) || (r, h, d) != (rb, hb, db) {
            return Tensor::cat(vec![a, b], 2);
        }
        let (a, b) = (Host::of(a), Host::of(b));
        let (sa, sb) = (ta * d, tb * d);
        let out = if sa == 0 || sb == 0 {
            [a.slice(), b.slice()].concat()
        } else {
            let mut out = Vec::with_capacity(r * h * (sa + sb));
            for (ra, rb) in a.slice().chunks_exact(sa).zip(b.slice().chunks_exact(sb)) {
                out.extend_from_slice(ra);
                out.extend_from_slice(rb);
            }
            out
        };
        tensor(out, [r, h, ta + tb, d])
    }

    fn rope(x: Tensor<Self, 4>, cos: Tensor<Self, 3>, sin: Tensor<Self, 3>) -> Tensor<Self, 4> {
        if !all_f32(&[x.dtype(), cos.dtype(), sin.dtype()]) {
            return reference::rope(x, cos, sin);
        }
        let [b, l, h, hd] = x.dims();
        let half = hd / 2;
        let (x, cos, sin) = (Host::of(x), Host::of(cos), Host::of(sin));
        let (xs, cs, ss) = (x.slice(), cos.slice(), sin.slice());
        let mut y = vec![0f32; b * h * l * hd];
        // Output block (row bi, head hi) is [l, hd], contiguous.
        y.par_chunks_mut((l * hd).max(1))
            .enumerate()
            .with_min_len(min_rows(l * hd))
            .for_each(|(bh, block)| {
                let (bi, hi) = (bh / h, bh % h);
                for (li, out) in block.chunks_mut(hd.max(1)).enumerate() {
                    let src = &xs[((bi * l + li) * h + hi) * hd..][..hd];
                    let t = (bi * l + li) * hd;
                    let (c, s) = (&cs[t..t + hd], &ss[t..t + hd]);
                    for j in 0..half {
                        out[j] = src[j] * c[j] - src[j + half] * s[j];
                        out[j + half] = src[j + half] * c[j + half] + src[j] * s[j + half];
                    }
                }
            });
        tensor(y, [b, h, l, hd])
    }

    fn rope_backward(
        dy: Tensor<Self, 4>,
        cos: Tensor<Self, 3>,
        sin: Tensor<Self, 3>,
    ) -> Tensor<Self, 4> {
        if !all_f32(&[dy.dtype(), cos.dtype(), sin.dtype()]) {
            return reference::rope_backward(dy, cos, sin);
        }
        let [b, h, l, hd] = dy.dims();
        let half = hd / 2;
        let (dy, cos, sin) = (Host::of(dy), Host::of(cos), Host::of(sin));
        let (dys, cs, ss) = (dy.slice(), cos.slice(), sin.slice());
        let mut dx = vec![0f32; b * l * h * hd];
        // Output block (row bi, position li) is [h, hd], contiguous.
        dx.par_chunks_mut((h * hd).max(1))
            .enumerate()
            .with_min_len(min_rows(h * hd))
            .for_each(|(bl, block)| {
                let (bi, li) = (bl / l, bl % l);
                let t = bl * hd;
                let (c, s) = (&cs[t..t + hd], &ss[t..t + hd]);
                for (hi, out) in block.chunks_mut(hd.max(1)).enumerate() {
                    let g = &dys[((bi * h + hi) * l + li) * hd..][..hd];
                    for j in 0..half {
                        out[j] = g[j] * c[j] + g[j + half] * s[j + half];
                        out[j + half] = g[j + half] * c[j + half] - g[j] * s[j];
                    }
                }
            });
        tensor(dx, [b, l, h, hd])
    }

    fn attn_softmax(scores: Tensor<Self, 4>, bias: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
        let [b, m, l, t] = scores.dims();
        let bb = bias.dims()[0];
        if !all_f32(&[scores.dtype(), bias.dtype()])
            || bias.dims() != [bb, 1, l, t]
            || (bb != 1 && bb != b)
        {
            return reference::attn_softmax(scores, bias, scale);
        }
        let (scores, bias) = (Host::of(scores), Host::of(bias));
        let (xs, bs) = (scores.slice(), bias.slice());
        let scale = scale as f32;
        let mut y = vec![0f32; b * m * l * t];
        y.par_chunks_mut(t.max(1))
            .enumerate()
            .with_min_len(min_rows(t))
            .for_each(|(row, out)| {
                let (bi, li) = (row / (m * l), row % l);
                let br = &bs[((if bb == 1 { 0 } else { bi }) * l + li) * t..][..t];
                let xr = &xs[row * t..][..t];
                let mut max = f32::NEG_INFINITY;
                for ((o, &v), &bv) in out.iter_mut().zip(xr).zip(br) {
                    *o = v * scale + bv;
                    max = max.max(*o);
                }
                out.iter_mut().for_each(|o| *o -= max);
                exp_in_place(out);
                let mut sum = 0f32;
                out.iter().for_each(|o| sum += o);
                let inv = 1.0 / sum;
                out.iter_mut().for_each(|o| *o *= inv);
            });
        tensor(y, [b, m, l, t])
    }

    fn attn(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        bias: Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        match attention_shape(&q, &k, &v, &bias) {
            Some(shape) => native_attention([q, k, v, bias], shape, scale).0,
            None => reference::attention((q, k, v), bias, scale, Self::attn_softmax),
        }
    }

    fn attn_saved(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        bias: Tensor<Self, 4>,
        scale: f64,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        match attention_shape(&q, &k, &v, &bias) {
            Some(shape) => native_attention([q, k, v, bias], shape, scale),
            None => reference::attn_lse((q, k, v), bias, scale),
        }
    }

    /// [`attend::attend_backward`]: the probabilities recomputed a block of queries at a
    /// time.
    fn attn_backward(
        (q, k, v): (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>),
        bias: Tensor<Self, 4>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 4>,
        dy: Tensor<Self, 4>,
        scale: f64,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>) {
        let shape = attention_shape(&q, &k, &v, &bias)
            .filter(|_| all_f32(&[out.dtype(), lse.dtype(), dy.dtype()]));
        let Some(shape) = shape else {
            let softmax_backward = Self::attn_softmax_backward;
            return reference::attn_backward_lse(
                (q, k, v),
                (bias, lse),
                dy,
                scale,
                softmax_backward,
            );
        };
        let (qd, kd) = (q.dims(), k.dims());
        let [q, k, v, bias, out, lse, dy] = [q, k, v, bias, out, lse, dy].map(Host::of);
        let saved = attend::Saved {
            out: out.slice(),
            lse: lse.slice(),
            dy: dy.slice(),
        };
        let (dq, dk, dv) = attend::attend_backward(
            (q.slice(), k.slice(), v.slice()),
            bias.slice(),
            saved,
            shape,
            scale as f32,
        );
        (tensor(dq, qd), tensor(dk, kd), tensor(dv, kd))
    }

    fn attn_softmax_backward(
        probs: Tensor<Self, 4>,
        dprobs: Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        if !all_f32(&[probs.dtype(), dprobs.dtype()]) {
            return reference::attn_softmax_backward(probs, dprobs, scale);
        }
        let shape = probs.dims();
        let t = shape[3];
        let (probs, dprobs) = (Host::of(probs), Host::of(dprobs));
        let (ps, dps) = (probs.slice(), dprobs.slice());
        let scale = scale as f32;
        let mut ds = vec![0f32; ps.len()];
        ds.par_chunks_mut(t.max(1))
            .enumerate()
            .with_min_len(min_rows(t))
            .for_each(|(row, out)| {
                let (pr, dr) = (&ps[row * t..][..t], &dps[row * t..][..t]);
                let dot: f32 = pr.iter().zip(dr).map(|(p, d)| p * d).sum();
                for ((o, &p), &d) in out.iter_mut().zip(pr).zip(dr) {
                    *o = scale * p * (d - dot);
                }
            });
        tensor(ds, shape)
    }

    fn swiglu(gate: Tensor<Self, 2>, up: Tensor<Self, 2>) -> Tensor<Self, 2> {
        if !all_f32(&[gate.dtype(), up.dtype()]) {
            return reference::swiglu(gate, up);
        }
        let shape = gate.dims();
        let (gate, up) = (Host::of(gate), Host::of(up));
        let (gs, us) = (gate.slice(), up.slice());
        // `y` holds -g first (written as it is made, with no zeroing pass), then e^-g: the
        // sigmoid's exponentials a block at a time.
        let mut y: Vec<f32> = gs.par_iter().with_min_len(4096).map(|&g| -g).collect();
        y.par_chunks_mut(4096)
            .zip(gs.par_chunks(4096).zip(us.par_chunks(4096)))
            .with_min_len(4)
            .for_each(|(out, (g, u))| {
                exp_in_place(out);
                for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                    *o = g * sigmoid_of(*o) * u;
                }
            });
        tensor(y, shape)
    }

    fn swiglu_backward(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        dy: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        if !all_f32(&[gate.dtype(), up.dtype(), dy.dtype()]) {
            return reference::swiglu_backward(gate, up, dy);
        }
        let shape = gate.dims();
        let (gate, up, dy) = (Host::of(gate), Host::of(up), Host::of(dy));
        let (gs, us, dys) = (gate.slice(), up.slice(), dy.slice());
        // Both made as they are first written (no zeroing pass): `dg` holds -g, then e^-g
        // as in the forward, `du` the output's gradient.
        let mut dg: Vec<f32> = gs.par_iter().with_min_len(4096).map(|&g| -g).collect();
        let mut du: Vec<f32> = dys.par_iter().with_min_len(4096).copied().collect();
        dg.par_chunks_mut(4096)
            .zip(du.par_chunks_mut(4096))
            .enumerate()
            .with_min_len(4)
            .for_each(|(c, (dgc, duc))| {
                let o = c * 4096;
                exp_in_place(dgc);
                for k in 0..dgc.len() {
                    let (g, u, d) = (gs[o + k], us[o + k], duc[k]);
                    let s = sigmoid_of(dgc[k]);
                    dgc[k] = d * u * s * (1.0 + g * (1.0 - s));
                    duc[k] = d * g * s;
                }
            });
        (tensor(dg, shape), tensor(du, shape))
    }

    fn token_logprobs(
        logits: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
    ) -> Tensor<Self, 2> {
        Self::token_logprobs_saved(logits, targets, temperature, kept).0
    }

    /// [`token_logprob`] row by row: the sampler's own arithmetic.
    fn token_logprobs_saved(
        logits: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let [n, v] = logits.dims();
        if logits.dtype() != DType::F32 || !fits_vocabulary(targets, kept, n, v) {
            return reference::token_logprobs_saved(logits, targets, temperature, kept);
        }
        let logits = Host::of(logits);
        let zs = logits.slice();
        let mut lp = vec![0f32; n];
        let mut lse = vec![0f32; n];
        lp.par_iter_mut()
            .zip(lse.par_iter_mut())
            .enumerate()
            .with_min_len(min_rows(v))
            .for_each(|(i, (lp, lse))| {
                let row = &zs[i * v..][..v];
                (*lp, *lse) = token_logprob(row, targets[i] as usize, temperature, kept.row(i));
            });
        (tensor(lp, [n, 1]), tensor(lse, [n, 1]))
    }

    fn token_logprobs_backward(
        logits: Tensor<Self, 2>,
        lse: Tensor<Self, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &Kept,
        dy: Tensor<Self, 2>,
    ) -> Tensor<Self, 2> {
        let [n, v] = logits.dims();
        if !all_f32(&[logits.dtype(), lse.dtype(), dy.dtype()])
            || !fits_vocabulary(targets, kept, n, v)
        {
            return reference::token_logprobs_backward(logits, lse, targets, temperature, kept, dy);
        }
        let k = inv_temperature(temperature);
        let (logits, lse, dy) = (Host::of(logits), Host::of(lse), Host::of(dy));
        let (zs, ls, dys) = (logits.slice(), lse.slice(), dy.slice());
        let mut dz = vec![0f32; n * v];
        dz.par_chunks_mut(v.max(1))
            .enumerate()
            .with_min_len(min_rows(v))
            .for_each(|(i, out)| {
                let (zr, l, dk) = (&zs[i * v..][..v], ls[i], dys[i] * k);
                match kept.row(i) {
                    [] => {
                        out.iter_mut().zip(zr).for_each(|(o, &z)| *o = z * k - l);
                        exp_in_place(out);
                        out.iter_mut().for_each(|o| *o *= -dk);
                    }
                    ids => {
                        for &id in ids {
                            out[id as usize] = -dk * exp(zr[id as usize] * k - l);
                        }
                    }
                }
                out[targets[i] as usize] += dk;
            });
        tensor(dz, [n, v])
    }

    /// The default's chunks, each chunk's weight gradient added into one buffer in the
    /// weight's own order (a tied embedding's transposed view gets it row-major, as
    /// [`Kernels::linear_rows_backward`] gives it).
    fn head_logprobs_backward(
        (x, weight): (Tensor<Self, 2>, Tensor<Self, 2>),
        weight_grad: bool,
        lse: Tensor<Self, 2>,
        t: HeadTargets<'_>,
        dy: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Option<Tensor<Self, 2>>) {
        let [n, d_in] = x.dims();
        let d_out = weight.dims()[1];
        if !all_f32(&[x.dtype(), weight.dtype(), lse.dtype(), dy.dtype()])
            || !fits_vocabulary(t.targets, t.kept, n, d_out)
        {
            return head_backward_chunks::<Self>((x, weight), weight_grad, lse, t, dy);
        }
        let (xh, w) = (Host::matrix_of(x.clone()), Host::matrix_of(weight.clone()));
        let mut dx = Array2::<f32>::zeros((n, d_in));
        let mut dw = weight_grad.then(|| match w.is_transposed() {
            true => Array2::<f32>::zeros((d_out, d_in)),
            false => Array2::<f32>::zeros((d_in, d_out)),
        });
        for rows in head::chunks(n, t.chunk) {
            head::note_logits(rows.len());
            let logits = Self::linear_rows(x.clone().slice(rows.clone()), weight.clone(), None);
            let dz = Host::matrix_of(Self::token_logprobs_backward(
                logits,
                lse.clone().slice(rows.clone()),
                &t.targets[rows.clone()],
                t.temperature,
                &t.kept.range(rows.clone()),
                dy.clone().slice(rows.clone()),
            ));
            let (dz, xc) = (
                dz.matrix(),
                xh.matrix().slice_move(ndarray::s![rows.clone(), ..]),
            );
            let mut dxc = dx.slice_mut(ndarray::s![rows, ..]);
            mat_mul(&dz, &w.matrix().t(), false, &mut dxc);
            match dw.as_mut() {
                Some(dw) if w.is_transposed() => mat_mul(&dz.t(), &xc, true, &mut dw.view_mut()),
                Some(dw) => mat_mul(&xc.t(), &dz, true, &mut dw.view_mut()),
                None => {}
            }
        }
        let dw = dw.map(|dw| match w.is_transposed() {
            true => matrix_tensor(dw.reversed_axes()),
            false => matrix_tensor(dw),
        });
        (matrix_tensor(dx), dw)
    }
}

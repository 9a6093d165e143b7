//! How a backend stores a model's parameters, apart from the arithmetic on them
//! ([`crate::model::Kernels`]): a linear weight built for generation
//! ([`WeightStorage::decode_weight`]), a parameter's values in Hugging Face order moved out,
//! read in place and put back ([`HfValues`]), and whether tensors live in host memory.
//! Every backend gets the defaults (a copy through the host); NdArray, whose tensors are
//! host arrays, hands its buffers over without copies and keeps large bf16 weights in 16
//! bits.

use crate::model::ModelError;
use burn::backend::NdArray;
use burn::backend::ndarray::NdArrayTensor;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use ndarray::{ArcArray, IxDyn};

/// `w` `[in, out]` in f32: a weight [`WeightStorage::decode_weight`] keeps in 16 bits (a float
/// tensor whose primitive holds bf16 bits as `u16`, which only [`Kernels::linear_rows`](crate::model::Kernels::linear_rows)
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
/// bits (a weight [`WeightStorage::decode_weight`] keeps in 16 bits) or f32.
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

/// A parameter's values in Hugging Face order, copied to the host as f32 (`[out, in]` for a
/// linear weight, which burn holds as `[in, out]`): what every backend does by default.
fn host_hf_values<B: Backend, const D: usize>(
    t: Tensor<B, D>,
    linear: bool,
) -> Result<HfValues, ModelError> {
    let t = if linear && D == 2 {
        widened_any(t).swap_dims(0, 1)
    } else {
        t
    };
    let data = t.into_data().convert::<f32>();
    data.into_vec::<f32>()
        .map(HfValues::F32)
        .map_err(|e| ModelError::Unsupported(format!("{e:?}")))
}

/// How a backend stores a model's parameters.
pub trait WeightStorage: Backend {
    /// Whether tensors live in host memory, where reading one is free: the trainer's
    /// optimizer and gradient norm then run as one fused pass over the host buffers
    /// (`stages::train::adamw`). Elsewhere (a device) they stay in tensor operations on the
    /// device, and a step reads back its statistics only.
    const HOST_MEMORY: bool = false;

    /// The address of `t`'s f32 values in CUDA memory of this process's primary context,
    /// when this backend keeps them there (the `cuda` build) and they are contiguous: a
    /// collective on the same GPU sums them in place. The tensor keeps the memory alive;
    /// the caller waits for the backend's pending work (`Backend::sync`) before another
    /// stream touches it. `None` by default.
    fn cuda_address(_t: &Tensor<Self, 1>) -> Option<u64> {
        None
    }

    /// A linear weight of a model built for generation (no gradients), `[in, out]`, from
    /// the checkpoint's row-major `[out, in]` values. By default a contiguous `[in, out]`
    /// copy, as every model gets; the native CPU kernels keep the stored order instead, read
    /// as a transposed view, so that [`Kernels::linear_rows`](crate::model::Kernels::linear_rows) streams each weight once for a
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
    /// place and put back with [`WeightStorage::from_hf_values`]. A backend that keeps the values
    /// in host memory in that order hands its buffer over without a copy when the tensor is
    /// its only holder; the default copies them to the host as f32.
    fn into_hf_values<const D: usize>(
        t: Tensor<Self, D>,
        linear: bool,
    ) -> Result<HfValues, ModelError> {
        host_hf_values(t, linear)
    }

    /// Runs `f` on a parameter's values in Hugging Face order (see
    /// [`WeightStorage::into_hf_values`]), read where they are when the backend holds them in host
    /// memory in that order; the default copies them to the host first.
    fn read_hf_values<const D: usize>(
        t: &Tensor<Self, D>,
        linear: bool,
        f: &mut dyn FnMut(HfSlice<'_>),
    ) -> Result<(), ModelError> {
        f(Self::into_hf_values(t.clone(), linear)?.as_slice());
        Ok(())
    }

    /// The parameter of `hf_shape` holding `values` (see [`WeightStorage::into_hf_values`]): a
    /// linear weight as [`WeightStorage::decode_weight`] holds it, anything else as a row-major
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
}

/// The fewest values a linear weight of bf16 values needs to be held in 16 bits: 1 MiB in
/// f32, a core's L2 cache on the CPUs measured. A smaller weight is read from cache on every
/// pass, where halving its bytes saves nothing and widening each load adds work (at the
/// small bench size, weights of 49k values, one run gave 6,095 tok/s in 16 bits against
/// 8,123 in f32, though that size moves by 15% from run to run: BENCHMARKS.md).
const BF16_MIN_VALUES: usize = 1 << 18;

/// `a` read in Hugging Face order (a linear weight's `[in, out]` view turned back to `[out,
/// in]`).
fn hf_ordered<E>(a: ArcArray<E, IxDyn>, linear: bool) -> ArcArray<E, IxDyn> {
    if linear { a.reversed_axes() } else { a }
}

/// The values of `a` in Hugging Face order (for a linear weight, `a` is the `[in, out]` view
/// of `[out, in]` values): its buffer when that is laid out so and `a` holds it alone, a
/// copy otherwise.
fn hf_vec<E: Clone>(a: ArcArray<E, IxDyn>, linear: bool) -> Vec<E> {
    let a = hf_ordered(a, linear);
    if a.is_standard_layout() {
        let n = a.len();
        let (v, offset) = a.into_owned().into_raw_vec_and_offset();
        if offset.unwrap_or(0) == 0 && v.len() == n {
            return v;
        }
        return v[offset.unwrap_or(0)..][..n].to_vec();
    }
    a.iter().cloned().collect()
}

/// Row-major `[rows, cols]` values as the `[cols, rows]` view of them.
fn stored<E: Clone>(values: Vec<E>, [rows, cols]: [usize; 2]) -> ArcArray<E, IxDyn> {
    ArcArray::from_shape_vec(IxDyn(&[rows, cols]), values)
        .unwrap_or_else(|e| unreachable!("a weight's values sized to its shape: {e}"))
        .reversed_axes()
}

impl WeightStorage for NdArray {
    const HOST_MEMORY: bool = true;

    /// `[out, in]` as stored, read as a transposed view; in 16 bits when every value is a
    /// bf16 (its low 16 bits zero, so narrowing loses nothing) and the weight is too large
    /// to stay in a core's cache between passes ([`BF16_MIN_VALUES`]).
    fn decode_weight(
        values: Vec<f32>,
        [rows, cols]: [usize; 2],
        _device: &Self::Device,
    ) -> Tensor<Self, 2> {
        let large = values.len() >= BF16_MIN_VALUES;
        let primitive = if large && values.iter().all(|v| v.to_bits() & 0xffff == 0) {
            let bits: Vec<u16> = values.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            NdArrayTensor::from(stored(bits, [rows, cols]))
        } else {
            NdArrayTensor::from(stored(values, [rows, cols]))
        };
        Tensor::from_primitive(TensorPrimitive::Float(primitive))
    }

    /// The buffer itself when it is in Hugging Face order and this tensor holds it alone
    /// (a generation model's weights: `[out, in]` as stored, or row-major), a copy otherwise.
    fn into_hf_values<const D: usize>(
        t: Tensor<Self, D>,
        linear: bool,
    ) -> Result<HfValues, ModelError> {
        Ok(match t.into_primitive().tensor() {
            NdArrayTensor::U16(storage) => HfValues::Bf16(hf_vec(storage.into_shared(), linear)),
            NdArrayTensor::F32(storage) => {
                let a = storage.into_shared();
                match a.as_slice() {
                    // A trainer's row-major `[in, out]` weight: transposed in cache tiles on
                    // every core.
                    Some(v) if linear && a.ndim() == 2 => {
                        let (rows, cols) = (a.shape()[0], a.shape()[1]);
                        HfValues::F32(crate::model::tensors::transpose(v, rows, cols))
                    }
                    _ => HfValues::F32(hf_vec(a, linear)),
                }
            }
            other => host_hf_values(
                Tensor::<Self, D>::from_primitive(TensorPrimitive::Float(other)),
                linear,
            )?,
        })
    }

    /// The tensor's own buffer when it is laid out in Hugging Face order.
    fn read_hf_values<const D: usize>(
        t: &Tensor<Self, D>,
        linear: bool,
        f: &mut dyn FnMut(HfSlice<'_>),
    ) -> Result<(), ModelError> {
        match t.clone().into_primitive().tensor() {
            NdArrayTensor::U16(s) => {
                let a = hf_ordered(s.into_shared(), linear);
                match a.as_slice() {
                    Some(v) => f(HfSlice::Bf16(v)),
                    None => f(HfSlice::Bf16(&a.iter().copied().collect::<Vec<_>>())),
                }
            }
            NdArrayTensor::F32(s) => {
                let a = hf_ordered(s.into_shared(), linear);
                match a.as_slice() {
                    Some(v) => f(HfSlice::F32(v)),
                    None => f(Self::into_hf_values(t.clone(), linear)?.as_slice()),
                }
            }
            _ => f(Self::into_hf_values(t.clone(), linear)?.as_slice()),
        }
        Ok(())
    }

    /// The values become the tensor's buffer without a copy: a linear weight as
    /// [`WeightStorage::decode_weight`] holds it (bf16 bits stay 16 bits), anything else row-major.
    fn from_hf_values<const D: usize>(
        values: HfValues,
        hf_shape: &[usize],
        linear: bool,
        device: &Self::Device,
    ) -> Tensor<Self, D> {
        let primitive = match (values, linear && D == 2) {
            (HfValues::Bf16(bits), true) => {
                NdArrayTensor::from(stored(bits, [hf_shape[0], hf_shape[1]]))
            }
            (HfValues::F32(v), true) => {
                let t = Self::decode_weight(v, [hf_shape[0], hf_shape[1]], device);
                return Tensor::from_primitive(t.into_primitive());
            }
            (values, false) => NdArrayTensor::from(
                ArcArray::from_shape_vec(IxDyn(hf_shape), values.into_f32())
                    .unwrap_or_else(|e| unreachable!("values sized to their shape: {e}")),
            ),
        };
        Tensor::from_primitive(TensorPrimitive::Float(primitive))
    }
}

#[cfg(feature = "flex")]
impl WeightStorage for burn::backend::Flex {
    const HOST_MEMORY: bool = true;
}

impl<B: WeightStorage, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    WeightStorage for burn::backend::Autodiff<B, C>
{
    const HOST_MEMORY: bool = B::HOST_MEMORY;
}

/// CubeCL's CUDA runtime keeps tensors in the primary context's memory, where NCCL (on the
/// same context, `collective::Nccl`) reads and writes them.
#[cfg(feature = "cuda")]
impl WeightStorage for burn::backend::Cuda {
    fn cuda_address(t: &Tensor<Self, 1>) -> Option<u64> {
        let t = t.clone().into_primitive().tensor();
        if !t.is_contiguous() {
            return None;
        }
        let held = t.client.get_resource(t.handle.clone()).ok()?;
        let r = held.resource();
        let bytes = (t.meta.shape().num_elements() * t.dtype.size()) as u64;
        (t.dtype == burn::tensor::DType::F32 && r.size >= bytes).then_some(r.ptr)
    }
}
#[cfg(feature = "wgpu")]
impl WeightStorage for burn::backend::Wgpu {}

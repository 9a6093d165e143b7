//! AdamW as one pass over each parameter's bytes, in place.
//!
//! burn's `AdamW` builds each update from a dozen whole-tensor operations, each of which
//! allocates and writes a new tensor: at 0.5B parameters that is tens of gigabytes of
//! memory traffic and page faults per step (BENCHMARKS.md). [`FusedAdamW`] computes the
//! same update (same formulas, same defaults, same order of floating-point operations
//! within an element) in one loop over parameter, gradient and both moments, split over
//! the CPU's cores, reusing the buffers it is handed: the parameter, the gradient and the
//! moments are taken out of their tensors without a copy when nothing else holds them.
//! Its state is burn's [`AdamWState`], so optimizer records keep their format.
//!
//! Gradient clipping is folded in: [`GradScaleHandle::set`] sets a factor that the next
//! step multiplies every gradient by as it reads it.
//!
//! That pass, like [`SquaredNorm`]'s, is for tensors in host memory
//! ([`WeightStorage::HOST_MEMORY`](crate::model::WeightStorage::HOST_MEMORY)). On a device the same update runs as tensor operations there,
//! so a step moves no parameter, gradient or moment across to the host
//! (`tests/integration/transfers.rs` bounds what does cross).

use crate::model::Kernels;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState};
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use rayon::prelude::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// Elements per parallel task: large enough that scheduling is noise.
const CHUNK: usize = 1 << 16;

/// AdamW with burn's defaults (β₁ 0.9, β₂ 0.999, ε 1e-5) and decoupled weight decay.
#[derive(Clone, Debug)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// f32 bits of the factor gradients are multiplied by (1 unless clipping).
    grad_scale: Arc<AtomicU32>,
}

impl FusedAdamW {
    pub fn new(weight_decay: f32) -> Self {
        FusedAdamW {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay,
            grad_scale: Arc::new(AtomicU32::new(1f32.to_bits())),
        }
    }

    /// The optimizer for a module, as burn's optimizer API drives it.
    pub fn adaptor<M, B>(self) -> OptimizerAdaptor<Self, M, B>
    where
        M: burn::module::AutodiffModule<B>,
        B: AutodiffBackend,
        B::InnerBackend: Kernels,
    {
        OptimizerAdaptor::from(self)
    }

    /// A handle that sets the factor the next steps multiply gradients by.
    pub fn grad_scale_handle(&self) -> GradScaleHandle {
        GradScaleHandle(self.grad_scale.clone())
    }

    fn grad_scale(&self) -> f32 {
        f32::from_bits(self.grad_scale.load(Ordering::Relaxed))
    }
}

/// Sets the gradient factor of a [`FusedAdamW`] (held inside burn's adaptor).
#[derive(Clone, Debug)]
pub struct GradScaleHandle(Arc<AtomicU32>);

impl GradScaleHandle {
    pub fn set(&self, factor: f32) {
        self.0.store(factor.to_bits(), Ordering::Relaxed);
    }
}

/// A tensor's values as f32, reusing its buffer where possible.
pub(super) fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    let data = t.into_data();
    match data.dtype {
        burn::tensor::DType::F32 => data.into_vec::<f32>(),
        _ => data.convert::<f32>().into_vec::<f32>(),
    }
    .unwrap_or_else(|e| panic!("an optimizer tensor did not convert to f32: {e:?}"))
}

/// The sum of squares of `g`'s values, handing the tensor back rebuilt around the same
/// buffer (no copy when nothing else holds it).
fn host_sum_squares<B: Backend, const D: usize>(g: Tensor<B, D>) -> (f64, Tensor<B, D>) {
    let (shape, device) = (g.shape(), g.device());
    let v = values(g);
    let sum = sum_squares(&v);
    (sum, Tensor::from_data(TensorData::new(v, shape), &device))
}

/// The sum of squares of `v` in f64: each chunk's sum in parallel, then the chunks in
/// order. A parallel reduction would add them in an order that depends on scheduling, and
/// the clipping factor (and so the weights) would change in the last bits from run to run.
pub(super) fn sum_squares(v: &[f32]) -> f64 {
    let chunks: Vec<f64> = v
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
        .collect();
    chunks.iter().sum()
}

/// The squared global L2 norm of a step's gradients, added one gradient at a time: on the
/// host in f64 and a fixed order ([`WeightStorage::HOST_MEMORY`](crate::model::WeightStorage::HOST_MEMORY)), on a device as one running
/// scalar there, read once by [`SquaredNorm::total`].
pub struct SquaredNorm<B: Backend> {
    host: f64,
    device: Option<Tensor<B, 1>>,
}

impl<B: Kernels> Default for SquaredNorm<B> {
    fn default() -> Self {
        SquaredNorm {
            host: 0.0,
            device: None,
        }
    }
}

impl<B: Kernels> SquaredNorm<B> {
    /// Adds the squares of `g`'s values, handing `g` back.
    pub fn add<const D: usize>(&mut self, g: Tensor<B, D>) -> Tensor<B, D> {
        if B::HOST_MEMORY {
            let (sum, g) = host_sum_squares(g);
            self.host += sum;
            return g;
        }
        let sum = g.clone().square().sum();
        self.device = Some(match self.device.take() {
            Some(total) => total + sum,
            None => sum,
        });
        g
    }

    /// The sum of squares of everything added.
    pub fn total(self) -> f64 {
        let device = self.device.map_or(0.0, |t| t.into_scalar().elem::<f64>());
        self.host + device
    }
}

/// The step's factors: bias corrections, learning rate, weight-decay factor and gradient
/// factor.
struct Factors {
    c1: f32,
    c2: f32,
    lr: f32,
    keep: f32,
    scale: f32,
}

impl FusedAdamW {
    fn factors(&self, time: usize, lr: LearningRate, scale: f32) -> Factors {
        Factors {
            c1: 1f32 - self.beta_1.powi(time as i32),
            c2: 1f32 - self.beta_2.powi(time as i32),
            lr: lr as f32,
            keep: (1.0 - lr * f64::from(self.weight_decay)) as f32,
            scale,
        }
    }

    /// The update of host values `p` from the gradient `g` (times `scale`) and the moments
    /// `m` and `v`, at update `time` (from 1) of these values, in place and split over the
    /// cores: what [`FusedAdamW::host_step`] does to a tensor, here to any run of values
    /// (sharded state updates its range with it, so its bits are one trainer's).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pass(
        &self,
        time: usize,
        lr: LearningRate,
        scale: f32,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let (b1, b2, eps) = (self.beta_1, self.beta_2, self.epsilon);
        let (f1, f2) = (1.0 - b1, 1.0 - b2);
        let Factors {
            c1,
            c2,
            lr: lr32,
            keep,
            scale,
        } = self.factors(time, lr, scale);
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                for i in 0..p.len() {
                    let g = g[i] * scale;
                    m[i] = m[i] * b1 + g * f1;
                    v[i] = v[i] * b2 + (g * g) * f2;
                    let delta = (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
                    p[i] = p[i] * keep - delta * lr32;
                }
            });
    }

    /// The update as one pass over host buffers, split over the cores.
    fn host_step<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<AdamWState<B, D>>,
    ) -> (Tensor<B, D>, Option<AdamWState<B, D>>) {
        let (shape, device) = (tensor.shape(), tensor.device());
        let n = shape.num_elements();
        let (time, m, v) = match state {
            Some(s) => (
                s.momentum.time + 1,
                values(s.momentum.moment_1),
                values(s.momentum.moment_2),
            ),
            None => (1, vec![0f32; n], vec![0f32; n]),
        };
        let (mut p, g, mut m, mut v) = (values(tensor), values(grad), m, v);
        self.pass(time, lr, self.grad_scale(), &mut p, &g, &mut m, &mut v);
        let tensor =
            |x: Vec<f32>| Tensor::<B, D>::from_data(TensorData::new(x, shape.clone()), &device);
        let state = AdamWState {
            momentum: AdaptiveMomentumState::new(time, tensor(m), tensor(v)),
        };
        (tensor(p), Some(state))
    }

    /// The same update in tensor operations on the tensors' device: nothing crosses to
    /// the host. Each element goes through the same operations in the same order as in
    /// [`FusedAdamW::host_step`].
    fn device_step<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<AdamWState<B, D>>,
    ) -> (Tensor<B, D>, Option<AdamWState<B, D>>) {
        let (time, m, v) = match state {
            Some(s) => (
                s.momentum.time + 1,
                s.momentum.moment_1,
                s.momentum.moment_2,
            ),
            None => (1, tensor.zeros_like(), tensor.zeros_like()),
        };
        let (b1, b2, eps) = (self.beta_1, self.beta_2, self.epsilon);
        let f = self.factors(time, lr, self.grad_scale());
        // A factor of 1 (no clipping this step, no weight decay) is left out: x · 1 is x,
        // and each operation here is a kernel launch per parameter on a GPU.
        let by = |t: Tensor<B, D>, factor: f32| {
            if factor == 1.0 {
                t
            } else {
                t.mul_scalar(factor)
            }
        };
        let g = by(grad, f.scale);
        let m = m.mul_scalar(b1) + g.clone().mul_scalar(1.0 - b1);
        let v = v.mul_scalar(b2) + (g.clone() * g).mul_scalar(1.0 - b2);
        let delta =
            m.clone().div_scalar(f.c1) / (v.clone().div_scalar(f.c2).sqrt().add_scalar(eps));
        let p = by(tensor, f.keep) - delta.mul_scalar(f.lr);
        let state = AdamWState {
            momentum: AdaptiveMomentumState::new(time, m, v),
        };
        (p, Some(state))
    }
}

impl<B: Kernels> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        if B::HOST_MEMORY {
            self.host_step(lr, tensor, grad, state)
        } else {
            self.device_step(lr, tensor, grad, state)
        }
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.momentum.moment_1 = state.momentum.moment_1.to_device(device);
        state.momentum.moment_2 = state.momentum.moment_2.to_device(device);
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::counted::Counted;
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};

    /// Three steps of the fused update against burn's AdamW on the same model and data,
    /// through burn's optimizer API as the trainer drives it: the largest difference in a
    /// weight, and how far the weights moved.
    fn against_burns<B: Kernels>() -> (f32, f32) {
        type AB<B> = Autodiff<B>;
        let device = Default::default();
        // Parameters made from data: a freshly configured module initialises lazily, and
        // each clone would draw its own values.
        let values = |n: usize, k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * k % 101) as f32 - 50.0) / 200.0)
                .collect()
        };
        let start = Linear::<AB<B>> {
            weight: Param::from_tensor(Tensor::from_data(
                TensorData::new(values(300, 37), [15, 20]),
                &device,
            )),
            bias: Some(Param::from_tensor(Tensor::from_data(
                TensorData::new(values(20, 11), [20]),
                &device,
            ))),
        };
        let (mut a, mut b) = (start.clone(), start.clone());
        let mut burns = AdamWConfig::new()
            .with_weight_decay(0.01)
            .init::<AB<B>, Linear<AB<B>>>();
        let mut fused = FusedAdamW::new(0.01).adaptor::<Linear<AB<B>>, AB<B>>();
        for step in 0..3 {
            let x: Vec<f32> = (0..60)
                .map(|i| (((i * 13 + step * 7) % 29) as f32 - 14.0) / 9.0)
                .collect();
            let x = Tensor::<AB<B>, 2>::from_data(TensorData::new(x, [4, 15]), &device);
            let grads = |m: &Linear<AB<B>>| {
                let loss = m.forward(x.clone()).powf_scalar(2.0).sum();
                GradientsParams::from_grads(loss.backward(), m)
            };
            let (ga, gb) = (grads(&a), grads(&b));
            a = burns.step(1e-2, a, ga);
            b = fused.step(1e-2, b, gb);
        }
        let flat = |m: &Linear<AB<B>>| super::values(m.weight.val().inner());
        let (wa, wb, w0) = (flat(&a), flat(&b), flat(&start));
        let most = |x: &[f32], y: &[f32]| {
            x.iter()
                .zip(y)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        (most(&wa, &wb), most(&wa, &w0))
    }

    #[test]
    fn matches_burns_adamw_on_the_host() {
        let (worst, moved) = against_burns::<NdArray>();
        assert!(worst < 1e-6, "fused AdamW differs from burn's by {worst}");
        assert!(moved > 1e-3, "the parameters should move ({moved})");
    }

    /// The device path (tensor operations), taken by a backend that is not host memory.
    #[test]
    fn matches_burns_adamw_on_a_device() {
        let (worst, moved) = against_burns::<Counted<NdArray>>();
        assert!(
            worst < 1e-6,
            "AdamW on the device differs from burn's by {worst}"
        );
        assert!(moved > 1e-3, "the parameters should move ({moved})");
    }

    fn scaled_moment<B: Kernels>() -> (Vec<f32>, Vec<f32>) {
        let device = Default::default();
        let fused = FusedAdamW::new(0.0);
        let p = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32; 4], [4]), &device);
        let g = Tensor::<B, 1>::from_data(TensorData::new(vec![2.0f32; 4], [4]), &device);
        let (_, s1) = fused.step(1e-3, p.clone(), g.clone(), None);
        fused.grad_scale_handle().set(0.5);
        let (_, s2) = fused.step(1e-3, p, g, None);
        let m1 = values(s1.map(|s| s.momentum.moment_1).expect("state"));
        let m2 = values(s2.map(|s| s.momentum.moment_1).expect("state"));
        (m1, m2)
    }

    #[test]
    fn grad_scale_scales_the_gradient() {
        for (m1, m2) in [
            scaled_moment::<NdArray>(),
            scaled_moment::<Counted<NdArray>>(),
        ] {
            assert!(
                (m1[0] - 0.2).abs() < 1e-7 && (m2[0] - 0.1).abs() < 1e-7,
                "{m1:?} {m2:?}"
            );
        }
    }

    fn squared_norm<B: Kernels>() -> (f64, Vec<f32>) {
        let device = Default::default();
        let g = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32, -2.0, 3.0], [3]), &device);
        let h = Tensor::<B, 2>::from_data(TensorData::new(vec![0.5f32; 4], [2, 2]), &device);
        let mut norm = SquaredNorm::<B>::default();
        let back = norm.add(g);
        let _ = norm.add(h);
        (norm.total(), values(back))
    }

    #[test]
    fn squared_norm_adds_every_gradient_and_keeps_them() {
        for (s, back) in [
            squared_norm::<NdArray>(),
            squared_norm::<Counted<NdArray>>(),
        ] {
            assert_eq!(s, 15.0);
            assert_eq!(back, vec![1.0, -2.0, 3.0]);
        }
    }
}

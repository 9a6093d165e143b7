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
//! Gradient clipping is folded in: [`FusedAdamW::scale_gradients`] sets a factor that the
//! next step multiplies every gradient by as it reads it.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState};
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
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
fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    let data = t.into_data();
    match data.dtype {
        burn::tensor::DType::F32 => data.into_vec::<f32>(),
        _ => data.convert::<f32>().into_vec::<f32>(),
    }
    .unwrap_or_else(|e| panic!("an optimizer tensor did not convert to f32: {e:?}"))
}

/// The sum of squares of `g`'s values, handing the tensor back rebuilt around the same
/// buffer (no copy when nothing else holds it).
pub fn sum_squares<B: Backend, const D: usize>(g: Tensor<B, D>) -> (f64, Tensor<B, D>) {
    let (shape, device) = (g.shape(), g.device());
    let v = values(g);
    // Each chunk's sum in parallel, then the chunks in order: a parallel reduction would
    // add them in an order that depends on scheduling, and the clipping factor (and so the
    // weights) would change in the last bits from run to run.
    let chunks: Vec<f64> = v
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
        .collect();
    let sum = chunks.iter().sum();
    (sum, Tensor::from_data(TensorData::new(v, shape), &device))
}

impl<B: Backend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
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
        let (b1, b2, eps) = (self.beta_1, self.beta_2, self.epsilon);
        let (f1, f2) = (1.0 - b1, 1.0 - b2);
        let c1 = 1f32 - b1.powi(time as i32);
        let c2 = 1f32 - b2.powi(time as i32);
        let lr32 = lr as f32;
        let keep = (1.0 - lr * f64::from(self.weight_decay)) as f32;
        let scale = self.grad_scale();
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
        let tensor =
            |x: Vec<f32>| Tensor::<B, D>::from_data(TensorData::new(x, shape.clone()), &device);
        let state = AdamWState {
            momentum: AdaptiveMomentumState::new(time, tensor(m), tensor(v)),
        };
        (tensor(p), Some(state))
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
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};

    type B = NdArray;

    /// Three steps of the fused update against burn's AdamW on the same model and data,
    /// through burn's optimizer API as the trainer drives it.
    #[test]
    fn matches_burns_adamw() {
        type AB = Autodiff<B>;
        let device = Default::default();
        // Parameters made from data: a freshly configured module initialises lazily, and
        // each clone would draw its own values.
        let values = |n: usize, k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * k % 101) as f32 - 50.0) / 200.0)
                .collect()
        };
        let start = Linear::<AB> {
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
            .init::<AB, Linear<AB>>();
        let mut fused = FusedAdamW::new(0.01).adaptor::<Linear<AB>, AB>();
        for step in 0..3 {
            let x: Vec<f32> = (0..60)
                .map(|i| (((i * 13 + step * 7) % 29) as f32 - 14.0) / 9.0)
                .collect();
            let x = Tensor::<AB, 2>::from_data(TensorData::new(x, [4, 15]), &device);
            let grads = |m: &Linear<AB>| {
                let loss = m.forward(x.clone()).powf_scalar(2.0).sum();
                GradientsParams::from_grads(loss.backward(), m)
            };
            let (ga, gb) = (grads(&a), grads(&b));
            a = burns.step(1e-2, a, ga);
            b = fused.step(1e-2, b, gb);
        }
        let flat = |m: &Linear<AB>| super::values(m.weight.val().inner());
        let (wa, wb, w0) = (flat(&a), flat(&b), flat(&start));
        let worst = wa
            .iter()
            .zip(&wb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "fused AdamW differs from burn's by {worst}");
        let moved = wa
            .iter()
            .zip(&w0)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(moved > 1e-3, "the parameters should move ({moved})");
    }

    #[test]
    fn grad_scale_scales_the_gradient() {
        let device = Default::default();
        let fused = FusedAdamW::new(0.0);
        let p = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32; 4], [4]), &device);
        let g = Tensor::<B, 1>::from_data(TensorData::new(vec![2.0f32; 4], [4]), &device);
        let (_, s1) = fused.step(1e-3, p.clone(), g.clone(), None);
        fused.grad_scale_handle().set(0.5);
        let (_, s2) = fused.step(1e-3, p, g, None);
        let m1 = values(s1.map(|s| s.momentum.moment_1).expect("state"));
        let m2 = values(s2.map(|s| s.momentum.moment_1).expect("state"));
        assert!(
            (m1[0] - 0.2).abs() < 1e-7 && (m2[0] - 0.1).abs() < 1e-7,
            "{m1:?} {m2:?}"
        );
    }

    #[test]
    fn sum_squares_keeps_the_tensor() {
        let device = Default::default();
        let g = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32, -2.0, 3.0], [3]), &device);
        let (s, back) = sum_squares(g);
        assert_eq!(s, 14.0);
        assert_eq!(values(back), vec![1.0, -2.0, 3.0]);
    }
}

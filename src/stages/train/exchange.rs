//! The all-reduce of unsharded trainer ranks with the gradients left on the backend's
//! device (`train.grad_buffers`): each parameter's gradient flattened, the buckets
//! concatenated on the device and summed in place by
//! [`Collective::all_reduce_device`] (NCCL on the `cuda` build's memory, with no copy;
//! MPI through the host, one bucket at a time), the sums sliced back to each parameter's
//! shape. The host path (`Trainer::all_reduce`) instead copies every gradient to the host
//! and back, which on a GPU is all of a step's gradient bytes twice over PCIe.
//!
//! The buckets and their order are the host path's ([`collective::bucket_runs`]), so both
//! paths sum the same values in the same calls and end with the same bits.

use crate::collective::{self, Collective, DeviceBuffer, ReduceDtype};
use crate::model::{ModelError, Policy, WeightStorage};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

/// A bucket of gradients on the backend's device, as a collective's [`DeviceBuffer`].
pub struct Bucket<B: Backend> {
    values: Tensor<B, 1>,
}

impl<B: Backend> Bucket<B> {
    pub fn new(values: Tensor<B, 1>) -> Self {
        Bucket { values }
    }

    /// The values, summed once the collective returned.
    pub fn into_values(self) -> Tensor<B, 1> {
        self.values
    }
}

impl<B: WeightStorage> DeviceBuffer for Bucket<B> {
    fn len(&self) -> usize {
        self.values.dims()[0]
    }

    fn cuda_address(&mut self) -> Option<u64> {
        let address = B::cuda_address(&self.values)?;
        // NCCL runs on its own stream: the kernels that wrote the bucket finish first.
        B::sync(&self.values.device()).ok()?;
        Some(address)
    }

    fn read(&mut self) -> Result<Vec<f32>, String> {
        crate::model::host_f32(self.values.clone().into_data()).map_err(|e| e.to_string())
    }

    fn write(&mut self, values: Vec<f32>) {
        let n = values.len();
        self.values = Tensor::from_data(TensorData::new(values, [n]), &self.values.device());
    }
}

/// Sums `grads` over the ranks of `c` on the device, in buckets of `bucket_values` values:
/// `has` says, per parameter in visiting order, whether any rank has its gradient (a rank
/// without one adds zeros). `what` names the calls in errors.
pub fn all_reduce_on_device<B>(
    model: &Policy<B>,
    grads: &mut GradientsParams,
    has: &[f32],
    c: &mut dyn Collective,
    what: &str,
    dtype: ReduceDtype,
    bucket_values: usize,
) -> Result<(), ModelError>
where
    B: AutodiffBackend<InnerBackend: WeightStorage>,
{
    let mut take = TakeFlat::<B::InnerBackend> {
        grads,
        has: has.iter(),
        pieces: Vec::new(),
    };
    model.visit(&mut take);
    let lens: Vec<usize> = take.pieces.iter().map(|p| p.dims()[0]).collect();
    let mut pieces: Vec<Option<Tensor<B::InnerBackend, 1>>> =
        take.pieces.into_iter().map(Some).collect();
    let mut summed: Vec<Vec<Tensor<B::InnerBackend, 1>>> = vec![Vec::new(); lens.len()];
    let buckets = collective::bucket_runs(&lens, bucket_values);
    tracing::debug!(
        buckets = buckets.len(),
        values = lens.iter().sum::<usize>(),
        "{what}: gradients summed in buckets on the device"
    );
    for (k, runs) in buckets.into_iter().enumerate() {
        let mut parts = Vec::with_capacity(runs.len());
        for &(i, off, len) in &runs {
            // The last run of a piece takes it: its memory goes with the bucket.
            let piece = if off + len == lens[i] {
                pieces[i].take()
            } else {
                pieces[i].clone()
            };
            let piece = piece.ok_or_else(|| {
                ModelError::Unsupported(format!("{what}: gradient {i} taken twice"))
            })?;
            parts.push(if len == lens[i] {
                piece
            } else {
                piece.slice(off..off + len)
            });
        }
        let values = match parts.len() {
            1 => parts.remove(0),
            _ => Tensor::cat(parts, 0),
        };
        let mut bucket = Bucket { values };
        let call = format!("{what} (bucket {})", k + 1);
        c.all_reduce_device(&call, &mut bucket, dtype)
            .map_err(|e| ModelError::Unsupported(e.to_string()))?;
        let mut at = 0;
        for (i, _, len) in runs {
            summed[i].push(if len == bucket.len() {
                bucket.values.clone()
            } else {
                bucket.values.clone().slice(at..at + len)
            });
            at += len;
        }
    }
    let mut put = PutFlat {
        grads,
        has: has.iter(),
        pieces: summed.into_iter().map(|mut parts| match parts.len() {
            1 => parts.remove(0),
            _ => Tensor::cat(parts, 0),
        }),
    };
    model.visit(&mut put);
    Ok(())
}

/// The gradients of the parameters some rank has one for, taken out of `grads` flattened
/// (zeros where this rank has none), in visiting order.
struct TakeFlat<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    has: std::slice::Iter<'a, f32>,
    pieces: Vec<Tensor<I, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeFlat<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.has.next().is_some_and(|&h| h > 0.0) {
            return;
        }
        let n = param.shape().num_elements();
        let piece = match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => g.reshape([n]),
            None => Tensor::zeros([n], &param.device()),
        };
        self.pieces.push(piece);
    }
}

/// The summed gradients handed back to `grads` in their parameters' shapes.
struct PutFlat<'a, P> {
    grads: &'a mut GradientsParams,
    has: std::slice::Iter<'a, f32>,
    pieces: P,
}

impl<B: AutodiffBackend, P: Iterator<Item = Tensor<B::InnerBackend, 1>>> ModuleVisitor<B>
    for PutFlat<'_, P>
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.has.next().is_some_and(|&h| h > 0.0) {
            return;
        }
        if let Some(piece) = self.pieces.next() {
            let g = piece.reshape(param.shape().dims::<D>());
            self.grads.register::<B::InnerBackend, D>(param.id, g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Solo;
    use crate::model::counted::Counted;
    use crate::model::{Architecture, ModelConfig};
    use burn::backend::{Autodiff, NdArray};

    type Train = Autodiff<Counted<NdArray>>;

    /// One rank alone sums nothing: the gradients come back with their bits, through
    /// buckets of 1,000 values that split most parameters and share others, and a
    /// parameter this rank has no gradient for comes back as zeros (another rank has one);
    /// on the checked backend (no operation over zero elements).
    #[test]
    fn gradients_come_back_whole_through_device_buckets() {
        let cfg = ModelConfig::tiny(Architecture::Qwen2, 40);
        let model = Policy::<Train>::random(&cfg, 3, &Default::default()).expect("model");
        let tokens =
            Tensor::<Train, 2, burn::tensor::Int>::from_data([[1, 5, 9, 2]], &Default::default());
        let loss = model.forward(tokens).powf_scalar(2.0).mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let mut before = Vec::new();
        model.visit(&mut Gather {
            grads: &mut grads,
            values: &mut before,
            drop_first: true,
        });
        assert!(before.iter().all(Option::is_some));
        let has = vec![1.0; before.len()];
        let mut solo = Solo::default();
        all_reduce_on_device(
            &model,
            &mut grads,
            &has,
            &mut solo,
            "test",
            ReduceDtype::F32,
            1000,
        )
        .expect("exchange");
        let mut after = Vec::new();
        model.visit(&mut Gather {
            grads: &mut grads,
            values: &mut after,
            drop_first: false,
        });
        let zeros = before[0].as_ref().map(|v| vec![0.0; v.len()]);
        assert_eq!(after[0], zeros, "no gradient on this rank: zeros");
        assert_eq!(&after[1..], &before[1..]);
        let values: usize = before.iter().flatten().map(Vec::len).sum();
        assert!(values > 10_000, "{values}");
    }

    /// Each parameter's gradient, read to the host; with `drop_first`, the first one is
    /// removed from `grads` after it is read.
    struct Gather<'a> {
        grads: &'a mut GradientsParams,
        values: &'a mut Vec<Option<Vec<f32>>>,
        drop_first: bool,
    }

    impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let g = self.grads.get::<B::InnerBackend, D>(param.id);
            if self.drop_first && self.values.is_empty() {
                self.grads.remove::<B::InnerBackend, D>(param.id);
            }
            self.values
                .push(g.map(|g| g.into_data().to_vec::<f32>().expect("f32")));
        }
    }
}

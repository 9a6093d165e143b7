//! Each weight packed once per training step rather than once per forward: a step runs
//! the same weights through every micro-batch's forward, and the output head through every
//! chunk of rows ([`super::head`]) forward and again in its backward, and packing a weight
//! for the many-rows tiles ([`PackedWeight`]) copies all of it (at Qwen's vocabulary the
//! head alone is 545 MB). While a [`PackOnce`] is open, the NdArray kernels keep each f32
//! weight's packing, keyed by the weight's buffer, which the entry holds so that no other
//! tensor can take its address; the last `PackOnce` to close drops them all.
//!
//! What it costs: one packed copy of every weight the open passes multiply by (the
//! model's linear weights, about its size), until the step's gradients are taken.

use super::rows::PackedWeight;
use ndarray::{ArcArray, IxDyn};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A buffer by address, shape and strides: the same buffer read as another view is another
/// packing.
type Key = (usize, Vec<usize>, Vec<isize>);

#[derive(Default)]
struct Cache {
    open: usize,
    entries: HashMap<Key, (ArcArray<f32, IxDyn>, Arc<PackedWeight>)>,
}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

/// Packings kept since the process started.
static KEPT: AtomicUsize = AtomicUsize::new(0);

fn cache() -> MutexGuard<'static, Option<Cache>> {
    // A panic while the lock was held leaves a map that is still consistent.
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// While open, each f32 weight is packed for the CPU's tiles once (see the module).
#[must_use = "weights stay packed only while the guard lives"]
pub struct PackOnce(());

impl PackOnce {
    /// Opens a scope (they nest, and may overlap across threads).
    pub fn open() -> PackOnce {
        cache().get_or_insert_with(Cache::default).open += 1;
        PackOnce(())
    }

    /// How many weights are packed now.
    pub fn packed_weights() -> usize {
        cache().as_ref().map_or(0, |c| c.entries.len())
    }

    /// How many packings have been kept since the process started (each weight of each
    /// step once, when the scopes work).
    pub fn packings_kept() -> usize {
        KEPT.load(Ordering::Relaxed)
    }
}

impl Drop for PackOnce {
    fn drop(&mut self) {
        let mut guard = cache();
        if let Some(c) = guard.as_mut() {
            c.open -= 1;
            if c.open == 0 {
                *guard = None;
            }
        }
    }
}

/// `weight`'s packing while a [`PackOnce`] is open: the kept one, or `make`'s, kept;
/// `None` when none is open or `make` gives none. `make` runs outside the lock (it may use
/// rayon), so two threads may both pack a weight; one packing is kept.
pub(super) fn packed(
    weight: &ArcArray<f32, IxDyn>,
    make: impl FnOnce() -> Option<PackedWeight>,
) -> Option<Arc<PackedWeight>> {
    let key = (
        weight.as_ptr() as usize,
        weight.shape().to_vec(),
        weight.strides().to_vec(),
    );
    if let Some(c) = cache().as_ref() {
        if let Some((_, p)) = c.entries.get(&key) {
            return Some(p.clone());
        }
    } else {
        return None;
    }
    let p = Arc::new(make()?);
    let mut guard = cache();
    let c = guard.as_mut()?;
    let (_, kept) = c.entries.entry(key).or_insert_with(|| {
        KEPT.fetch_add(1, Ordering::Relaxed);
        (weight.clone(), p)
    });
    Some(kept.clone())
}

#[cfg(test)]
mod tests {
    use super::PackOnce;
    use crate::model::kernels::Kernels;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tensor};

    /// A kept packing gives the bits of packing each call, for a row-major weight and for a
    /// transposed view of one (a tied head), and is kept while a scope is open.
    #[test]
    fn kept_packings_give_the_bits_of_fresh_ones() {
        let device = Default::default();
        let x = Tensor::<NdArray, 2>::random([70, 40], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<NdArray, 2>::random([40, 33], Distribution::Normal(0.0, 1.0), &device);
        let e = Tensor::<NdArray, 2>::random([33, 40], Distribution::Normal(0.0, 1.0), &device);
        for weight in [w.clone(), e.clone().transpose()] {
            let fresh = NdArray::linear_rows(x.clone(), weight.clone(), None).into_data();
            let scope = PackOnce::open();
            let first = NdArray::linear_rows(x.clone(), weight.clone(), None).into_data();
            assert!(
                PackOnce::packed_weights() >= 1,
                "the weight's packing is kept"
            );
            let again = NdArray::linear_rows(x.clone(), weight.clone(), None).into_data();
            drop(scope);
            let bits = |d: &burn::tensor::TensorData| -> Vec<u32> {
                d.as_slice::<f32>()
                    .expect("f32")
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(&fresh), bits(&first));
            assert_eq!(bits(&fresh), bits(&again));
        }
    }
}

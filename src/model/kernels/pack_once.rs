//! Each weight packed once per training step rather than once per forward: a step runs
//! the same weights through every micro-batch's forward, and the output head through every
//! chunk of rows ([`super::head`]) forward and again in its backward, and packing a weight
//! for the many-rows tiles ([`PackedWeight`]) copies all of it (at Qwen's vocabulary the
//! head alone is 545 MB). While a [`PackOnce`] is open on a thread, the NdArray kernels
//! called from that thread keep each f32 weight's packing, keyed by the weight's buffer,
//! which the entry holds so that no other tensor can take its address; the last `PackOnce`
//! of the thread to close drops them all. Other threads (a generator in the same process)
//! keep packing per call.
//!
//! What it costs: one packed copy of every weight the open passes multiply by (the
//! model's linear weights, about its size), until the step's gradients are taken.

use super::rows::PackedWeight;
use ndarray::{ArcArray, IxDyn};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A buffer by address, shape and strides: the same buffer read as another view is another
/// packing.
type Key = (usize, Vec<usize>, Vec<isize>);

#[derive(Default)]
struct Cache {
    open: usize,
    entries: HashMap<Key, (ArcArray<f32, IxDyn>, Rc<PackedWeight>)>,
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::default();
}

/// Packings kept since the process started, on every thread.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// While open, each f32 weight that this thread multiplies by is packed for the CPU's tiles
/// once (see the module).
#[must_use = "weights stay packed only while the guard lives"]
pub struct PackOnce(std::marker::PhantomData<Rc<()>>);

impl PackOnce {
    /// Opens a scope on this thread (they nest).
    pub fn open() -> PackOnce {
        CACHE.with_borrow_mut(|c| c.open += 1);
        PackOnce(std::marker::PhantomData)
    }

    /// How many weights this thread holds packed now.
    pub fn packed_weights() -> usize {
        CACHE.with_borrow(|c| c.entries.len())
    }

    /// How many packings have been kept since the process started (each weight of each
    /// step once, when the scopes work).
    pub fn packings_kept() -> usize {
        KEPT.load(Ordering::Relaxed)
    }
}

impl Drop for PackOnce {
    fn drop(&mut self) {
        let dropped = CACHE.with_borrow_mut(|c| {
            c.open -= 1;
            (c.open == 0).then(|| std::mem::take(&mut c.entries))
        });
        // Freed outside the borrow.
        drop(dropped);
    }
}

/// `weight`'s packing while a [`PackOnce`] is open on this thread: the kept one, or
/// `make`'s, kept; `None` when none is open or `make` gives none.
pub(super) fn packed(
    weight: &ArcArray<f32, IxDyn>,
    make: impl FnOnce() -> Option<PackedWeight>,
) -> Option<Rc<PackedWeight>> {
    if CACHE.with_borrow(|c| c.open == 0) {
        return None;
    }
    let key = (
        weight.as_ptr() as usize,
        weight.shape().to_vec(),
        weight.strides().to_vec(),
    );
    if let Some(p) = CACHE.with_borrow(|c| c.entries.get(&key).map(|(_, p)| p.clone())) {
        return Some(p);
    }
    // Packed outside the borrow (it runs on rayon's pool).
    let p = Rc::new(make()?);
    CACHE.with_borrow_mut(|c| c.entries.insert(key, (weight.clone(), p.clone())));
    KEPT.fetch_add(1, Ordering::Relaxed);
    Some(p)
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

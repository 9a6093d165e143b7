//! The generator's model slot: the versioned model the decode loop loads once per forward
//! pass, swapped atomically by the follower, with waiters woken by each swap.

use crate::model::Policy;
use arc_swap::ArcSwap;
use burn::tensor::backend::Backend;
use std::sync::{Arc, Mutex};

/// A model with the version it was built from.
pub struct Versioned<B: Backend> {
    pub version: u64,
    pub policy: Policy<B>,
}

/// The slot the decode loop reads its model from: one atomic load per forward pass. Cloning
/// shares the slot. Waiters for a version ([`ModelSlot::reached`]) are woken by each swap.
pub struct ModelSlot<B: Backend> {
    model: Arc<ArcSwap<Versioned<B>>>,
    version: Arc<tokio::sync::watch::Sender<u64>>,
    /// The pristine base adapter versions apply to, until a follower takes it.
    base: Arc<Mutex<Option<Policy<B>>>>,
}

impl<B: Backend> Clone for ModelSlot<B> {
    fn clone(&self) -> Self {
        ModelSlot {
            model: self.model.clone(),
            version: self.version.clone(),
            base: self.base.clone(),
        }
    }
}

impl<B: Backend> ModelSlot<B> {
    /// A slot starting at `model`, which is also the base adapter versions apply to.
    pub fn new(model: Versioned<B>) -> Self {
        let base = model.policy.without_adapter();
        Self::with_base(model, base)
    }

    /// A slot starting at `model` (e.g. a base with a starting adapter merged in) whose
    /// adapter versions apply to `base`.
    pub fn with_base(model: Versioned<B>, base: Policy<B>) -> Self {
        let version = tokio::sync::watch::Sender::new(model.version);
        ModelSlot {
            model: Arc::new(ArcSwap::from_pointee(model)),
            version: Arc::new(version),
            base: Arc::new(Mutex::new(Some(base))),
        }
    }

    /// Takes the base out of the slot (the follower keeps it).
    pub(crate) fn take_base(&self) -> Option<Policy<B>> {
        self.base.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// The current model.
    pub fn load(&self) -> Arc<Versioned<B>> {
        self.model.load_full()
    }

    /// Swaps `model` in and wakes the waiters.
    pub fn store(&self, model: Versioned<B>) {
        drop(self.swap(model));
    }

    /// Swaps `model` in, wakes the waiters and returns the model it replaced (the decode
    /// loop may still be running a pass on it: it is free once this is its last holder).
    pub fn swap(&self, model: Versioned<B>) -> Arc<Versioned<B>> {
        let version = model.version;
        let old = self.model.swap(Arc::new(model));
        self.version.send_replace(version);
        old
    }

    /// Waits until the slot holds `version` or a newer one.
    pub async fn reached(&self, version: u64) {
        let mut rx = self.version.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = rx.wait_for(|v| *v >= version).await;
    }
}

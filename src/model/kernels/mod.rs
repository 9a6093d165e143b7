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
//! Two blocks keep less than their inputs' products for the backward, so that memory
//! grows with neither the vocabulary nor the square of the length: the output head and
//! the log-prob run as one block over chunks of rows ([`head`]), recomputing each chunk's
//! logits in the backward, and attention keeps each query's log-sum-exp instead of its
//! probabilities, recomputing them block by block in the backward ([`attend`]), as flash
//! attention does.
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
mod exp;
mod fused;
pub mod head;
mod logprob;
mod pack_once;
mod products;
pub mod reference;
mod rows;

pub use fused::{Kernels, reshape};
pub use head::{HEAD_CHUNK_ROWS, reset_widest_logits, widest_logits};
pub use logprob::{HeadTargets, Kept, token_logprob};
pub(crate) use logprob::{MASKED, inv_temperature};
pub use pack_once::PackOnce;
pub use reference::LinearGrads;

#[cfg(test)]
mod tests;

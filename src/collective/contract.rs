//! What trainer ranks do together ([`Collective`]), the element type gradients travel in,
//! the errors of joining and talking, and [`Solo`], one rank alone. The libraries beside
//! it (`mpi.rs`, `nccl.rs`) implement it; `mod.rs` plans and joins the ranks.

use std::time::Duration;

/// The element type gradients travel in: f32 (exact sums in rank order) or bf16 (half
/// the bytes; each partial sum rounded to bf16).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    F32,
    Bf16,
}
crate::enum_setting!(ReduceDtype);

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "{world} trainer ranks over NCCL need a build with `--features cuda`; on machines \
         without GPUs run the ranks under mpirun with a build with `--features mpi`"
    )]
    NoNccl { world: usize },
    /// The launcher started ranks, but this build cannot join them.
    #[error(
        "{launcher} started this process as one of {world} MPI ranks, but this rlstream was built \
         without MPI: build it with `cargo build --release --features mpi` (Debian: apt-get \
         install libopenmpi-dev openmpi-bin libclang-dev)"
    )]
    NoMpi { launcher: String, world: usize },
    #[error("cannot start MPI: {0}")]
    Init(String),
    /// A device buffer that could not be read to the host for a collective.
    #[error("{what}: cannot read the gradients on the device: {detail}")]
    Device { what: String, detail: String },
    /// A message between ranks that does not decode: ranks of different builds.
    #[error(
        "rank {rank} sent a {what} this rank cannot read ({detail}); run one rlstream build on every rank"
    )]
    Garbled {
        rank: usize,
        what: &'static str,
        detail: String,
    },
}

/// f32 values in a backend's memory (a bucket of gradients on a GPU), which
/// [`Collective::all_reduce_device`] sums over the ranks in place.
pub trait DeviceBuffer {
    /// How many values.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The address of the values in CUDA memory of this process's primary context, once the
    /// device work that writes them is done, when they live there (the `cuda` build's
    /// backend): NCCL then sums them where they are. `None` elsewhere.
    fn cuda_address(&mut self) -> Option<u64>;
    /// The values, copied to the host.
    fn read(&mut self) -> Result<Vec<f32>, String>;
    /// Replaces the values by `values` (as many).
    fn write(&mut self, values: Vec<f32>);
}

/// [`Collective::all_reduce_device`] through the host: the values read, summed by
/// `all_reduce_sum`, written back. What a collective that cannot read device memory does.
pub fn all_reduce_staged<C: Collective + ?Sized>(
    c: &mut C,
    what: &str,
    buf: &mut dyn DeviceBuffer,
    dtype: ReduceDtype,
) -> Result<(), CollectiveError> {
    let mut host = buf.read().map_err(|detail| CollectiveError::Device {
        what: what.to_string(),
        detail,
    })?;
    c.all_reduce_sum(what, &mut host, dtype);
    buf.write(host);
    Ok(())
}

/// What trainer ranks do together. Every call returns once every rank has made the same
/// call, or, past [`Collective::timeout`], ends the job naming the ranks that did not.
/// Ranks make the same calls in the same order.
pub trait Collective: Send + Sync {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// How many ranks.
    fn world(&self) -> usize;
    /// How long one call waits for the other ranks.
    fn timeout(&self) -> Duration;
    fn set_timeout(&mut self, timeout: Duration);
    /// Replaces `buf` by its sum over the ranks, carried as `dtype`. `what` names the call
    /// in errors ("the all-reduce of step 7's gradients").
    fn all_reduce_sum(&mut self, what: &str, buf: &mut [f32], dtype: ReduceDtype);
    /// [`Collective::all_reduce_sum`] of values in a backend's memory, in place. By default
    /// through the host ([`all_reduce_staged`]), as MPI and one rank alone do (a CUDA-aware
    /// MPI could read device memory; rlstream's ranks on GPUs use NCCL, which sums CUDA
    /// memory where it is).
    fn all_reduce_device(
        &mut self,
        what: &str,
        buf: &mut dyn DeviceBuffer,
        dtype: ReduceDtype,
    ) -> Result<(), CollectiveError> {
        all_reduce_staged(self, what, buf, dtype)
    }
    /// Replaces `bytes` on every rank by rank `root`'s.
    fn broadcast(&mut self, what: &str, root: usize, bytes: &mut Vec<u8>);
    /// Every rank's `bytes`, in rank order.
    fn all_gather(&mut self, what: &str, bytes: &[u8]) -> Vec<Vec<u8>>;
    fn barrier(&mut self, what: &str);
    /// Sums `send` over the ranks and returns this rank's block of the sum: `send` holds one
    /// block per rank, of equal length, block `r` at `r * len .. (r + 1) * len`, carried as
    /// `dtype` (one `MPI_Ireduce` per block, `ncclReduceScatter`). Half the bytes of an
    /// all-reduce of `send`.
    fn reduce_scatter_sum(&mut self, what: &str, send: &[f32], dtype: ReduceDtype) -> Vec<f32>;
    /// In place: `buf` holds one block per rank, of equal length; this rank's block is its
    /// input and on return every block is its rank's (`MPI_Iallgather`, `ncclAllGather`).
    fn all_gather_blocks(&mut self, what: &str, buf: &mut [f32]);
}

/// One rank alone: every call returns at once.
#[derive(Debug, Default)]
pub struct Solo {
    timeout: Duration,
}

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
    fn all_reduce_sum(&mut self, _: &str, buf: &mut [f32], dtype: ReduceDtype) {
        if dtype == ReduceDtype::Bf16 {
            for x in buf {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        }
    }
    fn broadcast(&mut self, _: &str, _: usize, _: &mut Vec<u8>) {}
    fn all_gather(&mut self, _: &str, bytes: &[u8]) -> Vec<Vec<u8>> {
        vec![bytes.to_vec()]
    }
    fn barrier(&mut self, _: &str) {}
    fn reduce_scatter_sum(&mut self, _: &str, send: &[f32], dtype: ReduceDtype) -> Vec<f32> {
        let mut out = send.to_vec();
        self.all_reduce_sum("", &mut out, dtype);
        out
    }
    fn all_gather_blocks(&mut self, _: &str, _: &mut [f32]) {}
}

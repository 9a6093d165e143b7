//! [`Collective`] on NCCL (feature `cuda`, through `cudarc`), for trainer ranks on GPUs
//! started by any launcher (`srun`, `torchrun`, a job array) rather than `mpirun`: the ranks
//! meet through the rendezvous on Redis ([`super::rendezvous`]).
//!
//! Host buffers are copied to the rank's GPU, reduced there by NCCL and copied back;
//! gradients already in CUDA memory (`all_reduce_device` on the `cuda` backend's buckets)
//! are summed where they are, with no copy. Each call's completion is polled on a CUDA
//! event until it completes or its deadline passes.
//! NCCL cannot say which rank is missing: past the deadline the rank says that a rank is
//! lost or stopped and exits (every rank has the same deadline, so all stop); the
//! launcher's log names a rank that died. Nothing is lost: restart every rank.

use super::contract::{Collective, CollectiveError, DeviceBuffer, ReduceDtype, all_reduce_staged};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
    ValidAsZeroBits,
};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The exit code of a rank that gave up on a call.
const LOST_RANK: i32 = 75;

pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

// SAFETY: every call that reaches NCCL or CUDA takes `&mut self`, so one thread at a time
// uses the communicator and its stream (NCCL allows any thread); `&self` methods read
// plain fields.
unsafe impl Send for Nccl {}
// SAFETY: as above.
unsafe impl Sync for Nccl {}

fn failed(e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Init(format!("{e:?}"))
}

impl Nccl {
    /// A fresh NCCL unique id (rank 0 creates it and hands it out through the rendezvous).
    pub fn new_id() -> Result<Vec<u8>, CollectiveError> {
        let id = Id::new().map_err(failed)?;
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    }

    /// Joins the `world` ranks that share `id` as `rank`, on GPU `device`, within `timeout`
    /// (NCCL's own set-up waits for every rank without one).
    pub fn join(
        rank: usize,
        world: usize,
        id: &[u8],
        device: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let mut internal = [0 as std::ffi::c_char; 128];
        if id.len() != internal.len() {
            return Err(CollectiveError::Garbled {
                rank: 0,
                what: "NCCL id",
                detail: format!("{} bytes, not 128", id.len()),
            });
        }
        for (c, &b) in internal.iter_mut().zip(id) {
            *c = b as std::ffi::c_char;
        }
        let ctx = CudaContext::new(device).map_err(|e| {
            CollectiveError::Init(format!(
                "cannot open GPU {device} for NCCL rank {rank}: {e:?}"
            ))
        })?;
        let stream = ctx.default_stream();
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stream.clone();
        std::thread::spawn(move || {
            let _ = tx.send(Comm::from_rank(s, rank, world, Id::uninit(internal)).map(SendComm));
        });
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(SendComm(c))) => c,
            Ok(Err(e)) => return Err(failed(e)),
            Err(_) => {
                return Err(CollectiveError::Init(format!(
                    "NCCL rank {rank} of {world}: not every rank joined within {:.0} s (a rank \
                     not started, or an id left by an earlier launch under this rendezvous)",
                    timeout.as_secs_f64()
                )));
            }
        };
        Ok(Nccl {
            comm,
            stream,
            rank,
            world,
            timeout,
        })
    }

    /// Waits for the work queued on the stream; past the deadline, or on an error, this
    /// rank stops (see the module).
    fn wait(&self, what: &str) {
        let event = match self.stream.record_event(None) {
            Ok(e) => e,
            Err(e) => self.lost(what, &format!("{e:?}")),
        };
        let start = Instant::now();
        loop {
            match event.try_is_complete() {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => self.lost(what, &format!("{e:?}")),
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.lost(
                    what,
                    &format!(
                        "not complete within {:.1} s: a rank is lost or stopped (NCCL cannot \
                         say which; the launcher's log names a rank that died)",
                        waited.as_secs_f64()
                    ),
                );
            }
            if waited < Duration::from_secs(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn lost(&self, what: &str, why: &str) -> ! {
        let message = format!(
            "rank {}: {what}: {why}. Stopping this rank; restart every rank and they resume \
             from the last checkpoint, losing nothing",
            self.rank
        );
        tracing::error!("{message}");
        eprintln!("rlstream: {message}");
        std::process::exit(LOST_RANK)
    }

    fn to_device<T: DeviceRepr>(&self, what: &str, host: &[T]) -> CudaSlice<T> {
        self.stream
            .clone_htod(host)
            .unwrap_or_else(|e| self.lost(what, &format!("{e:?}")))
    }

    fn to_host<T: DeviceRepr + Default + Clone>(
        &self,
        what: &str,
        d: &CudaSlice<T>,
        host: &mut [T],
    ) {
        if let Err(e) = self.stream.memcpy_dtoh(d, host) {
            self.lost(what, &format!("{e:?}"));
        }
        if let Err(e) = self.stream.synchronize() {
            self.lost(what, &format!("{e:?}"));
        }
    }

    fn sum<T: DeviceRepr + NcclType + Default + Clone>(&mut self, what: &str, host: &mut [T]) {
        if host.is_empty() {
            return;
        }
        let mut d = self.to_device(what, host);
        if let Err(e) = self.comm.all_reduce_in_place(&mut d, &ReduceOp::Sum) {
            self.lost(what, &format!("{e:?}"));
        }
        self.wait(what);
        self.to_host(what, &d, host);
    }

    /// This rank's block of the sum of `send` (one block per rank).
    fn scatter_sum<T: DeviceRepr + NcclType + Default + Clone>(
        &mut self,
        what: &str,
        send: &[T],
    ) -> Vec<T> {
        let block = send.len() / self.world;
        let mut out = vec![T::default(); block];
        if block == 0 {
            return out;
        }
        let d = self.to_device(what, send);
        let mut recv = self.to_device(what, &out);
        if let Err(e) = self.comm.reduce_scatter(&d, &mut recv, &ReduceOp::Sum) {
            self.lost(what, &format!("{e:?}"));
        }
        self.wait(what);
        self.to_host(what, &recv, &mut out);
        out
    }

    fn gather<T: DeviceRepr + NcclType + ValidAsZeroBits + Default + Clone>(
        &mut self,
        what: &str,
        mine: &[T],
    ) -> Vec<T> {
        let send = self.to_device(what, mine);
        let mut recv = self
            .stream
            .alloc_zeros::<T>(mine.len() * self.world)
            .unwrap_or_else(|e| self.lost(what, &format!("{e:?}")));
        if let Err(e) = self.comm.all_gather(&send, &mut recv) {
            self.lost(what, &format!("{e:?}"));
        }
        self.wait(what);
        let mut out = vec![T::default(); mine.len() * self.world];
        self.to_host(what, &recv, &mut out);
        out
    }
}

/// f32 values in CUDA memory that another runtime (CubeCL's) owns, lent to NCCL for one
/// call: the owner keeps them alive and has finished writing them.
struct Lent {
    address: u64,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<f32> for Lent {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtrMut<f32> for Lent {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        // The owner finished its writes before lending (`DeviceBuffer::cuda_address`), and
        // the call is waited for (`Nccl::wait`) before the owner uses the values again.
        (self.address, SyncOnDrop::Sync(None))
    }
}

/// `Comm` handed from the thread that waited for every rank to join.
struct SendComm(Comm);
// SAFETY: the communicator is handed over once, and used by one thread at a time after.
unsafe impl Send for SendComm {}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn all_reduce_sum(&mut self, what: &str, buf: &mut [f32], dtype: ReduceDtype) {
        match dtype {
            ReduceDtype::F32 => self.sum(what, buf),
            ReduceDtype::Bf16 => {
                let mut half: Vec<half::bf16> =
                    buf.iter().map(|&x| half::bf16::from_f32(x)).collect();
                self.sum(what, &mut half);
                for (x, h) in buf.iter_mut().zip(half) {
                    *x = h.to_f32();
                }
            }
        }
    }

    /// In place when the values are in CUDA memory and travel as f32; else through the
    /// host (a bf16 sum rounds on the host, as `all_reduce_sum` does).
    fn all_reduce_device(
        &mut self,
        what: &str,
        buf: &mut dyn DeviceBuffer,
        dtype: ReduceDtype,
    ) -> Result<(), CollectiveError> {
        if buf.is_empty() {
            return Ok(());
        }
        let address = match dtype {
            ReduceDtype::F32 => buf.cuda_address(),
            ReduceDtype::Bf16 => None,
        };
        let Some(address) = address else {
            return all_reduce_staged(self, what, buf, dtype);
        };
        let mut lent = Lent {
            address,
            len: buf.len(),
            stream: self.stream.clone(),
        };
        if let Err(e) = self.comm.all_reduce_in_place(&mut lent, &ReduceOp::Sum) {
            self.lost(what, &format!("{e:?}"));
        }
        self.wait(what);
        Ok(())
    }

    fn broadcast(&mut self, what: &str, root: usize, bytes: &mut Vec<u8>) {
        let mut len = [bytes.len() as u64];
        let mut d = self.to_device(what, &len);
        if let Err(e) = self.comm.broadcast_in_place(&mut d, root as i32) {
            self.lost(what, &format!("{e:?}"));
        }
        self.wait(what);
        self.to_host(what, &d, &mut len);
        bytes.resize(usize::try_from(len[0]).unwrap_or(0), 0);
        if bytes.is_empty() {
            return;
        }
        let mut d = self.to_device(what, bytes);
        if let Err(e) = self.comm.broadcast_in_place(&mut d, root as i32) {
            self.lost(what, &format!("{e:?}"));
        }
        self.wait(what);
        self.to_host(what, &d, bytes);
    }

    fn all_gather(&mut self, what: &str, bytes: &[u8]) -> Vec<Vec<u8>> {
        let lens = self.gather(what, &[bytes.len() as u64]);
        let longest = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = bytes.to_vec();
        padded.resize(longest.max(1), 0);
        let all = self.gather(what, &padded);
        all.chunks(longest.max(1))
            .zip(&lens)
            .map(|(c, &n)| c[..n as usize].to_vec())
            .collect()
    }

    fn barrier(&mut self, what: &str) {
        let mut one = [1f32];
        self.sum(what, &mut one);
    }

    fn reduce_scatter_sum(&mut self, what: &str, send: &[f32], dtype: ReduceDtype) -> Vec<f32> {
        match dtype {
            ReduceDtype::F32 => self.scatter_sum(what, send),
            ReduceDtype::Bf16 => {
                let half: Vec<half::bf16> = send.iter().map(|&x| half::bf16::from_f32(x)).collect();
                self.scatter_sum(what, &half)
                    .into_iter()
                    .map(half::bf16::to_f32)
                    .collect()
            }
        }
    }

    fn all_gather_blocks(&mut self, what: &str, buf: &mut [f32]) {
        let block = buf.len() / self.world;
        let mine = buf[self.rank * block..(self.rank + 1) * block].to_vec();
        let all = self.gather(what, &mine);
        buf.copy_from_slice(&all);
    }
}

//! [`Collective`] on MPI (the `mpi` crate over the system's Open MPI or MPICH).
//!
//! Every call is MPI's non-blocking collective (`MPI_Iallreduce`, `MPI_Ibcast`,
//! `MPI_Iallgatherv`, `MPI_Ibarrier`, `MPI_Iallgather`, and one `MPI_Ireduce` per rank's
//! block for the reduce-scatter), tested until it completes or its deadline passes.
//! Waiting yields the core at once and sleeps a millisecond at a time after the first
//! second, so ranks that share cores (two ranks on a 2-core machine) leave them to the
//! ranks still computing instead of spinning on them.
//!
//! Past the deadline the rank takes a roll call: it sends every other rank a point-to-point
//! message, and every rank waiting in a call answers it from its wait loop. The ranks that
//! do not answer within a few seconds are named, and the job is ended with `MPI_Abort`
//! (a collective another rank may be inside cannot be cancelled).

use super::contract::{Collective, CollectiveError, ReduceDtype};
use mpi::collective::{Operation, SystemOperation, UnsafeUserOperation};
use mpi::datatype::Equivalence;
use mpi::datatype::PartitionMut;
use mpi::ffi::MPI_Datatype;
use mpi::request::{Request, Scope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

/// Point-to-point tags of the roll call (collectives do not use tags).
const ROLL_CALL: i32 = 7001;
const ROLL_ANSWER: i32 = 7002;
/// How long a roll call waits for answers.
const ROLL_GRACE: Duration = Duration::from_secs(3);
/// Waiting yields the core this long before it sleeps between tests.
const SPIN: Duration = Duration::from_secs(1);
/// The exit code of a job ended because a rank was lost.
const LOST_RANK: c_int = 75;

/// The MPI world as trainer ranks.
pub struct Mpi {
    // Dropped in this order: the operation and the communicator before MPI_Finalize.
    bf16_sum: UnsafeUserOperation,
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
    rank: usize,
    size: usize,
    timeout: Duration,
}

// SAFETY: MPI is initialised with `MPI_THREAD_SERIALIZED` (checked in `init`): any thread
// may make MPI calls as long as no two make them at once, which `&mut self` on every call
// guarantees. The handles are plain values MPI hands out for the process.
unsafe impl Send for Mpi {}
// SAFETY: the methods that take `&self` read plain fields; every MPI call is made under
// `&mut self` (the private helpers that make them are called only from those).
unsafe impl Sync for Mpi {}

/// Adds bf16 vectors: each pair widened to f32, added, rounded back to nearest even.
unsafe extern "C" fn bf16_sum(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _: *mut MPI_Datatype,
) {
    // SAFETY: MPI passes two buffers of `*len` elements of the u16 datatype the reduction
    // was called with.
    let (a, b) = unsafe {
        let n = usize::try_from(*len).unwrap_or(0);
        (
            std::slice::from_raw_parts(invec.cast::<u16>(), n),
            std::slice::from_raw_parts_mut(inoutvec.cast::<u16>(), n),
        )
    };
    for (x, y) in a.iter().zip(b) {
        let s = half::bf16::from_bits(*x).to_f32() + half::bf16::from_bits(*y).to_f32();
        *y = half::bf16::from_f32(s).to_bits();
    }
}

impl Mpi {
    /// Joins the MPI world the launcher started.
    pub fn init() -> Result<Self, CollectiveError> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| {
                CollectiveError::Init("MPI was initialised already in this process".into())
            })?;
        if threading < mpi::Threading::Serialized {
            return Err(CollectiveError::Init(format!(
                "the MPI library offers thread level {threading:?}; the trainer needs \
                 Serialized (calls from any one thread at a time)"
            )));
        }
        let world = universe.world();
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        let size = usize::try_from(world.size()).unwrap_or(1);
        // SAFETY: `bf16_sum` reads and writes exactly the buffers and length MPI passes.
        let bf16_sum = unsafe { UnsafeUserOperation::commutative(bf16_sum) };
        Ok(Mpi {
            bf16_sum,
            world,
            _universe: universe,
            rank,
            size,
            timeout: Duration::from_secs(300),
        })
    }

    /// Tests `req` until it completes; past the deadline, ends the job (see the module).
    fn wait<'a, D: ?Sized, S: Scope<'a>>(&self, what: &str, req: Request<'a, D, S>) {
        self.wait_all(what, vec![req]);
    }

    /// Tests `reqs` until every one completes; past the deadline, ends the job.
    fn wait_all<'a, D: ?Sized, S: Scope<'a>>(&self, what: &str, mut reqs: Vec<Request<'a, D, S>>) {
        let start = Instant::now();
        loop {
            reqs = reqs.into_iter().filter_map(|r| r.test().err()).collect();
            if reqs.is_empty() {
                return;
            }
            self.answer_roll_calls();
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.lost(what, waited);
            }
            if waited < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// This rank's block of the sum of `send` (one block per rank): block `r` is reduced
    /// onto rank `r` by its own `MPI_Ireduce`, all of them posted at once and waited on
    /// together. Open MPI's non-blocking `MPI_Ireduce_scatter_block` took longer than the
    /// whole all-reduce of the same values here (BENCHMARKS.md); the reductions onto each
    /// root move each rank's other blocks once.
    fn reduce_blocks<T, O>(&self, what: &str, send: &[T], op: O) -> Vec<T>
    where
        T: Equivalence + Default + Clone,
        O: Operation + Copy,
    {
        let block = send.len() / self.size;
        let mut recv = vec![T::default(); block];
        mpi::request::scope(|scope| {
            let mut mine = Some(&mut recv[..]);
            let mut reqs = Vec::with_capacity(self.size);
            for r in 0..self.size {
                let part = &send[r * block..(r + 1) * block];
                let root = self.world.process_at_rank(r as i32);
                match (r == self.rank).then(|| mine.take()).flatten() {
                    Some(out) => reqs.push(root.immediate_reduce_into_root(scope, part, out, op)),
                    None => reqs.push(root.immediate_reduce_into(scope, part, op)),
                }
            }
            self.wait_all(what, reqs);
        });
        recv
    }

    /// Receives every message with `tag` waiting; the ranks that sent them.
    fn received(&self, tag: i32) -> Vec<usize> {
        let mut from = Vec::new();
        while let Some((msg, status)) = self
            .world
            .any_process()
            .immediate_matched_probe_with_tag(tag)
        {
            let (_, _): (u32, _) = msg.matched_receive();
            from.push(usize::try_from(status.source_rank()).unwrap_or(usize::MAX));
        }
        from
    }

    /// Answers every roll call waiting: this rank is alive and inside a call.
    fn answer_roll_calls(&self) {
        for r in self.received(ROLL_CALL) {
            self.world
                .process_at_rank(r as i32)
                .send_with_tag(&[self.rank as u32][..], ROLL_ANSWER);
        }
    }

    /// A call missed its deadline: names the ranks that do not answer a roll call and ends
    /// every rank.
    fn lost(&self, what: &str, waited: Duration) -> ! {
        let me = [self.rank as u32];
        let mut answered = vec![false; self.size];
        answered[self.rank] = true;
        mpi::request::scope(|scope| {
            let mut sends = Vec::new();
            for r in (0..self.size).filter(|&r| r != self.rank) {
                let to = self.world.process_at_rank(r as i32);
                sends.push(to.immediate_send_with_tag(scope, &me[..], ROLL_CALL));
            }
            let until = Instant::now() + ROLL_GRACE;
            while Instant::now() < until && answered.iter().any(|a| !a) {
                // A rank past its own deadline asks too: it is alive.
                let alive = [self.received(ROLL_ANSWER), self.received(ROLL_CALL)];
                for r in alive.iter().flatten() {
                    if let Some(a) = answered.get_mut(*r) {
                        *a = true;
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let missing: Vec<String> = (0..self.size)
                .filter(|&r| !answered[r])
                .map(|r| r.to_string())
                .collect();
            let who = if missing.is_empty() {
                "every rank answers a roll call, so one is inside a different call: ranks \
                 disagree on the sequence of calls (a bug; report it with every rank's log)"
                    .to_string()
            } else {
                format!(
                    "lost rank {} (no answer to a roll call: killed, stopped, or busy outside \
                     MPI for longer than train.collective_timeout_s)",
                    missing.join(", ")
                )
            };
            let message = format!(
                "rank {}: {what} did not complete within {:.1} s: {who}. Ending every rank; \
                 restart them all and they resume from the last checkpoint, losing nothing",
                self.rank,
                waited.as_secs_f64()
            );
            tracing::error!("{message}");
            eprintln!("rlstream: {message}");
            self.world.abort(LOST_RANK)
        })
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.size
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn all_reduce_sum(&mut self, what: &str, buf: &mut [f32], dtype: ReduceDtype) {
        match dtype {
            ReduceDtype::F32 => {
                let send = buf.to_vec();
                mpi::request::scope(|scope| {
                    let req = self.world.immediate_all_reduce_into(
                        scope,
                        &send[..],
                        buf,
                        SystemOperation::sum(),
                    );
                    self.wait(what, req);
                });
            }
            ReduceDtype::Bf16 => {
                let send: Vec<u16> = buf
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                let mut recv = vec![0u16; send.len()];
                mpi::request::scope(|scope| {
                    let req = self.world.immediate_all_reduce_into(
                        scope,
                        &send[..],
                        &mut recv[..],
                        &self.bf16_sum,
                    );
                    self.wait(what, req);
                });
                for (x, b) in buf.iter_mut().zip(recv) {
                    *x = half::bf16::from_bits(b).to_f32();
                }
            }
        }
    }

    fn broadcast(&mut self, what: &str, root: usize, bytes: &mut Vec<u8>) {
        let root = self.world.process_at_rank(root as i32);
        let mut len = [bytes.len() as u64];
        mpi::request::scope(|scope| {
            let req = root.immediate_broadcast_into(scope, &mut len[..]);
            self.wait(what, req);
        });
        bytes.resize(usize::try_from(len[0]).unwrap_or(0), 0);
        mpi::request::scope(|scope| {
            let req = root.immediate_broadcast_into(scope, &mut bytes[..]);
            self.wait(what, req);
        });
    }

    fn all_gather(&mut self, what: &str, bytes: &[u8]) -> Vec<Vec<u8>> {
        let mine = [bytes.len() as i32];
        let mut lens = vec![0i32; self.size];
        mpi::request::scope(|scope| {
            let req = self
                .world
                .immediate_all_gather_into(scope, &mine[..], &mut lens[..]);
            self.wait(what, req);
        });
        let displs: Vec<i32> = lens
            .iter()
            .scan(0i32, |at, &n| {
                let d = *at;
                *at += n;
                Some(d)
            })
            .collect();
        let total: usize = lens.iter().map(|&n| usize::try_from(n).unwrap_or(0)).sum();
        let mut all = vec![0u8; total];
        let mut part = PartitionMut::new(&mut all[..], &lens[..], &displs[..]);
        mpi::request::scope(|scope| {
            let req = self
                .world
                .immediate_all_gather_varcount_into(scope, bytes, &mut part);
            self.wait(what, req);
        });
        lens.iter()
            .zip(&displs)
            .map(|(&n, &d)| {
                let (d, n) = (d as usize, n as usize);
                all[d..d + n].to_vec()
            })
            .collect()
    }

    fn barrier(&mut self, what: &str) {
        let req = self.world.immediate_barrier();
        self.wait(what, req);
    }

    fn reduce_scatter_sum(&mut self, what: &str, send: &[f32], dtype: ReduceDtype) -> Vec<f32> {
        match dtype {
            ReduceDtype::F32 => self.reduce_blocks(what, send, SystemOperation::sum()),
            ReduceDtype::Bf16 => {
                let send: Vec<u16> = send
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                self.reduce_blocks(what, &send, &self.bf16_sum)
                    .into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect()
            }
        }
    }

    fn all_gather_blocks(&mut self, what: &str, buf: &mut [f32]) {
        let block = buf.len() / self.size;
        let mine = buf[self.rank * block..(self.rank + 1) * block].to_vec();
        mpi::request::scope(|scope| {
            let req = self.world.immediate_all_gather_into(scope, &mine[..], buf);
            self.wait(what, req);
        });
    }
}

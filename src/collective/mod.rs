//! Collective communication among data-parallel trainer ranks, on an existing collective
//! library: [`Collective`] is what the trainer needs (a bucketed all-reduce of its gradient
//! set in f32 or bf16, broadcast, all-gather, barrier, and for sharded state a
//! reduce-scatter and an all-gather of equal blocks, [`shards`]), every call bounded by a
//! deadline.
//!
//! - [`Solo`]: one rank, every call a no-op; the trainer without `mpirun`.
//! - `Mpi` (feature `mpi`): Open MPI or MPICH through the `mpi` crate, ranks taken from the
//!   MPI world that `mpirun -n N rlstream train …` (or `srun`) starts.
//! - `Nccl` (feature `cuda`): NCCL through `cudarc` on the GPUs, ranks from `--world` and
//!   `--rank` or a launcher's environment, meeting through Redis ([`rendezvous`]).
//!
//! The command line joins the ranks and hands rank 0's trainer stage its [`Collective`]
//! (`stages::train::TrainJob::ranks`); the other ranks follow rank 0.
//!
//! A collective that misses its deadline cannot be cancelled (MPI has no way to take back
//! a collective that another rank may be inside): the rank that sees it asks every other
//! rank to answer, names the ranks that do not (killed, stopped, or outside MPI for longer
//! than the deadline), and ends the whole job. Nothing is lost by that: entries are acked
//! only after a checkpoint, and a restart of every rank resumes from the last one.

mod contract;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda")]
mod nccl;
pub mod rendezvous;
pub mod shards;

pub use self::contract::{
    Collective, CollectiveError, DeviceBuffer, ReduceDtype, Solo, all_reduce_staged,
};
#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;
#[cfg(feature = "cuda")]
pub use self::nccl::Nccl;

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Which collective library trainer ranks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CollectiveKind {
    /// MPI under `mpirun` (its environment says so); NCCL when `--world` or a launcher's
    /// `WORLD_SIZE` / `SLURM_NTASKS` gives more than one rank; else one trainer.
    Auto,
    /// MPI (for launchers that start MPI ranks without `mpirun`'s variables: `srun --mpi=pmix`).
    Mpi,
    /// NCCL on GPUs, the ranks meeting through Redis (feature `cuda`).
    Nccl,
}
crate::enum_setting!(CollectiveKind);

/// How this process joins trainer ranks, from its settings and its launcher's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Alone,
    Mpi,
    Nccl(NcclPlan),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclPlan {
    pub rank: usize,
    pub world: usize,
    /// The GPU this rank uses.
    pub device: usize,
    /// The rendezvous name the ranks meet under (see [`rendezvous`]).
    pub rendezvous: String,
}

/// What the launcher and the settings say: `kind`, and `world`, `rank` and `rendezvous` as
/// given (`world` 0 and an empty `rendezvous`: from the environment `env` reads).
pub fn plan(
    kind: CollectiveKind,
    world: usize,
    rank: usize,
    rendezvous: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Plan, CollectiveError> {
    let number = |vars: &[&str]| {
        vars.iter()
            .find_map(|v| env(v)?.trim().parse::<usize>().ok())
    };
    let mpi_launched = number(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]).is_some();
    if kind == CollectiveKind::Mpi || (kind == CollectiveKind::Auto && mpi_launched) {
        return Ok(Plan::Mpi);
    }
    let (world, rank) = if world > 0 {
        (world, rank)
    } else {
        (
            number(&["WORLD_SIZE", "SLURM_NTASKS"]).unwrap_or(1),
            number(&["RANK", "SLURM_PROCID"]).unwrap_or(0),
        )
    };
    if kind == CollectiveKind::Auto && world <= 1 {
        return Ok(Plan::Alone);
    }
    if rank >= world {
        return Err(CollectiveError::Init(format!(
            "rank {rank} is not below the world size {world} (--rank, --world, or the \
             launcher's RANK / WORLD_SIZE)"
        )));
    }
    let device = number(&["LOCAL_RANK", "SLURM_LOCALID"]).unwrap_or(rank);
    let rendezvous = if rendezvous.is_empty() {
        ["SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"]
            .iter()
            .find_map(|v| env(v))
            .unwrap_or_else(|| "default".into())
    } else {
        rendezvous.to_string()
    };
    Ok(Plan::Nccl(NcclPlan {
        rank,
        world,
        device,
        rendezvous,
    }))
}

/// Joins the NCCL ranks of `p`: rank 0 hands out the id through the rendezvous on `bus`
/// under `namespace`, and every rank joins within `timeout`.
#[cfg(feature = "cuda")]
pub async fn join_nccl(
    p: &NcclPlan,
    bus: &dyn crate::bus::Bus,
    namespace: &str,
    timeout: Duration,
) -> Result<Box<dyn Collective>, CollectiveError> {
    let key = rendezvous::key(namespace, &p.rendezvous);
    let id = if p.rank == 0 {
        let id = Nccl::new_id()?;
        rendezvous::offer(bus, &key, p.world, &id).await?;
        id
    } else {
        rendezvous::take(bus, &key, p.world, timeout).await?
    };
    let joined =
        tokio::task::block_in_place(|| Nccl::join(p.rank, p.world, &id, p.device, timeout));
    if p.rank == 0 {
        rendezvous::withdraw(bus, &key).await;
    }
    Ok(Box::new(joined?))
}

/// Without the `cuda` feature there is no NCCL: a clear error.
#[cfg(not(feature = "cuda"))]
pub async fn join_nccl(
    p: &NcclPlan,
    _: &dyn crate::bus::Bus,
    _: &str,
    _: Duration,
) -> Result<Box<dyn Collective>, CollectiveError> {
    Err(CollectiveError::NoNccl { world: p.world })
}

/// Joins the MPI world the launcher started: `None` when it holds one rank.
pub fn join_mpi() -> Result<Option<Box<dyn Collective>>, CollectiveError> {
    #[cfg(feature = "mpi")]
    {
        let mpi = Mpi::init()?;
        if mpi.world() == 1 {
            return Ok(None);
        }
        Ok(Some(Box::new(mpi)))
    }
    #[cfg(not(feature = "mpi"))]
    {
        let (launcher, world) = launched().unwrap_or_else(|| ("the launcher".into(), 0));
        if world == 1 {
            return Ok(None);
        }
        Err(CollectiveError::NoMpi { launcher, world })
    }
}

/// Chooses Open MPI's algorithm for the non-blocking reduction onto one rank, which the
/// reduce-scatter of sharded trainer state posts once per rank, unless the user chose one
/// (`OMPI_MCA_coll_libnbc_ireduce_algorithm`): a binomial tree. Open MPI 4.1's default for
/// large messages, a pipelined chain, made the reduce-scatter of the 0.5B gradients take
/// 1.2-1.4 s against 0.62 s on the tree over shared memory (BENCHMARKS.md). Other MPI
/// libraries ignore the variable.
///
/// # Safety
/// Sets an environment variable: call it before any other thread starts.
pub unsafe fn choose_mpi_algorithms() {
    const VAR: &str = "OMPI_MCA_coll_libnbc_ireduce_algorithm";
    if std::env::var_os(VAR).is_none() {
        // SAFETY: the caller guarantees no other thread runs yet.
        unsafe { std::env::set_var(VAR, "2") };
    }
}

/// Ranks on one machine share its cores: unless `RAYON_NUM_THREADS` or
/// `MATMUL_NUM_THREADS` is set, each of the ranks a launcher started on this machine gets
/// its share of the cores (at least one) for the CPU kernels' thread pools, instead of
/// every rank starting a thread per core. Returns the threads each rank gets, when set.
///
/// # Safety
/// Sets environment variables: call it before any other thread starts.
pub unsafe fn divide_cores() -> Option<usize> {
    let local: usize = [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
    ]
    .into_iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let each = (cores / local.max(1)).max(1);
    for var in ["RAYON_NUM_THREADS", "MATMUL_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            // SAFETY: the caller guarantees no other thread runs yet.
            unsafe { std::env::set_var(var, each.to_string()) };
        }
    }
    Some(each)
}

#[cfg(not(feature = "mpi"))]
/// Which launcher started this process and how many ranks it said, from the variables
/// Open MPI, MPICH/Hydra and Slurm set.
fn launched() -> Option<(String, usize)> {
    [
        ("mpirun (Open MPI)", "OMPI_COMM_WORLD_SIZE"),
        ("mpirun (MPICH)", "PMI_SIZE"),
    ]
    .into_iter()
    .find_map(|(who, var)| {
        let n = std::env::var(var).ok()?.parse().ok()?;
        Some((who.to_string(), n))
    })
}

/// One run of a bucket: (piece, offset in it, length).
pub type Run = (usize, usize, usize);

/// The buckets of at most `cap` values (at least 1) that pieces of `lens` values fill in
/// order, each as its runs: a bucket takes whole pieces while they fit and splits the one
/// that does not, so a gradient set of any size moves through a bounded buffer and many
/// small tensors share one call. No run is empty.
pub fn bucket_runs(lens: &[usize], cap: usize) -> Vec<Vec<Run>> {
    let cap = cap.max(1);
    let (mut out, mut bucket, mut filled) = (Vec::new(), Vec::new(), 0);
    for (i, &n) in lens.iter().enumerate() {
        let mut off = 0;
        while off < n {
            let len = (cap - filled).min(n - off);
            bucket.push((i, off, len));
            off += len;
            filled += len;
            if filled == cap {
                out.push(std::mem::take(&mut bucket));
                filled = 0;
            }
        }
    }
    if !bucket.is_empty() {
        out.push(bucket);
    }
    out
}

/// Sums `pieces` over the ranks in buckets of at most `bucket_values` values
/// ([`bucket_runs`]), one all-reduce each. `what` names the calls ("... (bucket 2)").
pub fn all_reduce_pieces(
    c: &mut dyn Collective,
    what: &str,
    pieces: &mut [Vec<f32>],
    dtype: ReduceDtype,
    bucket_values: usize,
) {
    let lens: Vec<usize> = pieces.iter().map(Vec::len).collect();
    let total: usize = lens.iter().sum();
    let mut values = Vec::with_capacity(bucket_values.max(1).min(total));
    for (k, runs) in bucket_runs(&lens, bucket_values).into_iter().enumerate() {
        values.clear();
        for &(i, off, len) in &runs {
            values.extend_from_slice(&pieces[i][off..off + len]);
        }
        c.all_reduce_sum(&format!("{what} (bucket {})", k + 1), &mut values, dtype);
        let mut at = 0;
        for (i, off, len) in runs {
            pieces[i][off..off + len].copy_from_slice(&values[at..at + len]);
            at += len;
        }
    }
}

/// Which ranks train which of a step's groups: each group in turn (the step's groups are
/// in group-id order) to the rank with the fewest tokens so far, the lowest rank on a tie.
/// Deterministic: every rank computes the same assignment from the same groups.
pub fn shares(tokens: &[usize], world: usize) -> Vec<Vec<usize>> {
    let world = world.max(1);
    let mut out = vec![Vec::new(); world];
    let mut load = vec![0usize; world];
    for (i, &t) in tokens.iter().enumerate() {
        let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        out[r].push(i);
        load[r] += t;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_string())
        }
    }

    #[test]
    fn the_plan_follows_the_launcher_and_the_flags() {
        use CollectiveKind::*;
        assert_eq!(plan(Auto, 0, 0, "", env(&[])).unwrap(), Plan::Alone);
        assert_eq!(
            plan(Auto, 0, 0, "", env(&[("OMPI_COMM_WORLD_SIZE", "2")])).unwrap(),
            Plan::Mpi
        );
        assert_eq!(plan(Mpi, 0, 0, "", env(&[])).unwrap(), Plan::Mpi);
        let torchrun = [
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("TORCHELASTIC_RUN_ID", "j7"),
        ];
        let p = NcclPlan {
            rank: 3,
            world: 4,
            device: 1,
            rendezvous: "j7".into(),
        };
        assert_eq!(plan(Auto, 0, 0, "", env(&torchrun)).unwrap(), Plan::Nccl(p));
        let slurm = [
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_JOB_ID", "99"),
        ];
        let p = NcclPlan {
            rank: 1,
            world: 2,
            device: 1,
            rendezvous: "99".into(),
        };
        assert_eq!(plan(Auto, 0, 0, "", env(&slurm)).unwrap(), Plan::Nccl(p));
        // Flags win over the environment; one NCCL rank on request.
        let p = NcclPlan {
            rank: 0,
            world: 1,
            device: 0,
            rendezvous: "mine".into(),
        };
        assert_eq!(
            plan(Nccl, 1, 0, "mine", env(&slurm)).unwrap(),
            Plan::Nccl(p)
        );
        let e = plan(Auto, 2, 2, "", env(&[])).unwrap_err().to_string();
        assert!(e.contains("rank 2 is not below the world size 2"), "{e}");
    }

    #[test]
    fn shares_balance_tokens_and_are_deterministic() {
        let s = shares(&[10, 1, 1, 1, 9, 2], 2);
        assert_eq!(s, vec![vec![0, 5], vec![1, 2, 3, 4]]);
        assert_eq!(shares(&[5], 3), vec![vec![0], vec![], vec![]]);
        assert_eq!(shares(&[], 2), vec![Vec::<usize>::new(), vec![]]);
    }

    #[test]
    fn buckets_fill_in_order_and_split_what_does_not_fit() {
        let b = bucket_runs(&[3, 0, 7, 1], 4);
        assert_eq!(
            b,
            vec![
                vec![(0, 0, 3), (2, 0, 1)],
                vec![(2, 1, 4)],
                vec![(2, 5, 2), (3, 0, 1)],
            ]
        );
        assert_eq!(bucket_runs(&[2, 2], 4), vec![vec![(0, 0, 2), (1, 0, 2)]]);
        assert_eq!(bucket_runs(&[], 4), Vec::<Vec<Run>>::new());
        assert_eq!(bucket_runs(&[2], 0), vec![vec![(0, 0, 1)], vec![(0, 1, 1)]]);
    }

    #[test]
    fn pieces_cross_bucket_boundaries_intact() {
        let mut c = Solo::default();
        let mut pieces = vec![vec![1.0, 2.0, 3.0], vec![], vec![4.0; 7], vec![5.0]];
        let before = pieces.clone();
        all_reduce_pieces(&mut c, "test", &mut pieces, ReduceDtype::F32, 4);
        assert_eq!(pieces, before);
        let mut pieces = vec![vec![1.0 + 1e-3]];
        all_reduce_pieces(&mut c, "test", &mut pieces, ReduceDtype::Bf16, 4);
        assert_eq!(pieces, vec![vec![1.0]], "bf16 on the wire rounds");
    }
}

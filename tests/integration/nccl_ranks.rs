//! NCCL trainer ranks without a GPU: what runs before NCCL does. The rendezvous through a
//! real Redis (rank 0's id reaches a rank that waits for it, a rank started for another
//! world size refuses, a rank with no rank 0 stops at its deadline), how a build without
//! `cuda` and `run` refuse NCCL ranks, and a `--world` that disagrees with `mpirun`'s.

use crate::common::{bin, redis_bus, redis_url, unique_ns};
use rlstream::collective::rendezvous;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rendezvous_hands_rank_0s_id_to_the_others_through_redis() {
    let bus = redis_bus().await;
    let ns = unique_ns("rendezvous");
    let key = rendezvous::key(&ns, "job-7");
    let waiting = {
        let (bus, key) = (bus.clone(), key.clone());
        tokio::spawn(async move {
            rendezvous::take(bus.as_ref(), &key, 2, Duration::from_secs(20)).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id: Vec<u8> = (0..128).collect();
    rendezvous::offer(bus.as_ref(), &key, 2, &id).await.unwrap();
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        id,
        "the waiting rank got rank 0's id"
    );
    let e = rendezvous::take(bus.as_ref(), &key, 4, Duration::from_secs(1))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 0 was started for 2 ranks and this rank for 4"),
        "{e}"
    );
    rendezvous::withdraw(bus.as_ref(), &key).await;
    let started = Instant::now();
    let e = rendezvous::take(bus.as_ref(), &key, 2, Duration::from_millis(500))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the deadline holds"
    );
    assert!(
        e.contains(&format!("no rendezvous id from rank 0 under {key} within")),
        "{e}"
    );
}

fn refused(args: &[&str]) -> String {
    let out = bin().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} ran");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Without `--features cuda` NCCL ranks stop at once with what to build; `run` never
/// takes NCCL ranks; a rank index past the world is refused.
#[cfg(not(feature = "cuda"))]
#[test]
fn nccl_ranks_refuse_what_they_cannot_run() {
    let ns = unique_ns("nccl-refuse");
    let url = redis_url();
    let train = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--model",
            "nowhere",
            "--redis",
            &url,
            "--namespace",
            &ns,
        ];
        a.extend_from_slice(extra);
        refused(&a)
    };
    let e = train(&["--world", "2", "--rank", "1"]);
    assert!(
        e.contains("2 trainer ranks over NCCL need a build with `--features cuda`"),
        "{e}"
    );
    let e = train(&["--collective", "nccl", "--world", "1"]);
    assert!(e.contains("1 trainer ranks over NCCL need a build"), "{e}");
    let e = train(&["--world", "2", "--rank", "2"]);
    assert!(e.contains("rank 2 is not below the world size 2"), "{e}");
    let e = refused(&["run", "--world", "2", "--rank", "1", "--steps", "1"]);
    assert!(
        e.contains("`rlstream run` runs trainer ranks under mpirun only"),
        "{e}"
    );
}

/// `--world` must agree with the ranks `mpirun` started.
#[cfg(feature = "mpi")]
#[test]
fn a_world_size_that_disagrees_with_mpirun_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::tiny_llama(dir.path(), 3);
    let ns = unique_ns("world-refuse");
    let model = dir.path().join("model");
    let args: Vec<String> = [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--world",
        "3",
        "--redis",
        &redis_url(),
        "--namespace",
        &ns,
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    let out = crate::common::mpirun(&[(2, args)]).output().unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("--world 3 but the launcher started 2 ranks"),
        "{e}"
    );
}

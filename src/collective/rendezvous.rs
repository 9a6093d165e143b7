//! How NCCL ranks find each other without `mpirun`: rank 0 creates NCCL's 128-byte unique
//! id and writes it under the namespace on the bus (Redis), the other ranks read it, each
//! within a deadline, and every rank checks that it was started for the same number of
//! ranks. Rank 0 removes the id once every rank has joined, so a later launch under the
//! same namespace and rendezvous name never reads it.

use super::contract::CollectiveError;
use crate::bus::Bus;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// What rank 0 writes.
#[derive(Debug, Serialize, Deserialize)]
struct Offer {
    world: usize,
    #[serde(with = "serde_bytes")]
    id: Vec<u8>,
}

/// The key of the rendezvous `name` under `namespace`.
pub fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}:train:rendezvous:{name}")
}

/// Rank 0: writes `id` for the ranks of a `world`-rank job.
pub async fn offer(
    bus: &dyn Bus,
    key: &str,
    world: usize,
    id: &[u8],
) -> Result<(), CollectiveError> {
    let offer = Offer {
        world,
        id: id.to_vec(),
    };
    let bytes = rmp_serde::to_vec(&offer).map_err(|e| CollectiveError::Init(e.to_string()))?;
    bus.put_blobs(&[(key.to_string(), Bytes::from(bytes))])
        .await
        .map_err(|e| CollectiveError::Init(format!("cannot write the rendezvous {key}: {e}")))
}

/// Rank 0, once every rank joined: removes the id.
pub async fn withdraw(bus: &dyn Bus, key: &str) {
    if let Err(e) = bus.delete(&[key.to_string()]).await {
        tracing::warn!(key, error = %e, "cannot remove the rendezvous id; it is replaced at the next start");
    }
}

/// Any other rank: rank 0's id for a `world`-rank job, polled until `timeout`.
pub async fn take(
    bus: &dyn Bus,
    key: &str,
    world: usize,
    timeout: Duration,
) -> Result<Vec<u8>, CollectiveError> {
    let started = Instant::now();
    loop {
        let found = bus
            .get_blobs(&[key.to_string()])
            .await
            .map_err(|e| CollectiveError::Init(format!("cannot read the rendezvous {key}: {e}")))?;
        if let Some(bytes) = found.into_iter().next().flatten() {
            let offer: Offer =
                rmp_serde::from_slice(&bytes).map_err(|e| CollectiveError::Garbled {
                    rank: 0,
                    what: "rendezvous id",
                    detail: e.to_string(),
                })?;
            if offer.world != world {
                return Err(CollectiveError::Init(format!(
                    "rank 0 was started for {} ranks and this rank for {world} (--world, or the \
                     launcher's WORLD_SIZE / SLURM_NTASKS): start every rank with one world size",
                    offer.world
                )));
            }
            return Ok(offer.id);
        }
        if started.elapsed() >= timeout {
            return Err(CollectiveError::Init(format!(
                "no rendezvous id from rank 0 under {key} within {:.0} s: is rank 0 running \
                 with the same --redis, --namespace and --rendezvous?",
                timeout.as_secs_f64()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::MemoryBus;

    #[tokio::test]
    async fn the_id_reaches_ranks_of_the_same_world_within_the_deadline() {
        let bus = MemoryBus::new();
        let k = key("ns", "job-1");
        let short = Duration::from_millis(200);
        let e = take(&bus, &k, 2, short).await.unwrap_err().to_string();
        assert!(
            e.contains("no rendezvous id from rank 0 under ns:train:rendezvous:job-1 within"),
            "{e}"
        );
        offer(&bus, &k, 2, &[7u8; 128]).await.unwrap();
        assert_eq!(take(&bus, &k, 2, short).await.unwrap(), vec![7u8; 128]);
        let e = take(&bus, &k, 3, short).await.unwrap_err().to_string();
        assert!(
            e.contains("rank 0 was started for 2 ranks and this rank for 3"),
            "{e}"
        );
        withdraw(&bus, &k).await;
        assert!(take(&bus, &k, 2, short).await.is_err(), "withdrawn");
    }
}

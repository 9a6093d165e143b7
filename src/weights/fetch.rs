//! Reading what the trainer published: the newest announce, and a version object fetched
//! from its store and checked against the announced size and checksum before anyone uses
//! it (an implausible announce is refused before anything is allocated).

use super::format::is_full_format;
use super::{BlobStore, MAX_CHUNKS, MAX_WEIGHTS_BYTES, RedisStore, WeightsError};
use crate::bus::{RangeBound, SharedBus, Topology};
use crate::model::ModelError;
use crate::model::tensors::checksum;
use crate::roles::Stream;
use crate::schema::{self, WeightsAnnounce};

/// The newest weights announce on the weights stream, if any. The last entry is the newest:
/// versions only go up (see `stages::train::run` on resume).
pub async fn newest_announce(
    bus: &dyn crate::bus::Bus,
    topo: &Topology,
) -> Result<Option<WeightsAnnounce>, WeightsError> {
    let stream = topo.key(Stream::Weights);
    let Some(last) = bus.stats(&stream).await?.last_id else {
        return Ok(None);
    };
    let entries = bus
        .range(&stream, RangeBound::Inclusive(last), RangeBound::Open, 1)
        .await?;
    Ok(entries
        .first()
        .and_then(|e| schema::decode::<WeightsAnnounce>(&e.payload).ok()))
}

/// Refuses an announce whose object no real model has, before anything is allocated.
fn check_plausible(a: &WeightsAnnounce) -> Result<(), WeightsError> {
    let object = a.object_bytes();
    if a.bytes > MAX_WEIGHTS_BYTES
        || object > MAX_WEIGHTS_BYTES
        || a.chunks > MAX_CHUNKS
        || u64::from(a.chunks) > object.max(1)
    {
        return Err(WeightsError::Implausible {
            version: a.version,
            bytes: a.bytes.max(object),
            chunks: a.chunks,
        });
    }
    Ok(())
}

/// Fetches the object of an announce from `store` and checks its size and checksum.
pub async fn fetch_object(
    store: &dyn BlobStore,
    a: &WeightsAnnounce,
) -> Result<Vec<u8>, WeightsError> {
    check_plausible(a)?;
    let blob = store.get(a.version, a.chunks).await?;
    let expected = a.object_bytes();
    if blob.len() as u64 != expected {
        return Err(WeightsError::Size {
            version: a.version,
            expected,
            found: blob.len() as u64,
        });
    }
    let found = checksum(&blob);
    if found != a.object_checksum() {
        return Err(WeightsError::Checksum {
            version: a.version,
            expected: a.object_checksum().to_string(),
            found,
        });
    }
    Ok(blob)
}

/// Fetches and verifies a whole version kept in Redis chunks.
pub async fn fetch(
    bus: &SharedBus,
    topo: &Topology,
    a: &WeightsAnnounce,
) -> Result<Vec<u8>, WeightsError> {
    if !is_full_format(&a.format) {
        return Err(WeightsError::Format {
            version: a.version,
            format: a.format.clone(),
        });
    }
    let store = RedisStore {
        bus: bus.clone(),
        topo: topo.clone(),
        chunk_bytes: 1,
    };
    fetch_object(&store, a).await
}

/// Checks assembled bytes against the whole-version checksum of their announce.
pub(crate) async fn verify(a: &WeightsAnnounce, bytes: Vec<u8>) -> Result<Vec<u8>, WeightsError> {
    let (version, expected) = (a.version, a.checksum.clone());
    tokio::task::spawn_blocking(move || {
        let found = checksum(&bytes);
        if found == expected {
            Ok(bytes)
        } else {
            Err(WeightsError::Checksum {
                version,
                expected,
                found,
            })
        }
    })
    .await
    .map_err(|e| ModelError::Unsupported(format!("checksum task failed: {e}")))?
}

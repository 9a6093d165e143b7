//! A generator's view of a weights announce: arbitrary announce bytes, and arbitrary chunk
//! bytes on the bus, through decoding and `weights::fetch` (limits, size, checksum). An
//! error or a verified blob, never a panic and never an allocation the announce dictates.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rlstream::bus::{Bus, MemoryBus, SharedBus, Topology};
use rlstream::schema::{self, WeightsAnnounce};
use std::sync::{Arc, OnceLock};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    // [announce length: u16 LE][announce bytes][chunk bytes...]
    if data.len() < 2 {
        return;
    }
    let n = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
    let (announce, rest) = data[2..].split_at(n);
    let Ok(a) = schema::decode::<WeightsAnnounce>(announce) else {
        return;
    };
    let topo = Topology::default();
    let bus: SharedBus = Arc::new(MemoryBus::new());
    runtime().block_on(async {
        // Up to 4 chunks of the remaining bytes, as a publisher would have written them.
        let chunks = a.chunks.min(4) as usize;
        let size = rest.len().div_ceil(chunks.max(1)).max(1);
        let blobs: Vec<(String, Bytes)> = rest
            .chunks(size)
            .take(chunks)
            .enumerate()
            .map(|(i, c)| (topo.weights_chunk_key(a.version, i as u32), Bytes::copy_from_slice(c)))
            .collect();
        bus.put_blobs(&blobs).await.expect("memory bus");
        if let Ok(blob) = rlstream::weights::fetch(&bus, &topo, &a).await {
            assert_eq!(blob.len() as u64, a.bytes);
        }
    });
});

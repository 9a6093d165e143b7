//! Every message decoder on arbitrary bytes: an error or a message, never a panic; and a
//! message that decodes re-encodes to bytes that decode to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rlstream::schema::{
    self, DeadLetter, Event, Message, Prompt, RolloutGroup, ScoredGroup, WeightsAnnounce,
};

fn round_trip<M: Message + PartialEq + std::fmt::Debug>(data: &[u8]) {
    if let Ok(m) = schema::decode_limited::<M>(data, 1 << 20) {
        let again = schema::encode(&m).expect("a decoded message encodes");
        let back = schema::decode::<M>(&again).expect("a re-encoded message decodes");
        assert_eq!(back, m);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<Prompt>(data);
    round_trip::<RolloutGroup>(data);
    round_trip::<ScoredGroup>(data);
    round_trip::<WeightsAnnounce>(data);
    round_trip::<DeadLetter>(data);
    round_trip::<Event>(data);
});

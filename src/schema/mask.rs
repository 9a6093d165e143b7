//! Sampling masks on the wire: the ids top-k/top-p kept at each step.
//!
//! In memory a [`SamplingMask`] is CSR: the ids kept at step `i` are
//! `ids[offsets[i]..offsets[i + 1]]`. On the wire it takes one of two forms:
//!
//! - **Kept sets, packed** (RolloutGroup 3.0, ScoredGroup 4.0, what this build writes): one
//!   MessagePack `bin` holding, for each step in order, the set's size and then its ids in
//!   ascending order, as unsigned LEB128 varints: the first id as it is, each later one as
//!   its gap to the previous id minus one. Ids that sit together in the vocabulary cost one
//!   byte each; at top-k 50 over a 151,936-token vocabulary the measured cost is about 2.2
//!   bytes per kept id against 4 (BENCHMARKS.md, "Message size").
//! - **CSR** (before 3.0, still read): a map `{offsets, ids}` of packed little-endian u32s.
//!
//! A set is a set: encoding sorts each step's ids and drops repeats, so a CSR mask written
//! by another producer in any order re-encodes to the same kept sets.

use super::Tokens;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Ragged per-step id sets in CSR form: the ids kept at step `i` are
/// `ids[offsets[i]..offsets[i + 1]]`, so `offsets` has one more entry than there are tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingMask {
    pub offsets: Tokens,
    pub ids: Tokens,
}

impl SamplingMask {
    /// The ids kept at step `i`.
    pub fn step(&self, i: usize) -> &[u32] {
        &self.ids[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    /// Steps in the mask.
    pub fn steps(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// The packed wire form (see the module docs).
    pub fn pack(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.ids.len() * 2 + self.steps());
        let mut sorted = Vec::new();
        for i in 0..self.steps() {
            let mut set = self.step(i);
            if set.windows(2).any(|w| w[1] <= w[0]) {
                sorted.clear();
                sorted.extend_from_slice(set);
                sorted.sort_unstable();
                sorted.dedup();
                set = &sorted;
            }
            put_varint(&mut out, set.len() as u64);
            let mut prev: Option<u32> = None;
            for &id in set {
                put_varint(&mut out, u64::from(prev.map_or(id, |p| id - p - 1)));
                prev = Some(id);
            }
        }
        out
    }

    /// Reads the packed wire form; says what is wrong with bytes that are not one.
    pub fn unpack(bytes: &[u8]) -> Result<SamplingMask, String> {
        let mut at = 0;
        let mut offsets = vec![0u32];
        let mut ids: Vec<u32> = Vec::new();
        while at < bytes.len() {
            let step = offsets.len() - 1;
            let n = get_varint(bytes, &mut at).map_err(|e| format!("step {step}: size {e}"))?;
            // Every id takes at least one byte: a size past what is left is corrupt (and
            // must not be allowed to reserve memory).
            if n > (bytes.len() - at) as u64 {
                return Err(format!(
                    "step {step}: {n} ids announced, {} bytes left",
                    bytes.len() - at
                ));
            }
            let mut prev: Option<u32> = None;
            for _ in 0..n {
                let v = get_varint(bytes, &mut at).map_err(|e| format!("step {step}: id {e}"))?;
                let id = match prev {
                    None => v,
                    Some(p) => u64::from(p) + v + 1,
                };
                let id = u32::try_from(id).map_err(|_| format!("step {step}: id {id} past u32"))?;
                ids.push(id);
                prev = Some(id);
            }
            let end = u32::try_from(ids.len()).map_err(|_| "more than 2^32 ids".to_string())?;
            offsets.push(end);
        }
        Ok(SamplingMask {
            offsets: offsets.into(),
            ids: ids.into(),
        })
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(bytes: &[u8], at: &mut usize) -> Result<u64, &'static str> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&b) = bytes.get(*at) else {
            return Err("cut short");
        };
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("longer than 10 bytes")
}

impl Serialize for SamplingMask {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.pack())
    }
}

/// A mask in the CSR wire form written before 3.0 (a map of packed u32s), still read; for
/// tools that need to write or measure that form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CsrMask {
    pub offsets: Tokens,
    pub ids: Tokens,
}

impl From<&SamplingMask> for CsrMask {
    fn from(m: &SamplingMask) -> Self {
        CsrMask {
            offsets: m.offsets.clone(),
            ids: m.ids.clone(),
        }
    }
}

struct MaskVisitor;

impl<'de> Visitor<'de> for MaskVisitor {
    type Value = SamplingMask;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("packed kept sets (bin) or a CSR map {offsets, ids}")
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<SamplingMask, E> {
        SamplingMask::unpack(v).map_err(E::custom)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<SamplingMask, A::Error> {
        let csr = CsrMask::deserialize(de::value::MapAccessDeserializer::new(map))?;
        Ok(SamplingMask {
            offsets: csr.offsets,
            ids: csr.ids,
        })
    }
}

impl<'de> Deserialize<'de> for SamplingMask {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MaskVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(sets: &[&[u32]]) -> SamplingMask {
        let mut offsets = vec![0u32];
        let mut ids = Vec::new();
        for s in sets {
            ids.extend_from_slice(s);
            offsets.push(ids.len() as u32);
        }
        SamplingMask {
            offsets: offsets.into(),
            ids: ids.into(),
        }
    }

    #[test]
    fn packed_sets_round_trip_and_cost_a_byte_per_close_id() {
        let m = mask(&[&[0, 1, 2, 3], &[7], &[], &[151_935, 200_000, u32::MAX]]);
        let bytes = m.pack();
        assert_eq!(SamplingMask::unpack(&bytes).unwrap(), m);
        // Four adjacent ids: a size byte and four one-byte ids.
        assert_eq!(&bytes[..5], &[4, 0, 0, 0, 0]);
    }

    #[test]
    fn sets_are_sorted_and_deduplicated_on_the_wire() {
        let m = mask(&[&[5, 1, 5, 3]]);
        assert_eq!(
            SamplingMask::unpack(&m.pack()).unwrap(),
            mask(&[&[1, 3, 5]])
        );
    }

    #[test]
    fn corrupt_packed_sets_are_refused_with_the_step() {
        // A size with its continuation bit set and nothing after it.
        assert!(
            SamplingMask::unpack(&[0x80])
                .unwrap_err()
                .contains("cut short")
        );
        // 100 ids announced, one byte left.
        let e = SamplingMask::unpack(&[1, 0, 100, 0]).unwrap_err();
        assert!(e.contains("step 1") && e.contains("100 ids"), "{e}");
        // An id past u32.
        let e = SamplingMask::unpack(&[1, 0xff, 0xff, 0xff, 0xff, 0x7f]).unwrap_err();
        assert!(e.contains("past u32"), "{e}");
    }
}

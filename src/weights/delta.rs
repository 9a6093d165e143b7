//! Delta versions: the XOR of a version's bytes with its base's, compressed with zstd.
//!
//! Two nearby versions of a safetensors blob have the same header and the same layout, and
//! most of their values are bit-identical (in bf16 at RL learning rates, nearly all), so the
//! XOR is mostly zero bytes and compresses to a small fraction of the version. Both sides
//! stream in 1 MiB pieces: no XOR buffer the size of the model is ever built.

use std::io::{Read, Write};

/// zstd level: the fastest levels already remove the runs of zero bytes that make up most
/// of a delta; higher ones cost encode time for little.
pub const ZSTD_LEVEL: i32 = 1;

const PIECE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("delta base has {base} bytes and the version {version}: not the same layout")]
    Length { base: usize, version: usize },
    #[error("delta does not decompress: {0}")]
    Corrupt(String),
    #[error("delta decompresses to {found} bytes or more, its base has {expected}")]
    Size { expected: usize, found: usize },
}

/// `zstd(base XOR next)`; `None` when the two are not the same length (a changed layout
/// needs a full version).
pub fn encode(base: &[u8], next: &[u8]) -> Option<Vec<u8>> {
    if base.len() != next.len() {
        return None;
    }
    let mut enc = zstd::stream::Encoder::new(Vec::new(), ZSTD_LEVEL).ok()?;
    let mut piece = vec![0u8; PIECE.min(base.len())];
    for (a, b) in base.chunks(PIECE).zip(next.chunks(PIECE)) {
        let out = &mut piece[..a.len()];
        xor_into(out, a, b);
        enc.write_all(out).ok()?;
    }
    enc.finish().ok()
}

/// Applies a delta to `base` in place: afterwards `base` holds the version the delta was
/// made for. On error `base` may be partly changed and must be discarded.
pub fn apply(base: &mut [u8], delta: &[u8]) -> Result<(), DeltaError> {
    let mut dec =
        zstd::stream::Decoder::new(delta).map_err(|e| DeltaError::Corrupt(e.to_string()))?;
    let mut piece = vec![0u8; PIECE.min(base.len().max(1))];
    let mut at = 0;
    loop {
        let n = dec
            .read(&mut piece)
            .map_err(|e| DeltaError::Corrupt(e.to_string()))?;
        if n == 0 {
            break;
        }
        if at + n > base.len() {
            return Err(DeltaError::Size {
                expected: base.len(),
                found: at + n,
            });
        }
        for (d, x) in base[at..at + n].iter_mut().zip(&piece[..n]) {
            *d ^= x;
        }
        at += n;
    }
    if at != base.len() {
        return Err(DeltaError::Size {
            expected: base.len(),
            found: at,
        });
    }
    Ok(())
}

fn xor_into(out: &mut [u8], a: &[u8], b: &[u8]) {
    // Eight bytes at a time; the compiler vectorises this loop.
    let (o8, o_rest) = out.as_chunks_mut::<8>();
    let (a8, a_rest) = a.as_chunks::<8>();
    let (b8, b_rest) = b.as_chunks::<8>();
    for ((o, x), y) in o8.iter_mut().zip(a8).zip(b8) {
        *o = (u64::from_ne_bytes(*x) ^ u64::from_ne_bytes(*y)).to_ne_bytes();
    }
    for ((o, x), y) in o_rest.iter_mut().zip(a_rest).zip(b_rest) {
        *o = x ^ y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    #[test]
    fn round_trip_across_pieces() {
        let base = bytes(3 * PIECE + 13, 1);
        let mut next = base.clone();
        for i in (0..next.len()).step_by(997) {
            next[i] ^= 0x5a;
        }
        let d = encode(&base, &next).unwrap();
        assert!(d.len() < base.len() / 20, "{} bytes", d.len());
        let mut got = base.clone();
        apply(&mut got, &d).unwrap();
        assert_eq!(got, next);
    }

    #[test]
    fn wrong_base_or_garbage_is_an_error() {
        let base = bytes(1000, 2);
        let next = bytes(1000, 3);
        assert!(encode(&base, &next[..999]).is_none());
        let d = encode(&base, &next).unwrap();
        let mut short = base[..999].to_vec();
        assert!(matches!(
            apply(&mut short, &d),
            Err(DeltaError::Size { .. })
        ));
        let mut long = [base.clone(), vec![0]].concat();
        assert!(matches!(apply(&mut long, &d), Err(DeltaError::Size { .. })));
        let mut b = base.clone();
        assert!(matches!(
            apply(&mut b, b"not zstd at all"),
            Err(DeltaError::Corrupt(_))
        ));
    }
}

//! Delta versions: the XOR of a version's bytes with its base's, compressed with zstd.
//!
//! Two nearby versions of a safetensors blob have the same header and the same layout, and
//! most of their values are bit-identical (in bf16 at RL learning rates, nearly all), so the
//! XOR is mostly zero bytes and compresses to a small fraction of the version.
//!
//! The version is cut into segments of [`SEGMENT`] bytes, each XORed and compressed as its
//! own zstd frame, so both sides use every core, no XOR buffer the size of the model is
//! built, and a publisher can write each frame as soon as it is compressed. Layout
//! (little-endian), each frame after its length:
//!
//! ```text
//! "RLX2" | total: u64 | segment: u64 | frames: u32 | (length: u64 | frame) × frames
//! ```
//!
//! The first layout (`"RLXD"`, every length in the header before the frames) is still read.

use rayon::prelude::*;

/// zstd level: the fastest levels already remove the runs of zero bytes that make up most
/// of a delta; higher ones cost encode time for little.
pub const ZSTD_LEVEL: i32 = 1;

/// Bytes per independently compressed segment.
pub const SEGMENT: usize = 16 << 20;

const MAGIC: &[u8; 4] = b"RLX2";
const MAGIC_V1: &[u8; 4] = b"RLXD";
/// Bytes before the first frame's length.
pub const HEADER: usize = 4 + 8 + 8 + 4;

#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("delta does not decompress: {0}")]
    Corrupt(String),
    #[error("delta is for {found} bytes, its base has {expected}")]
    Size { expected: usize, found: usize },
    #[error("delta changes the version's header: the tensors' names, shapes or dtype changed")]
    Layout,
}

/// `zstd(base XOR next)` in segments; `None` when the two are not the same length (a
/// changed layout needs a full version).
pub fn encode(base: &[u8], next: &[u8]) -> Option<Vec<u8>> {
    encode_with(base, next, SEGMENT)
}

fn encode_with(base: &[u8], next: &[u8], segment: usize) -> Option<Vec<u8>> {
    if base.len() != next.len() {
        return None;
    }
    let frames: Vec<Vec<u8>> = base
        .par_chunks(segment)
        .zip(next.par_chunks(segment))
        .map(|(a, b)| compress_xor(a, b))
        .collect::<Result<_, _>>()
        .ok()?;
    let mut out = header(base.len(), segment);
    for f in &frames {
        out.extend_from_slice(&frame_length(f));
        out.extend_from_slice(f);
    }
    Some(out)
}

/// The bytes a delta of a `total`-byte version in segments of `segment` starts with.
pub fn header(total: usize, segment: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(total as u64).to_le_bytes());
    out.extend_from_slice(&(segment as u64).to_le_bytes());
    out.extend_from_slice(&(total.div_ceil(segment) as u32).to_le_bytes());
    out
}

/// The length a frame is written after.
pub fn frame_length(frame: &[u8]) -> [u8; 8] {
    (frame.len() as u64).to_le_bytes()
}

/// One segment's frame: `zstd(a XOR b)`.
pub fn compress_xor(a: &[u8], b: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut x = vec![0u8; a.len()];
    xor_into(&mut x, a, b);
    zstd::bulk::compress(&x, ZSTD_LEVEL)
}

/// Where a delta's frames are: the version's size, the segment size and each frame's byte
/// range in the delta, checked against each other.
#[derive(Debug)]
pub struct Frames {
    pub total: usize,
    pub segment: usize,
    pub spans: Vec<(usize, usize)>,
}

impl Frames {
    /// The byte range of segment `i` in the version.
    pub fn segment_range(&self, i: usize) -> (usize, usize) {
        let a = i * self.segment;
        (a, (a + self.segment).min(self.total))
    }
}

/// Reads a delta's frame table (either layout).
pub fn frames(delta: &[u8]) -> Result<Frames, DeltaError> {
    let corrupt = |why: &str| DeltaError::Corrupt(why.to_string());
    if delta.len() < HEADER || (&delta[..4] != MAGIC && &delta[..4] != MAGIC_V1) {
        return Err(corrupt("no delta header"));
    }
    let u64_at = |at: usize| -> Result<u64, DeltaError> {
        let b = delta
            .get(at..at + 8)
            .ok_or_else(|| corrupt("a frame length runs past the end"))?;
        let mut x = [0u8; 8];
        x.copy_from_slice(b);
        Ok(u64::from_le_bytes(x))
    };
    let total = usize::try_from(u64_at(4)?).map_err(|_| corrupt("version size"))?;
    let segment = usize::try_from(u64_at(12)?)
        .ok()
        .filter(|s| *s > 0)
        .ok_or_else(|| corrupt("segment size 0"))?;
    let mut n = [0u8; 4];
    n.copy_from_slice(&delta[20..24]);
    let count = u32::from_le_bytes(n) as usize;
    if count != total.div_ceil(segment) || count > delta.len() {
        return Err(corrupt("frame count does not match the sizes"));
    }
    let v1 = &delta[..4] == MAGIC_V1;
    let mut spans = Vec::with_capacity(count);
    let mut at = if v1 { HEADER + 8 * count } else { HEADER };
    for i in 0..count {
        let len = if v1 {
            u64_at(HEADER + 8 * i)?
        } else {
            let l = u64_at(at)?;
            at += 8;
            l
        };
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| at.checked_add(l))
            .filter(|e| *e <= delta.len())
            .ok_or_else(|| corrupt("a frame runs past the end"))?;
        spans.push((at, end));
        at = end;
    }
    if at != delta.len() {
        return Err(corrupt("bytes after the last frame"));
    }
    Ok(Frames {
        total,
        segment,
        spans,
    })
}

/// Decompresses one frame into `out`, which must be exactly its segment's size.
pub fn decompress_into(
    z: &mut zstd::bulk::Decompressor<'static>,
    frame: &[u8],
    out: &mut [u8],
) -> Result<(), DeltaError> {
    let n = z
        .decompress_to_buffer(frame, out)
        .map_err(|e| DeltaError::Corrupt(e.to_string()))?;
    if n != out.len() {
        return Err(DeltaError::Corrupt(format!(
            "a segment decompresses to {n} bytes, not {}",
            out.len()
        )));
    }
    Ok(())
}

/// Applies a delta to `base` in place: afterwards `base` holds the version the delta was
/// made for. On error `base` may be partly changed and must be discarded.
pub fn apply(base: &mut [u8], delta: &[u8]) -> Result<(), DeltaError> {
    let f = frames(delta)?;
    if f.total != base.len() {
        return Err(DeltaError::Size {
            expected: base.len(),
            found: f.total,
        });
    }
    base.par_chunks_mut(f.segment)
        .zip(f.spans.par_iter())
        .try_for_each_init(
            || (zstd::bulk::Decompressor::new(), Vec::new()),
            |(z, x), (out, &(from, to))| {
                let z = z.as_mut().map_err(|e| DeltaError::Corrupt(e.to_string()))?;
                x.resize(out.len(), 0);
                decompress_into(z, &delta[from..to], x)?;
                xor_in_place(out, x);
                Ok(())
            },
        )
}

/// `out ^= x`.
pub fn xor_in_place(out: &mut [u8], x: &[u8]) {
    let (o8, o_rest) = out.as_chunks_mut::<8>();
    let (x8, x_rest) = x.as_chunks::<8>();
    for (o, y) in o8.iter_mut().zip(x8) {
        *o = (u64::from_ne_bytes(*o) ^ u64::from_ne_bytes(*y)).to_ne_bytes();
    }
    for (o, y) in o_rest.iter_mut().zip(x_rest) {
        *o ^= y;
    }
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
    fn round_trip_across_segments() {
        let base = bytes(3 * 4096 + 13, 1);
        let mut next = base.clone();
        for i in (0..next.len()).step_by(97) {
            next[i] ^= 0x5a;
        }
        let d = encode_with(&base, &next, 4096).unwrap();
        assert!(d.len() < base.len() / 4, "{} bytes", d.len());
        let mut got = base.clone();
        apply(&mut got, &d).unwrap();
        assert_eq!(got, next);
        let one = encode(&base, &next).unwrap();
        let mut got = base.clone();
        apply(&mut got, &one).unwrap();
        assert_eq!(got, next);
    }

    #[test]
    fn wrong_base_or_garbage_is_an_error() {
        let base = bytes(10_000, 2);
        let next = bytes(10_000, 3);
        assert!(encode(&base, &next[..9_999]).is_none());
        let d = encode_with(&base, &next, 4096).unwrap();
        let mut short = base[..9_999].to_vec();
        assert!(matches!(
            apply(&mut short, &d),
            Err(DeltaError::Size { .. })
        ));
        let mut b = base.clone();
        assert!(matches!(
            apply(&mut b, b"not a delta at all, not even close"),
            Err(DeltaError::Corrupt(_))
        ));
        for cut in [HEADER, d.len() - 1] {
            let mut b = base.clone();
            assert!(
                matches!(apply(&mut b, &d[..cut]), Err(DeltaError::Corrupt(_))),
                "cut at {cut}"
            );
        }
        let mut flipped = d.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 0xff;
        let mut b = base.clone();
        assert!(apply(&mut b, &flipped).is_err() || b != next);
    }
}

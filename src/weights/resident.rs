//! A version's bytes applied to the values a generation model holds, in place: a delta XORed
//! into them, or a whole version written over them, and the checksum of the version they
//! now make, all without building the version's bytes.
//!
//! The values are each parameter's, in Hugging Face order ([`Policy::take_values`]): bf16
//! bits for a weight the model keeps in 16 bits, f32 otherwise. A bf16 version's value is
//! the top half of an f32, so a bf16 delta applies to an f32 value as its bits shifted up,
//! and an f32 value that is not a bf16 makes a checksum that cannot match.
//!
//! [`Policy::take_values`]: crate::model::Policy::take_values

use super::delta::{self, DeltaError, Frames};
pub use super::error::ResidentError;
use super::layout::{Layout, Placed};
use crate::model::params::HostParam;
use crate::model::storage::HfValues;
use crate::model::tensors::WeightDtype;
use rayon::prelude::*;
use std::collections::HashMap;

/// A parameter's values as one tensor of the layout reads them.
enum Target<'a> {
    /// Bytes of the header: a delta must leave them as they are.
    Header(usize),
    /// bf16 values held as bf16 bits.
    Bits(&'a mut [u16]),
    /// bf16 values held widened to f32.
    Wide(&'a mut [f32]),
    /// f32 values.
    F32(&'a mut [f32]),
}

/// Pairs each tensor of `layout` with its parameter, in layout order, after giving each
/// parameter the storage the version's dtype wants (a linear weight of a bf16 version in
/// 16 bits, everything of an f32 version in f32; one tensor converted at a time).
fn bind<'a>(
    params: &'a mut [HostParam],
    layout: &'a Layout,
) -> Result<Vec<(&'a Placed, &'a mut HostParam)>, ResidentError> {
    if params.len() != layout.tensors.len() {
        return Err(ResidentError::Mismatch(format!(
            "{} parameters, {} tensors",
            params.len(),
            layout.tensors.len()
        )));
    }
    let at: HashMap<&str, usize> = layout
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut bound: Vec<Option<&'a mut HostParam>> = (0..params.len()).map(|_| None).collect();
    for p in params.iter_mut() {
        let i = *at.get(p.name.as_str()).ok_or_else(|| {
            ResidentError::Mismatch(format!("`{}` is not in the version", p.name))
        })?;
        let t = &layout.tensors[i];
        if t.shape != p.shape {
            return Err(ResidentError::Mismatch(format!(
                "`{}` is {:?} in the model and {:?} in the version",
                p.name, p.shape, t.shape
            )));
        }
        let values = std::mem::replace(&mut p.values, HfValues::F32(Vec::new()));
        p.values = match (t.dtype, values, p.linear) {
            (WeightDtype::Bf16, HfValues::F32(v), true) => {
                HfValues::Bf16(v.iter().map(|x| (x.to_bits() >> 16) as u16).collect())
            }
            (WeightDtype::F32, HfValues::Bf16(v), _)
            | (WeightDtype::Bf16, HfValues::Bf16(v), false) => {
                HfValues::F32(HfValues::Bf16(v).into_f32())
            }
            (_, v, _) => v,
        };
        bound[i] = Some(p);
    }
    layout
        .tensors
        .iter()
        .zip(bound)
        .map(|(t, p)| {
            p.map(|p| (t, p))
                .ok_or_else(|| ResidentError::Mismatch(format!("no parameter `{}`", t.name)))
        })
        .collect()
}

fn target<'a>(t: &Placed, p: &'a mut HostParam) -> Target<'a> {
    match (&mut p.values, t.dtype) {
        (HfValues::Bf16(v), _) => Target::Bits(v),
        (HfValues::F32(v), WeightDtype::Bf16) => Target::Wide(v),
        (HfValues::F32(v), WeightDtype::F32) => Target::F32(v),
    }
}

impl Target<'_> {
    /// Bytes per value in the version.
    fn width(&self) -> usize {
        match self {
            Target::Header(_) | Target::Bits(_) | Target::Wide(_) => 2,
            Target::F32(_) => 4,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Target::Header(n) => *n,
            Target::Bits(v) => 2 * v.len(),
            Target::Wide(v) => 2 * v.len(),
            Target::F32(v) => 4 * v.len(),
        }
    }

    /// Splits off the values of the first `bytes` bytes.
    fn split(self, bytes: usize) -> (Self, Self) {
        let n = bytes / self.width();
        match self {
            Target::Header(m) => (Target::Header(bytes), Target::Header(m - bytes)),
            Target::Bits(v) => {
                let (a, b) = v.split_at_mut(n);
                (Target::Bits(a), Target::Bits(b))
            }
            Target::Wide(v) => {
                let (a, b) = v.split_at_mut(n);
                (Target::Wide(a), Target::Wide(b))
            }
            Target::F32(v) => {
                let (a, b) = v.split_at_mut(n);
                (Target::F32(a), Target::F32(b))
            }
        }
    }

    /// Sets each value's bits to `op(its bits, the version's bits in x)`: XOR for a delta,
    /// the version's own bits for a whole version. A bf16 value held widened takes the
    /// version's bits in its top half.
    fn merge(&mut self, x: &[u8], op: impl Fn(u32, u32) -> u32) {
        let le16 = |c: &[u8]| u32::from(u16::from_le_bytes([c[0], c[1]]));
        match self {
            Target::Header(_) => {}
            Target::Bits(v) => {
                for (d, c) in v.iter_mut().zip(x.chunks_exact(2)) {
                    *d = op(u32::from(*d), le16(c)) as u16;
                }
            }
            Target::Wide(v) => {
                for (d, c) in v.iter_mut().zip(x.chunks_exact(2)) {
                    *d = f32::from_bits(op(d.to_bits(), le16(c) << 16));
                }
            }
            Target::F32(v) => {
                for (d, c) in v.iter_mut().zip(x.chunks_exact(4)) {
                    let bits = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    *d = f32::from_bits(op(d.to_bits(), bits));
                }
            }
        }
    }

    /// `self ^= x` (the version's bytes of these values); `false` when a header byte
    /// would change.
    fn xor(&mut self, x: &[u8]) -> bool {
        if let Target::Header(_) = self {
            return x.iter().all(|b| *b == 0);
        }
        self.merge(x, |a, b| a ^ b);
        true
    }

    /// `self = x`.
    fn write(&mut self, x: &[u8]) {
        self.merge(x, |_, b| b);
    }
}

/// The pieces of each segment: where in the segment each starts, and the values it covers.
fn pieces<'a>(
    bound: Vec<(&'a Placed, &'a mut HostParam)>,
    layout: &Layout,
    segment: usize,
) -> Result<Vec<Vec<(usize, Target<'a>)>>, ResidentError> {
    let count = layout.total.div_ceil(segment);
    let mut out: Vec<Vec<(usize, Target<'a>)>> = (0..count).map(|_| Vec::new()).collect();
    let header = (0usize, Target::Header(layout.header.len()));
    let all =
        std::iter::once(header).chain(bound.into_iter().map(|(t, p)| (t.start, target(t, p))));
    for (start, mut rest) in all {
        let mut at = start;
        let end = start + rest.bytes();
        while at < end {
            let s = at / segment;
            let cut = ((s + 1) * segment).min(end);
            if (cut - at) % rest.width() != 0 {
                return Err(ResidentError::Mismatch(
                    "a segment boundary splits a value".into(),
                ));
            }
            let (head, tail) = rest.split(cut - at);
            out[s].push((at - s * segment, head));
            rest = tail;
            at = cut;
        }
    }
    Ok(out)
}

/// XORs `delta` (a delta on the version `params` hold, laid out as `layout`) into `params`.
/// On error the values are partly changed and must be discarded.
pub fn xor_delta(
    params: &mut [HostParam],
    layout: &Layout,
    delta: &[u8],
) -> Result<(), ResidentError> {
    let f: Frames = delta::frames(delta)?;
    if f.total != layout.total {
        return Err(DeltaError::Size {
            expected: layout.total,
            found: f.total,
        }
        .into());
    }
    let pieces = pieces(bind(params, layout)?, layout, f.segment)?;
    pieces.into_par_iter().enumerate().try_for_each_init(
        || (zstd::bulk::Decompressor::new(), Vec::new()),
        |(z, x), (i, pieces)| {
            let z = z.as_mut().map_err(|e| DeltaError::Corrupt(e.to_string()))?;
            let (a, b) = f.segment_range(i);
            x.resize(b - a, 0);
            let (from, to) = f.spans[i];
            delta::decompress_into(z, &delta[from..to], x)?;
            for (at, mut t) in pieces {
                let n = t.bytes();
                if !t.xor(&x[at..at + n]) {
                    return Err(DeltaError::Layout.into());
                }
            }
            Ok(())
        },
    )
}

/// Writes a whole version (`bytes`, laid out as `layout`) over `params`.
pub fn write_version(
    params: &mut [HostParam],
    layout: &Layout,
    bytes: &[u8],
) -> Result<(), ResidentError> {
    if bytes.len() != layout.total || bytes[..layout.header.len()] != layout.header[..] {
        return Err(ResidentError::Mismatch(
            "the version's layout differs".into(),
        ));
    }
    bind(params, layout)?
        .into_par_iter()
        .for_each(|(t, p)| target(t, p).write(&bytes[t.start..t.end]));
    Ok(())
}

/// The checksum of the version `params` make in `layout` (what the publisher announced for
/// it); `None` when a value cannot be in that version (an f32 value that is not a bf16 in a
/// bf16 version).
pub fn checksum(
    params: &mut [HostParam],
    layout: &Layout,
) -> Result<Option<String>, ResidentError> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&layout.header);
    let mut scratch: Vec<u8> = Vec::with_capacity(1 << 16);
    for (t, p) in bind(params, layout)? {
        match target(t, p) {
            Target::Header(_) => {}
            Target::Bits(v) => {
                if cfg!(target_endian = "little") {
                    h.update(bytemuck::cast_slice(v));
                } else {
                    for c in v.chunks(1 << 15) {
                        scratch.clear();
                        scratch.extend(c.iter().flat_map(|x| x.to_le_bytes()));
                        h.update(&scratch);
                    }
                }
            }
            Target::Wide(v) => {
                for c in v.chunks(1 << 15) {
                    if c.iter().any(|x| x.to_bits() & 0xffff != 0) {
                        return Ok(None);
                    }
                    scratch.clear();
                    scratch.extend(
                        c.iter()
                            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()),
                    );
                    h.update(&scratch);
                }
            }
            Target::F32(v) => {
                if cfg!(target_endian = "little") {
                    h.update(bytemuck::cast_slice(v));
                } else {
                    for c in v.chunks(1 << 14) {
                        scratch.clear();
                        scratch.extend(c.iter().flat_map(|x| x.to_le_bytes()));
                        h.update(&scratch);
                    }
                }
            }
        }
    }
    Ok(Some(format!("{:016x}", h.digest())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensors::{HostTensor, TensorMap, checksum as blob_checksum};

    fn tensors(seed: f32) -> TensorMap {
        let mut m = TensorMap::new();
        for (name, shape) in [("w", vec![40, 30]), ("n", vec![30]), ("e", vec![7, 30])] {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|i| ((i as f32) * 0.013 + seed).sin()).collect();
            m.insert(name.to_string(), HostTensor { shape, data });
        }
        m
    }

    /// The values a generation model would hold for `t`: `w` a linear weight.
    fn held(t: &TensorMap, dtype: WeightDtype) -> Vec<HostParam> {
        let bytes = Layout::of_tensors(t, dtype).encode(t).unwrap();
        let exact = crate::model::tensors::safetensors_to_tensors(&bytes, None).unwrap();
        exact
            .into_iter()
            .map(|(name, h)| HostParam {
                linear: name == "w",
                name,
                shape: h.shape,
                values: HfValues::F32(h.data),
            })
            .collect()
    }

    #[test]
    fn deltas_and_versions_apply_in_place_in_both_dtypes() {
        for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
            let (a, b) = (tensors(0.0), tensors(0.001));
            let layout = Layout::of_tensors(&a, dtype);
            let (va, vb) = (layout.encode(&a).unwrap(), layout.encode(&b).unwrap());
            // Segments of 64 bytes: every tensor spans several, and the header too.
            let d = {
                let mut out = delta::header(va.len(), 64);
                for (x, y) in va.chunks(64).zip(vb.chunks(64)) {
                    let f = delta::compress_xor(x, y).unwrap();
                    out.extend_from_slice(&delta::frame_length(&f));
                    out.extend_from_slice(&f);
                }
                out
            };
            let mut p = held(&a, dtype);
            assert_eq!(checksum(&mut p, &layout).unwrap(), Some(blob_checksum(&va)));
            xor_delta(&mut p, &layout, &d).unwrap();
            assert_eq!(checksum(&mut p, &layout).unwrap(), Some(blob_checksum(&vb)));
            if dtype == WeightDtype::Bf16 {
                // The linear weight is now held in 16 bits.
                assert!(p.iter().any(|x| matches!(x.values, HfValues::Bf16(_))));
            }
            let mut q = held(&a, dtype);
            write_version(&mut q, &layout, &vb).unwrap();
            assert_eq!(checksum(&mut q, &layout).unwrap(), Some(blob_checksum(&vb)));
        }
    }

    #[test]
    fn a_changed_header_or_a_foreign_value_is_refused() {
        let (a, b) = (tensors(0.0), tensors(0.5));
        let layout = Layout::of_tensors(&a, WeightDtype::Bf16);
        let va = layout.encode(&a).unwrap();
        let mut vb = layout.encode(&b).unwrap();
        vb[10] ^= 1;
        let d = delta::encode(&va, &vb).unwrap();
        let mut p = held(&a, WeightDtype::Bf16);
        assert!(matches!(
            xor_delta(&mut p, &layout, &d),
            Err(ResidentError::Delta(DeltaError::Layout))
        ));
        // An f32 value that no bf16 version holds makes no checksum.
        let mut p = held(&a, WeightDtype::Bf16);
        if let Some(HfValues::F32(v)) = p.iter_mut().find(|x| x.name == "n").map(|x| &mut x.values)
        {
            v[0] = 1.0 + f32::EPSILON;
        }
        assert_eq!(checksum(&mut p, &layout).unwrap(), None);
        let mut short = held(&a, WeightDtype::Bf16);
        short.pop();
        assert!(matches!(
            xor_delta(&mut short, &layout, &d),
            Err(ResidentError::Mismatch(_))
        ));
    }
}

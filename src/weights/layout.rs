//! Where each tensor of a version lies in its bytes: the safetensors layout this crate
//! publishes (tensors in name order after a header, nothing between them), written segment
//! by segment straight from the trainer's tensors, and read back from a version's header.
//!
//! Both sides derive the same layout from the names, shapes and dtype alone, so a publisher
//! can write any byte range of a version without building the rest, and a generator can map
//! a delta's bytes onto the tensors it holds.

use super::WeightsError;
use crate::model::tensors::{TensorMap, WeightDtype};

/// One tensor of a version: its name, shape, dtype and byte range in the version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: WeightDtype,
    /// Byte offsets in the whole version (header included).
    pub start: usize,
    pub end: usize,
}

/// The layout of a version: its header bytes and where each tensor lies after them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The first bytes of the version: the header's length and the header itself.
    pub header: Vec<u8>,
    /// Tensors by offset.
    pub tensors: Vec<Placed>,
    /// The size of the whole version.
    pub total: usize,
}

/// `x` rounded to bf16 (to nearest, ties to even; a NaN stays a quiet NaN), as
/// `half::bf16::from_f32` and `torch.Tensor.to(torch.bfloat16)` round: written out so the
/// encoder's loop vectorises.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn width(dtype: WeightDtype) -> usize {
    match dtype {
        WeightDtype::F32 => 4,
        WeightDtype::Bf16 => 2,
    }
}

fn st_name(dtype: WeightDtype) -> &'static str {
    match dtype {
        WeightDtype::F32 => "F32",
        WeightDtype::Bf16 => "BF16",
    }
}

impl Layout {
    /// The layout this crate publishes `shapes` (name, shape) in `dtype`: name order, a
    /// header with `format = pt` (so `transformers` reads it) padded with spaces to 8 bytes.
    pub fn of<'a>(
        shapes: impl IntoIterator<Item = (&'a str, &'a [usize])>,
        dtype: WeightDtype,
    ) -> Layout {
        let mut named: Vec<(&str, &[usize])> = shapes.into_iter().collect();
        named.sort_by_key(|(n, _)| *n);
        let mut json = serde_json::Map::new();
        json.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
        let mut at = 0usize;
        let mut spans = Vec::with_capacity(named.len());
        for (name, shape) in &named {
            let n = shape.iter().product::<usize>() * width(dtype);
            json.insert(
                (*name).to_string(),
                serde_json::json!({
                    "dtype": st_name(dtype),
                    "shape": shape,
                    "data_offsets": [at, at + n],
                }),
            );
            spans.push((at, at + n));
            at += n;
        }
        let mut text = serde_json::Value::Object(json).to_string().into_bytes();
        while !text.len().is_multiple_of(8) {
            text.push(b' ');
        }
        let mut header = (text.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&text);
        let data = header.len();
        let tensors = named
            .iter()
            .zip(spans)
            .map(|((name, shape), (a, b))| Placed {
                name: (*name).to_string(),
                shape: shape.to_vec(),
                dtype,
                start: data + a,
                end: data + b,
            })
            .collect();
        Layout {
            header,
            tensors,
            total: data + at,
        }
    }

    /// The layout of `tensors` published in `dtype`.
    pub fn of_tensors(tensors: &TensorMap, dtype: WeightDtype) -> Layout {
        Layout::of(
            tensors
                .iter()
                .map(|(n, t)| (n.as_str(), t.shape.as_slice())),
            dtype,
        )
    }

    /// The layout of a whole version's bytes, read from its header: F32 and BF16 tensors
    /// that fill the bytes after the header without gaps; `None` for anything else (it is
    /// then loaded whole instead of in place).
    pub fn parse(bytes: &[u8]) -> Option<Layout> {
        let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let data = 8usize.checked_add(usize::try_from(n).ok()?)?;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(bytes.get(8..data)?).ok()?;
        let mut tensors = Vec::with_capacity(header.len());
        for (name, info) in &header {
            if name == "__metadata__" {
                continue;
            }
            let dtype = match info["dtype"].as_str()? {
                "F32" => WeightDtype::F32,
                "BF16" => WeightDtype::Bf16,
                _ => return None,
            };
            let shape: Vec<usize> = info["shape"]
                .as_array()?
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<_>>()?;
            let o = info["data_offsets"].as_array()?;
            let a = usize::try_from(o.first()?.as_u64()?).ok()?;
            let b = usize::try_from(o.get(1)?.as_u64()?).ok()?;
            let count = shape
                .iter()
                .try_fold(1usize, |acc, d| acc.checked_mul(*d))?;
            if b < a || b - a != count.checked_mul(width(dtype))? {
                return None;
            }
            tensors.push(Placed {
                name: name.clone(),
                shape,
                dtype,
                start: data.checked_add(a)?,
                end: data.checked_add(b)?,
            });
        }
        tensors.sort_by_key(|t| t.start);
        let mut at = data;
        for t in &tensors {
            if t.start != at {
                return None;
            }
            at = t.end;
        }
        (at == bytes.len()).then(|| Layout {
            header: bytes[..data].to_vec(),
            tensors,
            total: at,
        })
    }

    /// Writes bytes `from..from + out.len()` of the version `tensors` make in this layout
    /// (every tensor of the layout must be in `tensors`, with its shape).
    pub fn write_range(
        &self,
        tensors: &TensorMap,
        from: usize,
        out: &mut [u8],
    ) -> Result<(), WeightsError> {
        let to = from + out.len();
        if from < self.header.len() {
            let end = to.min(self.header.len());
            out[..end - from].copy_from_slice(&self.header[from..end]);
        }
        let first = self.tensors.partition_point(|t| t.end <= from);
        for t in &self.tensors[first..] {
            if t.start >= to {
                break;
            }
            let values = tensors
                .get(&t.name)
                .filter(|h| h.shape == t.shape)
                .ok_or_else(|| WeightsError::Store {
                    store: "encoder",
                    reason: format!("tensor `{}` changed between layout and encoding", t.name),
                })?;
            let (a, b) = (t.start.max(from) - t.start, t.end.min(to) - t.start);
            let w = width(t.dtype);
            let one = |k: usize| -> [u8; 4] {
                let v = values.data[k];
                match t.dtype {
                    WeightDtype::F32 => v.to_le_bytes(),
                    WeightDtype::Bf16 => {
                        let [x, y] = bf16_bits(v).to_le_bytes();
                        [x, y, 0, 0]
                    }
                }
            };
            let at = |byte: usize| t.start + byte - from;
            // Whole values in `lo..hi`; a value cut by the range's ends is written in part.
            let (lo, hi) = (a.div_ceil(w) * w, b / w * w);
            if lo > hi {
                let k = a / w;
                out[at(a)..at(b)].copy_from_slice(&one(k)[a - k * w..b - k * w]);
                continue;
            }
            if a < lo {
                let k = a / w;
                out[at(a)..at(lo)].copy_from_slice(&one(k)[a - k * w..w]);
            }
            let (dst, src) = (&mut out[at(lo)..at(hi)], &values.data[lo / w..hi / w]);
            match t.dtype {
                WeightDtype::F32 => {
                    for (d, v) in dst.as_chunks_mut::<4>().0.iter_mut().zip(src) {
                        *d = v.to_le_bytes();
                    }
                }
                WeightDtype::Bf16 => {
                    for (d, v) in dst.as_chunks_mut::<2>().0.iter_mut().zip(src) {
                        *d = bf16_bits(*v).to_le_bytes();
                    }
                }
            }
            if hi < b {
                out[at(hi)..at(b)].copy_from_slice(&one(hi / w)[..b - hi]);
            }
        }
        Ok(())
    }

    /// The whole version `tensors` make in this layout, written on every core (the
    /// publisher writes it segment by segment instead).
    #[cfg(test)]
    pub fn encode(&self, tensors: &TensorMap) -> Result<Vec<u8>, WeightsError> {
        use rayon::prelude::*;
        let mut out = vec![0u8; self.total];
        out.par_chunks_mut(1 << 20)
            .enumerate()
            .try_for_each(|(i, c)| self.write_range(tensors, i << 20, c))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensors::{HostTensor, safetensors_to_tensors};

    fn tensors() -> TensorMap {
        let mut m = TensorMap::new();
        for (name, shape) in [
            ("b.weight", vec![3, 5]),
            ("a.bias", vec![7]),
            ("c", vec![2]),
        ] {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|i| (i as f32 - 3.3) * 0.37).collect();
            m.insert(name.to_string(), HostTensor { shape, data });
        }
        m
    }

    #[test]
    fn encodes_what_safetensors_reads_and_parses_back() {
        let t = tensors();
        for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
            let layout = Layout::of_tensors(&t, dtype);
            let bytes = layout.encode(&t).unwrap();
            assert_eq!(bytes.len(), layout.total);
            assert_eq!(layout.header.len() % 8, 0);
            assert_eq!(Layout::parse(&bytes).as_ref(), Some(&layout));
            let back = safetensors_to_tensors(&bytes, None).unwrap();
            let want = crate::model::tensors::tensors_to_safetensors_as(&t, dtype).unwrap();
            assert_eq!(back, safetensors_to_tensors(&want, None).unwrap());
            // Any range written alone is those bytes of the whole.
            let mut piece = vec![0u8; 13];
            layout.write_range(&t, 40, &mut piece).unwrap();
            assert_eq!(piece, bytes[40..53]);
        }
    }

    #[test]
    fn bf16_rounding_is_halfs() {
        let mut x = 0x1234_5678u32;
        let special = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
        ];
        let values = special
            .into_iter()
            .chain([f32::NEG_INFINITY, f32::NAN, f32::from_bits(0x7f80_0001)])
            .chain((0..100_000).map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                f32::from_bits(x)
            }));
        for v in values {
            let want = half::bf16::from_f32(v).to_bits();
            assert_eq!(bf16_bits(v), want, "{v:e} ({:#x})", v.to_bits());
        }
    }

    #[test]
    fn a_gap_or_an_unknown_dtype_is_no_layout() {
        let t = tensors();
        let bytes = Layout::of_tensors(&t, WeightDtype::F32).encode(&t).unwrap();
        assert!(Layout::parse(&bytes[..bytes.len() - 1]).is_none());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Layout::parse(&longer).is_none());
        assert!(Layout::parse(b"short").is_none());
        let text = String::from_utf8_lossy(&bytes).replace("\"F32\"", "\"F16\"");
        assert!(Layout::parse(text.as_bytes()).is_none());
    }
}

//! Named host tensors and their bytes: safetensors files and buffers in f32, f16 and bf16,
//! the dtype a checkpoint is written in, and the checksums of a weight version. Nothing here
//! knows the model: the decoder, LoRA adapters and weight publication all read and write
//! through it.

use super::ModelError;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::BTreeMap;
use std::path::Path;

/// A tensor on the host: shape and row-major f32 values.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Named host tensors, in name order.
pub type TensorMap = BTreeMap<String, HostTensor>;

/// The dtype a checkpoint's `model.safetensors` is written in. Computation is f32 either
/// way; bf16 halves the file, and a trainer resumes from its own f32 record.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// 32-bit floats, exactly the trainer's weights.
    F32,
    /// bfloat16, rounded to nearest even from f32 (as `torch.Tensor.to(torch.bfloat16)`).
    Bf16,
}
crate::enum_setting!(WeightDtype);

impl WeightDtype {
    /// The short name (`f32`, `bf16`): a WeightsAnnounce's `dtype`.
    pub fn short_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
        }
    }

    /// The `torch_dtype` of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` matrix, in 32 × 32 tiles so
/// that reads and writes both stay in cache (a 0.5B model's linear weights are 358M values).
pub(crate) fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const TILE: usize = 32;
    let mut out = vec![0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return out;
    }
    // Each band of TILE output rows (input columns) is contiguous: the bands go to the
    // cores in parallel, each written in cache tiles.
    out.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(band, chunk)| {
            let c0 = band * TILE;
            let c1 = (c0 + TILE).min(cols);
            for r0 in (0..rows).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    let row = &data[r * cols..(r + 1) * cols];
                    for c in c0..c1 {
                        chunk[(c - c0) * rows + r] = row[c];
                    }
                }
            }
        });
    out
}

/// One tensor a safetensors header lists: where its bytes start (after the header), its
/// name, dtype, shape and value count, checked against the file's length.
struct HeaderEntry {
    begin: u64,
    name: String,
    dtype: String,
    shape: Vec<usize>,
    count: usize,
}

/// The tensors a safetensors header lists, in file order. `data_start` is where the data
/// begins and `file_len` the file's size; `bad` makes an error naming the file.
fn header_entries(
    header: &serde_json::Map<String, serde_json::Value>,
    data_start: u64,
    file_len: u64,
    bad: impl Fn(String) -> ModelError,
) -> Result<Vec<HeaderEntry>, ModelError> {
    let mut entries = Vec::with_capacity(header.len());
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap_or_default();
        let width = match dtype {
            "F32" => 4,
            "BF16" | "F16" => 2,
            other => {
                return Err(ModelError::Dtype {
                    name: name.clone(),
                    dtype: other.to_string(),
                });
            }
        };
        let shape: Vec<usize> = info["shape"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_u64().map(|d| d as usize))
                    .collect()
            })
            .ok_or_else(|| bad(format!("{name}: no shape")))?;
        let offsets = info["data_offsets"]
            .as_array()
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("{name}: no data_offsets")))?;
        let count: usize = shape.iter().product();
        if offsets.1 < offsets.0
            || offsets.1 - offsets.0 != (count * width) as u64
            || data_start + offsets.1 > file_len
        {
            return Err(bad(format!(
                "{name}: offsets {offsets:?} do not hold {count} {dtype} values inside the file"
            )));
        }
        entries.push(HeaderEntry {
            begin: offsets.0,
            name: name.clone(),
            dtype: dtype.to_string(),
            shape,
            count,
        });
    }
    entries.sort_by_key(|e| e.begin);
    Ok(entries)
}

/// `count` values of `dtype` read from `file` where it stands, widened to f32.
fn read_values(file: &mut std::fs::File, dtype: &str, count: usize) -> std::io::Result<Vec<f32>> {
    use std::io::Read;
    if dtype == "F32" {
        let mut data = vec![0f32; count];
        file.read_exact(bytemuck::cast_slice_mut(&mut data))?;
        if cfg!(target_endian = "big") {
            data.iter_mut()
                .for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
        }
        return Ok(data);
    }
    let mut raw = vec![0u16; count];
    file.read_exact(bytemuck::cast_slice_mut(&mut raw))?;
    Ok(if dtype == "BF16" {
        // bf16 is the top half of an f32: widening is a shift (exact, NaNs kept).
        raw.into_iter()
            .map(|b| f32::from_bits(u32::from(u16::from_le(b)) << 16))
            .collect()
    } else {
        raw.into_iter()
            .map(|b| half::f16::from_bits(u16::from_le(b)).to_f32())
            .collect()
    })
}

/// Reads a safetensors file tensor by tensor, each straight into its f32 buffer: the file
/// is never held whole, so loading needs the model's f32 size plus one tensor (a bf16
/// tensor is read, then widened). Offsets, sizes and dtypes are checked against the header
/// and the file's length before anything is read.
pub fn read_safetensors_file(path: &Path) -> Result<TensorMap, ModelError> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = |reason: String| ModelError::Safetensors {
        path: Some(path.display().to_string()),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|e| ModelError::MissingFile {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let file_len = file
        .metadata()
        .map_err(|source| ModelError::io(path, source))?
        .len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|e| bad(format!("no header: {e}")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > 100 << 20 || 8 + header_len > file_len {
        return Err(bad(format!(
            "header length {header_len} does not fit a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(format!("truncated header: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let data_start = 8 + header_len;
    let mut out = TensorMap::new();
    for e in header_entries(&header, data_start, file_len, bad)? {
        file.seek(SeekFrom::Start(data_start + e.begin))
            .map_err(|source| ModelError::io(path, source))?;
        let data = read_values(&mut file, &e.dtype, e.count)
            .map_err(|err| bad(format!("{}: {err}", e.name)))?;
        out.insert(
            e.name,
            HostTensor {
                shape: e.shape,
                data,
            },
        );
    }
    Ok(out)
}

/// Decodes a safetensors buffer; F32, F16 and BF16 become f32.
pub fn safetensors_to_tensors(bytes: &[u8], path: Option<&Path>) -> Result<TensorMap, ModelError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Safetensors {
        path: path.map(|p| p.display().to_string()),
        reason: e.to_string(),
    })?;
    use rayon::prelude::*;
    let mut out = TensorMap::new();
    for (name, view) in st.tensors() {
        // Widened on every core: a 0.5B-parameter version is a billion values.
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .par_chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => raw
                .par_chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            Dtype::F16 => raw
                .par_chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Dtype {
                    name,
                    dtype: format!("{other:?}"),
                });
            }
        };
        out.insert(
            name,
            HostTensor {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(out)
}

/// Encodes named tensors as one safetensors buffer (f32, `format = pt` metadata so
/// `transformers` accepts it).
pub fn tensors_to_safetensors(tensors: &TensorMap) -> Result<Vec<u8>, ModelError> {
    tensors_to_safetensors_as(tensors, WeightDtype::F32)
}

/// [`tensors_to_safetensors`] in `dtype`.
pub fn tensors_to_safetensors_as(
    tensors: &TensorMap,
    dtype: WeightDtype,
) -> Result<Vec<u8>, ModelError> {
    let bytes: Vec<(&String, Vec<u8>, &Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| {
            let b = match dtype {
                WeightDtype::F32 => bytemuck::cast_slice::<f32, u8>(&t.data).to_vec(),
                WeightDtype::Bf16 => t
                    .data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            (n, b, &t.shape)
        })
        .collect();
    let st_dtype = match dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::Bf16 => Dtype::BF16,
    };
    let views = bytes
        .iter()
        .map(|(n, b, s)| {
            TensorView::new(st_dtype, s.to_vec(), b)
                .map(|v| (n.as_str(), v))
                .map_err(|e| ModelError::Safetensors {
                    path: None,
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(|e| ModelError::Safetensors {
        path: None,
        reason: e.to_string(),
    })
}

/// xxh3-64 of a weight blob as 16 hex digits (the `checksum` of a WeightsAnnounce).
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// xxh3-64 over named host tensors (name, shape, then the f32 values, in name order), as
/// 16 hex digits: the checksum of a version handed over in process.
pub fn tensors_checksum(tensors: &TensorMap) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (name, t) in tensors {
        h.update(name.as_bytes());
        for d in &t.shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(bytemuck::cast_slice(&t.data));
    }
    format!("{:016x}", h.digest())
}

/// A tensor's values on the host as f32.
pub fn host_f32(data: burn::tensor::TensorData) -> Result<Vec<f32>, crate::model::ModelError> {
    data.convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| crate::model::ModelError::HostCopy(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_swaps_rows_and_columns() {
        let (rows, cols) = (37, 70);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let t = transpose(&data, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(t[c * rows + r], data[r * cols + c]);
            }
        }
    }
}

//! Sharded optimizer state and gradients among trainer ranks (`train.shard`), ZeRO's
//! stages 1 and 2 on the ranks' collective.
//!
//! The trainable parameters, in the model's order, make one vector of `len` values; rank
//! `r` owns the range [`Shards::range`] of it (a contiguous `1 / N`, cut by the same rule
//! on every rank). After the backward:
//!
//! - `optimizer`: the gradients are all-reduced as without sharding; each rank keeps the
//!   AdamW moments of its range only and updates its range of the parameters;
//! - `gradients`: the gradients are reduce-scattered, so each rank receives only its range
//!   of the sum (half the bytes of the all-reduce), then the same.
//!
//! The global gradient norm (clipping) is the sum of every rank's partial sum of squares,
//! added in rank order. Each rank then all-gathers the updated parameters, so every rank
//! holds the whole model between steps, the forward and backward are unchanged, and rank 0
//! publishes and checkpoints whole weights as before. The update of each value is
//! [`FusedAdamW::pass`], the one trainer's arithmetic; only the order in which the norm's
//! partial sums are added differs, in the last bits of the clipping factor.
//!
//! Checkpoints hold one file per rank ([`shard_file`]): its range, every parameter's
//! length and update count, and its two moments. A run resumes from them at any number of
//! ranks: each rank reads the parts of the old files that overlap its new range. A
//! checkpoint written without sharding resumes sharded (each rank takes its range of the
//! optimizer record); the other way is refused with what to do.

use super::adamw::{FusedAdamW, sum_squares, values};
use super::checkpoint::CheckpointError;
use super::config::Sharding;
use crate::collective::shards::{self, JoinedPieces, Shards};
use crate::collective::{self, Collective, ReduceDtype};
use crate::model::{Kernels, ModelError, Policy};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::optim::record::AdaptorRecord;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The first bytes of a shard file.
const MAGIC: &[u8; 8] = b"RLSHARD1";

/// The file rank `rank` of `world` writes its optimizer shard to, in a checkpoint.
pub fn shard_file(rank: usize, world: usize) -> String {
    format!("optimizer-shard-{rank:04}-of-{world:04}.bin")
}

/// AdamW over this rank's range of the trainable parameters.
pub struct ShardedAdamW {
    adam: FusedAdamW,
    rank: usize,
    world: usize,
    /// Each trainable parameter's length, in the model's order.
    lens: Vec<usize>,
    /// The updates each parameter has had (AdamW's bias-correction time), on every rank.
    times: Vec<usize>,
    range: Range<usize>,
    /// AdamW's moments over `range`.
    m: Vec<f32>,
    v: Vec<f32>,
}

/// What one sharded update needs besides the gradients.
pub struct ShardedStep<'a> {
    pub what: &'a str,
    pub mode: Sharding,
    pub dtype: ReduceDtype,
    pub bucket_values: usize,
    pub lr: f64,
    pub max_grad_norm: f64,
    pub loss: f64,
}

/// What a shard file says of itself, before its moments.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    world: usize,
    rank: usize,
    start: usize,
    end: usize,
    lens: Vec<usize>,
    times: Vec<usize>,
}

impl ShardedAdamW {
    /// Fresh moments for rank `rank` of `world` over parameters of lengths `lens`.
    pub fn fresh(weight_decay: f32, lens: Vec<usize>, rank: usize, world: usize) -> Self {
        let range = Shards::new(lens.iter().sum(), world).range(rank);
        ShardedAdamW {
            adam: FusedAdamW::new(weight_decay),
            rank,
            world,
            times: vec![0; lens.len()],
            m: vec![0.0; range.len()],
            v: vec![0.0; range.len()],
            lens,
            range,
        }
    }

    /// The ranks this state is sharded over.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The values of the moments this rank holds.
    pub fn held(&self) -> usize {
        self.range.len()
    }

    /// One update of `model` from this rank's `grads` (see the module). The model is taken
    /// out of `model` and always put back; the gradient norm and whether the update was
    /// applied (a non-finite loss or norm skips it on every rank).
    pub fn update<B>(
        &mut self,
        model: &mut Option<Policy<B>>,
        mut grads: GradientsParams,
        c: &mut dyn Collective,
        s: &ShardedStep<'_>,
    ) -> Result<(f64, bool), ModelError>
    where
        B: AutodiffBackend<InnerBackend: Kernels>,
    {
        let Some(m) = model.as_ref() else {
            return Err(ModelError::Unsupported("no model to update".into()));
        };
        let mut take = TakeGrads {
            grads: &mut grads,
            pieces: Vec::new(),
            has: Vec::new(),
            error: None,
        };
        m.visit(&mut take);
        if let Some(e) = take.error {
            return Err(e);
        }
        let (mut pieces, mut has) = (take.pieces, take.has);
        self.check(&pieces)?;
        let world = c.world();
        if world > 1 {
            let what = format!("{}: which gradients exist", s.what);
            c.all_reduce_sum(&what, &mut has, ReduceDtype::F32);
        }
        let g = self.gradient_range(c, s, &mut pieces);
        drop(pieces);
        let norm = global_norm(c, s.what, &g);
        if !(s.loss.is_finite() && norm.is_finite()) {
            tracing::warn!(
                loss = s.loss,
                grad_norm = norm,
                "non-finite loss or gradient: update skipped, weights kept"
            );
            return Ok((norm, false));
        }
        let scale = if norm > s.max_grad_norm {
            (s.max_grad_norm / norm) as f32
        } else {
            1.0
        };
        let Some(whole) = model.take() else {
            return Err(ModelError::Unsupported("no model to update".into()));
        };
        let mut out = TakeValues {
            pieces: Vec::new(),
            shapes: Vec::new(),
            error: None,
        };
        let placeheld = whole.map(&mut out);
        let mut params = out.pieces;
        let error = out.error.or_else(|| self.check(&params).err());
        if error.is_none() {
            self.step_range(&has, &g, &mut params, s.lr, scale);
            if world > 1 {
                let what = format!("{}: the updated parameters", s.what);
                shards::all_gather(
                    c,
                    &what,
                    &mut JoinedPieces::new(&mut params),
                    s.bucket_values,
                );
            }
        }
        let mut put = PutValues {
            pieces: params.into_iter(),
            shapes: out.shapes.into_iter(),
        };
        *model = Some(placeheld.map(&mut put));
        match error {
            Some(e) => Err(e),
            None => Ok((norm, true)),
        }
    }

    /// The pieces are the trainable parameters this state was made for.
    fn check(&self, pieces: &[Vec<f32>]) -> Result<(), ModelError> {
        let lens: Vec<usize> = pieces.iter().map(Vec::len).collect();
        if lens == self.lens {
            return Ok(());
        }
        Err(ModelError::Unsupported(format!(
            "the sharded optimizer holds {} trainable parameters ({} values) and the model has \
             {} ({} values)",
            self.lens.len(),
            self.lens.iter().sum::<usize>(),
            lens.len(),
            lens.iter().sum::<usize>()
        )))
    }

    /// This rank's range of the gradients summed over the ranks.
    fn gradient_range(
        &self,
        c: &mut dyn Collective,
        s: &ShardedStep<'_>,
        pieces: &mut [Vec<f32>],
    ) -> Vec<f32> {
        if c.world() > 1 && s.mode == Sharding::Gradients {
            return shards::reduce_scatter(
                c,
                s.what,
                &JoinedPieces::new(pieces),
                s.dtype,
                s.bucket_values,
            );
        }
        if c.world() > 1 {
            collective::all_reduce_pieces(c, s.what, pieces, s.dtype, s.bucket_values);
        }
        let mut g = vec![0.0; self.range.len()];
        JoinedPieces::new(pieces).read(self.range.start, &mut g);
        g
    }

    /// AdamW on this rank's range of `params` (whole parameters, in order) from `g`, its
    /// range of the summed gradients. A parameter no rank has a gradient for is left as it
    /// is, its update count too, as one trainer leaves it.
    fn step_range(&mut self, has: &[f32], g: &[f32], params: &mut [Vec<f32>], lr: f64, scale: f32) {
        let mut at = 0;
        for (i, p) in params.iter_mut().enumerate() {
            let start = at;
            at += p.len();
            if has.get(i).is_none_or(|&h| h <= 0.0) {
                continue;
            }
            self.times[i] += 1;
            let (lo, hi) = (start.max(self.range.start), at.min(self.range.end));
            if lo >= hi {
                continue;
            }
            let r = lo - self.range.start..hi - self.range.start;
            self.adam.pass(
                self.times[i],
                lr,
                scale,
                &mut p[lo - start..hi - start],
                &g[r.clone()],
                &mut self.m[r.clone()],
                &mut self.v[r],
            );
        }
    }

    /// Writes this rank's shard into checkpoint `dir` (written aside, then renamed).
    pub fn write(&self, dir: &Path) -> Result<(), CheckpointError> {
        let name = shard_file(self.rank, self.world);
        let header = Header {
            world: self.world,
            rank: self.rank,
            start: self.range.start,
            end: self.range.end,
            lens: self.lens.clone(),
            times: self.times.clone(),
        };
        let head = serde_json::to_vec(&header)
            .map_err(|e| CheckpointError::format(dir, name.clone(), e))?;
        let tmp = dir.join(format!("{name}.tmp"));
        let io = |e: std::io::Error| CheckpointError::format(dir, name.clone(), e);
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
        f.write_all(MAGIC).map_err(io)?;
        f.write_all(&(head.len() as u64).to_le_bytes())
            .map_err(io)?;
        f.write_all(&head).map_err(io)?;
        for x in self.m.iter().chain(&self.v) {
            f.write_all(&x.to_le_bytes()).map_err(io)?;
        }
        f.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        std::fs::rename(&tmp, dir.join(&name)).map_err(io)
    }

    /// Rank `rank` of `world`'s state from the shard files in checkpoint `dir`, written by
    /// any number of ranks; `None` when `dir` holds none.
    pub fn load(
        dir: &Path,
        weight_decay: f32,
        lens: Vec<usize>,
        rank: usize,
        world: usize,
    ) -> Result<Option<Self>, CheckpointError> {
        let files = shard_files(dir)?;
        if files.is_empty() {
            return Ok(None);
        }
        let mut me = Self::fresh(weight_decay, lens, rank, world);
        for (i, path) in files.iter().enumerate() {
            let (header, mut f, body) = read_header(dir, path)?;
            me.agree(dir, i, files.len(), &header)?;
            if i == 0 {
                me.times = header.times;
            }
            let (lo, hi) = (
                header.start.max(me.range.start),
                header.end.min(me.range.end),
            );
            if lo >= hi {
                continue;
            }
            let held = header.end - header.start;
            let into = lo - me.range.start..hi - me.range.start;
            let name = path.display().to_string();
            for (k, out) in [&mut me.m, &mut me.v].into_iter().enumerate() {
                let at = body + 4 * (k * held + lo - header.start) as u64;
                read_f32s(&mut f, at, &mut out[into.clone()])
                    .map_err(|e| CheckpointError::format(dir, name.clone(), e))?;
            }
        }
        tracing::info!(
            checkpoint = %dir.display(),
            written_by = files.len(),
            rank,
            ranks = world,
            values = me.range.len(),
            "optimizer shards read"
        );
        Ok(Some(me))
    }

    /// Shard `i` of `n`'s header says what this state expects.
    fn agree(&self, dir: &Path, i: usize, n: usize, h: &Header) -> Result<(), CheckpointError> {
        let name = shard_file(i, n);
        let whole = Shards::new(self.lens.iter().sum(), n).range(i);
        if (h.world, h.rank, h.start..h.end) != (n, i, whole.clone()) {
            return Err(CheckpointError::format(
                dir,
                name,
                format!(
                    "says it is rank {} of {} over {}..{}, where rank {i} of {n} holds {}..{}",
                    h.rank, h.world, h.start, h.end, whole.start, whole.end
                ),
            ));
        }
        if h.lens != self.lens || h.times.len() != self.lens.len() {
            return Err(CheckpointError::format(
                dir,
                name,
                format!(
                    "holds the optimizer of {} trainable parameters ({} values) and this model \
                     has {} ({} values): resume with the model and settings it was written for",
                    h.lens.len(),
                    h.lens.iter().sum::<usize>(),
                    self.lens.len(),
                    self.lens.iter().sum::<usize>()
                ),
            ));
        }
        Ok(())
    }

    /// Rank `rank` of `world`'s range of a whole optimizer's state: burn's per-parameter
    /// records of the trainer's optimizer (a checkpoint written without sharding).
    pub fn from_records<B>(
        model: &Policy<B>,
        records: impl IntoIterator<Item = (ParamId, AdaptorRecord<FusedAdamW, B>)>,
        weight_decay: f32,
        rank: usize,
        world: usize,
    ) -> Self
    where
        B: AutodiffBackend<InnerBackend: Kernels>,
    {
        let mut me = Self::fresh(weight_decay, trainable_lens(model), rank, world);
        let mut records: HashMap<_, _> = records.into_iter().collect();
        let mut from = FromRecords {
            records: &mut records,
            me: &mut me,
            at: 0,
            index: 0,
        };
        model.visit(&mut from);
        me
    }
}

/// How many shard files checkpoint `dir` holds (0 for a checkpoint written unsharded).
pub fn written_shards(dir: &Path) -> Result<usize, CheckpointError> {
    Ok(shard_files(dir)?.len())
}

/// The lengths of the trainable parameters of `model`, in order.
pub fn trainable_lens<B: AutodiffBackend>(model: &Policy<B>) -> Vec<usize>
where
    B::InnerBackend: Kernels,
{
    let mut lens = Lens(Vec::new());
    model.visit(&mut lens);
    lens.0
}

/// Removes every shard file from checkpoint `dir` (nothing when it does not exist): rank 0
/// clears a directory it writes a checkpoint into before any rank writes its shard there.
pub fn remove_shards(dir: &Path) -> Result<(), CheckpointError> {
    for (world, rank) in named_shards(dir) {
        let name = shard_file(rank, world);
        std::fs::remove_file(dir.join(&name)).map_err(|e| CheckpointError::format(dir, name, e))?;
    }
    Ok(())
}

/// The (world, rank) of every shard file in `dir`, sorted.
fn named_shards(dir: &Path) -> Vec<(usize, usize)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(usize, usize)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name
                .strip_prefix("optimizer-shard-")?
                .strip_suffix(".bin")?;
            let (r, w) = rest.split_once("-of-")?;
            let (world, rank) = (w.parse().ok()?, r.parse().ok()?);
            // Only the names `shard_file` writes (so that removing one finds it).
            (name == shard_file(rank, world)).then_some((world, rank))
        })
        .collect();
    found.sort_unstable();
    found
}

/// The shard files in `dir`, in rank order: all of one world's, or an error naming what is
/// missing.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let found = named_shards(dir);
    let Some(&(world, _)) = found.first() else {
        return Ok(Vec::new());
    };
    let want: Vec<(usize, usize)> = (0..world).map(|r| (world, r)).collect();
    if found != want {
        return Err(CheckpointError::format(
            dir,
            "optimizer shards",
            format!(
                "expected the {world} files {} .. {}, found {} shard files: a checkpoint's shards \
                 come from one run; resume from an earlier checkpoint",
                shard_file(0, world),
                shard_file(world - 1, world),
                found.len()
            ),
        ));
    }
    Ok((0..world).map(|r| dir.join(shard_file(r, world))).collect())
}

/// A shard file's header, the open file and where its moments start.
fn read_header(dir: &Path, path: &Path) -> Result<(Header, std::fs::File, u64), CheckpointError> {
    let name = path.display().to_string();
    let bad = |e: &dyn std::fmt::Display| CheckpointError::format(dir, name.clone(), e);
    let mut f = std::fs::File::open(path).map_err(|e| bad(&e))?;
    let mut magic = [0u8; 8];
    let mut len = [0u8; 8];
    f.read_exact(&mut magic).map_err(|e| bad(&e))?;
    if &magic != MAGIC {
        return Err(bad(&"not an rlstream optimizer shard"));
    }
    f.read_exact(&mut len).map_err(|e| bad(&e))?;
    let len = u64::from_le_bytes(len);
    if len > 1 << 30 {
        return Err(bad(&format!("a header of {len} bytes")));
    }
    let mut head = vec![0u8; len as usize];
    f.read_exact(&mut head).map_err(|e| bad(&e))?;
    let header: Header = serde_json::from_slice(&head).map_err(|e| bad(&e))?;
    let body = 16 + len;
    let want = body + 8 * (header.end.saturating_sub(header.start)) as u64;
    let size = f.metadata().map_err(|e| bad(&e))?.len();
    if size != want {
        return Err(bad(&format!(
            "{size} bytes where its header says {want}: the file is cut short or corrupt"
        )));
    }
    Ok((header, f, body))
}

fn read_f32s(f: &mut std::fs::File, at: u64, out: &mut [f32]) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(at))?;
    let mut bytes = vec![0u8; 4 * out.len()];
    f.read_exact(&mut bytes)?;
    for (x, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

/// The global gradient norm: every rank's sum of squares over its range, added in rank
/// order.
fn global_norm(c: &mut dyn Collective, what: &str, g: &[f32]) -> f64 {
    let mine = sum_squares(g);
    if c.world() == 1 {
        return mine.sqrt();
    }
    let all = c.all_gather(&format!("{what}: the gradient norm"), &mine.to_le_bytes());
    all.iter()
        .map(|b| <[u8; 8]>::try_from(b.as_slice()).map_or(f64::NAN, f64::from_le_bytes))
        .sum::<f64>()
        .sqrt()
}

/// The lengths of the parameters that take gradients, in visiting order.
struct Lens(Vec<usize>);

impl<B: AutodiffBackend> ModuleVisitor<B> for Lens {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if param.is_require_grad() {
            self.0.push(param.shape().num_elements());
        }
    }
}

/// Each trainable parameter's gradient taken out of `grads` as a host vector (zeros, and
/// `has` 0, where this rank has none).
struct TakeGrads<'a> {
    grads: &'a mut GradientsParams,
    pieces: Vec<Vec<f32>>,
    has: Vec<f32>,
    error: Option<ModelError>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() {
            return;
        }
        let n = param.shape().num_elements();
        match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => {
                let v = crate::model::host_f32(g.into_data()).unwrap_or_else(|e| {
                    self.error.get_or_insert(e);
                    vec![0.0; n]
                });
                self.pieces.push(v);
                self.has.push(1.0);
            }
            None => {
                self.pieces.push(vec![0.0; n]);
                self.has.push(0.0);
            }
        }
    }
}

/// Moves each trainable parameter's values out (its buffer, when nothing else holds it),
/// leaving a one-value placeholder.
struct TakeValues {
    pieces: Vec<Vec<f32>>,
    shapes: Vec<Vec<usize>>,
    error: Option<ModelError>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for TakeValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let dims = tensor.dims();
        let device = tensor.device();
        match crate::model::host_f32(tensor.inner().into_data()) {
            Ok(v) => self.pieces.push(v),
            Err(e) => {
                self.error.get_or_insert(e);
                self.pieces.push(vec![0.0; dims.iter().product()]);
            }
        }
        self.shapes.push(dims.to_vec());
        let placeholder = Tensor::<B, D>::zeros([1; D], &device).require_grad();
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts the values [`TakeValues`] moved out back, in the same order, as parameters that
/// take gradients.
struct PutValues {
    pieces: std::vec::IntoIter<Vec<f32>>,
    shapes: std::vec::IntoIter<Vec<usize>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for PutValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let (Some(values), Some(dims)) = (self.pieces.next(), self.shapes.next()) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let inner = Tensor::<B::InnerBackend, D>::from_data(
            TensorData::new(values, dims),
            &tensor.device(),
        );
        Param::from_mapped_value(id, Tensor::from_inner(inner).require_grad(), mapper)
    }
}

/// Each trainable parameter's burn optimizer record, cut to a sharded state's range.
struct FromRecords<'a, B>
where
    B: AutodiffBackend<InnerBackend: Kernels>,
{
    records: &'a mut HashMap<ParamId, AdaptorRecord<FusedAdamW, B>>,
    me: &'a mut ShardedAdamW,
    /// Where the next trainable parameter starts in the vector, and its index.
    at: usize,
    index: usize,
}

impl<B> ModuleVisitor<B> for FromRecords<'_, B>
where
    B: AutodiffBackend<InnerBackend: Kernels>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() {
            return;
        }
        let (start, i) = (self.at, self.index);
        self.at += param.shape().num_elements();
        self.index += 1;
        let Some(record) = self.records.remove(&param.id) else {
            return;
        };
        let state = record.into_state::<D>();
        self.me.times[i] = state.momentum.time;
        let range = self.me.range.clone();
        let (lo, hi) = (start.max(range.start), self.at.min(range.end));
        if lo >= hi {
            return;
        }
        let into = lo - range.start..hi - range.start;
        let m = values(state.momentum.moment_1);
        self.me.m[into.clone()].copy_from_slice(&m[lo - start..hi - start]);
        let v = values(state.momentum.moment_2);
        self.me.v[into].copy_from_slice(&v[lo - start..hi - start]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LENS: [usize; 4] = [5, 0, 7, 3];

    /// Rank `rank` of `world` with moments that say which value they are of.
    fn state(rank: usize, world: usize) -> ShardedAdamW {
        let mut s = ShardedAdamW::fresh(0.01, LENS.to_vec(), rank, world);
        for (k, i) in s.range.clone().enumerate() {
            s.m[k] = i as f32;
            s.v[k] = -(i as f32);
        }
        s.times = vec![3, 0, 3, 2];
        s
    }

    #[test]
    fn shards_written_by_two_ranks_resume_at_three_and_at_one() {
        let dir = tempfile::tempdir().unwrap();
        for r in 0..2 {
            state(r, 2).write(dir.path()).unwrap();
        }
        assert_eq!(written_shards(dir.path()).unwrap(), 2);
        for world in [1, 3] {
            for rank in 0..world {
                let s = ShardedAdamW::load(dir.path(), 0.01, LENS.to_vec(), rank, world)
                    .unwrap()
                    .expect("shards");
                let want: Vec<f32> = s.range.clone().map(|i| i as f32).collect();
                assert_eq!(s.m, want, "rank {rank} of {world}");
                assert_eq!(s.v, want.iter().map(|x| -x).collect::<Vec<_>>());
                assert_eq!(s.times, vec![3, 0, 3, 2]);
            }
        }
        let none = tempfile::tempdir().unwrap();
        assert!(
            ShardedAdamW::load(none.path(), 0.01, LENS.to_vec(), 0, 2)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_missing_cut_or_foreign_shard_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        for r in 0..2 {
            state(r, 2).write(dir.path()).unwrap();
        }
        let load = |lens: &[usize]| {
            ShardedAdamW::load(dir.path(), 0.01, lens.to_vec(), 0, 2)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let other = load(&[5, 0, 7, 4]);
        assert!(
            other.contains("holds the optimizer of 4 trainable parameters (15 values) and this model has 4 (16 values)"),
            "{other}"
        );
        let second = dir.path().join(shard_file(1, 2));
        let bytes = std::fs::read(&second).unwrap();
        std::fs::write(&second, &bytes[..bytes.len() - 4]).unwrap();
        let cut = load(&LENS);
        assert!(cut.contains("the file is cut short or corrupt"), "{cut}");
        std::fs::remove_file(&second).unwrap();
        let missing = load(&LENS);
        assert!(
            missing.contains("expected the 2 files optimizer-shard-0000-of-0002.bin .. optimizer-shard-0001-of-0002.bin, found 1"),
            "{missing}"
        );
    }

    #[test]
    fn a_checkpoint_written_again_holds_only_its_own_ranks_shards() {
        // Two ranks wrote step N's directory and stopped before marking it; three ranks
        // resumed earlier and write step N again.
        let dir = tempfile::tempdir().unwrap();
        for r in 0..2 {
            state(r, 2).write(dir.path()).unwrap();
        }
        std::fs::write(dir.path().join("optimizer-shard-notes.txt"), "kept").unwrap();
        remove_shards(dir.path()).unwrap();
        assert_eq!(written_shards(dir.path()).unwrap(), 0);
        for r in 0..3 {
            state(r, 3).write(dir.path()).unwrap();
        }
        let s = ShardedAdamW::load(dir.path(), 0.01, LENS.to_vec(), 1, 2)
            .unwrap()
            .expect("shards");
        assert_eq!(s.m, (8..15).map(|i| i as f32).collect::<Vec<_>>());
        assert!(dir.path().join("optimizer-shard-notes.txt").exists());
        remove_shards(&dir.path().join("absent")).unwrap();
    }

    #[test]
    fn the_update_of_a_range_is_one_trainers_update_of_those_values() {
        // Two ranks' ranges updated apart give the values one rank updates whole.
        let (g, p0): (Vec<f32>, Vec<f32>) = (0..15)
            .map(|i| ((i as f32 - 7.0) / 10.0, (i as f32) / 20.0))
            .unzip();
        let has = [1.0, 0.0, 1.0, 1.0];
        let split = |p: &[f32]| -> Vec<Vec<f32>> {
            let mut at = 0;
            LENS.iter()
                .map(|&n| {
                    at += n;
                    p[at - n..at].to_vec()
                })
                .collect()
        };
        let mut whole = ShardedAdamW::fresh(0.01, LENS.to_vec(), 0, 1);
        let mut one = split(&p0);
        whole.step_range(&has, &g, &mut one, 1e-2, 0.5);
        let mut both = split(&p0);
        for rank in 0..2 {
            let mut s = ShardedAdamW::fresh(0.01, LENS.to_vec(), rank, 2);
            let mut mine = split(&p0);
            s.step_range(&has, &g[s.range.clone()], &mut mine, 1e-2, 0.5);
            let r = s.range.clone();
            let flat: Vec<f32> = mine.concat();
            let mut all: Vec<f32> = both.concat();
            all[r.clone()].copy_from_slice(&flat[r]);
            both = split(&all);
            assert_eq!(s.times, vec![1, 0, 1, 1], "every rank counts every update");
        }
        assert_eq!(one, both);
        assert!(one.concat() != p0, "the update moved the values");
    }
}

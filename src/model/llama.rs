//! The decoder: token embedding, `num_layers` pre-norm blocks (RMSNorm → grouped-query
//! attention with rotary positions → RMSNorm → SwiGLU MLP), final RMSNorm, output head.
//!
//! One forward function serves every caller: the trainer (whole sequences, causal mask,
//! no cache), prefill (a prompt into an empty cache) and decode (one token per row against
//! the cache). Each row carries its own positions, so rows of different lengths share a
//! batch: the cache is left-aligned per row and masked before each row's start.

use super::config::ModelConfig;
use super::kernels::{Kernels, MASKED, reshape};
use super::layers::{BlockLora, Lora, Mlp, adapted, native_linear, rms_norm};
use super::moe::{Moe, Routes};
use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

/// Rows up to which the tied LM head multiplies the embedding as stored (see
/// [`Policy::project`]): decode steps, not training batches.
const FEW_ROWS: usize = 128;

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    /// Per-head RMSNorm of q and k before the rotary embedding (Qwen3).
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub attn_norm: RmsNorm<B>,
    pub attn: Attention<B>,
    pub mlp_norm: RmsNorm<B>,
    /// The dense MLP; `None` in a layer that routes to experts.
    pub mlp: Option<Mlp<B>>,
    /// Routed experts in a sparse layer of an MoE model.
    pub moe: Option<Moe<B>>,
    /// LoRA adapters on this layer's linear modules (see [`super::lora`]).
    pub lora: Option<BlockLora<B>>,
}

/// The policy. Build it with [`Policy::from_tensors`] (checkpoints, weight blobs) or
/// [`Policy::random`].
#[derive(Module, Debug)]
pub struct Policy<B: Backend> {
    pub embed: Embedding<B>,
    pub blocks: Vec<Block<B>>,
    pub norm: RmsNorm<B>,
    /// Untied output head; `None` when the embedding is reused.
    pub head: Option<Linear<B>>,
    /// Rotary tables `[max_position, head_dim]` in the HF layout (frequencies repeated
    /// over both halves). Constants, not parameters.
    rope_cos: Tensor<B, 2>,
    rope_sin: Tensor<B, 2>,
    #[module(skip)]
    config: ModelConfig,
}

/// Per-layer keys and values of the rows being decoded.
///
/// Row `r` occupies columns `starts[r]..len` of every layer's `[rows, kv_heads, len,
/// head_dim]` tensors; columns before `starts[r]` are padding, masked out. Rows join
/// ([`KvCache::append_rows`]) and leave ([`KvCache::keep_rows`]) between forward passes.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub(crate) layers: Vec<(Tensor<B, 4>, Tensor<B, 4>)>,
    pub(crate) starts: Vec<usize>,
    pub(crate) len: usize,
}

/// What one forward pass attends to.
pub(crate) enum AttnMode<'a, B: Backend> {
    /// Whole sequences from position 0, causal mask, no cache.
    Full,
    /// Append the inputs to `cache` and attend over it (prefill or decode).
    Cached(&'a mut KvCache<B>),
}

fn rope_tables<B: Backend>(cfg: &ModelConfig, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (hd, n) = (cfg.head_dim, cfg.max_position);
    let half = hd / 2;
    let mut cos = Vec::with_capacity(n * hd);
    let mut sin = Vec::with_capacity(n * hd);
    for pos in 0..n {
        for i in 0..hd {
            let inv_freq = 1.0 / cfg.rope_theta.powf((2 * (i % half)) as f64 / hd as f64);
            let inv_freq = cfg.rope_scaling.map_or(inv_freq, |r| r.scale(inv_freq));
            let angle = pos as f64 * inv_freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (
        Tensor::from_data(TensorData::new(cos, [n, hd]), device),
        Tensor::from_data(TensorData::new(sin, [n, hd]), device),
    )
}

impl<B: Kernels> Attention<B> {
    /// `cos` and `sin` are each row's rotary tables `[b, l, head_dim]`.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 3>,
        sin: Tensor<B, 3>,
        bias: Tensor<B, 4>,
        layer_cache: Option<&mut (Tensor<B, 4>, Tensor<B, 4>)>,
        lora: Option<&BlockLora<B>>,
    ) -> Tensor<B, 3> {
        let [b, l, d] = x.dims();
        let at = |layer: &Linear<B>, t: fn(&BlockLora<B>) -> Option<&Lora<B>>, x: Tensor<B, 2>| {
            adapted(layer, lora.and_then(t), x, [b, l])
        };
        let x = reshape(x, [b * l, d]);
        let (h, kvh, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let g = h / kvh;
        let norm = |t: Tensor<B, 4>, n: &Option<RmsNorm<B>>| match n {
            Some(n) => rms_norm(n, t),
            None => t,
        };
        // Rotary positions also lay q and k out as `[b, heads, l, hd]`.
        let q = B::rope(
            norm(
                reshape(at(&self.q, |l| l.q.as_ref(), x.clone()), [b, l, h, hd]),
                &self.q_norm,
            ),
            cos.clone(),
            sin.clone(),
        );
        let k = B::rope(
            norm(
                reshape(at(&self.k, |l| l.k.as_ref(), x.clone()), [b, l, kvh, hd]),
                &self.k_norm,
            ),
            cos,
            sin,
        );
        let v = reshape(at(&self.v, |l| l.v.as_ref(), x), [b, l, kvh, hd]).swap_dims(1, 2);
        let (k, v) = match layer_cache {
            Some(cache) => {
                let k = B::cat_columns(cache.0.clone(), k);
                let v = B::cat_columns(cache.1.clone(), v);
                *cache = (k.clone(), v.clone());
                (k, v)
            }
            None => (k, v),
        };
        // Query heads j*g..(j+1)*g share key/value head j (HF `repeat_kv`): grouped, all of
        // a kv head's query heads attend over its K and V without copying them.
        let q = reshape(q, [b, kvh, g * l, hd]);
        let scale = (hd as f64).powf(-0.5);
        // bias is [b or 1, 1, l, t]: broadcast over kv heads and their query groups.
        let out = reshape(B::attn(q, k, v, bias, scale), [b, h, l, hd])
            .swap_dims(1, 2)
            .reshape([b * l, h * hd]);
        reshape(at(&self.o, |l| l.o.as_ref(), out), [b, l, d])
    }
}

impl<B: Backend> Policy<B> {
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> B::Device {
        self.rope_cos.device()
    }

    /// An empty cache for `rows` rows.
    pub fn empty_cache(&self, rows: usize) -> KvCache<B> {
        let device = self.device();
        let (kvh, hd) = (self.config.num_kv_heads, self.config.head_dim);
        // Allocated, not filled: a fill over no elements would launch no blocks (refused
        // by CUDA).
        let empty = || Tensor::<B, 4>::empty([rows, kvh, 0, hd], &device);
        KvCache {
            layers: (0..self.config.num_layers)
                .map(|_| (empty(), empty()))
                .collect(),
            starts: vec![0; rows],
            len: 0,
        }
    }
}

impl<B: Kernels> Policy<B> {
    /// Logits `[rows, vocab]` of final hidden states `[rows, hidden]` (the LM head, or the
    /// tied embedding).
    pub(crate) fn project(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        super::kernels::head::note_logits(x.dims()[0]);
        match &self.head {
            Some(head) if B::NATIVE_LINEAR => native_linear(head, x),
            Some(head) => head.forward(x),
            // A few rows (a decode step): `(E · xᵀ)ᵀ` reads the embedding `[vocab, hidden]`
            // as stored. `x · Eᵀ` would hand the backend a transposed view of the whole
            // embedding, which Flex copies to contiguous memory on every call (544 MB per
            // token for a 151,936 × 896 vocabulary).
            None if x.dims()[0] <= FEW_ROWS && !B::NATIVE_LINEAR => {
                self.embed.weight.val().matmul(x.transpose()).transpose()
            }
            // Many rows (training, prefill), or a backend whose products read a transposed
            // view as stored: `x · Eᵀ`. The CPU kernel also writes the embedding's gradient
            // in the embedding's own layout.
            None => B::linear_rows(x, self.embed.weight.val().transpose(), None),
        }
    }

    /// Each row's entropy `[rows, 1]` after final hidden states `x` (`[rows, hidden]`),
    /// of the tempered distribution over `kept` a log-prob is taken under
    /// ([`reference::entropy`](super::kernels::reference::entropy)), the head run over
    /// [`HEAD_CHUNK_ROWS`](super::kernels::HEAD_CHUNK_ROWS) rows at a time. On an autodiff
    /// backend every chunk's logits stay in the graph for the backward: the memory of the
    /// logits of every row (the entropy bonus pays it; the statistic runs without a graph).
    pub(crate) fn head_entropy(
        &self,
        x: Tensor<B, 2>,
        temperature: f32,
        kept: &super::kernels::Kept,
    ) -> Tensor<B, 2> {
        let n = x.dims()[0];
        let chunks = super::kernels::head::chunks(n, super::kernels::HEAD_CHUNK_ROWS);
        let parts: Vec<Tensor<B, 2>> = chunks
            .map(|rows| {
                let logits = self.project(x.clone().slice(rows.clone()));
                super::kernels::reference::entropy(logits, temperature, &kept.range(rows))
            })
            .collect();
        Tensor::cat(parts, 0)
    }

    /// The output head as a `[hidden, vocab]` weight: the LM head's, or the tied
    /// embedding read transposed (a view, not a copy).
    fn head_weight(&self) -> Tensor<B, 2> {
        match &self.head {
            Some(head) => head.weight.val(),
            None => self.embed.weight.val().transpose(),
        }
    }

    /// The log-prob `[rows, 1]` of `targets[i]` after final hidden state `x[i]`
    /// (`[rows, hidden]`), tempered and renormalised over `kept` as
    /// [`token_logprob`](super::kernels::token_logprob) defines it: the head and the
    /// log-prob over [`HEAD_CHUNK_ROWS`](super::kernels::HEAD_CHUNK_ROWS) rows at a time
    /// ([`Kernels::head_logprobs`]), so the logits never exist for more rows than that.
    /// Each row's logits are [`Policy::project`]'s on the CPU backend, bit for bit.
    pub(crate) fn head_logprobs(
        &self,
        x: Tensor<B, 2>,
        targets: &[u32],
        temperature: f32,
        kept: &super::kernels::Kept,
    ) -> Tensor<B, 2> {
        let chunk = super::kernels::HEAD_CHUNK_ROWS;
        match &self.head {
            // A head with a bias (no model family here has one) through the plain path.
            Some(head) if head.bias.is_some() => {
                B::token_logprobs(self.project(x), targets, temperature, kept)
            }
            _ => {
                let t = super::kernels::HeadTargets {
                    targets,
                    temperature,
                    kept,
                    chunk,
                };
                B::head_logprobs(x, self.head_weight(), t)
            }
        }
    }

    /// Logits `[batch, len, vocab]` of token ids `[batch, len]` at `positions`
    /// (`[batch, len]`, each row's own), attending as `mode` says.
    pub(crate) fn forward_with(
        &self,
        tokens: Tensor<B, 2, Int>,
        positions: &[usize],
        mode: AttnMode<'_, B>,
    ) -> Tensor<B, 3> {
        self.forward_routed(tokens, positions, mode, &mut Routes::default())
    }

    /// [`Policy::forward_with`] with the MoE layers routed (and recorded) as `routes` says.
    pub(crate) fn forward_routed(
        &self,
        tokens: Tensor<B, 2, Int>,
        positions: &[usize],
        mode: AttnMode<'_, B>,
        routes: &mut Routes,
    ) -> Tensor<B, 3> {
        let x = self.trunk_routed(tokens, positions, mode, routes);
        let [b, l, d] = x.dims();
        self.project(x.reshape([b * l, d]))
            .reshape([b, l, self.config.vocab_size])
    }

    /// Final hidden states `[batch, len, hidden]` (after the last norm): everything but
    /// the LM head. MoE layers are routed (and recorded) as `routes` says; the tokens of the pass are
    /// the `[batch, len]` inputs in row-major order.
    pub(crate) fn trunk_routed(
        &self,
        tokens: Tensor<B, 2, Int>,
        positions: &[usize],
        mode: AttnMode<'_, B>,
        routes: &mut Routes,
    ) -> Tensor<B, 3> {
        let [b, l] = tokens.dims();
        routes.begin(b * l, self.moe_layers());
        let device = tokens.device();
        let (cos, sin) = self.rotary_at(positions, [b, l]);
        let mut x = self.embed.forward(tokens);
        match mode {
            AttnMode::Full => {
                let bias = causal_bias::<B>(l, &device).reshape([1, 1, l, l]);
                for block in &self.blocks {
                    let attend = (bias.clone(), None);
                    x = block.forward(x, cos.clone(), sin.clone(), attend, None, routes);
                }
            }
            AttnMode::Cached(cache) => {
                let total = cache.len + l;
                let bias = cached_bias::<B>(&cache.starts, cache.len, l, &device);
                let real = real_rows::<B>(&cache.starts, cache.len, l, &device);
                for (block, layer) in self.blocks.iter().zip(cache.layers.iter_mut()) {
                    let attend = (bias.clone(), Some(layer));
                    x = block.forward(x, cos.clone(), sin.clone(), attend, real.as_ref(), routes);
                }
                cache.len = total;
            }
        }
        rms_norm(&self.norm, x)
    }

    /// The rotary tables' rows `[batch, len, head_dim]` (cos, sin) at `positions`, each
    /// row's own.
    pub(crate) fn rotary_at(&self, positions: &[usize], [b, l]: [usize; 2]) -> RotaryRows<B> {
        let hd = self.config.head_dim;
        let pos = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                positions.iter().map(|&p| p as i64).collect::<Vec<_>>(),
                [b * l],
            ),
            &self.rope_cos.device(),
        );
        let cos = reshape(self.rope_cos.clone().select(0, pos.clone()), [b, l, hd]);
        let sin = reshape(self.rope_sin.clone().select(0, pos), [b, l, hd]);
        (cos, sin)
    }

    /// Logits of whole sequences `[batch, len]` from position 0 (the trainer's view; also
    /// the reference the cached path is tested against).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let positions = from_start(tokens.dims());
        self.forward_with(tokens, &positions, AttnMode::Full)
    }

    /// Final hidden states of whole sequences `[batch, len]` from position 0 (the
    /// trainer's view before the LM head; see [`super::logprobs`]).
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.hidden_routed(tokens, &mut Routes::default())
    }

    /// [`Policy::hidden`] with the MoE layers routed (and recorded) as `routes` says.
    pub fn hidden_routed(&self, tokens: Tensor<B, 2, Int>, routes: &mut Routes) -> Tensor<B, 3> {
        let positions = from_start(tokens.dims());
        self.trunk_routed(tokens, &positions, AttnMode::Full, routes)
    }

    /// MoE layers in the model (0 for a dense one).
    pub fn moe_layers(&self) -> usize {
        self.blocks.iter().filter(|b| b.moe.is_some()).count()
    }
}

/// What a block's attention reads: the bias over its columns, and the layer's cache.
type Attend<'a, B> = (Tensor<B, 4>, Option<&'a mut (Tensor<B, 4>, Tensor<B, 4>)>);

/// The rotary tables' cos and sin rows of a pass, `[batch, len, head_dim]` each.
pub(crate) type RotaryRows<B> = (Tensor<B, 3>, Tensor<B, 3>);

impl<B: Kernels> Block<B> {
    /// `real`: the rows `[b × l]` that are not left padding, when some are ([`real_rows`]):
    /// only they go through a dense MLP (the padding's MLP output is -0.0, which added to
    /// any value gives that value).
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 3>,
        sin: Tensor<B, 3>,
        (bias, cache): Attend<'_, B>,
        real: Option<&Tensor<B, 1, Int>>,
        routes: &mut Routes,
    ) -> Tensor<B, 3> {
        let lora = self.lora.as_ref();
        let h = x.clone()
            + self
                .attn
                .forward(rms_norm(&self.attn_norm, x), cos, sin, bias, cache, lora);
        let [b, l, d] = h.dims();
        let rows = reshape(rms_norm(&self.mlp_norm, h.clone()), [b * l, d]);
        let out = match (&self.mlp, &self.moe, real) {
            (_, Some(moe), _) => moe.forward(rows, [b, l], routes),
            (Some(mlp), None, Some(keep)) => {
                let y = mlp.forward(rows.select(0, keep.clone()), [1, keep.dims()[0]], lora);
                Tensor::full([b * l, d], -0.0, &y.device()).select_assign(
                    0,
                    keep.clone(),
                    y,
                    IndexingUpdateOp::Add,
                )
            }
            (Some(mlp), None, None) => mlp.forward(rows, [b, l], lora),
            (None, None, _) => return h,
        };
        h + reshape(out, [b, l, d])
    }
}

/// The rows of `[rows, l]` new tokens after `past` cached columns that are not left padding
/// (column `past + i` of row `r` is padding below `starts[r]`), where some are and the
/// backend's products go row by row ([`Kernels::NATIVE_LINEAR`]: a row's bits do not depend
/// on its batch-mates, so the MLP may skip the padding); `None` otherwise. A prefill of
/// prompts of 6 to 9 tokens padded to 9 skips about a sixth of its MLP work.
fn real_rows<B: Kernels>(
    starts: &[usize],
    past: usize,
    l: usize,
    device: &B::Device,
) -> Option<Tensor<B, 1, Int>> {
    // A decode step (every row's start within the cache) has no padding: no list to make.
    if !B::NATIVE_LINEAR || starts.iter().all(|&s| s <= past) {
        return None;
    }
    let keep: Vec<i64> = (0..starts.len())
        .flat_map(|r| (0..l).map(move |i| (r, i)))
        .filter(|&(r, i)| past + i >= starts[r])
        .map(|(r, i)| (r * l + i) as i64)
        .collect();
    let n = keep.len();
    (n > 0 && n < starts.len() * l).then(|| Tensor::from_data(TensorData::new(keep, [n]), device))
}

/// The positions of `[batch, len]` whole sequences, each row from 0: `0..len` `batch` times.
pub(crate) fn from_start([b, l]: [usize; 2]) -> Vec<usize> {
    (0..b).flat_map(|_| 0..l).collect()
}

/// `[l, l]`: 0 on and below the diagonal, masked above; made on the device (only the two
/// `l`-long index ranges cross, not `l²` values).
pub(crate) fn causal_bias<B: Backend>(l: usize, device: &B::Device) -> Tensor<B, 2> {
    let above = Tensor::<B, 2, burn::tensor::Bool>::tril_mask([l, l], 0, device);
    Tensor::zeros([l, l], device).mask_fill(above, MASKED)
}

/// `[rows, 1, l, past + l]` for `l` new tokens per row after `past` cached columns: a row
/// sees its own columns from `starts[r]`, causally among the new ones.
fn cached_bias<B: Backend>(
    starts: &[usize],
    past: usize,
    l: usize,
    device: &B::Device,
) -> Tensor<B, 4> {
    let t = past + l;
    let mut data = Vec::with_capacity(starts.len() * l * t);
    for &start in starts {
        for i in 0..l {
            for j in 0..t {
                let visible = j >= start && j <= past + i;
                data.push(if visible { 0.0 } else { MASKED });
            }
        }
    }
    Tensor::from_data(TensorData::new(data, [starts.len(), 1, l, t]), device)
}

impl<B: Backend> KvCache<B> {
    pub fn rows(&self) -> usize {
        self.starts.len()
    }

    /// Cached columns (the longest row plus left padding).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Keeps only `rows` (in that order) and drops padding columns no row needs any more.
    pub fn keep_rows(&mut self, rows: &[usize]) {
        if rows.is_empty() {
            for (k, v) in &mut self.layers {
                let [_, h, _, d] = k.dims();
                *k = Tensor::empty([0, h, 0, d], &k.device());
                *v = Tensor::empty([0, h, 0, d], &v.device());
            }
            self.starts.clear();
            self.len = 0;
            return;
        }
        let device = self.layers[0].0.device();
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                rows.iter().map(|&r| r as i64).collect::<Vec<_>>(),
                [rows.len()],
            ),
            &device,
        );
        let starts: Vec<usize> = rows.iter().map(|&r| self.starts[r]).collect();
        let drop = starts.iter().copied().min().unwrap_or(0);
        for (k, v) in &mut self.layers {
            let [_, h, t, d] = k.dims();
            *k = k
                .clone()
                .select(0, idx.clone())
                .slice([0..rows.len(), 0..h, drop..t, 0..d]);
            *v = v
                .clone()
                .select(0, idx.clone())
                .slice([0..rows.len(), 0..h, drop..t, 0..d]);
        }
        self.starts = starts.into_iter().map(|s| s - drop).collect();
        self.len -= drop;
    }

    /// Appends the rows of `other` (e.g. a freshly prefilled prompt), right-aligning both
    /// so every row's last token sits in the last column.
    pub fn append_rows(&mut self, other: KvCache<B>) {
        if self.starts.is_empty() {
            *self = other;
            return;
        }
        let t = self.len.max(other.len);
        let pad = |layers: &mut Vec<(Tensor<B, 4>, Tensor<B, 4>)>, from: usize| {
            if from == t {
                return;
            }
            for (k, v) in layers.iter_mut() {
                let [r, h, _, d] = k.dims();
                let zeros = Tensor::<B, 4>::zeros([r, h, t - from, d], &k.device());
                *k = Tensor::cat(vec![zeros.clone(), k.clone()], 2);
                *v = Tensor::cat(vec![zeros, v.clone()], 2);
            }
        };
        let mut other = other;
        pad(&mut self.layers, self.len);
        pad(&mut other.layers, other.len);
        let (shift_a, shift_b) = (t - self.len, t - other.len);
        for ((k, v), (ok, ov)) in self.layers.iter_mut().zip(other.layers) {
            *k = Tensor::cat(vec![k.clone(), ok], 0);
            *v = Tensor::cat(vec![v.clone(), ov], 0);
        }
        for s in &mut self.starts {
            *s += shift_a;
        }
        self.starts
            .extend(other.starts.into_iter().map(|s| s + shift_b));
        self.len = t;
    }

    /// Repeats every row `n` times (one prompt prefilled once, sampled `n` ways).
    pub fn repeat_rows(&mut self, n: usize) {
        if n == 1 {
            return;
        }
        let rows = self.starts.len();
        let order: Vec<usize> = (0..rows).flat_map(|r| std::iter::repeat_n(r, n)).collect();
        let starts = order.iter().map(|&r| self.starts[r]).collect();
        let device = self.layers[0].0.device();
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                order.iter().map(|&r| r as i64).collect::<Vec<_>>(),
                [order.len()],
            ),
            &device,
        );
        for (k, v) in &mut self.layers {
            *k = k.clone().select(0, idx.clone());
            *v = v.clone().select(0, idx.clone());
        }
        self.starts = starts;
    }

    /// Position of the next token of each row.
    pub fn next_positions(&self) -> Vec<usize> {
        self.starts.iter().map(|&s| self.len - s).collect()
    }
}

/// Builds modules from named tensors; see [`super::hf`] for names and layout.
pub(crate) struct Assembler<'a, B: Backend> {
    pub device: &'a B::Device,
    /// Parameters made so far: each gets an id fixed by its place in the build order
    /// (burn draws them at random), so that checkpoints of the same weights and optimizer
    /// state are the same bytes.
    made: std::cell::Cell<u64>,
}

impl<'a, B: Backend> Assembler<'a, B> {
    pub fn new(device: &'a B::Device) -> Self {
        Assembler {
            device,
            made: std::cell::Cell::new(0),
        }
    }

    /// A trainable parameter with the next stable id.
    fn param<const D: usize>(&self, value: Tensor<B, D>) -> Param<Tensor<B, D>> {
        let n = self.made.get() + 1;
        self.made.set(n);
        let id = crate::seed::derive(0, &format!("param/{n}"));
        Param::initialized(id.into(), value.require_grad())
    }

    /// A linear layer from a contiguous `[in, out]` weight.
    pub fn linear(&self, weight_in_out: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Linear<B> {
        Linear {
            weight: self.param(weight_in_out),
            bias: bias.map(|b| self.param(b)),
        }
    }

    pub fn norm(&self, gamma: Tensor<B, 1>, eps: f64) -> RmsNorm<B> {
        RmsNorm {
            gamma: self.param(gamma),
            epsilon: eps,
        }
    }

    pub fn attention(
        &self,
        cfg: &ModelConfig,
        [q, k, v, o]: [Linear<B>; 4],
        qk_norm: Option<(RmsNorm<B>, RmsNorm<B>)>,
    ) -> Attention<B> {
        let (q_norm, k_norm) = qk_norm.unzip();
        Attention {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        }
    }

    pub fn policy(
        &self,
        cfg: &ModelConfig,
        embed: Tensor<B, 2>,
        blocks: Vec<Block<B>>,
        norm: RmsNorm<B>,
        head: Option<Linear<B>>,
    ) -> Policy<B> {
        let (rope_cos, rope_sin) = rope_tables(cfg, self.device);
        Policy {
            embed: Embedding {
                weight: self.param(embed),
            },
            blocks,
            norm,
            head,
            rope_cos,
            rope_sin,
            config: cfg.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Architecture, InferBackend};

    type B = InferBackend;

    fn ids(v: &[u32]) -> Vec<i64> {
        v.iter().map(|&t| i64::from(t)).collect()
    }

    /// Logits of every position of `seq` by full recompute.
    fn full(model: &Policy<B>, seq: &[u32]) -> Vec<Vec<f32>> {
        let t = Tensor::<B, 2, Int>::from_data(
            TensorData::new(ids(seq), [1, seq.len()]),
            &Default::default(),
        );
        let flat: Vec<f32> = model.forward(t).into_data().into_vec().unwrap();
        flat.chunks(model.config().vocab_size)
            .map(<[f32]>::to_vec)
            .collect()
    }

    fn prefill(model: &Policy<B>, prompt: &[u32]) -> (KvCache<B>, Vec<f32>) {
        let mut cache = model.empty_cache(1);
        let t = Tensor::<B, 2, Int>::from_data(
            TensorData::new(ids(prompt), [1, prompt.len()]),
            &Default::default(),
        );
        let pos: Vec<usize> = (0..prompt.len()).collect();
        let flat: Vec<f32> = model
            .forward_with(t, &pos, AttnMode::Cached(&mut cache))
            .into_data()
            .into_vec()
            .unwrap();
        let v = model.config().vocab_size;
        (cache, flat[flat.len() - v..].to_vec())
    }

    fn step(model: &Policy<B>, cache: &mut KvCache<B>, next: &[u32]) -> Vec<Vec<f32>> {
        let t = Tensor::<B, 2, Int>::from_data(
            TensorData::new(ids(next), [next.len(), 1]),
            &Default::default(),
        );
        let pos = cache.next_positions();
        let flat: Vec<f32> = model
            .forward_with(t, &pos, AttnMode::Cached(cache))
            .into_data()
            .into_vec()
            .unwrap();
        flat.chunks(model.config().vocab_size)
            .map(<[f32]>::to_vec)
            .collect()
    }

    fn assert_close(a: &[f32], b: &[f32], what: &str) {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(d < 1e-4, "{what}: max diff {d}");
    }

    #[test]
    fn cached_decode_matches_full_recompute_as_rows_join_and_leave() {
        let cfg = ModelConfig::tiny(Architecture::Llama, 50);
        assert_eq!(
            (cfg.num_heads, cfg.num_kv_heads),
            (4, 2),
            "grouped-query attention under test"
        );
        let model = Policy::<B>::random(&cfg, 5, &Default::default()).unwrap();
        let a: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % 50).collect();
        let b: Vec<u32> = (0..11).map(|i| (i * 5 + 1) % 50).collect();
        let c: Vec<u32> = (0..9).map(|i| (i * 3 + 2) % 50).collect();
        let (fa, fb, fc) = (full(&model, &a), full(&model, &b), full(&model, &c));

        // Row a: prompt of 4, then decode.
        let (mut cache, last) = prefill(&model, &a[..4]);
        assert_close(&last, &fa[3], "a prefill");
        let mut pos = vec![4usize];
        let mut rows = vec![('a', &a, &fa)];
        for round in 0..7 {
            if round == 2 {
                // b joins with a 6-token prompt (longer than a's cache: a gets left-padded).
                let (cb, lb) = prefill(&model, &b[..6]);
                assert_close(&lb, &fb[5], "b prefill");
                cache.append_rows(cb);
                pos.push(6);
                rows.push(('b', &b, &fb));
            }
            if round == 4 {
                // a leaves; c joins with a 2-token prompt.
                cache.keep_rows(&[1]);
                pos.remove(0);
                rows.remove(0);
                let (cc, lc) = prefill(&model, &c[..2]);
                assert_close(&lc, &fc[1], "c prefill");
                cache.append_rows(cc);
                pos.push(2);
                rows.push(('c', &c, &fc));
            }
            let next: Vec<u32> = rows.iter().zip(&pos).map(|((_, s, _), &p)| s[p]).collect();
            let out = step(&model, &mut cache, &next);
            for (i, ((name, _, f), p)) in rows.iter().zip(pos.iter_mut()).enumerate() {
                assert_close(
                    &out[i],
                    &f[*p],
                    &format!("row {name} at {p}, round {round}"),
                );
                *p += 1;
            }
        }
        assert_eq!(cache.rows(), 2);
    }
}

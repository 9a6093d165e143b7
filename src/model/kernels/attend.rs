//! Attention on the CPU, one query at a time in one fixed order: the scores are
//! [`rows::dot`](super::rows) products, the softmax runs over the visible keys in key order,
//! and the output sums the values in key order with fused multiply-adds. Masked keys are
//! skipped, which is exact (their probability is 0), so a query's result depends only on
//! the keys it sees: not on left padding, on how many rows share the batch, or on whether
//! its keys came from a cache (a decode step) or from the same pass (prefill, training).

use super::logprob::MASKED;
use super::rows;
use rayon::prelude::*;

/// The layout of one attention call: queries `[b, kv_heads, rows, hd]` (a kv head's query
/// heads grouped, `rows` = group × `l`), keys and values `[b, kv_heads, t, hd]`, bias
/// `[bias_b, 1, l, t]` with `bias_b` 1 or `b`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub b: usize,
    pub kv_heads: usize,
    pub rows: usize,
    pub l: usize,
    pub t: usize,
    pub hd: usize,
    pub bias_b: usize,
}

/// The output `[b, kv_heads, rows, hd]` and, when `keep`, the probabilities `[b,
/// kv_heads, rows, t]` (the backward's input).
pub(super) fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    bias: &[f32],
    s: Shape,
    scale: f32,
    keep: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let n = s.b * s.kv_heads * s.rows;
    assert_eq!(q.len(), n * s.hd, "q is [b, kv_heads, rows, hd]");
    assert_eq!(
        k.len(),
        s.b * s.kv_heads * s.t * s.hd,
        "k is [b, kv_heads, t, hd]"
    );
    assert_eq!(v.len(), k.len(), "v is shaped as k");
    assert_eq!(
        bias.len(),
        s.bias_b * s.l * s.t,
        "bias is [1 or b, 1, l, t]"
    );
    let mut out = vec![0f32; n * s.hd];
    if n == 0 || s.hd == 0 {
        return (out, keep.then(|| vec![0f32; n * s.t]));
    }
    // About 16k multiply-adds a task: a decode step's few queries stay on one core.
    let min = (16_384 / (s.t * s.hd).max(1)).max(1);
    let query = |i: usize, o: &mut [f32], p: &mut [f32]| {
        let (bi, hi, qi) = (
            i / (s.kv_heads * s.rows),
            i / s.rows % s.kv_heads,
            i % s.rows,
        );
        let kv = (bi * s.kv_heads + hi) * s.t * s.hd;
        let b_at = ((if s.bias_b == 1 { 0 } else { bi }) * s.l + qi % s.l) * s.t;
        let row = Query {
            q: &q[i * s.hd..(i + 1) * s.hd],
            k: &k[kv..kv + s.t * s.hd],
            v: &v[kv..kv + s.t * s.hd],
            bias: &bias[b_at..b_at + s.t],
            hd: s.hd,
            scale,
        };
        row.run(o, p);
    };
    if keep {
        let mut probs = vec![0f32; n * s.t];
        out.par_chunks_mut(s.hd)
            .zip(probs.par_chunks_mut(s.t.max(1)))
            .enumerate()
            .with_min_len(min)
            .for_each(|(i, (o, p))| query(i, o, p));
        (out, Some(probs))
    } else {
        out.par_chunks_mut(s.hd)
            .enumerate()
            .with_min_len(min)
            .for_each_init(|| vec![0f32; s.t], |p, (i, o)| query(i, o, p));
        (out, None)
    }
}

/// One query's operands.
struct Query<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    bias: &'a [f32],
    hd: usize,
    scale: f32,
}

impl Query<'_> {
    /// Writes the output `o` `[hd]` and the probabilities `p` `[t]`.
    fn run(&self, o: &mut [f32], p: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if rows::fma_available() {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { self.run_fma(o, p) };
            return;
        }
        self.run_portable(o, p);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_fma(&self, o: &mut [f32], p: &mut [f32]) {
        self.run_portable(o, p)
    }

    #[inline(always)]
    fn run_portable(&self, o: &mut [f32], p: &mut [f32]) {
        let hd = self.hd;
        // A row that sees nothing (never built by the model) attends to every key, as the
        // composed softmax would.
        let none = self.bias.iter().all(|&b| b == MASKED);
        let visible = |j: usize| none || self.bias[j] != MASKED;
        let mut max = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            if visible(j) {
                let kj = &self.k[j * hd..(j + 1) * hd];
                *pj = rows::portable_dot(self.q, kj) * self.scale + self.bias[j];
                max = max.max(*pj);
            }
        }
        let mut sum = 0f32;
        for (j, pj) in p.iter_mut().enumerate() {
            if visible(j) {
                *pj = (*pj - max).exp();
                sum += *pj;
            } else {
                *pj = 0.0;
            }
        }
        let inv = 1.0 / sum;
        o.fill(0.0);
        for (j, pj) in p.iter_mut().enumerate() {
            *pj *= inv;
            if visible(j) {
                let vj = &self.v[j * hd..(j + 1) * hd];
                for (od, &vd) in o.iter_mut().zip(vj) {
                    *od = pj.mul_add(vd, *od);
                }
            }
        }
    }
}

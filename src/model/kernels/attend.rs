//! Attention on the CPU, one query at a time in one fixed order: the scores are
//! [`rows::dot`](super::rows) products, the softmax runs over the visible keys in key order,
//! and the output sums the values in key order with fused multiply-adds. Masked keys are
//! skipped, which is exact (their probability is 0), so a query's result depends only on
//! the keys it sees: not on left padding, on how many rows share the batch, or on whether
//! its keys came from a cache (a decode step) or from the same pass (prefill, training).
//!
//! The forward keeps only each query's log-sum-exp for the backward ([`attend_backward`]),
//! which recomputes the probabilities a block of queries at a time: the saved state is
//! linear in the length, and the square of it exists for one block only.

use super::exp::{exp, exp_in_place};
use super::logprob::MASKED;
use super::products::mat_mul;
use super::rows;
use ndarray::{ArrayView2, ArrayViewMut2};
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

impl Shape {
    fn check(&self, q: &[f32], k: &[f32], v: &[f32], bias: &[f32]) {
        let s = self;
        assert_eq!(
            q.len(),
            s.b * s.kv_heads * s.rows * s.hd,
            "q is [b, kv_heads, rows, hd]"
        );
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
    }

    /// The keys `lo..hi` that any of the flat query rows `rows` sees (all of them for a row
    /// that sees none, as attention attends then); every key outside has probability 0 for
    /// these rows.
    ///
    /// Each row is searched only where it could widen the range found so far (before `lo`,
    /// from `hi`), so a block of causal rows costs about one row's length, not one per row.
    fn key_range(&self, bias: &[f32], rows: std::ops::Range<usize>) -> (usize, usize) {
        let seen = |x: &f32| *x != MASKED;
        let (mut lo, mut hi) = (self.t, 0);
        for i in rows {
            let b = self.bias_row(bias, i);
            match b[..lo].iter().position(seen) {
                Some(first) => lo = first,
                // Nothing before `lo`: the row sees a key at or after it, or none at all.
                None if !b[lo..].iter().any(seen) => return (0, self.t),
                None => {}
            }
            if let Some(last) = b[hi..].iter().rposition(seen) {
                hi += last + 1;
            }
        }
        (lo.min(hi), hi)
    }

    /// Query row `i`'s bias row (its batch row's, at its position).
    fn bias_row<'a>(&self, bias: &'a [f32], i: usize) -> &'a [f32] {
        let bi = i / (self.kv_heads * self.rows);
        let qi = i % self.rows;
        let at = ((if self.bias_b == 1 { 0 } else { bi }) * self.l + qi % self.l) * self.t;
        &bias[at..at + self.t]
    }
}

/// The output `[b, kv_heads, rows, hd]` and each query's log-sum-exp `[b, kv_heads, rows]`
/// of its scaled, biased scores (the backward's input).
///
/// A block of up to [`QUERY_BLOCK`] queries of one kv head at a time: the block's scores
/// over the keys any of its rows sees are one product by [`rows::rows_by_transposed`]
/// (each score [`rows::portable_dot`]'s bits, whatever the block), then each row's softmax
/// and output run over its visible keys in key order.
pub(super) fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    bias: &[f32],
    s: Shape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    s.check(q, k, v, bias);
    let heads = s.b * s.kv_heads;
    let mut out = vec![0f32; heads * s.rows * s.hd];
    let mut lse = vec![0f32; heads * s.rows];
    if out.is_empty() {
        return (out, lse);
    }
    out.par_chunks_mut(s.rows * s.hd)
        .zip(lse.par_chunks_mut(s.rows))
        .enumerate()
        .for_each(|(h, (out, lse))| {
            let head = Head::of((q, k, v), bias, s, h, scale);
            out.par_chunks_mut(QUERY_BLOCK * s.hd)
                .zip(lse.par_chunks_mut(QUERY_BLOCK))
                .enumerate()
                .for_each(|(blk, (o, l))| head.forward(blk * QUERY_BLOCK, o, l));
        });
    (out, lse)
}

/// One batch row's kv head: its grouped queries `[rows, hd]`, keys and values `[t, hd]`.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    bias: &'a [f32],
    /// The flat query index of row 0 (for its bias row).
    first: usize,
    s: Shape,
    scale: f32,
}

impl<'a> Head<'a> {
    /// Head `h` (batch row × kv heads + kv head) of the operands laid out as `s` says.
    fn of(
        (q, k, v): (&'a [f32], &'a [f32], &'a [f32]),
        bias: &'a [f32],
        s: Shape,
        h: usize,
        scale: f32,
    ) -> Self {
        let (qn, kn) = (s.rows * s.hd, s.t * s.hd);
        Head {
            q: &q[h * qn..][..qn],
            k: &k[h * kn..][..kn],
            v: &v[h * kn..][..kn],
            bias,
            first: h * s.rows,
            s,
            scale,
        }
    }

    /// Writes the outputs `o` `[rows, hd]` and log-sum-exps `lse` `[rows]` of the block of
    /// query rows from `r0`.
    fn forward(&self, r0: usize, o: &mut [f32], lse: &mut [f32]) {
        let (hd, nb) = (self.s.hd, lse.len());
        let first = self.first + r0;
        let (lo, hi) = self.s.key_range(self.bias, first..first + nb);
        if hi == lo {
            return;
        }
        let nk = hi - lo;
        let q = &self.q[r0 * hd..(r0 + nb) * hd];
        let mut scores = rows::rows_by_transposed(q, nb, &self.k[lo * hd..hi * hd], nk, hd);
        let v = &self.v[lo * hd..hi * hd];
        for (i, (p, (o, lse))) in scores
            .chunks_exact_mut(nk)
            .zip(o.chunks_exact_mut(hd).zip(lse.iter_mut()))
            .enumerate()
        {
            let bias = &self.s.bias_row(self.bias, first + i)[lo..hi];
            *lse = softmax_out(p, bias, v, hd, self.scale, o);
        }
    }
}

/// One query's softmax over its dot products `p` (the keys `lo..hi`, in key order) with
/// their `bias`, and its output `o` `[hd]` over the values `v` `[hi - lo, hd]`: the
/// log-sum-exp of the scaled, biased scores it saw. A row that sees nothing (never built by
/// the model) attends to every key, as the composed softmax would.
fn softmax_out(
    p: &mut [f32],
    bias: &[f32],
    v: &[f32],
    hd: usize,
    scale: f32,
    o: &mut [f32],
) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if rows::fma_available() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { softmax_out_fma(p, bias, v, hd, scale, o) };
    }
    softmax_out_portable(p, bias, v, hd, scale, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_out_fma(
    p: &mut [f32],
    bias: &[f32],
    v: &[f32],
    hd: usize,
    scale: f32,
    o: &mut [f32],
) -> f32 {
    softmax_out_portable(p, bias, v, hd, scale, o)
}

#[inline(always)]
fn softmax_out_portable(
    p: &mut [f32],
    bias: &[f32],
    v: &[f32],
    hd: usize,
    scale: f32,
    o: &mut [f32],
) -> f32 {
    let none = bias.iter().all(|&b| b == MASKED);
    let visible = |j: usize| none || bias[j] != MASKED;
    let mut max = f32::NEG_INFINITY;
    for (j, pj) in p.iter_mut().enumerate() {
        if visible(j) {
            *pj = *pj * scale + bias[j];
            max = max.max(*pj);
        }
    }
    // A hidden column's e^-inf is 0, and adding 0 leaves the (positive) sum's bits as
    // they are: the visible columns' sum in their order.
    for (j, pj) in p.iter_mut().enumerate() {
        *pj = if visible(j) {
            *pj - max
        } else {
            f32::NEG_INFINITY
        };
    }
    exp_in_place(p);
    let mut sum = 0f32;
    p.iter().for_each(|&pj| sum += pj);
    let inv = 1.0 / sum;
    o.fill(0.0);
    for (j, pj) in p.iter_mut().enumerate() {
        *pj *= inv;
        if visible(j) {
            let vj = &v[j * hd..(j + 1) * hd];
            for (od, &vd) in o.iter_mut().zip(vj) {
                *od = pj.mul_add(vd, *od);
            }
        }
    }
    max + sum.ln()
}

/// Query rows one block takes, forward and backward: its scores (and in the backward their
/// gradient) are `[QUERY_BLOCK, t]` buffers, the only state that grows with the length
/// squared, and only for one block at a time.
const QUERY_BLOCK: usize = 64;

/// Saved and incoming values of one attention's backward: the forward's output and
/// log-sum-exp, and the output's gradient, laid out as [`attend`] returns them.
pub(super) struct Saved<'a> {
    pub out: &'a [f32],
    pub lse: &'a [f32],
    pub dy: &'a [f32],
}

/// Gradients `(dq, dk, dv)` of [`attend`], its probabilities recomputed block by block from
/// the scores and the saved log-sum-exp (flash attention's backward): per query block, the
/// scores over the keys any of its rows sees, their probabilities, and the products that
/// add into the gradients, on one task per batch row and kv head.
pub(super) fn attend_backward(
    (q, k, v): (&[f32], &[f32], &[f32]),
    bias: &[f32],
    saved: Saved<'_>,
    s: Shape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    s.check(q, k, v, bias);
    let heads = s.b * s.kv_heads;
    let (qn, kn) = (s.rows * s.hd, s.t * s.hd);
    let mut dq = vec![0f32; heads * qn];
    let mut dk = vec![0f32; heads * kn];
    let mut dv = vec![0f32; heads * kn];
    if qn == 0 || kn == 0 {
        return (dq, dk, dv);
    }
    dq.par_chunks_mut(qn)
        .zip(dk.par_chunks_mut(kn))
        .zip(dv.par_chunks_mut(kn))
        .enumerate()
        .for_each(|(h, ((dq, dk), dv))| {
            let own = Saved {
                out: &saved.out[h * qn..][..qn],
                dy: &saved.dy[h * qn..][..qn],
                lse: &saved.lse[h * s.rows..][..s.rows],
            };
            Head::of((q, k, v), bias, s, h, scale).backward(&own, dq, dk, dv);
        });
    (dq, dk, dv)
}

/// `rows × cols` values of `data` from `at`, row-major.
fn view(data: &[f32], at: usize, rows: usize, cols: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((rows, cols), &data[at..at + rows * cols])
        .unwrap_or_else(|e| unreachable!("a block inside its buffer: {e}"))
}

fn view_mut(data: &mut [f32], at: usize, rows: usize, cols: usize) -> ArrayViewMut2<'_, f32> {
    ArrayViewMut2::from_shape((rows, cols), &mut data[at..at + rows * cols])
        .unwrap_or_else(|e| unreachable!("a block inside its buffer: {e}"))
}

impl Head<'_> {
    /// Adds this head's gradients into `dq` `[rows, hd]`, `dk` and `dv` `[t, hd]`, from its
    /// saved output and log-sum-exps and its output's gradient.
    fn backward(&self, saved: &Saved<'_>, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
        let (hd, t) = (self.s.hd, self.s.t);
        let mut probs = vec![0f32; QUERY_BLOCK.min(self.s.rows) * t];
        let mut dscores = vec![0f32; probs.len()];
        for r0 in (0..self.s.rows).step_by(QUERY_BLOCK) {
            let r1 = (r0 + QUERY_BLOCK).min(self.s.rows);
            let (lo, hi) = self
                .s
                .key_range(self.bias, self.first + r0..self.first + r1);
            let (nb, nk) = (r1 - r0, hi - lo);
            if nk == 0 {
                continue;
            }
            let (qb, dyb) = (
                view(self.q, r0 * hd, nb, hd),
                view(saved.dy, r0 * hd, nb, hd),
            );
            let (kb, vb) = (view(self.k, lo * hd, nk, hd), view(self.v, lo * hd, nk, hd));
            let mut p = view_mut(&mut probs, 0, nb, nk);
            let mut ds = view_mut(&mut dscores, 0, nb, nk);
            mat_mul(&qb, &kb.t(), false, &mut p);
            mat_mul(&dyb, &vb.t(), false, &mut ds);
            for (i, (mut pr, mut dr)) in p.rows_mut().into_iter().zip(ds.rows_mut()).enumerate() {
                let bias = &self.s.bias_row(self.bias, self.first + r0 + i)[lo..hi];
                let lse = saved.lse[r0 + i];
                let at = (r0 + i) * hd;
                let d = rows::portable_dot(&saved.dy[at..at + hd], &saved.out[at..at + hd]);
                for (pj, &bj) in pr.iter_mut().zip(bias) {
                    *pj = *pj * self.scale + bj - lse;
                }
                match pr.as_slice_mut() {
                    Some(row) => exp_in_place(row),
                    None => pr.mapv_inplace(exp),
                }
                for (pj, dj) in pr.iter().zip(dr.iter_mut()) {
                    *dj = *pj * (*dj - d) * self.scale;
                }
            }
            mat_mul(&p.t(), &dyb, true, &mut view_mut(dv, lo * hd, nk, hd));
            mat_mul(&ds.view(), &kb, false, &mut view_mut(dq, r0 * hd, nb, hd));
            mat_mul(&ds.t(), &qb, true, &mut view_mut(dk, lo * hd, nk, hd));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MASKED, Shape};

    /// Every row searched whole: the range the narrowed search must find.
    fn every_row(s: &Shape, bias: &[f32], rows: std::ops::Range<usize>) -> (usize, usize) {
        let (mut lo, mut hi) = (s.t, 0);
        for i in rows {
            let b = s.bias_row(bias, i);
            match (
                b.iter().position(|&x| x != MASKED),
                b.iter().rposition(|&x| x != MASKED),
            ) {
                (Some(first), Some(last)) => (lo, hi) = (lo.min(first), hi.max(last + 1)),
                _ => return (0, s.t),
            }
        }
        (lo.min(hi), hi)
    }

    /// Causal rows, left-padded rows (padding queries see nothing), holes, and rows seeing
    /// keys out of order: the narrowed search finds each block's range as a whole search does.
    #[test]
    fn the_key_range_is_every_rows_range() {
        let (l, t) = (7, 10);
        let mut bias = vec![MASKED; 3 * l * t];
        for (bi, start) in [(0, 0), (1, 4), (2, 2)] {
            for q in 0..l {
                for j in 0..t {
                    let causal = j >= start && j <= q + 3;
                    let hole = bi == 2 && (j == 3 || (q % 3 == 1 && j > 5));
                    if causal && !hole {
                        bias[(bi * l + q) * t + j] = 0.0;
                    }
                }
            }
        }
        // Batch row 2's query 0 sees one late key only.
        bias[(2 * l) * t..(2 * l + 1) * t].fill(MASKED);
        bias[(2 * l) * t + 8] = 0.0;
        let s = Shape {
            b: 3,
            kv_heads: 2,
            rows: l,
            l,
            t,
            hd: 4,
            bias_b: 3,
        };
        let all = s.b * s.kv_heads * s.rows;
        for first in 0..all {
            for n in 1..=(all - first).min(9) {
                let rows = first..first + n;
                assert_eq!(
                    s.key_range(&bias, rows.clone()),
                    every_row(&s, &bias, rows.clone()),
                    "rows {rows:?}"
                );
            }
        }
    }
}

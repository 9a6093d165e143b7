//! The AVX2/FMA kernels of [`super`]: the few-rows block (four weight rows by three input
//! rows) and the packed many-rows tiles, eight lanes a register.

use super::{Elem, Strides};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Eight weight values from `p` as f32 (bf16 widened by a shift).
///
/// # Safety
/// The CPU has AVX2; `p` starts eight readable elements.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load8<E: Elem>(p: *const E) -> __m256 {
    if E::BF16 {
        // SAFETY: eight u16 are 128 bits from `p`.
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    } else {
        // SAFETY: eight f32 from `p`.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }
}

/// Four weight rows by three input rows: twelve accumulators, three input loads and
/// four weight loads per eight values of `k`.
pub(super) const COLS: usize = 4;
pub(super) const ROWS: usize = 3;

#[target_feature(enable = "avx2,fma")]
pub(super) fn fold(v: __m256) -> f32 {
    // Lanes i and i + 4, then 0 + 2 and 1 + 3, then the two: `super::fold`'s order.
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// The many-rows product on packed operands (see [`super::pack`]): `out[r * n + c] =
/// x[r] · w[c]` for the `rows` input rows of `x` and the `n` weight rows of `w`, summed
/// as [`block`] sums them (the tails from `x`'s rows and from `tails`, each weight row's
/// last `k % 8` values).
///
/// # Safety
/// The CPU has AVX2 and FMA; `xp`, `wp` are `pack(x, rows, k, 3)`, `pack(w, n, k, 4)`
/// with `x` `[rows, k]`, `w` `[n, k]`, `tails` `[n, k % 8]`, `out` `[rows, n]`,
/// `rows, n > 0`, `k >= 8`. Every one of `out`'s `rows × n` values is written (none is
/// read), so it may start uninitialised.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn packed(
    xp: &[f32],
    x: &[f32],
    rows: usize,
    wp: &[f32],
    tails: &[f32],
    n: usize,
    k: usize,
    out: &mut [MaybeUninit<f32>],
) {
    let (k8, kt) = (k - k % 8, k % 8);
    let (xs, ws) = (ROWS * k8, COLS * k8);
    for c in (0..n).step_by(COLS) {
        let nc = (n - c).min(COLS);
        let wg = wp[c / COLS * ws..][..ws].as_ptr();
        for r in (0..rows).step_by(ROWS) {
            let nr = (rows - r).min(ROWS);
            let xt = xp[r / ROWS * xs..][..xs].as_ptr();
            let mut acc = [_mm256_setzero_ps(); ROWS * COLS];
            for step in 0..k8 / 8 {
                // SAFETY: tile and group hold `k8 / 8` runs of 24 and 32 values.
                let (xv, wv) = unsafe {
                    let (xq, wq) = (xt.add(step * 8 * ROWS), wg.add(step * 8 * COLS));
                    (
                        [
                            _mm256_loadu_ps(xq),
                            _mm256_loadu_ps(xq.add(8)),
                            _mm256_loadu_ps(xq.add(16)),
                        ],
                        [
                            _mm256_loadu_ps(wq),
                            _mm256_loadu_ps(wq.add(8)),
                            _mm256_loadu_ps(wq.add(16)),
                            _mm256_loadu_ps(wq.add(24)),
                        ],
                    )
                };
                for cc in 0..COLS {
                    for a in 0..ROWS {
                        acc[a * COLS + cc] = _mm256_fmadd_ps(xv[a], wv[cc], acc[a * COLS + cc]);
                    }
                }
            }
            for a in 0..nr {
                for cc in 0..nc {
                    let mut s = fold(acc[a * COLS + cc]);
                    let (xr, wr) = (&x[(r + a) * k..][..k], &tails[(c + cc) * kt..][..kt]);
                    for t in k8..k {
                        s = xr[t].mul_add(wr[t - k8], s);
                    }
                    out[(r + a) * n + c + cc] = MaybeUninit::new(s);
                }
            }
        }
    }
}

/// See [`super::block`].
///
/// # Safety
/// The CPU has AVX2 and FMA; `x.len() >= rows * k`, `w.len() == cols * k` for some
/// `cols`, and `out` holds `(cols - 1) * strides.col + (rows - 1) * strides.row`, with
/// `rows > 0` and `k > 0`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block<E: Elem>(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[E],
    out: &mut [f32],
    strides: Strides,
) {
    let cols = w.len() / k;
    let k8 = k - k % 8;
    for c in (0..cols).step_by(COLS) {
        let nc = (cols - c).min(COLS);
        // A short last group repeats its last row (computed, not stored). The loads stay
        // out of closures, which would not inherit this function's target features.
        let row_of = |m: &'_ [f32], j: usize| -> *const f32 { m[j * k..(j + 1) * k].as_ptr() };
        let last = c + nc - 1;
        let w_row = |j: usize| -> *const E { w[j * k..(j + 1) * k].as_ptr() };
        let wr = [
            w_row(c),
            w_row((c + 1).min(last)),
            w_row((c + 2).min(last)),
            w_row((c + 3).min(last)),
        ];
        for r in (0..rows).step_by(ROWS) {
            let nr = (rows - r).min(ROWS);
            let last = r + nr - 1;
            let xr = [
                row_of(x, r),
                row_of(x, (r + 1).min(last)),
                row_of(x, (r + 2).min(last)),
            ];
            let mut acc = [_mm256_setzero_ps(); ROWS * COLS];
            let mut i = 0;
            while i < k8 {
                // SAFETY: every pointer starts a row of `k` values and `i + 8 <= k8 <= k`.
                let xv = unsafe {
                    [
                        _mm256_loadu_ps(xr[0].add(i)),
                        _mm256_loadu_ps(xr[1].add(i)),
                        _mm256_loadu_ps(xr[2].add(i)),
                    ]
                };
                for (cc, row) in wr.iter().enumerate() {
                    // SAFETY: as above.
                    let wv = unsafe { load8(row.add(i)) };
                    for a in 0..ROWS {
                        acc[a * COLS + cc] = _mm256_fmadd_ps(xv[a], wv, acc[a * COLS + cc]);
                    }
                }
                i += 8;
            }
            for a in 0..nr {
                for cc in 0..nc {
                    let mut s = fold(acc[a * COLS + cc]);
                    for t in k8..k {
                        // SAFETY: `t < k`, within the rows.
                        let (xt, wt) = unsafe { (*xr[a].add(t), (*wr[cc].add(t)).widen()) };
                        s = xt.mul_add(wt, s);
                    }
                    out[(c + cc) * strides.col + (r + a) * strides.row] = s;
                }
            }
        }
    }
}

//! The AVX-512 kernels of [`super`]: each 512-bit register two outputs in the AVX2 path's
//! eight lanes (the same sums), for the packed many-rows tiles and the few-rows product.

use super::{Elem, Strides};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// The few-rows tile: six weight rows by [`FEW_GROUP`] input rows.
pub(super) const FEW_COLS: usize = 6;
/// Input rows per group of the few-rows path, packed by [`super::pack`] so that each
/// pair of rows' eight values fills one 512-bit register (row `2p` low, `2p + 1` high).
pub(super) const FEW_GROUP: usize = 8;
/// Fewer rows take the AVX2 few-rows kernel: a pair would be half empty, and a step of
/// so few rows is bound by reading the weight, not by the arithmetic.
pub(super) const FEW_MIN_ROWS: usize = 2;
/// Values of `k` per pass over the groups of rows: the tile's six weight rows (24 KiB)
/// stay in L1 while every group reads them.
const FEW_DEPTH: usize = 1024;
/// Accumulators of one tile: `FEW_COLS` weight rows by four pairs of input rows.
const ACC: usize = FEW_COLS * FEW_GROUP / 2;

/// Eight weight values from `p` as f32 (bf16 widened by a shift), in both halves.
///
/// # Safety
/// The CPU has AVX-512 F and DQ; `p` starts eight readable elements.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
#[inline]
unsafe fn broadcast8<E: Elem>(p: *const E) -> __m512 {
    if E::BF16 {
        // SAFETY: eight u16 are 128 bits from `p`.
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        let v = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
        _mm512_broadcast_f32x8(_mm256_castsi256_ps(v))
    } else {
        // SAFETY: eight f32 from `p`.
        _mm512_broadcast_f32x8(unsafe { _mm256_loadu_ps(p.cast()) })
    }
}

/// The few-rows product ([`super::block`]'s contract) with the input rows packed in
/// pairs: each weight row's eight values broadcast to both halves of a register meet a
/// pair of input rows, so each 512-bit accumulator carries two outputs in the AVX2
/// path's eight lanes each: the same sums. Twenty-four accumulators, four input loads
/// and six weight loads per eight values of `k`; the weight as stored, read once from
/// memory. Long rows go [`FEW_DEPTH`] values at a time over every group of input rows,
/// each group's accumulators kept between (stored and reloaded exactly: the order of
/// the sums is unchanged).
///
/// # Safety
/// The CPU has AVX-512 F and DQ, AVX2 and FMA; `xp` is `pack(x, rows, k, FEW_GROUP)`
/// with `x` `[rows, k]`, `rows > 0`, `k >= 8`; `w.len() == cols * k` for some `cols`,
/// and `out` holds `(cols - 1) * strides.col + (rows - 1) * strides.row`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn few<E: Elem>(
    xp: &[f32],
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[E],
    out: &mut [f32],
    strides: Strides,
) {
    let cols = w.len() / k;
    let k8 = k - k % 8;
    let xs = FEW_GROUP * k8;
    let groups = rows.div_ceil(FEW_GROUP);
    let mut accs = vec![[_mm512_setzero_ps(); ACC]; groups];
    for c in (0..cols).step_by(FEW_COLS) {
        let nc = (cols - c).min(FEW_COLS);
        // A short last group repeats its last row (computed, not stored).
        let last = c + nc - 1;
        let wr: [*const E; FEW_COLS] =
            std::array::from_fn(|j| w[(c + j).min(last) * k..][..k].as_ptr());
        accs.iter_mut()
            .for_each(|a| *a = [_mm512_setzero_ps(); ACC]);
        for from in (0..k8).step_by(FEW_DEPTH) {
            let to = (from + FEW_DEPTH).min(k8);
            for (g, acc) in accs.iter_mut().enumerate() {
                let xt = xp[g * xs..][..xs].as_ptr();
                // SAFETY: `xt` holds `k8 / 8` runs of `FEW_GROUP` rows' eight values,
                // each `wr` row `k >= to` values; the CPU as this function requires.
                unsafe {
                    match (rows - g * FEW_GROUP).min(FEW_GROUP).div_ceil(2) {
                        1 => tile::<E, 1>(xt, &wr, from, to, acc),
                        2 => tile::<E, 2>(xt, &wr, from, to, acc),
                        3 => tile::<E, 3>(xt, &wr, from, to, acc),
                        _ => tile::<E, 4>(xt, &wr, from, to, acc),
                    }
                }
            }
        }
        for (g, acc) in accs.iter().enumerate() {
            let r = g * FEW_GROUP;
            for a in 0..(rows - r).min(FEW_GROUP) {
                for cc in 0..nc {
                    let v = acc[a / 2 * FEW_COLS + cc];
                    let half = if a % 2 == 0 {
                        _mm512_castps512_ps256(v)
                    } else {
                        _mm512_extractf32x8_ps::<1>(v)
                    };
                    let mut s = super::avx2::fold(half);
                    let (xr, wc) = (&x[(r + a) * k..][..k], &w[(c + cc) * k..][..k]);
                    for t in k8..k {
                        s = xr[t].mul_add(wc[t].widen(), s);
                    }
                    out[(c + cc) * strides.col + (r + a) * strides.row] = s;
                }
            }
        }
    }
}

/// `P` pairs of packed input rows by [`FEW_COLS`] weight rows over values `from..to`,
/// added to `acc`: accumulator `p * FEW_COLS + cc` is pair `p` against weight row `cc`.
///
/// # Safety
/// As [`few`]: `xt` holds runs of `FEW_GROUP * 8` values up to `to`, each `wr` row at
/// least `to` values, `from` and `to` multiples of eight.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
#[inline]
unsafe fn tile<E: Elem, const P: usize>(
    xt: *const f32,
    wr: &[*const E; FEW_COLS],
    from: usize,
    to: usize,
    acc: &mut [__m512; ACC],
) {
    let mut sums = *acc;
    for i in (from..to).step_by(8) {
        // SAFETY: the caller's bounds: the run of values `i..i + 8`.
        let xq = unsafe { xt.add(i * FEW_GROUP) };
        let mut xv = [_mm512_setzero_ps(); P];
        for (p, v) in xv.iter_mut().enumerate() {
            // SAFETY: as above, pair `p < FEW_GROUP / 2` of the run.
            *v = unsafe { _mm512_loadu_ps(xq.add(16 * p)) };
        }
        for (cc, row) in wr.iter().enumerate() {
            // SAFETY: as above.
            let wv = unsafe { broadcast8(row.add(i)) };
            for (p, v) in xv.iter().enumerate() {
                sums[p * FEW_COLS + cc] = _mm512_fmadd_ps(*v, wv, sums[p * FEW_COLS + cc]);
            }
        }
    }
    *acc = sums;
}

/// Four input rows by eight weight rows: each 512-bit register holds two outputs, eight
/// lanes each (the AVX2 path's lanes), so sixteen accumulators, four input loads (each
/// row's eight values in both halves) and four weight loads per eight values of `k`.
pub(super) const ROWS: usize = 4;
pub(super) const COLS: usize = 8;

/// See [`super::avx2::packed`]; `xp`, `wp` are `pack(x, rows, k, 4)` and
/// `pack(w, n, k, 8)`, `tails` `[n, k % 8]`.
///
/// # Safety
/// The CPU has AVX-512 F and DQ, AVX2 and FMA; the operands as in `avx2::packed`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
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
    const PAIRS: usize = COLS / 2;
    let (k8, kt) = (k - k % 8, k % 8);
    let (xs, ws) = (ROWS * k8, COLS * k8);
    for c in (0..n).step_by(COLS) {
        let nc = (n - c).min(COLS);
        let wg = wp[c / COLS * ws..][..ws].as_ptr();
        for r in (0..rows).step_by(ROWS) {
            let nr = (rows - r).min(ROWS);
            let xt = xp[r / ROWS * xs..][..xs].as_ptr();
            let mut acc = [_mm512_setzero_ps(); ROWS * PAIRS];
            for step in 0..k8 / 8 {
                // SAFETY: tile and group hold `k8 / 8` runs of 32 and 64 values.
                let (xq, wq) = unsafe { (xt.add(step * 8 * ROWS), wg.add(step * 8 * COLS)) };
                let xv = unsafe {
                    [
                        _mm512_broadcast_f32x8(_mm256_loadu_ps(xq)),
                        _mm512_broadcast_f32x8(_mm256_loadu_ps(xq.add(8))),
                        _mm512_broadcast_f32x8(_mm256_loadu_ps(xq.add(16))),
                        _mm512_broadcast_f32x8(_mm256_loadu_ps(xq.add(24))),
                    ]
                };
                for p in 0..PAIRS {
                    // SAFETY: as above.
                    let wv = unsafe { _mm512_loadu_ps(wq.add(p * 16)) };
                    for a in 0..ROWS {
                        acc[a * PAIRS + p] = _mm512_fmadd_ps(xv[a], wv, acc[a * PAIRS + p]);
                    }
                }
            }
            for a in 0..nr {
                for cc in 0..nc {
                    let v = acc[a * PAIRS + cc / 2];
                    let half = if cc % 2 == 0 {
                        _mm512_castps512_ps256(v)
                    } else {
                        _mm512_extractf32x8_ps::<1>(v)
                    };
                    let mut s = super::avx2::fold(half);
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

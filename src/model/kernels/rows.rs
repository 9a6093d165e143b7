//! The forward product of every linear layer on the CPU, `y = x · wᵀ` with the weight
//! stored `[out, in]`, and the dot product attention scores are made of.
//!
//! Each output is a dot product of an input row with one row of the weight, summed in one
//! fixed order (eight lanes over `in` with fused multiply-adds, the lanes folded pairwise,
//! then the tail, fused too), whatever the number of rows, their grouping, the split over
//! cores or the CPU's vector width: a row's result does not depend on its batch-mates, and
//! the sampler's decode step, its prefill and the trainer's whole-sequence pass give the
//! same bits for the same row (the basis of bitwise on-policy log-probs, see
//! [`super::token_logprob`]). The AVX2 path and the portable one are the same arithmetic.
//!
//! A few rows (a decode step) multiply every weight once, so their speed is how fast the
//! weights stream from memory: here the weight streams through once, each of its rows
//! shared by three input rows while it sits in L1, four weight rows at a time, the output
//! columns split over the cores. Many rows (prefill, training) go by panels of weight rows
//! split over the cores, each panel packed into the core's cache and run against every
//! block of input rows, both operands packed so that each register tile reads one contiguous
//! run of each; with AVX-512 each 512-bit register carries two outputs, eight lanes each,
//! so the sums are the AVX2 path's.
//!
//! A weight may be held in bf16 ([`Elem`]): each value is widened to its f32 (exact, a
//! shift) as it is loaded, so the products are the f32 path's bits for the same values, and
//! a decode step streams half the bytes.

use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Up to this many rows go by columns (each task a run of weight rows, all the input
/// rows); more go by blocks of input rows. Both sum every output in the same order.
const FEW_ROWS: usize = 64;

/// Weights handed to one task of the few-rows path (1 MiB of f32): a small layer stays on
/// one core.
const TASK_WEIGHTS: usize = 1 << 18;

/// Input values per block of rows in the many-rows path (256 KiB of f32, half an L2).
const BLOCK_VALUES: usize = 1 << 16;

/// Weight values one task of the many-rows path packs and keeps in cache (512 KiB of f32).
const PANEL_VALUES: usize = 1 << 17;

/// A weight's element as held in memory: f32, or bf16 kept as its 16 bits (`u16`), the
/// top half of an f32. Widening is exact, so a bf16 weight gives the f32 path's bits for the
/// same values.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Whether the element is bf16 bits.
    const BF16: bool;
    /// The element's f32 value.
    fn widen(self) -> f32;
}

impl Elem for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Elem for u16 {
    const BF16: bool = true;
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }
}

/// Where [`block`] writes output `(weight row c, input row r)`: `out[c * col + r * row]`.
#[derive(Clone, Copy)]
struct Strides {
    col: usize,
    row: usize,
}

/// `y = x · wtᵀ`: `x` `[rows, k]` and `wt` `[n, k]`, both row-major; `y` `[rows, n]` row-major.
pub(super) fn rows_by_transposed<E: Elem>(
    x: &[f32],
    rows: usize,
    wt: &[E],
    n: usize,
    k: usize,
) -> Vec<f32> {
    assert_eq!(x.len(), rows * k, "x is [rows, k]");
    assert_eq!(wt.len(), n * k, "wt is [n, k]");
    if rows == 0 || n == 0 || k == 0 {
        return vec![0.0; rows * n];
    }
    if rows > FEW_ROWS {
        return many_rows(x, rows, wt, n, k);
    }
    // Written transposed, `[n, rows]`, so that each task's columns are one contiguous run.
    let mut yt = vec![0f32; n * rows];
    let strides = Strides { col: rows, row: 1 };
    #[cfg(target_arch = "x86_64")]
    if rows >= avx512::FEW_MIN_ROWS && k >= 8 && avx512_available() {
        // At least four tasks a core, so that a small layer (the 896 x 896 of a 0.5B
        // model is 3.06 tasks of `TASK_WEIGHTS`) does not leave a core idle.
        let tasks = (n * k)
            .div_ceil(TASK_WEIGHTS)
            .max(4 * rayon::current_num_threads());
        let cols = n.div_ceil(tasks).next_multiple_of(avx512::FEW_COLS);
        // The input rows packed once, in pairs, for every task.
        let xp = pack(x, rows, k, avx512::FEW_GROUP);
        yt.par_chunks_mut(cols * rows)
            .zip(wt.par_chunks(cols * k))
            // SAFETY: the CPU has AVX-512 F and DQ, AVX2 and FMA (checked above); `xp` is
            // `pack(x, rows, k, FEW_GROUP)` of `x` `[rows, k]`, `w` holds whole weight rows
            // of `k >= 8` values, `out` every `(c, r)` of them at `strides`.
            .for_each(|(out, w)| unsafe { avx512::few(&xp, x, rows, k, w, out, strides) });
        return crate::model::tensors::transpose(&yt, n, rows);
    }
    let cols = (TASK_WEIGHTS / k).max(4).next_multiple_of(4);
    yt.par_chunks_mut(cols * rows)
        .zip(wt.par_chunks(cols * k))
        .for_each(|(out, w)| block(x, rows, k, w, out, strides));
    crate::model::tensors::transpose(&yt, n, rows)
}

/// [`rows_by_transposed`] for more than [`FEW_ROWS`] rows.
fn many_rows<E: Elem>(x: &[f32], rows: usize, wt: &[E], n: usize, k: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = tiles().filter(|_| k >= 8) {
        return by_panels(x, rows, wt, n, k, t);
    }
    let (mut y, per_block) = (vec![0f32; rows * n], rows_per_block(k));
    y.par_chunks_mut(per_block * n)
        .zip(x.par_chunks(per_block * k))
        .for_each(|(out, xb)| {
            let strides = Strides { col: 1, row: n };
            block(xb, xb.len() / k, k, wt, out, strides);
        });
    y
}

/// [`many_rows`] on the CPU's tiles with no packed copy of the whole weight: the input
/// packed once in blocks of rows, then each task packs a panel of weight rows (about
/// [`PANEL_VALUES`], so it stays in the core's cache) and runs every block of rows over it.
/// The weight is read from memory once, and nothing as large as it is allocated (a fresh
/// copy of a 0.5B model's weights is 2 GB of pages the kernel must zero). A bf16 weight is
/// widened as its panel is packed. The same tiles as [`rows_by_packed`], so the same bits.
#[cfg(target_arch = "x86_64")]
fn by_panels<E: Elem>(x: &[f32], rows: usize, wt: &[E], n: usize, k: usize, t: Tiles) -> Vec<f32> {
    let per_block = rows_per_block(k);
    let blocks: Vec<Vec<f32>> = x
        .par_chunks(per_block * k)
        .map(|xb| pack(xb, xb.len() / k, k, t.rows))
        .collect();
    // At least four tasks a core, so that a narrow layer does not leave a core idle.
    let cols = (PANEL_VALUES / k)
        .min(n.div_ceil(4 * rayon::current_num_threads()))
        .max(1)
        .next_multiple_of(t.cols);
    let panels: Vec<Vec<f32>> = wt
        .par_chunks(cols * k)
        .map(|w| {
            let pc = w.len() / k;
            let (wp, tails) = (pack(w, pc, k, t.cols), tails(w, k));
            let mut out = Vec::with_capacity(rows * pc);
            let parts = blocks
                .iter()
                .zip(x.chunks(per_block * k))
                .zip(out.spare_capacity_mut()[..rows * pc].chunks_mut(per_block * pc));
            for ((xp, xb), ob) in parts {
                // SAFETY: `tiles()` chose tiles this CPU has; `xp` and `wp` are `pack`'s
                // layouts of `xb` `[nr, k]` and the panel `[pc, k]` in the tiles' shape,
                // `tails` `[pc, k % 8]`, `ob` `[nr, pc]`, `k >= 8`.
                unsafe { (t.product)(xp, xb, xb.len() / k, &wp, &tails, pc, k, ob) };
            }
            // SAFETY: the blocks cover the `rows × pc` outputs, each written by its product.
            unsafe { out.set_len(rows * pc) };
            out
        })
        .collect();
    let mut y = Vec::with_capacity(rows * n);
    y.spare_capacity_mut()[..rows * n]
        .par_chunks_mut(n)
        .enumerate()
        .for_each(|(r, yr)| {
            let mut c = 0;
            for p in &panels {
                let pc = p.len() / rows;
                let row = &p[r * pc..(r + 1) * pc];
                for (o, &v) in yr[c..c + pc].iter_mut().zip(row) {
                    *o = MaybeUninit::new(v);
                }
                c += pc;
            }
        });
    // SAFETY: the panels' columns add up to `n`, so every row's `n` values were written.
    unsafe { y.set_len(rows * n) };
    y
}

#[cfg(target_arch = "x86_64")]
/// Each row's last `k % 8` values of `wt` `[n, k]`, `[n, k % 8]`: the part the tiles
/// leave to a scalar tail.
fn tails<E: Elem>(wt: &[E], k: usize) -> Vec<f32> {
    let k8 = k - k % 8;
    wt.chunks_exact(k)
        .flat_map(|r| &r[k8..])
        .map(|v| v.widen())
        .collect()
}

/// Input rows per block of the many-rows path (about [`BLOCK_VALUES`] values), a multiple
/// of three, each block writing its own rows of `y`.
fn rows_per_block(k: usize) -> usize {
    (BLOCK_VALUES / k.max(1)).clamp(3, 96) / 3 * 3
}

/// A weight `[n, k]` as the many-rows tiles read it: packed in their groups of rows
/// ([`pack`]), each row's last `k % 8` values apart. Packing is a copy of the weight; a
/// trainer step keeps each weight's packing for all its passes ([`super::PackOnce`]).
pub(super) struct PackedWeight {
    n: usize,
    k: usize,
    packed: Vec<f32>,
    tails: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    tiles: Tiles,
}

/// The tile kernel this CPU runs, with its height and width.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Tiles {
    rows: usize,
    cols: usize,
    product: PackedTiles,
}

#[cfg(target_arch = "x86_64")]
fn tiles() -> Option<Tiles> {
    if avx512_available() {
        Some(Tiles {
            rows: avx512::ROWS,
            cols: avx512::COLS,
            product: avx512::packed,
        })
    } else if fma_available() {
        Some(Tiles {
            rows: avx2::ROWS,
            cols: avx2::COLS,
            product: avx2::packed,
        })
    } else {
        None
    }
}

/// Whether [`PackedWeight::new`] packs weights of rows of `k` values on this CPU.
pub(super) fn packs(k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return k >= 8 && tiles().is_some();
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

impl PackedWeight {
    /// `wt` `[n, k]` packed, or `None` where the CPU has no tiles (no AVX2, not x86-64) or
    /// `k < 8`: the portable blocks read the weight as it is.
    pub(super) fn new(wt: &[f32], n: usize, k: usize) -> Option<PackedWeight> {
        assert_eq!(wt.len(), n * k, "wt is [n, k]");
        #[cfg(target_arch = "x86_64")]
        if k >= 8 && n > 0 {
            let tiles = tiles()?;
            let packed = pack(wt, n, k, tiles.cols);
            return Some(PackedWeight {
                n,
                k,
                packed,
                tails: tails(wt, k),
                tiles,
            });
        }
        None
    }
}

/// `y = x · wtᵀ` for `x` `[rows, k]` and a packed `wt` `[n, k]`: the bits of
/// [`rows_by_transposed`].
pub(super) fn rows_by_packed(x: &[f32], rows: usize, w: &PackedWeight) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    assert_eq!(x.len(), rows * k, "x is [rows, k]");
    #[cfg(target_arch = "x86_64")]
    if rows > 0 {
        let t = w.tiles;
        let per_block = rows_per_block(k);
        // Written once by the tiles, never zeroed first.
        let mut y = Vec::with_capacity(rows * n);
        // Both operands packed so that each tile reads one contiguous run of each; with
        // AVX-512, two outputs per 512-bit register, each in its own eight lanes: the same
        // sums.
        y.spare_capacity_mut()[..rows * n]
            .par_chunks_mut(per_block * n)
            .zip(x.par_chunks(per_block * k))
            .for_each(|(out, xb)| {
                let nr = xb.len() / k;
                let xp = pack(xb, nr, k, t.rows);
                // SAFETY: `PackedWeight::new` chose tiles this CPU has; `xp` and `w.packed`
                // are `pack`'s layouts of `xb` `[nr, k]` and the weight `[n, k]` in the
                // tiles' shape, `w.tails` `[n, k % 8]`, `out` `[nr, n]`, `k >= 8`.
                unsafe { (t.product)(&xp, xb, nr, &w.packed, &w.tails, n, k, out) };
            });
        // SAFETY: the blocks cover the `rows × n` outputs and each product wrote all of its
        // block's (the tiles' contract).
        unsafe { y.set_len(rows * n) };
        return y;
    }
    vec![0f32; rows * n]
}

/// Whether the AVX-512 path of many rows can run.
#[cfg(target_arch = "x86_64")]
pub(super) fn avx512_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && fma_available()
}

/// Whether the AVX2/FMA paths can run (detected once; the check is a load after that).
#[cfg(target_arch = "x86_64")]
pub(super) fn fma_available() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// `x · y` in the order every output of [`rows_by_transposed`] is summed in (inlined into
/// the AVX2 paths that call it, it compiles to the same fused operations).
#[inline(always)]
pub(super) fn portable_dot<E: Elem>(x: &[f32], y: &[E]) -> f32 {
    let k = x.len().min(y.len());
    let k8 = k - k % 8;
    let mut acc = [0f32; 8];
    for (xc, yc) in x[..k8].chunks_exact(8).zip(y[..k8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = xc[l].mul_add(yc[l].widen(), acc[l]);
        }
    }
    let mut s = fold(acc);
    for (a, b) in x[k8..k].iter().zip(&y[k8..k]) {
        s = a.mul_add(b.widen(), s);
    }
    s
}

/// `out[c * strides.col + r * strides.row] = x[r] · w[c]` for the weight rows `w`
/// `[cols, k]` and the input rows `x` `[rows, k]`.
fn block<E: Elem>(x: &[f32], rows: usize, k: usize, w: &[E], out: &mut [f32], strides: Strides) {
    #[cfg(target_arch = "x86_64")]
    if fma_available() {
        // SAFETY: the CPU has AVX2 and FMA (checked above); the slices' lengths are the
        // ones `avx2::block` reads within (`x` `[rows, k]`, `w` `[cols, k]`, `out` holding
        // every `(c, r)` at `strides`), asserted by the caller and by the chunking.
        unsafe { avx2::block(x, rows, k, w, out, strides) };
        return;
    }
    portable_block(x, rows, k, w, out, strides);
}

/// A packed many-rows product (`avx2::packed`, `avx512::packed`).
#[cfg(target_arch = "x86_64")]
type PackedTiles =
    unsafe fn(&[f32], &[f32], usize, &[f32], &[f32], usize, usize, &mut [MaybeUninit<f32>]);

/// `m` `[rows, k]` in groups of `group` rows, each group's first `k - k % 8` values
/// interleaved by eights (row 0's first eight, row 1's, …, then each row's next eight), a
/// short last group padded with its last row: one contiguous run per tile.
#[cfg(target_arch = "x86_64")]
fn pack<E: Elem>(m: &[E], rows: usize, k: usize, group: usize) -> Vec<f32> {
    let k8 = k - k % 8;
    let groups = rows.div_ceil(group);
    let mut out = Vec::with_capacity(groups * group * k8);
    for g in 0..groups {
        for i in (0..k8).step_by(8) {
            for j in 0..group {
                let r = (g * group + j).min(rows - 1);
                out.extend(m[r * k + i..r * k + i + 8].iter().map(|v| v.widen()));
            }
        }
    }
    out
}

/// Eight lanes as the AVX2 path keeps them, folded in the same order.
fn fold(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

fn portable_block<E: Elem>(x: &[f32], rows: usize, k: usize, w: &[E], out: &mut [f32], s: Strides) {
    for (c, wr) in w.chunks_exact(k).enumerate() {
        for (r, xr) in x.chunks_exact(k).take(rows).enumerate() {
            out[c * s.col + r * s.row] = portable_dot(xr, wr);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
            .map(|v| v as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Against a plain f64 product, at sizes with every kind of remainder (rows not a
    /// multiple of 3, columns not of 4, `k` not of 8, several tasks).
    #[test]
    fn matches_the_plain_product() {
        let sizes = [
            (1, 1, 1),
            (2, 5, 7),
            (3, 4, 8),
            (8, 130, 67),
            (5, 4099, 96),
            (131, 9, 40),
        ];
        for &(rows, n, k) in &sizes {
            let (x, wt) = (values(rows * k, 1), values(n * k, 2));
            let y = rows_by_transposed(&x, rows, &wt, n, k);
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| f64::from(x[r * k + t]) * f64::from(wt[j * k + t]))
                        .sum();
                    let got = f64::from(y[r * n + j]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{rows}x{n}x{k} [{r},{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A weight packed once gives every row count the bits of the unpacked product, `k`
    /// with and without a tail.
    #[test]
    fn a_packed_weight_gives_the_unpacked_bits() {
        for (n, k) in [(67, 37), (9, 64), (130, 8)] {
            let wt = values(n * k, 3);
            let Some(packed) = PackedWeight::new(&wt, n, k) else {
                return; // no tiles on this CPU: nothing is packed
            };
            for rows in [1, 3, 65, 200] {
                let x = values(rows * k, 4);
                let (a, b) = (
                    rows_by_packed(&x, rows, &packed),
                    rows_by_transposed(&x, rows, &wt, n, k),
                );
                assert!(
                    a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{rows}x{n}x{k}"
                );
            }
        }
    }

    /// Many rows by panels (several panels, the last one short, several blocks of rows, `k`
    /// with a tail) give the bits of the whole weight packed at once.
    #[test]
    fn panels_give_the_bits_of_a_whole_packed_weight() {
        let (rows, n, k) = (300, 1003, 601);
        let (x, wt) = (values(rows * k, 11), values(n * k, 12));
        let Some(packed) = PackedWeight::new(&wt, n, k) else {
            return; // no tiles on this CPU: nothing is packed
        };
        assert!(
            n > PANEL_VALUES / k && rows > rows_per_block(k),
            "several of each"
        );
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&rows_by_transposed(&x, rows, &wt, n, k)),
            bits(&rows_by_packed(&x, rows, &packed))
        );
    }

    /// A row's outputs are the same bits alone, in a group of three, and amid 12 others.
    #[test]
    fn a_rows_result_does_not_depend_on_its_batch_mates() {
        let (n, k) = (37, 203);
        let wt = values(n * k, 3);
        let x = values(13 * k, 4);
        let all = rows_by_transposed(&x, 13, &wt, n, k);
        for r in [0, 4, 12] {
            let alone = rows_by_transposed(&x[r * k..(r + 1) * k], 1, &wt, n, k);
            assert_eq!(alone, all[r * n..(r + 1) * n], "row {r}");
        }
    }

    /// Both paths, and [`portable_dot`], give the same bits: a row's outputs do not depend on the
    /// CPU's vector width either.
    #[test]
    fn the_portable_path_and_dot_give_the_same_bits() {
        let (rows, n, k) = (4, 9, 77);
        let (x, wt) = (values(rows * k, 5), values(n * k, 6));
        let mut out = vec![0f32; n * rows];
        portable_block(&x, rows, k, &wt, &mut out, Strides { col: rows, row: 1 });
        let y = rows_by_transposed(&x, rows, &wt, n, k);
        for r in 0..rows {
            for j in 0..n {
                let (xr, wr) = (&x[r * k..(r + 1) * k], &wt[j * k..(j + 1) * k]);
                assert_eq!(out[j * rows + r].to_bits(), y[r * n + j].to_bits());
                assert_eq!(portable_dot(xr, wr).to_bits(), y[r * n + j].to_bits());
            }
        }
    }

    /// The many-rows paths (AVX-512 or AVX2 where the CPU has them) give the portable
    /// path's bits.
    #[test]
    fn many_rows_give_the_portable_bits() {
        let (rows, n, k) = (70, 21, 83);
        let (x, wt) = (values(rows * k, 9), values(n * k, 10));
        let mut out = vec![0f32; n * rows];
        portable_block(&x, rows, k, &wt, &mut out, Strides { col: 1, row: n });
        let y = rows_by_transposed(&x, rows, &wt, n, k);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&y));
    }

    /// Many rows (blocks of rows) and a few of them (runs of columns) sum alike.
    #[test]
    fn many_rows_and_few_rows_give_the_same_bits() {
        let (n, k) = (19, 45);
        let wt = values(n * k, 7);
        let x = values(200 * k, 8);
        let all = rows_by_transposed(&x, 200, &wt, n, k);
        for r in [0, 65, 199] {
            let few = rows_by_transposed(
                &x[r * k..(r + 2).min(200) * k],
                (r + 2).min(200) - r,
                &wt,
                n,
                k,
            );
            assert_eq!(few[..n], all[r * n..(r + 1) * n], "row {r}");
        }
    }

    /// A weight held in bf16 gives the bits of the f32 weight with the same values, at a
    /// few rows (its own loads) and at many (widened as each panel is packed), on every path.
    #[test]
    fn bf16_weights_give_the_f32_bits_of_their_values() {
        let (n, k) = (23, 91);
        let half: Vec<u16> = values(n * k, 11)
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let wide: Vec<f32> = half.iter().map(|h| h.widen()).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for rows in [1, 5, 64, 70, 300] {
            let x = values(rows * k, 12);
            let want = rows_by_transposed(&x, rows, &wide, n, k);
            assert_eq!(
                bits(&rows_by_transposed(&x, rows, &half, n, k)),
                bits(&want)
            );
            let mut out = vec![0f32; n * rows];
            portable_block(&x, rows, k, &half, &mut out, Strides { col: 1, row: n });
            assert_eq!(bits(&out), bits(&want), "portable, {rows} rows");
        }
    }

    /// Every count of rows a decode step may have, weight rows not a multiple of the
    /// tile, `k` with a tail and longer than one pass of the few-rows kernel: the portable
    /// path's bits, f32 and bf16 weights alike.
    #[test]
    fn few_rows_give_the_portable_bits_at_every_count() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (n, k) in [(13, 1100), (7, 19)] {
            let wt = values(n * k, 13);
            let half: Vec<u16> = wt
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let wide: Vec<f32> = half.iter().map(|h| h.widen()).collect();
            for rows in (1..=18).chain([63, 64]) {
                let x = values(rows * k, 14);
                for (w, got) in [
                    (&wt, rows_by_transposed(&x, rows, &wt, n, k)),
                    (&wide, rows_by_transposed(&x, rows, &half, n, k)),
                ] {
                    let mut want = vec![0f32; n * rows];
                    portable_block(&x, rows, k, w, &mut want, Strides { col: 1, row: n });
                    assert_eq!(bits(&got), bits(&want), "{rows}x{n}x{k}");
                }
            }
        }
    }

    #[test]
    fn no_rows_or_no_columns() {
        assert!(rows_by_transposed(&[], 0, &values(12, 1), 3, 4).is_empty());
        assert!(rows_by_transposed(&values(8, 1), 2, &[] as &[f32], 0, 4).is_empty());
    }
}

//! The matrix products of the CPU backward passes (a linear layer's input and weight
//! gradients, the head's chunks, attention's blocks), through the `gemm` crate, which picks
//! its AVX-512, AVX2 or portable kernels when it runs.
//!
//! These products are free to sum in any order: nothing compares their bits with the
//! sampler's. The forward products are not, and go through [`super::rows`]. On a CPU with
//! AVX-512 the backward's products run about twice as fast here as through ndarray's
//! `general_mat_mul` (`matrixmultiply`, AVX2 at most); BENCHMARKS.md has the step.

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

/// Fused multiply-adds under which a product stays on the calling thread: splitting it
/// costs more than it gains, and attention's blocks already run one head per core.
#[cfg(not(feature = "blas"))]
const SERIAL_FMAS: usize = 1 << 22;

/// `c = a · b`, or `c += a · b` when `accumulate`; any strides (a transposed view is read
/// in place). Products smaller than [`SERIAL_FMAS`] run on the calling thread, larger ones
/// over rayon's pool; in a `--features blas` build, on the system BLAS.
pub(super) fn mat_mul(
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    accumulate: bool,
    c: &mut ArrayViewMut2<'_, f32>,
) {
    let ((m, k), (kb, n)) = (a.dim(), b.dim());
    assert_eq!(k, kb, "a is [m, k] and b [k, n]");
    assert_eq!(c.dim(), (m, n), "c is [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    #[cfg(feature = "blas")]
    {
        // `--features blas`: ndarray hands the product to the system BLAS.
        let beta = if accumulate { 1.0 } else { 0.0 };
        ndarray::linalg::general_mat_mul(1.0, a, b, beta, c);
    }
    #[cfg(not(feature = "blas"))]
    {
        let sc = [c.strides()[0], c.strides()[1]];
        // SAFETY: `c`'s pointer and strides address its `m × n` elements, initialised, and
        // it is borrowed mutably, so it overlaps neither input.
        unsafe { gemm_crate(a, b, accumulate, c.as_mut_ptr(), sc) };
    }
}

/// `a · b` as a new row-major matrix, each output written once: on the `gemm` crate the
/// destination is not zeroed first (a pass over it that a product of the small size's
/// layers pays as much as a tenth of its own time for).
pub(super) fn product(a: &ArrayView2<'_, f32>, b: &ArrayView2<'_, f32>) -> Array2<f32> {
    let ((m, k), (kb, n)) = (a.dim(), b.dim());
    assert_eq!(k, kb, "a is [m, k] and b [k, n]");
    #[cfg(not(feature = "blas"))]
    if m > 0 && n > 0 && k > 0 {
        let mut c = Array2::<f32>::uninit((m, n));
        let sc = [c.strides()[0], c.strides()[1]];
        let dst = c.as_mut_ptr().cast::<f32>();
        // SAFETY: `dst` and `sc` address the `m × n` elements of `c`, a fresh array that
        // overlaps neither input; with `accumulate` false `gemm` writes every one of them
        // and reads none, so all are initialised when it returns.
        unsafe {
            gemm_crate(a, b, false, dst, sc);
            return c.assume_init();
        }
    }
    let mut c = Array2::zeros((m, n));
    mat_mul(a, b, false, &mut c.view_mut());
    c
}

/// [`mat_mul`] through the `gemm` crate, into `dst` with strides `sc` (rows, columns).
///
/// # Safety
/// `dst` and `sc` address `m × n` writable elements that overlap neither input; they are
/// read only when `accumulate`, and then must be initialised.
#[cfg(not(feature = "blas"))]
unsafe fn gemm_crate(
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    accumulate: bool,
    dst: *mut f32,
    sc: [isize; 2],
) {
    let ((m, k), n) = (a.dim(), b.dim().1);
    let parallelism = if m * n * k < SERIAL_FMAS {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(0)
    };
    let (sa, sb) = (a.strides(), b.strides());
    let (sa, sb) = ([sa[0], sa[1]], [sb[0], sb[1]]);
    // SAFETY: each view's pointer and strides address its own `m × k` and `k × n` elements
    // (ndarray's invariant), `dst` its `m × n` (the caller's). `gemm`'s `alpha` scales the
    // destination (read only when `accumulate`) and `beta` the product.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            sc[1],
            sc[0],
            accumulate,
            a.as_ptr(),
            sa[1],
            sa[0],
            b.as_ptr(),
            sb[1],
            sb[0],
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{mat_mul, product};
    use ndarray::{Array2, linalg::general_mat_mul};

    fn values(rows: usize, cols: usize, seed: u32) -> Array2<f32> {
        Array2::from_shape_fn((rows, cols), |(i, j)| {
            let v = (i as u32 * 31 + j as u32 * 17 + seed).wrapping_mul(2_654_435_761);
            (v >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
    }

    /// Against ndarray's product, every layout the backward uses: plain, a transposed left
    /// or right operand, a transposed destination, serial and split sizes, accumulating, and
    /// into a fresh matrix ([`product`], never zeroed).
    #[test]
    fn matches_general_mat_mul_in_every_layout() {
        for (m, k, n) in [(3, 5, 7), (64, 64, 96), (300, 170, 260), (1, 9, 1)] {
            let (a, at) = (values(m, k, 1), values(k, m, 2));
            let (b, bt) = (values(k, n, 3), values(n, k, 4));
            for (lhs, rhs) in [
                (a.view(), b.view()),
                (at.t(), b.view()),
                (a.view(), bt.t()),
                (at.t(), bt.t()),
            ] {
                for accumulate in [false, true] {
                    let start = values(m, n, 5);
                    let mut want = start.clone();
                    let beta = if accumulate { 1.0 } else { 0.0 };
                    general_mat_mul(1.0, &lhs, &rhs, beta, &mut want);
                    let mut got = start.clone();
                    mat_mul(&lhs, &rhs, accumulate, &mut got.view_mut());
                    let mut got_t = start.t().as_standard_layout().into_owned();
                    mat_mul(
                        &lhs,
                        &rhs,
                        accumulate,
                        &mut got_t.view_mut().reversed_axes(),
                    );
                    let fresh = (!accumulate).then(|| product(&lhs, &rhs));
                    let fresh = fresh.iter().flat_map(|f| f.iter().zip(&want));
                    let back = got_t.t();
                    let all = got.iter().zip(&want).chain(back.iter().zip(&want));
                    for (g, w) in all.chain(fresh) {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{m}x{k}x{n}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_inner_dimension_gives_zeros_or_leaves_the_sum() {
        let (a, b) = (Array2::<f32>::zeros((3, 0)), Array2::<f32>::zeros((0, 2)));
        let mut c = Array2::from_elem((3, 2), 7.0f32);
        mat_mul(&a.view(), &b.view(), true, &mut c.view_mut());
        assert!(c.iter().all(|&v| v == 7.0));
        mat_mul(&a.view(), &b.view(), false, &mut c.view_mut());
        assert!(c.iter().all(|&v| v == 0.0));
        let fresh = product(&a.view(), &b.view());
        assert_eq!(fresh.dim(), (3, 2));
        assert!(fresh.iter().all(|&v| v == 0.0));
    }
}

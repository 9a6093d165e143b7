//! `exp` for the kernels' softmaxes and sigmoids, sixteen lanes at a time on AVX-512, with
//! a scalar twin that gives the same bits for every input.
//!
//! libm's `expf` is one value per call; attention's softmax, SwiGLU's sigmoid and the
//! token log-prob's sum of exponentials spent 3-8% of a training step in it (BENCHMARKS.md).
//! The bits of these sums are the sampler's as much as the trainer's (bitwise on-policy),
//! and which of their values fall in a vector and which in the scalar tail depends on a
//! row's length, which differs between a decode step and the trainer's pass. So both paths
//! run one sequence of IEEE operations (rounding to an integer, fused multiply-adds, two
//! exact scalings by powers of two), and a value gets the same bits whichever path it
//! takes: [`exp`] and [`exp_in_place`] are interchangeable.
//!
//! The method is Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (`ln 2` split in
//! two so that `r` is exact), `e^r` by a degree-7 polynomial, then `2^n` applied in two
//! halves so that results down to the subnormals round once. Within 2 ulp of the exact
//! value (checked against f64 below); 0 below [`LO`], infinity above [`HI`], NaN kept.

/// Below this, `e^x` rounds to zero in f32.
const LO: f32 = -103.972_08;
/// Above this, `e^x` overflows f32.
const HI: f32 = 88.722_84;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` as `C1 + C2`, `C1` with few enough bits that `n · C1` is exact.
const C1: f32 = 0.693_359_4;
const C2: f32 = -0.000_212_194_44;
/// The polynomial's coefficients, highest degree first.
const P: [f32; 6] = [
    0.000_198_756_91,
    0.001_398_199_9,
    0.008_333_452,
    0.041_665_796,
    0.166_666_66,
    0.5,
];

/// `e^x` for one value, through [`exp_in_place`]'s dispatch: the same bits as every lane,
/// with fused multiply-adds as instructions wherever the CPU has them.
pub(super) fn exp(x: f32) -> f32 {
    let mut v = [x];
    exp_in_place(&mut v);
    v[0]
}

/// The scalar twin: [`exp`]'s arithmetic, inlined into each caller so that it takes the
/// caller's target features (without FMA, `mul_add` is a call into libm).
#[inline(always)]
fn twin(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < LO {
        return 0.0;
    }
    if x > HI {
        return f32::INFINITY;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-C2, n.mul_add(-C1, x));
    let z = r * r;
    let mut y = P[0].mul_add(r, P[1]);
    for c in &P[2..] {
        y = y.mul_add(r, *c);
    }
    let y = y.mul_add(z, r) + 1.0;
    let n = n as i32;
    let (n1, n2) = (n >> 1, n - (n >> 1));
    y * pow2(n1) * pow2(n2)
}

/// `2^n` for `-126 <= n <= 127`.
#[inline(always)]
fn pow2(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// Every value of `xs` replaced by its [`exp`].
pub(super) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::rows::avx512_available() {
            // SAFETY: the CPU has AVX-512 F and DQ and FMA (checked above).
            return unsafe { avx512::exp_in_place(xs) };
        }
        if super::rows::fma_available() {
            // SAFETY: the CPU has FMA (checked above).
            return unsafe { scalar_fma(xs) };
        }
    }
    xs.iter_mut().for_each(|x| *x = twin(*x));
}

/// [`twin`] over `xs` with its fused multiply-adds as instructions.
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn scalar_fma(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = twin(*x));
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{C1, C2, HI, LO, LOG2E, P};
    use std::arch::x86_64::*;

    /// [`super::twin`] on sixteen lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    fn exp16(x: __m512) -> __m512 {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO));
        let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(HI));
        // In range the clamp changes nothing; out of range the lane is replaced below.
        let xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO)), _mm512_set1_ps(HI));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C1), xc);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C2), r);
        let z = _mm512_mul_ps(r, r);
        let mut y = _mm512_fmadd_ps(_mm512_set1_ps(P[0]), r, _mm512_set1_ps(P[1]));
        for c in &P[2..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0));
        let n = _mm512_cvtps_epi32(n);
        let n1 = _mm512_srai_epi32::<1>(n);
        let n2 = _mm512_sub_epi32(n, n1);
        let bias = _mm512_set1_epi32(127);
        let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
        let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
        let y = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
        let y = _mm512_mask_blend_ps(low, y, _mm512_setzero_ps());
        let y = _mm512_mask_blend_ps(high, y, _mm512_set1_ps(f32::INFINITY));
        _mm512_mask_blend_ps(nan, y, x)
    }

    /// # Safety
    /// The CPU has AVX-512 F and DQ and FMA.
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub(super) unsafe fn exp_in_place(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen values.
            unsafe { _mm512_storeu_ps(c.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr()))) };
        }
        chunks
            .into_remainder()
            .iter_mut()
            .for_each(|x| *x = super::twin(*x));
    }
}

#[cfg(test)]
mod tests {
    use super::{HI, LO, exp, exp_in_place};

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// Within 2 ulp of the exact value (f64's, rounded) over the whole range, subnormal
    /// results included, and the same bits from the scalar and the slice paths.
    #[test]
    fn is_within_two_ulp_and_the_same_bits_either_way() {
        let mut xs: Vec<f32> = (0..200_001)
            .map(|i| LO + (HI - LO) * i as f32 / 200_000.0)
            .collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.5, -87.5, -100.0, 88.0]);
        let mut got = xs.clone();
        exp_in_place(&mut got);
        let mut worst = 0;
        for (&x, &g) in xs.iter().zip(&got) {
            assert_eq!(
                g.to_bits(),
                exp(x).to_bits(),
                "exp({x}): slice and scalar differ"
            );
            let want = (x as f64).exp() as f32;
            if want.is_infinite() {
                assert_eq!(g, want, "exp({x})");
            } else if want > f32::MIN_POSITIVE {
                worst = worst.max(ulps(g, want));
            } else {
                // Subnormal results: within one step of the smallest subnormal.
                assert!((g - want).abs() <= 2e-45, "exp({x}) = {g}, not {want}");
            }
        }
        assert!(worst <= 2, "{worst} ulp off");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn the_edges_are_zero_infinity_and_nan() {
        let mut xs = vec![f32::NEG_INFINITY, -200.0, 200.0, f32::INFINITY, f32::NAN];
        // Past sixteen values, so the vector lanes see the edges too.
        xs = xs.iter().cycle().take(37).copied().collect();
        let mut got = xs.clone();
        exp_in_place(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            match x {
                x if x.is_nan() => assert!(g.is_nan()),
                x if *x < 0.0 => assert_eq!(*g, 0.0),
                _ => assert_eq!(*g, f32::INFINITY),
            }
            assert_eq!(g.to_bits(), exp(*x).to_bits());
        }
    }
}

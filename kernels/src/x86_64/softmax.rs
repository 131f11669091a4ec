//! x86-64 softmax rows (see `softmax.rs`): the scaled and masked row and its maximum, then the
//! exponentials in the arithmetic of ggml's build, then the normalization. With AVX-512 every
//! pass runs 16 lanes at a time (an AVX2 build's exponentials two of its vectors to a
//! register), and the lane sums of eight of the build's vectors are reduced together; each
//! value and each addition stays the build's. One thread, warm (`tests/benches/kernels.rs`,
//! `softmax/ymm/8`, SmolLM2's 72 rows of 1,024 under a mask, the AVX-512 Xeon): 49.4 us with
//! the 8-lane passes, 38.9 with these.

use super::{ggml_max, Exp, Mask};
use std::arch::x86_64::*;

pub(super) fn cpu_ok(exp: Exp) -> bool {
    let base = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    match exp {
        Exp::Ymm => base,
        Exp::Zmm => {
            base && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")
        }
    }
}

/// # Safety
/// The CPU runs `exp` ([`cpu_ok`]); equal lengths.
pub(super) unsafe fn row(exp: Exp, x: &[f32], mask: Mask<'_>, scale: f32, y: &mut [f32]) {
    // With AVX-512 the element-wise passes (and an AVX2 build's exponentials, two of its
    // vectors to a register) run 16 lanes at a time: each lane's operations are the build's.
    row_on(exp, wide(), x, mask, scale, y)
}

/// [`row`], 16 lanes at a time if `wide` (the CPU has AVX-512F/DQ), else 8 (AVX2's).
///
/// # Safety
/// As [`row`]; `wide` only where the CPU has AVX-512F and AVX-512DQ.
pub(super) unsafe fn row_on(
    exp: Exp,
    wide: bool,
    x: &[f32],
    mask: Mask<'_>,
    scale: f32,
    y: &mut [f32],
) {
    let (max, hidden) = if wide {
        scaled_zmm(x, mask, scale, y)
    } else {
        scaled(x, mask, scale, y)
    };
    // A vector of cells the mask hides (every value -inf) is 0 after `exp` whatever a finite
    // maximum is (ggml's `exp` of -inf is +0), and adds +0 to the sum, so it is written as 0
    // without `exp`: a sliding-window row hides half a 1,000-cell cache, and ggml's `exp`
    // takes its slow path for values past its range.
    let skip = hidden && max.is_finite();
    let sum = match exp {
        Exp::Zmm => exps_zmm(y, max, skip),
        Exp::Ymm if wide => exps_ymm_wide(y, max, skip),
        Exp::Ymm => exps_ymm(y, max, skip),
    };
    if wide {
        normalize_zmm(y, (1.0 / sum) as f32)
    } else {
        normalize(y, (1.0 / sum) as f32)
    }
}

/// The CPU has AVX-512F and AVX-512DQ (besides [`cpu_ok`]'s base; std caches the answers).
fn wide() -> bool {
    cpu_ok(Exp::Zmm)
}

/// `y = x * scale + mask` (ggml's `wp`), returning its maximum as ggml's comparisons give it,
/// and whether a value is -inf.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled(x: &[f32], mask: Mask<'_>, scale: f32, y: &mut [f32]) -> (f32, bool) {
    let n = x.len();
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let vs = _mm256_set1_ps(scale);
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut nan = _mm256_setzero_ps();
    let mut ninf = _mm256_setzero_ps();
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        let mut w = _mm256_mul_ps(_mm256_loadu_ps(xp.add(i)), vs);
        match mask {
            Mask::None => {}
            Mask::F16(m) => {
                let h = _mm_loadu_si128(m.as_ptr().add(i).cast());
                w = _mm256_add_ps(w, _mm256_cvtph_ps(h));
            }
            Mask::F32(m) => w = _mm256_add_ps(w, _mm256_loadu_ps(m.as_ptr().add(i))),
        }
        _mm256_storeu_ps(yp.add(i), w);
        vmax = _mm256_max_ps(vmax, w);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(w, w));
        ninf = _mm256_or_ps(ninf, _mm256_cmp_ps::<_CMP_EQ_OQ>(w, neg_inf));
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
    let max = lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let seen = (
        max,
        _mm256_movemask_ps(nan) != 0,
        _mm256_movemask_ps(ninf) != 0,
    );
    scaled_tail(x, mask, scale, y, i, seen)
}

/// The elements from `i` of [`scaled`] one at a time, onto what the vectors before them gave
/// (`seen`: their maximum, whether one was NaN, whether one was -inf); returns the row's
/// maximum as ggml's comparisons give it, and whether a value is -inf.
fn scaled_tail(
    x: &[f32],
    mask: Mask<'_>,
    scale: f32,
    y: &mut [f32],
    i: usize,
    seen: (f32, bool, bool),
) -> (f32, bool) {
    let (mut max, mut has_nan, mut hidden) = seen;
    for i in i..x.len() {
        let mut w = x[i] * scale;
        match mask {
            Mask::None => {}
            Mask::F16(m) => w += crate::f16::to_f32(m[i]),
            Mask::F32(m) => w += m[i],
        }
        y[i] = w;
        has_nan |= w.is_nan();
        hidden |= w == f32::NEG_INFINITY;
        max = max.max(w);
    }
    if has_nan {
        // ggml's left-to-right `a > b ? a : b` keeps or drops a NaN by where it stands.
        (ggml_max(y), hidden)
    } else {
        (max, hidden)
    }
}

/// [`scaled`] 16 lanes at a time (each element's operations are the same whatever the width,
/// and the maximum of any order but for NaNs, which go to ggml's order).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn scaled_zmm(x: &[f32], mask: Mask<'_>, scale: f32, y: &mut [f32]) -> (f32, bool) {
    let n = x.len();
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let vs = _mm512_set1_ps(scale);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut vmax = neg_inf;
    let (mut nan, mut ninf): (__mmask16, __mmask16) = (0, 0);
    let mut i = 0;
    while i + 16 <= n {
        let mut w = _mm512_mul_ps(_mm512_loadu_ps(xp.add(i)), vs);
        match mask {
            Mask::None => {}
            Mask::F16(m) => {
                let h = _mm256_loadu_si256(m.as_ptr().add(i).cast());
                w = _mm512_add_ps(w, _mm512_cvtph_ps(h));
            }
            Mask::F32(m) => w = _mm512_add_ps(w, _mm512_loadu_ps(m.as_ptr().add(i))),
        }
        _mm512_storeu_ps(yp.add(i), w);
        vmax = _mm512_max_ps(vmax, w);
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(w, w);
        ninf |= _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(w, neg_inf);
        i += 16;
    }
    let mut lanes = [0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), vmax);
    let max = lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    scaled_tail(x, mask, scale, y, i, (max, nan != 0, ninf != 0))
}

/// [`normalize`] 16 lanes at a time.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn normalize_zmm(y: &mut [f32], s: f32) {
    let n = y.len();
    let p = y.as_mut_ptr();
    let vs = _mm512_set1_ps(s);
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(p.add(i), _mm512_mul_ps(_mm512_loadu_ps(p.add(i)), vs));
        i += 16;
    }
    for v in &mut y[i..] {
        *v *= s;
    }
}

/// `y = x * s`, in place.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn normalize(y: &mut [f32], s: f32) {
    let n = y.len();
    let p = y.as_mut_ptr();
    let vs = _mm256_set1_ps(s);
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), vs));
        i += 8;
    }
    for v in &mut y[i..] {
        *v *= s;
    }
}

/// The constants of `ggml_v_expf` (read off ggml's hexadecimal literals).
mod c {
    pub(super) const ROUND: u32 = 0x4b40_0000; // 0x1.8p23
    pub(super) const LOG2E: u32 = 0x3fb8_aa3b; // 0x1.715476p+0
    pub(super) const LN2_LO: u32 = 0x35bf_be8e; // 0x1.7f7d1cp-20
    pub(super) const LN2_HI: u32 = 0x3f31_7200; // 0x1.62e4p-1
    pub(super) const P5: u32 = 0x3c07_2010; // 0x1.0e4020p-7
    pub(super) const P4: u32 = 0x3d2b_9f17; // 0x1.573e2ep-5
    pub(super) const P3: u32 = 0x3e2a_af33; // 0x1.555e66p-3
    pub(super) const P2: u32 = 0x3eff_fedb; // 0x1.fffdb6p-2
    pub(super) const P1: u32 = 0x3f7f_fff6; // 0x1.ffffecp-1
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn k16(bits: u32) -> __m512 {
    _mm512_set1_ps(f32::from_bits(bits))
}

/// ggml's AVX-512 `ggml_v_expf`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn exp16(x: __m512) -> __m512 {
    let r = k16(c::ROUND);
    let z = _mm512_fmadd_ps(x, k16(c::LOG2E), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, k16(c::LN2_LO), _mm512_fnmadd_ps(n, k16(c::LN2_HI), x));
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(k16(c::P5), b, k16(c::P4)),
            u,
            _mm512_fmadd_ps(k16(c::P3), b, k16(c::P2)),
        ),
        u,
        _mm512_fmadd_ps(k16(c::P1), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    if d == 0 {
        return res;
    }
    let zero = _mm512_setzero_ps();
    let alt = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero),
        _mm512_set1_ps(f32::INFINITY),
        zero,
    );
    _mm512_mask_blend_ps(d, res, alt)
}

/// GCC's `_mm512_reduce_add_ps`: 256-bit halves, 128-bit halves, then the pairs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn reduce16(v: __m512) -> f32 {
    let t3 = _mm256_add_ps(_mm512_extractf32x8_ps::<1>(v), _mm512_castps512_ps256(v));
    let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
    let t8 = _mm_add_ps(t6, _mm_shuffle_ps::<0b01_00_11_10>(t6, t6));
    _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8))
}

/// [`reduce16`] of eight vectors at once: lane k of the result is `reduce16(v[k])`, the same
/// additions of the same operands (256-bit halves, 128-bit halves, then the pairs), eight
/// vectors to a register, where a vector's own reduction took eight operations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn reduce16x8(v: &[__m512; 8]) -> [f32; 8] {
    // [halves of v[2i] added | halves of v[2i + 1] added]: the 256-bit halves lined up.
    let a: [__m512; 4] = std::array::from_fn(|i| {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y);
        _mm512_add_ps(lo, hi)
    });
    reduce8x8(&a)
}

/// ggml's AVX2 lane sum ([`reduce8`]) of eight 8-lane vectors, two to a register (`v[i]` holds
/// vector 2i, then 2i + 1): lane k of the result is vector k's, the same additions of the same
/// operands (128-bit halves, then `movehl`, then `movehdup`). [`reduce16`] ends with these
/// steps on its 256-bit sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn reduce8x8(a: &[__m512; 4]) -> [f32; 8] {
    // [the 128-bit halves of a vector added, for four vectors]: 0..4, then 4..8.
    let b: [__m512; 2] = std::array::from_fn(|i| {
        let (x, y) = (a[2 * i], a[2 * i + 1]);
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
        _mm512_add_ps(lo, hi)
    });
    // In 128-bit lane k: [b0 + b2, b1 + b3] of vector k, then of vector 4 + k.
    let c = _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(b[0], b[1]),
        _mm512_shuffle_ps::<0b11_10_11_10>(b[0], b[1]),
    );
    // The pairs: lane 4k vector k's sum, lane 4k + 2 vector 4 + k's.
    let r = _mm512_add_ps(c, _mm512_shuffle_ps::<0b10_11_00_01>(c, c));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut out = [0f32; 8];
    _mm256_storeu_ps(
        out.as_mut_ptr(),
        _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r)),
    );
    out
}

/// `y = exp(y - max)` as ggml's AVX-512 build, returning the sum; with `skip`, vectors of -inf
/// are written as 0 (see [`row`]). Eight vectors at a time have their lanes summed together
/// ([`reduce16x8`]), then added to the sum one after another, in order (a vector written as
/// 0 adds +0, which leaves the sum as it was).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn exps_zmm(y: &mut [f32], max: f32, skip: bool) -> f64 {
    let n = y.len();
    let p = y.as_mut_ptr();
    let vm = _mm512_set1_ps(max);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let one = |i: usize| {
        let w = _mm512_loadu_ps(p.add(i));
        let v = if skip && _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(w, neg_inf) == 0xffff {
            _mm512_setzero_ps()
        } else {
            exp16(_mm512_sub_ps(w, vm))
        };
        _mm512_storeu_ps(p.add(i), v);
        v
    };
    let mut sum = 0f64;
    let mut i = 0;
    while i + 128 <= n {
        let v: [__m512; 8] = std::array::from_fn(|k| one(i + 16 * k));
        for r in reduce16x8(&v) {
            sum += f64::from(r);
        }
        i += 128;
    }
    while i + 16 <= n {
        sum += f64::from(reduce16(one(i)));
        i += 16;
    }
    tail(&mut y[i..], max, sum)
}

/// ggml's scalar tail: libm's `expf`, each value added to the sum.
fn tail(y: &mut [f32], max: f32, mut sum: f64) -> f64 {
    for v in y {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    sum
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k8(bits: u32) -> __m256 {
    _mm256_set1_ps(f32::from_bits(bits))
}

/// ggml's AVX2 `ggml_v_expf`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp8(x: __m256) -> __m256 {
    let r = k8(c::ROUND);
    let z = _mm256_fmadd_ps(x, k8(c::LOG2E), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, k8(c::LN2_LO), _mm256_fnmadd_ps(n, k8(c::LN2_HI), x));
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(
        e,
        _mm256_castps_si256(_mm256_set1_ps(1.0)),
    ));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let c = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0)));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(k8(c::P5), b, k8(c::P4)),
            u,
            _mm256_fmadd_ps(k8(c::P3), b, k8(c::P2)),
        ),
        u,
        _mm256_mul_ps(k8(c::P1), b),
    );
    if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
        return _mm256_fmadd_ps(j, k, k);
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let d = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0)));
    let (c, d) = (_mm256_castsi256_ps(c), _mm256_castsi256_ps(d));
    _mm256_or_ps(
        _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(
            d,
            _mm256_or_ps(
                _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
            ),
        ),
    )
}

/// ggml's AVX2 lane sum: 128-bit halves, then `movehl`, then `movehdup`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce8(v: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
}

/// `y = exp(y - max)` as ggml's AVX2 build, returning the sum; with `skip`, vectors of -inf
/// are written as 0 (see [`row`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exps_ymm(y: &mut [f32], max: f32, skip: bool) -> f64 {
    exps_ymm_from(y, max, skip, 0.0)
}

/// [`exps_ymm`] with the sum so far `sum` (the terms before `y`'s).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exps_ymm_from(y: &mut [f32], max: f32, skip: bool, mut sum: f64) -> f64 {
    let n = y.len();
    let p = y.as_mut_ptr();
    let vm = _mm256_set1_ps(max);
    let mut i = 0;
    while i + 8 <= n {
        let w = _mm256_loadu_ps(p.add(i));
        if skip
            && _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
                w,
                _mm256_set1_ps(f32::NEG_INFINITY),
            )) == 0xff
        {
            _mm256_storeu_ps(p.add(i), _mm256_setzero_ps());
            i += 8;
            continue;
        }
        let v = exp8(_mm256_sub_ps(w, vm));
        _mm256_storeu_ps(p.add(i), v);
        sum += f64::from(reduce8(v));
        i += 8;
    }
    tail(&mut y[i..], max, sum)
}

/// ggml's AVX2 `ggml_v_expf` ([`exp8`]) on sixteen lanes: each lane the same operations on
/// the same operands, the selections by masks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn exp8x2(x: __m512) -> __m512 {
    let r = k16(c::ROUND);
    let z = _mm512_fmadd_ps(x, k16(c::LOG2E), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, k16(c::LN2_LO), _mm512_fnmadd_ps(n, k16(c::LN2_HI), x));
    let e = _mm512_slli_epi32::<23>(_mm512_castps_si512(z));
    let k = _mm512_castsi512_ps(_mm512_add_epi32(
        e,
        _mm512_castps_si512(_mm512_set1_ps(1.0)),
    ));
    let abs_n = _mm512_abs_ps(n);
    let c = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs_n, _mm512_set1_ps(126.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(k16(c::P5), b, k16(c::P4)),
            u,
            _mm512_fmadd_ps(k16(c::P3), b, k16(c::P2)),
        ),
        u,
        _mm512_mul_ps(k16(c::P1), b),
    );
    let common = _mm512_fmadd_ps(j, k, k);
    if c == 0 {
        return common;
    }
    let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
    let g = _mm512_maskz_mov_epi32(le, _mm512_set1_epi32(0x8200_0000u32 as i32));
    let s1 = _mm512_castsi512_ps(_mm512_add_epi32(g, _mm512_set1_epi32(0x7f00_0000)));
    let s2 = _mm512_castsi512_ps(_mm512_sub_epi32(e, g));
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs_n, _mm512_set1_ps(192.0));
    let big = _mm512_mul_ps(_mm512_fmadd_ps(s2, j, s2), s1);
    let v = _mm512_mask_blend_ps(c, common, big);
    _mm512_mask_blend_ps(d, v, _mm512_mul_ps(s1, s1))
}

/// [`exps_ymm`] sixteen lanes at a time on a CPU with AVX-512 ([`exp8x2`]): eight of the
/// build's vectors to four registers, their lanes summed together ([`reduce8x8`]) and added to
/// the sum one vector after another, in order; the last vectors as [`exps_ymm`] takes them.
/// With `skip`, sixteen values of -inf are written as 0 (a vector of -inf among them gets
/// ggml's `exp` of -inf, +0, which adds +0 as a skipped one adds nothing).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn exps_ymm_wide(y: &mut [f32], max: f32, skip: bool) -> f64 {
    let n = y.len();
    let p = y.as_mut_ptr();
    let vm = _mm512_set1_ps(max);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut sum = 0f64;
    let mut i = 0;
    while i + 64 <= n {
        let v: [__m512; 4] = std::array::from_fn(|k| {
            let w = _mm512_loadu_ps(p.add(i + 16 * k));
            let v = if skip && _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(w, neg_inf) == 0xffff {
                _mm512_setzero_ps()
            } else {
                exp8x2(_mm512_sub_ps(w, vm))
            };
            _mm512_storeu_ps(p.add(i + 16 * k), v);
            v
        });
        for r in reduce8x8(&v) {
            sum += f64::from(r);
        }
        i += 64;
    }
    exps_ymm_from(&mut y[i..], max, skip, sum)
}

/// `y = silu(x) * g` as ggml's `ggml_vec_swiglu_f32`: whole vectors of its build's width by
/// `ggml_v_silu` (`x / (1 + exp(0 - x))` with its `ggml_v_expf`), the tail by libm's `expf`.
///
/// # Safety
/// The CPU runs `exp` ([`cpu_ok`]); equal lengths.
pub(super) unsafe fn swiglu(exp: Exp, x: &[f32], g: &[f32], y: &mut [f32]) {
    let i = match exp {
        Exp::Zmm => swiglu_zmm(x, g, y),
        Exp::Ymm if wide() => swiglu_ymm_wide(x, g, y),
        Exp::Ymm => swiglu_ymm(x, g, y),
    };
    for ((y, &x), &g) in y[i..].iter_mut().zip(&x[i..]).zip(&g[i..]) {
        *y = x / (1.0 + (-x).exp()) * g;
    }
}

/// The whole 16-lane vectors of [`swiglu`]; returns where the tail starts.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn swiglu_zmm(x: &[f32], g: &[f32], y: &mut [f32]) -> usize {
    let n = x.len();
    let (px, pg, py) = (x.as_ptr(), g.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        let v = _mm512_loadu_ps(px.add(i));
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        let s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0), e));
        _mm512_storeu_ps(py.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(pg.add(i))));
        i += 16;
    }
    i
}

/// [`swiglu_ymm`] sixteen lanes at a time ([`exp8x2`]) on a CPU with AVX-512, a last 8-lane
/// vector as [`swiglu_ymm`] takes it; returns where the tail starts.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn swiglu_ymm_wide(x: &[f32], g: &[f32], y: &mut [f32]) -> usize {
    let n = x.len();
    let (px, pg, py) = (x.as_ptr(), g.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        let v = _mm512_loadu_ps(px.add(i));
        let e = exp8x2(_mm512_sub_ps(_mm512_setzero_ps(), v));
        let s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0), e));
        _mm512_storeu_ps(py.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(pg.add(i))));
        i += 16;
    }
    i + swiglu_ymm(&x[i..], &g[i..], &mut y[i..])
}

/// The whole 8-lane vectors of [`swiglu`]; returns where the tail starts.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_ymm(x: &[f32], g: &[f32], y: &mut [f32]) -> usize {
    let n = x.len();
    let (px, pg, py) = (x.as_ptr(), g.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_loadu_ps(px.add(i));
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
        let s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_storeu_ps(py.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(pg.add(i))));
        i += 8;
    }
    i
}

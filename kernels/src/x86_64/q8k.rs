//! `Q8_K` quantization with AVX2 (see `q8k.rs`).

use super::{Rounding, QK_K};
use crate::qdot::kquant::hsum_i32;
use std::arch::x86_64::*;

/// One block of [`super::quantize_ref`] with AVX2: the magnitude's maximum (exact in any
/// order), the first value that has it, the products with the scale rounded by
/// the addition of 1.5 * 2^23 as `rounding` says, and the sums of 16.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block(x: &[f32], y: &mut [u8], rounding: Rounding) {
    let p = x.as_ptr();
    let abs = |v: __m256| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
    let mut m = _mm256_setzero_ps();
    for c in 0..QK_K / 8 {
        m = _mm256_max_ps(m, abs(_mm256_loadu_ps(p.add(8 * c))));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
    if amax == 0.0 {
        y.fill(0);
        return;
    }
    let am = _mm256_set1_ps(amax);
    let first = (0..QK_K / 8)
        .find_map(|c| {
            let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
                abs(_mm256_loadu_ps(p.add(8 * c))),
                am,
            ));
            (eq != 0).then(|| 8 * c + eq.trailing_zeros() as usize)
        })
        .expect("the maximum is one of the values");
    let iscale = -127.0 / x[first];
    let s = _mm256_set1_ps(iscale);
    let magic = _mm256_set1_ps(12_582_912.0);
    let int = |v: __m256| {
        let m = match rounding {
            Rounding::Product => _mm256_add_ps(_mm256_mul_ps(s, v), magic),
            Rounding::Fused => _mm256_fmadd_ps(s, v, magic),
        };
        let i = _mm256_sub_epi32(
            _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(0x007f_ffff)),
            _mm256_set1_epi32(0x0040_0000),
        );
        _mm256_min_epi32(i, _mm256_set1_epi32(127))
    };
    let q = y.as_mut_ptr().add(4);
    for j in 0..QK_K / 16 {
        let a = int(_mm256_loadu_ps(p.add(16 * j)));
        let b = int(_mm256_loadu_ps(p.add(16 * j + 8)));
        // 16 values in [-127, 127]: the saturating packs are exact.
        let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
        let bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128(q.add(16 * j).cast(), bytes);
        let sum = hsum_i32(_mm256_add_epi32(a, b)) as i16;
        y[4 + QK_K + 2 * j..][..2].copy_from_slice(&sum.to_le_bytes());
    }
    y[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

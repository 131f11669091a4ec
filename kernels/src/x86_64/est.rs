//! The estimate's AVX2 kernel: up to 8 query heads' sums in registers per key load.

use super::{BLOCK, BLOCK_BYTES};
use crate::f16::simd::hsum;
use std::arch::x86_64::*;

/// [`super::scores_f32q`] for up to 8 heads, each head's sum in one register.
///
/// # Safety
/// As [`super::scores_f32q`]; `g <= 8`.
pub(super) unsafe fn scores_f32q(
    q: &[f32],
    g: usize,
    d: usize,
    n: usize,
    key: impl Fn(usize) -> *const u8,
    out: &mut [&mut [f32]],
) {
    let blocks = d / BLOCK;
    for c in 0..n {
        let k = key(c);
        let mut acc = [_mm256_setzero_ps(); 8];
        for b in 0..blocks {
            let blk = k.add(b * BLOCK_BYTES);
            let bits = u16::from_le_bytes([*blk, *blk.add(1)]) as i32;
            let scale = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
            let v = blk.add(2);
            let k0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.cast())));
            let k1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.add(8).cast())));
            let k2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.add(16).cast())));
            let k3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.add(24).cast())));
            for (h, a) in acc.iter_mut().enumerate().take(g) {
                let qp = q.as_ptr().add(h * d + b * BLOCK);
                let mut t = _mm256_mul_ps(_mm256_loadu_ps(qp), k0);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8)), k1, t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(16)), k2, t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(24)), k3, t);
                *a = _mm256_fmadd_ps(t, scale, *a);
            }
        }
        for h in 0..g {
            *out[h].get_unchecked_mut(c) = hsum(acc[h]);
        }
    }
}

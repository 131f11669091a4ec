//! The x86-64 unit: AVX2 with F16C's conversions, as ggml's `GGML_CPU_FP32_TO_FP16` and
//! `GGML_CPU_FP16_TO_FP32` on x86-64.

use std::arch::x86_64::*;

/// The CPU runs [`geglu`] and [`widen`] (AVX2/F16C).
pub fn cpu_ok() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
}

/// `h` as f32 with F16C's conversion (ggml's `GGML_CPU_FP16_TO_FP32` on x86-64).
///
/// # Safety
/// [`cpu_ok`]; `h.len()` is a multiple of 8.
pub unsafe fn widen(h: &[u16]) -> Vec<f32> {
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn go(h: &[u16], out: &mut [f32]) {
        for (o, c) in out.chunks_exact_mut(8).zip(h.chunks_exact(8)) {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(c.as_ptr().cast()));
            _mm256_storeu_ps(o.as_mut_ptr(), v);
        }
    }
    let mut out = vec![0f32; h.len()];
    go(h, &mut out);
    out
}

/// `y = gelu(x) * g` element by element, ggml's way (see the parent module's docs).
///
/// # Safety
/// [`cpu_ok`]; `table` has 65536 entries (the gather does not check); slices of equal length.
pub unsafe fn geglu(table: &[f32], x: &[f32], g: &[f32], y: &mut [f32]) {
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn go(table: &[f32], x: &[f32], g: &[f32], y: &mut [f32]) {
        let n8 = x.len() / 8 * 8;
        let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
        for i in (0..n8).step_by(8) {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(xv);
            let t = _mm256_i32gather_ps::<4>(table.as_ptr(), _mm256_cvtepu16_epi32(h));
            let mut v = _mm256_mul_ps(t, gv);
            v = _mm256_blendv_ps(
                v,
                _mm256_mul_ps(xv, gv),
                _mm256_cmp_ps::<_CMP_GE_OQ>(xv, hi),
            );
            v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(xv, lo));
            _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
        }
        for i in n8..x.len() {
            y[i] = if x[i] <= -10.0 {
                0.0
            } else if x[i] >= 10.0 {
                x[i] * g[i]
            } else {
                let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x[i]));
                table[_mm_extract_epi16::<0>(h) as u16 as usize] * g[i]
            };
        }
    }
    go(table, x, g, y)
}

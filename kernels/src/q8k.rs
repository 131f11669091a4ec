//! ggml's `quantize_row_q8_K` (activations for the k-quants' dot products), which ggml's x86-64
//! build computes with its scalar reference: per 256 values the first value of the largest
//! magnitude sets the scale `-127 / max`, each value is rounded to the nearest integer (ties to
//! even), and every 16 quants are summed. [`quantize`] is the same arithmetic with AVX2 where
//! the CPU has it (`leap_backend` checks it against the ggml the process loaded before use),
//! [`quantize_ref`] the transcription it is tested against.

use crate::qdot::{Q8K_BYTES, QK_K};

/// `x` (a multiple of 256 values) as `Q8_K` blocks into `y` (292 bytes a block: the f32
/// scale, 256 quants, 16 sums of 16), as ggml's reference computes them. An all-zero block
/// gets scale 0, zero quants and zero sums (ggml leaves its sums as they were: callers
/// compare on zeroed buffers).
///
/// # Panics
/// `x` is not whole blocks or `y` is shorter than their bytes.
pub fn quantize_ref(x: &[f32], y: &mut [u8]) {
    assert_eq!(x.len() % QK_K, 0, "not whole Q8_K blocks");
    for (x, y) in x.chunks_exact(QK_K).zip(y.chunks_exact_mut(Q8K_BYTES)) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y[4..4 + QK_K].iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for j in 0..QK_K / 16 {
            let s: i32 = y[4 + 16 * j..4 + 16 * (j + 1)]
                .iter()
                .map(|&q| i32::from(q as i8))
                .sum();
            y[4 + QK_K + 2 * j..][..2].copy_from_slice(&(s as i16).to_le_bytes());
        }
        y[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// ggml's `nearest_int`: the float's integer part after adding 1.5 * 2^23.
fn nearest_int(v: f32) -> i32 {
    ((v + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// [`quantize_ref`]'s result, with AVX2 where the CPU has it.
///
/// # Panics
/// As [`quantize_ref`].
pub fn quantize(x: &[f32], y: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert_eq!(x.len() % QK_K, 0, "not whole Q8_K blocks");
        assert!(y.len() >= x.len() / QK_K * Q8K_BYTES, "output too short");
        for (x, y) in x.chunks_exact(QK_K).zip(y.chunks_exact_mut(Q8K_BYTES)) {
            // SAFETY: AVX2 checked; 256 values and 292 bytes.
            unsafe { x86::block(x, y) };
        }
        return;
    }
    quantize_ref(x, y)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::QK_K;
    use std::arch::x86_64::*;

    /// One block of [`super::quantize_ref`] with AVX2: the magnitude's maximum (exact in any
    /// order), the first value that has it, the products with the scale rounded by
    /// `vcvtps2dq` (to nearest, ties to even: what adding 1.5 * 2^23 does for values this
    /// small), and the sums of 16.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block(x: &[f32], y: &mut [u8]) {
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
        let q = y.as_mut_ptr().add(4);
        for j in 0..QK_K / 16 {
            let a = _mm256_min_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(s, _mm256_loadu_ps(p.add(16 * j)))),
                _mm256_set1_epi32(127),
            );
            let b = _mm256_min_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(s, _mm256_loadu_ps(p.add(16 * j + 8)))),
                _mm256_set1_epi32(127),
            );
            // 16 values in [-127, 127]: the saturating packs are exact.
            let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            let bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128(q.add(16 * j).cast(), bytes);
            let t = _mm256_add_epi32(a, b);
            let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
            let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t));
            let sum = _mm_cvtsi128_si32(t) as i16;
            y[4 + QK_K + 2 * j..][..2].copy_from_slice(&sum.to_le_bytes());
        }
        y[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use crate::qdot::{Q8K_BYTES, QK_K};

    /// Blocks of every kind the quantizer branches on: random spreads, the largest magnitude
    /// negative and positive, ties of equal magnitude and opposite signs (the first decides
    /// the scale's sign), values rounding to exact halves, and an all-zero block.
    fn rows() -> Vec<Vec<f32>> {
        let mut rnd = crate::rng::XorShift::new(0x0008_0b1c);
        let mut out = Vec::new();
        for spread in [1e-3f32, 0.7, 3.0, 250.0] {
            out.push((0..4 * QK_K).map(|_| spread * rnd.signed()).collect());
        }
        let mut tie: Vec<f32> = (0..QK_K).map(|i| (i % 7) as f32 * 0.25 - 0.7).collect();
        tie[10] = -5.0;
        tie[200] = 5.0;
        out.push(tie.clone());
        tie[10] = 5.0;
        tie[200] = -5.0;
        out.push(tie);
        // iscale * x lands on halves: max 127 makes iscale -1.
        out.push(
            (0..QK_K)
                .map(|i| {
                    if i == 3 {
                        127.0
                    } else {
                        (i as f32 - 128.0) * 0.5
                    }
                })
                .collect(),
        );
        out.push(vec![0.0; QK_K]);
        let mut z = vec![0.0; 2 * QK_K];
        z[QK_K + 5] = -0.25;
        out.push(z);
        out
    }

    #[test]
    fn quantize_is_the_reference() {
        for x in rows() {
            let nb = x.len() / QK_K;
            let (mut want, mut got) = (vec![0u8; nb * Q8K_BYTES], vec![0xAAu8; nb * Q8K_BYTES]);
            super::quantize_ref(&x, &mut want);
            super::quantize(&x, &mut got);
            assert_eq!(want, got);
        }
    }

    /// The reference is a quantization: each quant times the scale is within half a step of
    /// its value, the first largest magnitude maps to -127, and the sums are the quants'.
    #[test]
    fn the_reference_quantizes() {
        for x in rows() {
            let mut y = vec![0u8; x.len() / QK_K * Q8K_BYTES];
            super::quantize_ref(&x, &mut y);
            for (x, y) in x.chunks_exact(QK_K).zip(y.chunks_exact(Q8K_BYTES)) {
                let d = f32::from_le_bytes(y[..4].try_into().unwrap());
                let qs: Vec<i32> = y[4..4 + QK_K].iter().map(|&q| i32::from(q as i8)).collect();
                for (&v, &q) in x.iter().zip(&qs) {
                    assert!(
                        (v - q as f32 * d).abs() <= d.abs() * 0.5 + 1e-6,
                        "{v} {q} {d}"
                    );
                }
                if let Some(i) = x
                    .iter()
                    .position(|v| v.abs() == x.iter().fold(0f32, |a, b| a.max(b.abs())))
                {
                    if x[i] != 0.0 {
                        assert_eq!(qs[i], -127);
                    }
                }
                for j in 0..16 {
                    let s = i16::from_le_bytes(y[4 + QK_K + 2 * j..][..2].try_into().unwrap());
                    assert_eq!(i32::from(s), qs[16 * j..16 * (j + 1)].iter().sum::<i32>());
                }
            }
        }
    }
}

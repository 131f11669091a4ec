//! ggml's `quantize_row_q8_K` (activations for the k-quants' dot products), which ggml's x86-64
//! build computes with its scalar reference: per 256 values the first value of the largest
//! magnitude sets the scale `-127 / max`, each value times the scale is rounded to the nearest
//! integer (ties to even) by adding 1.5 * 2^23, and every 16 quants are summed. Whether the
//! compiler fused that product and addition into one rounding is the build's choice
//! ([`Rounding`]): a value whose rounded product is a tie the exact one is not goes one way or
//! the other. [`quantize`] is the same arithmetic with AVX2 where the CPU has it
//! (`leap_backend` checks it against the ggml the process loaded, and picks the rounding, before
//! use), [`quantize_ref`] the transcription it is tested against.

use crate::qdot::{Q8K_BYTES, QK_K};

/// How a value times the scale becomes an integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// The product rounded to f32, then to the nearest integer (C compiled without
    /// contraction).
    Product,
    /// The exact product rounded to the nearest integer: `fma(scale, x, 1.5 * 2^23)` (GCC's
    /// default contraction where the build has FMA).
    Fused,
}

impl Rounding {
    /// Both, for a caller that tries which one the loaded ggml does.
    pub const ALL: [Rounding; 2] = [Rounding::Fused, Rounding::Product];
}

/// `x` (a multiple of 256 values) as `Q8_K` blocks into `y` (292 bytes a block: the f32
/// scale, 256 quants, 16 sums of 16), as ggml's reference computes them. An all-zero block
/// gets scale 0, zero quants and zero sums (ggml leaves its sums as they were: callers
/// compare on zeroed buffers).
///
/// # Panics
/// `x` is not whole blocks or `y` is shorter than their bytes.
pub fn quantize_ref(x: &[f32], y: &mut [u8], rounding: Rounding) {
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
            let magic = match rounding {
                Rounding::Product => iscale * v + 12_582_912.0,
                Rounding::Fused => iscale.mul_add(v, 12_582_912.0),
            };
            *q = nearest_int(magic).min(127) as i8 as u8;
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

/// ggml's `nearest_int` after its addition of 1.5 * 2^23 (`magic`): the integer the low bits
/// hold.
fn nearest_int(magic: f32) -> i32 {
    (magic.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// [`quantize_ref`]'s result, with AVX2 where the CPU has it.
///
/// # Panics
/// As [`quantize_ref`].
pub fn quantize(x: &[f32], y: &mut [u8], rounding: Rounding) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert_eq!(x.len() % QK_K, 0, "not whole Q8_K blocks");
        assert!(y.len() >= x.len() / QK_K * Q8K_BYTES, "output too short");
        for (x, y) in x.chunks_exact(QK_K).zip(y.chunks_exact_mut(Q8K_BYTES)) {
            // SAFETY: AVX2 checked; 256 values and 292 bytes.
            unsafe { x86::block(x, y, rounding) };
        }
        return;
    }
    quantize_ref(x, y, rounding)
}

/// A block of values on which the two [`Rounding`]s give different quants: the first value
/// -100 (scale 1.27, inexact), the others next to where the rounded product is a tie and the
/// exact one is not. For a check that picks the rounding of a build.
pub fn telling_block() -> Vec<f32> {
    let iscale = -127.0f32 / -100.0;
    let mut out = vec![-100.0f32];
    'fill: for k in 0..99 {
        let x0 = (k as f32 + 0.5) / iscale;
        for d in -8i32..=8 {
            let x = f32::from_bits(x0.to_bits().wrapping_add_signed(d));
            let product = f64::from(iscale * x).round_ties_even();
            let exact = (f64::from(iscale) * f64::from(x)).round_ties_even();
            if product != exact {
                out.push(x);
                if out.len() == QK_K {
                    break 'fill;
                }
            }
        }
    }
    out.resize(QK_K, 0.5);
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Rounding, QK_K};
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
            for r in super::Rounding::ALL {
                super::quantize_ref(&x, &mut want, r);
                super::quantize(&x, &mut got, r);
                assert_eq!(want, got, "{r:?}");
            }
        }
    }

    /// The telling block tells the roundings apart, and both kernels follow each.
    #[test]
    fn the_telling_block_tells_the_roundings_apart() {
        let x = super::telling_block();
        assert!(x[1..].iter().all(|v| v.abs() < 100.0));
        let mut by = Vec::new();
        for r in super::Rounding::ALL {
            let (mut want, mut got) = (vec![0u8; Q8K_BYTES], vec![0u8; Q8K_BYTES]);
            super::quantize_ref(&x, &mut want, r);
            super::quantize(&x, &mut got, r);
            assert_eq!(want, got, "{r:?}");
            by.push(want);
        }
        assert_ne!(by[0], by[1]);
    }

    /// The reference is a quantization: each quant times the scale is within half a step of
    /// its value, the first largest magnitude maps to -127, and the sums are the quants'.
    #[test]
    fn the_reference_quantizes() {
        for x in rows() {
            let mut y = vec![0u8; x.len() / QK_K * Q8K_BYTES];
            super::quantize_ref(&x, &mut y, super::Rounding::Fused);
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

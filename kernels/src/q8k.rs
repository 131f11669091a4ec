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

/// Bytes of `n` values (a multiple of 256) as `Q8_K` blocks.
pub fn row_bytes(n: usize) -> usize {
    n / QK_K * Q8K_BYTES
}

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
#[path = "x86_64/q8k.rs"]
mod x86;

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

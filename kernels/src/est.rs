//! The estimate of sparse attention: f32 queries against the int8 (`Q8_0`) shadow of the K
//! cache, several query heads per key load (grouped-query attention), one scale per block of
//! 32. (An NPU would quantize the queries too, with a scale per head: issue 6's QNN device.)
//! Portable here, AVX2 in `x86_64/est.rs` where the build has it (Leap's x86-64 build does).

/// Bytes of a `Q8_0` block: an f16 scale and 32 int8 values.
pub const BLOCK_BYTES: usize = 34;
/// Values per block.
pub const BLOCK: usize = 32;

/// For each key `c` in `0..n` and each of the `g` f32 query heads in `q` (`g * d` values):
/// `out[h][c] = Σ_blocks scale(k) · (q_h · k)`: only the keys are quantized, so the ranking
/// errs only by the int8 cache copy.
///
/// # Safety
/// Every `key(c)` points to `d / 32` readable blocks; `out` has `g` rows of at least `n`.
#[inline]
pub unsafe fn scores_f32q(
    q: &[f32],
    g: usize,
    d: usize,
    n: usize,
    key: impl Fn(usize) -> *const u8,
    out: &mut [&mut [f32]],
) {
    debug_assert!(q.len() >= g * d && out.len() >= g && d.is_multiple_of(BLOCK));
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "f16c",
        target_feature = "fma"
    ))]
    {
        if g <= 8 {
            avx2::scores_f32q(q, g, d, n, key, out);
            return;
        }
    }
    #[allow(clippy::needless_range_loop)]
    for c in 0..n {
        let k = key(c);
        for h in 0..g {
            let mut s = 0f32;
            for b in 0..d / BLOCK {
                let blk = k.add(b * BLOCK_BYTES);
                let scale = crate::f16::to_f32(u16::from_le_bytes([*blk, *blk.add(1)]));
                let vals = blk.add(2).cast::<i8>();
                let mut acc = 0f32;
                for x in 0..BLOCK {
                    acc += q[h * d + b * BLOCK + x] * *vals.add(x) as f32;
                }
                s += scale * acc;
            }
            out[h][c] = s;
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "f16c",
    target_feature = "fma"
))]
#[path = "x86_64/est.rs"]
mod avx2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_are_block_scaled_dot_products() {
        let (g, d, n) = (3, 64, 37);
        let q: Vec<f32> = (0..g * d)
            .map(|i| ((i * 37 % 255) as f32 - 127.0) / 50.0)
            .collect();
        let mut keys = vec![0u8; n * (d / BLOCK) * BLOCK_BYTES];
        for (i, b) in keys.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            let s = crate::f16::from_f32(0.01 * (i % 7 + 1) as f32).to_le_bytes();
            b[0] = s[0];
            b[1] = s[1];
            for (x, v) in b[2..].iter_mut().enumerate() {
                *v = (((i * 31 + x * 17) % 255) as i32 - 127) as i8 as u8;
            }
        }
        let row = (d / BLOCK) * BLOCK_BYTES;
        let key = |c: usize| keys.as_ptr().wrapping_add(c * row);
        let mut got = vec![vec![0f32; n]; g];
        // SAFETY: `keys` holds n rows of d/32 blocks.
        unsafe {
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|v| v.as_mut_slice()).collect();
            scores_f32q(&q, g, d, n, key, &mut outs);
        }
        for h in 0..g {
            for c in 0..n {
                let mut want = 0f64;
                for b in 0..d / BLOCK {
                    let blk = &keys[c * row + b * BLOCK_BYTES..][..BLOCK_BYTES];
                    let scale = crate::f16::to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64;
                    let dot: f64 = (0..BLOCK)
                        .map(|x| q[h * d + b * BLOCK + x] as f64 * blk[2 + x] as i8 as f64)
                        .sum();
                    want += scale * dot;
                }
                let v = got[h][c] as f64;
                assert!(
                    (v - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{h} {c}: {v} vs {want}"
                );
            }
        }
    }
}

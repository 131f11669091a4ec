//! A tile's columns written out as rows. The ggml device's kernels compute a tile of (weight or
//! cache row) x (batch row) results, one batch row's results side by side; ggml's node holds a
//! row per batch row. Moving them one float at a time cost a third of the attention products
//! themselves on SmolLM2's 64-wide heads; on x86-64 blocks of 8 x 8 go through registers.
//! Only data moves, so every value is the kernel's, bit for bit.

/// For each column `c` of `src` (`height` rows of `width` floats, row-major), its `height`
/// values in order at `dst(c)`: `dst(c)[j] = src[j * width + c]`.
///
/// # Safety
/// Each `dst(c)`, `c < width`, points at `height` writable floats that overlap neither `src`
/// nor another column's.
///
/// # Panics
/// When `src` is shorter than `width * height`.
pub unsafe fn columns_to(
    src: &[f32],
    width: usize,
    height: usize,
    dst: impl Fn(usize) -> *mut f32,
) {
    assert!(
        src.len() >= width * height,
        "src holds width x height floats"
    );
    #[allow(unused_mut)]
    let (mut h8, mut w8) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        (h8, w8) = (height / 8 * 8, width / 8 * 8);
        x86::blocks(src, width, h8, w8, &dst);
    }
    // The rest one at a time: the columns past the last whole 8 for every row, and the rows
    // past the last whole 8 for the others.
    for c in 0..width {
        let out = dst(c);
        let from = if c < w8 { h8 } else { 0 };
        for j in from..height {
            *out.add(j) = src[j * width + c];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::columns_to`] for rows `..h8` of columns `..w8` (multiples of 8), 8 x 8 at a time.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn blocks(
        src: &[f32],
        width: usize,
        h8: usize,
        w8: usize,
        dst: &impl Fn(usize) -> *mut f32,
    ) {
        let p = src.as_ptr();
        for c0 in (0..w8).step_by(8) {
            let outs: [*mut f32; 8] = std::array::from_fn(|i| dst(c0 + i));
            for j0 in (0..h8).step_by(8) {
                let r: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(p.add((j0 + i) * width + c0)));
                let t = [
                    _mm256_unpacklo_ps(r[0], r[1]),
                    _mm256_unpackhi_ps(r[0], r[1]),
                    _mm256_unpacklo_ps(r[2], r[3]),
                    _mm256_unpackhi_ps(r[2], r[3]),
                    _mm256_unpacklo_ps(r[4], r[5]),
                    _mm256_unpackhi_ps(r[4], r[5]),
                    _mm256_unpacklo_ps(r[6], r[7]),
                    _mm256_unpackhi_ps(r[6], r[7]),
                ];
                let s = [
                    _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                    _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                    _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                    _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                    _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                    _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                    _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                    _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
                ];
                // Column i: lanes 0-3 from rows 0-3 (s[i % 4]'s low or high 128 bits), lanes
                // 4-7 from rows 4-7 (s[4 + i % 4]'s).
                for i in 0..4 {
                    let lo = _mm256_permute2f128_ps::<0x20>(s[i], s[4 + i]);
                    let hi = _mm256_permute2f128_ps::<0x31>(s[i], s[4 + i]);
                    _mm256_storeu_ps(outs[i].add(j0), lo);
                    _mm256_storeu_ps(outs[4 + i].add(j0), hi);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every shape around the 8 x 8 blocks (whole blocks, leftover rows, leftover columns,
    /// both, neither) gives each column's values in order, written nowhere else.
    #[test]
    fn columns_come_out_as_rows() {
        for width in [1usize, 3, 8, 9, 16, 17, 24] {
            for height in [0usize, 1, 7, 8, 9, 16, 23, 64] {
                let src: Vec<f32> = (0..width * height).map(|i| i as f32 + 0.5).collect();
                // Each column's row with a guard value either side.
                let stride = height + 2;
                let mut out = vec![-1.0f32; width * stride];
                let base = out.as_mut_ptr() as usize;
                // SAFETY: column c's row is out[c * stride + 1..][..height]: disjoint.
                unsafe {
                    super::columns_to(&src, width, height, |c| {
                        (base as *mut f32).add(c * stride + 1)
                    })
                };
                for c in 0..width {
                    let row = &out[c * stride..(c + 1) * stride];
                    assert_eq!(row[0], -1.0, "{width} x {height}: before column {c}");
                    assert_eq!(
                        row[height + 1],
                        -1.0,
                        "{width} x {height}: after column {c}"
                    );
                    for j in 0..height {
                        assert_eq!(
                            row[j + 1],
                            src[j * width + c],
                            "{width} x {height}: ({j}, {c})"
                        );
                    }
                }
            }
        }
    }
}

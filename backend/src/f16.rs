//! Half-precision helpers for attention over ggml's f16 KV cache: conversion, and the two
//! inner loops exact attention needs (`q · k` with an f32 query and an f16 key, and
//! `acc += w · v`), with F16C/FMA where the build has them and portable code elsewhere.

/// IEEE half (as stored by ggml) to f32.
#[inline]
pub fn to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value = man * 2^-24.
            let v = man as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000,
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// f32 to IEEE half, rounding to nearest even (for tests and captured copies).
pub fn from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1 << shift) - 1);
        let mut r = m >> shift;
        if rest > half || (rest == half && r & 1 == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && r & 1 == 1) {
        r += 1;
    }
    sign | r as u16
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "f16c",
    target_feature = "fma"
))]
pub(crate) mod simd {
    use std::arch::x86_64::*;

    /// The sum of a register's 8 lanes.
    #[inline]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    #[inline]
    pub unsafe fn dot(q: &[f32], k: *const u16) -> f32 {
        let n = q.len();
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(k.add(i).cast()));
            let k1 = _mm256_cvtph_ps(_mm_loadu_si128(k.add(i + 8).cast()));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), k0, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i + 8)), k1, a1);
            i += 16;
        }
        let mut sum = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            sum += q[i] * super::to_f32(*k.add(i));
            i += 1;
        }
        sum
    }

    #[inline]
    pub unsafe fn prefetch(p: *const u8, bytes: usize) {
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.add(o).cast());
            o += 64;
        }
    }

    /// out = Σ_r w[r] · rows[r], accumulating 64 columns at a time in registers.
    pub unsafe fn weighted_sum(out: &mut [f32], w: &[f32], rows: &[*const u16]) {
        let n = out.len();
        let mut c0 = 0;
        while c0 + 64 <= n {
            let mut a = [_mm256_setzero_ps(); 8];
            for (r, &p) in rows.iter().enumerate() {
                if let Some(&next) = rows.get(r + 4) {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(c0).cast());
                    _mm_prefetch::<_MM_HINT_T0>(next.add(c0 + 32).cast());
                }
                let wv = _mm256_set1_ps(*w.get_unchecked(r));
                let p = p.add(c0);
                for (x, acc) in a.iter_mut().enumerate() {
                    let v = _mm256_cvtph_ps(_mm_loadu_si128(p.add(8 * x).cast()));
                    *acc = _mm256_fmadd_ps(wv, v, *acc);
                }
            }
            for (x, acc) in a.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * x), *acc);
            }
            c0 += 64;
        }
        if c0 < n {
            let tail = &mut out[c0..];
            tail.fill(0.0);
            for (r, &p) in rows.iter().enumerate() {
                axpy(tail, w[r], p.add(c0));
            }
        }
    }

    #[inline]
    pub unsafe fn axpy(acc: &mut [f32], w: f32, v: *const u16) {
        let n = acc.len();
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(v.add(i).cast()));
            let p = acc.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, x, _mm256_loadu_ps(p)));
            i += 8;
        }
        while i < n {
            acc[i] += w * super::to_f32(*v.add(i));
            i += 1;
        }
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "f16c",
    target_feature = "fma"
)))]
mod simd {
    #[inline]
    pub unsafe fn dot(q: &[f32], k: *const u16) -> f32 {
        let mut s = 0.0;
        for (i, &x) in q.iter().enumerate() {
            s += x * super::to_f32(*k.add(i));
        }
        s
    }

    #[inline]
    pub unsafe fn prefetch(_: *const u8, _: usize) {}

    pub unsafe fn weighted_sum(out: &mut [f32], w: &[f32], rows: &[*const u16]) {
        out.fill(0.0);
        for (r, &p) in rows.iter().enumerate() {
            axpy(out, w[r], p);
        }
    }

    #[inline]
    pub unsafe fn axpy(acc: &mut [f32], w: f32, v: *const u16) {
        for (i, a) in acc.iter_mut().enumerate() {
            *a += w * super::to_f32(*v.add(i));
        }
    }
}

/// `q · k` for `q.len()` elements of f16 at `k`.
///
/// # Safety
/// `k` points to at least `q.len()` readable halves.
#[inline]
pub unsafe fn dot(q: &[f32], k: *const u16) -> f32 {
    simd::dot(q, k)
}

/// `out = Σ_r w[r] · rows[r]` over f16 rows of `out.len()` values.
///
/// # Safety
/// Every row points to at least `out.len()` readable halves; `w.len() >= rows.len()`.
pub unsafe fn weighted_sum(out: &mut [f32], w: &[f32], rows: &[*const u16]) {
    debug_assert!(w.len() >= rows.len());
    simd::weighted_sum(out, w, rows)
}

/// Ask for `bytes` from `p` to be brought into cache (a hint; no-op where unsupported).
///
/// # Safety
/// A hint only, but keep `p` inside an allocation.
#[inline]
pub unsafe fn prefetch(p: *const u8, bytes: usize) {
    simd::prefetch(p, bytes)
}

/// `acc += w · v` for `acc.len()` elements of f16 at `v`.
///
/// # Safety
/// `v` points to at least `acc.len()` readable halves.
#[inline]
pub unsafe fn axpy(acc: &mut [f32], w: f32, v: *const u16) {
    simd::axpy(acc, w, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rounds_like_ieee() {
        for h in 0..=u16::MAX {
            let x = to_f32(h);
            if x.is_nan() {
                assert!(to_f32(from_f32(x)).is_nan());
            } else {
                assert_eq!(from_f32(x), h, "{h:#x} -> {x}");
            }
        }
        assert_eq!(to_f32(0x3c00), 1.0);
        assert_eq!(to_f32(0xc000), -2.0);
        assert_eq!(from_f32(1.0 + 1.0 / 4096.0), 0x3c00); // below half an ulp: down
        assert_eq!(from_f32(65504.0), 0x7bff);
        assert_eq!(from_f32(1e6), 0x7c00);
    }

    #[test]
    fn dot_and_axpy_match_scalar() {
        let q: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<u16> = (0..67).map(|i| from_f32((i as f32 * 0.11).cos())).collect();
        let want: f32 = q.iter().zip(&k).map(|(a, &b)| a * to_f32(b)).sum();
        // SAFETY: k has q.len() halves.
        let got = unsafe { dot(&q, k.as_ptr()) };
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
        let mut acc = q.clone();
        // SAFETY: as above.
        unsafe { axpy(&mut acc, 0.5, k.as_ptr()) };
        for i in 0..67 {
            assert!((acc[i] - (q[i] + 0.5 * to_f32(k[i]))).abs() < 1e-6);
        }
        // 130 columns: two register chunks of 64 and a tail of 2.
        let rows: Vec<Vec<u16>> = (0..5)
            .map(|r| {
                (0..130)
                    .map(|i| from_f32(((r * 130 + i) as f32 * 0.07).sin()))
                    .collect()
            })
            .collect();
        let ptrs: Vec<*const u16> = rows.iter().map(|r| r.as_ptr()).collect();
        let w = [0.1f32, -0.5, 2.0, 0.0, 1.0];
        let mut out = vec![9f32; 130];
        // SAFETY: five rows of 130 halves.
        unsafe { weighted_sum(&mut out, &w, &ptrs) };
        for i in 0..130 {
            let want: f32 = (0..5).map(|r| w[r] * to_f32(rows[r][i])).sum();
            assert!((out[i] - want).abs() < 1e-5, "{i}");
        }
    }
}

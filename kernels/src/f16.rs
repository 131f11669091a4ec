//! IEEE half precision, converted as the hardware does (F16C's `vcvtph2ps`, AArch64's `fcvt`):
//! the one conversion every kernel and its tests use; and the two inner loops exact attention
//! over ggml's f16 KV cache needs (`q · k` with an f32 query and an f16 key, and
//! `acc += w · v`), with F16C/FMA where the build has them (`x86_64/f16.rs`) and portable code
//! elsewhere.

/// The half of -inf: what ggml's f16 attention masks hold where a cell is hidden.
pub const NEG_INFINITY: u16 = 0xfc00;

/// IEEE half to single (exact; a NaN keeps its payload, made quiet).
#[inline]
pub fn to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value = man * 2^-24.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
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
#[path = "x86_64/f16.rs"]
pub(crate) mod simd;

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
    use super::{axpy, dot, from_f32, to_f32, weighted_sum};

    /// The hardware's conversion of `h`, where this CPU has one.
    fn hardware(h: u16) -> Option<f32> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("f16c") {
            #[target_feature(enable = "f16c")]
            unsafe fn cvt(h: u16) -> f32 {
                use std::arch::x86_64::*;
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
            }
            // SAFETY: F16C detected.
            return Some(unsafe { cvt(h) });
        }
        #[cfg(target_arch = "aarch64")]
        {
            let r: u32;
            // SAFETY: `fcvt` from half is in every AArch64 CPU's base instruction set.
            unsafe {
                std::arch::asm!("fmov {t:s}, {h:w}", "fcvt {t:s}, {t:h}", "fmov {r:w}, {t:s}",
                    h = in(reg) u32::from(h), t = out(vreg) _, r = lateout(reg) r);
            }
            return Some(f32::from_bits(r));
        }
        #[allow(unreachable_code)]
        {
            let _ = h;
            None
        }
    }

    /// Every half converts as the hardware converts it (a NaN keeps its payload, made quiet),
    /// and every non-NaN half survives the round trip.
    #[test]
    fn every_half_converts_as_the_hardware_and_round_trips() {
        for h in 0..=u16::MAX {
            let x = to_f32(h);
            if let Some(hw) = hardware(h) {
                assert_eq!(hw.to_bits(), x.to_bits(), "{h:#06x}");
            }
            if x.is_nan() {
                let quiet_payload = (u32::from(h & 0x3ff) << 13) | 0x0040_0000;
                assert_eq!(x.to_bits() & 0x007f_ffff, quiet_payload, "{h:#06x}");
                assert!(to_f32(from_f32(x)).is_nan(), "{h:#06x}");
            } else {
                assert_eq!(from_f32(x), h, "{h:#06x}");
            }
        }
    }

    /// Rounding to nearest even, halfway cases both ways, overflow to infinity.
    #[test]
    fn rounds_to_nearest_even() {
        let one = 0x3c00u16;
        let ulp = f32::from_bits(0x3a80_0000); // 2^-10
        assert_eq!(from_f32(1.0 + ulp / 2.0), one); // tie: even stays
        assert_eq!(from_f32(1.0 + ulp * 1.5), one + 2); // tie: odd goes up
        assert_eq!(from_f32(1.0 + ulp * 0.75), one + 1);
        assert_eq!(from_f32(70000.0), 0x7c00);
        assert_eq!(from_f32(-70000.0), 0xfc00);
        assert_eq!(from_f32(65504.0), 0x7bff); // the largest half
        assert_eq!(from_f32(1.0 + 1.0 / 4096.0), one); // below half an ulp: down
        assert_eq!(to_f32(0xc000), -2.0);
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

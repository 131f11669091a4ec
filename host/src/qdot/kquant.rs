//! Weight-stationary kernels for ggml's k-quants (`Q4_K`, `Q6_K`: super-blocks of 256 weights
//! with 6- or 8-bit sub-block scales) against `Q8_K` activations.
//!
//! Each weight super-block is unpacked once (quants and scale vectors, 16 registers) for up
//! to [`GROUP`](super::GROUP) activation rows, and every row then runs ggml's AVX2
//! `vec_dot_q4_K_q8_K` / `vec_dot_q6_K_q8_K` arithmetic on it: the same integer lane sums
//! (exact), the same fused multiply-adds per super-block in the same lanes, and ggml's
//! final reductions, so each result is bit-identical to ggml's single-row call.

use std::arch::x86_64::*;

/// Values per super-block.
pub(super) const QK_K: usize = 256;
/// Bytes of a `Q8_K` super-block: `f32 d`, 256 `i8` quants, 16 `i16` sums of 16 quants.
pub(super) const Q8K_BYTES: usize = 292;
/// Bytes of a `Q4_K` super-block: `f16 d, dmin`, 12 bytes of packed 6-bit scales and mins,
/// 128 bytes of 4-bit quants.
pub(super) const Q4K_BYTES: usize = 144;
/// Bytes of a `Q6_K` super-block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 `i8`
/// scales, `f16 d`.
pub(super) const Q6K_BYTES: usize = 210;

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// ggml's `hsum_float_8`.
#[inline(always)]
unsafe fn hsum8(x: __m256) -> f32 {
    let mut r = _mm256_extractf128_ps(x, 1);
    r = _mm_add_ps(r, _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Broadcast of 16-bit scale pair `i` (bytes 2i, 2i+1) over a register (`Q4_K`'s shuffle).
#[inline(always)]
unsafe fn pair_shuffle(i: usize) -> __m256i {
    let (a, b) = ((2 * i) as i8, (2 * i + 1) as i8);
    _mm256_setr_epi8(
        a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,
        a, b,
    )
}

/// Scale bytes 2i (8 times) then 2i+1 (8 times) (`Q6_K`'s shuffle).
#[inline(always)]
unsafe fn half_shuffle(i: usize) -> __m128i {
    let (a, b) = ((2 * i) as i8, (2 * i + 1) as i8);
    _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
}

/// `out[i * rows.len() + r]` = weight row i (of `nb` `Q4_K` super-blocks in `w`) · `rows[r]`.
///
/// # Safety
/// AVX2/FMA/F16C present; every activation row holds `nb` `Q8_K` super-blocks; `w` whole rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let m = rows.len();
    let nw = w.len() / (nb * Q4K_BYTES);
    let m4 = _mm256_set1_epi8(0xF);
    for i in 0..nw {
        for g0 in (0..m).step_by(super::GROUP) {
            let gl = (m - g0).min(super::GROUP);
            let mut acc = [_mm256_setzero_ps(); super::GROUP];
            let mut acc_m = [_mm_setzero_ps(); super::GROUP];
            for sb in 0..nb {
                let x = w.as_ptr().add((i * nb + sb) * Q4K_BYTES);
                let (xd, xdmin) = (f16_at(x), f16_at(x.add(2)));
                let mut u = [0u32; 4];
                std::ptr::copy_nonoverlapping(x.add(4), u.as_mut_ptr().cast::<u8>(), 12);
                u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
                let uaux = u[1] & KMASK1;
                u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
                u[2] = uaux;
                u[0] &= KMASK1;
                let ms = _mm256_cvtepu8_epi16(_mm_set_epi32(
                    u[3] as i32,
                    u[2] as i32,
                    u[1] as i32,
                    u[0] as i32,
                ));
                let mins = _mm256_extracti128_si256(ms, 1);
                let sc = _mm256_extracti128_si256(ms, 0);
                let scales = _mm256_set_m128i(sc, sc);
                let q4 = x.add(16);
                let mut ql = [_mm256_setzero_si256(); 4];
                let mut qh = ql;
                let mut sl = ql;
                let mut sh = ql;
                for j in 0..4 {
                    let bits = _mm256_loadu_si256(q4.add(32 * j).cast());
                    ql[j] = _mm256_and_si256(bits, m4);
                    qh[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                    sl[j] = _mm256_shuffle_epi8(scales, pair_shuffle(2 * j));
                    sh[j] = _mm256_shuffle_epi8(scales, pair_shuffle(2 * j + 1));
                }
                for r in 0..gl {
                    let y = rows[g0 + r].as_ptr().add(sb * Q8K_BYTES);
                    let yd = std::ptr::read_unaligned(y.cast::<f32>());
                    let d = yd * xd;
                    let dmin = -yd * xdmin;
                    let q8sums = _mm256_loadu_si256(y.add(260).cast());
                    let q8s = _mm_hadd_epi16(
                        _mm256_extracti128_si256(q8sums, 0),
                        _mm256_extracti128_si256(q8sums, 1),
                    );
                    let prod = _mm_madd_epi16(mins, q8s);
                    acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
                    let q8 = y.add(4);
                    let mut sumi = _mm256_setzero_si256();
                    for j in 0..4 {
                        let l = _mm256_loadu_si256(q8.add(64 * j).cast());
                        let h = _mm256_loadu_si256(q8.add(64 * j + 32).cast());
                        let pl = _mm256_madd_epi16(sl[j], _mm256_maddubs_epi16(ql[j], l));
                        let ph = _mm256_madd_epi16(sh[j], _mm256_maddubs_epi16(qh[j], h));
                        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
                    }
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
                }
            }
            for r in 0..gl {
                let mut am = acc_m[r];
                am = _mm_add_ps(am, _mm_movehl_ps(am, am));
                am = _mm_add_ss(am, _mm_movehdup_ps(am));
                out[i * m + g0 + r] = hsum8(acc[r]) + _mm_cvtss_f32(am);
            }
        }
    }
}

/// As [`q4k`] for `Q6_K` weights.
///
/// # Safety
/// As [`q4k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    let m = rows.len();
    let nw = w.len() / (nb * Q6K_BYTES);
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    for i in 0..nw {
        for g0 in (0..m).step_by(super::GROUP) {
            let gl = (m - g0).min(super::GROUP);
            let mut acc = [_mm256_setzero_ps(); super::GROUP];
            for sb in 0..nb {
                let x = w.as_ptr().add((i * nb + sb) * Q6K_BYTES);
                let (ql, qhp) = (x, x.add(128));
                let xd = f16_at(x.add(208));
                let scales = _mm_loadu_si128(x.add(192).cast());
                let scales_16 = _mm256_cvtepi8_epi16(scales);
                let mut q = [_mm256_setzero_si256(); 8];
                let mut sc = q;
                for j in 0..2 {
                    let b1 = _mm256_loadu_si256(ql.add(64 * j).cast());
                    let b2 = _mm256_loadu_si256(ql.add(64 * j + 32).cast());
                    let bh = _mm256_loadu_si256(qhp.add(32 * j).cast());
                    let h0 = _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4);
                    let h1 = _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(12)), 2);
                    let h2 = _mm256_and_si256(bh, _mm256_set1_epi8(48));
                    let h3 = _mm256_srli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(-64)), 2);
                    q[4 * j] = _mm256_or_si256(_mm256_and_si256(b1, m15), h0);
                    q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15), h1);
                    q[4 * j + 2] =
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), h2);
                    q[4 * j + 3] =
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), h3);
                    for g in 0..4 {
                        let s = _mm_shuffle_epi8(scales, half_shuffle(4 * j + g));
                        sc[4 * j + g] = _mm256_cvtepi8_epi16(s);
                    }
                }
                for r in 0..gl {
                    let y = rows[g0 + r].as_ptr().add(sb * Q8K_BYTES);
                    let d = std::ptr::read_unaligned(y.cast::<f32>()) * xd;
                    let q8sums = _mm256_loadu_si256(y.add(260).cast());
                    let sub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
                    let q8 = y.add(4);
                    let mut sumi = _mm256_setzero_si256();
                    for j in 0..2 {
                        let mut p = [_mm256_setzero_si256(); 4];
                        for (g, pg) in p.iter_mut().enumerate() {
                            let v = _mm256_loadu_si256(q8.add(128 * j + 32 * g).cast());
                            *pg = _mm256_madd_epi16(
                                sc[4 * j + g],
                                _mm256_maddubs_epi16(q[4 * j + g], v),
                            );
                        }
                        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
                    }
                    sumi = _mm256_sub_epi32(sumi, sub);
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
                }
            }
            for r in 0..gl {
                out[i * m + g0 + r] = hsum8(acc[r]);
            }
        }
    }
}

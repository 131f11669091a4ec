//! Weight-stationary NEON kernels for ggml's k-quants (`Q4_K`, `Q6_K`) against `Q8_K`
//! activations.
//!
//! ggml's NEON `vec_dot_q4_K_q8_K` / `vec_dot_q6_K_q8_K` reduce each super-block to integers
//! (every sub-block's products summed and scaled in `i32`, exact in any order) before any float
//! operation, so only the per-super-block scalar float steps must be copied, as gcc compiled
//! them in Leap's `libggml-cpu.so` (armv8-a, -O3): `Q4_K` `sum = fmsub(mins, dmin, sum)` then
//! `sum = fmadd(sumi, d, sum)` (with `d = y.d * x.d`, `dmin = y.d * x.dmin`), `Q6_K` `sum =
//! fmadd(isum - 32 * isum_mins, x.d * y.d, sum)`. Whether ggml was built with dotprod does not
//! matter here: it only changes how ggml forms those integers (see
//! [`crate::reference`]'s `kquant`).
//!
//! One weight row against a group of up to [`GROUP`](super::GROUP) activation rows at a time
//! (the group size a constant, so every accumulator stays in a register): each 64 quants of a
//! super-block and their scales are unpacked once for the group. The integer sums are formed
//! with `smull`/`smlal` into 16 bits (at most 4 products a lane: `Q6_K`'s `63 * 128 * 4` fits),
//! with `sdot` where the CPU has it, or with `smmla` on two weight rows by two activation rows.

use std::arch::aarch64::*;
use std::arch::asm;

use super::{Kernel, GROUP, Q4K_BYTES, Q6K_BYTES, Q8K_BYTES};
use crate::f16::to_f32;

/// How a variant forms the scaled integer sums of one sub-block: `acc + s * (w · a)` summed
/// over the lanes (which products land in which lane is free: only the lane total is used).
trait Sums {
    /// 32 quants in `w0, w1` against `a0, a1`.
    unsafe fn sub32(
        acc: int32x4_t,
        w0: int8x16_t,
        w1: int8x16_t,
        a0: int8x16_t,
        a1: int8x16_t,
        s: i16,
    ) -> int32x4_t;
    /// 16 quants.
    unsafe fn sub16(acc: int32x4_t, w: int8x16_t, a: int8x16_t, s: i16) -> int32x4_t;
}

/// Plain NEON: products widened to 16 bits, then scaled and widened to 32.
struct Neon;

impl Sums for Neon {
    #[inline(always)]
    unsafe fn sub32(
        acc: int32x4_t,
        w0: int8x16_t,
        w1: int8x16_t,
        a0: int8x16_t,
        a1: int8x16_t,
        s: i16,
    ) -> int32x4_t {
        // 4 products of a 4-bit quant and an `i8` per 16-bit lane: |sum| <= 4 * 15 * 128.
        let mut p = vmull_s8(vget_low_s8(w0), vget_low_s8(a0));
        p = vmlal_high_s8(p, w0, a0);
        p = vmlal_s8(p, vget_low_s8(w1), vget_low_s8(a1));
        p = vmlal_high_s8(p, w1, a1);
        vmlal_high_n_s16(vmlal_n_s16(acc, vget_low_s16(p), s), p, s)
    }

    #[inline(always)]
    unsafe fn sub16(acc: int32x4_t, w: int8x16_t, a: int8x16_t, s: i16) -> int32x4_t {
        let p = vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(a)), w, a);
        vmlal_high_n_s16(vmlal_n_s16(acc, vget_low_s16(p), s), p, s)
    }
}

/// `acc + w · a` by groups of 4 bytes (`sdot`; its intrinsic is not stable Rust).
///
/// # Safety
/// The CPU has FEAT_DotProd; only called from functions compiled with `dotprod`.
#[inline(always)]
unsafe fn sdot(mut acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    asm!("sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b", acc = inout(vreg) acc, w = in(vreg) w,
        a = in(vreg) a, options(pure, nomem, nostack));
    acc
}

/// `acc + w · aᵀ` for two rows of 8 bytes each (`smmla`): lanes `[w0·a0, w0·a1, w1·a0,
/// w1·a1]`.
///
/// # Safety
/// The CPU has FEAT_I8MM; only called from functions compiled with `i8mm`.
#[inline(always)]
unsafe fn smmla(mut acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    asm!("smmla {acc:v}.4s, {w:v}.16b, {a:v}.16b", acc = inout(vreg) acc, w = in(vreg) w,
        a = in(vreg) a, options(pure, nomem, nostack));
    acc
}

/// `sdot` into a fresh sum, scaled once per sub-block.
struct Sdot;

impl Sums for Sdot {
    #[inline(always)]
    unsafe fn sub32(
        acc: int32x4_t,
        w0: int8x16_t,
        w1: int8x16_t,
        a0: int8x16_t,
        a1: int8x16_t,
        s: i16,
    ) -> int32x4_t {
        let p = sdot(sdot(vdupq_n_s32(0), w0, a0), w1, a1);
        vmlaq_n_s32(acc, p, i32::from(s))
    }

    #[inline(always)]
    unsafe fn sub16(acc: int32x4_t, w: int8x16_t, a: int8x16_t, s: i16) -> int32x4_t {
        vmlaq_n_s32(acc, sdot(vdupq_n_s32(0), w, a), i32::from(s))
    }
}

/// `out[i * ys.len() + r]` = weight row i (of `nb` `Q4_K` super-blocks in `w`) · `ys[r]`.
///
/// # Safety
/// `k`'s features are the CPU's; every activation row holds `nb` `Q8_K` super-blocks; `w` is
/// whole rows; `out` has one value per weight row and activation row.
pub(super) unsafe fn q4k(k: &Kernel, ys: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    if k.i8mm {
        q4k_i8mm(ys, nb, w, out)
    } else if k.sdot {
        q4k_sdot(ys, nb, w, out)
    } else {
        q4k_neon(ys, nb, w, out)
    }
}

/// As [`q4k`], for `Q6_K` weights.
///
/// # Safety
/// As [`q4k`].
pub(super) unsafe fn q6k(k: &Kernel, ys: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    if k.i8mm {
        q6k_i8mm(ys, nb, w, out)
    } else if k.sdot {
        q6k_sdot(ys, nb, w, out)
    } else {
        q6k_neon(ys, nb, w, out)
    }
}

/// The one-weight-row entry points for one [`Sums`] and the features it needs.
macro_rules! entries {
    ($features:literal, $sums:ty, $q4k:ident, $q6k:ident) => {
        /// [`q4k`] with these integer sums.
        #[target_feature(enable = $features)]
        unsafe fn $q4k(ys: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
            super::by_groups::<GROUP>(ys, nb, w, Q4K_BYTES, out, |ys, x, o| match ys.len() {
                1 => q4k_rows::<$sums, 1>(ys, nb, x, o),
                2 => q4k_rows::<$sums, 2>(ys, nb, x, o),
                3 => q4k_rows::<$sums, 3>(ys, nb, x, o),
                _ => q4k_rows::<$sums, 4>(ys, nb, x, o),
            })
        }

        /// [`q6k`] with these integer sums.
        #[target_feature(enable = $features)]
        unsafe fn $q6k(ys: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
            super::by_groups::<GROUP>(ys, nb, w, Q6K_BYTES, out, |ys, x, o| match ys.len() {
                1 => q6k_rows::<$sums, 1>(ys, nb, x, o),
                2 => q6k_rows::<$sums, 2>(ys, nb, x, o),
                3 => q6k_rows::<$sums, 3>(ys, nb, x, o),
                _ => q6k_rows::<$sums, 4>(ys, nb, x, o),
            })
        }
    };
}

entries!("neon", Neon, q4k_neon, q6k_neon);
entries!("neon,dotprod", Sdot, q4k_sdot, q6k_sdot);

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    to_f32(u16::from_le_bytes([*p, *p.add(1)]))
}

#[inline(always)]
unsafe fn f32_at(p: *const u8) -> f32 {
    std::ptr::read_unaligned(p.cast::<f32>())
}

/// `Q4_K`'s 8 scales and 8 mins (6 bits each) from the 12 packed bytes at `p`, as ggml's NEON
/// code unpacks them.
#[inline(always)]
unsafe fn q4k_scales(p: *const u8) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [0u32; 3];
    std::ptr::copy_nonoverlapping(p, u.as_mut_ptr().cast::<u8>(), 12);
    let u = u.map(u32::from_le);
    let sc = [
        u[0] & KMASK1,
        (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4),
    ];
    let mins = [
        u[1] & KMASK1,
        ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4),
    ];
    let bytes = |v: [u32; 2]| {
        let (a, b) = (v[0].to_le_bytes(), v[1].to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    (bytes(sc), bytes(mins))
}

/// `Q4_K`'s mins term: `Σ mins[k] * (bsums[2k] + bsums[2k + 1])` for the `Q8_K` block at `y`.
#[inline(always)]
unsafe fn q4k_mins(mins: int16x8_t, y: *const u8) -> i32 {
    let q8sums = vpaddq_s16(vld1q_s16(y.add(260).cast()), vld1q_s16(y.add(276).cast()));
    let prod = vmlal_high_s16(
        vmull_s16(vget_low_s16(q8sums), vget_low_s16(mins)),
        q8sums,
        mins,
    );
    vaddvq_s32(prod)
}

/// `Q6_K`'s `Σ scales[k] * bsums[k]` for the `Q8_K` block at `y`.
#[inline(always)]
unsafe fn q6k_mins(sc: [int16x8_t; 2], y: *const u8) -> i32 {
    let (b0, b1) = (vld1q_s16(y.add(260).cast()), vld1q_s16(y.add(276).cast()));
    let mut p = vmull_s16(vget_low_s16(b0), vget_low_s16(sc[0]));
    p = vmlal_high_s16(p, b0, sc[0]);
    p = vmlal_s16(p, vget_low_s16(b1), vget_low_s16(sc[1]));
    p = vmlal_high_s16(p, b1, sc[1]);
    vaddvq_s32(p)
}

/// One `Q4_K` weight row (at `x`) against `R` activation rows.
#[inline(always)]
unsafe fn q4k_rows<S: Sums, const R: usize>(
    ys: &[*const u8],
    nb: usize,
    x: *const u8,
    out: &mut [f32],
) {
    let m4 = vdupq_n_u8(0xf);
    let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
    let mut sum = [0.0f32; R];
    for sb in 0..nb {
        let x = x.add(sb * Q4K_BYTES);
        let (xd, xdmin) = (f16_at(x), f16_at(x.add(2)));
        let (sc, mins) = q4k_scales(x.add(4));
        let mins = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mins.as_ptr())));
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
        let mut acc = [vdupq_n_s32(0); R];
        let q4 = x.add(16);
        for j in 0..4 {
            let (b0, b1) = (vld1q_u8(q4.add(32 * j)), vld1q_u8(q4.add(32 * j + 16)));
            let lo = [vandq_u8(b0, m4), vandq_u8(b1, m4)].map(|v| vreinterpretq_s8_u8(v));
            let hi = [vshrq_n_u8(b0, 4), vshrq_n_u8(b1, 4)].map(|v| vreinterpretq_s8_u8(v));
            let (sl, sh) = (i16::from(sc[2 * j]), i16::from(sc[2 * j + 1]));
            for r in 0..R {
                let q8 = ys[r].add(4 + 64 * j).cast::<i8>();
                let a = [0, 16, 32, 48].map(|o| vld1q_s8(q8.add(o)));
                acc[r] = S::sub32(acc[r], lo[0], lo[1], a[0], a[1], sl);
                acc[r] = S::sub32(acc[r], hi[0], hi[1], a[2], a[3], sh);
            }
        }
        for r in 0..R {
            let yd = f32_at(ys[r]);
            let (d, dmin) = (yd * xd, yd * xdmin);
            sum[r] = (-dmin).mul_add(q4k_mins(mins, ys[r]) as f32, sum[r]);
            sum[r] = d.mul_add(vaddvq_s32(acc[r]) as f32, sum[r]);
        }
    }
    out[..R].copy_from_slice(&sum);
}

/// `Q6_K`'s 6-bit quants `128h + 32g + 16t .. + 16` (for `g` in 0..4, `t` in 0..2) of the half
/// `h` whose low bits are `ql` (64 bytes) and high bits `qh` (32 bytes).
#[inline(always)]
unsafe fn q6k_half(ql: *const u8, qh: *const u8) -> [[int8x16_t; 2]; 4] {
    let (m4, m3) = (vdupq_n_u8(0xf), vdupq_n_u8(3));
    let h = [vld1q_u8(qh), vld1q_u8(qh.add(16))];
    let l = [0, 16, 32, 48].map(|o| vld1q_u8(ql.add(o)));
    let high = |t: usize, g: i32| -> uint8x16_t {
        let v = match g {
            0 => h[t],
            1 => vshrq_n_u8(h[t], 2),
            2 => vshrq_n_u8(h[t], 4),
            _ => vshrq_n_u8(h[t], 6),
        };
        vshlq_n_u8(vandq_u8(v, m3), 4)
    };
    let q = |g: usize, t: usize| {
        let low = l[2 * (g % 2) + t];
        let low = if g < 2 {
            vandq_u8(low, m4)
        } else {
            vshrq_n_u8(low, 4)
        };
        vreinterpretq_s8_u8(vorrq_u8(low, high(t, g as i32)))
    };
    std::array::from_fn(|g| [q(g, 0), q(g, 1)])
}

/// One `Q6_K` weight row (at `x`) against `R` activation rows.
#[inline(always)]
unsafe fn q6k_rows<S: Sums, const R: usize>(
    ys: &[*const u8],
    nb: usize,
    x: *const u8,
    out: &mut [f32],
) {
    let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
    let mut sum = [0.0f32; R];
    for sb in 0..nb {
        let x = x.add(sb * Q6K_BYTES);
        let xd = f16_at(x.add(208));
        let scales = vld1q_s8(x.add(192).cast());
        let sc16 = [vmovl_s8(vget_low_s8(scales)), vmovl_high_s8(scales)];
        let mut sc = [0i16; 16];
        vst1q_s16(sc.as_mut_ptr(), sc16[0]);
        vst1q_s16(sc.as_mut_ptr().add(8), sc16[1]);
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
        let mut acc = [vdupq_n_s32(0); R];
        for h in 0..2 {
            let q = q6k_half(x.add(64 * h), x.add(128 + 32 * h));
            for (g, q) in q.iter().enumerate() {
                for (t, &q) in q.iter().enumerate() {
                    let s = sc[8 * h + 2 * g + t];
                    for r in 0..R {
                        let a = vld1q_s8(ys[r].add(4 + 128 * h + 32 * g + 16 * t).cast());
                        acc[r] = S::sub16(acc[r], q, a, s);
                    }
                }
            }
        }
        for r in 0..R {
            let isum = vaddvq_s32(acc[r]).wrapping_sub(q6k_mins(sc16, ys[r]).wrapping_mul(32));
            sum[r] = (xd * f32_at(ys[r])).mul_add(isum as f32, sum[r]);
        }
    }
    out[..R].copy_from_slice(&sum);
}

/// [`q4k`] with `smmla`: two weight rows by two activation rows at a time.
#[target_feature(enable = "neon,dotprod,i8mm")]
unsafe fn q4k_i8mm(ys: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    by_pairs(ys, nb, w, Q4K_BYTES, out, |xs, ys, o| match ys.len() {
        1 => q4k_mm::<1>(xs, ys, nb, o),
        _ => q4k_mm::<2>(xs, ys, nb, o),
    })
}

/// [`q6k`] with `smmla`.
#[target_feature(enable = "neon,dotprod,i8mm")]
unsafe fn q6k_i8mm(ys: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    by_pairs(ys, nb, w, Q6K_BYTES, out, |xs, ys, o| match ys.len() {
        1 => q6k_mm::<1>(xs, ys, nb, o),
        _ => q6k_mm::<2>(xs, ys, nb, o),
    })
}

/// Calls `f(2 weight rows, pairs of activation rows, results)` for every pair of weight rows
/// of `w` (`nb` super-blocks of `block` bytes) and every 2 pairs of activation rows (of up to
/// [`GROUP`] rows), then stores result `[p][2 * wi + ai]` (weight row `wi` of the pair against
/// row `ai` of activation pair `p`). An odd last row on either side is paired with itself
/// and its copy's results dropped.
#[inline(always)]
unsafe fn by_pairs(
    rows: &[&[u8]],
    nb: usize,
    w: &[u8],
    block: usize,
    out: &mut [f32],
    f: impl Fn([*const u8; 2], &[[*const u8; 2]], &mut [[f32; 4]; GROUP / 2]),
) {
    let m = rows.len();
    let wr: Vec<*const u8> = w.chunks_exact(nb * block).map(<[u8]>::as_ptr).collect();
    let n = wr.len();
    let mut res = [[0.0f32; 4]; GROUP / 2];
    for g0 in (0..m).step_by(GROUP) {
        let gl = (m - g0).min(GROUP);
        let pairs: [[*const u8; 2]; GROUP / 2] = std::array::from_fn(|p| {
            let r = (g0 + 2 * p).min(m - 1);
            [rows[r].as_ptr(), rows[(r + 1).min(m - 1)].as_ptr()]
        });
        for i in (0..n).step_by(2) {
            f(
                [wr[i], wr[(i + 1).min(n - 1)]],
                &pairs[..gl.div_ceil(2)],
                &mut res,
            );
            for wi in 0..2.min(n - i) {
                for a in 0..gl {
                    out[(i + wi) * m + g0 + a] = res[a / 2][2 * wi + a % 2];
                }
            }
        }
    }
}

/// `[w0[..8] | w1[..8]]` and `[w0[8..] | w1[8..]]`: two rows' 8-byte runs side by side, as
/// `smmla` takes them.
#[inline(always)]
unsafe fn zip64(w0: int8x16_t, w1: int8x16_t) -> [int8x16_t; 2] {
    let (a, b) = (vreinterpretq_s64_s8(w0), vreinterpretq_s64_s8(w1));
    [vzip1q_s64(a, b), vzip2q_s64(a, b)].map(|v| vreinterpretq_s8_s64(v))
}

/// Two weight rows' 32 quants (`[row][half]`) as [`zip64`] pairs, in quant order.
#[inline(always)]
unsafe fn zip_rows(q: [[uint8x16_t; 2]; 2]) -> [int8x16_t; 4] {
    let [a0, a1] = zip64(vreinterpretq_s8_u8(q[0][0]), vreinterpretq_s8_u8(q[1][0]));
    let [b0, b1] = zip64(vreinterpretq_s8_u8(q[0][1]), vreinterpretq_s8_u8(q[1][1]));
    [a0, a1, b0, b1]
}

/// `acc + s * Σ smmla(w[k], a[k])`: the 2 x 2 products of a sub-block, scaled by `s` (the
/// weight rows' scales, `[s0, s0, s1, s1]`).
#[inline(always)]
unsafe fn mm_sub(acc: int32x4_t, w: &[int8x16_t], a: &[int8x16_t], s: int32x4_t) -> int32x4_t {
    let mut p = vdupq_n_s32(0);
    for (&w, &a) in w.iter().zip(a) {
        p = smmla(p, w, a);
    }
    vmlaq_s32(acc, p, s)
}

/// `[s0, s0, s1, s1]`.
#[inline(always)]
unsafe fn pair_scale(s0: i32, s1: i32) -> int32x4_t {
    vld1q_s32([s0, s0, s1, s1].as_ptr())
}

/// Two `Q4_K` weight rows (at `xs`) against `P` pairs of activation rows:
/// `out[p][2 * wi + ai]`.
#[inline(always)]
unsafe fn q4k_mm<const P: usize>(
    xs: [*const u8; 2],
    ys: &[[*const u8; 2]],
    nb: usize,
    out: &mut [[f32; 4]; GROUP / 2],
) {
    let m4 = vdupq_n_u8(0xf);
    let ys: [[*const u8; 2]; P] = std::array::from_fn(|p| ys[p]);
    let mut sum = [[0.0f32; 4]; P];
    for sb in 0..nb {
        let xs = xs.map(|x| x.add(sb * Q4K_BYTES));
        let xd = xs.map(|x| f16_at(x));
        let xdmin = xs.map(|x| f16_at(x.add(2)));
        let unpacked = xs.map(|x| q4k_scales(x.add(4)));
        let mins = unpacked.map(|(_, m)| vreinterpretq_s16_u16(vmovl_u8(vld1_u8(m.as_ptr()))));
        let sc = unpacked.map(|(s, _)| s.map(i32::from));
        let ys: [[*const u8; 2]; P] = ys.map(|y| y.map(|y| y.add(sb * Q8K_BYTES)));
        let mut acc = [vdupq_n_s32(0); P];
        for j in 0..4 {
            let b = xs.map(|x| {
                let q4 = x.add(16 + 32 * j);
                [vld1q_u8(q4), vld1q_u8(q4.add(16))]
            });
            let lo = zip_rows(b.map(|b| b.map(|v| vandq_u8(v, m4))));
            let hi = zip_rows(b.map(|b| b.map(|v| vshrq_n_u8(v, 4))));
            let sl = pair_scale(sc[0][2 * j], sc[1][2 * j]);
            let sh = pair_scale(sc[0][2 * j + 1], sc[1][2 * j + 1]);
            for p in 0..P {
                let a =
                    ys[p].map(|y| [0, 16, 32, 48].map(|o| vld1q_s8(y.add(4 + 64 * j + o).cast())));
                let al = [zip64(a[0][0], a[1][0]), zip64(a[0][1], a[1][1])];
                let ah = [zip64(a[0][2], a[1][2]), zip64(a[0][3], a[1][3])];
                acc[p] = mm_sub(acc[p], &lo, al.as_flattened(), sl);
                acc[p] = mm_sub(acc[p], &hi, ah.as_flattened(), sh);
            }
        }
        for p in 0..P {
            let mut isum = [0i32; 4];
            vst1q_s32(isum.as_mut_ptr(), acc[p]);
            for (l, s) in sum[p].iter_mut().enumerate() {
                let (wi, y) = (l / 2, ys[p][l % 2]);
                let yd = f32_at(y);
                let (d, dmin) = (yd * xd[wi], yd * xdmin[wi]);
                *s = (-dmin).mul_add(q4k_mins(mins[wi], y) as f32, *s);
                *s = d.mul_add(isum[l] as f32, *s);
            }
        }
    }
    out[..P].copy_from_slice(&sum);
}

/// Two `Q6_K` weight rows (at `xs`) against `P` pairs of activation rows:
/// `out[p][2 * wi + ai]`.
#[inline(always)]
unsafe fn q6k_mm<const P: usize>(
    xs: [*const u8; 2],
    ys: &[[*const u8; 2]],
    nb: usize,
    out: &mut [[f32; 4]; GROUP / 2],
) {
    let ys: [[*const u8; 2]; P] = std::array::from_fn(|p| ys[p]);
    let mut sum = [[0.0f32; 4]; P];
    for sb in 0..nb {
        let xs = xs.map(|x| x.add(sb * Q6K_BYTES));
        let xd = xs.map(|x| f16_at(x.add(208)));
        let sc16 = xs.map(|x| {
            let s = vld1q_s8(x.add(192).cast());
            [vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s)]
        });
        let sc =
            xs.map(|x| std::array::from_fn::<i32, 16, _>(|k| i32::from(*x.add(192 + k) as i8)));
        let ys: [[*const u8; 2]; P] = ys.map(|y| y.map(|y| y.add(sb * Q8K_BYTES)));
        let mut acc = [vdupq_n_s32(0); P];
        for h in 0..2 {
            let q = xs.map(|x| q6k_half(x.add(64 * h), x.add(128 + 32 * h)));
            for g in 0..4 {
                for t in 0..2 {
                    let k = 8 * h + 2 * g + t;
                    let wq = zip64(q[0][g][t], q[1][g][t]);
                    let s = pair_scale(sc[0][k], sc[1][k]);
                    for p in 0..P {
                        let at = 4 + 128 * h + 32 * g + 16 * t;
                        let a = ys[p].map(|y| vld1q_s8(y.add(at).cast()));
                        acc[p] = mm_sub(acc[p], &wq, &zip64(a[0], a[1]), s);
                    }
                }
            }
        }
        for p in 0..P {
            let mut isum = [0i32; 4];
            vst1q_s32(isum.as_mut_ptr(), acc[p]);
            for (l, s) in sum[p].iter_mut().enumerate() {
                let (wi, y) = (l / 2, ys[p][l % 2]);
                let isum = isum[l].wrapping_sub(q6k_mins(sc16[wi], y).wrapping_mul(32));
                *s = (xd[wi] * f32_at(y)).mul_add(isum as f32, *s);
            }
        }
    }
    out[..P].copy_from_slice(&sum);
}

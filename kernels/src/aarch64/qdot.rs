//! NEON kernels for the 32-weight block types (`Q8_0`, `Q5_0` x `Q8_0`; `Q4_1` x `Q8_1`):
//! ggml's ARM `vec_dot` arithmetic (nrc = 1), one weight block unpacked once for several rows.
//!
//! ggml sums each block's 32 products into 4 `i32` lanes, turns them into `f32`, multiplies
//! by the scale product and adds (unfused) into `sumv0` for the first block of a pair and
//! `sumv1` for the second; an odd last block goes through a scalar fused multiply-add (see
//! [`crate::reference`]). Which products share a lane depends on how that ggml was built:
//! without dotprod, lane l holds the elements `16h + {2l, 2l+1, 2l+8, 2l+9}` (`smull` +
//! `saddlp`); with it, `16h + 4l..4l+3` (`sdot`). Each integer method here has its own natural
//! grouping; to get the other one, the weights (per block, once for all rows) and the
//! activations (once, in [`super::Kernel::prepare`]) are permuted alike within each 16 bytes,
//! which moves the right products into each lane without changing any of them.
//!
//! `smmla` (i8mm) is not used: it sums 8 consecutive bytes of two rows against two rows, and
//! with one weight row at a time half of its products would be wasted.

// Accumulators are indexed by row inside fully unrolled constant-length loops.
#![allow(clippy::needless_range_loop)]

use super::{Acts, Kernel, Kind};

/// `new[i] = old[P[i]]` puts ggml's emulated lanes (`{2l, 2l+1, 2l+8, 2l+9}`) where `sdot`
/// sums (`4l..4l+3`).
const TO_SDOT: [u8; 16] = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15];
/// The inverse: puts `vdotq_s32`'s lanes (`4l..4l+3`) where `smull` + `saddlp` sum.
const TO_PAIRS: [u8; 16] = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15];

/// The byte permutation (applied to each 16 bytes of a block's weights and activations) that
/// makes kernel `k`'s integer lanes the ones of the ggml it matches, if they differ.
pub(super) fn permutation(k: &Kernel) -> Option<&'static [u8; 16]> {
    match (k.sdot, k.ggml_dotprod) {
        (true, false) => Some(&TO_SDOT),
        (false, true) => Some(&TO_PAIRS),
        _ => None,
    }
}

/// Weight-stationary products of every weight row in `w` with every row of `acts`.
///
/// # Safety
/// `k` must be a kernel for this CPU (`sdot` only where it has dotprod), `acts` prepared by a
/// kernel with the same `sdot` and `ggml_dotprod`, and `w` and `out` whole rows as
/// [`Kernel::dot_many`] checks.
pub(super) unsafe fn many(k: &Kernel, acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
    let perm = permutation(k);
    if perm.is_some() {
        assert_eq!(
            acts.qs.len(),
            acts.rows.len() * acts.nb * 32,
            "activations prepared for another kernel variant"
        );
    }
    if k.kind == Kind::Q4_1 {
        assert_eq!(
            acts.sums.len(),
            acts.scales.len(),
            "activation sums missing"
        );
    }
    // SAFETY: the caller's contract; `sdot` is only set when the CPU has dotprod.
    unsafe {
        match (k.kind, k.sdot) {
            (Kind::Q8_0, false) => plain::many::<Q8_0>(acts, perm, w, out),
            (Kind::Q5_0, false) => plain::many::<Q5_0>(acts, perm, w, out),
            (Kind::Q4_1, false) => plain::many::<Q4_1>(acts, perm, w, out),
            (Kind::Q8_0, true) => sdot::many::<Q8_0>(acts, perm, w, out),
            (Kind::Q5_0, true) => sdot::many::<Q5_0>(acts, perm, w, out),
            (Kind::Q4_1, true) => sdot::many::<Q4_1>(acts, perm, w, out),
            (Kind::Q4K | Kind::Q6K, _) => unreachable!("k-quants have their own kernels"),
        }
    }
}

/// Weight types as const parameters, so each kernel is compiled for one.
const Q8_0: u8 = 0;
const Q5_0: u8 = 1;
const Q4_1: u8 = 2;

/// The kernels, once per integer method: `$lanes::<T>(x, y)` sums a block's 32 products into
/// 4 `i32` lanes (its natural grouping; see the module docs).
macro_rules! kernels {
    ($name:ident, $feat:literal, $lanes:ident) => {
        mod $name {
            use super::{Q4_1, Q5_0, Q8_0};
            use crate::qdot::{Acts, Kind, GROUP};
            use std::arch::aarch64::*;

            const KINDS: [Kind; 3] = [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1];

            /// A weight block's 32 values as bytes (elements 0..15, 16..31), each 16 permuted
            /// by `perm` when set.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn weights<const T: u8>(
                x: *const u8,
                perm: Option<uint8x16_t>,
            ) -> [int8x16_t; 2] {
                let v = match T {
                    Q8_0 => [vld1q_s8(x.add(2).cast()), vld1q_s8(x.add(18).cast())],
                    Q5_0 => {
                        let nib = vld1q_u8(x.add(6));
                        let qh = vreinterpretq_u8_u32(vdupq_n_u32(u32::from_le_bytes([
                            *x.add(2),
                            *x.add(3),
                            *x.add(4),
                            *x.add(5),
                        ])));
                        // Element j's fifth bit is bit j % 8 of qh's byte j / 8; where it is
                        // clear the value is nibble - 16, i.e. 0xF0 | nibble (ggml's
                        // `table_b2b_1` subtraction gives the same bytes).
                        const BIT: [u8; 16] =
                            [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
                        const LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
                        const HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
                        let bit = vld1q_u8(BIT.as_ptr());
                        let f0 = vdupq_n_u8(0xF0);
                        let set_lo = vtstq_u8(vqtbl1q_u8(qh, vld1q_u8(LO.as_ptr())), bit);
                        let set_hi = vtstq_u8(vqtbl1q_u8(qh, vld1q_u8(HI.as_ptr())), bit);
                        let lo = vorrq_u8(vandq_u8(nib, vdupq_n_u8(0x0F)), vbicq_u8(f0, set_lo));
                        let hi = vorrq_u8(vshrq_n_u8(nib, 4), vbicq_u8(f0, set_hi));
                        [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)]
                    }
                    _ => {
                        let nib = vld1q_u8(x.add(4));
                        [
                            vreinterpretq_s8_u8(vandq_u8(nib, vdupq_n_u8(0x0F))),
                            vreinterpretq_s8_u8(vshrq_n_u8(nib, 4)),
                        ]
                    }
                };
                match perm {
                    Some(p) => [vqtbl1q_s8(v[0], p), vqtbl1q_s8(v[1], p)],
                    None => v,
                }
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn f16(p: *const u8) -> f32 {
                crate::f16::to_f32(u16::from_le_bytes([*p, *p.add(1)]))
            }

            /// ggml's `vaddvq_f32` as gcc emits it: `(l0 + l1) + (l2 + l3)`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn addv(v: float32x4_t) -> f32 {
                vpadds_f32(vget_low_f32(vpaddq_f32(v, v)))
            }

            /// Block `b` of one weight row (at `xb`) against K activation rows, added to
            /// `acc` as ggml's `vmlaq_n_f32` does: a multiply, then an add (unfused).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn block<const T: u8, const K: usize>(
                b: usize,
                xb: *const u8,
                perm: Option<uint8x16_t>,
                y: &[*const u8; K],
                ys: usize,
                yd: &[*const f32; K],
                acc: &mut [float32x4_t; K],
            ) {
                let qx = weights::<T>(xb, perm);
                let dx = f16(xb);
                for r in 0..K {
                    let q = y[r].add(b * ys);
                    let qy = [vld1q_s8(q.cast()), vld1q_s8(q.add(16).cast())];
                    let l = vcvtq_f32_s32(super::$lanes::<T>(qx, qy));
                    acc[r] = vaddq_f32(acc[r], vmulq_n_f32(l, dx * *yd[r].add(b)));
                }
            }

            /// One weight row against K activation rows: `y[r]` is row r's first block's 32
            /// quants, blocks `ys` bytes apart; `yd[r]`, `ysum[r]` its block scales and (Q4_1)
            /// sums as `f32`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn group<const T: u8, const K: usize>(
                nb: usize,
                perm: Option<uint8x16_t>,
                x: *const u8,
                y: [*const u8; K],
                ys: usize,
                yd: [*const f32; K],
                ysum: [*const f32; K],
                out: *mut f32,
            ) {
                let wb = KINDS[usize::from(T)].weight_block();
                let (mut sumv0, mut sumv1) = ([vdupq_n_f32(0.0); K], [vdupq_n_f32(0.0); K]);
                let mut summs = [0.0f32; K];
                for b in (0..nb / 2 * 2).step_by(2) {
                    let xb = x.add(b * wb);
                    block::<T, K>(b, xb, perm, &y, ys, &yd, &mut sumv0);
                    block::<T, K>(b + 1, xb.add(wb), perm, &y, ys, &yd, &mut sumv1);
                    if T == Q4_1 {
                        let (m0, m1) = (f16(xb.add(2)), f16(xb.add(wb + 2)));
                        for r in 0..K {
                            // Both products are exact: one rounding, as ggml's fused form.
                            summs[r] += m0 * *ysum[r].add(b) + m1 * *ysum[r].add(b + 1);
                        }
                    }
                }
                let mut sumf = [0.0f32; K];
                for r in 0..K {
                    sumf[r] = addv(sumv0[r]) + addv(sumv1[r]);
                    if T == Q4_1 {
                        sumf[r] += summs[r];
                    }
                }
                if nb % 2 == 1 {
                    // ggml's scalar tail: one fused multiply-add of the whole block's sum.
                    let b = nb - 1;
                    let xb = x.add(b * wb);
                    let qx = weights::<T>(xb, perm);
                    let dx = f16(xb);
                    for r in 0..K {
                        let q = y[r].add(b * ys);
                        let qy = [vld1q_s8(q.cast()), vld1q_s8(q.add(16).cast())];
                        let sumi = vaddvq_s32(super::$lanes::<T>(qx, qy)) as f32;
                        let d = dx * *yd[r].add(b);
                        sumf[r] = if T == Q4_1 {
                            sumf[r] + d.mul_add(sumi, f16(xb.add(2)) * *ysum[r].add(b))
                        } else {
                            sumi.mul_add(d, sumf[r])
                        };
                    }
                }
                for r in 0..K {
                    *out.add(r) = sumf[r];
                }
            }

            /// [`group`] on the first K of the rows given (as slices).
            #[inline]
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn rows<const T: u8, const K: usize>(
                nb: usize,
                perm: Option<uint8x16_t>,
                x: *const u8,
                y: &[*const u8],
                ys: usize,
                yd: &[*const f32],
                ysum: &[*const f32],
                out: *mut f32,
            ) {
                let (y, yd, ysum) = (
                    std::array::from_fn(|j| y[j]),
                    std::array::from_fn(|j| yd[j]),
                    std::array::from_fn(|j| ysum[j]),
                );
                group::<T, K>(nb, perm, x, y, ys, yd, ysum, out)
            }

            #[target_feature(enable = $feat)]
            pub(super) unsafe fn many<const T: u8>(
                acts: &Acts<'_>,
                perm: Option<&[u8; 16]>,
                w: &[u8],
                out: &mut [f32],
            ) {
                let kind = KINDS[usize::from(T)];
                let (nb, k) = (acts.nb, acts.rows.len());
                let row = nb * kind.weight_block();
                let ab = kind.act_block();
                // The activations' quants: permuted copies (32 bytes a block) or in place.
                let (y, ys): (Vec<*const u8>, usize) = if perm.is_some() {
                    let q = acts.qs.as_ptr();
                    ((0..k).map(|r| q.add(r * nb * 32)).collect(), 32)
                } else {
                    (
                        acts.rows.iter().map(|a| a.as_ptr().add(ab - 32)).collect(),
                        ab,
                    )
                };
                let yd: Vec<*const f32> =
                    (0..k).map(|r| acts.scales.as_ptr().add(r * nb)).collect();
                // Only read for Q4_1, whose `sums` `many` checked.
                let ysum: Vec<*const f32> = (0..k)
                    .map(|r| acts.sums.as_ptr().wrapping_add(r * nb))
                    .collect();
                let perm = perm.map(|p| vld1q_u8(p.as_ptr()));
                for (i, o) in out.chunks_exact_mut(k).enumerate() {
                    let x = w.as_ptr().add(i * row);
                    let mut r = 0;
                    while r < k {
                        let o = o.as_mut_ptr().add(r);
                        let (y, yd, ysum) = (&y[r..], &yd[r..], &ysum[r..]);
                        // K constant in each arm so the accumulators stay in registers.
                        match k - r {
                            1 => rows::<T, 1>(nb, perm, x, y, ys, yd, ysum, o),
                            2 => rows::<T, 2>(nb, perm, x, y, ys, yd, ysum, o),
                            3 => rows::<T, 3>(nb, perm, x, y, ys, yd, ysum, o),
                            _ => rows::<T, GROUP>(nb, perm, x, y, ys, yd, ysum, o),
                        }
                        r += GROUP;
                    }
                }
            }
        }
    };
}

use std::arch::aarch64::*;

/// A block's products summed as ggml's `ggml_vdotq_s32` emulation does: lane l holds elements
/// `16h + {2l, 2l+1, 2l+8, 2l+9}`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn pairs<const T: u8>(x: [int8x16_t; 2], y: [int8x16_t; 2]) -> int32x4_t {
    if T == Q8_0 {
        // Two products of -128 * -128 overflow an i16: widen each product pair at once.
        let mut acc = vpaddlq_s16(vmull_s8(vget_low_s8(x[0]), vget_low_s8(y[0])));
        acc = vpadalq_s16(acc, vmull_high_s8(x[0], y[0]));
        acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(x[1]), vget_low_s8(y[1])));
        vpadalq_s16(acc, vmull_high_s8(x[1], y[1]))
    } else {
        // Weights within -16..15: four products (at most 4 * 16 * 128) fit an i16.
        let mut p = vmull_s8(vget_low_s8(x[0]), vget_low_s8(y[0]));
        p = vmlal_high_s8(p, x[0], y[0]);
        p = vmlal_s8(p, vget_low_s8(x[1]), vget_low_s8(y[1]));
        p = vmlal_high_s8(p, x[1], y[1]);
        vpaddlq_s16(p)
    }
}

/// `sdot`: lane l += the products of bytes 4l..4l+3 (the intrinsic is not stable yet).
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot_acc(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: register-only instruction, available by this function's target feature.
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// A block's products summed by `sdot`: lane l holds elements `16h + 4l..4l+3`.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn quads<const T: u8>(x: [int8x16_t; 2], y: [int8x16_t; 2]) -> int32x4_t {
    sdot_acc(sdot_acc(vdupq_n_s32(0), x[0], y[0]), x[1], y[1])
}

kernels!(plain, "neon", pairs);
kernels!(sdot, "neon,dotprod", quads);

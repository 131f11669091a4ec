//! The AArch64 kernel, NEON only: what ggml's armv8-a build (no FP16 vector arithmetic, no
//! SVE) computes in `ggml_vec_dot_f16`. There `GGML_F16_VEC` is `float32x4_t`: steps of 16,
//! four 4-lane sums, each 4 halves widened (`fcvtl`) and accumulated with fused multiply-adds
//! (`fmla`), reduced as `(s0 + s2) + (s1 + s3)` and then `faddp` twice, the leftovers past the
//! last 16 multiplied in `f32` and added in `f64`. FEAT_FP16's half-precision arithmetic would
//! round differently, and the conversions it needs (`fcvtl`, `fcvt`) are in every AArch64 CPU,
//! so there is one kernel for all of them.
//!
//! ggml's `from_float` for f16 on this build is not the hardware's `fcvt`: `GGML_CPU_FP32_TO_FP16`
//! falls back to `ggml_compute_fp32_to_fp16`, integer and float tricks that gcc compiled with
//! one fused multiply-add; [`fp16_bits`] does the same, 4 lanes at a time (it rounds to
//! nearest even, and makes every NaN `0x7e00` with its sign where `fcvt` would keep the
//! payload). The GEGLU kernel ([`crate::geglu`]) indexes ggml's table with it too.

use std::arch::aarch64::*;
use std::arch::asm;

use super::{Dots, AHEAD_BYTES};

/// ggml's step (see the x86-64 kernels' `STEP`).
pub const STEP: usize = 16;

/// Every AArch64 CPU runs [`dots`]: NEON is part of the target's baseline.
pub fn cpu_ok() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// The kernels this CPU runs, the device's first.
pub fn kernels() -> &'static [Dots] {
    const ALL: &[Dots] = &[dots];
    ALL
}

/// ggml's `ggml_compute_fp32_to_fp16` on each lane of `x` (the half's bits in the low 16 bits
/// of its lane), with the one fused multiply-add gcc made of `base = bias + |x| * 2^112 * 2^-110`.
#[inline(always)]
pub(crate) fn fp16_bits(x: float32x4_t) -> uint32x4_t {
    // SAFETY: NEON is part of the target's baseline; register operations only.
    unsafe {
        let w = vreinterpretq_u32_f32(x);
        let shl1 = vaddq_u32(w, w);
        let sign = vandq_u32(vshrq_n_u32::<16>(w), vdupq_n_u32(0x8000));
        let bias = vmaxq_u32(
            vandq_u32(shl1, vdupq_n_u32(0xff00_0000)),
            vdupq_n_u32(0x7100_0000),
        );
        let scaled = vmulq_f32(vabsq_f32(x), vdupq_n_f32(f32::from_bits(0x7780_0000)));
        let base = vfmaq_f32(
            vreinterpretq_f32_u32(vaddq_u32(vshrq_n_u32::<1>(bias), vdupq_n_u32(0x0780_0000))),
            scaled,
            vdupq_n_f32(f32::from_bits(0x0880_0000)),
        );
        let bits = vreinterpretq_u32_f32(base);
        let nonsign = vaddq_u32(
            vandq_u32(vshrq_n_u32::<13>(bits), vdupq_n_u32(0x7c00)),
            vandq_u32(bits, vdupq_n_u32(0xfff)),
        );
        let nan = vcgtq_u32(shl1, vdupq_n_u32(0xff00_0000));
        vorrq_u32(sign, vbslq_u32(nan, vdupq_n_u32(0x7e00), nonsign))
    }
}

/// Four halves widened to f32 (`fcvtl`, exact; ggml's `vcvt_f32_f16`, which stable Rust has no
/// type for).
#[inline(always)]
pub(crate) fn widen4(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: a register-to-register conversion in every AArch64 CPU.
    unsafe {
        asm!("fcvtl {o:v}.4s, {h:v}.4h", o = out(vreg) out, h = in(vreg) h,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// One half widened to f32 (`fcvt`, ggml's scalar `GGML_CPU_FP16_TO_FP32` on AArch64).
#[inline(always)]
fn widen1(h: u16) -> f32 {
    let out: f32;
    // SAFETY: a register-to-register conversion in every AArch64 CPU.
    unsafe {
        asm!("fcvt {o:s}, {h:h}", o = out(vreg) out, h = in(vreg) h,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// `acc + x * y` fused, with `fmla`'s operands in the order gcc gave ggml's `vfmaq_f32(sum,
/// ax, ay)` (LLVM swaps them otherwise): of two NaNs, `fmla` returns the first.
#[inline(always)]
fn fmla(mut acc: float32x4_t, x: float32x4_t, y: float32x4_t) -> float32x4_t {
    // SAFETY: register arithmetic in every AArch64 CPU.
    unsafe {
        asm!("fmla {a:v}.4s, {x:v}.4s, {y:v}.4s", a = inout(vreg) acc, x = in(vreg) x,
             y = in(vreg) y, options(pure, nomem, nostack, preserves_flags));
    }
    acc
}

/// `y * x` in the operand order gcc gave ggml's leftover products (NaN payloads as there).
#[inline(always)]
fn fmul(y: f32, x: f32) -> f32 {
    let out: f32;
    // SAFETY: register arithmetic in every AArch64 CPU.
    unsafe {
        asm!("fmul {o:s}, {y:s}, {x:s}", o = out(vreg) out, y = in(vreg) y, x = in(vreg) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// `out` = `x` rounded to f16 as ggml's `from_float` does ([`fp16_bits`]) and widened back.
///
/// # Safety
/// [`cpu_ok`]; `out` is at least as long as `x`.
pub unsafe fn round_f16(x: &[f32], out: &mut [f32]) {
    let round = |v: float32x4_t| widen4(vmovn_u32(fp16_bits(v)));
    let mut xs = x.chunks_exact(4);
    for (c, o) in (&mut xs).zip(out.chunks_exact_mut(4)) {
        vst1q_f32(o.as_mut_ptr(), round(vld1q_f32(c.as_ptr())));
    }
    let rest = xs.remainder();
    if !rest.is_empty() {
        let mut buf = [0f32; 4];
        buf[..rest.len()].copy_from_slice(rest);
        vst1q_f32(buf.as_mut_ptr(), round(vld1q_f32(buf.as_ptr())));
        let done = x.len() - rest.len();
        out[done..x.len()].copy_from_slice(&buf[..rest.len()]);
    }
}

/// `sums[i * m + k]` = f16 row i (of `rows` at `x`, `stride` bytes apart) · query row k of `qs`
/// (rows of `n`; `m = sums.len() / rows` of them), ggml's way: each cache row widened once per
/// group of up to four query rows (16 accumulators of NEON's 32 registers), query groups
/// outer, so a group's rows stay in L1 while the block's cache rows come again from L2.
///
/// # Safety
/// `rows` rows of `n` f16 values at `x`.
unsafe fn dots(x: *const u8, stride: usize, rows: usize, qs: &[f32], n: usize, sums: &mut [f32]) {
    // No cache rows (a thread's empty share of a short view): nothing to compute.
    let m = sums.len().checked_div(rows).unwrap_or(0);
    let ahead = (AHEAD_BYTES / (2 * n)).clamp(2, 16);
    let mut k = 0;
    while k < m {
        let g = 4.min(m - k);
        for (i, out) in sums.chunks_exact_mut(m).enumerate() {
            // The first group's pass reads the cache from memory: fetch ahead of it.
            if k == 0 && i + ahead < rows {
                let next = x.add((i + ahead) * stride);
                for l in (0..2 * n).step_by(64) {
                    asm!("prfm pldl1keep, [{p}]", p = in(reg) next.add(l),
                         options(nostack, preserves_flags, readonly));
                }
            }
            let x = std::slice::from_raw_parts(x.add(i * stride).cast::<u16>(), n);
            match g {
                1 => group::<1>(x, qs, n, k, out),
                2 => group::<2>(x, qs, n, k, out),
                3 => group::<3>(x, qs, n, k, out),
                _ => group::<4>(x, qs, n, k, out),
            }
        }
        k += g;
    }
}

/// Query rows `k0..k0 + G` of `qs` against `x` into `sums`.
#[inline(always)]
unsafe fn group<const G: usize>(x: &[u16], qs: &[f32], n: usize, k0: usize, sums: &mut [f32]) {
    let np = n / 16 * 16;
    let xp = x.as_ptr();
    let ys: [*const f32; G] = std::array::from_fn(|g| qs.as_ptr().add((k0 + g) * n));
    let mut acc = [[vdupq_n_f32(0.0); 4]; G];
    let mut i = 0;
    while i < np {
        let ax: [float32x4_t; 4] = std::array::from_fn(|j| widen4(vld1_u16(xp.add(i + 4 * j))));
        for g in 0..G {
            for j in 0..4 {
                let ay = vld1q_f32(ys[g].add(i + 4 * j));
                acc[g][j] = fmla(acc[g][j], ax[j], ay);
            }
        }
        i += 16;
    }
    for g in 0..G {
        let [a0, a1, a2, a3] = acc[g];
        let s = vaddq_f32(vaddq_f32(a0, a2), vaddq_f32(a1, a3));
        // `vaddvq_f32` as gcc emitted it: `faddp` twice, (l0 + l1) + (l2 + l3).
        let s = vpaddq_f32(s, s);
        let mut sum = vgetq_lane_f32::<0>(vpaddq_f32(s, s)) as f64;
        for (i, &h) in x.iter().enumerate().skip(np) {
            sum += fmul(*ys[g].add(i), widen1(h)) as f64;
        }
        sums[k0 + g] = sum as f32;
    }
}

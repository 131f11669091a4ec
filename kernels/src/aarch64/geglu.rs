//! The AArch64 unit, NEON only. ggml's armv8-a build runs the scalar loop of
//! `ggml_vec_geglu_f32` (there is no vector path for it), where `GGML_CPU_FP32_TO_FP16` is the
//! integer-and-float `ggml_compute_fp32_to_fp16` (gcc: one fused multiply-add; shared with the
//! attention kernels as [`fp16_bits`]) and `GGML_CPU_FP16_TO_FP32` the hardware's `fcvt`
//! ([`widen4`] widens the table the same way); the products are single `fmul`s.

use std::arch::aarch64::*;
use std::arch::asm;

use crate::kq::neon::{fp16_bits, widen4};

/// Every AArch64 CPU runs [`geglu`] and [`widen`]: NEON is part of the target's baseline.
pub fn cpu_ok() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// `h` as f32 with `fcvtl` (exact, as ggml's `fcvt`).
///
/// # Safety
/// [`cpu_ok`]; `h.len()` is a multiple of 4.
pub unsafe fn widen(h: &[u16]) -> Vec<f32> {
    let mut out = vec![0f32; h.len()];
    for (o, c) in out.chunks_exact_mut(4).zip(h.chunks_exact(4)) {
        vst1q_f32(o.as_mut_ptr(), widen4(vld1_u16(c.as_ptr())));
    }
    out
}

/// `t * g` with `fmul`'s operands in the order gcc gave ggml's (LLVM may swap them
/// otherwise): of two NaNs, `fmul` returns the first.
#[inline(always)]
fn fmul(t: float32x4_t, g: float32x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: register arithmetic in every AArch64 CPU.
    unsafe {
        asm!("fmul {o:v}.4s, {t:v}.4s, {g:v}.4s", o = out(vreg) out, t = in(vreg) t,
             g = in(vreg) g, options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// `y = gelu(x) * g` element by element, ggml's way (see the parent module's docs), 4 at a
/// time (a short tail through a zero-padded block).
///
/// # Safety
/// [`cpu_ok`]; `table` has 65536 entries; slices of equal length.
pub unsafe fn geglu(table: &[f32], x: &[f32], g: &[f32], y: &mut [f32]) {
    let four = |xv: float32x4_t, gv: float32x4_t| {
        let mut h = [0u32; 4];
        vst1q_u32(h.as_mut_ptr(), fp16_bits(xv));
        let t: [f32; 4] = h.map(|h| table[h as usize]);
        let mut v = fmul(vld1q_f32(t.as_ptr()), gv);
        v = vbslq_f32(vcgeq_f32(xv, vdupq_n_f32(10.0)), vmulq_f32(xv, gv), v);
        vbslq_f32(vcleq_f32(xv, vdupq_n_f32(-10.0)), vdupq_n_f32(0.0), v)
    };
    let n4 = x.len() / 4 * 4;
    for i in (0..n4).step_by(4) {
        let v = four(vld1q_f32(x.as_ptr().add(i)), vld1q_f32(g.as_ptr().add(i)));
        vst1q_f32(y.as_mut_ptr().add(i), v);
    }
    if n4 < x.len() {
        let (mut xb, mut gb, mut yb) = ([0f32; 4], [0f32; 4], [0f32; 4]);
        let r = x.len() - n4;
        xb[..r].copy_from_slice(&x[n4..]);
        gb[..r].copy_from_slice(&g[n4..]);
        vst1q_f32(
            yb.as_mut_ptr(),
            four(vld1q_f32(xb.as_ptr()), vld1q_f32(gb.as_ptr())),
        );
        y[n4..].copy_from_slice(&yb[..r]);
    }
}

//! ggml's CPU flash attention for a query row computed alone (`FLASH_ATTN_EXT` on an f16 KV
//! cache), in portable scalar code: the arithmetic a verification row must repeat for
//! speculation to give plain decoding's tokens with flash attention on.
//!
//! ggml computes a row one of three ways, by the shape of the call
//! (`ggml_compute_forward_flash_attn_ext_f16`, ggml-cpu `ops.cpp`):
//!
//! - a lone row (decoding) over a key view of [`SPLIT_FROM`] cells or more: **split over the
//!   keys**, one chunk of `ceil(n_kv / threads)` cells per thread, each chunk an online softmax
//!   of its own, the chunks' partial results then merged in chunk order;
//! - a few rows (verification; 2 to 63, ggml's tile is 64): **one chunk** over every cell, per row;
//! - more rows (prefill): tiled.
//!
//! So a row's output depends on how many rows came with it, on the key view's length and on the
//! thread count. [`row`] computes a row the lone way for a given view length and thread count,
//! from its key dot products (ggml's `vec_dot_f16` of the query rounded to f16, as [`crate::kq`]
//! reproduces), libm's `expf`, the value accumulator kept in f16 and rounded after every fused
//! multiply-add (ggml's `ggml_vec_mad_f16` and `ggml_vec_scale_f16` are element-wise: every SIMD
//! width gives the same numbers), and the chunks merged as ggml merges them.
//!
//! Two steps are scalar C whose rounding the compiler chooses: the running sum `S = S*ms + vs`
//! and the merge `a*so + b*sn` may each be contracted to fused multiply-adds. [`Rounding`] names
//! the choices; the caller finds the one the loaded ggml made (`leap_backend::lone`).
//!
//! A ggml built for FP16 vector arithmetic computes in half precision natively, and
//! [`Rounding::half`] and [`Dot::Half`] reproduce it: the update `f16(acc + v * f16(w))`
//! rounded once, the rescaling `f16(acc * f16(ms))` likewise. x86-64 with AVX512-FP16
//! (`-march=native` on such a Xeon: ggml's `simd-mappings.h` takes `_mm512_fmadd_ph` and
//! `_mm512_mul_ph`, 32 halves a register and 128 a step, so value rows of 128 halves or more;
//! shorter ones keep the f32 loop; its dot products stay in f32, [`Dot::Zmm`]) and AArch64 with
//! ARMv8.2-A's FP16 (`vfmaq_f16`, steps of 32; its `vec_dot_f16` sums in halves too,
//! [`dot_half`]). Where the CPU has the instructions they compute it (`vfmadd231ph`, `fmla .8h`,
//! by inline assembly); the portable reference takes f64 and one rounding to f16 (`half_of`).
//!
//! A verification's rows are many lone rows over the same cache: [`rows`] computes the rows
//! that read one key-value head's values over one view length together, each exactly as
//! [`row`] would, with the value updates of up to six rows walking the cells
//! together (a value row loaded and converted once for all of them, each row's sum folded on
//! the way: SmolLM2's 8-row call with lone attention went from 9.6-9.8 to 8.3-8.6 ms of flash
//! attention, and to 7.6-7.7 with the sums in the walk). Each chunk's maxima are a scalar pass
//! in ggml's order, or with AVX-512 a prefix scan sixteen cells at a time that gives the same
//! steps (13.9-14.4 to 11.9-12.4 ms before that). How these were timed (`leap profile` with a
//! one-line local edit): docs/measurements.md, "Verification rows' lone attention together". Both take AVX-512:
//! with AVX2 and on AArch64 [`rows`] computes each row alone and the maxima pass is scalar;
//! in half precision too it computes each row alone (the accumulator then stays in halves,
//! without conversions: 43 µs a row of Gemma's shape over 1024 cells, against 99 in f32, by
//! `cargo bench -p leap-tests --bench kernels -- lone/` on the AVX512-FP16 Xeon);
//! the place for NEON to follow is `shared` (AVX2's sixteen registers spilled three rows'
//! accumulators and lost time, see `shared::ROWS`; NEON has 32) and `simd::steps`.

use crate::f16::{from_f32, to_f32};

/// The smallest key view ggml splits a lone row's keys over its threads for.
pub const SPLIT_FROM: usize = 512;

/// How the loaded ggml's compiler rounded its two scalar updates (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounding {
    /// `S = S*ms + vs` as one fused multiply-add.
    pub sum_fused: bool,
    /// The merge of chunk partials `a*so + b*sn`: unfused, `fma(a, so, b*sn)` or
    /// `fma(b, sn, a*so)`.
    pub merge: Merge,
    /// The value updates' SIMD step where ggml takes them in half-precision arithmetic, or 0
    /// (f32 arithmetic rounded to f16, every other build). A build for AVX512-FP16 updates the
    /// first `dv / half * half` halves of a row (steps of [`HALF_STEP_AVX512FP16`]) in halves:
    /// the weight rounded to f16, then one rounding of the exact product and sum ([`mad_half`],
    /// [`scale_half`]); the rest as the other builds do.
    pub half: usize,
}

/// ggml's `GGML_F16_STEP` where `__AVX512FP16__` is defined: 128 halves, four registers.
pub const HALF_STEP_AVX512FP16: usize = 128;
/// ggml's `GGML_F16_STEP` on AArch64 with `__ARM_FEATURE_FP16_VECTOR_ARITHMETIC`: 32 halves,
/// four registers.
pub const HALF_STEP_NEON: usize = 32;

/// The builds a ggml for this CPU may be, the likeliest first (one built for this CPU,
/// llama.cpp's default): each one's dot product and its half-precision updates' step (0:
/// none, f32 arithmetic).
fn builds() -> Vec<(Dot, usize)> {
    let mut builds = Vec::new();
    if half_ok() && cfg!(target_arch = "x86_64") {
        builds.push((Dot::Zmm, HALF_STEP_AVX512FP16));
    }
    if half_ok() && cfg!(target_arch = "aarch64") {
        builds.push((Dot::Half, HALF_STEP_NEON));
    }
    builds.push((Dot::Kq, 0));
    if zmm_ok() {
        builds.push((Dot::Zmm, 0));
    }
    builds
}

impl Rounding {
    /// The halves of a `dv`-long value row updated in half-precision arithmetic.
    pub fn half_len(self, dv: usize) -> usize {
        dv.checked_div(self.half)
            .map_or(0, |steps| steps * self.half)
    }
}

/// See [`Rounding::merge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Merge {
    /// Two products rounded, then added.
    Plain,
    /// The first product fused with the rounded second.
    FirstFused,
    /// The second product fused with the rounded first.
    SecondFused,
}

impl Merge {
    fn apply(self, a: f32, so: f32, b: f32, sn: f32) -> f32 {
        match self {
            Merge::Plain => a * so + b * sn,
            Merge::FirstFused => a.mul_add(so, b * sn),
            Merge::SecondFused => b.mul_add(sn, a * so),
        }
    }
}

/// Every [`Rounding`] this CPU can compute, the likeliest first: half-precision updates first
/// where the CPU has them (a ggml built for this CPU, llama.cpp's default, takes them), then
/// GCC's default contraction.
pub fn roundings() -> impl Iterator<Item = Rounding> {
    let mut halves: Vec<usize> = builds().into_iter().map(|(_, half)| half).collect();
    halves.dedup();
    halves.into_iter().flat_map(|half| {
        [true, false].into_iter().flat_map(move |sum_fused| {
            [Merge::FirstFused, Merge::SecondFused, Merge::Plain]
                .into_iter()
                .map(move |merge| Rounding {
                    sum_fused,
                    merge,
                    half,
                })
        })
    })
}

/// Whether the CPU computes [`mad_half`], [`scale_half`] (and on AArch64 [`dot_half`]) in its
/// own half-precision arithmetic (x86-64 with AVX512-FP16, AArch64 with ARMv8.2-A's FP16),
/// which a ggml built for it takes and Leap then reproduces at speed. Elsewhere the functions
/// compute the same numbers in portable code, too slowly for decoding and never needed: a
/// ggml built for half-precision arithmetic does not run on a CPU without it.
pub fn half_ok() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd::half_ok()
    }
    #[cfg(target_arch = "aarch64")]
    {
        neon::half_ok()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// How the loaded ggml's `vec_dot_f16` sums a key row with a query: its build's SIMD width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dot {
    /// 256-bit builds (AVX2/F16C, and AArch64's): [`crate::kq`]'s kernels.
    Kq,
    /// AVX-512 builds (`-march=native` on such a CPU, llama.cpp's default; with AVX512-FP16
    /// too, whose dot products stay in f32): four 16-lane sums over steps of 64, reduced
    /// pairwise and then as GCC's `_mm512_reduce_add_ps`, leftovers added in f64 ([`dot_zmm`]).
    Zmm,
    /// AArch64 builds with FP16 vector arithmetic: four 8-lane sums of halves over steps of 32,
    /// reduced in halves, then in f32, leftovers added in f64 ([`dot_half`]).
    Half,
}

/// The arithmetic of one loaded ggml: its dot product and its compiler's roundings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arith {
    pub dot: Dot,
    pub rounding: Rounding,
}

/// Every [`Arith`] this CPU can compute, the likeliest first: the builds' dot products, each
/// with the value updates a build with it takes.
pub fn ariths() -> impl Iterator<Item = Arith> {
    builds().into_iter().flat_map(|(dot, half)| {
        roundings()
            .filter(move |r| r.half == half)
            .map(move |rounding| Arith { dot, rounding })
    })
}

/// ggml's `vec_dot_f16` as an AArch64 build with FP16 vector arithmetic computes it: f16 key
/// row `k` times the query `q` (already rounded to f16 values, `qh` the same values as halves:
/// many key rows meet one query), `q.len()` elements. Four registers of eight halves each take
/// fused multiply-adds in halves over steps of 32 (`vfmaq_f16`); they are added in halves
/// (0 + 2, 1 + 3, then the two), the eight lanes widened and summed in f32 (lane i + lane i +
/// 4, then as `vaddvq_f32`'s pairwise adds), and the leftovers past the last step added in f64.
pub fn dot_half(k: &[u16], qh: &[u16], q: &[f32]) -> f32 {
    assert!(k.len() >= q.len() && qh.len() == q.len());
    let n = q.len();
    let np = n / 32 * 32;
    #[cfg(target_arch = "aarch64")]
    let x = if half_ok() {
        // SAFETY: the CPU has FP16 arithmetic; `k` and `qh` hold `np` values.
        unsafe { neon::dot_half_lanes(k, qh, np) }
    } else {
        dot_half_lanes(k, qh, np)
    };
    #[cfg(not(target_arch = "aarch64"))]
    let x = dot_half_lanes(k, qh, np);
    let u: [f32; 4] = std::array::from_fn(|i| to_f32(x[i]) + to_f32(x[i + 4]));
    let mut sumf = f64::from((u[0] + u[1]) + (u[2] + u[3]));
    for e in np..n {
        sumf += f64::from(to_f32(k[e]) * q[e]);
    }
    sumf as f32
}

/// [`dot_half`]'s eight lanes of halves after the reduction in halves, in portable code.
fn dot_half_lanes(k: &[u16], qh: &[u16], np: usize) -> [u16; 8] {
    let add = |a: u16, b: u16| half_of(f64::from(to_f32(a)) + f64::from(to_f32(b)));
    let mut sum = [[0u16; 8]; 4];
    for i in (0..np).step_by(32) {
        for (j, s) in sum.iter_mut().enumerate() {
            for (l, s) in s.iter_mut().enumerate() {
                let e = i + 8 * j + l;
                *s = fma_half(k[e], qh[e], *s);
            }
        }
    }
    std::array::from_fn(|l| {
        let (a, b) = (add(sum[0][l], sum[2][l]), add(sum[1][l], sum[3][l]));
        add(a, b)
    })
}

/// Whether [`dot_zmm`] runs its AVX-512 kernel here (it computes the same numbers anywhere).
pub fn zmm_ok() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd::zmm_ok()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// ggml's `vec_dot_f16` as an AVX-512 build computes it (without FP16 arithmetic): f16 key
/// row `k` times the query `q` (already rounded to f16 values), `q.len()` elements.
pub fn dot_zmm(k: &[u16], q: &[f32]) -> f32 {
    assert!(k.len() >= q.len());
    #[cfg(target_arch = "x86_64")]
    if simd::zmm_ok() {
        // SAFETY: the CPU has AVX-512F; `k` is at least as long as `q`.
        return unsafe { simd::dot_zmm(k, q) };
    }
    let n = q.len();
    let np = n / 64 * 64;
    let mut sum = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, s) in sum.iter_mut().enumerate() {
            for (l, s) in s.iter_mut().enumerate() {
                let e = i + 16 * j + l;
                *s = to_f32(k[e]).mul_add(q[e], *s);
            }
        }
    }
    let x0: [f32; 16] = std::array::from_fn(|l| (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]));
    let mut sumf = f64::from(reduce_add_16(&x0));
    for e in np..n {
        sumf += f64::from(to_f32(k[e]) * q[e]);
    }
    sumf as f32
}

/// GCC's `_mm512_reduce_add_ps`: halves, then quarters, then lanes (0, 2) and (1, 3), then
/// the two.
fn reduce_add_16(x: &[f32; 16]) -> f32 {
    let t3: [f32; 8] = std::array::from_fn(|i| x[i + 8] + x[i]);
    let t6: [f32; 4] = std::array::from_fn(|j| t3[j + 4] + t3[j]);
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// `acc[i] = f16(f32(v[i]) * w + f32(acc[i]))`, one rounding for the product and sum: ggml's
/// `ggml_vec_mad_f16` over whole SIMD steps (fused on every x86-64 build with FMA and on
/// AArch64 without FP16 arithmetic).
pub fn mad_f16(acc: &mut [u16], v: &[u16], w: f32) {
    assert!(v.len() >= acc.len());
    #[cfg(target_arch = "x86_64")]
    if simd::ok() {
        // SAFETY: the CPU has the features; `v` is at least as long as `acc`.
        return unsafe { simd::mad(acc, v, w) };
    }
    for (a, &v) in acc.iter_mut().zip(v) {
        *a = from_f32(to_f32(v).mul_add(w, to_f32(*a)));
    }
}

/// `acc[i] = f16(f32(acc[i]) * w)`: ggml's `ggml_vec_scale_f16`.
pub fn scale_f16(acc: &mut [u16], w: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd::ok() {
        // SAFETY: the CPU has the features.
        return unsafe { simd::scale(acc, w) };
    }
    for a in acc.iter_mut() {
        *a = from_f32(to_f32(*a) * w);
    }
}

/// `acc[i] = f16(f16(w) * v[i] + acc[i])`, the product and sum rounded once: ggml's
/// `ggml_vec_mad_f16` in half-precision arithmetic (`_mm512_fmadd_ph` with the weight
/// `_mm512_set1_ph`'s half).
pub fn mad_half(acc: &mut [u16], v: &[u16], w: f32) {
    assert!(v.len() >= acc.len());
    let wh = from_f32(w);
    #[cfg(target_arch = "x86_64")]
    if half_ok() {
        // SAFETY: the CPU has AVX512-FP16; `v` is at least as long as `acc`.
        return unsafe { simd::mad_ph(acc, v, wh) };
    }
    #[cfg(target_arch = "aarch64")]
    if half_ok() {
        // SAFETY: the CPU has FP16 arithmetic; `v` is at least as long as `acc`.
        return unsafe { neon::mad_half(acc, v, wh) };
    }
    mad_half_portable(acc, v, wh);
}

/// [`mad_half`] in portable code, the weight already a half.
fn mad_half_portable(acc: &mut [u16], v: &[u16], wh: u16) {
    for (a, &v) in acc.iter_mut().zip(v) {
        *a = fma_half(v, wh, *a);
    }
}

/// `f16(a * b + c)` of three halves, rounded once.
fn fma_half(a: u16, b: u16, c: u16) -> u16 {
    half_of(f64::from(to_f32(a)).mul_add(f64::from(to_f32(b)), f64::from(to_f32(c))))
}

/// `acc[i] = f16(acc[i] * f16(w))`, rounded once: ggml's `ggml_vec_scale_f16` in
/// half-precision arithmetic (`_mm512_mul_ph`).
pub fn scale_half(acc: &mut [u16], w: f32) {
    let wh = from_f32(w);
    #[cfg(target_arch = "x86_64")]
    if half_ok() {
        // SAFETY: the CPU has AVX512-FP16.
        return unsafe { simd::scale_ph(acc, wh) };
    }
    #[cfg(target_arch = "aarch64")]
    if half_ok() {
        // SAFETY: the CPU has FP16 arithmetic.
        return unsafe { neon::scale_half(acc, wh) };
    }
    // Two halves' product is exact in f32 (22 significant bits, exponents in range).
    let w = to_f32(wh);
    for a in acc.iter_mut() {
        *a = from_f32(to_f32(*a) * w);
    }
}

/// `x` rounded once to the nearest half (ties to even), for `x` the f64 sum of a half and a
/// product of two halves, or of two halves. A product of halves has at most 22 significant
/// bits and a half's least unit is 2^-24, so such a sum within a half's range is exact in f64
/// unless the smaller addend lies below 2^-30 of the larger: far under half a unit of the
/// larger (a half itself), it cannot carry the sum across a rounding boundary. Beyond the
/// range the half is infinite either way.
/// Through f32 the rounding would be double; rounded toward zero to f32 with the lost bits
/// kept as the last bit (round to odd), thirteen bits more than a half holds, one rounding to
/// nearest then gives the half the exact value rounds to.
fn half_of(x: f64) -> u16 {
    let f = x as f32;
    if !f.is_finite() || f64::from(f) == x {
        return from_f32(f);
    }
    // Nearest rounded away from zero: step back toward zero (same sign, one unit less).
    let t = if f64::from(f).abs() > x.abs() {
        f32::from_bits(f.to_bits() - 1)
    } else {
        f
    };
    from_f32(f32::from_bits(t.to_bits() | 1))
}

/// ARMv8.2-A's half-precision vector arithmetic (`FEAT_FP16`), by inline assembly: Rust has no
/// stable half-precision vector intrinsics. Each instruction is the one GCC emits for ggml's
/// `vfmaq_f16`, `vmulq_f16` and `vaddq_f16`.
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    pub(super) fn half_ok() -> bool {
        std::arch::is_aarch64_feature_detected!("fp16")
    }

    /// `a + b * c` on eight halves, rounded once.
    #[inline]
    #[target_feature(enable = "neon,fp16")]
    unsafe fn fma(a: uint16x8_t, b: uint16x8_t, c: uint16x8_t) -> uint16x8_t {
        let mut a = a;
        std::arch::asm!(
            "fmla {a:v}.8h, {b:v}.8h, {c:v}.8h",
            a = inout(vreg) a,
            b = in(vreg) b,
            c = in(vreg) c,
            options(pure, nomem, nostack, preserves_flags)
        );
        a
    }

    /// `$name(a, b)`: the instruction `$ins` on eight halves.
    macro_rules! binary {
        ($name:ident, $ins:literal) => {
            #[inline]
            #[target_feature(enable = "neon,fp16")]
            unsafe fn $name(a: uint16x8_t, b: uint16x8_t) -> uint16x8_t {
                let r: uint16x8_t;
                std::arch::asm!(
                    concat!($ins, " {r:v}.8h, {a:v}.8h, {b:v}.8h"),
                    r = lateout(vreg) r,
                    a = in(vreg) a,
                    b = in(vreg) b,
                    options(pure, nomem, nostack, preserves_flags)
                );
                r
            }
        };
    }
    binary!(mul, "fmul");
    binary!(add, "fadd");

    /// `acc = f(acc, v)` eight halves at a time (`v`'s matching halves, zeros without it), the
    /// last few through a padded register.
    ///
    /// # Safety
    /// The CPU has FP16 arithmetic; `v`, given, is at least as long as `acc`.
    #[inline]
    #[target_feature(enable = "neon,fp16")]
    unsafe fn by8(
        acc: &mut [u16],
        v: Option<&[u16]>,
        f: impl Fn(uint16x8_t, uint16x8_t) -> uint16x8_t,
    ) {
        let n8 = acc.len() / 8 * 8;
        let zeros = [0u16; 8];
        for i in (0..n8).step_by(8) {
            let p = acc.as_mut_ptr().add(i);
            let x = v.map_or(zeros.as_ptr(), |v| v[i..i + 8].as_ptr());
            vst1q_u16(p, f(vld1q_u16(p), vld1q_u16(x)));
        }
        let mut i = n8;
        while i < acc.len() {
            let n = acc.len() - i;
            let (mut ta, mut tx) = ([0u16; 8], [0u16; 8]);
            ta[..n].copy_from_slice(&acc[i..i + n]);
            if let Some(v) = v {
                tx[..n].copy_from_slice(&v[i..i + n]);
            }
            vst1q_u16(
                ta.as_mut_ptr(),
                f(vld1q_u16(ta.as_ptr()), vld1q_u16(tx.as_ptr())),
            );
            acc[i..i + n].copy_from_slice(&ta[..n]);
            i += 8;
        }
    }

    /// [`super::mad_half`].
    ///
    /// # Safety
    /// The CPU has FP16 arithmetic; `v` is at least as long as `acc`.
    #[target_feature(enable = "neon,fp16")]
    pub(super) unsafe fn mad_half(acc: &mut [u16], v: &[u16], w: u16) {
        let ww = vdupq_n_u16(w);
        by8(acc, Some(v), |a, x| fma(a, x, ww));
    }

    /// [`super::scale_half`].
    ///
    /// # Safety
    /// The CPU has FP16 arithmetic.
    #[target_feature(enable = "neon,fp16")]
    pub(super) unsafe fn scale_half(acc: &mut [u16], w: u16) {
        let ww = vdupq_n_u16(w);
        by8(acc, None, |a, _| mul(a, ww));
    }

    /// [`super::dot_half_lanes`] with the CPU's own arithmetic.
    ///
    /// # Safety
    /// The CPU has FP16 arithmetic; `k` and `q` hold `np` values, `np` a multiple of 32.
    #[target_feature(enable = "neon,fp16")]
    pub(super) unsafe fn dot_half_lanes(k: &[u16], qh: &[u16], np: usize) -> [u16; 8] {
        assert!(k.len() >= np && qh.len() >= np && np.is_multiple_of(32));
        let mut sum = [vdupq_n_u16(0); 4];
        for i in (0..np).step_by(32) {
            for (j, s) in sum.iter_mut().enumerate() {
                let kx = vld1q_u16(k.as_ptr().add(i + 8 * j));
                *s = fma(*s, kx, vld1q_u16(qh.as_ptr().add(i + 8 * j)));
            }
        }
        let x = add(add(sum[0], sum[2]), add(sum[1], sum[3]));
        let mut out = [0u16; 8];
        vst1q_u16(out.as_mut_ptr(), x);
        out
    }
}

/// The two f16 accumulator updates with F16C's conversions (nearest-even, as ggml's
/// `_mm256_cvtps_ph(x, 0)`), eight halves a step, the rest one at a time with the same
/// arithmetic.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    pub(super) fn ok() -> bool {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }

    pub(super) fn zmm_ok() -> bool {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }

    pub(super) fn half_ok() -> bool {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512fp16")
        })
    }

    /// `a = f16(b * c + a)` on 32 halves: AVX512-FP16's `vfmadd231ph` (Rust has no stable
    /// intrinsic for it; the instruction is the one GCC emits for `_mm512_fmadd_ph`).
    ///
    /// # Safety
    /// The CPU has AVX512-FP16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fmadd_ph(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
        let mut a = a;
        std::arch::asm!(
            "vfmadd231ph {a}, {b}, {c}",
            a = inout(zmm_reg) a,
            b = in(zmm_reg) b,
            c = in(zmm_reg) c,
            options(pure, nomem, nostack, preserves_flags)
        );
        a
    }

    /// `f16(a * b)` on 32 halves: AVX512-FP16's `vmulph`.
    ///
    /// # Safety
    /// The CPU has AVX512-FP16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn mul_ph(a: __m512i, b: __m512i) -> __m512i {
        let r: __m512i;
        std::arch::asm!(
            "vmulph {r}, {a}, {b}",
            r = lateout(zmm_reg) r,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        r
    }

    /// `acc = f(acc, v)` 32 halves at a time (`v`'s matching halves, zeros without it), the
    /// last few through a masked step.
    ///
    /// # Safety
    /// The CPU has AVX512-FP16 (for `f`); `v`, given, is at least as long as `acc`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn by32(acc: &mut [u16], v: Option<&[u16]>, f: impl Fn(__m512i, __m512i) -> __m512i) {
        let a = acc.as_mut_ptr();
        for i in (0..acc.len()).step_by(32) {
            let k = if acc.len() - i >= 32 {
                u32::MAX
            } else {
                (1u32 << (acc.len() - i)) - 1
            };
            let y = _mm512_maskz_loadu_epi16(k, a.add(i).cast());
            let x = v.map_or(_mm512_setzero_si512(), |v| {
                _mm512_maskz_loadu_epi16(k, v.as_ptr().add(i).cast())
            });
            _mm512_mask_storeu_epi16(a.add(i).cast(), k, f(y, x));
        }
    }

    /// [`super::mad_half`] with AVX512-FP16.
    ///
    /// # Safety
    /// The CPU has AVX512-FP16; `v` is at least as long as `acc`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn mad_ph(acc: &mut [u16], v: &[u16], w: u16) {
        let ww = _mm512_set1_epi16(w as i16);
        by32(acc, Some(v), |y, x| fmadd_ph(y, x, ww));
    }

    /// [`super::scale_half`] with AVX512-FP16.
    ///
    /// # Safety
    /// The CPU has AVX512-FP16.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn scale_ph(acc: &mut [u16], w: u16) {
        let ww = _mm512_set1_epi16(w as i16);
        by32(acc, None, |y, _| mul_ph(y, ww));
    }

    /// [`super::dot_zmm`] in 512-bit registers (the same lanes, the same additions).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_zmm(k: &[u16], q: &[f32]) -> f32 {
        let n = q.len();
        let np = n / 64 * 64;
        let (kp, qp) = (k.as_ptr(), q.as_ptr());
        let mut sum = [_mm512_setzero_ps(); 4];
        for i in (0..np).step_by(64) {
            for (j, s) in sum.iter_mut().enumerate() {
                let x = _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(i + 16 * j).cast()));
                *s = _mm512_fmadd_ps(x, _mm512_loadu_ps(qp.add(i + 16 * j)), *s);
            }
        }
        let x0 = _mm512_add_ps(_mm512_add_ps(sum[0], sum[2]), _mm512_add_ps(sum[1], sum[3]));
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), x0);
        let mut sumf = f64::from(super::reduce_add_16(&lanes));
        for e in np..n {
            sumf += f64::from(super::to_f32(*kp.add(e)) * *qp.add(e));
        }
        sumf as f32
    }

    /// [`super::Steps::scalar`] sixteen cells at a time: the visible cells' arguments
    /// `x = score * scale + mask` (a product then a sum, as ggml's), packed to the front of a
    /// register; their running maxima by a prefix scan in the register (log2 16 steps of
    /// "the later value where it is greater, else the earlier", which is ggml's `x > M` fold
    /// and associative, so the maxima are the fold's values); a cell raised the maximum where
    /// `x` is greater than the maximum before it, and its exponential's argument is that
    /// maximum minus `x`, else `x` minus it: the same subtractions of the same values. Returns
    /// false (the steps unset) where a visible argument is NaN, which the scan would not order
    /// as the fold does; the caller then takes the scalar pass.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `c0 <= c1`, both slices of `keys` hold cell `c1 - 1`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn steps(
        st: &mut super::Steps,
        keys: super::Keys<'_>,
        scale: f32,
        c0: usize,
        c1: usize,
    ) -> bool {
        let n = c1 - c0;
        st.clear();
        st.cells.reserve(n);
        st.e.reserve(n);
        st.raised.reserve(n);
        let (pc, pe, pr) = (
            st.cells.as_mut_ptr(),
            st.e.as_mut_ptr(),
            st.raised.as_mut_ptr(),
        );
        let (sp, mp) = (keys.scores.as_ptr(), keys.mask.as_ptr());
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let vscale = _mm512_set1_ps(scale);
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let one = _mm512_set1_epi32(1);
        let mut m = f32::NEG_INFINITY;
        let mut len = 0usize;
        let mut c = c0;
        while c < c1 {
            let k = if c1 - c >= 16 {
                0xFFFFu16
            } else {
                (1u16 << (c1 - c)) - 1
            };
            let sc = _mm512_maskz_loadu_ps(k, sp.add(c));
            let mv = _mm512_maskz_loadu_ps(k, mp.add(c));
            let x = _mm512_add_ps(_mm512_mul_ps(sc, vscale), mv);
            // ggml skips `mv == -INFINITY`; a NaN mask value is not skipped (unordered: true).
            let vis = k & _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(mv, ninf);
            if _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(vis, x, x) != 0 {
                st.clear();
                return false;
            }
            let nv = vis.count_ones() as usize;
            if nv > 0 {
                let first = _mm512_set1_ps(m);
                // The visible arguments in lanes 0..nv, -inf after (no maximum moves there).
                let xs = _mm512_mask_compress_ps(ninf, vis, x);
                let mut p = xs;
                for sh in [1i32, 2, 4, 8] {
                    let idx = _mm512_sub_epi32(lane, _mm512_set1_epi32(sh));
                    let earlier = _mm512_mask_permutexvar_ps(ninf, !((1u16 << sh) - 1), idx, p);
                    p = _mm512_max_ps(p, earlier);
                }
                // With the maximum before this block: later where greater, else earlier.
                let p = _mm512_max_ps(p, first);
                let before =
                    _mm512_mask_permutexvar_ps(first, 0xFFFE, _mm512_sub_epi32(lane, one), p);
                let live = ((1u32 << nv) - 1) as u16;
                let up = _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(live, xs, before);
                let e =
                    _mm512_mask_blend_ps(up, _mm512_sub_ps(xs, before), _mm512_sub_ps(before, xs));
                let cells = _mm512_maskz_compress_epi32(
                    vis,
                    _mm512_add_epi32(lane, _mm512_set1_epi32(c as i32)),
                );
                _mm512_mask_storeu_epi32(pc.add(len).cast(), live, cells);
                _mm512_mask_storeu_ps(pe.add(len), live, e);
                _mm512_mask_storeu_epi32(pr.add(len).cast(), live, _mm512_maskz_mov_epi32(up, one));
                let last = _mm512_permutexvar_ps(_mm512_set1_epi32(nv as i32 - 1), p);
                m = _mm512_cvtss_f32(last);
                len += nv;
            }
            c += 16;
        }
        // SAFETY: the first len elements of each were written above (capacity n >= len).
        st.cells.set_len(len);
        st.e.set_len(len);
        st.raised.set_len(len);
        st.m = m;
        true
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half(x: f32) -> u16 {
        _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))) as u16
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn single(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mad(acc: &mut [u16], v: &[u16], w: f32) {
        let n8 = acc.len() / 8 * 8;
        let (a, x) = (acc.as_mut_ptr(), v.as_ptr());
        let ww = _mm256_set1_ps(w);
        for i in (0..n8).step_by(8) {
            let y = _mm256_cvtph_ps(_mm_loadu_si128(a.add(i).cast()));
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.add(i).cast()));
            let r = _mm256_fmadd_ps(xv, ww, y);
            _mm_storeu_si128(
                a.add(i).cast(),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r),
            );
        }
        for i in n8..acc.len() {
            *a.add(i) = half(single(*x.add(i)).mul_add(w, single(*a.add(i))));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scale(acc: &mut [u16], w: f32) {
        let n8 = acc.len() / 8 * 8;
        let a = acc.as_mut_ptr();
        let ww = _mm256_set1_ps(w);
        for i in (0..n8).step_by(8) {
            let y = _mm256_cvtph_ps(_mm_loadu_si128(a.add(i).cast()));
            _mm_storeu_si128(
                a.add(i).cast(),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(y, ww)),
            );
        }
        for i in n8..acc.len() {
            *a.add(i) = half(single(*a.add(i)) * w);
        }
    }
}

/// A row's keys as [`row`] reads them: `scores[c]` is the row's rounded-query dot
/// product with key cell `c` (ggml's `vec_dot_f16`), `mask[c]` its mask value (an f16's, as
/// f32; `-inf` hides the cell). The view is `mask.len()` cells.
#[derive(Clone, Copy)]
pub struct Keys<'a> {
    pub scores: &'a [f32],
    pub mask: &'a [f32],
}

/// The value rows: cell `c`'s `dv` halves at `data[c * stride..]`.
#[derive(Clone, Copy)]
pub struct Values<'a> {
    pub data: &'a [u16],
    pub stride: usize,
    pub dv: usize,
}

/// One query row of one head computed as ggml computes a lone row over the key view
/// `keys.mask.len()` a lone call would have had, with `threads` for its thread count. Writes
/// `dv` outputs to `out`.
pub fn row(
    keys: Keys<'_>,
    scale: f32,
    values: Values<'_>,
    threads: usize,
    rounding: Rounding,
    out: &mut [f32],
) {
    let (n_kv, dv) = (keys.mask.len(), values.dv);
    assert!(out.len() == dv && threads >= 1);
    assert!(keys.scores.len() >= n_kv);
    assert!(n_kv == 0 || values.data.len() >= (n_kv - 1) * values.stride + dv);
    STEPS.with(|st| {
        row_with(
            keys,
            scale,
            values,
            threads,
            rounding,
            out,
            &mut st.borrow_mut(),
        )
    });
}

thread_local! {
    /// [`row`]'s chunk steps, reused from row to row on each thread.
    static STEPS: std::cell::RefCell<Steps> = std::cell::RefCell::new(Steps::default());
}

/// Rows that read the same value rows over views of the same length (the query heads of a
/// key-value head, the rows of a verification batch), each computed exactly as [`row`]
/// computes it alone: the same chunks, steps and updates, but with AVX-512 a chunk's updates
/// of up to six rows walk the cells together ([`shared`]), each value row loaded and converted
/// once for all of them. `outs[i]` gets row `i`'s `dv` outputs.
pub fn rows(
    keys: &[Keys<'_>],
    scale: f32,
    values: Values<'_>,
    threads: usize,
    rounding: Rounding,
    outs: &mut [&mut [f32]],
) {
    assert_eq!(keys.len(), outs.len());
    let Some(first) = keys.first() else {
        return;
    };
    let (n, dv) = (first.mask.len(), values.dv);
    for (k, o) in keys.iter().zip(outs.iter()) {
        assert!(k.mask.len() == n && k.scores.len() >= n && o.len() == dv);
    }
    assert!(n == 0 || values.data.len() >= (n - 1) * values.stride + dv);
    #[cfg(target_arch = "x86_64")]
    if keys.len() > 1 && rounding.half_len(dv) == 0 && shared::fits(dv) {
        GROUP.with(|g| {
            let g = &mut *g.borrow_mut();
            g.accs.resize(shared::ROWS * dv, 0.0);
            for (keys, outs) in keys.chunks(shared::ROWS).zip(outs.chunks_mut(shared::ROWS)) {
                let mut merged: [Option<Merged<'_>>; shared::ROWS] = std::array::from_fn(|_| None);
                for (m, o) in merged.iter_mut().zip(outs.iter_mut()) {
                    *m = Some(Merged::new(o, n));
                }
                for (c0, c1) in chunks(n, threads) {
                    g.of(keys, scale, c0, c1);
                    let steps = &g.steps[..keys.len()];
                    // SAFETY: `fits(dv)` held (the CPU runs the walk, dv a whole number of its
                    // slices); every step's value row is inside `values.data` (asserted above
                    // for the view); at most ROWS rows, `accs` holds ROWS * dv.
                    let sums = unsafe {
                        shared::run(steps, &g.union, values, rounding.sum_fused, &mut g.accs)
                    };
                    for (r, m) in merged.iter_mut().flatten().enumerate() {
                        m.add(steps[r].m, sums[r], &g.accs[r * dv..(r + 1) * dv], rounding);
                    }
                }
                merged.into_iter().flatten().for_each(Merged::finish);
            }
        });
        return;
    }
    for (k, o) in keys.iter().zip(outs.iter_mut()) {
        row(*k, scale, values, threads, rounding, o);
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// [`rows`]' steps and accumulators, reused on each thread.
    static GROUP: std::cell::RefCell<Group> = std::cell::RefCell::new(Group::default());
}

/// The state of [`rows`]' walk: each row's steps, the rows' chunk accumulators, the cells any
/// of them sees.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct Group {
    steps: Vec<Steps>,
    accs: Vec<f32>,
    seen: Vec<bool>,
    union: Vec<u32>,
}

#[cfg(target_arch = "x86_64")]
impl Group {
    /// Each row's steps over cells `c0..c1`, and the cells any of them sees, in order.
    fn of(&mut self, keys: &[Keys<'_>], scale: f32, c0: usize, c1: usize) {
        if self.steps.len() < keys.len() {
            self.steps.resize_with(keys.len(), Steps::default);
        }
        self.seen.clear();
        self.seen.resize(c1 - c0, false);
        for (st, k) in self.steps.iter_mut().zip(keys) {
            st.of(*k, scale, c0, c1);
            for &c in &st.cells {
                self.seen[c as usize - c0] = true;
            }
        }
        let seen = &self.seen;
        self.union.clear();
        self.union
            .extend((c0..c1).filter(|&c| seen[c - c0]).map(|c| c as u32));
    }
}

/// ggml's running sum of a chunk's weights, `S = S*ms + vs`, fused or not as the loaded
/// ggml's compiler made it.
#[inline(always)]
fn add_weight(s: f32, ms: f32, vs: f32, fused: bool) -> f32 {
    if fused {
        s.mul_add(ms, vs)
    } else {
        s * ms + vs
    }
}

fn row_with(
    keys: Keys<'_>,
    scale: f32,
    values: Values<'_>,
    threads: usize,
    rounding: Rounding,
    out: &mut [f32],
    steps: &mut Steps,
) {
    let dv = values.dv;
    // A chunk's accumulator, kept with the steps from row to row.
    let mut acc = std::mem::take(&mut steps.partial);
    acc.resize(dv, 0.0);
    let n = keys.mask.len();
    let mut merged = Merged::new(out, n);
    for (c0, c1) in chunks(n, threads) {
        let (m, s) = chunk(keys, scale, values, c0, c1, rounding, &mut acc, steps);
        merged.add(m, s, &acc, rounding);
    }
    merged.finish();
    steps.partial = acc;
}

/// The chunks ggml computes a lone row's view of `n` cells in: one below [`SPLIT_FROM`] cells,
/// else one of `ceil(n / threads)` cells per thread (empty ones left out).
fn chunks(n: usize, threads: usize) -> impl Iterator<Item = (usize, usize)> {
    let (size, count) = if n < SPLIT_FROM {
        (n, 1)
    } else {
        let size = n.div_ceil(threads);
        (size, n.div_ceil(size))
    };
    (0..count).map(move |t| (t * size, ((t + 1) * size).min(n)))
}

/// A row's output as its chunks come, as ggml's: an unsplit row's one chunk is its
/// accumulator; a split row's chunks are merged in order into zeros (empty ones skipped); the
/// whole is divided by the sum at the end.
struct Merged<'a> {
    out: &'a mut [f32],
    split: bool,
    m: f32,
    s: f32,
}

impl<'a> Merged<'a> {
    /// A row over a view of `n` cells.
    fn new(out: &'a mut [f32], n: usize) -> Self {
        let split = n >= SPLIT_FROM;
        if split {
            out.fill(0.0);
        }
        Merged {
            out,
            split,
            m: f32::NEG_INFINITY,
            s: 0.0,
        }
    }

    /// The next chunk's running maximum `pm`, sum `ps` and accumulator.
    fn add(&mut self, pm: f32, ps: f32, acc: &[f32], rounding: Rounding) {
        if !self.split {
            self.out.copy_from_slice(&acc[..self.out.len()]);
            self.s = ps;
            return;
        }
        if ps == 0.0 {
            return;
        }
        let mn = self.m.max(pm);
        let (so, sn) = ((self.m - mn).exp(), (pm - mn).exp());
        for (o, a) in self.out.iter_mut().zip(acc) {
            *o = rounding.merge.apply(*o, so, *a, sn);
        }
        self.s = rounding.merge.apply(self.s, so, ps, sn);
        self.m = mn;
    }

    fn finish(self) {
        if self.split && self.s == 0.0 {
            return;
        }
        let inv = if self.s == 0.0 { 0.0 } else { 1.0 / self.s };
        for o in self.out.iter_mut() {
            *o *= inv;
        }
    }
}

/// A chunk's visible cells in order, each with the one exponential its update takes: where
/// the cell raised the running maximum, the accumulator's rescaling `ms = exp(old - M)` (the
/// cell's own weight is then 1), else the cell's weight `vs = exp(x - M)`. The maxima are a
/// scalar pass (the same comparisons as ggml's loop); the exponentials (libm's `expf`, as
/// ggml's) then follow in a loop of their own, where no call waits for the one before: in
/// ggml's loop each waits on the running maximum and the accumulator's update.
#[derive(Default)]
struct Steps {
    cells: Vec<u32>,
    e: Vec<f32>,
    /// 1 where the cell raised the maximum (a whole word, as AVX-512 stores a lane).
    raised: Vec<u32>,
    m: f32,
    /// Scratch for a split row's chunk accumulator ([`row_with`]).
    partial: Vec<f32>,
}

impl Steps {
    /// The steps of cells `c0..c1` of `keys` at `scale`: sixteen cells at a time where the CPU
    /// has AVX-512 ([`simd::steps`]), else one at a time ([`Steps::scalar`]); the same steps
    /// either way.
    fn of(&mut self, keys: Keys<'_>, scale: f32, c0: usize, c1: usize) {
        assert!(c0 <= c1 && c1 <= keys.mask.len() && c1 <= keys.scores.len());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked); cells c0..c1 are inside both slices.
        if simd::zmm_ok() && unsafe { simd::steps(self, keys, scale, c0, c1) } {
            self.exps();
            return;
        }
        self.scalar(keys, scale, c0, c1);
        self.exps();
    }

    /// No steps.
    fn clear(&mut self) {
        self.cells.clear();
        self.e.clear();
        self.raised.clear();
    }

    /// The exponentials of the steps' arguments (libm's `expf`, as ggml's).
    fn exps(&mut self) {
        for e in self.e.iter_mut() {
            *e = e.exp();
        }
    }

    /// [`Steps::of`]'s maxima pass one cell at a time, as ggml's loop (the arguments of the
    /// exponentials in `e`).
    fn scalar(&mut self, keys: Keys<'_>, scale: f32, c0: usize, c1: usize) {
        self.clear();
        let mut m = f32::NEG_INFINITY;
        for c in c0..c1 {
            let mv = keys.mask[c];
            if mv == f32::NEG_INFINITY {
                continue;
            }
            let x = keys.scores[c] * scale + mv;
            self.cells.push(c as u32);
            if x > m {
                self.e.push(m - x);
                self.raised.push(1);
                m = x;
            } else {
                self.e.push(x - m);
                self.raised.push(0);
            }
        }
        self.m = m;
    }

    /// Step `k`: its cell, and `(ms, vs)`.
    #[inline]
    fn at(&self, k: usize) -> (usize, f32, f32) {
        let e = self.e[k];
        let c = self.cells[k] as usize;
        if self.raised[k] != 0 {
            (c, e, 1.0)
        } else {
            (c, 1.0, e)
        }
    }
}

/// One chunk's online softmax over cells `c0..c1`: returns its running maximum M and sum S and
/// writes its value accumulator (f16 values, widened) to `acc`. With AVX-512 (or AVX2) and a
/// head size the registers hold, the accumulator stays in registers as f32 values rounded
/// through f16 after every update ([`regs`]), or as halves where `rounding` updates the whole
/// row in half-precision arithmetic and the CPU has it; elsewhere [`chunk_scalar`].
#[allow(clippy::too_many_arguments)]
fn chunk(
    keys: Keys<'_>,
    scale: f32,
    values: Values<'_>,
    c0: usize,
    c1: usize,
    rounding: Rounding,
    acc: &mut [f32],
    steps: &mut Steps,
) -> (f32, f32) {
    steps.of(keys, scale, c0, c1);
    #[cfg(target_arch = "x86_64")]
    {
        let fused = rounding.sum_fused;
        let s = match rounding.half_len(values.dv) {
            0 => regs::chunk(steps, values, fused, acc, simd::zmm_ok()),
            h if h == values.dv => regs::chunk_half(steps, values, fused, acc),
            _ => None,
        };
        if let Some(s) = s {
            return (steps.m, s);
        }
    }
    (steps.m, chunk_scalar(steps, values, rounding, acc))
}

/// [`chunk`]'s updates with the accumulator in halves, by [`mad_f16`] and [`scale_f16`], or
/// [`mad_half`] and [`scale_half`] over the part `rounding` updates in halves (ggml's own
/// steps, one cell at a time); returns S.
fn chunk_scalar(steps: &Steps, values: Values<'_>, rounding: Rounding, out: &mut [f32]) -> f32 {
    let dv = values.dv;
    let h = rounding.half_len(dv);
    let mut s = 0.0f32;
    let mut acc = vec![0u16; dv];
    for k in 0..steps.cells.len() {
        let (c, ms, vs) = steps.at(k);
        let (halves, singles) = acc.split_at_mut(h);
        if steps.raised[k] != 0 {
            scale_half(halves, ms);
            scale_f16(singles, ms);
        }
        let v = c * values.stride;
        mad_half(halves, &values.data[v..v + h], vs);
        mad_f16(singles, &values.data[v + h..v + dv], vs);
        s = add_weight(s, ms, vs, rounding.sum_fused);
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = to_f32(a);
    }
    s
}

/// [`chunk`]'s updates with the value accumulator in vector registers: `N` registers of 16
/// lanes (AVX-512) or of 8 (AVX2), each update rounded to f16 and back as ggml's stores and
/// loads of its f16 accumulator round it. The same arithmetic as [`chunk_scalar`], element
/// for element, without the accumulator's trip through memory and with AVX-512's
/// twice-as-wide conversions.
#[cfg(target_arch = "x86_64")]
mod regs {
    use super::{Steps, Values};
    use std::arch::x86_64::*;

    /// With `wide`, the AVX-512 kernel where the CPU has it; else AVX2's. `None`: neither
    /// runs here, or not this head size.
    pub(super) fn chunk(
        steps: &Steps,
        values: Values<'_>,
        sum_fused: bool,
        acc: &mut [f32],
        wide: bool,
    ) -> Option<f32> {
        assert!(acc.len() >= values.dv);
        if let Some(&c) = steps.cells.last() {
            assert!(values.data.len() >= c as usize * values.stride + values.dv);
        }
        macro_rules! go {
            ($f:ident, $n:literal) => {
                // SAFETY: the CPU has the kernel's features (checked by the match); every
                // step's value row is inside `values.data` (its last is, checked above), and
                // `acc` holds dv.
                Some(unsafe { $f::<$n>(steps, values, sum_fused, acc) })
            };
        }
        if wide && super::simd::zmm_ok() {
            return match values.dv {
                64 => go!(zmm, 4),
                128 => go!(zmm, 8),
                256 => go!(zmm, 16),
                _ => None,
            };
        }
        if super::simd::ok() {
            return match values.dv {
                64 => go!(ymm, 8),
                128 => go!(ymm, 16),
                256 => go!(ymm, 32),
                _ => None,
            };
        }
        None
    }

    macro_rules! kernel {
        ($name:ident, $feat:literal, $v:ty, $lanes:literal, $zero:ident, $set1:ident,
         $mul:ident, $fma:ident, $load:expr, $round:expr, $store:ident) => {
            #[target_feature(enable = $feat)]
            unsafe fn $name<const N: usize>(
                steps: &Steps,
                values: Values<'_>,
                sum_fused: bool,
                out: &mut [f32],
            ) -> f32 {
                let mut acc: [$v; N] = [$zero(); N];
                let mut s = 0.0f32;
                let vp = values.data.as_ptr();
                for k in 0..steps.cells.len() {
                    let (c, ms, vs) = steps.at(k);
                    if steps.raised[k] != 0 {
                        let w = $set1(ms);
                        for a in acc.iter_mut() {
                            *a = $round($mul(*a, w));
                        }
                    }
                    let w = $set1(vs);
                    let v = vp.add(c * values.stride);
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = $round($fma($load(v.add($lanes * j)), w, *a));
                    }
                    s = super::add_weight(s, ms, vs, sum_fused);
                }
                for (j, a) in acc.iter().enumerate() {
                    $store(out.as_mut_ptr().add($lanes * j), *a);
                }
                s
            }
        };
    }

    /// [`chunk`] where every half of the row is updated in half-precision arithmetic: `dv / 32`
    /// registers of halves, AVX512-FP16's own multiply-adds. `None`: the CPU has no
    /// AVX512-FP16, or not this head size.
    pub(super) fn chunk_half(
        steps: &Steps,
        values: Values<'_>,
        sum_fused: bool,
        acc: &mut [f32],
    ) -> Option<f32> {
        assert!(acc.len() >= values.dv);
        if let Some(&c) = steps.cells.last() {
            assert!(values.data.len() >= c as usize * values.stride + values.dv);
        }
        if !super::simd::half_ok() {
            return None;
        }
        // SAFETY: the CPU has AVX512-FP16 (checked); every step's value row is inside
        // `values.data` (its last is, checked above), and `acc` holds dv.
        unsafe {
            match values.dv {
                128 => Some(halves::<4>(steps, values, sum_fused, acc)),
                256 => Some(halves::<8>(steps, values, sum_fused, acc)),
                _ => None,
            }
        }
    }

    /// The f16 of `x` (nearest even) in every lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn splat_half(x: f32) -> __m512i {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x));
        _mm512_broadcastw_epi16(h)
    }

    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn halves<const N: usize>(
        steps: &Steps,
        values: Values<'_>,
        sum_fused: bool,
        out: &mut [f32],
    ) -> f32 {
        use super::simd::{fmadd_ph, mul_ph};
        let mut acc = [_mm512_setzero_si512(); N];
        let mut s = 0.0f32;
        let vp = values.data.as_ptr();
        for k in 0..steps.cells.len() {
            let (c, ms, vs) = steps.at(k);
            if steps.raised[k] != 0 {
                let w = splat_half(ms);
                for a in acc.iter_mut() {
                    *a = mul_ph(*a, w);
                }
            }
            let w = splat_half(vs);
            let v = vp.add(c * values.stride);
            for (j, a) in acc.iter_mut().enumerate() {
                *a = fmadd_ph(*a, _mm512_loadu_si512(v.add(32 * j).cast()), w);
            }
            s = super::add_weight(s, ms, vs, sum_fused);
        }
        let o = out.as_mut_ptr();
        for (j, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(32 * j), _mm512_cvtph_ps(_mm512_castsi512_si256(*a)));
            _mm512_storeu_ps(
                o.add(32 * j + 16),
                _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(*a)),
            );
        }
        s
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn load16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round16(x: __m512) -> __m512 {
        _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn round8(x: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    }

    kernel!(
        zmm,
        "avx512f",
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_fmadd_ps,
        load16,
        round16,
        _mm512_storeu_ps
    );
    kernel!(
        ymm,
        "avx2,fma,f16c",
        __m256,
        8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_fmadd_ps,
        load8,
        round8,
        _mm256_storeu_ps
    );
}

/// [`rows`]' value updates (AVX-512): six rows' accumulators for a slice of four registers of
/// the values each, in registers together, walking the cells any of them sees; at each cell
/// the slice of the value row is loaded and converted once, and each row that sees the cell
/// takes its update (its rescaling first where it raised the maximum), rounded through f16 as
/// [`regs`] rounds it. Rows and slices are independent element for element, so each row's
/// values are [`regs`]' (and [`chunk_scalar`]'s).
#[cfg(target_arch = "x86_64")]
mod shared {
    use super::{Steps, Values};
    use std::arch::x86_64::*;

    /// Rows walked together. AVX2 has no such walk: with its sixteen registers three rows'
    /// accumulators spilled, and SmolLM2's 8-row call took 12.7-13.6 ms of lone attention
    /// against 11.6-12.0 row by row, Gemma's 4.8-4.9 against 4.2-4.4 (AVX-512 turned off on
    /// this machine for the A/B).
    pub(super) const ROWS: usize = 6;
    /// Registers of values a row keeps per pass.
    const REGS: usize = 4;
    /// Values a pass covers.
    const SLICE: usize = REGS * 16;

    /// Whether [`run`] takes value rows of `dv` here (the CPU runs it, whole slices).
    pub(super) fn fits(dv: usize) -> bool {
        super::simd::zmm_ok() && dv.is_multiple_of(SLICE)
    }

    /// Each row's chunk accumulator (`accs[r * dv..]`, f16 values widened) from its steps, over
    /// the cells `union` (ascending, every cell of every row's steps); returns each row's sum S
    /// (`sums[r]`, [`super::add_weight`] with `fused`), folded as the walk goes.
    ///
    /// # Safety
    /// [`fits`] holds for `values.dv`; at most [`ROWS`] rows; every cell's value row is inside
    /// `values.data`; `accs` holds `steps.len() * dv`.
    pub(super) unsafe fn run(
        steps: &[Steps],
        union: &[u32],
        values: Values<'_>,
        fused: bool,
        accs: &mut [f32],
    ) -> [f32; ROWS] {
        assert!(steps.len() <= ROWS && accs.len() >= steps.len() * values.dv);
        let mut sums = [0f32; ROWS];
        let out = accs.as_mut_ptr();
        // Every slice folds the same sums (a chain that waits on nothing the vectors do).
        let s = &mut sums;
        for off in (0..values.dv).step_by(SLICE) {
            match steps.len() {
                1 => walk::<1>(steps, union, values, off, fused, out, s),
                2 => walk::<2>(steps, union, values, off, fused, out, s),
                3 => walk::<3>(steps, union, values, off, fused, out, s),
                4 => walk::<4>(steps, union, values, off, fused, out, s),
                5 => walk::<5>(steps, union, values, off, fused, out, s),
                _ => walk::<6>(steps, union, values, off, fused, out, s),
            }
        }
        sums
    }

    /// Values `off..off + SLICE` of the `G` rows' accumulators, and their sums in `sums`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn walk<const G: usize>(
        steps: &[Steps],
        union: &[u32],
        values: Values<'_>,
        off: usize,
        fused: bool,
        out: *mut f32,
        sums: &mut [f32],
    ) {
        use super::regs::{load16, round16};
        let steps: [&Steps; G] = std::array::from_fn(|r| &steps[r]);
        let mut acc = [[_mm512_setzero_ps(); REGS]; G];
        let mut s = [0f32; G];
        let mut next = [0usize; G];
        let vp = values.data.as_ptr().add(off);
        for &c in union {
            let v = vp.add(c as usize * values.stride);
            let x: [__m512; REGS] = std::array::from_fn(|j| load16(v.add(16 * j)));
            for r in 0..G {
                let (st, k) = (steps[r], next[r]);
                if k >= st.cells.len() || *st.cells.get_unchecked(k) != c {
                    continue;
                }
                next[r] = k + 1;
                let e = *st.e.get_unchecked(k);
                let (ms, vs) = if *st.raised.get_unchecked(k) != 0 {
                    let w = _mm512_set1_ps(e);
                    for a in acc[r].iter_mut() {
                        *a = round16(_mm512_mul_ps(*a, w));
                    }
                    (e, 1.0)
                } else {
                    (1.0, e)
                };
                let w = _mm512_set1_ps(vs);
                for (a, xj) in acc[r].iter_mut().zip(&x) {
                    *a = round16(_mm512_fmadd_ps(*xj, w, *a));
                }
                s[r] = super::add_weight(s[r], ms, vs, fused);
            }
        }
        let dv = values.dv;
        for (r, regs) in acc.iter().enumerate() {
            for (j, a) in regs.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * dv + off + 16 * j), *a);
            }
        }
        sums[..G].copy_from_slice(&s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::XorShift;

    /// Softmax-weighted values in f64 from the same scores: what every rounding approximates.
    fn exact(scores: &[f32], mask: &[f32], scale: f32, values: &[u16], dv: usize) -> Vec<f64> {
        let vis: Vec<usize> = (0..scores.len())
            .filter(|&c| mask[c] != f32::NEG_INFINITY)
            .collect();
        let m = vis
            .iter()
            .map(|&c| f64::from(scores[c] * scale))
            .fold(f64::NEG_INFINITY, f64::max);
        let mut out = vec![0f64; dv];
        let mut s = 0f64;
        for &c in &vis {
            let w = (f64::from(scores[c] * scale) - m).exp();
            s += w;
            for (o, &v) in out.iter_mut().zip(&values[c * dv..(c + 1) * dv]) {
                *o += w * f64::from(to_f32(v));
            }
        }
        out.iter().map(|o| o / s).collect()
    }

    /// The accumulator updates give the scalar arithmetic's halves (on x86-64 the F16C path
    /// against the portable one), ties and subnormals included.
    #[test]
    fn f16_updates_match_the_scalar_arithmetic() {
        let mut rng = XorShift::new(11);
        for n in [1usize, 8, 13, 64, 256] {
            for w in [0.0f32, 1.0, 0.3, 1e-5, 0.999_999, 37.5] {
                let acc0: Vec<u16> = (0..n)
                    .map(|i| from_f32(rng.centered() * if i % 3 == 0 { 1e-4 } else { 4.0 }))
                    .collect();
                let v: Vec<u16> = (0..n).map(|_| from_f32(rng.centered() * 2.0)).collect();
                let mut got = acc0.clone();
                mad_f16(&mut got, &v, w);
                let want: Vec<u16> = acc0
                    .iter()
                    .zip(&v)
                    .map(|(&a, &v)| from_f32(to_f32(v).mul_add(w, to_f32(a))))
                    .collect();
                assert_eq!(got, want, "mad, {n} halves, w {w}");
                let mut got = acc0.clone();
                scale_f16(&mut got, w);
                let want: Vec<u16> = acc0.iter().map(|&a| from_f32(to_f32(a) * w)).collect();
                assert_eq!(got, want, "scale, {n} halves, w {w}");
            }
        }
    }

    /// The AVX-512 build's dot product: the kernel gives the portable arithmetic's sums (with
    /// leftovers past the last step of 64), and both approximate the exact product.
    #[test]
    fn zmm_dot_matches_its_reference() {
        let mut rng = XorShift::new(13);
        for n in [64usize, 100, 256] {
            let k: Vec<u16> = (0..n).map(|_| from_f32(rng.centered() * 4.0)).collect();
            let q: Vec<f32> = (0..n)
                .map(|_| to_f32(from_f32(rng.centered() * 4.0)))
                .collect();
            let got = dot_zmm(&k, &q);
            let exact: f64 = k
                .iter()
                .zip(&q)
                .map(|(&a, &b)| f64::from(to_f32(a)) * f64::from(b))
                .sum();
            assert!(
                (f64::from(got) - exact).abs() < 1e-3 * (1.0 + exact.abs()),
                "{got} vs {exact}"
            );
            let np = n / 64 * 64;
            let mut sum = [[0f32; 16]; 4];
            for i in (0..np).step_by(64) {
                for (j, s) in sum.iter_mut().enumerate() {
                    for (l, s) in s.iter_mut().enumerate() {
                        *s = to_f32(k[i + 16 * j + l]).mul_add(q[i + 16 * j + l], *s);
                    }
                }
            }
            let x0: [f32; 16] =
                std::array::from_fn(|l| (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]));
            let mut want = f64::from(reduce_add_16(&x0));
            for e in np..n {
                want += f64::from(to_f32(k[e]) * q[e]);
            }
            assert_eq!(got.to_bits(), (want as f32).to_bits(), "{n} elements");
        }
    }

    /// Lone rows, split or not, stay within the f16 accumulator's precision of exact
    /// attention; a row whose every cell is masked gives zeros; splitting over threads changes
    /// the bits (the reason a verification row must know the lone call's thread count).
    #[test]
    fn lone_rows_approximate_attention_and_split_changes_bits() {
        let mut rng = XorShift::new(7);
        let dv = 64;
        let r = Rounding {
            sum_fused: true,
            merge: Merge::FirstFused,
            half: 0,
        };
        let mut split_differs = false;
        for n_kv in [100usize, 511, 512, 1000] {
            let scores: Vec<f32> = (0..n_kv).map(|_| rng.centered() * 8.0).collect();
            let mask: Vec<f32> = (0..n_kv)
                .map(|c| if c % 11 == 3 { f32::NEG_INFINITY } else { 0.0 })
                .collect();
            let keys = Keys {
                scores: &scores,
                mask: &mask,
            };
            let values: Vec<u16> = (0..n_kv * dv).map(|_| from_f32(rng.centered())).collect();
            let vals = Values {
                data: &values,
                stride: dv,
                dv,
            };
            let want = exact(&scores, &mask, 0.125, &values, dv);
            let mut one = vec![0f32; dv];
            row(keys, 0.125, vals, 1, r, &mut one);
            for threads in [1usize, 2, 3] {
                let mut got = vec![0f32; dv];
                row(keys, 0.125, vals, threads, r, &mut got);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (f64::from(*g) - w).abs() < 2e-3,
                        "{n_kv} cells, {threads}: {g} vs {w}"
                    );
                }
                if n_kv < SPLIT_FROM {
                    assert_eq!(got, one, "under {SPLIT_FROM} cells a row is one chunk");
                } else if threads > 1 {
                    split_differs |= got
                        .iter()
                        .zip(&one)
                        .any(|(a, b)| a.to_bits() != b.to_bits());
                }
            }
            let hidden = vec![f32::NEG_INFINITY; n_kv];
            let mut got = vec![1f32; dv];
            let keys = Keys {
                mask: &hidden,
                ..keys
            };
            row(keys, 0.125, vals, 2, r, &mut got);
            assert!(got.iter().all(|&g| g == 0.0));
        }
        assert!(split_differs);
    }

    /// The AVX-512 maxima pass gives the scalar pass's steps exactly: chunks starting and
    /// ending inside a block of sixteen, shorter than one, masked runs (a sliding window's
    /// start, a tail, scattered cells, whole blocks), ties and signed zeros, rising keys (the
    /// maximum moving in most blocks), a cell at -inf that is not masked, and a NaN (which
    /// takes the scalar pass).
    #[test]
    fn vector_maxima_pass_gives_the_scalar_steps() {
        #[cfg(target_arch = "x86_64")]
        if !simd::zmm_ok() {
            eprintln!("no AVX-512 here: the scalar pass is the only one");
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        return;
        #[cfg(target_arch = "x86_64")]
        {
            let mut rng = XorShift::new(23);
            let mut checked = 0;
            for case in 0..400usize {
                let n = 1 + (case * 37) % 300;
                let rising = case % 3 == 1;
                let mut scores: Vec<f32> = (0..n)
                    .map(|i| {
                        let v = rng.centered() * 4.0;
                        let v = if case % 5 == 0 {
                            (v * 2.0).round() * 0.5
                        } else {
                            v
                        };
                        v + if rising { i as f32 * 0.05 } else { 0.0 }
                    })
                    .collect();
                if case % 7 == 0 {
                    // Zeros of both signs tie for the maximum.
                    for (i, v) in scores.iter_mut().enumerate() {
                        *v = if i % 4 == 1 {
                            if i % 8 == 1 {
                                0.0
                            } else {
                                -0.0
                            }
                        } else {
                            -v.abs()
                        };
                    }
                }
                if case % 11 == 3 {
                    scores[n / 2] = f32::NEG_INFINITY;
                }
                let nan = case % 50 == 9;
                if nan {
                    scores[n / 3] = f32::NAN;
                }
                let window = if case % 4 == 2 { n / 3 } else { 0 };
                let mask: Vec<f32> = (0..n)
                    .map(|c| {
                        if c < window || c + 5 >= n && case % 2 == 0 || c % 29 == 7 {
                            f32::NEG_INFINITY
                        } else if case % 7 == 0 {
                            // x keeps the score's sign of zero (-0 + -0 = -0).
                            -0.0
                        } else if case % 6 == 5 {
                            -0.5 * (c % 3) as f32
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let keys = Keys {
                    scores: &scores,
                    mask: &mask,
                };
                let (c0, c1) = ((case * 13) % n.min(40), n - (case % 17).min(n / 2));
                if c0 > c1 {
                    continue;
                }
                let mut want = Steps::default();
                want.scalar(keys, 0.125, c0, c1);
                let mut got = Steps::default();
                // SAFETY: AVX-512F checked; cells c0..c1 are inside both slices.
                let took = unsafe { simd::steps(&mut got, keys, 0.125, c0, c1) };
                let has_nan = (c0..c1).any(|c| scores[c].is_nan() && mask[c] != f32::NEG_INFINITY);
                assert_eq!(took, !has_nan, "case {case}");
                if !took {
                    continue;
                }
                assert_eq!(got.cells, want.cells, "case {case}");
                assert_eq!(got.raised, want.raised, "case {case}");
                assert_eq!(got.m.to_bits(), want.m.to_bits(), "case {case}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.e), bits(&want.e), "case {case}");
                checked += 1;
            }
            assert!(checked > 300);
        }
    }

    /// Random rows over one set of values: keys rising on some rows (the maximum moves all
    /// along), each row's own hidden cells (a window's start on some, a tail past the row, a
    /// scattered few), and one row that sees nothing.
    fn batch(
        rng: &mut XorShift,
        rows: usize,
        n: usize,
        dv: usize,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<u16>) {
        let scores = (0..rows)
            .map(|r| {
                (0..n)
                    .map(|i| rng.centered() * 5.0 + if r % 3 == 1 { i as f32 * 0.02 } else { 0.0 })
                    .collect()
            })
            .collect();
        let masks = (0..rows)
            .map(|r| {
                (0..n)
                    .map(|c| {
                        let hidden = r == 4
                            || (r % 2 == 1 && c < n / 4)
                            || c + rows > n + r
                            || (c * 7 + r) % 31 == 3;
                        if hidden {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                    .collect()
            })
            .collect();
        let values = (0..n * (dv + 16))
            .map(|_| from_f32(rng.centered() * 2.0))
            .collect();
        (scores, masks, values)
    }

    /// The shared walk gives each row the halves' arithmetic's accumulator and sum bit for bit,
    /// with either sum's rounding, one to six rows that see different cells.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn shared_updates_are_each_rows_own() {
        let mut rng = XorShift::new(29);
        let mut compared = 0;
        for dv in [64usize, 128, 256] {
            if !shared::fits(dv) {
                eprintln!("no shared walk here (AVX-512)");
                return;
            }
            for (count, fused) in [(1usize, true), (2, false), (3, true), (5, false), (6, true)] {
                let n = 333;
                let (scores, masks, data) = batch(&mut rng, count, n, dv);
                let vals = Values {
                    data: &data,
                    stride: dv + 16,
                    dv,
                };
                let steps: Vec<Steps> = (0..count)
                    .map(|r| {
                        let mut st = Steps::default();
                        let keys = Keys {
                            scores: &scores[r],
                            mask: &masks[r],
                        };
                        st.of(keys, 0.11, 5, n);
                        st
                    })
                    .collect();
                let mut union: Vec<u32> = steps.iter().flat_map(|s| s.cells.clone()).collect();
                union.sort_unstable();
                union.dedup();
                let mut accs = vec![0f32; count * dv];
                // SAFETY: fits checked; at most six rows; the cells' rows are inside data; accs
                // sized.
                let sums = unsafe { shared::run(&steps, &union, vals, fused, &mut accs) };
                for (r, st) in steps.iter().enumerate() {
                    let mut want = vec![0f32; dv];
                    let r1 = Rounding {
                        sum_fused: fused,
                        merge: Merge::Plain,
                        half: 0,
                    };
                    let s = chunk_scalar(st, vals, r1, &mut want);
                    assert_eq!(
                        sums[r].to_bits(),
                        s.to_bits(),
                        "dv {dv}, {count} rows, row {r}: S"
                    );
                    let got = &accs[r * dv..(r + 1) * dv];
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "dv {dv}, {count} rows, row {r}"
                    );
                    compared += 1;
                }
            }
        }
        assert!(compared > 40);
    }

    /// [`rows`] gives each row [`row`]'s output bit for bit: views below and above the split,
    /// one to three threads, both sums' roundings and every merge, value rows the shared walk
    /// takes and one it does not (48), and more rows than go at once.
    #[test]
    fn rows_are_each_row_alone() {
        let mut rng = XorShift::new(31);
        for dv in [64usize, 256, 48] {
            for (n, threads) in [(300usize, 2usize), (1024, 2), (1000, 3), (700, 1)] {
                for count in [1usize, 2, 7, 13] {
                    let (scores, masks, data) = batch(&mut rng, count, n, dv);
                    let vals = Values {
                        data: &data,
                        stride: dv + 16,
                        dv,
                    };
                    let keys: Vec<Keys<'_>> = (0..count)
                        .map(|r| Keys {
                            scores: &scores[r],
                            mask: &masks[r],
                        })
                        .collect();
                    for rounding in roundings() {
                        let mut got = vec![0f32; count * dv];
                        let mut outs: Vec<&mut [f32]> = got.chunks_mut(dv).collect();
                        rows(&keys, 0.13, vals, threads, rounding, &mut outs);
                        for (r, k) in keys.iter().enumerate() {
                            let mut want = vec![0f32; dv];
                            row(*k, 0.13, vals, threads, rounding, &mut want);
                            let g = &got[r * dv..(r + 1) * dv];
                            assert!(
                                g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "dv {dv}, n {n}, {threads} threads, {count} rows, row {r}, {rounding:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A chunk's scores (rising along it, if asked, so that the maximum moves), a mask hiding
    /// every 13th cell, and `n` value rows of `dv` spaced `dv + 8` apart.
    fn chunk_case(
        rng: &mut XorShift,
        dv: usize,
        n: usize,
        rising: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<u16>) {
        let scores = (0..n)
            .map(|i| rng.centered() * 6.0 + if rising { i as f32 * 0.06 } else { 0.0 })
            .collect();
        let mask = (0..n)
            .map(|c| if c % 13 == 5 { f32::NEG_INFINITY } else { 0.0 })
            .collect();
        let values = (0..n * (dv + 8))
            .map(|_| from_f32(rng.centered() * 3.0))
            .collect();
        (scores, mask, values)
    }

    /// The register kernels give the halves-in-memory arithmetic's bits: head sizes the
    /// registers hold and one they do not, value rows apart by more than their length, masked
    /// cells, and keys rising so that the maximum moves (the rescaling steps) all along a chunk.
    #[test]
    fn register_chunks_match_the_scalar_arithmetic() {
        let mut rng = XorShift::new(17);
        for dv in [64usize, 128, 256, 48] {
            for (n, rising) in [(300usize, false), (300, true), (37, true)] {
                let (scores, mask, values) = chunk_case(&mut rng, dv, n, rising);
                let keys = Keys {
                    scores: &scores,
                    mask: &mask,
                };
                let vals = Values {
                    data: &values,
                    stride: dv + 8,
                    dv,
                };
                for (fused, wide) in [(true, true), (false, true), (true, false), (false, false)] {
                    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
                    let (mut a, mut b) = (vec![0f32; dv], vec![0f32; dv]);
                    let mut steps = Steps::default();
                    steps.of(keys, 0.09, 2, n);
                    #[cfg(target_arch = "x86_64")]
                    let got = regs::chunk(&steps, vals, fused, &mut a, wide);
                    #[cfg(not(target_arch = "x86_64"))]
                    let got: Option<f32> = None;
                    let Some(got) = got else {
                        eprintln!("no register kernel for {dv} (wide {wide}) here");
                        continue;
                    };
                    let r = Rounding {
                        sum_fused: fused,
                        merge: Merge::Plain,
                        half: 0,
                    };
                    let want = chunk_scalar(&steps, vals, r, &mut b);
                    assert_eq!(got.to_bits(), want.to_bits(), "{dv} {n} S");
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{dv} {n} {rising} {fused} {wide}"
                    );
                    assert!(a.iter().any(|&x| x != 0.0));
                }
            }
        }
    }
    /// The half nearest `x` (ties to even), found by comparing distances to the neighbours of
    /// f32's rounding: independent of [`half_of`]'s rounding to odd.
    fn nearest_half(x: f64) -> u16 {
        let h = from_f32(x as f32);
        let cands = [h.wrapping_sub(1), h, h.wrapping_add(1)];
        let mut best = h;
        let mut best_d = f64::INFINITY;
        for c in cands {
            // Neighbours across zero or into infinity/NaN are not candidates here.
            let f = to_f32(c);
            if !f.is_finite() || (c ^ h) & 0x8000 != 0 {
                continue;
            }
            let d = (f64::from(f) - x).abs();
            if d < best_d || (d == best_d && c & 1 == 0) {
                (best, best_d) = (c, d);
            }
        }
        best
    }

    /// Halves spread over the range that matters: ordinary values, ones near 1 (softmax
    /// weights), subnormals, and large ones near overflow.
    fn some_halves(rng: &mut XorShift, n: usize) -> Vec<u16> {
        (0..n)
            .map(|i| match i % 5 {
                0 => from_f32(rng.centered() * 4.0),
                1 => from_f32(1.0 - rng.centered().abs() * 1e-3),
                2 => from_f32(rng.centered() * 1e-6),
                3 => from_f32(rng.centered() * 3e4),
                _ => (rng.next() as u16) & 0x7bff | ((rng.next() as u16) & 0x8000),
            })
            .collect()
    }

    /// The half-precision updates round once: the portable arithmetic against the nearest half
    /// of the exact value, and on a CPU with AVX512-FP16 its instructions against the portable
    /// arithmetic (ties, subnormals, overflow and lengths off its 32 lanes included).
    #[test]
    fn half_updates_round_once() {
        let mut rng = XorShift::new(41);
        let mut differs_from_f32 = false;
        for n in [1usize, 31, 32, 33, 128, 256, 1000] {
            for w in [0.0f32, 1.0, 0.3, 1e-5, 6e-8, 0.999_999, 37.5, 2.0] {
                let acc0 = some_halves(&mut rng, n);
                let v = some_halves(&mut rng, n);
                let wh = from_f32(w);
                let mut want = acc0.clone();
                mad_half_portable(&mut want, &v, wh);
                for ((&a, &x), &got) in acc0.iter().zip(&v).zip(&want) {
                    let exact = f64::from(to_f32(x)) * f64::from(to_f32(wh)) + f64::from(to_f32(a));
                    if exact.is_finite() && exact.abs() < 65504.0 {
                        assert_eq!(got, nearest_half(exact), "{a:#x} + {x:#x} * {w}");
                    }
                    // What the other builds compute: f32 arithmetic, the weight unrounded.
                    let single = from_f32(to_f32(x).mul_add(w, to_f32(a)));
                    differs_from_f32 |= single != got;
                }
                let mut got = acc0.clone();
                mad_half(&mut got, &v, w);
                assert_eq!(got, want, "mad, {n} halves, w {w}");
                let mut got = acc0.clone();
                scale_half(&mut got, w);
                let want: Vec<u16> = acc0
                    .iter()
                    .map(|&a| nearest_half(f64::from(to_f32(a)) * f64::from(to_f32(wh))))
                    .collect();
                for (g, w) in got.iter().zip(&want) {
                    if to_f32(*w).is_finite() && to_f32(*w).abs() < 65504.0 {
                        assert_eq!(g, w, "scale, {n} halves");
                    }
                }
            }
        }
        assert!(
            differs_from_f32,
            "the f32 arithmetic gave the half-precision arithmetic's halves everywhere"
        );
        if !half_ok() {
            eprintln!("no AVX512-FP16 here: the portable arithmetic only");
        }
    }

    /// [`half_of`] on sums chosen to sit exactly on, just below and just above a half's
    /// rounding boundary, where rounding through f32 first would go wrong.
    #[test]
    fn half_of_rounds_near_ties_once() {
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10; a little more or less decides it.
        let tie = 1.0 + 2f64.powi(-11);
        assert_eq!(half_of(tie), 0x3c00);
        assert_eq!(half_of(tie + 2f64.powi(-40)), 0x3c01);
        assert_eq!(half_of(tie - 2f64.powi(-40)), 0x3c00);
        // Through f32, tie + 2^-40 would become the tie and round to even: 1.
        assert_eq!(from_f32((tie + 2f64.powi(-40)) as f32), 0x3c00);
        // Subnormal halves: 2^-24 is the least; 1.5 * 2^-24 is a tie to even (2 * 2^-24).
        assert_eq!(half_of(1.5 * 2f64.powi(-24)), 0x0002);
        assert_eq!(half_of(1.5 * 2f64.powi(-24) - 2f64.powi(-60)), 0x0001);
        assert_eq!(half_of(-(tie + 2f64.powi(-40))), 0xbc01);
    }

    /// Rows whose values ggml updates in half-precision arithmetic: the register kernel gives
    /// the halves-in-memory arithmetic's bits; a row partly in halves (a head size off the
    /// step) is computed too; the results approximate exact attention and differ from the
    /// f32 arithmetic's (so a check against ggml can tell the two apart).
    #[test]
    fn half_rows_match_the_scalar_arithmetic() {
        let mut rng = XorShift::new(43);
        let mut differs = false;
        for dv in [128usize, 256, 192, 64] {
            for (n, rising) in [(300usize, false), (300, true), (37, true)] {
                let (scores, mask, values) = chunk_case(&mut rng, dv, n, rising);
                let keys = Keys {
                    scores: &scores,
                    mask: &mask,
                };
                let vals = Values {
                    data: &values,
                    stride: dv + 8,
                    dv,
                };
                let mut steps = Steps::default();
                steps.of(keys, 0.09, 0, n);
                let half = Rounding {
                    sum_fused: true,
                    merge: Merge::FirstFused,
                    half: HALF_STEP_AVX512FP16,
                };
                let mut b = vec![0f32; dv];
                let want_s = chunk_scalar(&steps, vals, half, &mut b);
                #[cfg(target_arch = "x86_64")]
                let mut a = vec![0f32; dv];
                #[cfg(target_arch = "x86_64")]
                if let Some(s) = regs::chunk_half(&steps, vals, true, &mut a) {
                    assert_eq!(s.to_bits(), want_s.to_bits());
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{dv} {n} {rising}"
                    );
                }
                let mut single = vec![0f32; dv];
                chunk_scalar(&steps, vals, Rounding { half: 0, ..half }, &mut single);
                let h = half.half_len(dv);
                assert!(
                    single[h..] == b[h..],
                    "{dv}: the part past the steps is f32's"
                );
                differs |= single[..h] != b[..h];
                let want = exact(
                    &scores,
                    &mask,
                    0.09,
                    &values_rows(&values, dv + 8, dv, n),
                    dv,
                );
                for (g, w) in b.iter().zip(&want) {
                    let g = f64::from(*g) / f64::from(want_s);
                    assert!((g - w).abs() < 2e-2 * (1.0 + w.abs()), "{dv}: {g} vs {w}");
                }
            }
        }
        assert!(differs, "half-precision updates gave f32's bits");
    }

    /// The AArch64 FP16 build's dot product: the CPU's half arithmetic (where it has it) gives
    /// the portable arithmetic's lanes; the sum approximates the exact product as closely as
    /// sums in halves can, and differs from the f32 builds' (so a check can tell them apart).
    #[test]
    fn half_dot_matches_its_reference() {
        let mut rng = XorShift::new(47);
        let mut differs = false;
        for n in [32usize, 64, 100, 256] {
            for _ in 0..20 {
                let k: Vec<u16> = (0..n).map(|_| from_f32(rng.centered() * 4.0)).collect();
                let q: Vec<f32> = (0..n)
                    .map(|_| to_f32(from_f32(rng.centered() * 4.0)))
                    .collect();
                let qh: Vec<u16> = q.iter().map(|&x| from_f32(x)).collect();
                #[cfg(target_arch = "aarch64")]
                if half_ok() {
                    let np = n / 32 * 32;
                    // SAFETY: the CPU has FP16 arithmetic; np values in both.
                    let got = unsafe { neon::dot_half_lanes(&k, &qh, np) };
                    assert_eq!(got, dot_half_lanes(&k, &qh, np), "{n} elements");
                }
                let got = dot_half(&k, &qh, &q);
                let exact: f64 = k
                    .iter()
                    .zip(&q)
                    .map(|(&a, &b)| f64::from(to_f32(a)) * f64::from(b))
                    .sum();
                let mag: f64 = k
                    .iter()
                    .zip(&q)
                    .map(|(&a, &b)| (f64::from(to_f32(a)) * f64::from(b)).abs())
                    .sum();
                assert!(
                    (f64::from(got) - exact).abs() <= 4e-3 * mag,
                    "{n}: {got} vs {exact}"
                );
                differs |= got.to_bits() != dot_zmm(&k, &q).to_bits();
            }
        }
        assert!(differs, "sums in halves gave f32's sums everywhere");
        if !half_ok() {
            eprintln!("no FP16 arithmetic here: the portable arithmetic only");
        }
    }

    /// The `dv` values of each of `n` cells laid `stride` apart, packed.
    fn values_rows(data: &[u16], stride: usize, dv: usize, n: usize) -> Vec<u16> {
        (0..n)
            .flat_map(|c| data[c * stride..c * stride + dv].iter().copied())
            .collect()
    }
}

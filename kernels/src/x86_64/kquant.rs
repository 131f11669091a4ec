//! Weight-stationary kernels for ggml's k-quants (`Q4_K`, `Q6_K`: super-blocks of 256 weights
//! with 6- or 8-bit sub-block scales) against `Q8_K` activations.
//!
//! One weight row against a group of up to [`PASS`] activation rows at a time (the group size
//! a constant, so every integer sum lives in a register): each 64 quants of a super-block and
//! their scale vectors are unpacked once for the group, and every row then
//! runs ggml's AVX2 `vec_dot_q4_K_q8_K` / `vec_dot_q6_K_q8_K` arithmetic on them: the same
//! integer lane sums (exact, so their order is free), the same fused multiply-adds per
//! super-block in the same lanes, and ggml's final reductions, so each result is bit-identical
//! to ggml's single-row call. The scale shuffles are tables (one load each): building them with
//! `_mm256_setr_epi8` in the loop cost more than the arithmetic.
//!
//! Where the CPU has AVX-512BW and VNNI, [`zmm`] runs the same arithmetic two 256-bit operands
//! to a register, eight rows to a group.

use std::arch::x86_64::*;

use super::{Q4K_BYTES, Q6K_BYTES, Q8K_BYTES};

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

/// `PAIR[i]`: 16-bit scale pair `i` (bytes 2i, 2i+1) broadcast over a register (`Q4_K`'s
/// shuffle), as a table so each is one load.
static PAIR: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut i = 0;
    while i < 8 {
        let mut k = 0;
        while k < 32 {
            t[i][k] = (2 * i + k % 2) as u8;
            k += 1;
        }
        i += 1;
    }
    t
};

#[inline(always)]
unsafe fn pair_shuffle(i: usize) -> __m256i {
    _mm256_loadu_si256(PAIR[i].as_ptr().cast())
}

/// `HALF[i]`: scale bytes 2i (8 times) then 2i+1 (8 times) (`Q6_K`'s shuffle).
static HALF: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut i = 0;
    while i < 8 {
        let mut k = 0;
        while k < 16 {
            t[i][k] = (2 * i + k / 8) as u8;
            k += 1;
        }
        i += 1;
    }
    t
};

#[inline(always)]
unsafe fn half_shuffle(i: usize) -> __m128i {
    _mm_loadu_si128(HALF[i].as_ptr().cast())
}

/// Asks for the super-block [`crate::qdot::AHEAD`] bytes past the one at `x` (`bytes` long,
/// every cache line of it), so a matrix streamed from DRAM arrives before it is read.
#[inline(always)]
unsafe fn prefetch(x: *const u8, bytes: usize) {
    let at = x.wrapping_add(crate::qdot::AHEAD);
    for l in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(l).cast());
    }
}

/// A `Q4_K` super-block's (at `x`) eight 6-bit sub-block scales and eight minima, each
/// widened to 16 bits (ggml's `utmp` unpacking).
#[inline(always)]
unsafe fn q4k_scales_mins(x: *const u8) -> (__m128i, __m128i) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
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
    (
        _mm256_extracti128_si256(ms, 0),
        _mm256_extracti128_si256(ms, 1),
    )
}

/// `acc_m` with one activation super-block's (at `y`) minimum term added: its `Q8_K` block
/// sums against the weight's `mins`, times `-d * xdmin` (ggml's `acc_m` step).
#[inline(always)]
unsafe fn q4k_min_term(y: *const u8, mins: __m128i, xdmin: f32, acc_m: __m128) -> __m128 {
    let dmin = -std::ptr::read_unaligned(y.cast::<f32>()) * xdmin;
    let q8sums = _mm256_loadu_si256(y.add(260).cast());
    let q8s = _mm_hadd_epi16(
        _mm256_extracti128_si256(q8sums, 0),
        _mm256_extracti128_si256(q8sums, 1),
    );
    let prod = _mm_madd_epi16(mins, q8s);
    _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m)
}

/// A `Q4_K` row's result from its accumulators (ggml's final reductions).
#[inline(always)]
unsafe fn q4k_result(acc: __m256, acc_m: __m128) -> f32 {
    let mut am = acc_m;
    am = _mm_add_ps(am, _mm_movehl_ps(am, am));
    am = _mm_add_ss(am, _mm_movehdup_ps(am));
    hsum8(acc) + _mm_cvtss_f32(am)
}

/// A `Q6_K` row's integer sums' start for one activation super-block (at `y`): minus 32 times
/// its scale-weighted `Q8_K` block sums (ggml subtracts them at the end; exact either way).
#[inline(always)]
unsafe fn q6k_offset(y: *const u8, scales_16: __m256i) -> __m256i {
    let q8sums = _mm256_loadu_si256(y.add(260).cast());
    _mm256_sub_epi32(
        _mm256_setzero_si256(),
        _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5),
    )
}

/// Activation rows per pass over a weight row: the 32-weight blocks' 256-bit kernels' eight
/// ([`super::WIDE`]); four made an 8-row call unpack every super-block's quants and scales twice.
/// The integer sums and the unpacked operands fit the sixteen registers; the float
/// accumulators, used once a super-block, may live on the stack. `qdot/Q6K/avx2/8` and
/// `qdot/Q4K/avx2/8` (kernels bench, one thread, the AVX2-only Zen 4 VM, four alternating runs):
/// 421-569 against 515-694 us, and 473-564 against 556-730 us; a one-row call is unchanged.
const PASS: usize = super::WIDE;

/// `$f::<R>(ys, nb, x, out)` for `R` = `ys.len()`, one of `$n` or else `$last` (the group
/// size is a constant in each kernel, so every accumulator lives in a register).
macro_rules! by_count {
    ($f:ident, $ys:expr, $nb:expr, $x:expr, $o:expr, [$($n:literal),*], $last:literal) => {
        match $ys.len() {
            $($n => $f::<$n>($ys, $nb, $x, $o),)*
            _ => $f::<$last>($ys, $nb, $x, $o),
        }
    };
}

/// `out[i * rows.len() + r]` = weight row i (of `nb` `Q4_K` super-blocks in `w`) ·
/// `rows[r]`.
///
/// # Safety
/// The CPU has these features; every activation row holds `nb` `Q8_K` super-blocks;
/// `w` whole rows; `out` one value per weight row and activation row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    super::by_groups::<PASS>(rows, nb, w, Q4K_BYTES, out, |ys, x, o| {
        by_count!(q4k_rows, ys, nb, x, o, [1, 2, 3, 4, 5, 6, 7], 8)
    })
}

/// As the `Q4_K` kernel beside it, for `Q6_K` weights.
///
/// # Safety
/// As that kernel.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    super::by_groups::<PASS>(rows, nb, w, Q6K_BYTES, out, |ys, x, o| {
        by_count!(q6k_rows, ys, nb, x, o, [1, 2, 3, 4, 5, 6, 7], 8)
    })
}

/// Where one `Q4_K` weight row's quants of a super-block are, 32 bytes at a time: the bytes
/// whose low nibbles are run 2j of 32 quants and high nibbles run 2j + 1.
trait Q4kQuants {
    /// Those 32 bytes for `j` in 0..4.
    unsafe fn bits(&self, j: usize) -> __m256i;
}

/// A `Q4_K` block's 128 bytes of quants, in order (at `q4`).
struct Contiguous(*const u8);

impl Q4kQuants for Contiguous {
    #[inline(always)]
    unsafe fn bits(&self, j: usize) -> __m256i {
        _mm256_loadu_si256(self.0.add(32 * j).cast())
    }
}

/// Row `.1`'s quants in a `block_q4_Kx8` (at `.0`): its bytes 8c..8c + 8 at 128 + 8(8c + j).
struct Interleaved(*const u8, usize);

impl Q4kQuants for Interleaved {
    #[inline(always)]
    unsafe fn bits(&self, j: usize) -> __m256i {
        let q = |c: usize| {
            std::ptr::read_unaligned(self.0.add(128 + 8 * (8 * c + self.1)).cast::<i64>())
        };
        _mm256_set_epi64x(q(4 * j + 3), q(4 * j + 2), q(4 * j + 1), q(4 * j))
    }
}

/// Every row's integer sums of one `Q4_K` super-block: its quants (`q`) times each row's
/// `Q8_K` quants (`ys`, at the super-block), by sub-block scale (`scales`: the 8 scales in both
/// halves), 64 quants at a time, unpacked once for all rows. Exact, so each lane ends with
/// ggml's sum whatever the order.
#[inline(always)]
unsafe fn q4k_sums<const R: usize>(
    q: &impl Q4kQuants,
    scales: __m256i,
    ys: &[*const u8; R],
) -> [__m256i; R] {
    let m4 = _mm256_set1_epi8(0xF);
    let mut sumi = [_mm256_setzero_si256(); R];
    for j in 0..4 {
        let bits = q.bits(j);
        let ql = _mm256_and_si256(bits, m4);
        let qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        let sl = _mm256_shuffle_epi8(scales, pair_shuffle(2 * j));
        let sh = _mm256_shuffle_epi8(scales, pair_shuffle(2 * j + 1));
        for r in 0..R {
            let q8 = ys[r].add(4 + 64 * j);
            let l = _mm256_loadu_si256(q8.cast());
            let h = _mm256_loadu_si256(q8.add(32).cast());
            let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, l));
            let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, h));
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
        }
    }
    sumi
}

/// One `Q4_K` weight row (at `x`) against `R` activation rows: ggml's AVX2 `vec_dot_q4_K_q8_K`
/// for each row, with the weight quants and scales unpacked once per 64 values for all rows
/// and the accumulators in registers (`R` is a constant).
#[inline(always)]
unsafe fn q4k_rows<const R: usize>(ys: &[*const u8], nb: usize, x: *const u8, out: &mut [f32]) {
    let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm_setzero_ps(); R];
    for sb in 0..nb {
        let x = x.add(sb * Q4K_BYTES);
        prefetch(x, Q4K_BYTES);
        let (xd, xdmin) = (f16_at(x), f16_at(x.add(2)));
        let (sc, mins) = q4k_scales_mins(x);
        let scales = _mm256_set_m128i(sc, sc);
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
        for r in 0..R {
            acc_m[r] = q4k_min_term(ys[r], mins, xdmin, acc_m[r]);
        }
        // The quants, 64 at a time: unpacked once and multiplied into every row's integer
        // sums.
        let sumi = q4k_sums(&Contiguous(x.add(16)), scales, &ys);
        for r in 0..R {
            let d = std::ptr::read_unaligned(ys[r].cast::<f32>()) * xd;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for r in 0..R {
        out[r] = q4k_result(acc[r], acc_m[r]);
    }
}

/// `out[i * rows.len() + r]` = weight row i · `rows[r]` for `Q4_K` weights llama.cpp repacked
/// (`w`: whole groups of 8 weight rows, each `nb` `block_q4_Kx8`s, read in that layout), each
/// rounded as ggml's one-row product over them (x86's `ggml_gemv_q4_K_8x8_q8_K`, which ggml
/// runs for a lone row): the integer sums of the `Q4_K` kernel beside it, combined as that
/// function does.
///
/// # Safety
/// As that kernel; `w` is whole 8-row groups.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_x8(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
    let m = rows.len();
    const G: usize = PASS;
    for g0 in (0..m).step_by(G) {
        let gl = (m - g0).min(G);
        let ptrs: [*const u8; G] =
            std::array::from_fn(|r| rows.get(g0 + r).map_or(std::ptr::null(), |a| a.as_ptr()));
        let ys = &ptrs[..gl];
        for (g, group) in w.chunks_exact(nb * super::Q4K_X8_BYTES).enumerate() {
            for j in 0..8 {
                let i = 8 * g + j;
                let o = &mut out[i * m + g0..i * m + g0 + gl];
                let x = (group.as_ptr(), j);
                by_count!(q4k_x8_rows, ys, nb, x, o, [1, 2, 3, 4, 5, 6, 7], 8);
            }
        }
    }
}

/// The sum of the eight 32-bit lanes of `v` (exact: the callers' sums fit in 32 bits; `q8k`'s
/// too).
#[inline(always)]
pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Row `j`'s eight 6-bit sub-block scales and eight minima of a `block_q4_Kx8` (at `x`),
/// widened to 16 bits: sub-block s's 8 rows' values are packed in the 12 bytes at `32 + 12s`
/// (s < 4) or `32 + 48 + 12(s - 4)` as a `Q4_K` block packs its 8 (ggml's `get_scale_min_k4`).
#[inline(always)]
unsafe fn q4k_x8_scales_mins(x: *const u8, j: usize) -> (__m128i, __m128i) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for s in 0..8 {
        let at = 32 + if s < 4 { 12 * s } else { 48 + 12 * (s - 4) };
        (sc[s], mn[s]) =
            crate::reference::scale_min_k4(j, std::slice::from_raw_parts(x.add(at), 12));
    }
    (
        _mm_cvtepu8_epi16(_mm_loadl_epi64(sc.as_ptr().cast())),
        _mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr().cast())),
    )
}

/// Row `x.1` of the 8-row group at `x.0` (`nb` `block_q4_Kx8`s) against `R` activation rows,
/// each as ggml's repacked one-row product computes its column: per super-block the whole
/// integer sum `Σ scale_j · (q4 · q8)_j` and the minimum term `Σ min_j · (block sums)_j`, each
/// converted to `f32` and accumulated with one fused multiply-add by `d_w · d_a` and
/// `dmin_w · d_a`; the result is their difference. (The integer sums are exact in any order, so
/// the products are [`q4k_rows`]'; the row's quants are 8 bytes in every 64 of the group's.)
#[inline(always)]
unsafe fn q4k_x8_rows<const R: usize>(
    ys: &[*const u8],
    nb: usize,
    x: (*const u8, usize),
    out: &mut [f32],
) {
    let (group, j) = x;
    let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
    let mut acc = [0.0f32; R];
    let mut acc_m = [0.0f32; R];
    for sb in 0..nb {
        let x = group.add(sb * super::Q4K_X8_BYTES);
        let (xd, xdmin) = (f16_at(x.add(2 * j)), f16_at(x.add(16 + 2 * j)));
        let (sc, mins) = q4k_x8_scales_mins(x, j);
        let scales = _mm256_set_m128i(sc, sc);
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
        let sumi = q4k_sums(&Interleaved(x, j), scales, &ys);
        for r in 0..R {
            let yd = std::ptr::read_unaligned(ys[r].cast::<f32>());
            let q8sums = _mm256_loadu_si256(ys[r].add(260).cast());
            let pairs = _mm_hadd_epi16(
                _mm256_extracti128_si256(q8sums, 0),
                _mm256_extracti128_si256(q8sums, 1),
            );
            let mm = _mm_madd_epi16(mins, pairs);
            let mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0b01_00_11_10));
            let mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0b10_11_00_01));
            acc[r] = (hsum_i32(sumi[r]) as f32).mul_add(xd * yd, acc[r]);
            acc_m[r] = (_mm_cvtsi128_si32(mm) as f32).mul_add(xdmin * yd, acc_m[r]);
        }
    }
    for r in 0..R {
        out[r] = acc[r] - acc_m[r];
    }
}

/// As [`q4k_rows`] for `Q6_K` (ggml's AVX2 `vec_dot_q6_K_q8_K`).
#[inline(always)]
unsafe fn q6k_rows<const R: usize>(ys: &[*const u8], nb: usize, x: *const u8, out: &mut [f32]) {
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..nb {
        let x = x.add(sb * Q6K_BYTES);
        prefetch(x, Q6K_BYTES);
        let (ql, qhp) = (x, x.add(128));
        let xd = f16_at(x.add(208));
        let scales = _mm_loadu_si128(x.add(192).cast());
        let scales_16 = _mm256_cvtepi8_epi16(scales);
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
        let mut sumi: [__m256i; R] = std::array::from_fn(|r| q6k_offset(ys[r], scales_16));
        for j in 0..2 {
            let b1 = _mm256_loadu_si256(ql.add(64 * j).cast());
            let b2 = _mm256_loadu_si256(ql.add(64 * j + 32).cast());
            let bh = _mm256_loadu_si256(qhp.add(32 * j).cast());
            let h = [
                _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4),
                _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(12)), 2),
                _mm256_and_si256(bh, _mm256_set1_epi8(48)),
                _mm256_srli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(-64)), 2),
            ];
            let lo = [
                _mm256_and_si256(b1, m15),
                _mm256_and_si256(b2, m15),
                _mm256_and_si256(_mm256_srli_epi16(b1, 4), m15),
                _mm256_and_si256(_mm256_srli_epi16(b2, 4), m15),
            ];
            for g in 0..4 {
                let q = _mm256_or_si256(lo[g], h[g]);
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, half_shuffle(4 * j + g)));
                for r in 0..R {
                    let v = _mm256_loadu_si256(ys[r].add(4 + 128 * j + 32 * g).cast());
                    let p = _mm256_madd_epi16(sc, _mm256_maddubs_epi16(q, v));
                    sumi[r] = _mm256_add_epi32(sumi[r], p);
                }
            }
        }
        for r in 0..R {
            let d = std::ptr::read_unaligned(ys[r].cast::<f32>()) * xd;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for r in 0..R {
        out[r] = hsum8(acc[r]);
    }
}

/// The same arithmetic on 512-bit registers (AVX-512BW and VNNI), eight activation rows to a
/// pass over a weight row.
///
/// Each register holds two of ggml's 256-bit operands side by side: a sub-block pair's 64
/// quants (`Q4_K`'s low and high nibbles of 32 bytes, `Q6_K`'s groups g and g+1), the 64
/// activation bytes they meet (consecutive in `Q8_K`, so one load), and the pair's scales. A
/// row's products are then one `vpmaddubsw` and one `vpdpwssd` (ggml's `vpmaddwd` and
/// `vpaddd` in one, without saturation as those) per 64 quants, where ggml's code takes six
/// instructions. At a super-block's end the two halves are added: lane l of the sum is ggml's
/// lane l (the same four products of each half, added exactly), so the float steps after it
/// are ggml's own.
pub(super) mod zmm {
    use super::*;

    /// `PAIR2[j]`, in each 128-bit lane: scale pair `2j` over the low 256 bits, `2j + 1` over
    /// the high (`Q4_K`: the scales of the low and the high nibbles of quant bytes 32j..).
    static PAIR2: [[u8; 64]; 4] = {
        let mut t = [[0u8; 64]; 4];
        let mut j = 0;
        while j < 4 {
            let mut k = 0;
            while k < 64 {
                t[j][k] = (2 * (2 * j + k / 32) + k % 2) as u8;
                k += 1;
            }
            j += 1;
        }
        t
    };

    /// `HALF2[i]`: [`HALF`]`[2i]` then `HALF[2i + 1]` (`Q6_K`: groups 2i and 2i + 1's scale
    /// bytes, each for 16 quants).
    static HALF2: [[u8; 32]; 4] = {
        let mut t = [[0u8; 32]; 4];
        let mut i = 0;
        while i < 4 {
            let mut k = 0;
            while k < 32 {
                t[i][k] = HALF[2 * i + k / 16][k % 16];
                k += 1;
            }
            i += 1;
        }
        t
    };

    /// A 512-bit integer sum's halves added: ggml's 256-bit lanes.
    #[inline(always)]
    unsafe fn halves(x: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64::<1>(x))
    }

    /// `out[i * rows.len() + r]` = weight row i (of `nb` `Q4_K` super-blocks in `w`) ·
    /// `rows[r]`.
    ///
    /// # Safety
    /// The CPU has these features; every activation row holds `nb` `Q8_K` super-blocks; `w`
    /// whole rows; `out` one value per weight row and activation row.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(in crate::qdot) unsafe fn q4k(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
        crate::qdot::by_groups::<8>(rows, nb, w, Q4K_BYTES, out, |ys, x, o| {
            by_count!(q4k_rows, ys, nb, x, o, [1, 2, 3, 4, 5, 6, 7], 8)
        })
    }

    /// As the `Q4_K` kernel beside it, for `Q6_K` weights.
    ///
    /// # Safety
    /// As that kernel.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(in crate::qdot) unsafe fn q6k(rows: &[&[u8]], nb: usize, w: &[u8], out: &mut [f32]) {
        crate::qdot::by_groups::<8>(rows, nb, w, Q6K_BYTES, out, |ys, x, o| {
            by_count!(q6k_rows, ys, nb, x, o, [1, 2, 3, 4, 5, 6, 7], 8)
        })
    }

    /// [`super::q4k_rows`] on 512-bit registers.
    #[inline(always)]
    unsafe fn q4k_rows<const R: usize>(ys: &[*const u8], nb: usize, x: *const u8, out: &mut [f32]) {
        let m4 = _mm512_set1_epi8(0xF);
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut acc_m = [_mm_setzero_ps(); R];
        for sb in 0..nb {
            let x = x.add(sb * Q4K_BYTES);
            prefetch(x, Q4K_BYTES);
            let (xd, xdmin) = (f16_at(x), f16_at(x.add(2)));
            let (sc, mins) = q4k_scales_mins(x);
            let scales = _mm512_broadcast_i32x4(sc);
            let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
            for r in 0..R {
                acc_m[r] = q4k_min_term(ys[r], mins, xdmin, acc_m[r]);
            }
            let q4 = x.add(16);
            let mut sumi = [_mm512_setzero_si512(); R];
            for (j, pair) in PAIR2.iter().enumerate() {
                // Low nibbles of 32 bytes, then their high nibbles: 64 quants, against the
                // 64 activation bytes at 64j.
                let bits = _mm256_loadu_si256(q4.add(32 * j).cast());
                let q = _mm512_and_si512(
                    _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(bits),
                        _mm256_srli_epi16(bits, 4),
                    ),
                    m4,
                );
                let s = _mm512_shuffle_epi8(scales, _mm512_loadu_si512(pair.as_ptr().cast()));
                for r in 0..R {
                    let y = _mm512_loadu_si512(ys[r].add(4 + 64 * j).cast());
                    sumi[r] = _mm512_dpwssd_epi32(sumi[r], s, _mm512_maddubs_epi16(q, y));
                }
            }
            for r in 0..R {
                let d = std::ptr::read_unaligned(ys[r].cast::<f32>()) * xd;
                acc[r] = _mm256_fmadd_ps(
                    _mm256_set1_ps(d),
                    _mm256_cvtepi32_ps(halves(sumi[r])),
                    acc[r],
                );
            }
        }
        for r in 0..R {
            out[r] = q4k_result(acc[r], acc_m[r]);
        }
    }

    /// [`super::q6k_rows`] on 512-bit registers.
    #[inline(always)]
    unsafe fn q6k_rows<const R: usize>(ys: &[*const u8], nb: usize, x: *const u8, out: &mut [f32]) {
        let m15 = _mm512_set1_epi8(15);
        // Per half: which two bits of the high-bit byte a group takes, and how far they move
        // to bits 4 and 5 (groups 0 | 1 left, groups 2 | 3 right).
        let mask01 = _mm512_inserti64x4::<1>(_mm512_set1_epi8(3), _mm256_set1_epi8(12));
        let shl01 = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
        let mask23 = _mm512_inserti64x4::<1>(_mm512_set1_epi8(48), _mm256_set1_epi8(-64));
        let shr23 = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
        let ys: [*const u8; R] = std::array::from_fn(|r| ys[r]);
        let mut acc = [_mm256_setzero_ps(); R];
        for sb in 0..nb {
            let x = x.add(sb * Q6K_BYTES);
            prefetch(x, Q6K_BYTES);
            let (ql, qhp) = (x, x.add(128));
            let xd = f16_at(x.add(208));
            let scales = _mm_loadu_si128(x.add(192).cast());
            let scales_16 = _mm256_cvtepi8_epi16(scales);
            let scales2 = _mm256_broadcastsi128_si256(scales);
            let ys: [*const u8; R] = std::array::from_fn(|r| ys[r].add(sb * Q8K_BYTES));
            let base: [__m256i; R] = std::array::from_fn(|r| q6k_offset(ys[r], scales_16));
            let mut sumi = [_mm512_setzero_si512(); R];
            for j in 0..2 {
                let b = _mm512_loadu_si512(ql.add(64 * j).cast());
                let bh = _mm512_broadcast_i64x4(_mm256_loadu_si256(qhp.add(32 * j).cast()));
                let h01 = _mm512_sllv_epi16(_mm512_and_si512(bh, mask01), shl01);
                let h23 = _mm512_srlv_epi16(_mm512_and_si512(bh, mask23), shr23);
                let q01 = _mm512_or_si512(_mm512_and_si512(b, m15), h01);
                let q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), m15), h23);
                let s = |i: usize| {
                    _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(
                        scales2,
                        _mm256_loadu_si256(HALF2[i].as_ptr().cast()),
                    ))
                };
                let (s01, s23) = (s(2 * j), s(2 * j + 1));
                for r in 0..R {
                    let y = ys[r].add(4 + 128 * j);
                    let p01 = _mm512_maddubs_epi16(q01, _mm512_loadu_si512(y.cast()));
                    let p23 = _mm512_maddubs_epi16(q23, _mm512_loadu_si512(y.add(64).cast()));
                    sumi[r] = _mm512_dpwssd_epi32(sumi[r], s01, p01);
                    sumi[r] = _mm512_dpwssd_epi32(sumi[r], s23, p23);
                }
            }
            for r in 0..R {
                let d = std::ptr::read_unaligned(ys[r].cast::<f32>()) * xd;
                let s = _mm256_add_epi32(base[r], halves(sumi[r]));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc[r]);
            }
        }
        for r in 0..R {
            out[r] = hsum8(acc[r]);
        }
    }
}

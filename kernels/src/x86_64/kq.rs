//! The x86-64 kernels: 256-bit (AVX2/FMA/F16C) and, where the CPU has AVX-512F/VL, two cache
//! rows against four query rows in 32 registers; F16C's conversions, as ggml's on x86-64.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::{Dots, AHEAD_BYTES};

/// ggml's step: the products of elements `i` and `i + STEP` go to the same lane of the same
/// sum, and elements past the last whole step are the leftovers. A run of terms that are all
/// zero, starting and ending on a step boundary (or ending at the row's end), adds nothing to
/// any sum, so a caller may leave it out (`leap_backend::kqmm` does, for softmax rows).
pub const STEP: usize = 32;

/// The CPU runs [`dots_blocked`] (AVX2/FMA/F16C).
pub fn cpu_ok() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

fn wide() -> bool {
    use std::sync::OnceLock;
    static WIDE: OnceLock<bool> = OnceLock::new();
    *WIDE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
    })
}

/// The kernels this CPU runs (where [`cpu_ok`]), the device's first: [`dots_wide`] with
/// AVX-512VL, then [`dots_blocked`].
pub fn kernels() -> &'static [Dots] {
    const WIDE: &[Dots] = &[dots_wide, dots_blocked];
    const NARROW: &[Dots] = &[dots_blocked];
    if wide() {
        WIDE
    } else {
        NARROW
    }
}

/// `out` = `x` rounded to f16 (nearest even, F16C's `vcvtps2ph` as ggml uses) and back.
///
/// # Safety
/// [`cpu_ok`]; `out` is at least as long as `x`.
pub unsafe fn round_f16(x: &[f32], out: &mut [f32]) {
    // Sixteen at a time with AVX-512 (the same rounding of each value), the rest as below.
    #[target_feature(enable = "avx2,f16c,avx512f")]
    unsafe fn go16(x: &[f32], out: &mut [f32]) {
        let n16 = x.len() / 16 * 16;
        for i in (0..n16).step_by(16) {
            let v = _mm512_loadu_ps(x.as_ptr().add(i));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
        go(&x[n16..], &mut out[n16..x.len()])
    }
    if wide() {
        return go16(x, out);
    }
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn go(x: &[f32], out: &mut [f32]) {
        let n8 = x.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        for i in n8..x.len() {
            let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x[i]));
            out[i] = _mm_cvtss_f32(_mm_cvtph_ps(h));
        }
    }
    go(x, out)
}

/// How many cache rows ahead the kernels fetch: [`AHEAD_BYTES`] of them.
fn ahead(n: usize) -> usize {
    (AHEAD_BYTES / (2 * n)).clamp(2, 16)
}

/// Fetch into L1 the cache rows `ahead` rows past those of `now` (rows of `n` halves, `stride`
/// bytes apart from `x`, `rows` of them): the first query group's pass reads the cache from
/// memory.
#[inline(always)]
unsafe fn fetch_ahead(
    x: *const u8,
    stride: usize,
    rows: usize,
    now: std::ops::Range<usize>,
    ahead: usize,
    n: usize,
) {
    for j in now {
        if j + ahead < rows {
            let next = x.add((j + ahead) * stride);
            for l in (0..2 * n).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(next.add(l).cast());
            }
        }
    }
}

/// `sums[i * m + k]` = f16 row i (of `rows` at `x`, `stride` bytes apart) · query row k of `qs`
/// (rows of `n`; `m = sums.len() / rows` of them), ggml's way, with AVX2's 16 registers. Each
/// of ggml's four 8-lane sums of a (cache row, query row) pair is independent of the other
/// three until the reduction, so they are computed one after another ([`block`]) instead of
/// side by side. That leaves room for two cache rows against four query rows (8
/// accumulators): a query load feeds two fused multiply-adds and a converted cache load four,
/// where the kernel this one replaced (one cache row against two query rows, the four sums
/// side by side, until `efd247f`) gave one and two. (Three cache rows, 12 accumulators, ran
/// slower: Gemma's 8-row `kq` took 431-462 us a pass against the old kernel's 318-345.) Each
/// sum adds the same products in the same order, so the results are bit for bit the old
/// kernel's, and ggml's. One thread, warm cache (`tests/benches/kernels.rs`, `kq`; this AMD EPYC,
/// AVX2): Gemma's 8-row `kq` 366-382 us against the old kernel's 432-458, its `kqv` 364-370
/// against 518-535, SmolLM2's `kqv` 53-59 against 70-81. Query groups are outer, cache rows
/// inner, so a group's rows stay in L1 while the block's cache rows come again from L2.
///
/// # Safety
/// The CPU has AVX2/FMA/F16C; `rows` rows of `n` f16 values at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_blocked(
    x: *const u8,
    stride: usize,
    rows: usize,
    qs: &[f32],
    n: usize,
    sums: &mut [f32],
) {
    // No cache rows (a thread's empty share of a short view): nothing to compute.
    let m = sums.len().checked_div(rows).unwrap_or(0);
    let ahead = ahead(n);
    let row = |i: usize| x.add(i * stride).cast::<u16>();
    let mut k = 0;
    while k < m {
        let g = 4.min(m - k);
        let mut i = 0;
        while i < rows {
            let r = 2.min(rows - i);
            if k == 0 {
                fetch_ahead(x, stride, rows, i..i + r, ahead, n);
            }
            macro_rules! go {
                ($r:literal, $g:literal) => {
                    block::<$r, $g>(
                        std::array::from_fn(|j| row(i + j)),
                        qs,
                        n,
                        k,
                        m,
                        &mut sums[i * m..],
                    )
                };
            }
            match (r, g) {
                (1, 1) => go!(1, 1),
                (1, 2) => go!(1, 2),
                (1, 3) => go!(1, 3),
                (1, _) => go!(1, 4),
                (_, 1) => go!(2, 1),
                (_, 2) => go!(2, 2),
                (_, 3) => go!(2, 3),
                (_, _) => go!(2, 4),
            }
            i += r;
        }
        k += g;
    }
}

/// Cache rows `xs` against query rows `k0..k0 + G` of `qs`, into `sums` (row `r`'s sums at
/// `r * m`): ggml's four 8-lane sums of each pair one after another, then reduced as
/// [`group`] reduces them.
#[inline(always)]
unsafe fn block<const R: usize, const G: usize>(
    xs: [*const u16; R],
    qs: &[f32],
    n: usize,
    k0: usize,
    m: usize,
    sums: &mut [f32],
) {
    let np = n / 32 * 32;
    let ys: [*const f32; G] = std::array::from_fn(|g| qs.as_ptr().add((k0 + g) * n));
    // `acc[j][r][g]`: ggml's j-th 8-lane sum of cache row r with query row g.
    let mut acc = [[[_mm256_setzero_ps(); G]; R]; 4];
    for (j, acc) in acc.iter_mut().enumerate() {
        let mut i = 8 * j;
        while i < np {
            let ax: [__m256; R] =
                std::array::from_fn(|r| _mm256_cvtph_ps(_mm_loadu_si128(xs[r].add(i).cast())));
            for g in 0..G {
                let ay = _mm256_loadu_ps(ys[g].add(i));
                for r in 0..R {
                    acc[r][g] = _mm256_fmadd_ps(ax[r], ay, acc[r][g]);
                }
            }
            i += 32;
        }
    }
    // Pair (r, g)'s `(a0 + a2) + (a1 + a3)`, ggml's first reduction steps, in slot 4r + g.
    let mut x0 = [_mm256_setzero_ps(); 8];
    for r in 0..R {
        for g in 0..G {
            x0[4 * r + g] = _mm256_add_ps(
                _mm256_add_ps(acc[0][r][g], acc[2][r][g]),
                _mm256_add_ps(acc[1][r][g], acc[3][r][g]),
            );
        }
    }
    let done = reduce8_256(x0);
    for r in 0..R {
        let x = std::slice::from_raw_parts(xs[r], n);
        for g in 0..G {
            sums[r * m + k0 + g] = leftovers(done[4 * r + g], x, ys[g], np);
        }
    }
}

/// The rest of ggml's `GGML_F32x8_REDUCE` for eight 8-lane sums `x0` at once (before the
/// leftovers): ggml takes `t0` = `x0`'s low 128 bits + its high, then `_mm_hadd_ps(t0, t0)`
/// twice. `_mm_hadd_ps` adds neighbours in each 128-bit half of its two operands, so eight
/// pairs' `t0`s share three `hadd`s where each pair took two of its own (the same additions,
/// operands in the same order). Every kernel here ends in it or in [`reduce8`].
#[inline(always)]
unsafe fn reduce8_256(x0: [__m256; 8]) -> [f32; 8] {
    // [t0 of x0[2i] | t0 of x0[2i + 1]]: each sum's 128-bit halves added, low first.
    let t: [__m256; 4] = std::array::from_fn(|i| {
        let (a, b) = (x0[2 * i], x0[2 * i + 1]);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    });
    let u0 = _mm256_hadd_ps(t[0], t[1]);
    let u1 = _mm256_hadd_ps(t[2], t[3]);
    // Sums 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high.
    let f = _mm256_hadd_ps(u0, u1);
    let mut out = [0f32; 8];
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_ps(out.as_mut_ptr(), _mm256_permutevar8x32_ps(f, order));
    out
}

/// [`dots_blocked`]'s products with AVX-512's 32 registers: two cache rows at a time against
/// four query rows (16 accumulators; six and 24 for rows of up to 256 values), ggml's four
/// sums of a pair side by side in two 512-bit registers, so each query load feeds two fused
/// multiply-adds; and query groups outer,
/// cache rows inner, so a group's rows (16 KB for Gemma's `kqv`) stay in L1 while the cache
/// rows of the block come again from L2 for each group. (Cache rows outer, Gemma's 8-row `kqv`
/// streamed its 128 KB of query rows through L2 for every cache row, slower than ggml.) The
/// arithmetic is [`group`]'s: a 512-bit lane holds what one of ggml's four 256-bit sums holds.
///
/// # Safety
/// As [`dots_blocked`], and the CPU has AVX-512F/VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn dots_wide(
    x: *const u8,
    stride: usize,
    rows: usize,
    qs: &[f32],
    n: usize,
    sums: &mut [f32],
) {
    // No cache rows (a thread's empty share of a short view): nothing to compute.
    let m = sums.len().checked_div(rows).unwrap_or(0);
    let ahead = ahead(n);
    let row = |i: usize| std::slice::from_raw_parts(x.add(i * stride).cast::<u16>(), n);
    // Six query rows to a pass (24 accumulators) where six rows fit L1 beside the cache rows
    // with room to spare (keys: 6 KB for Gemma, 1.5 KB for SmolLM2): each converted cache row
    // then serves six. A softmax row is a context long, and six of them (24 KB at 1000) pushed
    // the cache rows out: Gemma's 8-row `kqv` went 264-304 -> 367-386 us, so four there.
    let most = if n <= 256 { 6 } else { 4 };
    let mut k = 0;
    while k < m {
        let g = most.min(m - k);
        let mut i = 0;
        while i < rows {
            if k == 0 {
                fetch_ahead(x, stride, rows, i..i + 2, ahead, n);
            }
            if i + 1 < rows {
                let (a, b) = sums[i * m..(i + 2) * m].split_at_mut(m);
                match g {
                    1 => pair::<1>(row(i), row(i + 1), qs, n, k, a, b),
                    2 => pair::<2>(row(i), row(i + 1), qs, n, k, a, b),
                    3 => pair::<3>(row(i), row(i + 1), qs, n, k, a, b),
                    4 => pair::<4>(row(i), row(i + 1), qs, n, k, a, b),
                    5 => pair::<5>(row(i), row(i + 1), qs, n, k, a, b),
                    _ => pair::<6>(row(i), row(i + 1), qs, n, k, a, b),
                }
                i += 2;
            } else {
                let out = &mut sums[i * m..(i + 1) * m];
                match g {
                    1 => group::<1>(row(i), qs, n, k, out),
                    2 => group::<2>(row(i), qs, n, k, out),
                    3 => group::<3>(row(i), qs, n, k, out),
                    4 => group::<4>(row(i), qs, n, k, out),
                    5 => group::<5>(row(i), qs, n, k, out),
                    _ => group::<6>(row(i), qs, n, k, out),
                }
                i += 1;
            }
        }
        k += g;
    }
}

/// Query rows `k0..k0 + G` of `qs` against cache rows `xa` and `xb` into `sa` and `sb`, in
/// 512-bit registers: for each of ggml's steps of 32 the low half of `acc[.][.][0]` is ggml's
/// first 8-lane sum, its high half the second, `acc[.][.][1]` the third and fourth.
#[inline(always)]
unsafe fn pair<const G: usize>(
    xa: &[u16],
    xb: &[u16],
    qs: &[f32],
    n: usize,
    k0: usize,
    sa: &mut [f32],
    sb: &mut [f32],
) {
    let np = n / 32 * 32;
    let (pa, pb) = (xa.as_ptr(), xb.as_ptr());
    let ys: [*const f32; G] = std::array::from_fn(|g| qs.as_ptr().add((k0 + g) * n));
    let mut acc = [[[_mm512_setzero_ps(); 2]; G]; 2];
    let mut i = 0;
    while i < np {
        let a0 = _mm512_cvtph_ps(_mm256_loadu_si256(pa.add(i).cast()));
        let a1 = _mm512_cvtph_ps(_mm256_loadu_si256(pa.add(i + 16).cast()));
        let b0 = _mm512_cvtph_ps(_mm256_loadu_si256(pb.add(i).cast()));
        let b1 = _mm512_cvtph_ps(_mm256_loadu_si256(pb.add(i + 16).cast()));
        for g in 0..G {
            let y0 = _mm512_loadu_ps(ys[g].add(i));
            let y1 = _mm512_loadu_ps(ys[g].add(i + 16));
            acc[0][g][0] = _mm512_fmadd_ps(a0, y0, acc[0][g][0]);
            acc[0][g][1] = _mm512_fmadd_ps(a1, y1, acc[0][g][1]);
            acc[1][g][0] = _mm512_fmadd_ps(b0, y0, acc[1][g][0]);
            acc[1][g][1] = _mm512_fmadd_ps(b1, y1, acc[1][g][1]);
        }
        i += 32;
    }
    // Pair (r, g)'s sum in slot rG + g: [a0 + a2 | a1 + a3], ggml's first two reduction steps.
    let mut s = [_mm512_setzero_ps(); 16];
    for r in 0..2 {
        for g in 0..G {
            s[G * r + g] = _mm512_add_ps(acc[r][g][0], acc[r][g][1]);
        }
    }
    let mut done = [0f32; 16];
    for h in 0..(2 * G).div_ceil(8) {
        let eight = std::array::from_fn(|j| s[8 * h + j]);
        _mm256_storeu_ps(done.as_mut_ptr().add(8 * h), reduce8(eight));
    }
    for (r, (x, out)) in [(xa, &mut *sa), (xb, &mut *sb)].into_iter().enumerate() {
        for g in 0..G {
            out[k0 + g] = leftovers(done[G * r + g], x, ys[g], np);
        }
    }
}

/// ggml's remaining reduction steps of eight pairs at once: `s[j]` holds a pair's two 8-lane
/// halves, and lane j of the result is what [`reduce8_256`] gives for `x0 = lo + hi`: `t0 =
/// x0's low 128 bits + its high`, then `_mm_hadd_ps` twice. The same additions with the same
/// operands in the same order, only eight pairs to a 512-bit register, where a pair's own
/// reduction spent two extractions and two 3-uop `hadd`s (SmolLM2's key rows are 64
/// values, so a pair's products are four fused multiply-adds, fewer instructions than its
/// own reduction took).
#[inline(always)]
unsafe fn reduce8(s: [__m512; 8]) -> __m256 {
    // [x0 of s[2i] | x0 of s[2i + 1]]: 256-bit halves lined up and added, low first.
    let x: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (s[2 * i], s[2 * i + 1]);
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
        _mm512_add_ps(lo, hi)
    });
    // [t0 of four pairs]: each x0's 128-bit halves lined up and added, low first.
    let t: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        _mm512_add_ps(lo, hi)
    });
    // `_mm_hadd_ps` in every 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
    let hadd = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        )
    };
    let u = hadd(t[0], t[1]);
    // Lane k of `f` starts with pair k's sum, then pair 4 + k's.
    let f = hadd(u, u);
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(order, f))
}

/// `s` plus the products past `np` (ggml's leftovers, added in `f64`).
#[inline(always)]
unsafe fn leftovers(s: f32, x: &[u16], y: *const f32, np: usize) -> f32 {
    if np == x.len() {
        return s;
    }
    let mut s = s as f64;
    for (i, &h) in x.iter().enumerate().skip(np) {
        let xv = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))));
        s += (xv * *y.add(i)) as f64;
    }
    s as f32
}

/// Query rows `k0..k0 + G` of `qs` against `x` into `sums`.
#[inline(always)]
unsafe fn group<const G: usize>(x: &[u16], qs: &[f32], n: usize, k0: usize, sums: &mut [f32]) {
    let np = n / 32 * 32;
    let xp = x.as_ptr();
    let ys: [*const f32; G] = std::array::from_fn(|g| qs.as_ptr().add((k0 + g) * n));
    let mut acc = [[_mm256_setzero_ps(); 4]; G];
    let mut i = 0;
    while i < np {
        let ax: [__m256; 4] =
            std::array::from_fn(|j| _mm256_cvtph_ps(_mm_loadu_si128(xp.add(i + 8 * j).cast())));
        for g in 0..G {
            for j in 0..4 {
                let ay = _mm256_loadu_ps(ys[g].add(i + 8 * j));
                acc[g][j] = _mm256_fmadd_ps(ax[j], ay, acc[g][j]);
            }
        }
        i += 32;
    }
    // Query row g's `(a0 + a2) + (a1 + a3)`, ggml's first reduction steps, in slot g.
    let mut x0 = [_mm256_setzero_ps(); 8];
    for g in 0..G {
        let [a0, a1, a2, a3] = acc[g];
        x0[g] = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
    }
    let done = reduce8_256(x0);
    for g in 0..G {
        sums[k0 + g] = leftovers(done[g], x, ys[g], np);
    }
}

/// The CPU runs [`dots_lanes`] (AVX-512F besides [`cpu_ok`]'s features).
fn lanes_ok() -> bool {
    cpu_ok() && std::arch::is_x86_feature_detected!("avx512f")
}

/// The query-lanes kernels this CPU runs, the device's first: [`dots_lanes`] with AVX-512F,
/// then [`dots_lanes_256`] (where [`cpu_ok`]).
pub fn lanes_kernels() -> &'static [super::Lanes] {
    const WIDE: &[super::Lanes] = &[dots_lanes, dots_lanes_256];
    const NARROW: &[super::Lanes] = &[dots_lanes_256];
    if lanes_ok() {
        WIDE
    } else if cpu_ok() {
        NARROW
    } else {
        &[]
    }
}

/// `sums[i * m + k]` = f16 cache row i (of `rows` at `x`, `stride` bytes apart, 64 values) ·
/// query row k, from the query rows laid out by [`super::lanes_queries`] in `qt` (`m` of them),
/// ggml's way. Query rows sit in the lanes of a register (sixteen to a register, two
/// registers), each cache row's elements are broadcast against them: every lane is one pair
/// from its first product to its last addition, so the reduction of a pair's four 8-lane sums
/// (`(a0 + a2) + (a1 + a3)`, then `t0` = low 128 bits + high, then `_mm_hadd_ps` twice, as
/// [`reduce8_256`]) is plain additions of whole registers, where [`dots_wide`] spends two
/// shuffles and an addition for each of its steps. Element `32s + 8j + l` goes to sum j's lane
/// l by a fused multiply-add in step order s (the first onto +0, as ggml's zeroed sums).
///
/// A last group of eight query rows or fewer shares each register between two cache rows
/// (lanes alternating): an 8-row verification's 24 query rows a key (SmolLM2) filled 24 of 32
/// lanes as two groups of sixteen. One thread, warm cache, `kq/smollm-kq/lanes0/8` 28.6-29.6 ->
/// 25.8-25.9 us (three alternated runs); `leap profile -m smollm2-135m --paths engine --rows
/// 1,8 --reps 25 --ops`, the 8-row call's attention 4.18, 4.20, 4.04 -> 3.88, 4.05, 3.94 ms.
///
/// # Safety
/// [`lanes_ok`]; `rows` rows of 64 f16 values at `x`; `qt` as [`super::lanes_queries`] made it
/// for `m` query rows; `sums` holds `rows * m`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn dots_lanes(
    x: *const u8,
    stride: usize,
    rows: usize,
    qt: &[f32],
    m: usize,
    sums: &mut [f32],
) {
    const N: usize = super::LANES_N;
    // Cache rows a block: converted to f32 together, then each of ggml's eight lanes l goes
    // over all of them with the query elements of that lane held in registers.
    const BLOCK: usize = 16;
    let groups = m.div_ceil(16);
    debug_assert!(qt.len() >= groups * N * 16 && sums.len() >= rows * m);
    // A last group of eight query rows or fewer (an 8-row call's 24 a key on SmolLM2: 16 + 8)
    // takes two cache rows to a register: lanes 2q and 2q + 1 are query row q against the
    // pair's first and second cache row, each lane the same chain as in a group of its own
    // (whose register would be half empty), so the pair's elements come as one 64-bit
    // broadcast and its products take half the operations.
    let last = m - 16 * (groups - 1);
    let paired = last <= 8;
    let whole = if paired { groups - 1 } else { groups };
    // The paired group's query elements, each query row in two lanes (zero past `last`).
    let mut qp = [MaybeUninit::<__m512>::uninit(); N];
    if paired {
        let twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        let q0 = qt.as_ptr().add((groups - 1) * N * 16);
        for (e, qp) in qp.iter_mut().enumerate() {
            let v = _mm512_maskz_loadu_ps(0xff, q0.add(e * 16));
            *qp = MaybeUninit::new(_mm512_permutexvar_ps(twice, v));
        }
    }
    let ahead = ahead(N);
    // The block's cache rows as f32, broadcast from here an element at a time (converted well
    // before they are read: a load from a vector store still in flight waits for it).
    // (These are 20 KB a call, so not zeroed: each element is written before it is read, and
    // rows past a short block's length are not read.)
    let mut xr = [[MaybeUninit::<f32>::uninit(); N]; BLOCK];
    // The block's cache rows by pairs for the paired group: element e of rows 2p and 2p + 1
    // side by side at `xp[p][2e]` (a block's odd last row with itself).
    let mut xp = [[MaybeUninit::<f32>::uninit(); 2 * N]; BLOCK / 2];
    // `x0[r][l][h]`: lane l of `(a0 + a2) + (a1 + a3)` for cache row r against query group h.
    let mut x0 = [[[MaybeUninit::<__m512>::uninit(); 2]; 8]; BLOCK];
    for i0 in (0..rows).step_by(BLOCK) {
        let len = BLOCK.min(rows - i0);
        fetch_ahead(x, stride, rows, i0..i0 + len, ahead, N);
        for (r, xr) in xr.iter_mut().enumerate().take(len) {
            let p = x.add((i0 + r) * stride).cast::<u16>();
            for c in 0..N / 16 {
                _mm512_storeu_ps(
                    xr.as_mut_ptr().add(16 * c).cast(),
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.add(16 * c).cast())),
                );
            }
        }
        if paired {
            pair_rows(&xr, len, &mut xp);
        }
        let mut g = 0;
        while g < whole {
            let two = g + 1 < whole;
            let hs = 1 + usize::from(two);
            let q0 = qt.as_ptr().add(g * N * 16);
            for l in 0..8 {
                // The query elements of lane l: `32s + 8j + l`, for each group.
                let qv: [[[__m512; 2]; 2]; 4] = std::array::from_fn(|j| {
                    std::array::from_fn(|s| {
                        std::array::from_fn(|h| {
                            if h < hs {
                                _mm512_loadu_ps(q0.add((h * N + 32 * s + 8 * j + l) * 16))
                            } else {
                                _mm512_setzero_ps()
                            }
                        })
                    })
                });
                for (xr, x0) in xr.iter().zip(x0.iter_mut()).take(len) {
                    let mut a = [[_mm512_setzero_ps(); 2]; 4];
                    for (j, a) in a.iter_mut().enumerate() {
                        let b0 = _mm512_set1_ps(xr[8 * j + l].assume_init());
                        let b1 = _mm512_set1_ps(xr[32 + 8 * j + l].assume_init());
                        for h in 0..hs {
                            a[h] = _mm512_fmadd_ps(b0, qv[j][0][h], _mm512_setzero_ps());
                            a[h] = _mm512_fmadd_ps(b1, qv[j][1][h], a[h]);
                        }
                    }
                    for h in 0..hs {
                        x0[l][h] = MaybeUninit::new(_mm512_add_ps(
                            _mm512_add_ps(a[0][h], a[2][h]),
                            _mm512_add_ps(a[1][h], a[3][h]),
                        ));
                    }
                }
            }
            for (r, x0) in x0.iter().enumerate().take(len) {
                // `h` picks a register of each of the eight lanes' pairs, not an element.
                #[allow(clippy::needless_range_loop)]
                for h in 0..hs {
                    let f = lanes_reduced(x0, h);
                    let k0 = (g + h) * 16;
                    let mask = if m - k0 >= 16 {
                        0xffff
                    } else {
                        (1u16 << (m - k0)) - 1
                    };
                    _mm512_mask_storeu_ps(sums.as_mut_ptr().add((i0 + r) * m + k0), mask, f);
                }
            }
            g += hs;
        }
        if paired {
            let k0 = (groups - 1) * 16;
            paired_group(&xp, len, &qp, &mut x0, &mut sums[i0 * m..], m, k0, last);
        }
    }
}

/// A block's cache rows (`xr`, `len` of them) by pairs for [`dots_lanes`]' paired group:
/// element e of rows 2p and 2p + 1 side by side at `xp[p][2e]` (an odd last row with itself).
#[inline(always)]
unsafe fn pair_rows(
    xr: &[[MaybeUninit<f32>; super::LANES_N]; 16],
    len: usize,
    xp: &mut [[MaybeUninit<f32>; 2 * super::LANES_N]; 8],
) {
    let lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    let hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (pr, xp) in xp.iter_mut().enumerate().take(len.div_ceil(2)) {
        let (a, b) = (2 * pr, (2 * pr + 1).min(len - 1));
        for c in 0..super::LANES_N / 16 {
            // Rows a and b of the block were written before this is called.
            let va = _mm512_loadu_ps(xr[a].as_ptr().add(16 * c).cast());
            let vb = _mm512_loadu_ps(xr[b].as_ptr().add(16 * c).cast());
            let out = xp.as_mut_ptr().add(32 * c).cast::<f32>();
            _mm512_storeu_ps(out, _mm512_permutex2var_ps(va, lo, vb));
            _mm512_storeu_ps(out.add(16), _mm512_permutex2var_ps(va, hi, vb));
        }
    }
}

/// The rest of ggml's reduction for register h of a cache row's eight lanes `x0[l][h]` (each
/// `(a0 + a2) + (a1 + a3)`): `t0` = the 8-lane sum's low 128 bits + its high, then
/// `_mm_hadd_ps` twice, every lane of the register at once.
#[inline(always)]
unsafe fn lanes_reduced(x0: &[[MaybeUninit<__m512>; 2]; 8], h: usize) -> __m512 {
    let t: [__m512; 4] =
        std::array::from_fn(|i| _mm512_add_ps(x0[i][h].assume_init(), x0[i + 4][h].assume_init()));
    _mm512_add_ps(_mm512_add_ps(t[0], t[1]), _mm512_add_ps(t[2], t[3]))
}

/// [`dots_lanes`]' paired group (its `last` query rows from `k0`, each in two lanes of `qp`)
/// against a block's `len` cache rows by pairs (`xp`, [`pair_rows`]), `x0[p]` the pair p's
/// lanes, into `sums` (from the block's first cache row, rows of `m`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn paired_group(
    xp: &[[MaybeUninit<f32>; 2 * super::LANES_N]; 8],
    len: usize,
    qp: &[MaybeUninit<__m512>; super::LANES_N],
    x0: &mut [[[MaybeUninit<__m512>; 2]; 8]; 16],
    sums: &mut [f32],
    m: usize,
    k0: usize,
    last: usize,
) {
    for l in 0..8 {
        let qv: [[__m512; 2]; 4] =
            std::array::from_fn(|j| std::array::from_fn(|s| qp[32 * s + 8 * j + l].assume_init()));
        for (xp, x0) in xp.iter().zip(x0.iter_mut()).take(len.div_ceil(2)) {
            let pair = |e: usize| {
                _mm512_castpd_ps(_mm512_set1_pd(xp.as_ptr().add(2 * e).cast::<f64>().read()))
            };
            let a: [__m512; 4] = std::array::from_fn(|j| {
                let a = _mm512_fmadd_ps(pair(8 * j + l), qv[j][0], _mm512_setzero_ps());
                _mm512_fmadd_ps(pair(32 + 8 * j + l), qv[j][1], a)
            });
            x0[l][0] = MaybeUninit::new(_mm512_add_ps(
                _mm512_add_ps(a[0], a[2]),
                _mm512_add_ps(a[1], a[3]),
            ));
        }
    }
    // Lanes 2q (the pair's first row) to 0-7, 2q + 1 (its second) to 8-15.
    let apart = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
    let mask = (1u16 << last) - 1;
    for (pr, x0) in x0.iter().enumerate().take(len.div_ceil(2)) {
        let f = _mm512_permutexvar_ps(apart, lanes_reduced(x0, 0));
        let r = 2 * pr;
        _mm512_mask_storeu_ps(sums.as_mut_ptr().add(r * m + k0), mask, f);
        if r + 1 < len {
            // (AVX-512F's extraction: `extractf32x8` is AVX-512DQ's.)
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(f)));
            _mm256_mask_storeu_ps(sums.as_mut_ptr().add((r + 1) * m + k0), mask as u8, hi);
        }
    }
}

/// [`dots_lanes`] with AVX2's 16 registers: eight query rows in a register's lanes (half of one
/// of [`super::lanes_queries`]' groups of sixteen), the same products and additions in the same
/// order, one group of eight at a time. [`dots_blocked`] ends each pair with its share of a
/// shuffled reduction of eight pairs; here a pair is one lane from its first product to its last
/// addition. One thread, warm cache, the AVX2-only AMD EPYC (Zen 4): SmolLM2's 8-row `kq` (24
/// query rows a key; `tests/benches/kernels.rs`, `kq/smollm-kq/lanes0/8` against `leap0/8`,
/// four runs) 62-103 us against [`dots_blocked`]'s 106-159; level at 2 rows (6 query rows,
/// which `leap_backend::kqmm` gives the blocked kernel).
///
/// # Safety
/// [`cpu_ok`]; `rows` rows of 64 f16 values at `x`; `qt` as [`super::lanes_queries`] made it
/// for `m` query rows; `sums` holds `rows * m`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dots_lanes_256(
    x: *const u8,
    stride: usize,
    rows: usize,
    qt: &[f32],
    m: usize,
    sums: &mut [f32],
) {
    const N: usize = super::LANES_N;
    const BLOCK: usize = 16;
    let eights = m.div_ceil(8);
    debug_assert!(qt.len() >= m.div_ceil(16) * N * 16 && sums.len() >= rows * m);
    let ahead = ahead(N);
    // As in `dots_lanes`: the block's cache rows as f32, and each row's eight lanes of
    // `(a0 + a2) + (a1 + a3)`, each element written before it is read.
    let mut xr = [[MaybeUninit::<f32>::uninit(); N]; BLOCK];
    let mut x0 = [[MaybeUninit::<__m256>::uninit(); 8]; BLOCK];
    for i0 in (0..rows).step_by(BLOCK) {
        let len = BLOCK.min(rows - i0);
        fetch_ahead(x, stride, rows, i0..i0 + len, ahead, N);
        for (r, xr) in xr.iter_mut().enumerate().take(len) {
            let p = x.add((i0 + r) * stride).cast::<u16>();
            for c in 0..N / 8 {
                _mm256_storeu_ps(
                    xr.as_mut_ptr().add(8 * c).cast(),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(8 * c).cast())),
                );
            }
        }
        for e in 0..eights {
            // Query rows 8e..8e + 8: half e % 2 of group e / 2's sixteen lanes.
            let q0 = qt.as_ptr().add(e / 2 * N * 16 + e % 2 * 8);
            for l in 0..8 {
                // The query elements of lane l: `32s + 8j + l`.
                let qv: [[__m256; 2]; 4] = std::array::from_fn(|j| {
                    std::array::from_fn(|s| _mm256_loadu_ps(q0.add((32 * s + 8 * j + l) * 16)))
                });
                for (xr, x0) in xr.iter().zip(x0.iter_mut()).take(len) {
                    let a: [__m256; 4] = std::array::from_fn(|j| {
                        let b0 = _mm256_set1_ps(xr[8 * j + l].assume_init());
                        let b1 = _mm256_set1_ps(xr[32 + 8 * j + l].assume_init());
                        let a = _mm256_fmadd_ps(b0, qv[j][0], _mm256_setzero_ps());
                        _mm256_fmadd_ps(b1, qv[j][1], a)
                    });
                    x0[l] = MaybeUninit::new(_mm256_add_ps(
                        _mm256_add_ps(a[0], a[2]),
                        _mm256_add_ps(a[1], a[3]),
                    ));
                }
            }
            let k0 = 8 * e;
            let count = (m - k0).min(8);
            for (r, x0) in x0.iter().enumerate().take(len) {
                // `t0` = the 8-lane sum's low 128 bits + its high; `_mm_hadd_ps` twice.
                let t: [__m256; 4] = std::array::from_fn(|i| {
                    _mm256_add_ps(x0[i].assume_init(), x0[i + 4].assume_init())
                });
                let f = _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]));
                let out = sums.as_mut_ptr().add((i0 + r) * m + k0);
                if count == 8 {
                    _mm256_storeu_ps(out, f);
                } else {
                    let mut v = [0f32; 8];
                    _mm256_storeu_ps(v.as_mut_ptr(), f);
                    std::ptr::copy_nonoverlapping(v.as_ptr(), out, count);
                }
            }
        }
    }
}

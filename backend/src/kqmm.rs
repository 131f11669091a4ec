//! Attention's two matrix products over ggml's f16 KV cache without flash attention
//! (`kq = K x Q` and `kqv = Vᵀ x softmax(kq)`), in batches of up to 4096 rows: each cache row
//! is converted from f16 once and multiplied with every query row of every head that shares it
//! (grouped-query attention: Gemma 3 270M has 4 query heads on 1 KV head), where ggml's CPU
//! backend converts and loads it again for each (head, row) pair. With AVX-512 two cache rows
//! meet four query rows at a time ([`dots_wide`]); on a warm cache, one thread, that is
//! 2.3-3.2x (Gemma) and 2.2-3.4x (SmolLM2) faster than ggml at 1 to 8 rows
//! (`tests/examples/attntime.rs` at `1bc4334`; a cache row at a time it was 12-22% and
//! 1.4-1.8x). In a real call the cache comes mostly from memory, so the rows are prefetched
//! ahead: without that (`6e523d9`) SmolLM2's one-row call took 12.1-13.1 ms, with it
//! (`5124809`) 7.4-8.0 (`tests/examples/hiddentime.rs`, context 1000, the call cut before the
//! output projection).
//!
//! Each output is bit-identical to ggml's `ggml_vec_dot_f16` on an AVX2/F16C build for that
//! pair alone: the query row is rounded to f16 (ggml converts `src1` to its `vec_dot_type`),
//! products are accumulated with fused multiply-adds in four 8-lane sums over steps of 32,
//! reduced as `GGML_F32x8_REDUCE` does, and the leftovers added in `f64`.

use std::arch::x86_64::*;

use crate::ffi as g;
use crate::par::{parallel, Ptr};

/// Most rows of a batch taken: decoding's one (its 4 heads share the cache rows),
/// verification's few and prefill's batches, as the device's matrix products. With query
/// groups outer a group's rows stay in L1 whatever the batch; taking prefill's too made Leap's
/// prefill 20-33% faster (see "Prefill" in
/// `docs/measurements.md`).
const MAX_ROWS: i64 = 4096;

/// Whether the device computes `op`: an f16 x f32 `MUL_MAT` with contiguous rows, `src0`
/// broadcast over `src1`'s third dimension, of 1 to [`MAX_ROWS`] rows, on a CPU with
/// AVX2/FMA/F16C where the kernels passed [`agrees_with_ggml`].
pub(crate) fn supports(op: &g::ggml_tensor) -> bool {
    if op.op != g::GGML_OP_MUL_MAT || op.type_ != g::GGML_TYPE_F32 || !checked() {
        return false;
    }
    let (s0, s1) = (op.src[0], op.src[1]);
    if s0.is_null() || s1.is_null() {
        return false;
    }
    // SAFETY: ggml's sources of a node are valid tensors.
    let (s0, s1) = unsafe { (&*s0, &*s1) };
    s0.type_ == g::GGML_TYPE_F16
        && s1.type_ == g::GGML_TYPE_F32
        && s0.ne[0] == s1.ne[0]
        && s0.ne[3] == 1
        && s1.ne[3] == 1
        && s0.ne[2] >= 1
        && s1.ne[2] % s0.ne[2] == 0
        && (1..=MAX_ROWS).contains(&s1.ne[1])
        && s0.nb[0] == 2
        && s1.nb[0] == 4
        && op.nb[0] == 4
}

/// The CPU runs the kernels and they passed [`agrees_with_ggml`] (checked once per process).
fn checked() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let ok = agrees_with_ggml();
        if cpu_ok() && !ok {
            log::warn!("Leap's f16 attention products do not reproduce ggml's vec_dot_f16 here; not using them");
        }
        ok
    })
}

fn cpu_ok() -> bool {
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

/// Compute `node` (which [`supports`] accepted) with `threads` threads.
///
/// # Safety
/// `node` is a valid, allocated MUL_MAT node whose sources hold their data.
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    QUERIES.with_borrow_mut(|q| compute_with(node, threads, q));
}

thread_local! {
    /// Buffers reused from node to node: the rounded query rows (on the calling thread) and a
    /// block's sums (on each worker).
    static QUERIES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    static SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`compute`] with `q` for the query rows.
unsafe fn compute_with(node: &mut g::ggml_tensor, threads: usize, q: &mut Vec<f32>) {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let n = s0.ne[0] as usize;
    let (ne01, ne02) = (s0.ne[1] as usize, s0.ne[2] as usize);
    let (ne11, ne12) = (s1.ne[1] as usize, s1.ne[2] as usize);
    let r2 = ne12 / ne02;
    // Query rows rounded through f16 as ggml's conversion does, one contiguous f32 row each,
    // ordered (i12, i11): those sharing `src0` matrix i02 are consecutive.
    q.resize(ne12 * ne11 * n, 0.0);
    for i12 in 0..ne12 {
        for i11 in 0..ne11 {
            let src = (s1.data as *const u8)
                .add(i12 * s1.nb[2] + i11 * s1.nb[1])
                .cast::<f32>();
            let dst = &mut q[(i12 * ne11 + i11) * n..][..n];
            round_f16(std::slice::from_raw_parts(src, n), dst);
        }
    }
    let q = &q[..ne12 * ne11 * n];
    let per = r2 * ne11;
    // Tasks: blocks of `src0` rows, every matrix (KV head) of a block together (the heads of a
    // cache row share its cache lines); at least 4 blocks per thread, so that no thread waits
    // long for the others (SmolLM2's kqv has 64 rows a head), and at most 64 rows a block.
    let block = ne01.div_ceil(4 * threads).clamp(4, 64);
    let tasks = ne01.div_ceil(block);
    let (dst, dst_nb1, dst_nb2) = (Ptr(node.data.cast()), node.nb[1], node.nb[2]);
    let wide = wide();
    let (x0, nb01, nb02) = (Ptr(s0.data.cast()), s0.nb[1], s0.nb[2]);
    let work = |b: usize, sums: &mut Vec<f32>| {
        let (r0, r1) = (b * block, ((b + 1) * block).min(ne01));
        sums.resize((r1 - r0) * per, 0.0);
        let sums = &mut sums[..(r1 - r0) * per];
        for i02 in 0..ne02 {
            let qs = &q[i02 * per * n..(i02 + 1) * per * n];
            let x = x0.at(i02 * nb02 + r0 * nb01);
            if wide {
                dots_wide(x, nb01, r1 - r0, qs, n, sums);
            } else {
                dots(x, nb01, r1 - r0, qs, n, sums);
            }
            // Each output row's run r0..r1 in address order (one row after another, the
            // stores went 4 KB apart on Gemma's 1024 cells and stalled).
            for k in 0..per {
                let (i12, i11) = (i02 * r2 + k / ne11, k % ne11);
                // SAFETY: elements (r0..r1, i11, i12) of dst; tasks write disjoint elements.
                let out = dst.at(i12 * dst_nb2 + i11 * dst_nb1 + r0 * 4).cast::<f32>();
                for (j, row) in sums.chunks_exact(per).enumerate() {
                    *out.add(j) = row[k];
                }
            }
        }
    };
    parallel(threads.min(tasks), &|tid, nth| {
        SUMS.with_borrow_mut(|sums| {
            // A contiguous run of blocks per thread: each streams through its part of the
            // cache in address order, which the hardware prefetchers follow.
            for t in tid * tasks / nth..(tid + 1) * tasks / nth {
                work(t, sums);
            }
        })
    });
}

/// `out` = `x` rounded to f16 (nearest even, F16C's `vcvtps2ph` as ggml uses) and back.
unsafe fn round_f16(x: &[f32], out: &mut [f32]) {
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

/// How far ahead the kernels prefetch cache rows: the cache is read once per call, mostly from
/// memory, and SmolLM2's 128-byte key rows are too short for the hardware's streams (see the
/// module's figures).
const AHEAD_BYTES: usize = 2048;

/// `sums[i * m + k]` = f16 row i (of `rows` at `x`, `stride` bytes apart) · query row k of `qs`
/// (rows of `n`; `m = sums.len() / rows` of them), ggml's way, with AVX2's 16 registers: one
/// cache row at a time against two query rows, query pairs outer (as [`dots_wide`], so a
/// pair's rows stay in L1 while the block's cache rows come again from L2).
///
/// # Safety
/// The CPU has AVX2/FMA/F16C; `rows` rows of `n` f16 values at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots(x: *const u8, stride: usize, rows: usize, qs: &[f32], n: usize, sums: &mut [f32]) {
    let m = sums.len() / rows;
    let ahead = (AHEAD_BYTES / (2 * n)).clamp(2, 16);
    let mut k = 0;
    while k < m {
        let g = 2.min(m - k);
        for (i, out) in sums.chunks_exact_mut(m).enumerate() {
            // The first pair's pass reads the cache from memory: fetch ahead of it.
            if k == 0 && i + ahead < rows {
                let next = x.add((i + ahead) * stride);
                for l in (0..2 * n).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(l).cast());
                }
            }
            let x = std::slice::from_raw_parts(x.add(i * stride).cast::<u16>(), n);
            match g {
                1 => group::<1>(x, qs, n, k, out),
                _ => group::<2>(x, qs, n, k, out),
            }
        }
        k += g;
    }
}

/// [`dots`] with AVX-512's 32 registers: two cache rows at a time against four query rows
/// (16 accumulators), so each query load feeds two fused multiply-adds; and query groups outer,
/// cache rows inner, so a group's rows (16 KB for Gemma's `kqv`) stay in L1 while the cache
/// rows of the block come again from L2 for each group. (Cache rows outer, Gemma's 8-row `kqv`
/// streamed its 128 KB of query rows through L2 for every cache row, slower than ggml.) The
/// arithmetic is [`group`]'s: a 512-bit lane holds what one of ggml's four 256-bit sums holds.
///
/// # Safety
/// As [`dots`], and the CPU has AVX-512F/VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn dots_wide(
    x: *const u8,
    stride: usize,
    rows: usize,
    qs: &[f32],
    n: usize,
    sums: &mut [f32],
) {
    let m = sums.len() / rows;
    let ahead = (AHEAD_BYTES / (2 * n)).clamp(2, 16);
    let row = |i: usize| std::slice::from_raw_parts(x.add(i * stride).cast::<u16>(), n);
    let mut k = 0;
    while k < m {
        let g = 4.min(m - k);
        let mut i = 0;
        while i < rows {
            // The first group's pass reads the cache from memory: fetch ahead of it.
            if k == 0 {
                for j in [i, i + 1] {
                    if j + ahead < rows {
                        let next = x.add((j + ahead) * stride);
                        for l in (0..2 * n).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(next.add(l).cast());
                        }
                    }
                }
            }
            if i + 1 < rows {
                let (a, b) = sums[i * m..(i + 2) * m].split_at_mut(m);
                match g {
                    1 => pair::<1>(row(i), row(i + 1), qs, n, k, a, b),
                    2 => pair::<2>(row(i), row(i + 1), qs, n, k, a, b),
                    3 => pair::<3>(row(i), row(i + 1), qs, n, k, a, b),
                    _ => pair::<4>(row(i), row(i + 1), qs, n, k, a, b),
                }
                i += 2;
            } else {
                let out = &mut sums[i * m..(i + 1) * m];
                match g {
                    1 => group::<1>(row(i), qs, n, k, out),
                    2 => group::<2>(row(i), qs, n, k, out),
                    3 => group::<3>(row(i), qs, n, k, out),
                    _ => group::<4>(row(i), qs, n, k, out),
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
    for (r, (x, out)) in [(xa, &mut *sa), (xb, &mut *sb)].into_iter().enumerate() {
        for g in 0..G {
            // (a0 + a2) + (a1 + a3), ggml's first two reduction steps, then as `group`.
            let s = _mm512_add_ps(acc[r][g][0], acc[r][g][1]);
            let x0 = _mm256_add_ps(
                _mm512_castps512_ps256(s),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s))),
            );
            out[k0 + g] = finish(x0, x, ys[g], np);
        }
    }
}

/// ggml's last reduction steps of one 8-lane sum `x0`, plus the leftovers past `np` in `f64`.
#[inline(always)]
unsafe fn finish(x0: __m256, x: &[u16], y: *const f32, np: usize) -> f32 {
    let t0 = _mm_add_ps(_mm256_castps256_ps128(x0), _mm256_extractf128_ps::<1>(x0));
    let t1 = _mm_hadd_ps(t0, t0);
    let mut s = _mm_cvtss_f32(_mm_hadd_ps(t1, t1)) as f64;
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
    for g in 0..G {
        let [a0, a1, a2, a3] = acc[g];
        let x0 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
        sums[k0 + g] = finish(x0, x, ys[g], np);
    }
}

/// Whether [`compute`]'s arithmetic reproduces ggml's own `vec_dot_f16` (with ggml's f32 to
/// f16 conversion of the query) bit for bit, on pseudo-random rows of several lengths and
/// magnitudes, in groups of every size both kernels use.
pub fn agrees_with_ggml() -> bool {
    if !cpu_ok() {
        return false;
    }
    // SAFETY: static traits table; idempotent init.
    let tr = unsafe {
        g::ggml_cpu_init();
        &*g::ggml_get_type_traits_cpu(g::GGML_TYPE_F16)
    };
    let (Some(vec_dot), Some(from)) = (tr.vec_dot, tr.from_float) else {
        return false;
    };
    let mut rnd = crate::check_values(0x9E37_79B9_7F4A_7C15u64);
    // Three cache rows: the wide kernel takes them as a pair and a single.
    const ROWS: usize = 3;
    for n in [64usize, 256, 1000, 1024, 1057] {
        let x: Vec<u16> = (0..ROWS * n)
            .map(|i| crate::f16::from_f32(rnd(1.0 + (i % 7) as f32)))
            .collect();
        let raw: Vec<f32> = (0..9 * n)
            .map(|i| rnd(if i % 5 == 0 { 30.0 } else { 0.3 }))
            .collect();
        let mut qs = vec![0f32; raw.len()];
        // SAFETY: plain slices of equal length.
        unsafe { round_f16(&raw, &mut qs) };
        for m in 1..=9 {
            let (mut a, mut b) = (vec![0f32; ROWS * m], vec![0f32; ROWS * m]);
            // SAFETY: the CPU features were checked (`wide` for the second).
            unsafe {
                dots(x.as_ptr().cast(), 2 * n, ROWS, &qs[..m * n], n, &mut a);
                if wide() {
                    dots_wide(x.as_ptr().cast(), 2 * n, ROWS, &qs[..m * n], n, &mut b);
                } else {
                    b.copy_from_slice(&a);
                }
            }
            for k in 0..m {
                let mut h = vec![0u16; n];
                // SAFETY: rows of n elements.
                unsafe { from(raw[k * n..].as_ptr(), h.as_mut_ptr().cast(), n as i64) };
                for r in 0..ROWS {
                    let mut want = 0f32;
                    // SAFETY: rows of n elements; nrc = 1 as ggml's mul_mat calls it.
                    unsafe {
                        vec_dot(
                            n as i32,
                            &mut want,
                            0,
                            x[r * n..].as_ptr() as *mut _,
                            0,
                            h.as_mut_ptr().cast(),
                            0,
                            1,
                        );
                    }
                    let (ga, gb) = (a[r * m + k], b[r * m + k]);
                    if want.to_bits() != ga.to_bits() || want.to_bits() != gb.to_bits() {
                        return false;
                    }
                }
            }
        }
    }
    true
}

/// Diagnostic (`tests/examples/attntime.rs`): seconds for `reps` passes over `rows` f16 rows
/// of `n` (`stride` bytes apart) against `m` query rows, of Leap's kernel as the device runs
/// it, of Leap's 256-bit kernel, and of ggml's `vec_dot_f16` pair by pair.
#[doc(hidden)]
pub fn time_products(n: usize, rows: usize, stride: usize, m: usize, reps: usize) -> [f64; 3] {
    // SAFETY: static traits table; idempotent init.
    let tr = unsafe {
        g::ggml_cpu_init();
        &*g::ggml_get_type_traits_cpu(g::GGML_TYPE_F16)
    };
    let vec_dot = tr.vec_dot.expect("f16 vec_dot");
    let x: Vec<u8> = (0..rows * stride).map(|i| (i % 7) as u8 * 9).collect();
    let qs: Vec<f32> = (0..m * n).map(|i| (i % 13) as f32 * 0.01).collect();
    let qh: Vec<u16> = qs.iter().map(|&v| crate::f16::from_f32(v)).collect();
    let mut sums = vec![0f32; rows * m];
    let mut leap = [0f64; 2];
    for (narrow, secs) in [false, true].into_iter().zip(&mut leap) {
        let t = std::time::Instant::now();
        for _ in 0..reps {
            // SAFETY: rows of n f16 inside x (stride >= 2n).
            unsafe {
                if wide() && !narrow {
                    dots_wide(x.as_ptr(), stride, rows, &qs, n, &mut sums)
                } else {
                    dots(x.as_ptr(), stride, rows, &qs, n, &mut sums)
                }
            }
        }
        *secs = t.elapsed().as_secs_f64();
    }
    let t = std::time::Instant::now();
    for _ in 0..reps {
        for r in 0..rows {
            for k in 0..m {
                // SAFETY: one row of n f16 each.
                unsafe {
                    vec_dot(
                        n as i32,
                        &mut sums[r * m + k],
                        0,
                        x.as_ptr().add(r * stride) as *mut _,
                        0,
                        qh.as_ptr().add(k * n) as *mut _,
                        0,
                        1,
                    )
                };
            }
        }
    }
    [leap[0], leap[1], t.elapsed().as_secs_f64()]
}

#[cfg(test)]
mod tests {
    /// Both kernels (256-bit, and 32 registers where the CPU has AVX-512VL) give ggml's
    /// `vec_dot_f16` bit for bit, in every group size and with leftovers past the last 32.
    #[test]
    fn products_match_ggml_vec_dot_f16() {
        if !super::cpu_ok() {
            eprintln!("no AVX2/FMA/F16C here");
            return;
        }
        assert!(super::agrees_with_ggml());
    }
}

//! Attention's two matrix products over ggml's f16 KV cache without flash attention
//! (`kq = K x Q` and `kqv = Vᵀ x softmax(kq)`) on the device, in batches of up to 4096 rows,
//! with the kernels of [`leap_kernels::kq`] (where their speed and their bit-for-bit match with
//! ggml's `ggml_vec_dot_f16` are described): here is what ggml's graph needs, which nodes the
//! device takes, how a node is split over threads, and the check against the ggml this process
//! loaded before the device claims any.

use leap_kernels::kq;

use std::ffi::c_void;

use crate::ffi as g;
use crate::par::{parallel, Ptr};

/// Most rows of a batch taken: decoding's one (its 4 heads share the cache rows),
/// verification's few and prefill's batches, as the device's matrix products. With query
/// groups outer a group's rows stay in L1 whatever the batch; taking prefill's too made Leap's
/// prefill 20-33% faster (see "Prefill" in
/// `docs/measurements.md`).
const MAX_ROWS: i64 = 4096;

/// Whether the device computes `op`: an f16 x f32 `MUL_MAT` with contiguous rows, `src0`
/// broadcast over `src1`'s third dimension, of 1 to [`MAX_ROWS`] rows, on a CPU that runs the
/// kernels (x86-64: AVX2/FMA/F16C; AArch64: all) where they passed [`agrees_with_ggml`].
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
        if kq::cpu_ok() && !ok {
            log::warn!("Leap's f16 attention products do not reproduce ggml's vec_dot_f16 here; not using them");
        }
        ok
    })
}

/// Compute `node` (which [`supports`] accepted) with `threads` threads.
///
/// # Safety
/// `node` is a valid, allocated MUL_MAT node whose sources hold their data.
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    SCRATCH.with(|s| compute_with(node, threads, &mut s.queries.borrow_mut()));
}

/// Buffers reused from node to node: the rounded query rows (on the calling thread) and a
/// block's sums (on each worker, the calling thread among them: two cells).
struct Scratch {
    queries: std::cell::RefCell<Vec<f32>>,
    sums: std::cell::RefCell<Vec<f32>>,
}

thread_local! {
    static SCRATCH: Scratch = const {
        Scratch {
            queries: std::cell::RefCell::new(Vec::new()),
            sums: std::cell::RefCell::new(Vec::new()),
        }
    };
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
    let (src, src_nb1, src_nb2, out) = (
        Ptr(s1.data.cast()),
        s1.nb[1],
        s1.nb[2],
        Ptr(q.as_mut_ptr().cast()),
    );
    let round = |row: usize| {
        let (i12, i11) = (row / ne11, row % ne11);
        let src = src.at(i12 * src_nb2 + i11 * src_nb1).cast::<f32>();
        // SAFETY: row `row` of `q`, written by this call only.
        let dst = std::slice::from_raw_parts_mut(out.at(row * n * 4).cast::<f32>(), n);
        kq::round_f16(std::slice::from_raw_parts(src, n), dst);
    };
    let rows = ne12 * ne11;
    // A prefill batch's rows (KQV's are the softmax's rows, a cache length each) on every
    // thread; a few decode rows on this one.
    if threads > 1 && rows * n >= 1 << 16 {
        parallel(threads.min(rows), &|tid, nth| {
            (tid * rows / nth..(tid + 1) * rows / nth).for_each(round)
        });
    } else {
        (0..rows).for_each(round);
    }
    let q = &q[..ne12 * ne11 * n];
    let per = r2 * ne11;
    // Tasks: blocks of `src0` rows, every matrix (KV head) of a block together (the heads of a
    // cache row share its cache lines); at least 4 blocks per thread, so that no thread waits
    // long for the others (SmolLM2's kqv has 64 rows a head), and at most 64 rows a block.
    let block = ne01.div_ceil(4 * threads).clamp(4, 64);
    let tasks = ne01.div_ceil(block);
    let (dst, dst_nb1, dst_nb2) = (Ptr(node.data.cast()), node.nb[1], node.nb[2]);
    let dots = kq::kernels()[0];
    let (x0, nb01, nb02) = (Ptr(s0.data.cast()), s0.nb[1], s0.nb[2]);
    let work = |b: usize, sums: &mut Vec<f32>| {
        let (r0, r1) = (b * block, ((b + 1) * block).min(ne01));
        sums.resize((r1 - r0) * per, 0.0);
        let sums = &mut sums[..(r1 - r0) * per];
        for i02 in 0..ne02 {
            let qs = &q[i02 * per * n..(i02 + 1) * per * n];
            let x = x0.at(i02 * nb02 + r0 * nb01);
            dots(x, nb01, r1 - r0, qs, n, sums);
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
        SCRATCH.with(|s| {
            let sums = &mut s.sums.borrow_mut();
            // A contiguous run of blocks per thread: each streams through its part of the
            // cache in address order, which the hardware prefetchers follow.
            for t in tid * tasks / nth..(tid + 1) * tasks / nth {
                work(t, sums);
            }
        })
    });
}

/// ggml's f16 `vec_dot` of one row of `n` halves at `x` with one at `y` (nrc = 1, as its
/// `mul_mat` calls it): what the kernels are checked and timed against.
///
/// # Safety
/// `x` and `y` each hold `n` f16 values.
unsafe fn ggml_dot(
    vec_dot: unsafe extern "C" fn(
        i32,
        *mut f32,
        usize,
        *const c_void,
        usize,
        *const c_void,
        usize,
        i32,
    ),
    n: usize,
    x: *const u8,
    y: *const u16,
) -> f32 {
    let mut s = 0f32;
    vec_dot(n as i32, &mut s, 0, x.cast(), 0, y.cast(), 0, 1);
    s
}

/// Whether [`compute`]'s arithmetic reproduces ggml's own `vec_dot_f16` (with ggml's f32 to
/// f16 conversion of the query) bit for bit, on pseudo-random rows of several lengths (with
/// and without leftovers past ggml's steps, shorter than one step too) and magnitudes, in
/// groups of every size, for every kernel the CPU runs.
pub fn agrees_with_ggml() -> bool {
    if !kq::cpu_ok() {
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
    for n in [7usize, 64, 256, 1000, 1024, 1057] {
        let x: Vec<u16> = (0..ROWS * n)
            .map(|i| crate::f16::from_f32(rnd(1.0 + (i % 7) as f32)))
            .collect();
        let raw: Vec<f32> = (0..9 * n)
            .map(|i| rnd(if i % 5 == 0 { 30.0 } else { 0.3 }))
            .collect();
        let mut qs = vec![0f32; raw.len()];
        // SAFETY: the CPU runs the kernels; slices of equal length.
        unsafe { kq::round_f16(&raw, &mut qs) };
        let mut h = vec![0u16; raw.len()];
        // SAFETY: slices of raw.len() elements.
        unsafe { from(raw.as_ptr(), h.as_mut_ptr().cast(), raw.len() as i64) };
        // The rounded query is ggml's (no NaN here: `to_f32` widens the rest exactly).
        if h.iter()
            .zip(&qs)
            .any(|(&h, q)| crate::f16::to_f32(h).to_bits() != q.to_bits())
        {
            return false;
        }
        for m in 1..=9 {
            for dots in kq::kernels() {
                let mut got = vec![0f32; ROWS * m];
                // SAFETY: the CPU runs the kernels; ROWS rows of n f16 at x.
                unsafe { dots(x.as_ptr().cast(), 2 * n, ROWS, &qs[..m * n], n, &mut got) };
                for k in 0..m {
                    for r in 0..ROWS {
                        // SAFETY: rows of n elements.
                        let want = unsafe {
                            ggml_dot(vec_dot, n, x[r * n..].as_ptr().cast(), h[k * n..].as_ptr())
                        };
                        if want.to_bits() != got[r * m + k].to_bits() {
                            return false;
                        }
                    }
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use leap_kernels::kq;

    /// Every kernel the CPU runs (x86-64: 256-bit, and 32 registers where the CPU has
    /// AVX-512VL; AArch64: NEON) gives ggml's `vec_dot_f16` bit for bit, in every group size
    /// and with leftovers past ggml's last step.
    #[test]
    fn products_match_ggml_vec_dot_f16() {
        if !kq::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        assert!(super::agrees_with_ggml());
    }

    /// Of a NaN cache element and a NaN query element (always ggml's `0x7e00` once rounded),
    /// the result keeps the payload ggml's armv8-a build keeps: the cache's within its steps of
    /// 16 (`fmla` returns its first NaN operand), the query's in the leftovers (gcc's `fmul`
    /// has the query first).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn nan_payloads_match_ggml_vec_dot_f16() {
        // SAFETY: static traits table; idempotent init.
        let tr = unsafe {
            crate::ffi::ggml_cpu_init();
            &*crate::ffi::ggml_get_type_traits_cpu(crate::ffi::GGML_TYPE_F16)
        };
        let (vec_dot, from) = (tr.vec_dot.unwrap(), tr.from_float.unwrap());
        const N: usize = 21;
        // Cache row 0: a signalling NaN in the first step; row 1: a quiet one in the leftovers.
        let mut x = vec![0x3c00u16; 2 * N];
        x[3] = 0x7d01;
        x[N + 18] = 0xff21;
        // Query row 0: a NaN on row 0's; query row 1: on row 1's.
        let mut raw = vec![0.5f32; 2 * N];
        raw[3] = f32::from_bits(0x7fa0_0001);
        raw[N + 18] = f32::from_bits(0xffc0_4321);
        let mut qs = vec![0f32; 2 * N];
        let mut h = vec![0u16; 2 * N];
        // SAFETY: slices of 2N elements; the CPU runs the kernels (all AArch64 CPUs).
        unsafe {
            kq::round_f16(&raw, &mut qs);
            from(raw.as_ptr(), h.as_mut_ptr().cast(), 2 * N as i64);
        }
        for dots in kq::kernels() {
            let mut got = [0f32; 4];
            // SAFETY: two rows of N f16 at x.
            unsafe { dots(x.as_ptr().cast(), 2 * N, 2, &qs, N, &mut got) };
            for (i, got) in got.iter().enumerate() {
                let (r, k) = (i / 2, i % 2);
                // SAFETY: rows of N elements.
                let want = unsafe {
                    super::ggml_dot(vec_dot, N, x[r * N..].as_ptr().cast(), h[k * N..].as_ptr())
                };
                assert_eq!(got.to_bits(), want.to_bits(), "row {r} query {k}: {want:?}");
            }
            assert!(got[0].is_nan() && got[3].is_nan());
        }
    }

    /// The query rows are rounded as ggml's f16 `from_float` rounds them, on every exponent
    /// with the rounding bits just below, at and above halfway, on pseudo-random bit patterns
    /// (half subnormals, overflow to infinity), and on NaNs (both give a NaN).
    #[test]
    fn query_rounding_matches_ggml_from_float() {
        if !kq::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        // SAFETY: static traits table; idempotent init.
        let from = unsafe {
            crate::ffi::ggml_cpu_init();
            (*crate::ffi::ggml_get_type_traits_cpu(crate::ffi::GGML_TYPE_F16))
                .from_float
                .expect("f16 from_float")
        };
        let mut rng = leap_kernels::rng::XorShift::new(0x2545_F491_4F6C_DD1D);
        let mut bits: Vec<u32> = (0..1u32 << 19)
            .flat_map(|i| [0, 1, 0xfff, 0x1000, 0x1001, 0x1fff].map(|low| i << 13 | low))
            .collect();
        bits.extend((0..1 << 20).map(|_| (rng.next() >> 32) as u32));
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut got = vec![0f32; x.len()];
        // SAFETY: checked above; slices of equal length.
        unsafe { kq::round_f16(&x, &mut got) };
        let mut want = vec![0u16; x.len()];
        // SAFETY: slices of x.len() elements.
        unsafe { from(x.as_ptr(), want.as_mut_ptr().cast(), x.len() as i64) };
        for ((&x, &g), &w) in x.iter().zip(&got).zip(&want) {
            let w = crate::f16::to_f32(w);
            if x.is_nan() {
                assert!(g.is_nan() && w.is_nan(), "{x:?}");
            } else {
                assert_eq!(g.to_bits(), w.to_bits(), "{x:e} ({:#x})", x.to_bits());
            }
        }
    }
}

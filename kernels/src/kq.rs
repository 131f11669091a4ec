//! Attention's f16 products (`kq = K x Q`, `kqv = Vᵀ x softmax(kq)`) over ggml's f16 KV cache:
//! each cache row is converted from f16 once and multiplied with every query row of every head
//! that shares it (grouped-query attention: Gemma 3 270M has 4 query heads on 1 KV head),
//! where ggml's CPU backend converts and loads it again for each (head, row) pair. On x86-64
//! two cache rows meet four query rows at a time: with AVX-512 in 32 registers
//! (`x86::dots_wide`; on a warm cache, one thread, that is 2.3-3.2x (Gemma) and 2.2-3.4x
//! (SmolLM2) faster than ggml at 1 to 8 rows, `tests/examples/attntime.rs` at `1bc4334`; a
//! cache row at a time it was 12-22% and 1.4-1.8x), six query rows for rows of up to 256
//! values (keys), with AVX2 in 16 by taking ggml's four partial sums of a pair one after
//! another (`x86::dots_blocked`). In a real call the cache comes mostly from memory, so the
//! rows are prefetched ahead: without that (`6e523d9`) SmolLM2's one-row call took 12.1-13.1
//! ms, with it (`5124809`) 7.4-8.0 (`tests/examples/hiddentime.rs`, context 1000, the call
//! cut before the output projection). A pair's products end in ggml's reduction of its four
//! 8-lane sums to one number; both x86-64 kernels reduce eight pairs at once (`x86::reduce8`,
//! `x86::reduce8_256`: the same additions, eight pairs to a register), where a pair's own
//! extractions and two 3-uop `hadd`s outnumbered the four fused multiply-adds of SmolLM2's
//! 64-value key rows (Xeon, AVX-512, one thread, warm: SmolLM2's `kq` 18.8-20.0 -> 16.8-17.3
//! us at 1 row, 132-140 -> 123-126 at 8, `tests/benches/kernels.rs`). On AArch64 (`neon`)
//! one cache row meets up to four query rows at a time (the place for the six-row pass and
//! the batched reduction to follow, where `faddp` reduces a pair); it has not been timed on
//! hardware yet.
//!
//! For SmolLM2's 64-value keys met by many query rows (a verification's: 24 a key for 8 rows)
//! [`lanes`] puts sixteen query rows in a register's lanes instead (AVX-512; eight with AVX2),
//! so that a pair's reduction is additions of whole registers rather than shuffles: one thread,
//! warm, SmolLM2's 8-row `kq` 20.6 us against the wide kernel's 25.0 (`tests/benches/kernels.rs`,
//! `kq/smollm-kq`, the AVX-512 AMD EPYC), 62-103 us against the blocked kernel's 106-159 with
//! AVX2 (the AVX2-only one).
//!
//! Each output is bit-identical to ggml's `ggml_vec_dot_f16` for that pair alone, as ggml's
//! CPU backend for the architecture computes it: the query row is rounded to f16 as ggml's
//! `from_float` does (ggml converts `src1` to its `vec_dot_type`), and products are
//! accumulated, reduced and their leftovers added as ggml's build does. The kernels are per
//! architecture (same interface: [`cpu_ok`], [`kernels`], [`round_f16`]): `x86_64/kq.rs`
//! (AVX2/F16C build: fused multiply-adds in four 8-lane sums over steps of 32, reduced as
//! `GGML_F32x8_REDUCE`, leftovers in `f64`) and `aarch64/kq.rs` (armv8-a build: four 4-lane
//! sums over steps of 16, see there). The caller (`leap_backend::kqmm`) checks them against
//! the ggml the process loaded before use.

#[cfg(target_arch = "aarch64")]
#[path = "aarch64/kq.rs"]
pub(crate) mod neon;
#[cfg(target_arch = "x86_64")]
#[path = "x86_64/kq.rs"]
mod x86;

#[cfg(target_arch = "aarch64")]
pub use neon::{cpu_ok, kernels, round_f16, STEP};
#[cfg(target_arch = "x86_64")]
pub use x86::{cpu_ok, kernels, round_f16, STEP};

/// The row length [`Lanes`] kernels take: SmolLM2's 64-value keys, where a pair's own products
/// (four fused multiply-adds) are fewer instructions than [`kernels`]' reduction of it.
pub const LANES_N: usize = 64;

/// A kernel with query rows in a register's lanes: `sums[i * m + k]` = f16 row i (of `rows`
/// at `x`, `stride` bytes apart, [`LANES_N`] values) · query row k, from the query rows as
/// [`lanes_queries`] lays them out (`m` of them), bit for bit what [`kernels`] give. Unsafe to
/// call: the CPU runs it and `x` holds the rows.
pub type Lanes = unsafe fn(*const u8, usize, usize, &[f32], usize, &mut [f32]);

/// The [`Lanes`] kernel, where the CPU has one (x86-64: AVX-512F's sixteen rows to a register,
/// else AVX2's eight; AArch64 has none yet: a NEON register holds four lanes, where the
/// reduction's shuffles cost less).
pub fn lanes() -> Option<Lanes> {
    lanes_kernels().first().copied()
}

/// Every [`Lanes`] kernel the CPU runs, [`lanes`]' first (for comparing them).
pub fn lanes_kernels() -> &'static [Lanes] {
    #[cfg(target_arch = "x86_64")]
    return x86::lanes_kernels();
    #[allow(unreachable_code)]
    &[]
}

/// `m` query rows of [`LANES_N`] values (rounded by [`round_f16`]) at `qs`, laid out for a
/// [`Lanes`] kernel and appended to `out` (a caller lays out several groups of rows in one
/// buffer): groups of sixteen rows, element e of group g's rows at `(g * LANES_N + e) * 16`
/// from where they start, lane q row `16g + q`, zeros past the last row.
pub fn lanes_queries(qs: &[f32], m: usize, out: &mut Vec<f32>) {
    const N: usize = LANES_N;
    let start = out.len();
    out.resize(start + m.div_ceil(16) * N * 16, 0.0);
    let out = &mut out[start..];
    for (k, row) in qs.chunks_exact(N).take(m).enumerate() {
        let (g, q) = (k / 16, k % 16);
        for (e, &v) in row.iter().enumerate() {
            out[(g * N + e) * 16 + q] = v;
        }
    }
}

/// A kernel: `sums[i * m + k]` = f16 row i (of `rows` at `x`, `stride` bytes apart) · query row
/// k of `qs` (rows of `n`, rounded through f16 by [`round_f16`]; `m = sums.len() / rows` of
/// them), ggml's way. A plain function pointer so that the caller picks one per node and its
/// threads share it. Unsafe to call: the CPU has the kernel's features and `x` holds the rows.
pub type Dots = unsafe fn(*const u8, usize, usize, &[f32], usize, &mut [f32]);

/// How far ahead the kernels prefetch cache rows: the cache is read once per call, mostly from
/// memory, and SmolLM2's 128-byte key rows are too short for the hardware's streams (see the
/// module's figures).
const AHEAD_BYTES: usize = 2048;

#[cfg(test)]
mod tests {
    use crate::f16::{from_f32, to_f32};

    /// Query rows round to the nearest half, ties to even (as ggml's `from_float` rounds on
    /// both architectures; its NaNs are checked against ggml by the caller), across the half
    /// range, its subnormals and past its largest value.
    #[test]
    fn round_f16_rounds_to_nearest_even() {
        if !super::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let x: Vec<f32> = (0..1u32 << 16)
            .flat_map(|i| [0, 0xfff, 0x1000, 0x1001].map(|low| (0x3300_0000 + (i << 13)) | low))
            .map(|b| f32::from_bits(b) * if b & 1 == 0 { 1.0 } else { -1.0 })
            .filter(|x| !x.is_nan())
            .collect();
        let mut got = vec![0f32; x.len()];
        // SAFETY: checked above; slices of equal length.
        unsafe { super::round_f16(&x, &mut got) };
        for (x, g) in x.iter().zip(&got) {
            assert_eq!(g.to_bits(), to_f32(from_f32(*x)).to_bits(), "{x:e}");
        }
    }

    /// Every kernel the CPU runs gives the same bits (they are ggml's arithmetic, regrouped
    /// only in which rows meet), near the exact products, for every group size, cache rows
    /// apart by more than their length, and lengths with leftovers or shorter than one step.
    #[test]
    fn kernels_agree_and_are_near_exact() {
        if !super::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        // Rows past 256 values (a softmax row of `kqv`, a context long) take four query rows
        // a pass on x86-64's AVX-512 kernel, six up to 256.
        for (n, rows) in [
            (7usize, 3usize),
            (48, 3),
            (64, 3),
            (100, 3),
            (300, 5),
            (1100, 13),
        ] {
            let stride = 2 * n + 6;
            let mut x = vec![0u8; rows * stride];
            for r in 0..rows {
                for i in 0..n {
                    let h = from_f32(((r * n + i) as f32 * 0.37).sin() * 3.0);
                    x[r * stride + 2 * i..][..2].copy_from_slice(&h.to_le_bytes());
                }
            }
            let raw: Vec<f32> = (0..9 * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut qs = vec![0f32; raw.len()];
            // SAFETY: checked above; slices of equal length.
            unsafe { super::round_f16(&raw, &mut qs) };
            for m in 1..=9 {
                let mut first: Option<Vec<f32>> = None;
                for dots in super::kernels() {
                    let mut got = vec![0f32; rows * m];
                    // SAFETY: the CPU runs the kernels; `rows` rows of n halves, stride apart.
                    unsafe { dots(x.as_ptr(), stride, rows, &qs[..m * n], n, &mut got) };
                    for (i, g) in got.iter().enumerate() {
                        let (r, k) = (i / m, i % m);
                        let exact: f64 = (0..n)
                            .map(|j| {
                                let h = u16::from_le_bytes([
                                    x[r * stride + 2 * j],
                                    x[r * stride + 2 * j + 1],
                                ]);
                                f64::from(to_f32(h)) * f64::from(qs[k * n + j])
                            })
                            .sum();
                        assert!(
                            (f64::from(*g) - exact).abs() < 1e-4 * n as f64,
                            "{n} {m} {i}"
                        );
                    }
                    let first = first.get_or_insert_with(|| got.clone());
                    assert!(first
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        }
    }

    /// No cache rows (a thread's empty share of a view shorter than the threads) is no work,
    /// for every kernel, the lanes kernels too.
    #[test]
    fn no_cache_rows_is_no_work() {
        if !super::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let qs = vec![0.5f32; 4 * super::LANES_N];
        let mut qt = Vec::new();
        super::lanes_queries(&qs, 4, &mut qt);
        let x = [0u8; 2];
        for dots in super::kernels() {
            // SAFETY: the CPU runs the kernels; no rows are read.
            unsafe { dots(x.as_ptr(), 0, 0, &qs, super::LANES_N, &mut []) };
        }
        for lanes in super::lanes_kernels() {
            // SAFETY: as above.
            unsafe { lanes(x.as_ptr(), 0, 0, &qt, 4, &mut []) };
        }
    }

    /// The lanes kernel gives the other kernels' bits for every query count around its groups
    /// of sixteen (and two groups), for cache rows apart by more than their length.
    #[test]
    fn lanes_agree_with_the_kernels() {
        if super::lanes_kernels().is_empty() {
            eprintln!("no lanes kernel on this CPU");
            return;
        }
        const N: usize = super::LANES_N;
        let (rows, stride) = (37usize, 2 * N + 10);
        let mut x = vec![0u8; rows * stride];
        for r in 0..rows {
            for i in 0..N {
                let h = from_f32(((r * N + i) as f32 * 0.37).sin() * 3.0);
                x[r * stride + 2 * i..][..2].copy_from_slice(&h.to_le_bytes());
            }
        }
        let raw: Vec<f32> = (0..50 * N).map(|i| (i as f32 * 0.11).cos() * 7.0).collect();
        let mut qs = vec![0f32; raw.len()];
        // SAFETY: the CPU runs the kernels (it runs the lanes kernel); equal lengths.
        unsafe { super::round_f16(&raw, &mut qs) };
        let mut qt = Vec::new();
        for (kernel, &lanes) in super::lanes_kernels().iter().enumerate() {
            for m in (1..=34).chain([47, 48, 49, 50]) {
                let mut want = vec![0f32; rows * m];
                let mut got = vec![f32::NAN; rows * m];
                qt.clear();
                super::lanes_queries(&qs[..m * N], m, &mut qt);
                // SAFETY: `rows` rows of N halves, stride apart; qt made for m rows.
                unsafe {
                    super::kernels()[0](x.as_ptr(), stride, rows, &qs[..m * N], N, &mut want);
                    lanes(x.as_ptr(), stride, rows, &qt, m, &mut got);
                }
                for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                    assert_eq!(
                        w.to_bits(),
                        g.to_bits(),
                        "lanes kernel {kernel}, m {m}: cache row {} query {}",
                        i / m,
                        i % m
                    );
                }
            }
        }
    }
}

//! Gemma's GELU-gated unit (`GEGLU`), a row at a time, 8 (x86-64) or 4 (AArch64) elements at
//! once where ggml's own runs one element at a time.
//!
//! Bit-identical to ggml's `ggml_vec_geglu_f32` (built with `GGML_GELU_FP16`, as ggml's CPU
//! backend is): `x <= -10` gives 0, `x >= 10` gives `x * g`, anything else
//! `f16_to_f32(table[f32_to_f16(x)]) * g`, where the table is ggml's own
//! `ggml_table_gelu_f16`, which the caller finds in the process and widens once with
//! [`widen`] (so the kernel never converts a table entry), and the conversions are ggml's for
//! the architecture: F16C's on x86-64 (`x86_64/geglu.rs`), on AArch64 (`aarch64/geglu.rs`)
//! ggml's own integer-and-float rounding to f16 and `fcvt` back. The caller
//! (`leap_backend::glu`) checks the unit against ggml's own op before use.

#[cfg(target_arch = "aarch64")]
#[path = "aarch64/geglu.rs"]
mod neon;
#[cfg(target_arch = "x86_64")]
#[path = "x86_64/geglu.rs"]
mod x86;

#[cfg(target_arch = "aarch64")]
pub use neon::{cpu_ok, geglu, widen};
#[cfg(target_arch = "x86_64")]
pub use x86::{cpu_ok, geglu, widen};

#[cfg(test)]
mod tests {
    use crate::f16::{from_f32, to_f32};

    /// Against a table whose entry i is i (so a wrong index shows), the unit gives 0 at and
    /// below -10, `x * g` at and above 10, and in between the entry of `x` rounded to the
    /// nearest half (ties to even, as both architectures' conversions round) times `g`; on
    /// lengths that leave every tail.
    #[test]
    fn geglu_indexes_the_table_by_the_rounded_half() {
        if !super::cpu_ok() {
            eprintln!("the CPU does not run the unit (x86-64 needs AVX2/F16C)");
            return;
        }
        let halves: Vec<u16> = (0..=u16::MAX).collect();
        // SAFETY: the CPU runs the unit; 65536 entries.
        let table = unsafe { super::widen(&halves) };
        assert!(table
            .iter()
            .enumerate()
            .all(|(i, t)| t.to_bits() == to_f32(i as u16).to_bits()));
        let table: Vec<f32> = (0..1u32 << 16).map(|i| i as f32).collect();
        let mut rng = crate::rng::XorShift::new(0x9E37_79B9);
        let mut rnd = move |scale: f32| rng.signed() * scale;
        let special = [
            -10.0, 10.0, -9.999999, 9.999999, -10.000001, 10.000001, 0.0, -0.0, 3.0e-6,
        ];
        for len in [1usize, 3, 4, 7, 8, 9, 37] {
            let x: Vec<f32> = (0..len)
                .map(|i| {
                    special
                        .get(i + len % 3)
                        .copied()
                        .unwrap_or_else(|| rnd(14.0))
                })
                .collect();
            let g: Vec<f32> = (0..len).map(|_| rnd(4.0)).collect();
            let mut y = vec![f32::NAN; len];
            // SAFETY: the CPU runs the unit; 65536 entries; slices of equal length.
            unsafe { super::geglu(&table, &x, &g, &mut y) };
            for i in 0..len {
                let want = if x[i] <= -10.0 {
                    0.0
                } else if x[i] >= 10.0 {
                    x[i] * g[i]
                } else {
                    table[usize::from(from_f32(x[i]))] * g[i]
                };
                assert_eq!(y[i].to_bits(), want.to_bits(), "len {len}, x {:e}", x[i]);
            }
        }
    }
}

//! Diagnostic: one thread, 16384 x 2048 k-quant weights (`Q4_K`, `Q6_K`) against 1, 2, 3 and 4
//! `Q8_K` activation rows with Leap's kernels, and ggml's single-row `vec_dot` for comparison.
use leap_backend::ffi as g;
use leap_host::qdot::{Kernel, Kind};
fn main() {
    let (n, rows_w) = (2048usize, 16384usize);
    let nb = n / 256;
    // SAFETY: idempotent init; static traits.
    unsafe { g::ggml_cpu_init() };
    for (kind, ty, wb) in [
        (Kind::Q4K, g::GGML_TYPE_Q4_K, 144usize),
        (Kind::Q6K, g::GGML_TYPE_Q6_K, 210),
    ] {
        // Patterned bytes, each super-block's f16 scales set to ~0.008 (Q6_K's d is last).
        let mut w = vec![0u8; rows_w * nb * wb];
        for (i, b) in w.chunks_exact_mut(wb).enumerate() {
            for (j, q) in b.iter_mut().enumerate() {
                *q = ((i * 31 + j * 7) % 251) as u8;
            }
            if kind == Kind::Q4K {
                b[..4].copy_from_slice(&[0x1f, 0x20, 0x1f, 0x20]);
            } else {
                b[208..210].copy_from_slice(&[0x1f, 0x20]);
            }
        }
        let mut a = vec![0u8; nb * 292];
        for (i, q) in a.iter_mut().enumerate() {
            *q = ((i * 13) % 200) as u8;
        }
        for b in a.chunks_exact_mut(292) {
            b[..4].copy_from_slice(&0.01f32.to_le_bytes());
        }
        let k = Kernel::new(kind).unwrap();
        for r in [1usize, 2, 3, 4] {
            let acts_v: Vec<&[u8]> = (0..r).map(|_| a.as_slice()).collect();
            let acts = k.prepare(n, &acts_v);
            let mut out = vec![0f32; 64 * r];
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                for tile in w.chunks(64 * nb * wb) {
                    k.dot_many(&acts, tile, &mut out);
                }
            }
            println!(
                "{kind:?} leap rows {r}: {:.2} ms per pass (1 thread)",
                t0.elapsed().as_secs_f64() * 1e3 / 5.0
            );
        }
        // SAFETY: static traits; whole rows of each type.
        let vd = unsafe { (*g::ggml_get_type_traits_cpu(ty)).vec_dot.unwrap() };
        let t0 = std::time::Instant::now();
        let mut s = 0f32;
        for _ in 0..5 {
            for row in w.chunks(nb * wb) {
                unsafe {
                    vd(
                        n as i32,
                        &mut s,
                        0,
                        row.as_ptr().cast(),
                        0,
                        a.as_ptr().cast(),
                        0,
                        1,
                    )
                };
            }
        }
        println!(
            "{kind:?} ggml rows 1: {:.2} ms per pass (1 thread) {s}",
            t0.elapsed().as_secs_f64() * 1e3 / 5.0
        );
    }
}

//! Diagnostic: attention's f16 products on a warm cache, one thread: Leap's kernels
//! (`leap_backend::kqmm`; the 512-bit one where the CPU has it, and the 256-bit one) against
//! ggml's `vec_dot_f16` pair by pair, for Gemma 3 270M's and SmolLM2-135M's shapes at 1024
//! cache cells.
#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("x86-64 only");
}

#[cfg(target_arch = "x86_64")]
fn main() {
    for (name, n, rows, stride, m) in [
        ("gemma kq 1 row", 256usize, 1024usize, 512usize, 4usize),
        ("gemma kq 2 rows", 256, 1024, 512, 8),
        ("gemma kq 8 rows", 256, 1024, 512, 32),
        ("gemma kqv 1 row", 1024, 256, 4096, 4),
        ("gemma kqv 2 rows", 1024, 256, 4096, 8),
        ("gemma kqv 8 rows", 1024, 256, 4096, 32),
        ("smollm kq 1 row", 64, 1024, 384, 3),
        ("smollm kq 2 rows", 64, 1024, 384, 6),
        ("smollm kq 8 rows", 64, 1024, 384, 24),
        ("smollm kqv 1 row", 1024, 64, 4096, 3),
        ("smollm kqv 2 rows", 1024, 64, 4096, 6),
        ("smollm kqv 8 rows", 1024, 64, 4096, 24),
    ] {
        let [a, narrow, ggml] = leap_backend::kqmm::time_products(n, rows, stride, m, 200);
        println!(
            "{name}: leap {:.1} us (256-bit kernel {:.1}), ggml {:.1} us per pass",
            a * 5e3,
            narrow * 5e3,
            ggml * 5e3
        );
    }
}

//! Half precision for attention over ggml's f16 KV cache, from [`leap_kernels::f16`]: the one
//! conversion (the hardware's, NaN payloads kept) and exact attention's two inner loops, under
//! the paths the attention code and other crates (`leap_backend::f16::to_f32`) use.

pub use leap_kernels::f16::{axpy, dot, from_f32, prefetch, to_f32, weighted_sum};

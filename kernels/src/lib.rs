//! Leap's compute kernels: the weight-stationary quantized dot products that make a verified
//! row cheap and give it, bit for bit, what ggml's CPU backend gives that row alone
//! ([`qdot`]), attention's f16 products ([`kq`]) and Gemma's GELU-gated unit ([`geglu`]) under
//! the same contract, sparse attention's int8 estimate ([`est`]) and exact inner loops
//! ([`f16`]), the half-precision conversion they share, and the move of a result tile into
//! ggml's rows ([`transpose`]), ggml's flash attention for a lone query row ([`lone`]), and the
//! k-quants' activation quantization ([`q8k`]) and softmax rows ([`softmax`]).
//!
//! No FFI and no dependencies: the checks against the ggml a process actually loaded live with
//! the callers (`leap_host::qdot::agrees_with_ggml`, `leap_backend`). Here each architecture's
//! kernels sit in their own folder (`x86_64/`, `aarch64/`) and are tested against
//! [`reference`], a portable scalar implementation of ggml's arithmetic in each architecture's
//! order, on any machine (the aarch64 ones under qemu-user: `make test-aarch64`).

pub mod cpu;
pub mod est;
pub mod f16;
pub mod geglu;
pub mod kq;
pub mod lone;
pub mod q8k;
pub mod qdot;
pub mod reference;
pub mod rng;
pub mod softmax;
pub mod transpose;

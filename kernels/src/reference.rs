//! ggml's single-row `vec_dot` arithmetic in portable scalar Rust, in each architecture's
//! order: the reference every architecture's kernels in [`crate::qdot`] are tested against on
//! any machine (integer sums are exact whatever their order; what must match is which
//! integers become one `f32` lane, and the order and fusing of the float operations).

use crate::qdot::Kind;

mod blocks;
mod kquant;

#[cfg(target_arch = "x86_64")]
pub(crate) use kquant::scale_min_k4;

/// Whose arithmetic: ggml's kernels for a given instruction set round differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// ggml's x86-64 AVX2/FMA/F16C kernels (Leap's x86-64 build).
    X86Avx2,
    /// ggml's AArch64 NEON kernels built without dotprod (armv8-a: Leap's aarch64 build).
    Neon,
    /// ggml's AArch64 NEON kernels built with dotprod (armv8.2-a+dotprod and up).
    NeonDotprod,
}

/// One weight row (`n` values of `kind`) against one activation row of its activation type,
/// as ggml's `vec_dot` for `order` computes it.
///
/// # Panics
/// When the rows are shorter than `n` needs, or `n` is not a whole number of blocks.
pub fn dot(kind: Kind, order: Order, n: usize, w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(n % kind.block_len(), 0, "not whole blocks");
    let nb = n / kind.block_len();
    assert!(w.len() >= nb * kind.weight_block(), "weight row too short");
    assert!(a.len() >= nb * kind.act_block(), "activation row too short");
    if kind.is_k() {
        kquant::dot(kind, order, nb, w, a)
    } else {
        blocks::dot(kind, order, nb, w, a)
    }
}

/// One `Q4_K` weight row (`n` values) against one `Q8_K` row as ggml's one-row product over
/// *repacked* `Q4_K` weights rounds it on x86-64 (`ggml_gemv_q4_K_8x8_q8_K`: llama.cpp repacks
/// `Q4_K` there by default).
///
/// # Panics
/// When the rows are shorter than `n` needs, or `n` is not a whole number of super-blocks.
pub fn q4k_repacked(n: usize, w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(n % Kind::Q4K.block_len(), 0, "not whole blocks");
    let nb = n / Kind::Q4K.block_len();
    assert!(
        w.len() >= nb * Kind::Q4K.weight_block(),
        "weight row too short"
    );
    assert!(
        a.len() >= nb * Kind::Q4K.act_block(),
        "activation row too short"
    );
    kquant::q4k_repacked(nb, w, a)
}

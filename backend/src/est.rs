//! Sparse attention's int8 estimate, for `attn/estimate.rs` and the OpenCL
//! device's check against it: the kernel is [`leap_kernels::est`].

pub(crate) use leap_kernels::est::{scores_f32q, BLOCK, BLOCK_BYTES};

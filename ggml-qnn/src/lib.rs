//! The Qualcomm QNN device: Qualcomm's `libQnnHtp.so` loaded with `dlopen`, static-shape
//! graphs for what Leap offloads to the NPU, a graph cache keyed by shape and scale bucket, and
//! context binaries so start-up does not pay graph finalization again.
//!
//! Nothing of Qualcomm's is needed to build this crate: the FFI is declared by hand
//! ([`ffi`]) and the libraries are found at run time (`--lib-dir`, `LEAP_QNN_LIB_DIR`, or the
//! cache `scripts/fetch-qnn` fills from the `onnxruntime-qnn` wheel, whose x86-64
//! `libQnnHtp.so` emulates the Hexagon NPU). Crates enable it with their `qnn` feature.
//!
//! Modules:
//! - [`library`]: finding and opening the libraries, provider and version negotiation.
//! - [`ffi`]: the C declarations, with compile-time layout checks.
//! - [`error`]: [`Error`] and the QNN status names.
//! - [`backend`]: owning types backend -> device -> context -> graph; size-checked execute.
//! - [`tensor`]: data types, quantization and sizes (pure).
//! - [`ops`]: the graphs Leap builds (f32 MatMul, the Q·K estimate on int8 keys, quantized MatMul
//!   chunks) and their CPU references.
//! - [`estimate`]: the Q·K estimate with per-row scales (channels, keys and queries
//!   normalized on the CPU, one graph for every head), what sparse attention uses.
//! - [`bucket`]: shadowAttn's scale buckets and the graph-cache key (pure).
//! - [`schedule`]: progressive prefill-to-decode graph switching (pure).
//! - [`binary`]: saving and reloading context binaries.
//! - [`selftest`]: `leap qnn-selftest`, every graph against its CPU reference.
//! - `log`: QNN's `va_list` log callback, through a C shim, into the `log` crate.

pub mod backend;
pub mod binary;
pub mod bucket;
pub mod error;
pub mod estimate;
pub mod ffi;
pub mod library;
mod log;
pub mod ops;
pub mod schedule;
pub mod selftest;
pub mod tensor;

pub use backend::{Backend, Context, Device, Graph, GraphBuilder, Param};
pub use error::{Error, Result, Status};
pub use library::Api;
pub use tensor::{DataType, Quant, Role, TensorSpec};

//! Leap's ggml backend plugin (registry -> device -> buffer type -> buffer), registered
//! in-process or loaded as a `.so` through `GGML_BACKEND_PATH`, with NPU-estimated sparse
//! attention on a CPU device and an OpenCL device.
//!
//! **Nothing is implemented here yet.** Foundation facts it will rely on: llama.cpp is built
//! as shared libraries (`dynamic-link`), so this plugin and the host link one ggml; the
//! plugin needs its own bindgen of `ggml-backend-impl.h` from the same vendored tree.

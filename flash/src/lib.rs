//! Flash-streamed target weights: a GGUF layer map, a DRAM budget, prefetch/evict during a
//! target call, and I/O accounting.
//!
//! **Nothing is implemented here yet**; `leap bench --flash-budget` says so and stops. The
//! layer map will be built on `leap_host::GgufInfo` (ggml's own GGUF parser, absolute tensor
//! byte ranges), which exists today.
#![forbid(unsafe_code)]

//! Safe Rust over llama.cpp, through `llama-cpp-sys-2`.
//!
//! Every `unsafe` call into `llama.h`, `ggml.h` and `gguf.h` in Leap lives in this crate; the
//! crates above it (`spec`, `flash`, the CLI) are safe Rust on the types here.
//!
//! | module | owns |
//! |---|---|
//! | [`backend`] | one-time `llama_backend_init`, llama.cpp's log routed to the `log` crate |
//! | [`model`] | [`Model`]: loading (with a GGUF pre-check), metadata, vocabulary, tokenize/detokenize, chat templates |
//! | [`gguf`] | [`GgufInfo`]: reading a GGUF's header, key/values and tensor table with ggml's own parser |
//! | [`context`] | [`Context`]: decode, logits per output row, KV memory (`seq_rm`/`seq_cp`/`seq_keep`/`seq_add`), threads |
//! | [`batch`] | [`Batch`]: tokens with positions, several sequence ids each, and per-row output flags |
//! | [`sampler`] | [`Sampler`]: llama.cpp's sampler chains (greedy, or temperature/top-k/top-p/min-p/seeded dist) |
//! | [`grammar`] | [`grammar::Grammar`]: llama.cpp's grammar sampler as a mask over a row's logits (GBNF, or a JSON schema through common's converter in a C++ shim) |
//! | [`eval`] | [`EvalObserver`]: llama.cpp's eval callback, for reading named intermediate tensors |
//! | [`exit`] | [`exit::Exit`]: early exit at a layer of a verification call, as a row mask Leap's device honours |
//! | [`usage`] | CPU time and peak RSS of the process, for benchmark accounting |
//! | [`qdot`] | weight-stationary multi-row quantized dot products, bit-identical to ggml's one-row `vec_dot` |
//! | [`project`] | [`project::OnDemand`]: the on-demand output projection (the decode cut at `result_norm`, logits only for the rows wanted, bit-identical to llama.cpp's), [`project::RowStream`] and [`project::DraftVocab`] for flash streaming |
//! | [`sidecar`] | [`sidecar::Sidecar`]: `MODEL.leap.gguf`, Leap's per-model metadata (sparse-attention head profile, early-exit head) |
//! | [`fileio`] | a model file read beside llama.cpp: read-only mappings of byte ranges, reads around the page cache (`O_DIRECT`) |
//! | [`par`] | [`par::parallel`]: Leap's parallel work on ggml's OpenMP team when the process has libgomp, else scoped threads |
//! | [`anchor`] | [`anchor::LlamaSpeculative`]: llama.cpp's own speculative decoding (`common/speculative.h`) through a small C++ shim, the baseline Leap is measured against |
//!
//! Ownership follows the C objects: a [`Model`] is shared through `Arc` and outlives every
//! [`Context`] made from it; a [`Context`] owns its KV memory; a [`Sampler`] and a [`Batch`]
//! own their C allocations. Every llama.cpp status code goes through one conversion into
//! [`Error`].

pub mod anchor;
pub mod backend;
pub mod batch;
pub mod context;
mod error;
pub mod eval;
pub mod exit;
pub mod fileio;
pub mod gguf;
pub mod grammar;
pub mod model;
pub mod par;
pub mod project;
pub mod qdot;
pub mod sampler;
pub mod sidecar;
pub mod usage;

pub use batch::Batch;
pub use context::{Cancel, Context, ContextParams, FlashAttn, Pooling};
pub use error::{Error, Result};
pub use eval::{Chain, EvalObserver, TensorView};
pub use gguf::GgufInfo;
pub use model::{Model, ModelParams};
pub use sampler::Sampler;

/// A token id in a model's vocabulary.
pub type Token = i32;
/// A sequence id in a context's KV memory.
pub type SeqId = i32;
/// A position in a sequence.
pub type Pos = i32;

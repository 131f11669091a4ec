//! Estimated sparse attention (shadowAttn, `../shared/papers/004`, §3) for ggml's
//! `FLASH_ATTN_EXT` on host memory.
//!
//! For every query row and head: a cheap low-precision estimate of `q · k` over all visible
//! keys, the top keys by that estimate (a per-head budget, the first keys and the most recent
//! ones always kept), then exact attention (f32 arithmetic on the f16 cache) over those keys
//! only. A query that sees fewer than [`Sparse::min_keys`] keys attends densely (same code).
//!
//! The estimate reads an int8 shadow of the K cache (ggml's `Q8_0`: a scale per 32 values)
//! instead of the f16 cache: the device takes the cache's `SET_ROWS` writes too (bit-identical
//! to ggml's) and quantizes each new key once, so estimation reads half the bytes of exact
//! attention; the queries stay f32 (only the keys are quantized). 004 estimates on the NPU
//! with a scale per head (static graphs need fixed scales); a scale per block is as cheap on a
//! CPU and closer. Cells the device did not write (it was off, or the context predates sparse
//! mode) are quantized from the f16 cache the first time a node reads them. QNN's estimate
//! ([`crate::qnn`]) reads the f16 cache itself.
//!
//! | file | owns |
//! |---|---|
//! | `attn.rs` | the settings ([`Sparse`], given per context in [`crate::DeviceConfig`]), the process's totals ([`stats`]), profiling's [`Ablation`] |
//! | `attn/op.rs` | the ggml side: which `FLASH_ATTN_EXT` and `SET_ROWS` nodes the device takes, their [`Operands`], computing a node |
//! | `attn/shadow.rs` | the int8 copies of the K caches ([`Keys8`]), kept up to date or filled from the cache |
//! | `attn/kernel.rs` | [`compute`]: per (row, head) the keys kept and exact attention over them, split across threads |
//! | `attn/estimate.rs` | the estimate step on the CPU, OpenCL or QNN, and the head-wise OpenCL pipeline |
//! | `attn/capture.rs` | [`Captured`] nodes for `leap attn-bench` and the tests |

mod capture;
mod estimate;
mod kernel;
mod op;
mod shadow;

pub use capture::Captured;
pub use estimate::{opencl_calls, qnn_calls};
pub use kernel::{compute, Chosen};
pub use op::Operands;
pub(crate) use op::{f16_cache_shape, flash_attn, set_rows, supports_fa, supports_set_rows};
pub(crate) use shadow::quantizer;
pub use shadow::{q8_row_bytes, quantize_f16_rows, Keys8};

use std::sync::Arc;

/// Sparse-attention settings (see the module docs).
#[derive(Debug, Clone)]
pub struct Sparse {
    /// Fraction of a query's visible keys attended exactly (004: 20%).
    pub keep: f32,
    /// Visible keys below which a query attends densely.
    pub min_keys: usize,
    /// First keys (attention sinks) always kept.
    pub sink: usize,
    /// Most recent keys always kept.
    pub recent: usize,
    /// Query rows above which the device leaves a node to ggml (unlimited by default). Every
    /// row is computed alike whatever its batch only while the device takes every node:
    /// with a limit, a prompt token prefilled in a long batch (ggml, dense) and the same token
    /// in a short one (sparse) attend differently, and speculative decoding, whose prompt
    /// calibration prefills in short chunks, no longer reproduces plain decoding exactly. A
    /// limit suits plain decoding of long prompts: on a CPU the estimate of a long batch is a
    /// full `Q·K` product, about as costly as ggml's tiled dense attention.
    pub max_rows: usize,
    /// Extra candidates (a fraction of the estimated budget) whose exact scores are
    /// computed, so that the estimate's errors near the cut are corrected: the budget's
    /// best by exact score are kept.
    pub refine: f32,
    /// Per layer and head keep fractions from an offline profile (`leap profile-heads`);
    /// [`Sparse::keep`] where it has none.
    pub heads: Option<Arc<HeadProfile>>,
    /// Where the estimate runs (the device that takes attention: `leap-cpu` or
    /// `leap-opencl`).
    pub estimate_on: EstimateOn,
    /// With the estimate on OpenCL, run the head-wise pipeline (004 §3.4: the device
    /// estimates the next head while the CPU attends this one). `None`: when the OpenCL
    /// device is a GPU; on a CPU device (PoCL) the launches cost more than they hide.
    pub pipeline: Option<bool>,
    /// Whether the estimate (on `leap-cpu`) runs on Qualcomm's NPU through QNN ([`crate::qnn`],
    /// feature `qnn`): `None` (default) when its library loads and the platform uses it
    /// (Android; elsewhere only with `LEAP_QNN=on`); `Some(true)` whenever it loads;
    /// `Some(false)` never. Without the library the CPU estimates (a warning says why).
    pub qnn: Option<bool>,
}

/// Where sparse attention's int8 estimate runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EstimateOn {
    /// Leap's SIMD kernels on the CPU (`leap-cpu`).
    #[default]
    Cpu,
    /// An OpenCL device (`leap-opencl`): the GPU of a phone, PoCL here.
    OpenCl,
}

impl std::str::FromStr for EstimateOn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(EstimateOn::Cpu),
            "opencl" => Ok(EstimateOn::OpenCl),
            x => Err(format!("the estimate runs on cpu or opencl, not {x:?}")),
        }
    }
}

impl Default for Sparse {
    fn default() -> Self {
        Self {
            keep: 0.2,
            min_keys: 1024,
            sink: 4,
            recent: 64,
            refine: 0.25,
            max_rows: usize::MAX,
            heads: None,
            estimate_on: EstimateOn::Cpu,
            pipeline: None,
            qnn: None,
        }
    }
}

/// Keep fractions per layer and head.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadProfile {
    /// `layers[il][h]`: the fraction of visible keys head `h` of layer `il` keeps.
    pub layers: Vec<Vec<f32>>,
}

impl Sparse {
    /// The fraction of visible keys head `head` of `layer` keeps.
    pub fn keep_for(&self, layer: Option<usize>, head: usize) -> f32 {
        layer
            .and_then(|il| self.heads.as_ref()?.layers.get(il)?.get(head).copied())
            .unwrap_or(self.keep)
            .clamp(0.0, 1.0)
    }
}

/// What sparse attention did, summed over nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Flash-attention nodes computed.
    pub nodes: u64,
    /// (query row, head) pairs attended sparsely.
    pub sparse_rows: u64,
    /// (query row, head) pairs attended densely (too few visible keys).
    pub dense_rows: u64,
    /// Visible keys over all pairs.
    pub keys_visible: u64,
    /// Keys attended exactly over all pairs.
    pub keys_kept: u64,
}

impl Stats {
    /// Nothing done yet.
    pub(crate) const ZERO: Stats = Stats {
        nodes: 0,
        sparse_rows: 0,
        dense_rows: 0,
        keys_visible: 0,
        keys_kept: 0,
    };

    pub(crate) fn add(&mut self, o: &Stats) {
        self.nodes += o.nodes;
        self.sparse_rows += o.sparse_rows;
        self.dense_rows += o.dense_rows;
        self.keys_visible += o.keys_visible;
        self.keys_kept += o.keys_kept;
    }
}

/// Totals since the process started, over every context ([`crate::Device::attn_stats`]: one
/// context's).
pub fn stats() -> Stats {
    *crate::device::TOTALS
        .attn
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A head (or a whole layer's attention) whose output is zeroed, to measure how much the
/// model's loss needs it (004 Eq. 1-2, `leap profile-heads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ablation {
    pub layer: usize,
    /// `None`: every head of the layer.
    pub head: Option<usize>,
}

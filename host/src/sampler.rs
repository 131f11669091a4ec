//! llama.cpp's samplers.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::{backend, Context, Token};

/// Index of the largest logit (the first on ties, as llama.cpp's greedy sampler); 0 for an
/// empty row.
pub fn argmax(logits: &[f32]) -> Token {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as Token
}

/// Settings for a sampled (non-greedy) chain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Temperature; below [`SamplingParams::GREEDY_BELOW`] (0 included) means greedy.
    pub temp: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: i32,
    /// Nucleus threshold (1.0: off).
    pub top_p: f32,
    /// Minimum probability relative to the best token (0.0: off).
    pub min_p: f32,
    /// Seed of the final random draw.
    pub seed: u32,
}

impl SamplingParams {
    /// Temperatures below this decode greedily. The chain divides logits by the temperature:
    /// at 1e-38 they overflow to infinity and the softmax is NaN; well before that, only
    /// logits within a hair of the best keep any probability.
    pub const GREEDY_BELOW: f32 = 1e-4;

    /// Whether these settings decode greedily (a NaN temperature too).
    pub fn is_greedy(&self) -> bool {
        self.temp.is_nan() || self.temp < Self::GREEDY_BELOW
    }

    /// A seed for a request that asks for a random one (llama.cpp's seed -1): the clock,
    /// hashed with the process's random hasher keys.
    pub fn random_seed() -> u32 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish() as u32
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temp: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: 0x5eed,
        }
    }
}

/// Owns a `llama_sampler` (a chain).
pub struct Sampler {
    raw: NonNull<sys::llama_sampler>,
}

// SAFETY: a sampler chain is plain heap state with no thread affinity.
unsafe impl Send for Sampler {}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: created by llama_sampler_chain_init and freed once; the chain frees its members.
        unsafe { sys::llama_sampler_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampler")
    }
}

impl Sampler {
    fn chain(members: impl IntoIterator<Item = *mut sys::llama_sampler>) -> Self {
        backend::init();
        // SAFETY: default params; llama_sampler_chain_init returns a new chain (never null).
        let chain =
            unsafe { sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params()) };
        for m in members {
            // SAFETY: `m` is a freshly created sampler; the chain takes ownership.
            unsafe { sys::llama_sampler_chain_add(chain, m) };
        }
        Self {
            raw: NonNull::new(chain).expect("llama_sampler_chain_init returned null"),
        }
    }

    /// Always the most likely token.
    pub fn greedy() -> Self {
        // SAFETY: creates a new sampler.
        Self::chain([unsafe { sys::llama_sampler_init_greedy() }])
    }

    /// Greedy when [`SamplingParams::is_greedy`], else top-k, top-p, min-p, temperature and
    /// a seeded draw.
    pub fn new(p: &SamplingParams) -> Self {
        if p.is_greedy() {
            return Self::greedy();
        }
        // SAFETY: each call creates a new sampler that the chain will own.
        unsafe {
            Self::chain([
                sys::llama_sampler_init_top_k(p.top_k),
                sys::llama_sampler_init_top_p(p.top_p, 1),
                sys::llama_sampler_init_min_p(p.min_p, 1),
                sys::llama_sampler_init_temp(p.temp),
                sys::llama_sampler_init_dist(p.seed),
            ])
        }
    }

    /// Sample from batch row `row` of the last decode (`-1`: last output) and accept it.
    pub fn sample(&mut self, ctx: &Context, row: i32) -> Token {
        // SAFETY: live sampler and context; llama.cpp reads the row's logits.
        unsafe { sys::llama_sampler_sample(self.raw.as_ptr(), ctx.raw(), row) }
    }
}

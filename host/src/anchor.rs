//! llama.cpp's own speculative decoding (`common/speculative.h`), the anchor `leap bench` runs
//! beside Leap's modes in the same process. A small C++ shim (`host/shim/anchor.cpp`, compiled
//! by build.rs against the vendored llama.cpp) drives it exactly as llama-server does; this
//! module is the safe face of that shim.

use std::ffi::{c_char, CString};
use std::ptr::NonNull;

use crate::{Context, Error, Result, Token};

/// llama.cpp's speculative types that `leap bench` runs as `llama:TYPE`.
pub const TYPES: &[&str] = &[
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "draft-simple",
];

#[repr(C)]
struct LeapAnchor {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AnchorParams {
    temp: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    seed: u32,
    draft_n_max: i32,
    draft_n_min: i32,
    draft_p_min: f32,
    log_verbosity: i32,
}

extern "C" {
    fn leap_anchor_new(
        ctx_tgt: *mut llama_cpp_sys_2::llama_context,
        ctx_dft: *mut llama_cpp_sys_2::llama_context,
        kind: *const c_char,
        params: *const AnchorParams,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut LeapAnchor;
    fn leap_anchor_free(a: *mut LeapAnchor);
    fn leap_anchor_prefill(
        a: *mut LeapAnchor,
        prompt: *const Token,
        n: i32,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn leap_anchor_first(a: *mut LeapAnchor) -> Token;
    fn leap_anchor_step(
        a: *mut LeapAnchor,
        n_remaining: i32,
        out: *mut Token,
        cap: i32,
        n_drafted: *mut i32,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// Settings of the anchor: the target's sampler, and draft-simple's knobs (`None` keeps
/// llama.cpp's defaults).
#[derive(Debug, Clone, Copy, Default)]
pub struct AnchorConfig {
    /// The target sampler (`temp <= 0`: greedy).
    pub sampling: crate::sampler::SamplingParams,
    /// draft-simple: most tokens per draft.
    pub draft_n_max: Option<i32>,
    /// draft-simple: drafts shorter than this are dropped.
    pub draft_n_min: Option<i32>,
    /// draft-simple: stop drafting below this draft probability.
    pub draft_p_min: Option<f32>,
}

/// One accepted run of tokens from a speculative step.
#[derive(Debug, Clone, Default)]
pub struct Step {
    /// Accepted tokens, at least one (the target's own token at the end).
    pub tokens: Vec<Token>,
    /// How many tokens the drafter proposed.
    pub drafted: usize,
}

/// llama.cpp's speculative decoder. It owns the target context (and the draft context for
/// `draft-simple`), as a llama-server slot does, so its drafter state (ngram-mod's table, the
/// n-gram caches) lives across requests the way it does in the server.
pub struct LlamaSpeculative {
    raw: NonNull<LeapAnchor>,
    kind: String,
    // Freed after `raw` (Drop runs first, then fields in order).
    target: Context,
    _draft: Option<Context>,
}

// SAFETY: the shim's state is plain heap data used from one thread at a time (`&mut self`).
unsafe impl Send for LlamaSpeculative {}

impl Drop for LlamaSpeculative {
    fn drop(&mut self) {
        // SAFETY: created by leap_anchor_new, freed once.
        unsafe { leap_anchor_free(self.raw.as_ptr()) }
    }
}

const ERR_LEN: usize = 512;

fn err_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl LlamaSpeculative {
    /// A decoder of llama.cpp type `kind` (see [`TYPES`]).
    ///
    /// # Errors
    /// [`Error::Speculative`] with llama.cpp's own message, e.g. for a draft whose vocabulary
    /// does not match the target's.
    pub fn new(
        target: Context,
        mut draft: Option<Context>,
        kind: &str,
        params: &AnchorConfig,
    ) -> Result<Self> {
        let ckind = CString::new(kind).map_err(|_| Error::NulByte {
            what: "speculative type",
        })?;
        if kind == "draft-simple" && draft.is_none() {
            return Err(Error::Speculative {
                kind: kind.into(),
                reason: "draft-simple needs a draft context".into(),
            });
        }
        let p = AnchorParams {
            temp: params.sampling.temp,
            top_k: params.sampling.top_k,
            top_p: params.sampling.top_p,
            min_p: params.sampling.min_p,
            seed: params.sampling.seed,
            draft_n_max: params.draft_n_max.unwrap_or(-1),
            draft_n_min: params.draft_n_min.unwrap_or(-1),
            draft_p_min: params.draft_p_min.unwrap_or(-1.0),
            // common/ logs to stderr by itself; follow the `log` crate's level for llama.cpp.
            log_verbosity: if log::log_enabled!(target: "llama.cpp", log::Level::Debug) {
                5
            } else if log::log_enabled!(target: "llama.cpp", log::Level::Info) {
                3
            } else if log::log_enabled!(target: "llama.cpp", log::Level::Warn) {
                2
            } else if log::log_enabled!(target: "llama.cpp", log::Level::Error) {
                1
            } else {
                // Off (the CLI's default): a failure comes back in the error this returns.
                0
            },
        };
        let mut err = [0 as c_char; ERR_LEN];
        let dft = draft.as_mut().map_or(std::ptr::null_mut(), |d| d.raw());
        // SAFETY: both contexts are live and owned by the decoder from here on, so nothing
        // else touches them while the shim holds their pointers; strings and params outlive the call; the shim
        // catches every C++ exception and reports it through `err`.
        let raw = unsafe {
            leap_anchor_new(
                target.raw(),
                dft,
                ckind.as_ptr(),
                &p,
                err.as_mut_ptr(),
                ERR_LEN,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| Error::Speculative {
            kind: kind.into(),
            reason: err_text(&err),
        })?;
        Ok(Self {
            raw,
            kind: kind.into(),
            target,
            _draft: draft,
        })
    }

    /// The target context.
    pub fn target(&self) -> &Context {
        &self.target
    }

    fn fail(&self, err: &[c_char]) -> Error {
        Error::Speculative {
            kind: self.kind.clone(),
            reason: err_text(err),
        }
    }

    /// Clear the contexts and run the prompt through the target (and the drafter).
    ///
    /// # Errors
    /// [`Error::Speculative`] when a decode fails.
    pub fn prefill(&mut self, prompt: &[Token]) -> Result<()> {
        let mut err = [0 as c_char; ERR_LEN];
        // SAFETY: `prompt` is valid for its length; the decoder is live.
        let rc = unsafe {
            leap_anchor_prefill(
                self.raw.as_ptr(),
                prompt.as_ptr(),
                prompt.len() as i32,
                err.as_mut_ptr(),
                ERR_LEN,
            )
        };
        if rc != 0 {
            return Err(self.fail(&err));
        }
        Ok(())
    }

    /// The first generated token (sampled from the prompt's last logits).
    ///
    /// # Errors
    /// [`Error::Speculative`] if sampling failed.
    pub fn first(&mut self) -> Result<Token> {
        // SAFETY: live decoder, after prefill.
        let t = unsafe { leap_anchor_first(self.raw.as_ptr()) };
        if t < 0 {
            return Err(Error::Speculative {
                kind: self.kind.clone(),
                reason: "sampling the first token failed".into(),
            });
        }
        Ok(t)
    }

    /// One draft + verify step; `n_remaining` caps the draft at `n_remaining - 1` tokens.
    ///
    /// # Errors
    /// [`Error::Speculative`] when the target or the drafter fails.
    pub fn step(&mut self, n_remaining: usize) -> Result<Step> {
        let cap = 512usize;
        let mut out = vec![0 as Token; cap];
        let mut drafted = 0i32;
        let mut err = [0 as c_char; ERR_LEN];
        // SAFETY: `out` has `cap` slots; live decoder.
        let n = unsafe {
            leap_anchor_step(
                self.raw.as_ptr(),
                n_remaining.min(i32::MAX as usize) as i32,
                out.as_mut_ptr(),
                cap as i32,
                &mut drafted,
                err.as_mut_ptr(),
                ERR_LEN,
            )
        };
        if n < 1 {
            return Err(self.fail(&err));
        }
        out.truncate(n as usize);
        Ok(Step {
            tokens: out,
            drafted: drafted.max(0) as usize,
        })
    }
}

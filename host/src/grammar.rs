//! Structured output: llama.cpp's grammar sampler (`llama_sampler_init_grammar`) as a mask
//! over a row's logits. A grammar is GBNF text, or a JSON schema turned into GBNF by llama.cpp's
//! own converter (`common/json-schema-to-grammar.h`, C++, behind `shim/grammar.cpp`), as
//! llama-server does for `json_schema` and `response_format`.
//!
//! The decoder masks the logits of each position ([`Grammar::mask`]: tokens the grammar does
//! not allow there get `-inf`), chooses among the rest as it would without a grammar, and
//! tells the grammar the token it chose ([`Grammar::accept`]). An end-of-generation token is
//! allowed once the grammar is complete.

use std::ffi::{c_char, CString};
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::sampler::argmax;
use crate::{backend, Error, Model, Result, Token};

extern "C" {
    fn leap_json_schema_to_grammar(
        schema: *const c_char,
        out: *mut c_char,
        cap: i64,
        err: *mut c_char,
        err_cap: i64,
    ) -> i64;
}

/// The GBNF grammar of a JSON schema (JSON text), as llama.cpp's converter writes it.
///
/// # Errors
/// [`Error::Grammar`] when the schema is not JSON or uses what the converter cannot express.
pub fn json_schema_to_gbnf(schema: &str) -> Result<String> {
    let bad = |reason: String| Error::Grammar {
        what: "JSON schema",
        reason,
    };
    let c = CString::new(schema).map_err(|_| Error::NulByte {
        what: "JSON schema",
    })?;
    let mut err = vec![0u8; 512];
    let mut out = vec![0u8; 4096];
    for _ in 0..2 {
        // SAFETY: `c` is NUL-terminated; `out` and `err` have the lengths passed. The shim
        // catches every C++ exception.
        let n = unsafe {
            leap_json_schema_to_grammar(
                c.as_ptr(),
                out.as_mut_ptr().cast(),
                out.len() as i64,
                err.as_mut_ptr().cast(),
                err.len() as i64,
            )
        };
        if n < 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            return Err(bad(String::from_utf8_lossy(&err[..end]).into_owned()));
        }
        let n = n as usize;
        if n < out.len() {
            out.truncate(n);
            return String::from_utf8(out).map_err(|e| bad(e.to_string()));
        }
        out.resize(n + 1, 0);
    }
    Err(bad("the grammar kept growing".into()))
}

/// llama.cpp's grammar sampler for one generation on `model`'s vocabulary.
pub struct Grammar {
    raw: NonNull<sys::llama_sampler>,
    /// Keeps the vocabulary the sampler points into alive.
    model: Arc<Model>,
    /// One entry per vocabulary token, rebuilt for every [`Grammar::mask`].
    cand: Vec<sys::llama_token_data>,
}

// SAFETY: the sampler is plain memory owned by this value, used through `&mut self` only
// (one thread at a time); llama.cpp keeps no thread-affine state in it.
unsafe impl Send for Grammar {}

impl Drop for Grammar {
    fn drop(&mut self) {
        // SAFETY: created by llama_sampler_init_grammar, freed once.
        unsafe { sys::llama_sampler_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").finish_non_exhaustive()
    }
}

impl Grammar {
    /// The grammar of GBNF text `gbnf` (its rule `root` first).
    ///
    /// # Errors
    /// [`Error::Grammar`] with llama.cpp's reason when it cannot parse it.
    pub fn gbnf(model: &Arc<Model>, gbnf: &str) -> Result<Self> {
        backend::init();
        let text = CString::new(gbnf).map_err(|_| Error::NulByte { what: "grammar" })?;
        backend::take_last_problem();
        // SAFETY: the vocabulary lives as long as `model` (kept in the value); both strings are
        // NUL-terminated and outlive the call.
        let raw = unsafe {
            sys::llama_sampler_init_grammar(model.vocab(), text.as_ptr(), c"root".as_ptr())
        };
        let raw = NonNull::new(raw).ok_or_else(|| Error::Grammar {
            what: "grammar",
            reason: backend::reason_or("llama.cpp cannot parse it"),
        })?;
        Ok(Self {
            raw,
            model: Arc::clone(model),
            cand: Vec::new(),
        })
    }

    /// The grammar of a JSON schema (JSON text): [`json_schema_to_gbnf`], then [`Grammar::gbnf`].
    ///
    /// # Errors
    /// As those two.
    pub fn json_schema(model: &Arc<Model>, schema: &str) -> Result<Self> {
        Self::gbnf(model, &json_schema_to_gbnf(schema)?)
    }

    /// Set to `-inf` the logits (one per vocabulary token) of the tokens the grammar does not
    /// allow next; whether any token is left.
    pub fn mask(&mut self, logits: &mut [f32]) -> bool {
        let n = (self.model.n_vocab() as usize).min(logits.len());
        self.cand.clear();
        self.cand.extend(
            logits[..n]
                .iter()
                .enumerate()
                .map(|(i, &l)| sys::llama_token_data {
                    id: i as Token,
                    logit: l,
                    p: 0.0,
                }),
        );
        let mut arr = sys::llama_token_data_array {
            data: self.cand.as_mut_ptr(),
            size: self.cand.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: `arr` points into `self.cand` (`size` entries), alive and unaliased during
        // the call; the grammar sampler only rewrites logits in place.
        unsafe { sys::llama_sampler_apply(self.raw.as_ptr(), &raw mut arr) };
        // SAFETY: the sampler may have pointed `data` elsewhere; it holds `size` entries.
        let out = unsafe { std::slice::from_raw_parts(arr.data, arr.size) };
        let mut any = false;
        for c in out {
            if c.logit == f32::NEG_INFINITY {
                if let Some(l) = logits.get_mut(c.id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            } else {
                any = true;
            }
        }
        any
    }

    /// Whether the grammar allows `token` next (one candidate through the sampler: far
    /// cheaper than [`Grammar::mask`] over a whole vocabulary).
    pub fn allows(&mut self, token: Token) -> bool {
        let mut one = sys::llama_token_data {
            id: token,
            logit: 0.0,
            p: 0.0,
        };
        let mut arr = sys::llama_token_data_array {
            data: &raw mut one,
            size: 1,
            selected: -1,
            sorted: false,
        };
        // SAFETY: `arr` points at `one`, alive and unaliased during the call; the grammar
        // sampler only rewrites logits in place.
        unsafe { sys::llama_sampler_apply(self.raw.as_ptr(), &raw mut arr) };
        // SAFETY: the sampler may have pointed `data` elsewhere; it holds `size` entries.
        let out = unsafe { std::slice::from_raw_parts(arr.data, arr.size) };
        out.iter()
            .any(|c| c.id == token && c.logit != f32::NEG_INFINITY)
    }

    /// The greedy choice under the grammar: the allowed token with the largest logit (the
    /// lowest id among equals), `None` when the grammar allows none. As llama.cpp's
    /// `common_sampler` does, the unconstrained best is tried first and the whole vocabulary
    /// masked only when the grammar refuses it: the same token either way, since an allowed
    /// overall best is also the best allowed. `scratch` holds the masked copy.
    pub fn choose_greedy(&mut self, logits: &[f32], scratch: &mut Vec<f32>) -> Option<Token> {
        let best = argmax(logits);
        if self.allows(best) {
            return Some(best);
        }
        scratch.clear();
        scratch.extend_from_slice(logits);
        self.mask(scratch).then(|| argmax(scratch))
    }

    /// [`Grammar::choose_greedy`], then [`Grammar::accept`] of the token chosen. `None`, with
    /// a warning that the output ends there, when the grammar allows no token.
    pub fn take_greedy(&mut self, logits: &[f32], scratch: &mut Vec<f32>) -> Option<Token> {
        let Some(t) = self.choose_greedy(logits, scratch) else {
            log::warn!("the grammar allows no token here: the output ends");
            return None;
        };
        self.accept(t);
        Some(t)
    }

    /// An independent copy in the same state (to walk drafts without moving this one).
    ///
    /// # Errors
    /// [`Error::Grammar`] when llama.cpp cannot copy it.
    pub fn try_clone(&self) -> Result<Self> {
        // SAFETY: a live sampler; the copy is a new sampler owned by the result.
        let raw = unsafe { sys::llama_sampler_clone(self.raw.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::Grammar {
            what: "grammar",
            reason: "llama.cpp could not copy its state".into(),
        })?;
        Ok(Self {
            raw,
            model: Arc::clone(&self.model),
            cand: Vec::new(),
        })
    }

    /// How many of `tokens`, one after another from here, the grammar allows (a copy walks
    /// them; this one stays where it is).
    ///
    /// # Errors
    /// As [`Grammar::try_clone`].
    pub fn allowed_prefix(&self, tokens: &[Token]) -> Result<usize> {
        let mut walk = self.try_clone()?;
        for (i, &t) in tokens.iter().enumerate() {
            if !walk.allows(t) {
                return Ok(i);
            }
            walk.accept(t);
        }
        Ok(tokens.len())
    }

    /// Advance the grammar past `token`, the one chosen.
    pub fn accept(&mut self, token: Token) {
        // SAFETY: a live sampler; llama.cpp checks the token against the grammar (an
        // end-of-generation token is a no-op).
        unsafe { sys::llama_sampler_accept(self.raw.as_ptr(), token) }
    }
}

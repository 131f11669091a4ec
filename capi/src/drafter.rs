//! `leap_drafter_*`: Leap's drafting for a host that decodes and verifies itself, llama.cpp's
//! `--spec-type leap` (patches/) above all. A thin layer over [`leap_spec::hosted`]; one
//! drafter per host sequence. And `leap_backend_register`: Leap's ggml device in a host's
//! backend registry, configured from the environment as the plugin is.

use std::sync::Mutex;

use leap_spec::hosted::{HostedConfig, HostedDrafter};

use crate::error::Error;
use crate::{guard, guard_value, leap_status, ref_arg, write_out};

/// `leap_drafter`: a hosted drafter behind a lock, so that two threads drafting on it at
/// once get an error rather than aliasing.
pub struct leap_drafter {
    inner: Mutex<HostedDrafter>,
}

/// `leap_drafter_params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct leap_drafter_params {
    pub max_draft: i32,
    pub min_match: i32,
    pub history_tokens: i32,
}

/// `leap_drafter_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct leap_drafter_stats {
    pub steps: u64,
    pub drafts: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// Most tokens one draft may have.
const MAX_DRAFT: i32 = 256;

impl leap_drafter_params {
    fn config(&self) -> Result<HostedConfig, Error> {
        let range = |what, v: i32, lo, hi, expected| {
            if v < lo || v > hi {
                Err(Error::Range {
                    what,
                    value: v.into(),
                    expected,
                })
            } else {
                Ok(v as usize)
            }
        };
        Ok(HostedConfig {
            max_draft: range("max_draft", self.max_draft, 1, MAX_DRAFT, "1 to 256")?,
            min_match: range("min_match", self.min_match, 1, 64, "1 to 64")?,
            history_tokens: range(
                "history_tokens",
                self.history_tokens,
                0,
                i32::MAX,
                "at least 0",
            )?,
            ..HostedConfig::default()
        })
    }
}

/// `leap_drafter_params leap_drafter_default_params(void)`.
#[no_mangle]
pub extern "C" fn leap_drafter_default_params() -> leap_drafter_params {
    let c = HostedConfig::default();
    leap_drafter_params {
        max_draft: c.max_draft as i32,
        min_match: c.min_match as i32,
        history_tokens: i32::try_from(c.history_tokens).unwrap_or(i32::MAX),
    }
}

/// The tokens at `p`: `n` of them, or none when `n` is 0 (then `p` may be NULL).
///
/// # Safety
/// `p` is NULL or points to `n` readable `i32`s that stay unchanged during the call.
unsafe fn tokens_arg<'a>(p: *const i32, n: usize, what: &'static str) -> Result<&'a [i32], Error> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::Null { what });
    }
    // SAFETY: non-null, `n` readable tokens by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Lock a drafter for one call.
fn lock(d: &leap_drafter) -> Result<std::sync::MutexGuard<'_, HostedDrafter>, Error> {
    crate::try_lock(&d.inner)
}

/// Make a drafter with `make` into the out-pointer `out` (NULL on failure).
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn new_into(
    out: *mut *mut leap_drafter,
    make: impl FnOnce() -> Result<HostedDrafter, Error>,
) -> leap_status {
    guard(|| {
        // SAFETY: NULL or writable (contract); NULL on failure.
        unsafe { write_out(out, std::ptr::null_mut(), "out") }?;
        crate::logging::init();
        let d = Box::new(leap_drafter {
            inner: Mutex::new(make()?),
        });
        // SAFETY: checked writable above.
        unsafe { out.write(Box::into_raw(d)) };
        Ok(())
    })
}

/// `leap_status leap_drafter_new(const leap_drafter_params *, leap_drafter **out)`.
///
/// # Safety
/// `params` is NULL or points to a `leap_drafter_params`; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_new(
    params: *const leap_drafter_params,
    out: *mut *mut leap_drafter,
) -> leap_status {
    // `out` is NULL or writable (contract).
    new_into(out, || {
        // SAFETY: NULL or a valid leap_drafter_params (contract).
        let params = unsafe { params.as_ref() }.copied();
        let cfg = params
            .unwrap_or_else(|| leap_drafter_default_params())
            .config()?;
        Ok(HostedDrafter::new(cfg))
    })
}

/// `leap_status leap_drafter_new_sibling(leap_drafter *of, leap_drafter **out)`.
///
/// # Safety
/// `of` is NULL or a live drafter; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_new_sibling(
    of: *mut leap_drafter,
    out: *mut *mut leap_drafter,
) -> leap_status {
    // `out` is NULL or writable (contract).
    new_into(out, || {
        // SAFETY: NULL or live (contract).
        let of = unsafe { ref_arg(of, "of") }?;
        Ok(lock(of)?.sibling())
    })
}

/// `leap_status leap_drafter_use_corpus(leap_drafter *, const char *model_path,
/// const char *sidecar, size_t *answers)`.
///
/// # Safety
/// `d` is NULL or a live drafter; `model_path` NULL or a string; `sidecar` NULL or a string;
/// `answers` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_use_corpus(
    d: *mut leap_drafter,
    model_path: *const std::ffi::c_char,
    sidecar: *const std::ffi::c_char,
    answers: *mut usize,
) -> leap_status {
    guard(|| {
        if !answers.is_null() {
            // SAFETY: non-null, writable (contract); 0 until answers are loaded.
            unsafe { answers.write(0) };
        }
        // SAFETY: NULL or live (contract).
        let d = unsafe { ref_arg(d, "drafter") }?;
        // SAFETY: NULL or strings (contract).
        let model = std::path::PathBuf::from(unsafe { crate::str_arg(model_path, "model_path") }?);
        let side = if sidecar.is_null() {
            None
        } else {
            // SAFETY: a string (contract).
            Some(std::path::PathBuf::from(unsafe {
                crate::str_arg(sidecar, "sidecar")
            }?))
        };
        let corpus =
            leap_spec::session::corpus_at(&model, side.as_deref()).map_err(Error::Sidecar)?;
        if let Some(c) = corpus {
            lock(d)?.set_corpus(c.automaton());
            if !answers.is_null() {
                // SAFETY: non-null, writable (contract).
                unsafe { answers.write(c.answers()) };
            }
        }
        Ok(())
    })
}

/// `void leap_drafter_free(leap_drafter *)`.
///
/// # Safety
/// `d` is NULL or came from `leap_drafter_new` and was not freed yet, and no call on it runs.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_free(d: *mut leap_drafter) {
    guard_value((), || {
        if !d.is_null() {
            // SAFETY: from leap_drafter_new (Box::into_raw), freed once (contract).
            drop(unsafe { Box::from_raw(d) });
        }
    })
}

/// `leap_status leap_drafter_begin(leap_drafter *, const int32_t *prompt, size_t n_prompt)`.
///
/// # Safety
/// `d` is NULL or a live drafter; `prompt` is NULL or points to `n_prompt` tokens.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_begin(
    d: *mut leap_drafter,
    prompt: *const i32,
    n_prompt: usize,
) -> leap_status {
    guard(|| {
        // SAFETY: NULL or live (contract).
        let d = unsafe { ref_arg(d, "drafter") }?;
        // SAFETY: NULL or n_prompt tokens (contract).
        let prompt = unsafe { tokens_arg(prompt, n_prompt, "prompt") }?;
        lock(d)?.begin(prompt);
        Ok(())
    })
}

/// Logged once where [`leap_backend::lone::verification_rows_inexact`]: `--spec-type leap`
/// then drafts nothing, so its output stays `--spec-type none`'s: a ggml whose arithmetic
/// `leap_kernels::lone` does not reproduce (a CPU without the device's kernels stops it too).
const DRAFTS_OFF: &str = "Leap's device cannot compute flash attention's verification rows as \
this ggml computes a row alone: drafting nothing, so the output stays plain decoding's; with \
-fa off Leap drafts";

/// `leap_status leap_drafter_draft(leap_drafter *, const int32_t *tokens, size_t n_tokens,
/// int32_t id_last, int32_t max, int32_t *out, size_t *n_out)`.
///
/// # Safety
/// `d` is NULL or a live drafter; `tokens` is NULL or points to `n_tokens` tokens; `out` is
/// NULL or has room for `max` tokens; `n_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_draft(
    d: *mut leap_drafter,
    tokens: *const i32,
    n_tokens: usize,
    id_last: i32,
    max: i32,
    out: *mut i32,
    n_out: *mut usize,
) -> leap_status {
    guard(|| {
        // SAFETY: NULL or writable (contract); 0 on failure.
        unsafe { write_out(n_out, 0, "n_out") }?;
        // SAFETY: NULL or live (contract).
        let d = unsafe { ref_arg(d, "drafter") }?;
        // SAFETY: NULL or n_tokens tokens (contract).
        let tokens = unsafe { tokens_arg(tokens, n_tokens, "tokens") }?;
        if max < 0 {
            return Err(Error::Range {
                what: "max",
                value: max.into(),
                expected: "at least 0",
            });
        }
        if out.is_null() && max > 0 {
            return Err(Error::Null { what: "out" });
        }
        if leap_backend::lone::verification_rows_inexact() {
            // The host's verification rows would round otherwise than its plain steps: no
            // drafts keeps its output plain decoding's (`n_out` is 0).
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| log::warn!("{DRAFTS_OFF}"));
            return Ok(());
        }
        let mut drafter = lock(d)?;
        let draft = drafter.draft(tokens, id_last, max as usize);
        debug_assert!(draft.len() <= max as usize);
        let n = draft.len().min(max as usize);
        if n > 0 {
            // SAFETY: room for `max` >= n tokens (contract); `draft` is the drafter's buffer.
            unsafe { std::ptr::copy_nonoverlapping(draft.as_ptr(), out, n) };
        }
        // SAFETY: checked writable above.
        unsafe { n_out.write(n) };
        Ok(())
    })
}

/// `leap_status leap_drafter_get_stats(const leap_drafter *, leap_drafter_stats *out)`.
///
/// # Safety
/// `d` is NULL or a live drafter; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn leap_drafter_get_stats(
    d: *const leap_drafter,
    out: *mut leap_drafter_stats,
) -> leap_status {
    guard(|| {
        // SAFETY: NULL or live (contract).
        let d = unsafe { ref_arg(d, "drafter") }?;
        let s = lock(d)?.stats();
        let stats = leap_drafter_stats {
            steps: s.steps,
            drafts: s.drafts,
            drafted: s.drafted,
            accepted: s.accepted,
        };
        // SAFETY: NULL or writable (contract).
        unsafe { write_out(out, stats, "out") }
    })
}

/// `leap_status leap_backend_register(void)`: Leap's `leap-cpu` device into ggml's registry,
/// configured from the environment (as the plugin: `LEAP_KERNELS`, `LEAP_SPARSE`,
/// `LEAP_ESTIMATE`, `LEAP_STATS`, `LEAP_OUTPUT`), taking the output projection too unless
/// `LEAP_OUTPUT=ggml` ([`leap_backend::DeviceConfig::take_output`]). Once per process; later calls do nothing.
#[no_mangle]
pub extern "C" fn leap_backend_register() -> leap_status {
    guard(|| {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            crate::logging::init();
            // Such a host computes every row's logits itself (no on-demand projection here);
            // the environment may say otherwise (LEAP_OUTPUT=ggml). It is llama.cpp with
            // Leap's patches, whose automatic flash attention stays on with the device taking
            // attention (patches/0003): decoding's and verification's rows as lone rows.
            leap_backend::use_by_default(leap_backend::configure_from_env(
                "leap",
                leap_backend::DeviceConfig {
                    take_output: true,
                    lone_attention: true,
                    ..Default::default()
                },
            ));
            leap_backend::register();
        });
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::LEAP_ERR_INVALID_ARGUMENT;
    use crate::LEAP_OK;

    #[test]
    fn a_drafter_drafts_a_repeat_and_refuses_bad_arguments() {
        unsafe {
            let mut d = std::ptr::null_mut();
            let bad = leap_drafter_params {
                max_draft: 0,
                ..leap_drafter_default_params()
            };
            assert_eq!(leap_drafter_new(&bad, &mut d), LEAP_ERR_INVALID_ARGUMENT);
            assert!(d.is_null());
            assert_eq!(leap_drafter_new(std::ptr::null(), &mut d), LEAP_OK);
            let mut text: Vec<i32> = (100..160).collect();
            text.extend(100..110);
            assert_eq!(leap_drafter_begin(d, text.as_ptr(), text.len()), LEAP_OK);
            let mut out = [0i32; 8];
            let mut n = 99;
            let st = leap_drafter_draft(
                d,
                text.as_ptr(),
                text.len(),
                110,
                8,
                out.as_mut_ptr(),
                &mut n,
            );
            assert_eq!(st, LEAP_OK);
            assert!(n > 0 && n <= 8, "{n}");
            assert_eq!(out[..n], (111..111 + n as i32).collect::<Vec<_>>()[..]);
            // NULL out with room asked for; a negative max.
            let st = leap_drafter_draft(
                d,
                text.as_ptr(),
                text.len(),
                110,
                8,
                std::ptr::null_mut(),
                &mut n,
            );
            assert_eq!((st, n), (LEAP_ERR_INVALID_ARGUMENT, 0));
            let st = leap_drafter_draft(
                d,
                text.as_ptr(),
                text.len(),
                110,
                -1,
                out.as_mut_ptr(),
                &mut n,
            );
            assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
            let mut s = leap_drafter_stats::default();
            assert_eq!(leap_drafter_get_stats(d, &mut s), LEAP_OK);
            assert_eq!((s.steps, s.drafts), (1, 1));
            assert_eq!(
                leap_drafter_begin(std::ptr::null_mut(), text.as_ptr(), 1),
                LEAP_ERR_INVALID_ARGUMENT
            );
            assert_eq!(
                leap_drafter_begin(d, std::ptr::null(), 3),
                LEAP_ERR_INVALID_ARGUMENT
            );
            let mut sib = std::ptr::null_mut();
            assert_eq!(leap_drafter_new_sibling(d, &mut sib), LEAP_OK);
            assert!(!sib.is_null());
            assert_eq!(
                leap_drafter_new_sibling(std::ptr::null_mut(), &mut sib),
                LEAP_ERR_INVALID_ARGUMENT
            );
            assert!(sib.is_null());
            leap_drafter_free(d);
            leap_drafter_free(std::ptr::null_mut());
        }
    }
}

//! Leap's C API: `libleap.so` and `include/leap.h`, for apps that embed Leap.
//!
//! A thin layer over [`leap_spec::session`], the engine API every front end uses: a
//! `leap_model` is a [`Runtime`], a `leap_session` a [`Session`] (with an `Arc` of its runtime,
//! so freeing the model first is not undefined behaviour), and `leap_generate` is
//! [`Session::generate`] after the prompt is wrapped and tokenized as `leap generate` does it.
//! No decoding logic lives here. The C names are kept in Rust (`leap_model_params`) so that a
//! grep lines up across the header and this crate.
//!
//! Every exported function runs its body inside [`guard`]: null pointers and invalid UTF-8
//! are `LEAP_ERR_INVALID_ARGUMENT`, the engine's errors keep their
//! [`Error::code`](leap_spec::session::Error::code), and a panic is caught there and becomes
//! `LEAP_ERR_INTERNAL`, so no unwinding ever crosses into C. The message goes to the calling
//! thread's `leap_last_error`.
//!
//! | module | owns |
//! |---|---|
//! | [`error`] | the C API's errors, their `leap_status`, the thread's last error message |
//! | [`drafter`] | `leap_drafter_*` (drafting for a host that verifies, llama.cpp's `--spec-type leap`) and `leap_backend_register` |
//! | [`logging`] | Leap's and llama.cpp's log on stderr, filtered by `LEAP_LOG` |

#![allow(non_camel_case_types)]

pub mod drafter;
pub mod error;
pub mod logging;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, TryLockError};

use leap_host::sampler::SamplingParams;
use leap_spec::session::{Mode, Options, Request, Runtime, Session, Totals};

use error::Error;
pub use error::{
    LEAP_ERR_CONTEXT_FULL, LEAP_ERR_DECODE, LEAP_ERR_INTERNAL, LEAP_ERR_INVALID_ARGUMENT,
    LEAP_ERR_MODEL, LEAP_OK,
};
use leap_spec::text::TextStream;

/// `leap_status`: `LEAP_OK` or an error (the constants in [`error`]). An `int` rather than a
/// Rust enum, so that any value C passes in is defined.
pub type leap_status = c_int;

/// `LEAP_MODE_LEAP`.
pub const LEAP_MODE_LEAP: i32 = 0;
/// `LEAP_MODE_PLAIN`.
pub const LEAP_MODE_PLAIN: i32 = 1;
/// `LEAP_FINISH_LENGTH`.
pub const LEAP_FINISH_LENGTH: i32 = 0;
/// `LEAP_FINISH_EOG`.
pub const LEAP_FINISH_EOG: i32 = 1;
/// `LEAP_FINISH_CANCELLED`.
pub const LEAP_FINISH_CANCELLED: i32 = 2;

/// An open model (`leap_model`).
pub struct leap_model {
    rt: Arc<Runtime>,
}

/// A session (`leap_session`): the engine's session behind a lock, so that a second
/// `leap_generate` on it (another thread, or its own callback) is an error, not aliasing.
pub struct leap_session {
    inner: Mutex<SessionState>,
    /// Keeps the runtime (its early-exit head, options) alive as long as the session.
    rt: Arc<Runtime>,
}

struct SessionState {
    session: Session,
    /// The last generation's `LEAP_FINISH_*`.
    last_finish: i32,
}

/// `leap_model_params`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct leap_model_params {
    pub threads: i32,
    pub n_ctx: u32,
    pub mode: i32,
    pub leap_kernels: bool,
    pub sidecar: *const c_char,
}

/// `leap_generate_params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct leap_generate_params {
    pub max_tokens: i32,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u32,
    pub chat: bool,
}

/// `leap_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct leap_stats {
    pub prompt_tokens: u64,
    pub tokens: u64,
    pub target_calls: u64,
    pub accepted_per_call: f64,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub finish: i32,
}

/// `leap_token_callback`.
pub type leap_token_callback = Option<
    unsafe extern "C" fn(
        piece: *const c_char,
        len: usize,
        token: i32,
        user_data: *mut c_void,
    ) -> bool,
>;

/// Run `f`, turning its error or panic into a status and the thread's last error message.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> leap_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => LEAP_OK,
        Ok(Err(e)) => error::fail(&e),
        Err(payload) => error::fail(&Error::Panic(error::panic_message(&*payload))),
    }
}

/// Run `f` for a value; `fallback` if it panics (there is no status to report it with).
fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// The string at `p`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged for `'a`.
unsafe fn str_arg<'a>(p: *const c_char, what: &'static str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(Error::Null { what });
    }
    // SAFETY: non-null and, by the caller's contract, NUL-terminated and valid for 'a.
    let bytes = unsafe { CStr::from_ptr(p) }.to_bytes();
    std::str::from_utf8(bytes).map_err(|e| Error::Utf8 {
        what,
        at: e.valid_up_to(),
    })
}

/// The object at `p`.
///
/// # Safety
/// `p` is NULL or points to a live `T` that nothing mutates for `'a`.
unsafe fn ref_arg<'a, T>(p: *const T, what: &'static str) -> Result<&'a T, Error> {
    // SAFETY: by the caller's contract, a non-null `p` is a live, unaliased-for-writes T.
    unsafe { p.as_ref() }.ok_or(Error::Null { what })
}

/// Write `value` to the out-pointer `out` (checked for NULL).
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn write_out<T>(out: *mut T, value: T, what: &'static str) -> Result<(), Error> {
    if out.is_null() {
        return Err(Error::Null { what });
    }
    // SAFETY: non-null and, by the caller's contract, valid for writes.
    unsafe { out.write(value) };
    Ok(())
}

impl leap_model_params {
    /// The engine's options for these parameters.
    ///
    /// # Safety
    /// `sidecar` is NULL or a NUL-terminated string valid for the call.
    unsafe fn options(&self) -> Result<Options, Error> {
        let mode = match self.mode {
            LEAP_MODE_LEAP => Mode::Leap,
            LEAP_MODE_PLAIN => Mode::Plain,
            m => {
                return Err(Error::Range {
                    what: "mode",
                    value: m.into(),
                    expected: "LEAP_MODE_LEAP (0) or LEAP_MODE_PLAIN (1)",
                })
            }
        };
        let sidecar = if self.sidecar.is_null() {
            None
        } else {
            // SAFETY: non-null, and NUL-terminated by the caller's contract.
            Some(PathBuf::from(unsafe { str_arg(self.sidecar, "sidecar") }?))
        };
        Ok(Options {
            threads: self.threads,
            n_ctx: self.n_ctx,
            mode,
            leap_kernels: self.leap_kernels,
            sidecar,
            ..Options::default()
        })
    }
}

impl leap_generate_params {
    fn request(&self) -> Result<Request, Error> {
        if self.max_tokens < 1 {
            return Err(Error::Range {
                what: "max_tokens",
                value: self.max_tokens.into(),
                expected: "at least 1",
            });
        }
        Ok(Request {
            max_tokens: self.max_tokens as usize,
            sampling: SamplingParams {
                temp: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                seed: self.seed,
            },
        })
    }
}

impl From<&Totals> for leap_stats {
    fn from(t: &Totals) -> Self {
        Self {
            prompt_tokens: t.prompt_tokens,
            tokens: t.tokens,
            target_calls: t.target_calls,
            accepted_per_call: t.accepted_per_call(),
            prefill_seconds: t.prefill_seconds,
            decode_seconds: t.decode_seconds,
            finish: LEAP_FINISH_LENGTH,
        }
    }
}

/// `const char *leap_last_error(void)`.
#[no_mangle]
pub extern "C" fn leap_last_error() -> *const c_char {
    guard_value(c"".as_ptr(), error::last)
}

/// `const char *leap_status_string(leap_status)`.
#[no_mangle]
pub extern "C" fn leap_status_string(status: leap_status) -> *const c_char {
    guard_value(c"unknown status".as_ptr(), || {
        error::status_str(status).as_ptr()
    })
}

/// `const char *leap_version(void)`.
#[no_mangle]
pub extern "C" fn leap_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => panic!("the package version has a NUL byte"),
        };
    VERSION.as_ptr()
}

/// `leap_model_params leap_model_default_params(void)`: [`Options::default`]'s values.
#[no_mangle]
pub extern "C" fn leap_model_default_params() -> leap_model_params {
    let from = |o: Options| leap_model_params {
        threads: o.threads,
        n_ctx: o.n_ctx,
        mode: match o.mode {
            Mode::Leap => LEAP_MODE_LEAP,
            Mode::Plain => LEAP_MODE_PLAIN,
        },
        leap_kernels: o.leap_kernels,
        sidecar: std::ptr::null(),
    };
    guard_value(
        leap_model_params {
            threads: 1,
            n_ctx: 4096,
            mode: LEAP_MODE_LEAP,
            leap_kernels: true,
            sidecar: std::ptr::null(),
        },
        || from(Options::default()),
    )
}

/// `leap_generate_params leap_generate_default_params(void)`: [`Request::default`]'s values.
#[no_mangle]
pub extern "C" fn leap_generate_default_params() -> leap_generate_params {
    let r = Request::default();
    let s = r.sampling;
    leap_generate_params {
        max_tokens: i32::try_from(r.max_tokens).unwrap_or(i32::MAX),
        temperature: s.temp,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed,
        chat: false,
    }
}

/// `leap_status leap_model_open(const char *path, const leap_model_params *params,
/// leap_model **out)`.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `params` is NULL or points to a
/// `leap_model_params` (whose `sidecar` is NULL or a NUL-terminated string); `out` is NULL or
/// valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn leap_model_open(
    path: *const c_char,
    params: *const leap_model_params,
    out: *mut *mut leap_model,
) -> leap_status {
    guard(|| {
        // SAFETY: `out` is NULL or writable (contract); cleared first so it is NULL on failure.
        unsafe { write_out(out, std::ptr::null_mut(), "out") }?;
        // The log's destination first: loading routes llama.cpp's log into it.
        logging::init();
        // SAFETY: `path` is NULL or NUL-terminated (contract), read only during this call.
        let path = unsafe { str_arg(path, "path") }?;
        // Before any kernel could run an instruction this CPU does not have.
        if let Some(f) = leap_kernels::cpu::missing_baseline() {
            return Err(Error::Cpu(leap_kernels::cpu::below_baseline_message(f)));
        }
        let opts = if params.is_null() {
            Options::default()
        } else {
            // SAFETY: non-null `params` points to a leap_model_params whose `sidecar` is NULL
            // or NUL-terminated (contract).
            unsafe { (*params).options() }?
        };
        let rt = Runtime::open(path.as_ref(), &opts)?;
        let model = Box::new(leap_model { rt: Arc::new(rt) });
        // SAFETY: checked writable above.
        unsafe { out.write(Box::into_raw(model)) };
        Ok(())
    })
}

/// `void leap_model_free(leap_model *)`.
///
/// # Safety
/// `model` is NULL or came from `leap_model_open` and was not freed yet.
#[no_mangle]
pub unsafe extern "C" fn leap_model_free(model: *mut leap_model) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if !model.is_null() {
            // SAFETY: from Box::into_raw in leap_model_open, freed once (contract). Sessions
            // hold their own Arc of the runtime, so none dangles.
            drop(unsafe { Box::from_raw(model) });
        }
    }));
}

/// `leap_status leap_session_new(leap_model *, leap_session **out)`.
///
/// # Safety
/// `model` is NULL or a live model from `leap_model_open`; `out` is NULL or valid for a write
/// of a pointer.
#[no_mangle]
pub unsafe extern "C" fn leap_session_new(
    model: *mut leap_model,
    out: *mut *mut leap_session,
) -> leap_status {
    guard(|| {
        // SAFETY: `out` is NULL or writable (contract); cleared first so it is NULL on failure.
        unsafe { write_out(out, std::ptr::null_mut(), "out") }?;
        // SAFETY: NULL or a live model (contract); only read.
        let model = unsafe { ref_arg(model, "model") }?;
        let session = model.rt.session()?;
        let s = Box::new(leap_session {
            inner: Mutex::new(SessionState {
                session,
                last_finish: LEAP_FINISH_LENGTH,
            }),
            rt: Arc::clone(&model.rt),
        });
        // SAFETY: checked writable above.
        unsafe { out.write(Box::into_raw(s)) };
        Ok(())
    })
}

/// `void leap_session_free(leap_session *)`.
///
/// # Safety
/// `session` is NULL or came from `leap_session_new`, was not freed yet, and no call on it is
/// running.
#[no_mangle]
pub unsafe extern "C" fn leap_session_free(session: *mut leap_session) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if !session.is_null() {
            // SAFETY: from Box::into_raw in leap_session_new, freed once, not in use
            // (contract).
            drop(unsafe { Box::from_raw(session) });
        }
    }));
}

/// An object's state behind its lock (a session's, a drafter's), or why it cannot be used now:
/// busy with another call, or left unusable by an earlier panic.
fn try_lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, Error> {
    m.try_lock().map_err(|e| match e {
        TryLockError::WouldBlock => Error::Busy,
        TryLockError::Poisoned(_) => Error::Poisoned,
    })
}

/// `leap_status leap_generate(leap_session *, const char *prompt, const leap_generate_params *,
/// leap_token_callback, void *user_data, leap_stats *stats)`.
///
/// # Safety
/// `session` is NULL or a live session; `prompt` is NULL or a NUL-terminated string;
/// `params` is NULL or points to a `leap_generate_params`; `callback`, if not NULL, is safe to
/// call with `user_data` and a piece; `stats` is NULL or valid for a write of `leap_stats`.
#[no_mangle]
pub unsafe extern "C" fn leap_generate(
    session: *mut leap_session,
    prompt: *const c_char,
    params: *const leap_generate_params,
    callback: leap_token_callback,
    user_data: *mut c_void,
    stats: *mut leap_stats,
) -> leap_status {
    guard(|| {
        if !stats.is_null() {
            // SAFETY: non-null and writable (contract).
            unsafe { stats.write(leap_stats::default()) };
        }
        // SAFETY: NULL or a live session (contract); shared, its state is behind the lock.
        let s = unsafe { ref_arg(session.cast_const(), "session") }?;
        // SAFETY: NULL or NUL-terminated (contract), read only during this call.
        let prompt = unsafe { str_arg(prompt, "prompt") }?;
        // SAFETY: NULL or a leap_generate_params (contract); copied.
        let params = unsafe { params.as_ref() }
            .copied()
            .unwrap_or_else(|| leap_generate_default_params());
        let req = params.request()?;
        let mut state = try_lock(&s.inner)?;
        let model = Arc::clone(s.rt.model());
        let tokens = s.rt.prompt_tokens(prompt, params.chat)?;

        let mut stream = TextStream::default();
        let mut cancelled = false;
        let deliver = |text: String, token: i32| -> bool {
            let Some(cb) = callback else { return true };
            let mut piece = text.into_bytes();
            let len = piece.len();
            piece.push(0);
            // SAFETY: `piece` holds `len` bytes and a NUL, alive across the call; the
            // callback and `user_data` are the caller's, callable per its contract. The
            // callback is C and does not unwind.
            unsafe { cb(piece.as_ptr().cast(), len, token, user_data) }
        };
        let mut on_token = |t: i32| {
            let piece = model.token_to_piece(t, false).unwrap_or_default();
            let go_on = deliver(stream.push(&piece), t);
            cancelled |= !go_on;
            go_on
        };
        let g = state.session.generate(&tokens, &req, &mut on_token)?;
        let rest = stream.finish();
        if !rest.is_empty() {
            deliver(rest, -1);
        }
        let finish = if cancelled {
            LEAP_FINISH_CANCELLED
        } else if g.tokens.last().is_some_and(|&t| model.is_eog(t)) {
            LEAP_FINISH_EOG
        } else {
            LEAP_FINISH_LENGTH
        };
        state.last_finish = finish;
        if !stats.is_null() {
            let one = Totals {
                requests: 1,
                prompt_tokens: tokens.len() as u64,
                tokens: g.tokens.len() as u64,
                target_calls: g.target_calls,
                decode_seconds: g.decode_seconds,
                prefill_seconds: g.prefill_seconds,
            };
            // SAFETY: non-null and writable (contract).
            unsafe {
                stats.write(leap_stats {
                    finish,
                    ..leap_stats::from(&one)
                })
            };
        }
        Ok(())
    })
}

/// `leap_status leap_session_totals(const leap_session *, leap_stats *out)`.
///
/// # Safety
/// `session` is NULL or a live session; `out` is NULL or valid for a write of `leap_stats`.
#[no_mangle]
pub unsafe extern "C" fn leap_session_totals(
    session: *const leap_session,
    out: *mut leap_stats,
) -> leap_status {
    guard(|| {
        // SAFETY: NULL or a live session (contract); shared, its state is behind the lock.
        let s = unsafe { ref_arg(session, "session") }?;
        let state = try_lock(&s.inner)?;
        let totals = leap_stats {
            finish: state.last_finish,
            ..leap_stats::from(&state.session.totals())
        };
        // SAFETY: NULL or writable (contract).
        unsafe { write_out(out, totals, "out") }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: leap_last_error returns a NUL-terminated string valid until the next call.
        unsafe { CStr::from_ptr(leap_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn null_pointers_are_invalid_arguments() {
        let mut model: *mut leap_model = std::ptr::dangling_mut();
        // SAFETY: every pointer is NULL or valid.
        let st = unsafe { leap_model_open(std::ptr::null(), std::ptr::null(), &mut model) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert!(model.is_null(), "the out-pointer is cleared on failure");
        assert_eq!(last_error(), "path is NULL");

        // SAFETY: as above.
        let st =
            unsafe { leap_model_open(c"m.gguf".as_ptr(), std::ptr::null(), std::ptr::null_mut()) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "out is NULL");

        let mut session: *mut leap_session = std::ptr::dangling_mut();
        // SAFETY: as above.
        let st = unsafe { leap_session_new(std::ptr::null_mut(), &mut session) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert!(session.is_null());

        let mut stats = leap_stats {
            tokens: 7,
            ..Default::default()
        };
        // SAFETY: as above.
        let st = unsafe {
            leap_generate(
                std::ptr::null_mut(),
                c"hi".as_ptr(),
                std::ptr::null(),
                None,
                std::ptr::null_mut(),
                &mut stats,
            )
        };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "session is NULL");
        assert_eq!(stats, leap_stats::default(), "stats are zeroed on failure");

        // SAFETY: as above.
        let st = unsafe { leap_session_totals(std::ptr::null(), &mut stats) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        // SAFETY: NULL is a no-op.
        unsafe {
            leap_session_free(std::ptr::null_mut());
            leap_model_free(std::ptr::null_mut());
        }
    }

    #[test]
    fn strings_must_be_utf8() {
        let mut model = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, a writable out-pointer.
        let st = unsafe { leap_model_open(c"bad\xff.gguf".as_ptr(), std::ptr::null(), &mut model) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "path is not valid UTF-8 (byte 3)");

        let params = leap_model_params {
            sidecar: c"\xc3(".as_ptr(),
            ..leap_model_default_params()
        };
        // SAFETY: as above; `params` is valid with a NUL-terminated sidecar.
        let st = unsafe { leap_model_open(c"m.gguf".as_ptr(), &params, &mut model) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert!(last_error().starts_with("sidecar is not valid UTF-8"));
    }

    #[test]
    fn a_missing_model_is_a_model_error_and_bad_parameters_are_refused() {
        let mut model = std::ptr::null_mut();
        // SAFETY: valid pointers.
        let st =
            unsafe { leap_model_open(c"/nowhere/m.gguf".as_ptr(), std::ptr::null(), &mut model) };
        assert_eq!(st, LEAP_ERR_MODEL);
        assert!(last_error().contains("/nowhere/m.gguf"), "{}", last_error());

        let params = leap_model_params {
            mode: 7,
            ..leap_model_default_params()
        };
        // SAFETY: valid pointers.
        let st = unsafe { leap_model_open(c"/nowhere/m.gguf".as_ptr(), &params, &mut model) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert!(last_error().starts_with("mode 7"), "{}", last_error());

        let bad = leap_generate_params {
            max_tokens: 0,
            ..leap_generate_default_params()
        };
        assert!(matches!(bad.request(), Err(Error::Range { .. })));
    }

    #[test]
    fn defaults_are_the_engines() {
        let p = leap_model_default_params();
        let o = Options::default();
        assert_eq!(
            (p.threads, p.n_ctx, p.leap_kernels),
            (o.threads, o.n_ctx, o.leap_kernels)
        );
        assert_eq!(p.mode, LEAP_MODE_LEAP);
        assert!(p.sidecar.is_null());
        let g = leap_generate_default_params();
        assert_eq!(g.request().unwrap(), Request::default());
        assert!(!g.chat);
    }

    /// What the header promises: a model is shared between threads, a session moves
    /// between them (its lock keeps it to one at a time).
    #[test]
    fn models_and_sessions_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<leap_model>();
        send_sync::<leap_session>();
    }

    #[test]
    fn a_panic_stops_at_the_boundary() {
        let st = guard(|| panic!("boom"));
        assert_eq!(st, LEAP_ERR_INTERNAL);
        assert_eq!(
            last_error(),
            "internal error in Leap (please report it): boom"
        );
        assert_eq!(guard_value(7, || -> i32 { panic!("boom") }), 7);
    }

    #[test]
    fn static_strings() {
        // SAFETY: static NUL-terminated strings.
        let s = |p| unsafe { CStr::from_ptr(p) }.to_str().unwrap();
        assert_eq!(s(leap_version()), env!("CARGO_PKG_VERSION"));
        assert_eq!(s(leap_status_string(LEAP_OK)), "ok");
        assert_eq!(s(leap_status_string(LEAP_ERR_INTERNAL)), "internal error");
        assert_eq!(s(leap_status_string(-3)), "unknown status");
    }

    #[test]
    fn the_header_declares_every_export() {
        let header = include_str!("../../include/leap.h");
        for f in [
            "leap_last_error(void)",
            "leap_status_string(leap_status status)",
            "leap_version(void)",
            "leap_model_default_params(void)",
            "leap_generate_default_params(void)",
            "leap_model_open(",
            "leap_model_free(leap_model *model)",
            "leap_session_new(leap_model *model, leap_session **out)",
            "leap_session_free(leap_session *session)",
            "leap_generate(",
            "leap_session_totals(const leap_session *session, leap_stats *out)",
        ] {
            assert!(header.contains(f), "include/leap.h lacks {f}");
        }
        for (name, value) in [
            ("#define LEAP_MODE_LEAP ", LEAP_MODE_LEAP),
            ("#define LEAP_MODE_PLAIN ", LEAP_MODE_PLAIN),
            ("#define LEAP_FINISH_LENGTH ", LEAP_FINISH_LENGTH),
            ("#define LEAP_FINISH_EOG ", LEAP_FINISH_EOG),
            ("#define LEAP_FINISH_CANCELLED ", LEAP_FINISH_CANCELLED),
            ("LEAP_ERR_INVALID_ARGUMENT = ", LEAP_ERR_INVALID_ARGUMENT),
            ("LEAP_ERR_CONTEXT_FULL = ", LEAP_ERR_CONTEXT_FULL),
            ("LEAP_ERR_MODEL = ", LEAP_ERR_MODEL),
            ("LEAP_ERR_DECODE = ", LEAP_ERR_DECODE),
            ("LEAP_ERR_INTERNAL = ", LEAP_ERR_INTERNAL),
        ] {
            let value_in_header = header
                .lines()
                .find_map(|l| l.trim().strip_prefix(name))
                .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                .unwrap_or_else(|| panic!("include/leap.h lacks {name}"));
            assert_eq!(value_in_header, value.to_string(), "{name}");
        }
    }
}

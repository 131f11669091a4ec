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
pub use logging::leap_log_callback;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

use leap_host::sampler::SamplingParams;
use leap_spec::session::{Mode, Options, Request, Runtime, Session, Totals};

use error::Error;
pub use error::{
    LEAP_ERR_BUFFER, LEAP_ERR_CANCELLED, LEAP_ERR_CONTEXT_FULL, LEAP_ERR_DECODE, LEAP_ERR_INTERNAL,
    LEAP_ERR_INVALID_ARGUMENT, LEAP_ERR_MODEL, LEAP_OK,
};
use leap_host::model::ChatMessage;
use leap_host::Token;
use leap_spec::text::TextOut;

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
/// `LEAP_FINISH_STOP`.
pub const LEAP_FINISH_STOP: i32 = 3;
include!(concat!(env!("OUT_DIR"), "/abi.rs"));

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
    /// Set by `leap_session_cancel` (any thread), read by the session's decodes, cleared when
    /// a generation starts.
    cancel: Arc<AtomicBool>,
}

/// `leap_chat_message`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct leap_chat_message {
    pub role: *const c_char,
    pub content: *const c_char,
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
    pub progress: leap_progress_callback,
    pub progress_user_data: *mut c_void,
}

/// `leap_progress_callback`.
pub type leap_progress_callback =
    Option<unsafe extern "C" fn(progress: f32, user_data: *mut c_void) -> bool>;

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
    pub stop: *const *const c_char,
    pub n_stop: usize,
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
    pub device_nodes: u64,
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
    /// The stop strings.
    ///
    /// # Safety
    /// `stop` is NULL or points to `n_stop` pointers, each NULL or a NUL-terminated string,
    /// valid for `'a`.
    unsafe fn stops<'a>(&self) -> Result<Vec<&'a str>, Error> {
        if self.n_stop == 0 {
            return Ok(Vec::new());
        }
        if self.stop.is_null() {
            return Err(Error::Null { what: "stop" });
        }
        // SAFETY: `n_stop` pointers at `stop` (contract).
        let ptrs = unsafe { std::slice::from_raw_parts(self.stop, self.n_stop) };
        ptrs.iter()
            .map(|&p| {
                // SAFETY: NULL or NUL-terminated (contract).
                let s = unsafe { str_arg(p, "a stop string") }?;
                if s.is_empty() {
                    return Err(Error::Range {
                        what: "stop string length",
                        value: 0,
                        expected: "at least 1 byte",
                    });
                }
                Ok(s)
            })
            .collect()
    }

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
            device_nodes: 0,
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
        progress: None,
        progress_user_data: std::ptr::null_mut(),
    };
    guard_value(
        leap_model_params {
            threads: 1,
            n_ctx: 4096,
            mode: LEAP_MODE_LEAP,
            leap_kernels: true,
            sidecar: std::ptr::null(),
            progress: None,
            progress_user_data: std::ptr::null_mut(),
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
        stop: std::ptr::null(),
        n_stop: 0,
    }
}

/// `int32_t leap_abi_version(void)`.
#[no_mangle]
pub extern "C" fn leap_abi_version() -> i32 {
    LEAP_ABI_VERSION
}

/// `leap_status leap_log_set(leap_log_callback, int32_t max_level, void *user_data)`.
///
/// # Safety
/// `callback`, if not NULL, is safe to call with `user_data` from any thread, at any time
/// until it is replaced.
#[no_mangle]
pub unsafe extern "C" fn leap_log_set(
    callback: leap_log_callback,
    max_level: i32,
    user_data: *mut c_void,
) -> leap_status {
    guard(|| {
        let max = logging::level_filter(max_level).ok_or(Error::Range {
            what: "max_level",
            value: max_level.into(),
            expected: "LEAP_LOG_NONE (0) to LEAP_LOG_TRACE (5)",
        })?;
        logging::set_sink(callback, max, user_data);
        Ok(())
    })
}

/// `leap_status leap_model_open(const char *path, const leap_model_params *params,
/// leap_model **out)`.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `params` is NULL or points to a
/// `leap_model_params` (whose `sidecar` is NULL or a NUL-terminated string, and whose
/// `progress`, if set, is safe to call with `progress_user_data`); `out` is NULL or valid for
/// a write of a pointer.
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
        // SAFETY: NULL or a leap_model_params (contract); copied.
        let params = unsafe { params.as_ref() }
            .copied()
            .unwrap_or_else(|| leap_model_default_params());
        // SAFETY: `sidecar` is NULL or NUL-terminated (contract).
        let opts = unsafe { params.options() }?;
        let mut report = |fraction: f32| match params.progress {
            // SAFETY: the app's callback with its pointer (contract); C, it does not unwind.
            Some(f) => unsafe { f(fraction, params.progress_user_data) },
            None => true,
        };
        let rt = match Runtime::open_reporting(path.as_ref(), &opts, Some(&mut report)) {
            Err(e) if e.is_cancelled() => return Err(Error::LoadStopped),
            rt => rt?,
        };
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
        let mut session = model.rt.session()?;
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cancel);
        session.set_cancel(Some(Arc::new(move || flag.load(Ordering::Relaxed))));
        let s = Box::new(leap_session {
            inner: Mutex::new(SessionState {
                session,
                last_finish: LEAP_FINISH_LENGTH,
            }),
            rt: Arc::clone(&model.rt),
            cancel,
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
/// `params` is NULL or points to a `leap_generate_params` (its stop strings as documented);
/// `callback`, if not NULL, is safe to call with `user_data` and a piece; `stats` is NULL or
/// valid for a write of `leap_stats`.
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
        let tokens = |rt: &Runtime, chat| {
            // SAFETY: NULL or NUL-terminated (contract), read only during this call.
            let prompt = unsafe { str_arg(prompt, "prompt") }?;
            Ok(rt.prompt_tokens(prompt, chat)?)
        };
        // SAFETY: the caller's contract, passed on.
        unsafe { generation(session, params, callback, user_data, stats, tokens) }
    })
}

/// `leap_status leap_generate_chat(leap_session *, const leap_chat_message *messages,
/// size_t n_messages, const leap_generate_params *, leap_token_callback, void *user_data,
/// leap_stats *stats)`.
///
/// # Safety
/// As [`leap_generate`]; `messages` is NULL or points to `n_messages` messages whose `role`
/// and `content` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn leap_generate_chat(
    session: *mut leap_session,
    messages: *const leap_chat_message,
    n_messages: usize,
    params: *const leap_generate_params,
    callback: leap_token_callback,
    user_data: *mut c_void,
    stats: *mut leap_stats,
) -> leap_status {
    guard(|| {
        let tokens = |rt: &Runtime, _chat| {
            if messages.is_null() || n_messages == 0 {
                return Err(Error::Null { what: "messages" });
            }
            // SAFETY: `n_messages` messages at `messages` (contract).
            let msgs = unsafe { std::slice::from_raw_parts(messages, n_messages) };
            let msgs = msgs
                .iter()
                .map(|m| {
                    // SAFETY: NULL or NUL-terminated (contract), read during this call.
                    let role = unsafe { str_arg(m.role, "a message's role") }?;
                    // SAFETY: as above.
                    let content = unsafe { str_arg(m.content, "a message's content") }?;
                    Ok(ChatMessage {
                        role: role.into(),
                        content: content.into(),
                    })
                })
                .collect::<Result<Vec<_>, Error>>()?;
            Ok(rt.model().chat_tokens(&msgs, true)?)
        };
        // SAFETY: the caller's contract, passed on.
        unsafe { generation(session, params, callback, user_data, stats, tokens) }
    })
}

/// One generation on `session`, from the tokens `prompt` makes of the runtime and the
/// parameters' `chat`: the body of `leap_generate` and `leap_generate_chat`.
///
/// # Safety
/// As [`leap_generate`].
unsafe fn generation(
    session: *mut leap_session,
    params: *const leap_generate_params,
    callback: leap_token_callback,
    user_data: *mut c_void,
    stats: *mut leap_stats,
    prompt: impl FnOnce(&Runtime, bool) -> Result<Vec<Token>, Error>,
) -> Result<(), Error> {
    if !stats.is_null() {
        // SAFETY: non-null and writable (contract).
        unsafe { stats.write(leap_stats::default()) };
    }
    // SAFETY: NULL or a live session (contract); shared, its state is behind the lock.
    let s = unsafe { ref_arg(session.cast_const(), "session") }?;
    // SAFETY: NULL or a leap_generate_params (contract); copied.
    let params = unsafe { params.as_ref() }
        .copied()
        .unwrap_or_else(|| leap_generate_default_params());
    let req = params.request()?;
    // SAFETY: the stop strings as the contract says, read only during this call.
    let stops = unsafe { params.stops() }?;
    let mut state = try_lock(&s.inner)?;
    let model = Arc::clone(s.rt.model());
    let tokens = prompt(&s.rt, params.chat)?;

    let mut text = TextOut::new(stops.iter().map(|s| s.to_string()).collect());
    let (mut cancelled, mut delivered) = (false, 0u64);
    let deliver = |text: String, token: i32| -> bool {
        let Some(cb) = callback else { return true };
        let mut piece = text.into_bytes();
        let len = piece.len();
        piece.push(0);
        // SAFETY: `piece` holds `len` bytes and a NUL, alive across the call; the callback
        // and `user_data` are the caller's, callable per its contract. The callback is C and
        // does not unwind.
        unsafe { cb(piece.as_ptr().cast(), len, token, user_data) }
    };
    let mut on_token = |t: i32| {
        let piece = model.token_to_piece(t, false).unwrap_or_default();
        let (out, stop) = text.push(&piece);
        delivered += 1;
        let go_on = deliver(out, t);
        cancelled |= !go_on;
        go_on && !stop
    };
    s.cancel.store(false, Ordering::Relaxed);
    let nodes_before = state.session.device().calls();
    let g = match state.session.generate(&tokens, &req, &mut on_token) {
        Err(e) if e.is_cancelled() => None,
        g => Some(g?),
    };
    let rest = text.finish();
    if !rest.is_empty() {
        deliver(rest, -1);
    }
    let finish = match &g {
        None => LEAP_FINISH_CANCELLED,
        Some(_) if cancelled => LEAP_FINISH_CANCELLED,
        Some(_) if text.stopped => LEAP_FINISH_STOP,
        Some(g) if g.tokens.last().is_some_and(|&t| model.is_eog(t)) => LEAP_FINISH_EOG,
        Some(_) => LEAP_FINISH_LENGTH,
    };
    state.last_finish = finish;
    if !stats.is_null() {
        let one = match &g {
            Some(g) => Totals {
                requests: 1,
                prompt_tokens: tokens.len() as u64,
                tokens: g.tokens.len() as u64,
                target_calls: g.target_calls,
                decode_seconds: g.decode_seconds,
                prefill_seconds: g.prefill_seconds,
            },
            // Stopped by leap_session_cancel: what reached the callback.
            None => Totals {
                requests: 1,
                prompt_tokens: tokens.len() as u64,
                tokens: delivered,
                ..Totals::default()
            },
        };
        // SAFETY: non-null and writable (contract).
        unsafe {
            stats.write(leap_stats {
                finish,
                device_nodes: state.session.device().calls() - nodes_before,
                ..leap_stats::from(&one)
            })
        };
    }
    Ok(())
}

/// `leap_status leap_session_cancel(leap_session *)`: may run on any thread, during a
/// generation on another.
///
/// # Safety
/// `session` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn leap_session_cancel(session: *mut leap_session) -> leap_status {
    guard(|| {
        // SAFETY: NULL or a live session (contract); only its atomic flag is touched.
        let s = unsafe { ref_arg(session.cast_const(), "session") }?;
        s.cancel.store(true, Ordering::Relaxed);
        Ok(())
    })
}

/// `leap_status leap_tokenize(const leap_model *, const char *text, bool add_special,
/// bool parse_special, int32_t *out, size_t max, size_t *n_out)`.
///
/// # Safety
/// `model` is NULL or live; `text` NULL or NUL-terminated; `out` NULL or valid for `max`
/// writes; `n_out` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn leap_tokenize(
    model: *const leap_model,
    text: *const c_char,
    add_special: bool,
    parse_special: bool,
    out: *mut i32,
    max: usize,
    n_out: *mut usize,
) -> leap_status {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { write_out(n_out, 0, "n_out") }?;
        // SAFETY: as above.
        let (model, text) = unsafe { (ref_arg(model, "model")?, str_arg(text, "text")?) };
        let tokens = model
            .rt
            .model()
            .tokenize(text, add_special, parse_special)?;
        // SAFETY: as above.
        unsafe { n_out.write(tokens.len()) };
        // SAFETY: as above.
        unsafe { fill(out, max, &tokens, "out") }
    })
}

/// `leap_status leap_detokenize(const leap_model *, const int32_t *tokens, size_t n_tokens,
/// bool special, char *out, size_t size, size_t *n_out)`.
///
/// # Safety
/// `model` is NULL or live; `tokens` NULL or `n_tokens` tokens; `out` NULL or valid for
/// `size` writes; `n_out` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn leap_detokenize(
    model: *const leap_model,
    tokens: *const i32,
    n_tokens: usize,
    special: bool,
    out: *mut c_char,
    size: usize,
    n_out: *mut usize,
) -> leap_status {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { write_out(n_out, 0, "n_out") }?;
        // SAFETY: as above.
        let model = unsafe { ref_arg(model, "model") }?;
        let tokens = if n_tokens == 0 {
            &[][..]
        } else if tokens.is_null() {
            return Err(Error::Null { what: "tokens" });
        } else {
            // SAFETY: `n_tokens` tokens at `tokens` (contract).
            unsafe { std::slice::from_raw_parts(tokens, n_tokens) }
        };
        let bytes = model
            .rt
            .model()
            .detokenize(tokens, false, special)?
            .into_bytes();
        // SAFETY: as above.
        unsafe { n_out.write(bytes.len()) };
        let mut with_nul = bytes;
        with_nul.push(0);
        // SAFETY: as above.
        unsafe { fill(out.cast::<u8>(), size, &with_nul, "out") }
    })
}

/// Copy `items` to `out` (room for `max`), or say how many are needed.
///
/// # Safety
/// `out` is NULL or valid for `max` writes of `T`.
unsafe fn fill<T: Copy>(
    out: *mut T,
    max: usize,
    items: &[T],
    what: &'static str,
) -> Result<(), Error> {
    if items.len() > max {
        return Err(Error::Buffer {
            what,
            room: max,
            needed: items.len(),
        });
    }
    if out.is_null() {
        return Err(Error::Null { what });
    }
    // SAFETY: `out` has room for `max >= items.len()` (contract); the regions are distinct.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    Ok(())
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
            device_nodes: state.session.device().calls(),
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

    /// The header's version is the crate's (Cargo.toml's), and its ABI the library's.
    #[test]
    fn the_header_carries_the_version() {
        let header = include_str!("../../include/leap.h");
        let define = |name: &str| {
            header
                .lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("include/leap.h lacks {name}"))
                .trim()
                .to_string()
        };
        let version = format!(
            "{}.{}.{}",
            define("LEAP_VERSION_MAJOR"),
            define("LEAP_VERSION_MINOR"),
            define("LEAP_VERSION_PATCH")
        );
        assert_eq!(
            version,
            env!("CARGO_PKG_VERSION"),
            "bump include/leap.h with Cargo.toml"
        );
        assert_eq!(define("LEAP_ABI_VERSION"), leap_abi_version().to_string());
        assert!(leap_abi_version() >= 1);
    }

    #[test]
    fn stop_strings_are_checked() {
        let stops = [c"END".as_ptr(), c"".as_ptr()];
        let mut p = leap_generate_params {
            stop: stops.as_ptr(),
            n_stop: 1,
            ..leap_generate_default_params()
        };
        // SAFETY: `n_stop` valid strings at `stop`, alive for the calls.
        assert_eq!(unsafe { p.stops() }.unwrap(), ["END"]);
        p.n_stop = 2;
        // SAFETY: as above.
        let e = unsafe { p.stops() }.unwrap_err();
        assert_eq!(e.to_string(), "stop string length 0: at least 1 byte");
        p.stop = std::ptr::null();
        // SAFETY: a NULL array with n_stop > 0 is refused before it is read.
        assert!(matches!(
            unsafe { p.stops() },
            Err(Error::Null { what: "stop" })
        ));
        p.n_stop = 0;
        // SAFETY: nothing is read.
        assert!(unsafe { p.stops() }.unwrap().is_empty());
    }

    #[test]
    fn a_log_level_out_of_range_is_refused() {
        // SAFETY: no callback is installed.
        let st = unsafe { leap_log_set(None, 9, std::ptr::null_mut()) };
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert!(last_error().starts_with("max_level 9"), "{}", last_error());
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
            "leap_abi_version(void)",
            "leap_log_set(leap_log_callback callback, int32_t max_level, void *user_data)",
            "leap_tokenize(const leap_model *model, const char *text, bool add_special,",
            "leap_detokenize(const leap_model *model, const int32_t *tokens, size_t n_tokens,",
            "leap_session_cancel(leap_session *session)",
            "leap_generate_chat(leap_session *session, const leap_chat_message *messages,",
        ] {
            assert!(header.contains(f), "include/leap.h lacks {f}");
        }
        for (name, value) in [
            ("#define LEAP_MODE_LEAP ", LEAP_MODE_LEAP),
            ("#define LEAP_MODE_PLAIN ", LEAP_MODE_PLAIN),
            ("#define LEAP_FINISH_LENGTH ", LEAP_FINISH_LENGTH),
            ("#define LEAP_FINISH_EOG ", LEAP_FINISH_EOG),
            ("#define LEAP_FINISH_CANCELLED ", LEAP_FINISH_CANCELLED),
            ("#define LEAP_FINISH_STOP ", LEAP_FINISH_STOP),
            ("LEAP_ERR_BUFFER = ", LEAP_ERR_BUFFER),
            ("LEAP_ERR_CANCELLED = ", LEAP_ERR_CANCELLED),
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

//! One-time llama.cpp initialisation and log routing.
//!
//! llama.cpp and ggml print through one log callback. Leap routes it to the `log` crate under
//! the target `llama.cpp` (ggml's INFO becomes `debug`, so a normal run is quiet) and keeps the
//! last error line, so that a failed load or decode can say *why* in its [`crate::Error`].

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, Once};

use llama_cpp_sys_2 as sys;

static INIT: Once = Once::new();
/// The line being assembled (llama.cpp logs in pieces, `CONT` continues the previous level).
static PENDING: Mutex<(u32, String)> = Mutex::new((0, String::new()));
/// The last complete WARN or ERROR line, for error messages.
static LAST_PROBLEM: Mutex<String> = Mutex::new(String::new());

/// ggml's switch for its tiled K-quant matmul. That path takes batches of 8 or more rows and
/// rounds differently from the one-row dot products a single decoded token goes through, so
/// a token verified in a batch of 8 got other logits than the same token decoded alone, and a
/// near-tie could flip a greedy token. Off, each output of a matmul is one ggml dot product
/// whatever the batch (with the build's `GGML_LLAMAFILE=OFF`, no weight repacking and no flash
/// attention: [`crate::ModelParams`], [`crate::ContextParams`]), and speculative decoding gives
/// exactly plain decoding's tokens. Prefill pays ~5% on Q4_K/Q6_K models.
pub const BATCH_INVARIANT_ENV: &str = "GGML_CPU_TILED_MM";

/// Initialise llama.cpp's backends and route its log. Idempotent and thread-safe; every
/// constructor in this crate calls it, so callers need not.
///
/// It also keeps ggml's CPU matmuls batch-invariant (see [`BATCH_INVARIANT_ENV`]): unless the
/// process already set `GGML_CPU_TILED_MM`, init sets it to 0 before ggml reads it.
pub fn init() {
    INIT.call_once(|| {
        if std::env::var_os(BATCH_INVARIANT_ENV).is_none() {
            std::env::set_var(BATCH_INVARIANT_ENV, "0");
        }
        // SAFETY: `log_callback` is a plain `extern "C"` function that never unwinds (its body
        // is wrapped in `catch_unwind`) and ignores `user_data`, so a null pointer is fine.
        unsafe {
            sys::llama_log_set(Some(log_callback), std::ptr::null_mut());
            sys::llama_backend_init();
        }
    });
}

/// The last warning or error llama.cpp logged, taken (cleared) by the call; empty if none.
pub(crate) fn take_last_problem() -> String {
    std::mem::take(&mut *LAST_PROBLEM.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A reason for an error: llama.cpp's last complaint, or `fallback` if it said nothing.
pub(crate) fn reason_or(fallback: &str) -> String {
    let last = take_last_problem();
    if last.is_empty() {
        fallback.to_string()
    } else {
        last
    }
}

unsafe extern "C" fn log_callback(
    level: sys::ggml_log_level,
    text: *const c_char,
    _user: *mut c_void,
) {
    let _ = std::panic::catch_unwind(|| {
        if text.is_null() {
            return;
        }
        // SAFETY: ggml passes a NUL-terminated string valid for the duration of the call.
        let piece = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        if level != sys::GGML_LOG_LEVEL_CONT {
            pending.0 = level;
        }
        pending.1.push_str(&piece);
        while let Some(nl) = pending.1.find('\n') {
            let line: String = pending.1.drain(..=nl).collect();
            emit(pending.0, line.trim_end());
        }
    });
}

fn emit(level: u32, line: &str) {
    if line.is_empty() {
        return;
    }
    let lvl = match level {
        sys::GGML_LOG_LEVEL_ERROR => log::Level::Error,
        sys::GGML_LOG_LEVEL_WARN => log::Level::Warn,
        sys::GGML_LOG_LEVEL_INFO => log::Level::Debug,
        _ => log::Level::Trace,
    };
    if lvl <= log::Level::Warn {
        *LAST_PROBLEM.lock().unwrap_or_else(|e| e.into_inner()) = line.to_string();
    }
    log::log!(target: "llama.cpp", lvl, "{line}");
}

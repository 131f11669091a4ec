//! What a call can fail with, its `leap_status`, and the calling thread's last error message
//! (`leap_last_error`).

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};

use leap_spec::session;

use crate::leap_status;

/// `LEAP_OK`.
pub const LEAP_OK: leap_status = 0;
/// `LEAP_ERR_INVALID_ARGUMENT`.
pub const LEAP_ERR_INVALID_ARGUMENT: leap_status = 1;
/// `LEAP_ERR_CONTEXT_FULL`.
pub const LEAP_ERR_CONTEXT_FULL: leap_status = 2;
/// `LEAP_ERR_MODEL`.
pub const LEAP_ERR_MODEL: leap_status = 3;
/// `LEAP_ERR_DECODE`.
pub const LEAP_ERR_DECODE: leap_status = 4;
/// `LEAP_ERR_INTERNAL`.
pub const LEAP_ERR_INTERNAL: leap_status = 5;
/// `LEAP_ERR_BUFFER`.
pub const LEAP_ERR_BUFFER: leap_status = 6;
/// `LEAP_ERR_CANCELLED`.
pub const LEAP_ERR_CANCELLED: leap_status = 7;

/// A failed call of the C API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A required pointer was NULL.
    #[error("{what} is NULL")]
    Null { what: &'static str },
    /// A string argument is not UTF-8.
    #[error("{what} is not valid UTF-8 (byte {at})")]
    Utf8 { what: &'static str, at: usize },
    /// A parameter the engine has no range check for.
    #[error("{what} {value}: {expected}")]
    Range {
        what: &'static str,
        value: i64,
        expected: &'static str,
    },
    /// An output buffer too small for the result (its size is in the call's `n_out`).
    #[error("{what} has room for {room}, {needed} needed")]
    Buffer {
        what: &'static str,
        room: usize,
        needed: usize,
    },
    /// The app's progress callback stopped loading the model.
    #[error("the progress callback stopped loading the model")]
    LoadStopped,
    /// The session is already generating (from another thread, or its own callback).
    #[error(
        "the session is busy with another leap_generate (on another thread, or this call \
         comes from inside its token callback); use one session per thread"
    )]
    Busy,
    /// An earlier panic left the session in an unknown state.
    #[error("an earlier internal error left this session unusable; free it and make a new one")]
    Poisoned,
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] session::Error),
    /// The CPU lacks an instruction-set feature this build of Leap was compiled for.
    #[error("{0}")]
    Cpu(String),
    /// A sidecar whose contents do not fit the model (another model's answers).
    #[error("{0}")]
    Sidecar(String),
    /// A Rust panic, caught at the boundary.
    #[error("internal error in Leap (please report it): {0}")]
    Panic(String),
}

impl From<leap_host::Error> for Error {
    fn from(e: leap_host::Error) -> Self {
        Self::Engine(e.into())
    }
}

impl Error {
    /// The `leap_status` of this error: the engine's own [`session::Error::code`] for its
    /// errors.
    pub fn status(&self) -> leap_status {
        match self {
            Error::Null { .. } | Error::Utf8 { .. } | Error::Range { .. } | Error::Busy => {
                LEAP_ERR_INVALID_ARGUMENT
            }
            Error::Buffer { .. } => LEAP_ERR_BUFFER,
            Error::Sidecar(_) => LEAP_ERR_MODEL,
            Error::LoadStopped => LEAP_ERR_CANCELLED,
            Error::Engine(e) => e.code(),
            Error::Poisoned | Error::Panic(_) | Error::Cpu(_) => LEAP_ERR_INTERNAL,
        }
    }
}

/// `leap_status_string`'s text for `status`.
pub fn status_str(status: leap_status) -> &'static CStr {
    match status {
        LEAP_OK => c"ok",
        LEAP_ERR_INVALID_ARGUMENT => c"invalid argument",
        LEAP_ERR_CONTEXT_FULL => c"the request does not fit the context",
        LEAP_ERR_MODEL => c"model file missing or unreadable",
        LEAP_ERR_DECODE => c"llama.cpp failed",
        LEAP_ERR_INTERNAL => c"internal error",
        LEAP_ERR_BUFFER => c"output buffer too small",
        LEAP_ERR_CANCELLED => c"cancelled",
        _ => c"unknown status",
    }
}

thread_local! {
    /// The message of the last failed call on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `e` as the calling thread's last error and return its status.
pub fn fail(e: &Error) -> leap_status {
    // A message with a NUL in it (from a file name) would end early in C: drop the NULs.
    let msg = CString::new(e.to_string().replace('\0', "")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|last| {
        if let Ok(mut last) = last.try_borrow_mut() {
            *last = msg;
        }
    });
    e.status()
}

/// The calling thread's last error message; `""` if none (or while the thread exits).
pub fn last() -> *const c_char {
    LAST_ERROR
        .try_with(|last| last.try_borrow().map(|m| m.as_ptr()).ok())
        .ok()
        .flatten()
        .unwrap_or(c"".as_ptr())
}

/// The message of a caught panic's payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_keep_their_codes() {
        let full = Error::from(session::Error::ContextFull {
            prompt: 10,
            max_tokens: 10,
            n_ctx: 16,
        });
        assert_eq!(full.status(), LEAP_ERR_CONTEXT_FULL);
        let missing = Error::from(leap_host::Error::ModelNotFound {
            path: "/nowhere.gguf".into(),
        });
        assert_eq!(missing.status(), LEAP_ERR_MODEL);
        assert_eq!(Error::Panic("x".into()).status(), LEAP_ERR_INTERNAL);
        assert_eq!(Error::Busy.status(), LEAP_ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn the_last_error_is_per_thread() {
        fail(&Error::Null { what: "out" });
        // SAFETY: `last` returns a NUL-terminated string that lives until the next failure.
        let here = unsafe { CStr::from_ptr(last()) }
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(here, "out is NULL");
        let there = std::thread::spawn(|| {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(last()) }.to_bytes().len()
        })
        .join()
        .unwrap();
        assert_eq!(there, 0, "another thread has no error");
    }
}

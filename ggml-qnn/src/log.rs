//! QNN's log messages, routed to the `log` crate (target `qnn`) through the C shim.
//!
//! QNN's callback takes a `va_list`; `shim/log.c` formats it and calls [`sink`]. The HTP
//! emulator logs ` <E> unexpected GraphHtpSettings option 66` at ERROR on every graphCreate,
//! which is harmless (probe §1): it is passed on at `debug`. Other levels go one step down
//! ([`level_for`]).

use crate::ffi;
use std::ffi::{c_char, CStr};

/// The QNN log level to ask for, given the `log` crate's current maximum ([`level_for`] maps
/// QNN's levels one step down).
pub fn qnn_level() -> u32 {
    match log::max_level() {
        log::LevelFilter::Off | log::LevelFilter::Error | log::LevelFilter::Warn => {
            ffi::LOG_LEVEL_ERROR
        }
        log::LevelFilter::Info => ffi::LOG_LEVEL_WARN,
        log::LevelFilter::Debug => ffi::LOG_LEVEL_INFO,
        log::LevelFilter::Trace => ffi::LOG_LEVEL_VERBOSE,
    }
}

/// Register [`sink`] with the shim (idempotent).
pub fn install() {
    // SAFETY: `sink` has the shim's sink signature and lives for the whole program.
    unsafe { ffi::leap_qnn_set_log_sink(Some(sink)) };
}

/// Map a QNN log level and message to a `log` level, one step down: a QNN error is a `warn`
/// (the failing call also returns a status, which Leap turns into an [`crate::Error`]; the
/// log line carries the detail, e.g. the data types an op accepts), QNN's warnings are `info`
/// (the emulator emits dozens per graph about its own tiling and settings).
pub fn level_for(level: u32, message: &str) -> log::Level {
    match level {
        ffi::LOG_LEVEL_ERROR if message.contains("unexpected GraphHtpSettings option") => {
            log::Level::Debug
        }
        ffi::LOG_LEVEL_ERROR => log::Level::Warn,
        ffi::LOG_LEVEL_WARN => log::Level::Info,
        ffi::LOG_LEVEL_INFO => log::Level::Debug,
        _ => log::Level::Trace,
    }
}

/// Called by the C shim with a formatted message. Never unwinds into C.
unsafe extern "C" fn sink(level: u32, message: *const c_char) {
    let _ = std::panic::catch_unwind(|| {
        if message.is_null() {
            return;
        }
        // SAFETY: the shim passes a NUL-terminated buffer that outlives this call.
        let text = unsafe { CStr::from_ptr(message) }.to_string_lossy();
        let text = text.trim_end();
        log::log!(target: "qnn", level_for(level, text), "{text}");
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_noise_is_demoted() {
        assert_eq!(
            level_for(1, " <E> unexpected GraphHtpSettings option 66"),
            log::Level::Debug
        );
        assert_eq!(level_for(1, "could not create op"), log::Level::Warn);
        assert_eq!(level_for(2, "tiling"), log::Level::Info);
        assert_eq!(level_for(3, "x"), log::Level::Debug);
    }

    #[test]
    fn shim_formats_and_forwards() {
        install();
        // The shim's callback is callable from Rust only with a real va_list; this checks the
        // sink handles a NULL message without unwinding.
        // SAFETY: a NULL message is ignored by `sink`.
        unsafe { sink(1, std::ptr::null()) };
    }
}

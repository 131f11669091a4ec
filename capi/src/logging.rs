//! Where Leap's log goes when an app embeds it: stderr, filtered by the `LEAP_LOG` environment
//! variable (the app's own logging knows nothing of Rust's `log`), or the app's callback
//! (`leap_log_set`: on Android, stderr goes nowhere).
//!
//! leap-host routes llama.cpp's log into `log` under the target `llama.cpp` (its INFO as
//! `debug`), so one filter covers both. Unset, Leap's warnings and errors are shown and
//! llama.cpp is silent (its errors reach the app through `leap_last_error`), as `leap` does
//! without `-vv`; `LEAP_LOG=1` shows what `leap -vv` does (debug), `LEAP_LOG=0` nothing, and
//! a level name (`error`, `warn`, `info`, `debug`, `trace`) that level for Leap and llama.cpp
//! alike. A callback comes with its own level, for both, and `LEAP_LOG` is then not read.

use std::ffi::{c_char, c_void, CString};
use std::sync::{Once, OnceLock, RwLock};

use log::{Level, LevelFilter, Log, Metadata, Record};

/// The environment variable read at the first `leap_model_open` or `leap_log_set`.
pub const ENV: &str = "LEAP_LOG";

/// `leap_log_callback`: a record's `LEAP_LOG_*` level, its source (`"leap"` or
/// `"llama.cpp"`) and message (one line, no newline), and the app's pointer.
pub type leap_log_callback = Option<
    unsafe extern "C" fn(
        level: i32,
        source: *const c_char,
        message: *const c_char,
        user_data: *mut c_void,
    ),
>;

/// The app's callback, its pointer (kept as an address: the app vouches that it may be used
/// from any thread) and the most detailed level it takes.
#[derive(Clone, Copy)]
struct Sink {
    callback: unsafe extern "C" fn(i32, *const c_char, *const c_char, *mut c_void),
    user_data: usize,
    max: LevelFilter,
}

static SINK: RwLock<Option<Sink>> = RwLock::new(None);

fn sink() -> Option<Sink> {
    *SINK.read().unwrap_or_else(|e| e.into_inner())
}

struct Logger;

/// Which of the two a record comes from.
fn source(target: &str) -> &'static str {
    if target == "llama.cpp" {
        "llama.cpp"
    } else {
        "leap"
    }
}

impl Log for Logger {
    fn enabled(&self, m: &Metadata) -> bool {
        let max = match (sink(), source(m.target())) {
            (Some(s), _) => s.max,
            (None, "llama.cpp") => env_filters().1,
            (None, _) => env_filters().0,
        };
        m.level() <= max
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let who = source(r.target());
        match sink() {
            Some(s) => {
                let text = r.args().to_string().replace('\0', "\u{fffd}");
                let message = CString::new(text).unwrap_or_default();
                let who = if who == "leap" { c"leap" } else { c"llama.cpp" };
                // SAFETY: the app's callback (leap_log_set's contract: callable from any thread
                // with its pointer); both strings are NUL-terminated and outlive the call.
                unsafe {
                    (s.callback)(
                        level_number(r.level()),
                        who.as_ptr(),
                        message.as_ptr(),
                        s.user_data as *mut c_void,
                    )
                };
            }
            None => eprintln!("{who}: {}: {}", r.level().as_str().to_lowercase(), r.args()),
        }
    }

    fn flush(&self) {}
}

/// `LEAP_LOG_*` of a level: ERROR 1, WARN 2, INFO 3, DEBUG 4, TRACE 5.
pub fn level_number(l: Level) -> i32 {
    l as i32
}

/// The filter of `LEAP_LOG_*` level `n` (0: nothing), if it is one.
pub fn level_filter(n: i32) -> Option<LevelFilter> {
    LevelFilter::iter().find(|f| *f as i32 == n)
}

/// The filters `LEAP_LOG=value` asks for (Leap's, llama.cpp's).
fn filters(value: Option<&str>) -> (LevelFilter, LevelFilter) {
    match value.map(str::trim) {
        None | Some("") => (LevelFilter::Warn, LevelFilter::Off),
        Some("0") => (LevelFilter::Off, LevelFilter::Off),
        Some("1") => (LevelFilter::Debug, LevelFilter::Debug),
        Some(level) => match level.parse::<LevelFilter>() {
            Ok(l) => (l, l),
            Err(_) => (LevelFilter::Warn, LevelFilter::Off),
        },
    }
}

/// The stderr filters (Leap's, llama.cpp's), from `LEAP_LOG` when the logger is installed.
static ENV_FILTERS: OnceLock<(LevelFilter, LevelFilter)> = OnceLock::new();

fn env_filters() -> (LevelFilter, LevelFilter) {
    ENV_FILTERS
        .get()
        .copied()
        .unwrap_or((LevelFilter::Off, LevelFilter::Off))
}

/// `log`'s global level: the callback's, or the higher of the stderr filters.
fn set_max_level() {
    let max = match sink() {
        Some(s) => s.max,
        None => {
            let (leap, llama) = env_filters();
            leap.max(llama)
        }
    };
    log::set_max_level(max);
}

/// Install the logger once per process, unless the process already has a logger (a Rust
/// program using the rlib).
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let value = std::env::var(ENV).ok();
        let _ = ENV_FILTERS.set(filters(value.as_deref()));
        if log::set_logger(&Logger).is_ok() {
            set_max_level();
        }
    });
}

/// Send the log to `callback` up to `max` (`None`: back to stderr).
pub fn set_sink(callback: leap_log_callback, max: LevelFilter, user_data: *mut c_void) {
    init();
    *SINK.write().unwrap_or_else(|e| e.into_inner()) = callback.map(|callback| Sink {
        callback,
        user_data: user_data as usize,
        max,
    });
    set_max_level();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leap_log_values() {
        assert_eq!(filters(None), (LevelFilter::Warn, LevelFilter::Off));
        assert_eq!(filters(Some("0")), (LevelFilter::Off, LevelFilter::Off));
        assert_eq!(filters(Some("1")), (LevelFilter::Debug, LevelFilter::Debug));
        assert_eq!(
            filters(Some("info")),
            (LevelFilter::Info, LevelFilter::Info)
        );
        assert_eq!(
            filters(Some("bogus")),
            (LevelFilter::Warn, LevelFilter::Off)
        );
    }

    #[test]
    fn level_numbers_are_the_headers() {
        let header = include_str!("../../include/leap.h");
        for (name, level) in [
            ("LEAP_LOG_ERROR", Level::Error),
            ("LEAP_LOG_WARN", Level::Warn),
            ("LEAP_LOG_INFO", Level::Info),
            ("LEAP_LOG_DEBUG", Level::Debug),
            ("LEAP_LOG_TRACE", Level::Trace),
        ] {
            let line = format!("#define {name} {}", level_number(level));
            assert!(header.contains(&line), "include/leap.h lacks `{line}`");
            assert_eq!(
                level_filter(level_number(level)),
                Some(level.to_level_filter())
            );
        }
        assert!(header.contains("#define LEAP_LOG_NONE 0"));
        assert_eq!(level_filter(0), Some(LevelFilter::Off));
        assert_eq!(level_filter(6), None);
        assert_eq!(level_filter(-1), None);
    }
}

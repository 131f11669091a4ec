//! Where Leap's log goes when an app embeds it: stderr, filtered by the `LEAP_LOG` environment
//! variable (the app's own logging knows nothing of Rust's `log`).
//!
//! leap-host routes llama.cpp's log into `log` under the target `llama.cpp` (its INFO as
//! `debug`), so one filter covers both. Unset, Leap's warnings and errors are shown and
//! llama.cpp is silent (its errors reach the app through `leap_last_error`), as `leap` does
//! without `-vv`; `LEAP_LOG=1` shows what `leap -vv` does (debug), `LEAP_LOG=0` nothing, and
//! a level name (`error`, `warn`, `info`, `debug`, `trace`) that level for Leap and llama.cpp
//! alike.

use std::sync::Once;

use log::{LevelFilter, Log, Metadata, Record};

/// The environment variable read at the first `leap_model_open`.
pub const ENV: &str = "LEAP_LOG";

struct Stderr {
    /// Leap's own records up to this level.
    leap: LevelFilter,
    /// llama.cpp's records (target `llama.cpp`) up to this level.
    llama: LevelFilter,
}

impl Log for Stderr {
    fn enabled(&self, m: &Metadata) -> bool {
        let max = if m.target() == "llama.cpp" {
            self.llama
        } else {
            self.leap
        };
        m.level() <= max
    }

    fn log(&self, r: &Record) {
        if self.enabled(r.metadata()) {
            let who = if r.target() == "llama.cpp" {
                "llama.cpp"
            } else {
                "leap"
            };
            eprintln!("{who}: {}: {}", r.level().as_str().to_lowercase(), r.args());
        }
    }

    fn flush(&self) {}
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

/// Install the stderr logger once per process, unless the process already has a logger
/// (a Rust program using the rlib).
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let value = std::env::var(ENV).ok();
        let (leap, llama) = filters(value.as_deref());
        let logger = Box::leak(Box::new(Stderr { leap, llama }));
        if log::set_logger(logger).is_ok() {
            log::set_max_level(leap.max(llama));
        }
    });
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
}

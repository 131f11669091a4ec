//! `libggml_leap.so`: Leap's ggml device for a llama.cpp that Leap did not build.
//!
//! ggml's loader (`ggml_backend_load`, and `ggml_backend_load_all`, which reads the
//! `GGML_BACKEND_PATH` environment variable) `dlopen`s this library, checks
//! `ggml_backend_score`, calls `ggml_backend_init` and registers the registry it returns, whose
//! `leap-cpu` device then takes work in every context created afterwards, as it does inside
//! `leap`. The library links the host's shared ggml (never a copy of its own), and must come
//! from the same llama.cpp tree as the host: `leap plugin-path` prints where it is.
//!
//! Settings come from the environment, since the host program knows nothing of Leap:
//! - `LEAP_SPARSE`: `off` (default) or the fraction of keys a query attends (`0.2`); the host
//!   must run with flash attention on (`-fa on`) for the device to see attention.
//! - `LEAP_KERNELS`: `on` (default) or `off` (small-batch matrix products left to ggml).
//! - `LEAP_ESTIMATE`: `cpu` (default) or `opencl`: sparse attention's estimate on an OpenCL
//!   device (the `leap-opencl` device, registered when OpenCL works here).
//! - `LEAP_QNN`: `on` or `off`: `leap-cpu`'s estimate on Qualcomm's NPU through QNN (default:
//!   on for Android when `libQnnHtp.so` loads, off elsewhere; `LEAP_QNN_LIB_DIR` says where
//!   the library is). A library that does not load is reported on stderr and the CPU
//!   estimates.
//! - `LEAP_STATS`: `1` prints, when the host exits, how many graph nodes `leap-cpu` computed
//!   (`libggml_leap: leap-cpu computed N nodes`): the way to see that the device ran.
//!
//! Leap's warnings and errors go to stderr (the host's logging knows nothing of Rust's).

use std::ffi::c_void;

use leap_backend::attn::{self, Sparse};

/// Leap's log records of level warning and above, on stderr.
struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!("libggml_leap: {}: {}", r.level(), r.args());
        }
    }
    fn flush(&self) {}
}

/// `LEAP_STATS`' report, run by the C library at exit.
extern "C" fn report() {
    // Nothing may unwind out of an exit handler.
    let _ = std::panic::catch_unwind(|| {
        eprintln!(
            "libggml_leap: leap-cpu computed {} nodes",
            leap_backend::total_calls()
        );
    });
}

fn configure() {
    if log::set_logger(&Stderr).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
    if std::env::var("LEAP_STATS").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "off")) {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: `report` is a plain function that stays valid as long as this library
        // (glibc runs a library's exit handlers when it is unloaded, too).
        ONCE.call_once(|| unsafe {
            libc::atexit(report);
        });
    }
    if let Ok(v) = std::env::var("LEAP_KERNELS") {
        leap_backend::set_enabled(!matches!(v.trim(), "off" | "0" | "false"));
    }
    let estimate_on = match std::env::var("LEAP_ESTIMATE").as_deref().map(str::trim) {
        Ok("opencl") => {
            leap_backend::want_opencl();
            attn::EstimateOn::OpenCl
        }
        Ok("") | Ok("cpu") | Err(_) => attn::EstimateOn::Cpu,
        Ok(v) => {
            eprintln!("libggml_leap: LEAP_ESTIMATE must be cpu or opencl, not {v:?}; using cpu");
            attn::EstimateOn::Cpu
        }
    };
    match std::env::var("LEAP_SPARSE").as_deref().map(str::trim) {
        Ok("") | Ok("off") | Ok("0") | Err(_) => {}
        Ok(v) => match v.parse::<f32>() {
            Ok(keep) if keep > 0.0 && keep <= 1.0 => attn::set_sparse(Some(Sparse {
                keep,
                estimate_on,
                ..Sparse::default()
            })),
            _ => eprintln!("libggml_leap: LEAP_SPARSE must be off or a fraction in (0, 1], not {v:?}; sparse attention stays off"),
        },
    }
}

/// ggml's plugin entry point: the registry (the same pointer on every call).
#[no_mangle]
pub extern "C" fn ggml_backend_init() -> *mut c_void {
    std::panic::catch_unwind(|| {
        configure();
        leap_backend::registry().cast::<c_void>()
    })
    .unwrap_or(std::ptr::null_mut())
}

/// ggml's plugin score: nonzero, the device runs on any CPU (it checks its kernels against
/// ggml's at run time and leaves to ggml what it cannot compute exactly).
#[no_mangle]
pub extern "C" fn ggml_backend_score() -> i32 {
    1
}

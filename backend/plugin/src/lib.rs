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
//! - `LEAP_OUTPUT`: `ggml` (default here) or `device`: who computes the output projection.
//! - `LEAP_STATS`: `1` prints, when the host exits, how many graph nodes `leap-cpu` computed
//!   (`libggml_leap: leap-cpu computed N nodes`): the way to see that the device ran.
//!
//! Leap's warnings and errors go to stderr (the host's logging knows nothing of Rust's).

use std::ffi::c_void;

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

fn configure() {
    if log::set_logger(&Stderr).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
    leap_backend::use_by_default(leap_backend::configure_from_env(
        "libggml_leap",
        leap_backend::DeviceConfig::default(),
    ));
}

/// ggml's plugin entry point: the registry (the same pointer on every call).
#[no_mangle]
pub extern "C" fn ggml_backend_init() -> *mut c_void {
    // A CPU below the build's baseline: no device (ggml_backend_score said why).
    if leap_kernels::cpu::missing_baseline().is_some() {
        return std::ptr::null_mut();
    }
    std::panic::catch_unwind(|| {
        configure();
        leap_backend::registry().cast::<c_void>()
    })
    .unwrap_or(std::ptr::null_mut())
}

/// ggml's plugin score: nonzero, the device runs on any CPU this build was compiled for (it
/// checks its kernels against ggml's at run time and leaves to ggml what it cannot compute
/// exactly); 0, with one line on stderr, on a CPU below the build's baseline, so that ggml
/// does not load it.
#[no_mangle]
pub extern "C" fn ggml_backend_score() -> i32 {
    match leap_kernels::cpu::missing_baseline() {
        None => 1,
        Some(f) => {
            eprintln!(
                "libggml_leap: not loaded: {}",
                leap_kernels::cpu::below_baseline_message(f)
            );
            0
        }
    }
}

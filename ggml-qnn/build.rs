//! Compiles the C shim that turns QNN's `va_list` log callback into a formatted string for
//! Rust (stable Rust cannot take a `va_list`). No Qualcomm file is needed to build.

fn main() {
    println!("cargo:rerun-if-changed=shim/log.c");
    cc::Build::new()
        .file("shim/log.c")
        .warnings(true)
        .compile("leap_qnn_log_shim");
}

//! Puts the directory of llama.cpp's shared libraries (exported by leap-host) in the DT_RPATH of
//! this crate's binaries and tests (DT_RPATH, unlike RUNPATH, also serves libllama's own
//! dependency on libggml); `$ORIGIN` (set in .cargo/config.toml) covers copies of the
//! libraries shipped next to an installed binary. Also tells the plugin test where llama.cpp's
//! headers and libraries are (to build a C program against them).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if let Ok(dir) = std::env::var("DEP_LEAPHOST_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,{dir}");
        println!("cargo:rustc-env=LEAP_LLAMA_LIBDIR={dir}");
    }
    if let Ok(dir) = std::env::var("DEP_LEAPHOST_SRCDIR") {
        println!("cargo:rustc-env=LEAP_LLAMA_SRCDIR={dir}");
    }
}

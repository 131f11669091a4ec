//! Puts the directory of llama.cpp's shared libraries (exported by leap-host) in the DT_RPATH of
//! libleap.so (DT_RPATH, unlike RUNPATH, also serves libllama's own dependency on libggml);
//! `$ORIGIN` (set in .cargo/config.toml) covers copies of the libraries shipped next to it.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if let Ok(dir) = std::env::var("DEP_LEAPHOST_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,{dir}");
    }
}

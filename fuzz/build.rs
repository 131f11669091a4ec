//! Puts the directory of llama.cpp's shared libraries (exported by leap-host) in the DT_RPATH
//! of the fuzz targets, as cli/build.rs does for `leap`: cargo-fuzz's RUSTFLAGS replace the
//! `-rpath,$ORIGIN` of .cargo/config.toml.
fn main() {
    if let Ok(dir) = std::env::var("DEP_LEAPHOST_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,{dir}");
    }
}

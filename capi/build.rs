//! libleap.so's link: its SONAME `libleap.so.N`, N being `LEAP_ABI_VERSION` in include/leap.h
//! (the one place it is written; the crate's `LEAP_ABI_VERSION` constant is generated from it,
//! `OUT_DIR/abi.rs`), and the directory of llama.cpp's shared libraries (exported by leap-host) in
//! its DT_RPATH (DT_RPATH, unlike RUNPATH, also serves libllama's own dependency on libggml);
//! `$ORIGIN` (set in .cargo/config.toml) covers copies of the libraries shipped next to it.
//! `make install` (scripts/install) rewrites that rpath for the installed tree.
//!
//! A program linked with `-lleap` asks the loader for `libleap.so.N`, so the build tree has it
//! too: a symlink to libleap.so in the profile directory (target/release, or
//! target/<triple>/release), made here since cargo names the library itself.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../include/leap.h");
    let header = std::fs::read_to_string("../include/leap.h").expect("include/leap.h");
    let abi: u32 = header
        .lines()
        .find_map(|l| l.strip_prefix("#define LEAP_ABI_VERSION "))
        .and_then(|v| v.trim().parse().ok())
        .expect("include/leap.h defines LEAP_ABI_VERSION as a number");
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(
        out.join("abi.rs"),
        format!("/// `LEAP_ABI_VERSION` (include/leap.h): the N of the SONAME `libleap.so.N`.\npub const LEAP_ABI_VERSION: i32 = {abi};\n"),
    )
    .expect("write abi.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libleap.so.{abi}");
    soname_link(abi);
    if let Ok(dir) = std::env::var("DEP_LEAPHOST_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,{dir}");
    }
}

/// `libleap.so.N -> libleap.so` in the profile directory (OUT_DIR is
/// `<profile dir>/build/leap-capi-<hash>/out`); dangling until the library is linked.
fn soname_link(abi: u32) {
    let Some(out) = std::env::var_os("OUT_DIR") else {
        return;
    };
    let Some(profile) = std::path::Path::new(&out).ancestors().nth(3) else {
        return;
    };
    let link = profile.join(format!("libleap.so.{abi}"));
    if std::fs::read_link(&link).is_err() {
        let _ = std::fs::remove_file(&link);
        if let Err(e) = std::os::unix::fs::symlink("libleap.so", &link) {
            println!("cargo:warning=cannot link {}: {e}", link.display());
        }
    }
}

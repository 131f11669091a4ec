//! Compiles the C++ shim over llama.cpp's `common/speculative.h` (the anchor Leap measures
//! itself against) against the exact llama.cpp tree that llama-cpp-sys-2 vendored and built.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim/anchor.cpp");
    println!("cargo:rerun-if-changed=shim/anchor.h");
    println!("cargo:rerun-if-changed=shim/grammar.cpp");
    let src = llama_source_dir();
    // For the backend plugin's bindgen of ggml's backend interface (same tree).
    println!("cargo:srcdir={}", src.display());
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .file("shim/anchor.cpp")
        .file("shim/grammar.cpp")
        .include("shim")
        .include(src.join("include"))
        .include(src.join("ggml/include"))
        .include(src.join("common"))
        .include(src.join("vendor"))
        .warnings(false)
        .flag_if_supported("-Wno-unused-parameter");
    b.compile("leap_anchor");
    // The shim calls into libllama-common, which llama-cpp-sys-2 links for us ("common" feature).

    // llama.cpp is built as shared libraries (so that Leap's backend plugin and the host share
    // one ggml). Binaries find them through an rpath: tell dependents where they are, and
    // set it for this crate's own test binaries.
    let libdir = lib_dir();
    println!("cargo:libdir={}", libdir.display());
    // DT_RPATH, not RUNPATH: libllama.so needs libggml.so but carries no rpath of its own,
    // and only DT_RPATH also serves a library's dependencies.
    println!(
        "cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,{}",
        libdir.display()
    );
    link_sonames(&libdir);
}

/// llama-cpp-sys-2 hard-links its `libX.so` files, which are symlinks to `libX.so.0`, into
/// `target/<profile>/`, `deps/` and `examples/`, where they dangle; the next build of the sys crate in that
/// target dir (another feature set or RUSTFLAGS) then fails with "File exists". Putting the
/// `libX.so.0` links beside them (pointing into the current build) makes them valid, and lets
/// binaries find the libraries through `$ORIGIN` as well.
fn link_sonames(libdir: &std::path::Path) {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // target/<profile>/build/leap-host-*/out -> target/<profile>
    let Some(profile_dir) = out.ancestors().nth(3) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(libdir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("lib") && name.ends_with(".so.0")) {
            continue;
        }
        for dir in [
            profile_dir.to_path_buf(),
            profile_dir.join("deps"),
            profile_dir.join("examples"),
        ] {
            if !dir.is_dir() {
                continue;
            }
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            if let Err(err) = std::os::unix::fs::symlink(e.path(), &link) {
                println!("cargo:warning=could not link {}: {err}", link.display());
            }
        }
    }
}

/// Where llama-cpp-sys-2 installed libllama.so and libggml*.so.
fn lib_dir() -> PathBuf {
    let cmake_dir = std::env::var("DEP_LLAMA_GGML_CMAKE_DIR").expect("DEP_LLAMA_GGML_CMAKE_DIR");
    PathBuf::from(cmake_dir)
        .parent()
        .map(PathBuf::from)
        .expect("ggml cmake dir has a parent")
}

/// The llama.cpp source tree the sys crate configured CMake with, read from its CMake cache.
fn llama_source_dir() -> PathBuf {
    let cmake_dir = std::env::var("DEP_LLAMA_GGML_CMAKE_DIR")
        .expect("llama-cpp-sys-2 did not export DEP_LLAMA_GGML_CMAKE_DIR (links = \"llama\")");
    // .../out/lib/cmake -> .../out
    let out = PathBuf::from(cmake_dir)
        .ancestors()
        .nth(2)
        .map(PathBuf::from)
        .expect("unexpected ggml cmake dir layout");
    let cache = out.join("build").join("CMakeCache.txt");
    let text = std::fs::read_to_string(&cache)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cache.display()));
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("CMAKE_HOME_DIRECTORY:INTERNAL=") {
            return PathBuf::from(v);
        }
    }
    panic!("no CMAKE_HOME_DIRECTORY in {}", cache.display());
}

//! `libggml_leap.so` in a llama.cpp program that knows nothing of Leap (`tests/c/plugin_host.c`,
//! compiled here against the same libllama): ggml's loader finds it through
//! `GGML_BACKEND_PATH`, its `leap-cpu` device takes work, and the program decodes the tokens it
//! decodes without it.

use std::path::{Path, PathBuf};
use std::process::Command;

use leap_tests::{built_library, model_path, SMOLLM};

fn plugin() -> PathBuf {
    built_library("libggml_leap.so", "leap-plugin")
}

/// Compile the C host against llama.cpp's headers and shared libraries.
fn host_program(dir: &Path) -> PathBuf {
    let src = env!("LEAP_LLAMA_SRCDIR");
    let lib = env!("LEAP_LLAMA_LIBDIR");
    let out = dir.join("plugin_host");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .arg("-O1")
        .arg("-o")
        .arg(&out)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/c/plugin_host.c"))
        .arg(format!("-I{src}/include"))
        .arg(format!("-I{src}/ggml/include"))
        .arg(format!("-L{lib}"))
        .args(["-lllama", "-lggml", "-lggml-base"])
        .arg(format!("-Wl,--disable-new-dtags,-rpath,{lib}"))
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(status.success(), "compiling plugin_host.c failed");
    out
}

struct Run {
    code: i32,
    devices: Vec<String>,
    tokens: String,
    nodes: u64,
    stderr: String,
}

fn run(host: &Path, envs: &[(&str, &str)], flash_attn: bool) -> Run {
    let mut cmd = Command::new(host);
    cmd.arg(model_path(SMOLLM))
        .arg("8")
        .arg(if flash_attn { "1" } else { "0" })
        .env_remove("GGML_BACKEND_PATH")
        .env_remove("LEAP_SPARSE")
        .env_remove("LEAP_KERNELS")
        .env_remove("LEAP_QNN")
        .env_remove("LEAP_QNN_LIB_DIR");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run plugin_host");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |p: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    Run {
        code: out.status.code().unwrap_or(-1),
        devices: stdout
            .lines()
            .filter_map(|l| l.strip_prefix("device "))
            .map(str::to_string)
            .collect(),
        tokens: field("tokens"),
        nodes: field("leap-cpu nodes ").parse().unwrap_or(0),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn unmodified_llama_cpp_loads_the_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let host = host_program(dir.path());
    let so = plugin();
    let so = so.to_str().unwrap();

    let without = run(&host, &[], false);
    assert_eq!(
        without.code, 2,
        "without GGML_BACKEND_PATH there is no leap-cpu"
    );
    assert!(!without.devices.iter().any(|d| d == "leap-cpu"));

    let with = run(&host, &[("GGML_BACKEND_PATH", so)], false);
    assert_eq!(with.code, 0);
    assert!(
        with.devices.iter().any(|d| d == "leap-cpu"),
        "{:?}",
        with.devices
    );
    assert!(
        with.nodes > 0,
        "the device computed the prompt's matrix products"
    );

    // The device's matrix products are ggml's bit for bit: same tokens as with it off.
    let off = run(
        &host,
        &[("GGML_BACKEND_PATH", so), ("LEAP_KERNELS", "off")],
        false,
    );
    assert_eq!(off.code, 0);
    assert_eq!(off.nodes, 0);
    assert_eq!(with.tokens, off.tokens);
    assert_eq!(with.tokens.split(' ').count(), 8);

    // Sparse attention through the environment (the host runs with flash attention).
    let sparse = run(
        &host,
        &[("GGML_BACKEND_PATH", so), ("LEAP_SPARSE", "0.2")],
        true,
    );
    let dense = run(&host, &[("GGML_BACKEND_PATH", so)], true);
    assert_eq!(sparse.code, 0);
    assert_eq!(dense.code, 0);
    assert!(
        sparse.nodes > dense.nodes,
        "attention and cache writes on the device: {} vs {}",
        sparse.nodes,
        dense.nodes
    );

    // QNN asked for (LEAP_QNN=on) with a library that is not QNN: a warning on stderr, and the
    // program decodes what it decodes without QNN.
    let wrong = tempfile::tempdir().unwrap();
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).is_file())
    .expect("libm.so.6 stands in for a wrong QNN library");
    std::fs::copy(libm, wrong.path().join("libQnnHtp.so")).unwrap();
    let qnn = run(
        &host,
        &[
            ("GGML_BACKEND_PATH", so),
            ("LEAP_SPARSE", "0.2"),
            ("LEAP_QNN", "on"),
            ("LEAP_QNN_LIB_DIR", wrong.path().to_str().unwrap()),
        ],
        true,
    );
    assert_eq!(qnn.code, 0, "{}", qnn.stderr);
    assert!(
        qnn.stderr.contains("QNN unavailable") && qnn.stderr.contains("not a QNN library"),
        "{}",
        qnn.stderr
    );
    assert_eq!(qnn.tokens, sparse.tokens);
    assert_eq!(qnn.nodes, sparse.nodes);
}

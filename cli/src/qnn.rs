//! `leap qnn-selftest`: the QNN device's graphs run on the QNN library that is present (on x86
//! the HTP emulator from the onnxruntime-qnn wheel, `scripts/fetch-qnn`), each compared with
//! Leap's CPU reference; the JSON report goes to `--out`, a summary to stderr.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

/// Options of `leap qnn-selftest`.
#[derive(Args, Debug, Clone)]
pub struct QnnSelftestArgs {
    /// Directory holding libQnnHtp.so and libQnnSystem.so (default: $LEAP_QNN_LIB_DIR, then
    /// the cache scripts/fetch-qnn fills).
    #[arg(long)]
    pub lib_dir: Option<PathBuf>,
    /// Where to write the JSON report.
    #[arg(long)]
    pub out: PathBuf,
    /// Where context binaries are saved (default: the QNN cache's `graphs/`).
    #[arg(long)]
    pub graph_dir: Option<PathBuf>,
}

#[cfg(feature = "qnn")]
/// Run the self-test and write the report.
///
/// # Errors
/// A missing or unsupported QNN library (the message says how to get one), a QNN failure, or
/// an unwritable `--out`.
pub fn qnn_selftest(args: &QnnSelftestArgs) -> Result<()> {
    use anyhow::Context as _;
    use leap_ggml_qnn::{library, selftest};
    let graph_dir = match &args.graph_dir {
        Some(d) => d.clone(),
        None => library::cache_dir()
            .map(|d| d.with_file_name("graphs"))
            .unwrap_or_else(|| std::env::temp_dir().join("leap-qnn-graphs")),
    };
    let report = selftest::run(selftest::Options {
        lib_dir: args.lib_dir.clone(),
        cache_dir: graph_dir,
        data: None,
    })
    .context("QNN self-test")?;
    eprintln!(
        "{} (core API {}, backend API {}) at {}",
        report.provider,
        report.core_api,
        report.backend_api,
        report.library.display()
    );
    for op in &report.ops {
        eprintln!(
            "  {:<40} {:>16} {:<38} max_abs_err {:.3e} (tol {:.1e}) {}",
            op.op,
            format!("{:?}", op.shape),
            op.dtype,
            op.max_abs_err,
            op.tolerance,
            if op.ok { "ok" } else { "FAIL" }
        );
    }
    eprintln!(
        "  estimation recall@20% {:.4}; finalize {:.1} ms; context binary saved {} ({} B), reload {}",
        report.estimation_recall,
        report.finalize_ms,
        report.context_binary.saved,
        report.context_binary.bytes,
        report
            .context_binary
            .reload_ms
            .map_or("-".into(), |ms| format!("{ms:.1} ms"))
    );
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(&args.out, json + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    if report.ops.iter().any(|o| !o.ok) {
        anyhow::bail!(
            "a QNN op is outside its tolerance (see {})",
            args.out.display()
        );
    }
    Ok(())
}

#[cfg(not(feature = "qnn"))]
/// Without the `qnn` feature there is no QNN device.
///
/// # Errors
/// Always.
pub fn qnn_selftest(_args: &QnnSelftestArgs) -> Result<()> {
    anyhow::bail!("this leap was built without the `qnn` feature; rebuild with --features qnn")
}

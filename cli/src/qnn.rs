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
    /// Measure the estimate's recall on queries and keys captured from this model's decode
    /// step (its full-attention layers) instead of random data, e.g. `gemma3-270m`.
    #[arg(long)]
    pub capture: Option<String>,
    /// The text whose tokens fill the context for `--capture`.
    #[arg(long, default_value = "tests/data/attention-notes.txt")]
    pub text: PathBuf,
    /// Context length (keys) for `--capture`.
    #[arg(long, default_value_t = 1024)]
    pub ctx: usize,
}

/// Q and K of one decode step's attention nodes of `model` at context `n`: the layers whose
/// decode row sees every key (full attention), every query head against its KV head's keys.
#[cfg(feature = "qnn")]
fn capture(
    model: &str,
    text: &std::path::Path,
    n: usize,
) -> Result<leap_ggml_qnn::selftest::QkData> {
    use anyhow::{ensure, Context as _};
    use leap_host::{Batch, Context, ContextParams, FlashAttn, Model, ModelParams};
    ensure!(n >= 16, "--ctx must be at least 16");
    let path = crate::models::resolve(model)?;
    leap_backend::register();
    // Dense on the device: the capture takes every attention node.
    let device = leap_backend::Device::new(leap_backend::DeviceConfig::default());
    let model = Model::load(&path, &ModelParams::default())?;
    let body =
        std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
    let mut toks = model.tokenize(&body, true, false)?;
    ensure!(!toks.is_empty(), "{} has no tokens", text.display());
    while toks.len() < n {
        let more = toks.clone();
        toks.extend_from_slice(&more);
    }
    toks.truncate(n);
    let mut ctx = device.bind(|| {
        Context::new(
            &model,
            &ContextParams {
                n_ctx: (n + 16) as u32,
                n_batch: 512,
                n_ubatch: 512,
                flash_attn: FlashAttn::On,
                ..Default::default()
            },
        )
    })?;
    for (c, chunk) in toks[..n - 1].chunks(512).enumerate() {
        let mut b = Batch::new(chunk.len(), 1);
        for (k, &t) in chunk.iter().enumerate() {
            b.add(t, (c * 512 + k) as i32, &[0], false)?;
        }
        ctx.decode(&b)?;
    }
    device.start_capture();
    let mut b = Batch::new(1, 1);
    b.add(toks[n - 1], (n - 1) as i32, &[0], true)?;
    let r = ctx.decode(&b);
    let nodes = device.take_capture();
    r?;
    // Full attention: the decode row sees every key (sliding-window layers mask all but
    // their window, so a top-k over all keys would rank keys attention never reads).
    let full: Vec<_> = nodes
        .iter()
        .filter(|c| {
            c.n_q == 1
                && c.mask[..c.n_kv]
                    .iter()
                    .all(|&m| leap_backend::f16::to_f32(m).is_finite())
        })
        .collect();
    ensure!(
        !full.is_empty(),
        "no full-attention decode node was captured from {model:?}"
    );
    let (d, n_kv) = (full[0].d, full[0].n_kv);
    // Only the candidates are estimated: sparse attention always keeps the first keys (sinks)
    // and the recent window (leap_backend::attn::Sparse), as its CPU estimate does.
    let cfg = leap_backend::attn::Sparse::default();
    ensure!(
        n_kv > cfg.sink + cfg.recent + 16,
        "--ctx is too short for sparse attention"
    );
    let (lo, hi) = (cfg.sink, n_kv - cfg.recent);
    let keys = hi - lo;
    let (mut q, mut k) = (Vec::new(), Vec::new());
    for c in &full {
        ensure!(c.d == d && c.n_kv == n_kv, "captured nodes differ in shape");
        let group = c.n_head / c.n_head_kv.max(1);
        for h in 0..c.n_head {
            q.push(c.q[h * d..][..d].to_vec());
            let hk = h / group.max(1);
            let kh: Vec<f32> = (lo..hi)
                .flat_map(|j| {
                    let row = &c.k[(j * c.n_head_kv + hk) * d..][..d];
                    row.iter().map(|&x| leap_backend::f16::to_f32(x))
                })
                .collect();
            k.push(kh);
        }
    }
    let layers: Vec<usize> = full.iter().map(|c| c.layer).collect();
    Ok(leap_ggml_qnn::selftest::QkData {
        rows: 1,
        keys,
        d,
        source: format!(
            "{} decode step at context {n}: layers {layers:?}, {} heads, candidate keys {lo}..{hi}",
            path.file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
            q.len()
        ),
        q,
        k,
    })
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
    let data = match &args.capture {
        Some(model) => Some(capture(model, &args.text, args.ctx).context("capturing Q/K")?),
        None => None,
    };
    let report = selftest::run(selftest::Options {
        lib_dir: args.lib_dir.clone(),
        cache_dir: graph_dir,
        data,
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
        "  estimation recall@20%: estimate alone {:.4} (CPU-simulated {:.4}, 16-bit keys {}, \
         per-head scale buckets {:.4}, unsmoothed {:.4}); kept set (25% extra re-ranked exactly) {:.4}",
        report.estimation_recall,
        report.estimation_recall_simulated,
        report
            .estimation_recall_key16
            .map_or_else(|| "refused".to_string(), |r| format!("{r:.4}")),
        report.estimation_recall_buckets,
        report.estimation_recall_unsmoothed,
        report.estimation_recall_kept,
    );
    eprintln!(
        "  finalize {:.1} ms; context binary saved {} ({} B), reload {}",
        report.finalize_ms,
        report.context_binary.saved,
        report.context_binary.bytes,
        report
            .context_binary
            .reload_ms
            .map_or("-".into(), |ms| format!("{ms:.1} ms"))
    );
    let sched = &report.schedule;
    match (sched.sync_ms, sched.progressive_ms) {
        (Some(sync), Some(prog)) => eprintln!(
            "  switching {} blocks x {} chunks: synchronous {sync:.1} ms, progressive {prog:.1} ms \
             (chosen: {})",
            sched.blocks,
            sched.chunks,
            sched.chosen.unwrap_or("-")
        ),
        _ => eprintln!(
            "  switching: not measured ({})",
            sched.error.as_deref().unwrap_or("-")
        ),
    }
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

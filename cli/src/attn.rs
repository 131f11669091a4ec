//! `leap attn-bench`, `leap perplexity`, `leap profile-heads` and `leap plugin-path`: what
//! sparse attention costs and what it changes, measured on a real model and text, and its
//! per-head budgets written into the sidecar.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::attn_bench::{self, NodeResult};
use anyhow::{bail, ensure, Context as _, Result};
use leap_backend::attn::{self, Sparse};
use leap_backend::{Device, DeviceConfig};
use leap_host::{Batch, Context, ContextParams, FlashAttn, Model, ModelParams};
use serde::Serialize;

use crate::{models, progress};

/// Where the plugin's shared library is: next to the `leap` executable (cargo puts both in
/// `target/<profile>/`), or under `../lib` of an installed one.
pub fn plugin_path() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the leap executable")?;
    let dir = exe.parent().context("the executable's directory")?;
    let name = "libggml_leap.so";
    for cand in [dir.join(name), dir.join("../lib").join(name)] {
        if cand.exists() {
            return Ok(cand.canonicalize().unwrap_or(cand));
        }
    }
    bail!(
        "{name} is not next to {} (build it with `make plugin` or `cargo build --release`)",
        exe.display()
    )
}

/// Sparse-attention settings from the command line: `keep` in (0, 1].
pub fn sparse_config(keep: f32) -> Result<Sparse> {
    ensure!(
        keep > 0.0 && keep <= 1.0,
        "--keep must be a fraction in (0, 1], not {keep}"
    );
    Ok(Sparse {
        keep,
        ..Sparse::default()
    })
}

/// Tokens of `file`, at least `need` of them (the text repeats if it is shorter, with a
/// warning: attention over repeated text is easier to estimate than over new text).
fn tokens_of(model: &Model, file: &Path, need: usize) -> Result<Vec<i32>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    ensure!(!text.trim().is_empty(), "{} is empty", file.display());
    let mut toks = model.tokenize(&text, true, false)?;
    if toks.len() < need {
        log::warn!(
            "{} has {} tokens, fewer than {need}: repeating it",
            file.display(),
            toks.len()
        );
        let body = model.tokenize(&text, false, false)?;
        while toks.len() < need {
            toks.extend_from_slice(&body);
        }
    }
    Ok(toks)
}

/// A context with flash attention whose Leap device is `device`.
fn fa_context(
    model: &Arc<Model>,
    device: &Device,
    n_ctx: u32,
    n_batch: u32,
    threads: i32,
) -> Result<Context> {
    Ok(device.bind(|| {
        Context::new(
            model,
            &ContextParams {
                n_ctx,
                n_batch,
                n_ubatch: 512,
                n_threads: threads,
                n_threads_batch: threads,
                flash_attn: FlashAttn::On,
                ..Default::default()
            },
        )
    })?)
}

/// `-log p(next)` under the softmax of `logits` (f64 sums, max-shifted).
fn next_token_nll(logits: &[f32], next: i32) -> f64 {
    let max = logits.iter().copied().fold(f32::MIN, f32::max);
    let z: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    z.ln() - (logits[next as usize] - max) as f64
}

/// Decode `tokens` from position `pos0` in batches of `n_batch`, with logits for the rows
/// where `want(pos)` holds; `f(pos, logits)` sees them.
fn decode_run(
    ctx: &mut Context,
    tokens: &[i32],
    pos0: usize,
    n_batch: usize,
    want: impl Fn(usize) -> bool,
    mut f: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    for (c, chunk) in tokens.chunks(n_batch).enumerate() {
        let mut b = Batch::new(chunk.len(), 1);
        let mut rows = Vec::new();
        for (k, &t) in chunk.iter().enumerate() {
            let pos = pos0 + c * n_batch + k;
            let row = b.add(t, pos as i32, &[0], want(pos))?;
            if want(pos) {
                rows.push((pos, row));
            }
        }
        ctx.decode(&b)?;
        for (pos, row) in rows {
            f(pos, ctx.logits(row)?)?;
        }
    }
    Ok(())
}

#[derive(Serialize)]
struct AttnCtxResult {
    ctx: usize,
    dense_ms: f64,
    sparse_ms: f64,
    speedup: f64,
    recall: f64,
    max_abs_err: f32,
    /// Recall of the int8 estimate's own top-k (before the exact re-ranking near the cut).
    estimate_recall: f64,
    /// Attention probability of the kept keys (exact softmax), averaged over sparse queries.
    mass: f64,
    /// Leap's own dense path (every key) on the nodes it takes.
    leap_dense_ms: f64,
    /// ggml vs Leap over the nodes where some query attended sparsely (full-attention layers;
    /// the rest are sliding-window layers, which Leap computes densely over their window).
    dense_ms_sparse_nodes: f64,
    sparse_ms_sparse_nodes: f64,
    speedup_sparse_nodes: f64,
    /// Keys kept / visible over the nodes the device takes.
    kept_fraction: f64,
    nodes: usize,
    nodes_taken: usize,
    layers: Vec<LayerResult>,
}

#[derive(Serialize)]
struct LayerResult {
    layer: usize,
    swa: bool,
    taken: bool,
    n_kv: usize,
    dense_ms: f64,
    leap_dense_ms: f64,
    sparse_ms: f64,
    recall: f64,
    estimate_recall: f64,
    mass: f64,
    max_abs_err: f32,
    sparse_rows: u64,
}

#[derive(Serialize)]
struct AttnReport {
    schema: &'static str,
    model: String,
    text: String,
    threads: i32,
    keep: f32,
    min_keys: usize,
    sink: usize,
    recent: usize,
    reps: usize,
    estimate: String,
    note: &'static str,
    results: Vec<AttnCtxResult>,
}

/// Settings of `leap attn-bench`.
pub struct AttnBench {
    pub model: String,
    pub ctx: Vec<usize>,
    pub text: PathBuf,
    pub out: PathBuf,
    pub threads: i32,
    pub keep: f32,
    pub reps: usize,
    pub estimate: attn::EstimateOn,
}

/// Capture the attention nodes of one decode step at each context length (the text as
/// context), then time ggml's CPU flash attention and Leap's sparse attention on them.
pub fn attn_bench(a: &AttnBench) -> Result<()> {
    ensure!(!a.ctx.is_empty(), "--ctx needs at least one length");
    ensure!(a.reps > 0, "--reps must be at least 1");
    let path = models::resolve(&a.model)?;
    let cfg = Sparse {
        estimate_on: a.estimate,
        ..with_sidecar(sparse_config(a.keep)?, &path)?
    };
    if a.estimate == attn::EstimateOn::OpenCl && !leap_backend::opencl_available() {
        bail!(
            "--estimate opencl: {}",
            leap_backend::opencl_unavailable_reason()
        );
    }
    leap_backend::register();
    // Dense on the device: the capture takes every node.
    let device = Device::new(DeviceConfig::default());
    let model = Model::load(&path, &ModelParams::default())?;
    let max_ctx = *a.ctx.iter().max().unwrap();
    let toks = tokens_of(&model, &a.text, max_ctx)?;
    let threads = a.threads.max(1) as usize;
    let mut results = Vec::new();
    let bar = progress::bar(
        true,
        a.ctx.len() as u64,
        "{msg} [{bar:30}] {pos}/{len} contexts",
    );
    for &n in &a.ctx {
        ensure!(n >= 2, "context lengths must be at least 2");
        bar.set_message(format!("ctx {n}"));
        let mut ctx = fa_context(&model, &device, (n + 16) as u32, 512, a.threads)?;
        decode_run(&mut ctx, &toks[..n - 1], 0, 512, |_| false, |_, _| Ok(()))?;
        // The next token's graph is built now (a one-row graph differs from prefill's), so
        // the capture sees every layer's attention at this context length.
        device.start_capture();
        let r = decode_run(
            &mut ctx,
            &toks[n - 1..n],
            n - 1,
            1,
            |_| false,
            |_, _| Ok(()),
        );
        let nodes = device.take_capture();
        r?;
        ensure!(
            !nodes.is_empty(),
            "no flash-attention node reached Leap's device (does this model use flash attention?)"
        );
        let per: Vec<NodeResult> = nodes
            .iter()
            .map(|c| attn_bench::measure(c, &cfg, threads, a.reps))
            .collect();
        results.push(summarise(n, &per));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let report = AttnReport {
        schema: "leap-attn-bench/1",
        model: path.display().to_string(),
        text: a.text.display().to_string(),
        threads: a.threads,
        keep: cfg.keep,
        min_keys: cfg.min_keys,
        sink: cfg.sink,
        recent: cfg.recent,
        reps: a.reps,
        estimate: format!("{:?}", a.estimate).to_lowercase(),
        note: "one decode step's attention nodes (all layers) at each context length; \
               dense = ggml's CPU flash attention, sparse = Leap's device (ggml's time for \
               caches of fewer than min_keys cells; sliding-window layers, whose caches \
               llama.cpp names like full ones, are Leap's, dense over their window); the int8 \
               K shadow is kept up to date by the cache writes while decoding and is not timed",
        results,
    };
    for r in &report.results {
        eprintln!(
            "ctx {:>5}: dense {:7.3} ms  sparse {:7.3} ms  speedup {:5.2}x (sparse nodes {:5.2}x)  recall {:.4} (int8 alone {:.4})  mass {:.3}  max|err| {:.4}  kept {:.3}  ({} of {} nodes on the device)",
            r.ctx, r.dense_ms, r.sparse_ms, r.speedup, r.speedup_sparse_nodes, r.recall,
            r.estimate_recall, r.mass, r.max_abs_err, r.kept_fraction, r.nodes_taken, r.nodes
        );
    }
    write_json(&a.out, &report)
}

fn summarise(n: usize, per: &[NodeResult]) -> AttnCtxResult {
    let dense: f64 = per.iter().map(|r| r.dense_ms).sum();
    let sparse: f64 = per.iter().map(|r| r.sparse_ms).sum();
    let taken: Vec<&NodeResult> = per.iter().filter(|r| r.taken).collect();
    // Quality averaged over the sparsely attended (row, head) pairs.
    let pairs: u64 = per.iter().map(|r| r.sparse_rows).sum();
    let mean = |f: &dyn Fn(&NodeResult) -> f64| {
        if pairs == 0 {
            1.0
        } else {
            per.iter().map(|r| f(r) * r.sparse_rows as f64).sum::<f64>() / pairs as f64
        }
    };
    let (vis, kept): (u64, u64) = taken
        .iter()
        .fold((0, 0), |(v, k), r| (v + r.visible, k + r.kept));
    let sp: Vec<&NodeResult> = per.iter().filter(|r| r.sparse_rows > 0).collect();
    let (d_sp, s_sp) = (
        sp.iter().map(|r| r.dense_ms).sum::<f64>(),
        sp.iter().map(|r| r.sparse_ms).sum::<f64>(),
    );
    AttnCtxResult {
        dense_ms_sparse_nodes: d_sp,
        sparse_ms_sparse_nodes: s_sp,
        speedup_sparse_nodes: if s_sp > 0.0 { d_sp / s_sp } else { 0.0 },
        ctx: n,
        dense_ms: dense,
        sparse_ms: sparse,
        speedup: if sparse > 0.0 { dense / sparse } else { 0.0 },
        recall: mean(&|r| r.recall),
        estimate_recall: mean(&|r| r.estimate_recall),
        mass: mean(&|r| r.mass),
        max_abs_err: per.iter().map(|r| r.max_abs_err).fold(0.0, f32::max),
        leap_dense_ms: taken.iter().map(|r| r.leap_dense_ms).sum(),
        kept_fraction: if vis > 0 {
            kept as f64 / vis as f64
        } else {
            1.0
        },
        nodes: per.len(),
        nodes_taken: taken.len(),
        layers: per
            .iter()
            .map(|r| LayerResult {
                layer: r.layer,
                swa: r.swa,
                taken: r.taken,
                n_kv: r.n_kv,
                dense_ms: r.dense_ms,
                leap_dense_ms: r.leap_dense_ms,
                sparse_ms: r.sparse_ms,
                recall: r.recall,
                estimate_recall: r.estimate_recall,
                mass: r.mass,
                max_abs_err: r.max_abs_err,
                sparse_rows: r.sparse_rows,
            })
            .collect(),
    }
}

/// [`crate::write_json`], saying where a file went.
fn write_json(out: &Path, v: &impl Serialize) -> Result<()> {
    crate::write_json(out, v)?;
    if out.as_os_str() != "-" {
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// Settings of `leap perplexity`.
pub struct Perplexity {
    pub model: String,
    pub file: PathBuf,
    pub ctx: usize,
    pub sparse: bool,
    pub keep: f32,
    pub chunks: Option<usize>,
    pub out: Option<PathBuf>,
    pub threads: i32,
}

#[derive(Serialize)]
struct PplReport {
    ppl: f64,
    tokens: usize,
    sparse: bool,
    schema: &'static str,
    model: String,
    file: String,
    ctx: usize,
    chunks: usize,
    keep: Option<f32>,
    /// Whether per-head budgets came from the model's sidecar.
    sidecar: bool,
    /// Keys kept / visible over the attention the device computed (sparse only).
    kept_fraction: Option<f64>,
    seconds: f64,
    note: &'static str,
}

/// Perplexity of `file` in windows of `ctx` tokens, scoring the second half of each window
/// (the first half is its context), with ggml's flash attention or Leap's sparse attention.
pub fn perplexity(a: &Perplexity) -> Result<f64> {
    ensure!(a.ctx >= 16, "--ctx must be at least 16");
    let path = models::resolve(&a.model)?;
    leap_backend::register();
    // Every row as decoding computes it, also in the batches this runs in.
    let sparse = if a.sparse {
        Some(with_sidecar(
            Sparse {
                max_rows: usize::MAX,
                ..sparse_config(a.keep)?
            },
            &path,
        )?)
    } else {
        None
    };
    let sidecar = sparse.as_ref().is_some_and(|s| s.heads.is_some());
    let device = Device::new(DeviceConfig {
        sparse,
        ..DeviceConfig::default()
    });
    let model = Model::load(&path, &ModelParams::default())?;
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let toks = model.tokenize(&text, true, false)?;
    let available = toks.len() / a.ctx;
    ensure!(
        available > 0,
        "{} has {} tokens, fewer than one window of --ctx {}",
        a.file.display(),
        toks.len(),
        a.ctx
    );
    let chunks = a.chunks.map_or(available, |c| c.min(available)).max(1);
    let start = Instant::now();
    let half = a.ctx / 2;
    let n_batch = 128usize;
    let mut ctx = fa_context(&model, &device, a.ctx as u32, 512, a.threads)?;
    let (mut nll, mut count) = (0f64, 0usize);
    let bar = progress::bar(
        true,
        chunks as u64,
        "perplexity [{bar:30}] {pos}/{len} windows {msg}",
    );
    for c in 0..chunks {
        let w = &toks[c * a.ctx..(c + 1) * a.ctx];
        ctx.clear(true);
        // The first half is context only; logits from its last row on (each row predicts
        // the next token).
        let score = |pos: usize| pos + 1 >= half && pos + 1 < a.ctx;
        decode_run(&mut ctx, w, 0, n_batch, score, |pos, logits| {
            nll += next_token_nll(logits, w[pos + 1]);
            count += 1;
            Ok(())
        })?;
        bar.set_message(format!("ppl {:.3}", (nll / count as f64).exp()));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let ppl = (nll / count as f64).exp();
    let st = device.attn_stats();
    let (vis, kept) = (st.keys_visible, st.keys_kept);
    let report = PplReport {
        ppl,
        tokens: count,
        sparse: a.sparse,
        schema: "leap-perplexity/1",
        model: path.display().to_string(),
        file: a.file.display().to_string(),
        ctx: a.ctx,
        chunks,
        keep: a.sparse.then_some(a.keep),
        sidecar,
        kept_fraction: (a.sparse && vis > 0).then(|| kept as f64 / vis as f64),
        seconds: start.elapsed().as_secs_f64(),
        note: "windows of ctx tokens, each scored on its second half; flash attention on \
               (ggml's when sparse is off)",
    };
    eprintln!(
        "perplexity {:.4} over {} tokens ({} windows of {}, sparse {})",
        ppl,
        count,
        chunks,
        a.ctx,
        if a.sparse { "on" } else { "off" }
    );
    if let Some(out) = &a.out {
        write_json(out, &report)?;
    }
    Ok(ppl)
}

/// Sidecar keys of the sparse-attention profile.
pub mod keys {
    /// Per head keep fractions, `[layer][head]` flattened.
    pub const KEEP: &str = "leap.attn.keep";
    /// Per head loss increase when the head is removed (004 Eq. 1).
    pub const HEAD_IMPORTANCE: &str = "leap.attn.head_importance";
    /// Per layer loss increase when its attention is removed (004 Eq. 2).
    pub const LAYER_IMPORTANCE: &str = "leap.attn.layer_importance";
    pub const N_LAYER: &str = "leap.attn.n_layer";
    pub const N_HEAD: &str = "leap.attn.n_head";
    /// The global keep fraction the per-head ones average to.
    pub const GLOBAL_KEEP: &str = "leap.attn.global_keep";
    pub const CORPUS: &str = "leap.attn.corpus";
    pub const TOKENS: &str = "leap.attn.tokens";
}

/// `--sparse` of the runtime options: `off`, `on` (the default fraction) or a fraction.
pub fn parse_sparse(v: &str) -> Result<Option<Sparse>> {
    match v.trim() {
        "off" | "0" => Ok(None),
        "on" => Ok(Some(Sparse::default())),
        x => {
            let keep: f32 = x.parse().map_err(|_| {
                anyhow::anyhow!("--sparse must be off, on or a fraction in (0, 1], not {x:?}")
            })?;
            Ok(Some(sparse_config(keep)?))
        }
    }
}

/// Per-head budgets from the model's sidecar (`MODEL.leap.gguf`), if it has a profile for
/// this model's shape; scaled so that they average to `s.keep`.
pub fn with_sidecar(s: Sparse, model: &Path) -> Result<Sparse> {
    with_sidecar_at(s, &leap_host::sidecar::path_for(model))
}

/// [`with_sidecar`] from the sidecar at `path` (unchanged settings if there is none, or it
/// has no attention profile).
pub fn with_sidecar_at(mut s: Sparse, path: &Path) -> Result<Sparse> {
    let Some(side) = leap_host::sidecar::Sidecar::load(path)? else {
        return Ok(s);
    };
    let (Some(keep), Some(nl), Some(nh)) = (
        side.f32s(keys::KEEP),
        side.u32(keys::N_LAYER),
        side.u32(keys::N_HEAD),
    ) else {
        return Ok(s);
    };
    let (nl, nh) = (nl as usize, nh as usize);
    ensure!(nh > 0, "{}: {} is 0", path.display(), keys::N_HEAD);
    ensure!(
        keep.len() == nl * nh,
        "{}: {} has {} values, not {nl} layers x {nh} heads",
        path.display(),
        keys::KEEP,
        keep.len()
    );
    let global = match side.get(keys::GLOBAL_KEEP) {
        Some(leap_host::sidecar::Value::F32(g)) if *g > 0.0 => *g,
        _ => s.keep,
    };
    let scale = s.keep / global;
    s.heads = Some(Arc::new(attn::HeadProfile {
        layers: keep
            .chunks(nh)
            .map(|l| l.iter().map(|k| (k * scale).clamp(0.0, 1.0)).collect())
            .collect(),
    }));
    log::info!("per-head sparse-attention budgets from {}", path.display());
    Ok(s)
}

/// Eq. 3 of 004: per head keep fractions proportional to clamp(headImp · layerImp), averaging
/// `r` over the heads, each within [r/4, 1] (what a head cannot take is shared by the others).
pub fn head_budgets(head_imp: &[f64], layer_imp: &[f64], n_head: usize, r: f32) -> Vec<f32> {
    let n = head_imp.len();
    let mut w: Vec<f64> = head_imp
        .iter()
        .enumerate()
        .map(|(i, &h)| h.max(0.0) * layer_imp[i / n_head].max(0.0))
        .collect();
    // Clamp the extreme points (004: "clamping extremely large points") at the 90th
    // percentile, and give every head a floor.
    let mut sorted = w.clone();
    sorted.sort_by(f64::total_cmp);
    let hi = sorted[(n * 9 / 10).min(n - 1)];
    let mean = sorted.iter().sum::<f64>() / n as f64;
    let floor = (mean * 1e-2).max(1e-12);
    for x in w.iter_mut() {
        *x = x.clamp(floor, hi.max(floor));
    }
    let (lo_k, hi_k) = ((r / 4.0) as f64, 1.0f64);
    let target = r as f64 * n as f64;
    let mut keep = vec![0f64; n];
    let mut fixed = vec![false; n];
    // Water-filling: scale the free heads to the remaining budget; pin those out of bounds.
    for _ in 0..n + 1 {
        let pinned: f64 = (0..n).filter(|&i| fixed[i]).map(|i| keep[i]).sum();
        let free_w: f64 = (0..n).filter(|&i| !fixed[i]).map(|i| w[i]).sum();
        if free_w <= 0.0 {
            break;
        }
        let scale = (target - pinned).max(0.0) / free_w;
        let mut changed = false;
        for i in 0..n {
            if fixed[i] {
                continue;
            }
            keep[i] = w[i] * scale;
            if keep[i] > hi_k || keep[i] < lo_k {
                keep[i] = keep[i].clamp(lo_k, hi_k);
                fixed[i] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    keep.into_iter().map(|k| k as f32).collect()
}

/// Settings of `leap profile-heads`.
pub struct ProfileHeads {
    pub model: String,
    pub corpus: PathBuf,
    pub ctx: usize,
    pub tail: usize,
    pub windows: usize,
    pub keep: f32,
    pub out: Option<PathBuf>,
    pub threads: i32,
}

/// Measure each head's and each layer's importance on a calibration text (the loss increase
/// when its attention output is zeroed, on the last `tail` tokens of windows of `ctx`), turn
/// them into per-head budgets (004 Eq. 1-3) and write them into the model's sidecar.
pub fn profile_heads(a: &ProfileHeads) -> Result<PathBuf> {
    ensure!(
        a.tail >= 2 && a.tail < a.ctx,
        "--tail must be in [2, --ctx)"
    );
    ensure!(a.windows >= 1, "--windows must be at least 1");
    let keep = sparse_config(a.keep)?.keep;
    let path = models::resolve(&a.model)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| leap_host::sidecar::path_for(&path));
    leap_backend::register();
    // Dense, every attention node on the device (the ablation reaches every layer).
    let device = Device::new(DeviceConfig {
        take_all: true,
        ..DeviceConfig::default()
    });
    let model = Model::load(&path, &ModelParams::default())?;
    let (nl, nh) = (model.n_layer() as usize, model.n_head() as usize);
    let toks = tokens_of(&model, &a.corpus, a.ctx * a.windows)?;
    let mut ctx = fa_context(&model, &device, a.ctx as u32, 512, a.threads)?;
    let prefix = a.ctx - a.tail;
    let passes = (1 + nl + nl * nh) * a.windows;
    let bar = progress::bar(
        true,
        passes as u64,
        "profile-heads [{bar:30}] {pos}/{len} passes {msg}",
    );
    let (mut head_imp, mut layer_imp) = (vec![0f64; nl * nh], vec![0f64; nl]);
    for w in 0..a.windows {
        let win = &toks[w * a.ctx..(w + 1) * a.ctx];
        ctx.clear(true);
        decode_run(&mut ctx, &win[..prefix], 0, 512, |_| false, |_, _| Ok(()))?;
        // Loss over the tail (each row predicts the next token), with `ab` zeroed.
        let mut loss = |ab: Option<attn::Ablation>| -> Result<f64> {
            device.ablate(ab);
            ctx.seq_rm(0, prefix as i32, -1);
            let (mut nll, mut n) = (0f64, 0usize);
            let tail = &win[prefix..];
            decode_run(
                &mut ctx,
                tail,
                prefix,
                a.tail,
                |p| p + 1 < a.ctx,
                |pos, logits| {
                    nll += next_token_nll(logits, win[pos + 1]);
                    n += 1;
                    Ok(())
                },
            )?;
            device.ablate(None);
            bar.inc(1);
            Ok(nll / n as f64)
        };
        let base = loss(None)?;
        bar.set_message(format!("base loss {base:.3}"));
        for il in 0..nl {
            layer_imp[il] += loss(Some(attn::Ablation {
                layer: il,
                head: None,
            }))? - base;
            for h in 0..nh {
                head_imp[il * nh + h] += loss(Some(attn::Ablation {
                    layer: il,
                    head: Some(h),
                }))? - base;
            }
        }
    }
    bar.finish_and_clear();
    for x in head_imp.iter_mut().chain(layer_imp.iter_mut()) {
        *x /= a.windows as f64;
    }
    let budgets = head_budgets(&head_imp, &layer_imp, nh, keep);
    let mut side = leap_host::sidecar::Sidecar::load(&out)?.unwrap_or_default();
    use leap_host::sidecar::Value;
    side.set(keys::KEEP, Value::F32s(budgets.clone()));
    side.set(
        keys::HEAD_IMPORTANCE,
        Value::F32s(head_imp.iter().map(|&x| x as f32).collect()),
    );
    side.set(
        keys::LAYER_IMPORTANCE,
        Value::F32s(layer_imp.iter().map(|&x| x as f32).collect()),
    );
    side.set(keys::N_LAYER, Value::U32(nl as u32));
    side.set(keys::N_HEAD, Value::U32(nh as u32));
    side.set(keys::GLOBAL_KEEP, Value::F32(keep));
    side.set(
        keys::CORPUS,
        Value::Str(
            a.corpus
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
    );
    side.set(keys::TOKENS, Value::U32((a.tail * a.windows) as u32));
    side.save(&out)?;
    let (lo, hi) = budgets
        .iter()
        .fold((f32::MAX, f32::MIN), |(l, h), &k| (l.min(k), h.max(k)));
    eprintln!(
        "wrote {}: {nl} layers x {nh} heads, keep {lo:.3}..{hi:.3} (mean {:.3})",
        out.display(),
        budgets.iter().sum::<f32>() / budgets.len() as f32
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by `make fuzz` (target `sidecar`): a profile of 0 heads and no values passed the
    /// size check and split its values into chunks of 0 (a panic).
    #[test]
    fn a_profile_without_heads_is_refused() {
        use leap_host::sidecar::{Sidecar, Value};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.leap.gguf");
        let mut side = Sidecar::default();
        side.set(keys::KEEP, Value::F32s(Vec::new()));
        side.set(keys::N_LAYER, Value::U32(18));
        side.set(keys::N_HEAD, Value::U32(0));
        side.save(&path).unwrap();
        let e = with_sidecar_at(sparse_config(0.5).unwrap(), &path).unwrap_err();
        assert!(e.to_string().contains("n_head is 0"), "{e}");
        side.set(keys::KEEP, Value::F32s(vec![0.5; 4]));
        side.set(keys::N_LAYER, Value::U32(2));
        side.set(keys::N_HEAD, Value::U32(2));
        side.save(&path).unwrap();
        let s = with_sidecar_at(sparse_config(0.5).unwrap(), &path).unwrap();
        assert_eq!(s.heads.unwrap().layers, vec![vec![0.5; 2]; 2]);
    }

    #[test]
    fn head_budgets_follow_importance_and_average_the_global_keep() {
        // 3 layers x 4 heads; layer 1 matters most, head 2 of each layer most.
        let layer = [0.5, 2.0, 0.1];
        let head: Vec<f64> = (0..12)
            .map(|i| match i % 4 {
                2 => 0.3,
                3 => -0.05, // removing it helped: the floor
                x => 0.05 * (x + 1) as f64,
            })
            .collect();
        let r = 0.2;
        let k = head_budgets(&head, &layer, 4, r);
        let mean = k.iter().sum::<f32>() / k.len() as f32;
        assert!((mean - r).abs() < 1e-4, "mean {mean}");
        assert!(
            k.iter().all(|&x| (r / 4.0 - 1e-6..=1.0).contains(&x)),
            "{k:?}"
        );
        for l in 0..3 {
            assert!(k[l * 4 + 2] >= k[l * 4 + 1] && k[l * 4 + 1] >= k[l * 4]);
            assert!((k[l * 4 + 3] - r / 4.0).abs() < 1e-6, "floor: {k:?}");
        }
        assert!(k[4 + 2] >= k[2] && k[2] >= k[8 + 2], "layer order: {k:?}");
        // Uniform importance: every head gets the global keep.
        let u = head_budgets(&[1.0; 8], &[1.0, 1.0], 4, r);
        assert!(u.iter().all(|&x| (x - r).abs() < 1e-6), "{u:?}");
    }

    #[test]
    fn sparse_flag_parses() {
        assert!(parse_sparse("off").unwrap().is_none());
        assert_eq!(parse_sparse("on").unwrap().unwrap().keep, 0.2);
        assert_eq!(parse_sparse("0.3").unwrap().unwrap().keep, 0.3);
        assert!(parse_sparse("1.5").is_err());
        assert!(parse_sparse("lots").is_err());
    }
}

//! `leap bench`: the benchmark contract of `../shared/BENCH.md`.
//!
//! Every mode gets its own llama.cpp context on the one shared model (so a drafter's state
//! lives across requests, as in llama-server), and the modes run interleaved per request:
//! request 1 in every mode, then request 2, so machine drift hits every mode alike.
//!
//! | module | owns |
//! |---|---|
//! | this one | [`BenchConfig`] and [`run`]: the requests run in every mode, the report filled |
//! | `assemble` | the modes set up: what they share, each mode's runner, context, device and flash streamer |
//! | `modes` | mode names: [`ModeKind`], Leap's named configurations ([`LEAP_CONFIGS`], [`leap_config`]) |
//! | `runner` | one request generated in one mode |
//! | `summary` | the tables for people ([`table`], [`anchor_table`]) and a flash-budget [`sweep`] |
//! | [`workload`] | the workload file |
//! | [`report`] | the `leap-bench/1` JSON report |
//! | [`stock`] | `server:*` modes: a stock llama-server in its own process |
//! | [`oracle`] | `leap:oracle`'s drafter |
//! | [`chart`] | the sweep's bar chart (PNG) |

pub mod chart;
pub mod oracle;
pub mod report;
pub mod stock;
pub mod workload;

mod assemble;
mod modes;
mod runner;
mod summary;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use leap_host::sampler::SamplingParams;
use leap_host::usage::peak_rss_bytes;
use leap_host::FlashAttn;
pub use modes::{leap_config, ModeKind, LEAP_CONFIGS};
pub use report::Report;
use report::{ModeReport, RequestReport};
use runner::Runner;
pub use summary::{anchor_table, sweep, sweep_path, table};

/// What `leap bench` was asked to do.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub model: PathBuf,
    pub draft: Option<PathBuf>,
    pub workload: PathBuf,
    pub limit: Option<usize>,
    pub tasks: Vec<String>,
    pub modes: Vec<String>,
    pub threads: i32,
    /// The model's sidecar, for `leap`'s early-exit head (`None`: next to the model).
    pub sidecar: Option<PathBuf>,
    /// The early-exit head's path-score threshold (`None`: the default).
    pub exit_threshold: Option<f32>,
    pub ctx: u32,
    pub flash_attn: FlashAttn,
    pub flash_budget: Option<f64>,
    /// What stays resident under the flash budget.
    pub flash_strategy: leap_flash::Strategy,
    pub sampling: SamplingParams,
    pub progress: bool,
    /// Leap's modes use Leap's ggml device for small-batch matrix products (registered by
    /// the caller before `run`); `plain` and `llama:*` never do.
    pub kernels: bool,
    /// The stock llama-server of the `server:*` modes (`None`: found as
    /// [`stock::find_server`] says).
    pub server_bin: Option<PathBuf>,
    /// Skip the first N requests (after `--task` filtering), before `--limit`: the dev
    /// workload's second half is `--skip 171`.
    pub skip: usize,
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn file_name(p: &std::path::Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Run the benchmark and return the report (the caller writes it).
///
/// # Errors
/// Bad arguments, models that do not load, decode failures.
pub fn run(cfg: &BenchConfig) -> Result<Report> {
    anyhow::ensure!(cfg.threads >= 1, "--threads {}: at least 1", cfg.threads);
    anyhow::ensure!(cfg.ctx >= 16, "--ctx {}: at least 16 tokens", cfg.ctx);
    if let Some(f) = cfg.flash_budget {
        anyhow::ensure!(
            (0.0..=1.0).contains(&f),
            "--flash-budget {f}: a fraction of the weights, 0.0 to 1.0"
        );
    }
    let kinds = modes::parse_all(cfg)?;
    let requests = workload::load(&cfg.workload, &cfg.tasks, cfg.skip, cfg.limit)?;
    if requests.is_empty() {
        bail!(
            "{}: no requests (after --task/--skip/--limit)",
            cfg.workload.display()
        );
    }
    let shared = assemble::Shared::open(cfg, &kinds)?;
    let mut modes = assemble::modes(cfg, &kinds, &shared)?;
    let mut report = Report {
        schema: report::SCHEMA.into(),
        model: file_name(&cfg.model),
        draft: cfg.draft.as_deref().map(file_name),
        threads: cfg.threads,
        ctx: cfg.ctx,
        cpu: cpu_name(),
        workload: file_name(&cfg.workload),
        n_requests: 0,
        n_skipped: 0,
        flash_budget: cfg.flash_budget,
        flash_attn: cfg.flash_attn.as_str().into(),
        temp: cfg.sampling.temp,
        modes: BTreeMap::new(),
    };
    let mut tallies: Vec<Tally> = modes.iter().map(|_| Tally::default()).collect();
    let prompts = requests
        .iter()
        .map(|r| Ok(shared.model.tokenize(&r.prompt, true, false)?))
        .collect::<Result<Vec<_>>>()?;
    let fits = fitting(cfg, &requests, &prompts)?;
    let bar = crate::progress::bar(
        cfg.progress,
        (requests.len() * modes.len()) as u64,
        "bench [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
    );
    for ((req, prompt), fits) in requests.iter().zip(&prompts).zip(fits) {
        if !fits {
            report.n_skipped += 1;
            bar.inc(modes.len() as u64);
            continue;
        }
        report.n_requests += 1;
        for (i, tally) in tallies.iter_mut().enumerate() {
            bar.set_message(format!("{} {}", req.id, cfg.modes[i]));
            run_one(cfg, &shared, &mut modes, i, req, prompt, tally)?;
            bar.inc(1);
        }
        // Without a terminal for the bar, a line per request (CI logs).
        if cfg.progress && bar.is_hidden() {
            eprintln!(
                "bench: {} done ({}/{})",
                req.id,
                report.n_requests + report.n_skipped,
                requests.len()
            );
        }
    }
    bar.finish_and_clear();
    finish(cfg, &kinds, shared.flash.is_some(), tallies, &mut report);
    Ok(report)
}

/// Which requests fit the context (prompt and `max_tokens` together); an error if none does,
/// a warning for those that do not.
fn fitting(
    cfg: &BenchConfig,
    requests: &[workload::Request],
    prompts: &[Vec<leap_host::Token>],
) -> Result<Vec<bool>> {
    let fits: Vec<bool> = (requests.iter().zip(prompts))
        .map(|(r, p)| p.len() + r.max_tokens <= cfg.ctx as usize)
        .collect();
    let too_long = fits.iter().filter(|f| !**f).count();
    anyhow::ensure!(
        too_long < requests.len(),
        "none of the {} requests fits --ctx {} (prompt and max_tokens together): raise --ctx",
        requests.len(),
        cfg.ctx
    );
    if too_long > 0 {
        eprintln!(
            "bench: warning: {too_long} of {} requests do not fit --ctx {} and are skipped",
            requests.len(),
            cfg.ctx
        );
    }
    Ok(fits)
}

/// What one mode measured over the requests.
#[derive(Default)]
struct Tally {
    report: ModeReport,
    cpu: f64,
    rss: u64,
    /// Under flash: bytes read from storage during decoding, the peak resident, seconds
    /// blocked on reads.
    read: u64,
    peak: u64,
    blocked: f64,
}

/// Request `req` (tokens `prompt`) in mode `i`, into its tally.
fn run_one(
    cfg: &BenchConfig,
    shared: &assemble::Shared,
    modes: &mut [assemble::Mode],
    i: usize,
    req: &workload::Request,
    prompt: &[leap_host::Token],
    t: &mut Tally,
) -> Result<()> {
    // Under flash each mode's plan runs alone: the others' pins are let go, its own
    // restored (plans differ: `leap` budgets its resident vocabulary out of its own).
    if let Some(st) = modes[i].streamer() {
        for (j, other) in modes.iter().enumerate() {
            if let (true, Some(o)) = (j != i, other.streamer()) {
                o.suspend();
            }
        }
        st.resume()?;
    }
    let mode = &mut modes[i];
    let g = mode
        .runner
        .run(prompt, req.max_tokens, cfg)
        .with_context(|| format!("request {} in mode {}", req.id, cfg.modes[i]))?;
    if cfg.modes[i] == "plain" {
        shared.answer.set(&g.tokens);
    }
    t.cpu += g.decode_cpu_seconds;
    t.rss = t.rss.max(match &mode.runner {
        Runner::Server(s) => s.peak_rss_bytes(),
        _ => peak_rss_bytes(),
    });
    if let Some(st) = mode.streamer() {
        // The decode's calls are the last `target_calls` (prefill came first).
        st.flush();
        let calls = st.calls();
        let n = (g.target_calls as usize).min(calls.len());
        let decode = &calls[calls.len() - n..];
        t.read += decode.iter().map(|c| c.read_bytes).sum::<u64>();
        t.blocked += decode.iter().map(|c| c.blocked_seconds).sum::<f64>();
        // Calls that ran llama.cpp's projection node had the output resident whole:
        // where Leap's chunked projection ran the others (Leap's modes, flash-AR),
        // those are its one-off checks against llama.cpp's logits.
        let chunked = decode.iter().any(|c| !c.llama_output);
        t.peak = t.peak.max(
            decode
                .iter()
                .filter(|c| !(chunked && c.llama_output))
                .map(|c| c.peak_streamed_resident + st.plan().pinned_bytes + mode.reserved)
                .max()
                .unwrap_or(0),
        );
    }
    t.report.requests.push(RequestReport {
        id: req.id.clone(),
        task: req.task.clone(),
        prompt_tokens: prompt.len(),
        generated_tokens: g.tokens.len(),
        decode_seconds: g.decode_seconds,
        prefill_seconds: g.prefill_seconds,
        target_calls: g.target_calls,
        drafted_tokens: g.drafted_tokens,
        draft_seconds: g.draft_seconds,
        calib_seconds: g.calib_seconds,
        verify_seconds: g.verify_seconds,
        project_seconds: g.project_seconds,
        verify_rows: g.verify_rows,
        rows_after_exit: g.rows_after_exit,
        output_rows: g.output_rows,
        exit_accepted: g.exit_accepted,
        exit_accepted_kept: g.exit_accepted_kept,
        exit_seconds: g.exit_seconds,
        output_sha256: report::tokens_sha256(&g.tokens),
    });
    Ok(())
}

/// Each mode's totals into the report, with its outputs compared to plain's (greedy).
fn finish(
    cfg: &BenchConfig,
    kinds: &[ModeKind],
    flash: bool,
    tallies: Vec<Tally>,
    report: &mut Report,
) {
    // Outputs are compared through their hashes (the report's own `output_sha256`).
    let plain_outputs: Option<Vec<String>> = kinds
        .iter()
        .position(|k| *k == ModeKind::Plain)
        .filter(|_| cfg.sampling.is_greedy())
        .map(|p| {
            tallies[p]
                .report
                .requests
                .iter()
                .map(|r| r.output_sha256.clone())
                .collect()
        });
    for (i, t) in tallies.into_iter().enumerate() {
        let mut m = t.report;
        m.total();
        m.cpu_seconds = t.cpu;
        m.peak_rss_bytes = t.rss;
        m.storage_read_bytes = flash.then_some(t.read);
        m.flash_peak_resident_bytes = flash.then_some(t.peak);
        m.flash_blocked_seconds = flash.then_some(t.blocked);
        if let Some(plain) = &plain_outputs {
            m.differing_requests = m
                .requests
                .iter()
                .zip(plain)
                .filter(|(r, p)| r.output_sha256 != **p)
                .map(|(r, _)| r.id.clone())
                .collect();
            m.identical_to_plain = Some(m.differing_requests.is_empty());
        }
        report.modes.insert(cfg.modes[i].clone(), m);
    }
}

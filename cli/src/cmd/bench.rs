//! `leap bench`: its command line, and the reports and tables it writes (the benchmark
//! itself is [`leap_cli::bench`]).

use std::path::PathBuf;

use anyhow::{bail, ensure, Result};
use clap::Args;
use leap_cli::{bench, models};

use super::options::{RuntimeArgs, SamplingArgs};

#[derive(Args)]
pub struct BenchArgs {
    /// Target model: a name (`leap models`) or a GGUF path.
    #[arg(long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// Draft model for llama:draft-simple (same vocabulary as the target) and leap:draft (any
    /// vocabulary): a name or a GGUF path.
    #[arg(long)]
    draft: Option<String>,
    /// Workload, JSON Lines of {id, task, prompt, max_tokens}.
    #[arg(long)]
    workload: PathBuf,
    /// The early-exit head's pruning threshold: a tree node goes past the exit layer when
    /// the head's scores along its path multiply to at least this (default 0.1).
    #[arg(long)]
    exit_threshold: Option<f32>,
    /// Take the first N requests (after --task filtering and --skip).
    #[arg(long)]
    limit: Option<usize>,
    /// Skip the first N requests (after --task filtering): tune on one part of a workload,
    /// report another (the dev workload's second half is --skip 171).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Only these tasks (comma separated), e.g. summary,rag,code.
    #[arg(long, value_delimiter = ',')]
    task: Vec<String>,
    /// Modes, comma separated: plain, llama:TYPE (ngram-simple, ngram-map-k, ngram-map-k4v,
    /// ngram-mod, ngram-cache, draft-simple), server:TYPE (a stock llama-server in its own
    /// process, over loopback: none, or one of llama:'s types), leap, leap:NAME (sam,
    /// sam-fixed, history, reuse, calib, tree, eager, ondemand, exit-measure, ggml, draft,
    /// vocab, oracle, no-corpus; see docs/measurements.md).
    #[arg(long, value_delimiter = ',', default_value = "plain,llama:ngram-mod")]
    modes: Vec<String>,
    /// Flash streaming: the fraction of the target's weights kept in DRAM (0.25); the rest is
    /// read from storage by every target call, for every mode (`plain` becomes flash-AR).
    /// Several, comma separated (0,0.25,0.5,0.75,1), run the whole bench at each and add a
    /// summary table and a chart of decode tok/s per budget (Lever's Table 6).
    #[arg(long, value_delimiter = ',')]
    flash_budget: Vec<f64>,
    /// What stays resident under --flash-budget: `fill` (the first blocks, then as much of
    /// the output projection as fits; the least read per call), `first-layers` (Lever's:
    /// whole sections, first blocks first) or `output-first` (the output projection whole
    /// first, then blocks).
    #[arg(long, default_value = "fill", value_parser = ["fill", "first-layers", "output-first"])]
    flash_strategy: String,
    /// With several --flash-budget values: write the chart here (PNG; default: next to --out).
    #[arg(long)]
    chart: Option<PathBuf>,
    /// The stock llama-server of server:* modes (default: $LEAP_STOCK_BIN/llama-server, else
    /// what scripts/stock-llama built in ~/.cache/leap/stock-llama-11434/bin).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Write the JSON report here (`-` for stdout). With several --flash-budget values, one
    /// report per budget: OUT with `.flashB` before the extension.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    runtime: RuntimeArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.runtime.sparse != "off" {
        // Its anchors (plain, llama:*) run without Leap's device, on ggml's dense attention:
        // the comparison would mix two models.
        bail!(
            "leap bench does not measure --sparse yet; use leap attn-bench, leap perplexity or \
             leap generate --sparse"
        );
    }
    let kernels = a.runtime.setup().kernels;
    let cfg = bench::BenchConfig {
        kernels,
        model: models::resolve(&a.model)?,
        draft: a.draft.as_deref().map(models::resolve).transpose()?,
        workload: a.workload,
        limit: a.limit,
        skip: a.skip,
        server_bin: a.server_bin.clone(),
        tasks: a.task,
        modes: a.modes.clone(),
        threads: a.runtime.threads,
        sidecar: a.runtime.sidecar.clone(),
        exit_threshold: a.exit_threshold,
        ctx: a.runtime.ctx,
        flash_attn: a.runtime.flash_attn(),
        flash_budget: a.flash_budget.first().copied(),
        flash_strategy: match a.flash_strategy.as_str() {
            "first-layers" => leap_flash::Strategy::FirstLayers,
            "output-first" => leap_flash::Strategy::OutputFirst,
            _ => leap_flash::Strategy::Fill,
        },
        sampling: a.sampling.params(),
        progress: true,
    };
    if a.flash_budget.len() <= 1 {
        let report = bench::run(&cfg)?;
        leap_cli::write_json(&a.out, &report)?;
        eprintln!("{}", bench::table(&report, &a.modes));
        return Ok(());
    }
    ensure!(
        a.out.as_os_str() != "-",
        "several --flash-budget values write one report each: give --out a file name"
    );
    let mut reports = Vec::new();
    for &b in &a.flash_budget {
        eprintln!("bench: flash budget {b}");
        let report = bench::run(&bench::BenchConfig {
            flash_budget: Some(b),
            ..cfg.clone()
        })?;
        let out = bench::sweep_path(&a.out, b);
        leap_cli::write_json(&out, &report)?;
        eprintln!("{}", bench::table(&report, &a.modes));
        reports.push(report);
    }
    let chart = a
        .chart
        .clone()
        .unwrap_or_else(|| a.out.with_extension("png"));
    eprintln!("{}", bench::sweep(&reports, &a.modes, &chart)?);
    eprintln!("chart: {}", chart.display());
    Ok(())
}

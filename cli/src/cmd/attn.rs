//! Sparse attention measured and tuned, and handed to llama.cpp: `leap attn-bench`,
//! `leap perplexity`, `leap profile-heads` and `leap plugin-path` (the work is
//! [`leap_cli::attn`]'s).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use leap_cli::models;

use super::options::default_threads;

#[derive(Args)]
pub struct AttnBenchArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// Context lengths (tokens of the text before the measured step), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096")]
    ctx: Vec<usize>,
    /// The text the context is made of (repeated if it is too short).
    #[arg(long)]
    text: PathBuf,
    /// Fraction of visible keys each query attends exactly.
    #[arg(long, default_value_t = 0.2)]
    keep: f32,
    /// Timed repetitions per node (the median is reported).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Where the estimate runs: cpu or opencl.
    #[arg(long, default_value = "cpu")]
    estimate: leap_backend::attn::EstimateOn,
    /// Threads.
    #[arg(short, long, default_value_t = default_threads())]
    threads: i32,
    /// Write the JSON report here (`-` for stdout).
    #[arg(long)]
    out: PathBuf,
}

pub fn attn_bench(a: AttnBenchArgs) -> Result<()> {
    leap_cli::attn::attn_bench(&leap_cli::attn::AttnBench {
        model: a.model,
        ctx: a.ctx,
        text: a.text,
        out: a.out,
        threads: a.threads,
        keep: a.keep,
        reps: a.reps,
        estimate: a.estimate,
    })
}

#[derive(Args)]
pub struct PerplexityArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// The text to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens (each window's second half is scored).
    #[arg(long, default_value_t = 1024)]
    ctx: usize,
    /// Leap's sparse attention (`on`) or ggml's flash attention (`off`).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    sparse: String,
    /// With --sparse on: fraction of visible keys each query attends exactly.
    #[arg(long, default_value_t = 0.2)]
    keep: f32,
    /// Score at most this many windows.
    #[arg(long)]
    chunks: Option<usize>,
    /// Threads.
    #[arg(short, long, default_value_t = default_threads())]
    threads: i32,
    /// Write the JSON report here (`-` for stdout).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    leap_cli::attn::perplexity(&leap_cli::attn::Perplexity {
        model: a.model,
        file: a.file,
        ctx: a.ctx,
        sparse: a.sparse == "on",
        keep: a.keep,
        chunks: a.chunks,
        out: a.out,
        threads: a.threads,
    })
    .map(|_| ())
}

#[derive(Args)]
pub struct ProfileHeadsArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    model: String,
    /// Calibration text.
    #[arg(long)]
    corpus: PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = 1024)]
    ctx: usize,
    /// Tokens at the end of each window whose loss is measured.
    #[arg(long, default_value_t = 128)]
    tail: usize,
    /// Windows of the corpus to average over.
    #[arg(long, default_value_t = 1)]
    windows: usize,
    /// The global keep fraction the per-head budgets average to.
    #[arg(long, default_value_t = 0.2)]
    keep: f32,
    /// The sidecar to write (default: MODEL.leap.gguf next to the model; other keys in it are
    /// kept).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Threads.
    #[arg(short, long, default_value_t = default_threads())]
    threads: i32,
}

pub fn profile_heads(a: ProfileHeadsArgs) -> Result<()> {
    leap_cli::attn::profile_heads(&leap_cli::attn::ProfileHeads {
        model: a.model,
        corpus: a.corpus,
        ctx: a.ctx,
        tail: a.tail,
        windows: a.windows,
        keep: a.keep,
        out: a.out,
        threads: a.threads,
    })
    .map(|_| ())
}

pub fn plugin_path() -> Result<()> {
    writeln!(
        std::io::stdout().lock(),
        "{}",
        leap_cli::attn::plugin_path()?.display()
    )?;
    Ok(())
}

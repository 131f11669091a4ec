//! `leap corpus`: the model's own answers to a file of prompts, written into its sidecar
//! (the work is [`leap_cli::corpus`]'s).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use super::options::default_threads;

#[derive(Args)]
pub struct CorpusArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    model: String,
    /// The prompts: a `.jsonl` file of `{"prompt": ..., "max_tokens": ...}` (a `leap bench`
    /// workload; max_tokens optional), or a text file whose paragraphs (separated by blank
    /// lines) are the prompts. Take prompts like the ones the model's users send.
    #[arg(long)]
    prompts: PathBuf,
    /// Leave out the first N prompts (keep them for a benchmark: `leap bench --skip N`).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Answer at most N prompts.
    #[arg(long)]
    limit: Option<usize>,
    /// The longest answer, where a `.jsonl` line does not say.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// The sidecar to write (default: MODEL.leap.gguf next to the model; other keys in it are
    /// kept, an older corpus is replaced).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Threads.
    #[arg(short, long, default_value_t = default_threads())]
    threads: i32,
    /// Context length: a prompt that does not fit with its answer is left out, with a warning.
    #[arg(short, long, default_value_t = 4096)]
    ctx: u32,
}

pub fn corpus(a: CorpusArgs) -> Result<()> {
    let b = leap_cli::corpus::build_corpus(&leap_cli::corpus::BuildCorpus {
        model: a.model,
        prompts: a.prompts,
        skip: a.skip,
        limit: a.limit,
        max_tokens: a.max_tokens,
        out: a.out,
        threads: a.threads,
        ctx: a.ctx,
        progress: true,
    })?;
    eprintln!(
        "corpus: {} answers, {} tokens in {:.0} s{}",
        b.answers,
        b.tokens,
        b.seconds,
        if b.too_long > 0 {
            format!(" ({} prompts too long for --ctx, left out)", b.too_long)
        } else {
            String::new()
        }
    );
    writeln!(std::io::stdout().lock(), "{}", b.out.display())?;
    Ok(())
}

//! `leap`: fast language-model inference on phones and small machines, on llama.cpp.
//!
//! Exit codes: 0 success (also when stdout is closed early, e.g. `| head`), 1 error, 2 usage.
//!
//! This file is the command line's top ([`Cli`], [`Cmd`]), logging, the dispatch and the exit
//! codes; each subcommand's arguments and code are in [`cmd`].

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

mod cmd;

#[derive(Parser)]
#[command(name = "leap", version, about = "Fast language-model inference on phones and small machines, on llama.cpp", long_about = None)]
struct Cli {
    /// More logging (-v: info, -vv: llama.cpp's own log too). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, streaming it to stdout (speed on stderr).
    Generate(cmd::generate::GenerateArgs),
    /// Serve a model over llama-server's OpenAI-compatible HTTP API (completions, chat,
    /// streaming, tokenize, metrics), decoding with Leap's engine.
    Serve(cmd::serve::ServeArgs),
    /// Measure decoding modes against llama.cpp in one run (see docs/measurements.md).
    Bench(cmd::bench::BenchArgs),
    /// List the models Leap can fetch, or fetch them.
    Models(cmd::models::ModelsArgs),
    /// Measure what a target call of k rows costs here, relative to one row (the curve that
    /// decides how much speculation can pay).
    Profile(cmd::profile::ProfileArgs),
    /// Time ggml's flash attention against Leap's sparse attention on one decode step's
    /// attention nodes at several context lengths (recall and error included).
    AttnBench(cmd::attn::AttnBenchArgs),
    /// Perplexity of a text file, with ggml's attention or Leap's sparse attention.
    Perplexity(cmd::attn::PerplexityArgs),
    /// Profile how much each attention head matters on a calibration text and write per-head
    /// sparse-attention budgets into the model's sidecar (`MODEL.leap.gguf`).
    ProfileHeads(cmd::attn::ProfileHeadsArgs),
    /// Train an early-exit head (Lever §4.3) at a middle layer on a corpus and write it into
    /// the model's sidecar (`MODEL.leap.gguf`): `leap` then prunes tree rows there that the
    /// target will not accept, and runs the later layers for the others only. With `--ahead`,
    /// a head that guesses the token after next instead, for the target drafting for itself.
    TrainHeads(cmd::train_heads::TrainHeadsArgs),
    /// Answer a file of prompts greedily and write the answers into the model's sidecar
    /// (`MODEL.leap.gguf`): `leap` then drafts from how the model itself phrases things, where
    /// the request's own text has nothing to copy. Ship it next to the model.
    Corpus(cmd::corpus::CorpusArgs),
    /// Print the path of Leap's ggml plugin (`libggml_leap.so`): give it to an unmodified
    /// llama.cpp as `GGML_BACKEND_PATH` (with `LEAP_SPARSE=0.2` and `-fa on` for sparse
    /// attention).
    PluginPath,
    /// Run the QNN device's graphs on the QNN library present (x86: the HTP emulator fetched by
    /// scripts/fetch-qnn) against Leap's CPU reference; JSON report to --out.
    QnnSelftest(leap_cli::qnn::QnnSelftestArgs),
    /// Show a GGUF model's architecture, layers, vocabulary and sizes.
    Info(cmd::info::InfoArgs),
}

fn main() -> ExitCode {
    // Before anything that may run the build's instructions on a CPU that lacks them.
    if let Some(f) = leap_kernels::cpu::missing_baseline() {
        eprintln!(
            "leap: error: {}",
            leap_kernels::cpu::below_baseline_message(f)
        );
        return ExitCode::FAILURE;
    }
    let cli = Cli::parse_from(llama_names(std::env::args_os()));
    leap_flash::exit_on_sigbus(
        "leap: error: the model file could not be read through its mapping (SIGBUS): it was \
         truncated while in use, or the storage failed; run again once the file is whole\n",
    );
    let level = match cli.verbose {
        // llama.cpp's own complaints reach the user inside Leap's error line (`leap: error:
        // ... : <llama.cpp's last warning or error>`), so they are not printed twice.
        0 => "warn,llama.cpp=off",
        1 => "info,llama.cpp=warn",
        _ => "debug",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level))
        .format_timestamp(None)
        .init();
    match run(cli.cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leap: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// llama.cpp's single-dash long options, as the long ones clap parses: `-np N` is `leap
/// serve`'s `--parallel N`, `-fa V` the other subcommands' `--flash-attn V`.
fn llama_names(args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let args: Vec<_> = args.collect();
    // The subcommand: the first argument that is no option (the global ones take no value).
    let serve = args
        .iter()
        .skip(1)
        .find(|a| !a.to_string_lossy().starts_with('-'))
        .is_some_and(|a| a == "serve");
    args.into_iter()
        .map(|a| {
            if serve && a == "-np" {
                "--parallel".into()
            } else if !serve && a == "-fa" {
                "--flash-attn".into()
            } else {
                a
            }
        })
        .collect()
}

/// Whether `e` comes from writing to a closed pipe: the reader of stdout went away (`| head`),
/// which ends the output asked for and is no error. Rust starts with SIGPIPE ignored, so the
/// write fails with EPIPE rather than killing the process; the subcommands write stdout with
/// `writeln!` (see [`cmd`]) so that the error reaches here instead of panicking in `println!`.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run(command: Cmd) -> Result<()> {
    match command {
        Cmd::Generate(a) => cmd::generate::generate(a),
        Cmd::Serve(a) => cmd::serve::serve(a),
        Cmd::Bench(a) => cmd::bench::bench(a),
        Cmd::Models(a) => cmd::models::models(a),
        Cmd::Profile(a) => cmd::profile::profile(a),
        Cmd::AttnBench(a) => cmd::attn::attn_bench(a),
        Cmd::Perplexity(a) => cmd::attn::perplexity(a),
        Cmd::ProfileHeads(a) => cmd::attn::profile_heads(a),
        Cmd::TrainHeads(a) => cmd::train_heads::train_heads(a),
        Cmd::Corpus(a) => cmd::corpus::corpus(a),
        Cmd::PluginPath => cmd::attn::plugin_path(),
        Cmd::QnnSelftest(a) => leap_cli::qnn::qnn_selftest(&a),
        Cmd::Info(a) => cmd::info::info(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Cli, clap::Error> {
        let args = line.split_whitespace().map(std::ffi::OsString::from);
        Cli::try_parse_from(llama_names(args))
    }

    /// What a llama.cpp user types: `-c`/`--ctx-size`, `-s -1`, `-n -1`, `-fa`, `-np`.
    #[test]
    fn llama_cpp_s_names_parse() {
        let Cmd::Generate(g) = parse("leap generate -p hi -c 512 -s -1 -n -1 -fa on --temp 0.8")
            .unwrap()
            .cmd
        else {
            panic!("not generate")
        };
        assert_eq!(g.runtime.ctx, 512);
        assert_eq!(g.runtime.flash_attn, leap_host::FlashAttn::On);
        assert_eq!(g.max_tokens, -1);
        let Cmd::Generate(g) = parse("leap generate -p hi --ctx-size 256 --seed 7")
            .unwrap()
            .cmd
        else {
            panic!("not generate")
        };
        assert_eq!((g.runtime.ctx, g.sampling.seed), (256, 7));
        assert!(parse("leap generate -p hi -s -2").is_err());
        assert!(parse("leap generate -p hi -s 4294967296").is_err());
        let Cmd::Serve(s) = parse("leap serve -np 3").unwrap().cmd else {
            panic!("not serve")
        };
        assert_eq!(s.serve.parallel, 3);
    }
}

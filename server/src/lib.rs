//! `leap serve`: llama-server's OpenAI-compatible HTTP API over Leap's engine, so an app that
//! talks to llama-server (or to OpenAI) gets Leap's speculative decoding by changing nothing
//! but the URL.
//!
//! | module | owns |
//! |---|---|
//! | [`routes`] | the endpoints: health, models, completions, chat, tokenize, metrics; API key |
//! | [`oai`] | the requests' JSON, parsed and checked field by field |
//! | [`slots`] | `--parallel` threads, each with its own session, taking requests from one queue; text with stop strings |
//! | [`metrics`] | the counters behind `GET /metrics` |
//! | [`error`] | OpenAI-style error objects |
//!
//! HTTP is axum on tokio; decoding runs on the slots' own threads (it is CPU work that would
//! stall tokio's), and each slot streams its tokens back through a channel. A client that
//! hangs up closes that channel, which stops its generation at the next token.
//!
//! SIGTERM or Ctrl-C closes the listener and finishes the requests already taken (decoding or
//! queued); a second signal, or `--drain-timeout` seconds, stops them at their next token.

pub mod error;
pub mod metrics;
pub mod oai;
pub mod routes;
pub mod slots;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{Context as _, Result};
use leap_spec::session::{Mode, Options, Runtime};

use crate::metrics::Metrics;
use crate::slots::Pool;

/// `leap serve`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on. Anything but loopback exposes the model to the network: use
    /// --api-key there.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests decoded at once, each in its own context (slot) of --ctx tokens; more wait
    /// in a queue. A request's output does not depend on the others running.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Context length of each slot, in tokens (prompt and output together).
    #[arg(long, default_value_t = 4096)]
    pub ctx: u32,
    /// Threads for each slot's decoding and prefill.
    #[arg(short, long, default_value_t = default_threads())]
    pub threads: i32,
    /// Decoding: `leap` (Leap's speculative engine: the tokens of plain greedy decoding, or
    /// with a temperature the same distribution as plain sampling, in fewer target calls) or
    /// `plain` (llama.cpp alone, one target call per token).
    #[arg(long, default_value = "leap", value_parser = ["leap", "plain"])]
    pub mode: String,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, env = "LEAP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model's name in /v1/models and in responses (default: the file's name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Largest request body in bytes; a larger one gets a 413.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Leave out GET /metrics.
    #[arg(long)]
    pub no_metrics: bool,
    /// Seconds SIGTERM or Ctrl-C waits for the requests in flight to finish before it stops
    /// them (a second signal stops them at once).
    #[arg(long, default_value_t = 60)]
    pub drain_timeout: u64,
    /// Who computes the quantized matrix products: `leap` (Leap's ggml device) or `ggml`.
    #[arg(long, default_value = "leap", value_parser = ["leap", "ggml"])]
    pub kernels: String,
    /// The model's sidecar (default: MODEL.leap.gguf next to the model) with an early-exit
    /// head for pruning verification rows.
    #[arg(long)]
    pub sidecar: Option<PathBuf>,
}

fn default_threads() -> i32 {
    std::thread::available_parallelism().map_or(4, |n| n.get() as i32)
}

/// What the handlers share.
pub struct AppState {
    /// Set once the model is loaded and every slot has its session.
    ready: OnceLock<Ready>,
    metrics: Arc<Metrics>,
    alias: String,
    api_key: Option<String>,
    max_body: usize,
    n_ctx: u32,
    created: u64,
}

struct Ready {
    rt: Arc<Runtime>,
    pool: Pool,
}

/// Serve `model` until SIGTERM or Ctrl-C, then finish the requests in flight and return.
///
/// # Errors
/// The address cannot be bound, the model cannot be loaded, a slot's context cannot be made;
/// requests were still decoding or queued when a second signal or `--drain-timeout` stopped
/// them.
pub fn run(model: &Path, args: &ServeArgs) -> Result<()> {
    anyhow::ensure!(
        (1..=64).contains(&args.parallel),
        "--parallel {}: from 1 to 64",
        args.parallel
    );
    let opts = Options {
        threads: args.threads,
        n_ctx: args.ctx,
        mode: args.mode.parse::<Mode>()?,
        leap_kernels: args.kernels == "leap",
        sidecar: args.sidecar.clone(),
        ..Options::default()
    };
    // Bad options and a file that is not a whole GGUF fail here, before the server listens
    // (the model itself loads in the background once it does).
    opts.validate()?;
    leap_host::GgufInfo::open(model)?;
    let alias = args.alias.clone().unwrap_or_else(|| {
        model
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    let state = Arc::new(AppState {
        ready: OnceLock::new(),
        metrics: Arc::new(Metrics::default()),
        alias,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_body: args.max_body,
        n_ctx: args.ctx,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    // One thread for all of HTTP: decoding has the cores (the slots' threads), and every
    // thread more would preempt them on a small machine.
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    tokio.block_on(serve(model, args, opts, state))
}

async fn serve(model: &Path, args: &ServeArgs, opts: Options, state: Arc<AppState>) -> Result<()> {
    // Signals are counted from here on: the first drains, the second stops what is left.
    let signals = signal_count()?;
    let drain = std::time::Duration::from_secs(args.drain_timeout);
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    eprintln!(
        "leap serve: listening on http://{local} (loading {})",
        model.display()
    );
    let app = routes::router(Arc::clone(&state), !args.no_metrics);

    // Load in the background: /health answers 503 meanwhile. A failure stops the server
    // and is what `run` returns.
    let failed = Arc::new(tokio::sync::Notify::new());
    let load_error: Arc<std::sync::Mutex<Option<anyhow::Error>>> = Default::default();
    {
        let state = Arc::clone(&state);
        let (failed, load_error) = (Arc::clone(&failed), Arc::clone(&load_error));
        let model = model.to_path_buf();
        let parallel = args.parallel;
        std::thread::Builder::new()
            .name("leap-load".into())
            .spawn(move || {
                let r =
                    (|| -> Result<()> {
                        let t0 = std::time::Instant::now();
                        let rt = Arc::new(Runtime::open(&model, &opts)?);
                        let pool =
                            Pool::start(Arc::clone(&rt), parallel, Arc::clone(&state.metrics))?;
                        eprintln!(
                        "leap serve: ready in {:.1} s: {}, {} slot{} of {} tokens, {} decoding{}",
                        t0.elapsed().as_secs_f64(),
                        rt.model().desc(),
                        parallel,
                        if parallel == 1 { "" } else { "s" },
                        opts.n_ctx,
                        if opts.mode == Mode::Leap { "leap" } else { "plain" },
                        if rt.has_exit_head() { " with an early-exit head" } else { "" }
                    );
                        let _ = state.ready.set(Ready { rt, pool });
                        Ok(())
                    })();
                if let Err(e) = r {
                    if let Ok(mut le) = load_error.lock() {
                        *le = Some(e);
                    }
                    failed.notify_one();
                }
            })?;
    }
    let shutdown = {
        let (failed, mut signals) = (Arc::clone(&failed), signals.clone());
        async move {
            tokio::select! {
                () = signalled(&mut signals, 1) => eprintln!(
                    "leap serve: stopping: finishing the requests in flight (up to {} s; a second signal stops them)",
                    drain.as_secs()
                ),
                () = failed.notified() => {}
            }
        }
    };
    let cut = {
        let mut signals = signals.clone();
        async move {
            signalled(&mut signals, 1).await;
            tokio::select! {
                () = signalled(&mut signals, 2) => "a second signal",
                () = tokio::time::sleep(drain) => "the drain timeout",
            }
        }
    };
    let served = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    tokio::select! {
        r = std::future::IntoFuture::into_future(served) => r.context("serving")?,
        why = cut => {
            let left = state.metrics.in_flight();
            eprintln!("leap serve: {why}: stopping {left} request(s) unfinished");
            if let Some(r) = state.ready.get() {
                r.pool.abort();
            }
            // The connections still open go with the runtime (`run` drops it), and the
            // slots, stopped at their next token, are joined with the state.
            anyhow::ensure!(left == 0, "{why} stopped {left} request(s) before they finished");
            return Ok(());
        }
    }
    if let Some(e) = load_error.lock().ok().and_then(|mut e| e.take()) {
        return Err(e.context("loading the model"));
    }
    // The slots finish and join when the state goes (no request holds it any more).
    drop(state);
    eprintln!("leap serve: stopped");
    Ok(())
}

/// Returns once `n` signals have arrived.
async fn signalled(count: &mut tokio::sync::watch::Receiver<u32>, n: u32) {
    if count.wait_for(|&k| k >= n).await.is_err() {
        // No more signals can come.
        std::future::pending::<()>().await;
    }
}

/// How many times SIGTERM or Ctrl-C arrived, counted from now on.
///
/// # Errors
/// A handler cannot be installed.
fn signal_count() -> Result<tokio::sync::watch::Receiver<u32>> {
    let (tx, rx) = tokio::sync::watch::channel(0);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("handling SIGTERM")?;
        let mut int = signal(SignalKind::interrupt()).context("handling SIGINT")?;
        tokio::spawn(async move {
            loop {
                let got = tokio::select! {
                    s = term.recv() => s,
                    s = int.recv() => s,
                };
                if got.is_none() {
                    break;
                }
                tx.send_modify(|n| *n += 1);
            }
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            tx.send_modify(|n| *n += 1);
        }
    });
    Ok(rx)
}

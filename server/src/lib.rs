//! `leap serve`: llama-server's OpenAI-compatible HTTP API over Leap's engine, so an app that
//! talks to llama-server (or to OpenAI) gets Leap's speculative decoding by changing nothing
//! but the URL.
//!
//! | module | owns |
//! |---|---|
//! | [`routes`] | the endpoints: health, models, props, completions, chat, tokenize, metrics; CORS, API key |
//! | [`oai`] | the requests' JSON, parsed and checked field by field |
//! | [`fields`] | what each field of OpenAI's and llama-server's requests does here: honoured, no effect, or refused with a 400 |
//! | [`slots`] | `--parallel` threads, each with its own session, taking requests from one queue; text with stop strings |
//! | [`metrics`] | the counters behind `GET /metrics` |
//! | [`error`] | OpenAI-style error objects |
//!
//! HTTP is hyper (with axum's router) on one tokio thread that only moves bytes: parsing,
//! templating and tokenizing run on two blocking threads, decoding on the slots' own threads,
//! and each slot streams its tokens back through a channel. A client that hangs up closes
//! that channel, which stops its generation within a graph node (prefill too).
//!
//! Every connection has timers (`--header-timeout` for headers and idle keep-alive,
//! `--timeout` for a body), their number a cap (`--max-connections`), bodies in flight a
//! memory budget, the queue a bound (`--max-queue`); on loopback, requests for another host
//! are refused (DNS rebinding). docs/bad-input.md lists what each hostile client gets.
//!
//! SIGTERM or Ctrl-C (taken on a thread of their own) closes the listener and finishes the
//! requests already taken (decoding or queued); a second signal, or `--drain-timeout`
//! seconds, stops them; a third exits at once.

pub mod error;
pub mod fields;
pub mod metrics;
pub mod oai;
pub mod routes;
pub mod slots;
pub mod tools;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, Result};
use leap_spec::session::{Mode, Options, Runtime};

use crate::metrics::Metrics;
use crate::slots::Pool;

/// `leap serve`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on. Anything but loopback exposes the model to the network: use
    /// --api-key there. On loopback, requests that name another host (Host or Origin) are
    /// refused, which keeps web pages from reaching the server (DNS rebinding).
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
    /// llama-server's context size: the context of all slots together, each getting
    /// CTX_SIZE / --parallel tokens (instead of --ctx).
    #[arg(short = 'c', long, conflicts_with = "ctx")]
    pub ctx_size: Option<u32>,
    /// The seed of requests that send none (or -1); without it each such request draws a
    /// random one, as llama-server's default -1 does.
    #[arg(short = 's', long, allow_negative_numbers = true)]
    pub seed: Option<i64>,
    /// The chat template for chat requests instead of the GGUF's: the name of one llama.cpp
    /// knows (`chatml`, `llama3`, `gemma`, `phi3`, ...) or a template's text, as llama-server's.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Not served here: refused by name. Chat templates are rendered by llama.cpp's built-in
    /// formats (llama-server without --jinja), which tell the common templates apart by their
    /// text; Jinja's rendering is not (tools are described in the system message instead,
    /// see `tools`).
    #[arg(long)]
    pub jinja: bool,
    /// Accepted as llama-server takes it: /metrics is served unless --no-metrics.
    #[arg(long, conflicts_with = "no_metrics")]
    pub metrics: bool,
    /// Threads for each slot's decoding and prefill (default: one per physical core, as
    /// llama.cpp).
    #[arg(short, long, default_value_t = default_threads())]
    pub threads: i32,
    /// Decoding: `leap` (Leap's speculative engine: the tokens of plain greedy decoding, or
    /// with a temperature the same distribution as plain sampling, in fewer target calls) or
    /// `plain` (llama.cpp alone, one target call per token).
    #[arg(long, default_value = "leap", value_parser = ["leap", "plain"])]
    pub mode: String,
    /// Require `Authorization: Bearer KEY` (or `X-Api-Key: KEY`) on every endpoint but
    /// /health. Several keys, comma-separated, are several tenants: each sees only its own
    /// cache (--shared-cache). Without the flag or LEAP_API_KEY, llama-server's LLAMA_API_KEY
    /// is read too.
    #[arg(long, env = "LEAP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model's name in /v1/models and in responses (default: the file's name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Largest request body in bytes; a larger one gets a 413 [default: 64 KiB + 64 bytes
    /// per token of --ctx, room for any prompt that fits]
    #[arg(long)]
    pub max_body: Option<usize>,
    /// Leave out GET /metrics.
    #[arg(long)]
    pub no_metrics: bool,
    /// Seconds SIGTERM or Ctrl-C waits for the requests in flight to finish before it stops
    /// them (a second signal stops them at once; a third exits at once).
    #[arg(long, default_value_t = 60)]
    pub drain_timeout: u64,
    /// Who computes the quantized matrix products: `leap` (Leap's ggml device) or `ggml`.
    #[arg(long, default_value = "leap", value_parser = ["leap", "ggml"])]
    pub kernels: String,
    /// The model's sidecar (default: MODEL.leap.gguf next to the model) with an early-exit
    /// head for pruning verification rows.
    #[arg(long)]
    pub sidecar: Option<PathBuf>,
    /// Seconds a client has to send a request's headers, from when it connects or its last
    /// response ended: a connection idle that long is closed (keep-alive included).
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a client has to send a request's body once its headers are in (a 408 after).
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Open connections at most (lowered to the open-file limit less 64). A connection
    /// beyond them gets a 503 with Retry-After and is closed.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Requests waiting for a slot at most; one more gets a 503 with Retry-After.
    #[arg(long, default_value_t = 32)]
    pub max_queue: usize,
    /// Host names requests may name (Host and Origin headers), comma-separated, besides
    /// loopback's (`localhost`, `127.0.0.1`, `[::1]`); `*` takes any. Checked when bound to
    /// loopback, or when given.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Let a request reuse the KV cache and drafting history other clients' requests left
    /// in a slot (faster repeats and conversations, but one client's timing then tells what
    /// another sent). Without it they are shared only between requests with the same API
    /// key (none without --api-key).
    #[arg(long)]
    pub shared_cache: bool,
    /// Report each request's drafting (`target_calls`, `accepted_per_call`) in its
    /// `timings`.
    #[arg(long)]
    pub drafting_stats: bool,
    /// Serve /v1/embeddings (as llama-server's --embeddings): the target's final hidden
    /// states pooled (--pooling) and normalised, from a context of --ctx tokens of its own.
    #[arg(long)]
    pub embeddings: bool,
    /// How /v1/embeddings pools a text's rows. llama-server takes the model's own, which for
    /// a generative model is none, and refuses OpenAI's endpoint then; mean here
    /// [default: mean]
    #[arg(long, requires = "embeddings", value_parser = ["mean", "last", "cls"])]
    pub pooling: Option<String>,
}

fn default_threads() -> i32 {
    leap_host::par::default_threads()
}

/// What the handlers share.
pub struct AppState {
    /// Set once the model is loaded and every slot has its session.
    ready: OnceLock<Ready>,
    metrics: Arc<Metrics>,
    alias: String,
    /// The API keys (none: no authentication); a key's index is its tenant.
    api_keys: Vec<String>,
    max_body: usize,
    /// Bytes of request bodies being received or parsed, across connections, at most.
    body_budget: Arc<tokio::sync::Semaphore>,
    body_timeout: Duration,
    n_ctx: u32,
    created: u64,
    hosts: routes::Hosts,
    shared_cache: bool,
    drafting_stats: bool,
    /// The seed of requests that send none (`--seed`).
    seed: Option<u32>,
    /// Slots (`--parallel`) and the model's file, for `/props`.
    total_slots: usize,
    model_path: String,
}

struct Ready {
    rt: Arc<Runtime>,
    pool: Pool,
    /// The embedding context (`--embeddings`), one request at a time.
    embed: Option<std::sync::Mutex<leap_host::Context>>,
}

/// A context that pools the target's final hidden states (`--embeddings`): a text of up to
/// `n_ctx` tokens in one batch.
fn embedding_context(
    rt: &Runtime,
    pooling: leap_host::Pooling,
    n_ctx: u32,
    threads: i32,
) -> leap_host::Result<leap_host::Context> {
    // On the device as the runtime's sessions are.
    rt.new_device().bind(|| {
        leap_host::Context::new(
            rt.model(),
            &leap_host::ContextParams {
                n_ctx,
                n_batch: n_ctx,
                n_ubatch: n_ctx,
                n_threads: threads,
                n_threads_batch: threads,
                pooling: Some(pooling),
                ..Default::default()
            },
        )
    })
}

/// The `--max-body` default for a context of `n_ctx` tokens: 64 KiB of JSON around 64 bytes
/// per token (a token is rarely more than 16 bytes of text, and JSON escapes at most six
/// bytes per character).
pub fn default_max_body(n_ctx: u32) -> usize {
    (64 << 10) + 64 * n_ctx as usize
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
    let mut args = args.clone();
    if let Some(total) = args.ctx_size {
        args.ctx = total / args.parallel as u32;
        log::info!(
            "--ctx-size {total} over {} slots: {} tokens each",
            args.parallel,
            args.ctx
        );
    }
    let seed = match args.seed {
        None | Some(-1) | Some(0xFFFF_FFFF) => None,
        Some(s @ 0..0xFFFF_FFFF) => Some(s as u32),
        Some(s) => anyhow::bail!("--seed {s}: from 0 to 4294967295, or -1 for a random one"),
    };
    if args.jinja {
        anyhow::bail!(
            "--jinja: leap serve renders chat templates with llama.cpp's built-in formats, as \
             llama-server does without --jinja (--chat-template picks one); leave --jinja out"
        );
    }
    let args = &args;
    let from_llama = || std::env::var("LLAMA_API_KEY").ok();
    let api_keys = match &args.api_key.clone().or_else(from_llama) {
        None => Vec::new(),
        Some(k) => {
            let keys: Vec<String> = k
                .split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(str::to_owned)
                .collect();
            anyhow::ensure!(
                !keys.is_empty(),
                "--api-key is empty: give a key, or leave --api-key (and LEAP_API_KEY, LLAMA_API_KEY) out to \
                 serve without one"
            );
            keys
        }
    };
    anyhow::ensure!(
        args.header_timeout > 0 && args.timeout > 0,
        "--header-timeout and --timeout: at least 1 second"
    );
    anyhow::ensure!(args.max_connections > 0, "--max-connections 0: at least 1");
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
    match args.ctx_size {
        // A per-slot context the user did not type: say where it came from.
        Some(total) => opts
            .validate()
            .with_context(|| format!("--ctx-size {total} over {} slots", args.parallel))?,
        None => opts.validate()?,
    }
    leap_host::GgufInfo::open(model)?;
    let alias = args.alias.clone().unwrap_or_else(|| {
        model
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    let max_body = args.max_body.unwrap_or_else(|| default_max_body(args.ctx));
    // Partial bodies are held in memory: all of them together within this (and always room
    // for one of the largest).
    let budget = (64usize << 20).max(2 * max_body).min(u32::MAX as usize);
    let hosts = routes::Hosts::new(&args.host, &args.allowed_hosts);
    let state = Arc::new(AppState {
        ready: OnceLock::new(),
        metrics: Arc::new(Metrics::default()),
        alias,
        api_keys,
        max_body,
        body_budget: Arc::new(tokio::sync::Semaphore::new(budget)),
        body_timeout: Duration::from_secs(args.timeout),
        n_ctx: args.ctx,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        hosts,
        shared_cache: args.shared_cache,
        drafting_stats: args.drafting_stats,
        seed,
        total_slots: args.parallel,
        model_path: model.display().to_string(),
    });
    // One thread for all of HTTP: decoding has the cores (the slots' threads), and every
    // thread more would preempt them on a small machine. Tokenizing and parsing, which grow
    // with the request, run on two blocking threads beside it, so HTTP never waits on them.
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(2)
        // Kept rather than made again for each burst of requests.
        .thread_keep_alive(Duration::from_secs(3600))
        .build()?;
    let held = Arc::downgrade(&state);
    let r = tokio.block_on(serve(model, args, opts, state));
    // A tokenization still running for a client that is gone is not waited for.
    tokio.shutdown_timeout(Duration::from_secs(1));
    if held.strong_count() > 0 {
        end_now(&r);
    }
    r
}

/// End the process at once with the status `leap` gives `r`: a tokenization still running
/// holds the server's state, and with it the model, and an ordinary exit would run
/// llama.cpp's static destructors under it (a SIGSEGV, not an exit status).
fn end_now(r: &Result<()>) -> ! {
    eprintln!("leap serve: not waiting for a tokenization still running");
    let code = match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("leap: error: {e:#}");
            1
        }
    };
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: ends the process at once, with nothing left to flush.
    unsafe { libc::_exit(code) }
}

/// The open-file limit (soft), if it can be read.
fn open_file_limit() -> Option<usize> {
    #[cfg(unix)]
    {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `l` is a valid rlimit to write.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0 {
            return Some(usize::try_from(l.rlim_cur).unwrap_or(usize::MAX));
        }
    }
    None
}

async fn serve(model: &Path, args: &ServeArgs, opts: Options, state: Arc<AppState>) -> Result<()> {
    // Signals are counted from here on: the first drains, the second stops what is left.
    let signals = signal_count()?;
    let drain = Duration::from_secs(args.drain_timeout);
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    // Below the open-file limit, with room for the model, the slots and a few refusals.
    let max_conns = match open_file_limit() {
        Some(n) => args.max_connections.min(n.saturating_sub(64).max(1)),
        None => args.max_connections,
    };
    if max_conns < args.max_connections {
        log::warn!(
            "--max-connections {} lowered to {max_conns}: the open-file limit is {} (`ulimit -n`)",
            args.max_connections,
            max_conns + 64
        );
    }
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
        let (parallel, max_queue) = (args.parallel, args.max_queue);
        let chat_template = args.chat_template.clone();
        let pooling = args
            .embeddings
            .then_some(match args.pooling.as_deref().unwrap_or("mean") {
                "last" => leap_host::Pooling::Last,
                "cls" => leap_host::Pooling::Cls,
                _ => leap_host::Pooling::Mean,
            });
        std::thread::Builder::new()
            .name("leap-load".into())
            .spawn(move || {
                let r =
                    (|| -> Result<()> {
                        let t0 = std::time::Instant::now();
                        let rt = Arc::new(Runtime::open(&model, &opts)?);
                        if let Some(t) = &chat_template {
                            rt.model()
                                .set_chat_template(t)
                                .with_context(|| format!("--chat-template {t:?}"))?;
                        }
                        // Read off the vocabulary now rather than in the first request.
                        rt.model().max_token_bytes();
                        let pool = Pool::start(
                            Arc::clone(&rt),
                            parallel,
                            max_queue,
                            Arc::clone(&state.metrics),
                        )?;
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
                        let embed = match &pooling {
                            Some(p) => Some(std::sync::Mutex::new(
                                embedding_context(&rt, *p, opts.n_ctx, opts.threads)
                                    .context("--embeddings: the embedding context")?,
                            )),
                            None => None,
                        };
                        let _ = state.ready.set(Ready { rt, pool, embed });
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
    let conns = Connections {
        open: Arc::new(tokio::sync::Semaphore::new(max_conns)),
        refusing: Arc::new(tokio::sync::Semaphore::new(REFUSING)),
        header_timeout: Duration::from_secs(args.header_timeout),
        graceful: hyper_util::server::graceful::GracefulShutdown::new(),
    };
    let served = async {
        accept_until(&listener, &app, &conns, shutdown).await;
        drop(listener);
        // In flight requests finish; idle connections close.
        conns.graceful.shutdown().await;
    };
    tokio::select! {
        () = served => {}
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

/// Connections over the cap answered with a 503 at once, at most (more are closed unanswered).
const REFUSING: usize = 16;

/// The open connections and their limits.
struct Connections {
    /// A permit per open connection, up to the cap.
    open: Arc<tokio::sync::Semaphore>,
    /// A permit per connection over the cap being told so.
    refusing: Arc<tokio::sync::Semaphore>,
    header_timeout: Duration,
    graceful: hyper_util::server::graceful::GracefulShutdown,
}

impl Connections {
    fn http1(&self) -> hyper::server::conn::http1::Builder {
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(hyper_util::rt::TokioTimer::new())
            // From the connection's start or its last response: idle keep-alive too.
            .header_read_timeout(self.header_timeout)
            // What a connection may hold unread (headers, a body's next chunk).
            .max_buf_size(64 << 10);
        b
    }
}

/// Accept connections until `shutdown`, serving each with hyper (axum's router as the
/// service) under the header timeout and the connection cap.
async fn accept_until(
    listener: &tokio::net::TcpListener,
    app: &axum::Router,
    conns: &Connections,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::TokioIo;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors, most likely: the connection waits in the
                    // backlog until one is free.
                    log::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let _ = tcp.set_nodelay(true);
        let io = TokioIo::new(tcp);
        match Arc::clone(&conns.open).try_acquire_owned() {
            Ok(permit) => {
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                let conn = conns
                    .graceful
                    .watch(conns.http1().serve_connection(io, svc));
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        log::debug!("connection: {e}");
                    }
                    drop(permit);
                });
            }
            Err(_) => {
                let Ok(permit) = Arc::clone(&conns.refusing).try_acquire_owned() else {
                    continue;
                };
                let mut b = conns.http1();
                b.keep_alive(false);
                let conn = b.serve_connection(
                    io,
                    hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(
                            axum::response::IntoResponse::into_response(
                                error::ApiError::too_many_connections(),
                            ),
                        )
                    }),
                );
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
                    drop(permit);
                });
            }
        }
    }
}

/// Returns once `n` signals have arrived.
async fn signalled(count: &mut tokio::sync::watch::Receiver<u32>, n: u32) {
    if count.wait_for(|&k| k >= n).await.is_err() {
        // No more signals can come.
        std::future::pending::<()>().await;
    }
}

/// How many times SIGTERM or Ctrl-C arrived, counted from now on. The signals are taken on a
/// thread of their own, so they arrive whatever the server's threads are doing; a third one
/// exits at once.
///
/// # Errors
/// A handler cannot be installed.
fn signal_count() -> Result<tokio::sync::watch::Receiver<u32>> {
    let (tx, rx) = tokio::sync::watch::channel(0u32);
    let (installed_tx, installed) = std::sync::mpsc::channel::<Result<()>>();
    std::thread::Builder::new()
        .name("leap-signals".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = installed_tx.send(Err(e.into()));
                    return;
                }
            };
            rt.block_on(async move {
                let count = move |tx: &tokio::sync::watch::Sender<u32>| {
                    tx.send_modify(|n| *n += 1);
                    if *tx.borrow() >= 3 {
                        eprintln!("leap serve: a third signal: exiting now");
                        std::process::exit(1);
                    }
                };
                #[cfg(unix)]
                {
                    use tokio::signal::unix::{signal, SignalKind};
                    let handlers = signal(SignalKind::terminate())
                        .context("handling SIGTERM")
                        .and_then(|t| {
                            Ok((
                                t,
                                signal(SignalKind::interrupt()).context("handling SIGINT")?,
                            ))
                        });
                    let (mut term, mut int) = match handlers {
                        Ok(h) => h,
                        Err(e) => {
                            let _ = installed_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = installed_tx.send(Ok(()));
                    loop {
                        let got = tokio::select! {
                            s = term.recv() => s,
                            s = int.recv() => s,
                        };
                        if got.is_none() {
                            break;
                        }
                        count(&tx);
                    }
                }
                #[cfg(not(unix))]
                {
                    let _ = installed_tx.send(Ok(()));
                    while tokio::signal::ctrl_c().await.is_ok() {
                        count(&tx);
                    }
                }
            });
        })?;
    installed
        .recv()
        .context("the signal thread stopped before it started")??;
    Ok(rx)
}

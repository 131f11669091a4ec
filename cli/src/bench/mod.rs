//! `leap bench`: the benchmark contract of `../shared/BENCH.md`.
//!
//! Every mode gets its own llama.cpp context on the one shared model (so a drafter's state
//! lives across requests, as in llama-server), and the modes run interleaved per request:
//! request 1 in every mode, then request 2, so machine drift hits every mode alike.

pub mod chart;
pub mod oracle;
pub mod report;
pub mod stock;
pub mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use leap_host::anchor::{AnchorConfig, LlamaSpeculative, TYPES};
use leap_host::project::OnDemand;
use leap_host::sampler::SamplingParams;
use leap_host::{Context, ContextParams, FlashAttn, Model, ModelParams, Token};

use leap_host::usage::{cpu_seconds, peak_rss_bytes};
use leap_spec::engine::{Engine, EngineConfig};
use leap_spec::model_draft::{LlamaDraft, ModelDrafter, Vocab};
use leap_spec::plain::{self, Generation};
pub use report::Report;
use report::{ModeReport, RequestReport};
use std::sync::Arc;

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

/// A mode, parsed from its name.
#[derive(Debug, Clone, PartialEq)]
pub enum ModeKind {
    /// `plain`.
    Plain,
    /// `llama:TYPE`.
    Llama(String),
    /// `server:TYPE`: a stock llama-server in its own process ([`stock`]).
    Server(String),
    /// `leap` or `leap:NAME`: Leap's engine with a named configuration.
    Leap(EngineConfig),
}

/// Leap's named configurations (`leap:NAME`); `leap` is the recommended one.
pub const LEAP_CONFIGS: &[&str] = &[
    "sam",
    "sam-fixed",
    "history",
    "reuse",
    "calib",
    "tree",
    "eager",
    "ondemand",
    "exit-measure",
    "ggml",
    "draft",
    "vocab",
    "oracle",
];

/// The engine configuration of `leap` (`None`) or `leap:NAME`. The named ones add one
/// technique at a time, so a bench run shows each one's contribution:
/// `sam` (retrieval from the request only, Lever trees of one leaf), `sam-fixed` (the same
/// drafting the longest continuation every step), `history` (+ earlier requests and answers),
/// `reuse` (+ draft reuse), `calib` (+ in-context calibration: `leap`'s trees where it builds
/// them), `tree` (+ up to 4 leaves per step, and the sidecar's early-exit head); `eager`,
/// `ondemand` and `exit-measure` verify `tree`'s trees with llama.cpp computing logits for
/// every verified row, with on-demand output projection alone, and with the head deciding
/// without pruning; `ggml` is `calib` with verification's matrix products on ggml's CPU
/// kernels instead of Leap's device.
pub fn leap_config(name: Option<&str>) -> Option<EngineConfig> {
    // Only `leap` itself (and `leap:tree`, which is `leap` with wider trees) prunes with an
    // early-exit head when the sidecar has one: every other named configuration shows its
    // technique without it.
    // Only `leap` drafts with the target itself (on a streamed target, or where the output
    // projection is a large share of a call): the named configurations show their trees.
    let base = EngineConfig {
        exit: name.is_none() || name == Some("tree"),
        vocab: None,
        ..EngineConfig::default()
    };
    let sam = EngineConfig {
        history_tokens: 0,
        reuse_lifetime: 0,
        calibrate: false,
        ..base.clone()
    };
    Some(match name {
        None => EngineConfig {
            vocab: EngineConfig::default().vocab,
            ..base
        },
        Some("sam") => sam,
        Some("sam-fixed") => EngineConfig {
            adaptive: false,
            max_draft: 8,
            ..sam
        },
        Some("history") => EngineConfig {
            reuse_lifetime: 0,
            calibrate: false,
            ..base
        },
        Some("reuse") => EngineConfig {
            calibrate: false,
            ..base
        },
        Some("calib") => base,
        Some("tree") => EngineConfig {
            max_branches: 4,
            ..base
        },
        // Issue 7's modes verify Lever's trees (up to 4 leaves, as `leap:tree`), which is
        // where skipping rows pays: `eager` with llama.cpp computing every verified row's
        // logits, `ondemand` projecting only the rows acceptance reads (no early-exit head),
        // `exit-measure` with the sidecar's head deciding on every tree without pruning (what
        // it would keep, and how many accepted tokens that would have kept, on the same
        // trees). `leap:tree` is the three together.
        Some("eager") => EngineConfig {
            on_demand: false,
            max_branches: 4,
            ..base
        },
        Some("ondemand") => EngineConfig {
            max_branches: 4,
            ..base
        },
        Some("exit-measure") => EngineConfig {
            exit: true,
            max_branches: 4,
            prune: leap_spec::exit::PruneConfig {
                measure_only: true,
                ..base.prune.clone()
            },
            ..base
        },
        // `leap` on llama.cpp's kernels alone (see `BenchConfig::kernels`).
        Some("ggml") => base,
        // `leap` plus a draft model (`--draft`), across vocabularies if need be.
        Some("draft") => base,
        // The target drafting for itself over a resident vocabulary, with resident weights
        // too (`leap` does it on a streamed target).
        Some("vocab") => EngineConfig {
            vocab: Some(leap_spec::vocab::VocabConfig {
                resident: leap_spec::vocab::Resident::Always,
                ..Default::default()
            }),
            ..base
        },
        // Chains of plain's own answer (see [`oracle`]): the ceiling of any drafter here.
        Some("oracle") => sam,
        Some(_) => return None,
    })
}

impl ModeKind {
    /// Parse a mode name.
    ///
    /// # Errors
    /// Unknown names, and Leap modes that do not exist yet.
    pub fn parse(name: &str) -> Result<Self> {
        if name == "plain" {
            return Ok(ModeKind::Plain);
        }
        if let Some(t) = name.strip_prefix("llama:") {
            if TYPES.contains(&t) {
                return Ok(ModeKind::Llama(t.to_string()));
            }
            bail!(
                "unknown llama.cpp speculative type {t:?}; one of: {}",
                TYPES.join(", ")
            );
        }
        if let Some(t) = name.strip_prefix("server:") {
            if stock::server_types().contains(&t) {
                return Ok(ModeKind::Server(t.to_string()));
            }
            bail!(
                "unknown stock llama-server mode {name:?}; one of: server:{}",
                stock::server_types().join(", server:")
            );
        }
        if name == "leap" || name.starts_with("leap:") {
            let known = || {
                LEAP_CONFIGS
                    .iter()
                    .map(|c| format!("leap:{c}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return leap_config(name.strip_prefix("leap:"))
                .map(ModeKind::Leap)
                .with_context(|| {
                    format!(
                        "unknown Leap configuration {name:?}; one of: leap, {}",
                        known()
                    )
                });
        }
        bail!(
            "unknown mode {name:?}; modes are plain, llama:TYPE ({}), server:TYPE ({}), leap, \
             leap:NAME ({})",
            TYPES.join(", "),
            stock::server_types().join(", "),
            LEAP_CONFIGS.join(", ")
        )
    }
}

enum Runner {
    /// Plain decoding; under flash streaming with Leap's chunked output projection.
    Plain(Context, Option<OnDemand>),
    Llama(Box<LlamaSpeculative>),
    Leap(Context, Box<Engine>),
    Server(Box<stock::StockServer>),
}

impl Runner {
    fn run(
        &mut self,
        prompt: &[Token],
        max_tokens: usize,
        cfg: &BenchConfig,
    ) -> Result<Generation> {
        match self {
            Runner::Plain(ctx, od) => Ok(plain::plain_with(
                ctx,
                od.as_ref(),
                prompt,
                max_tokens,
                &cfg.sampling,
                512,
                &mut |_| true,
            )?),
            Runner::Llama(spec) => run_anchor(spec, prompt, max_tokens),
            Runner::Server(server) => {
                let c = server.complete(prompt, max_tokens, &cfg.sampling)?;
                // The first token comes with the prompt; every decode call yields one token
                // plus the drafts it accepted, from a row per token and per draft.
                let decoded = (c.tokens.len() as u64).saturating_sub(1);
                let rows = decoded + c.drafted;
                Ok(Generation {
                    target_calls: decoded.saturating_sub(c.accepted),
                    drafted_tokens: c.drafted,
                    verify_rows: rows,
                    rows_after_exit: rows,
                    output_rows: rows,
                    tokens: c.tokens,
                    prefill_seconds: c.prompt_seconds,
                    decode_seconds: c.decode_seconds,
                    decode_cpu_seconds: c.cpu_seconds,
                    ..Default::default()
                })
            }
            Runner::Leap(ctx, engine) => Ok(engine.generate_with(
                ctx,
                prompt,
                max_tokens,
                512,
                &cfg.sampling,
                &mut |_| true,
            )?),
        }
    }
}

/// Generate with llama.cpp's speculative decoding; stops at `max_tokens` or end of generation.
fn run_anchor(
    spec: &mut LlamaSpeculative,
    prompt: &[Token],
    max_tokens: usize,
) -> Result<Generation> {
    let t0 = Instant::now();
    spec.prefill(prompt)?;
    let mut g = Generation {
        prefill_seconds: t0.elapsed().as_secs_f64(),
        ..Default::default()
    };
    let model = spec.target().model().clone();
    let cpu0 = cpu_seconds();
    let t1 = Instant::now();
    let first = spec.first()?;
    g.tokens.push(first);
    let mut done = model.is_eog(first);
    while !done && g.tokens.len() < max_tokens {
        let step = spec.step(max_tokens - g.tokens.len())?;
        g.target_calls += 1;
        g.drafted_tokens += step.drafted as u64;
        // llama.cpp verifies the last token and the draft, logits for every row.
        g.verify_rows += 1 + step.drafted as u64;
        g.rows_after_exit += 1 + step.drafted as u64;
        g.output_rows += 1 + step.drafted as u64;
        for t in step.tokens {
            g.tokens.push(t);
            if model.is_eog(t) || g.tokens.len() >= max_tokens {
                done = true;
                break;
            }
        }
    }
    g.decode_seconds = t1.elapsed().as_secs_f64();
    g.decode_cpu_seconds = cpu_seconds() - cpu0;
    Ok(g)
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

pub use leap_spec::session::vocab_reserve;

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
    let kinds: Vec<ModeKind> = cfg
        .modes
        .iter()
        .map(|m| ModeKind::parse(m))
        .map(|k| match (k, cfg.exit_threshold) {
            (Ok(ModeKind::Leap(mut ec)), Some(t)) => {
                ec.prune.threshold = t;
                Ok(ModeKind::Leap(ec))
            }
            (k, _) => k,
        })
        .collect::<Result<_>>()?;
    let needs_draft = kinds
        .iter()
        .any(|k| *k == ModeKind::Llama("draft-simple".into()))
        || cfg.modes.iter().any(|m| m == "leap:draft");
    if let Some(o) = cfg.modes.iter().position(|m| m == "leap:oracle") {
        anyhow::ensure!(
            cfg.modes[..o].iter().any(|m| m == "plain"),
            "leap:oracle drafts plain decoding's answers: put plain before it in --modes"
        );
        anyhow::ensure!(
            cfg.sampling.temp <= 0.0,
            "leap:oracle drafts plain's greedy answers: it runs with --temp 0 only"
        );
    }
    if needs_draft && cfg.draft.is_none() {
        bail!("modes llama:draft-simple and leap:draft need a draft model: pass --draft PATH");
    }
    let servers = kinds.iter().any(|k| matches!(k, ModeKind::Server(_)));
    if servers && cfg.flash_budget.is_some() {
        bail!("server:* modes cannot stream weights: run them without --flash-budget");
    }
    let server_bin = if servers {
        Some(stock::find_server(cfg.server_bin.as_deref())?)
    } else {
        None
    };
    let requests = workload::load(&cfg.workload, &cfg.tasks, cfg.skip, cfg.limit)?;
    if requests.is_empty() {
        bail!(
            "{}: no requests (after --task/--skip/--limit)",
            cfg.workload.display()
        );
    }
    let model = Model::load(&cfg.model, &ModelParams::default())
        .with_context(|| format!("loading target {}", cfg.model.display()))?;
    leap_spec::session::check_ctx(&model, cfg.ctx).map_err(|e| anyhow::anyhow!("--ctx: {e}"))?;
    let draft_model = match &cfg.draft {
        Some(p) => Some(
            Model::load(p, &ModelParams::default())
                .with_context(|| format!("loading draft {}", p.display()))?,
        ),
        None => None,
    };
    let cparams = ContextParams {
        n_ctx: cfg.ctx,
        n_threads: cfg.threads,
        n_threads_batch: cfg.threads,
        flash_attn: cfg.flash_attn,
        ..Default::default()
    };
    let mut runners = Vec::new();
    // Plain's answer to the current request, for `leap:oracle`.
    let answer = oracle::Answer::default();
    // Flash streaming: one streamer per mode (each mode's context has its own hooks), all
    // with the same plan.
    let flash = match cfg.flash_budget {
        Some(f) => {
            let map = leap_flash::LayerMap::open(&cfg.model)?;
            let per_call = map.per_call_bytes();
            let chunk = map.largest_block().max(1);
            let p = leap_flash::plan(
                &map,
                (f * per_call as f64) as u64,
                chunk,
                1,
                cfg.flash_strategy,
            );
            Some((map, p))
        }
        None => None,
    };
    // `leap`'s early-exit head, if the sidecar has one for this model (not under flash
    // streaming, where a call's cost is its reads).
    let head = kinds
        .iter()
        .any(|k| matches!(k, ModeKind::Leap(ec) if ec.exit))
        .then(|| crate::heads::load_head(&model, cfg.sidecar.as_deref()))
        .flatten()
        .filter(|_| flash.is_none())
        .map(Arc::new);
    let mut streamers: Vec<Option<leap_flash::Streamer>> = Vec::new();
    // Bytes each mode keeps resident besides its plan's (budgeted out of the plan).
    let mut reserved: Vec<u64> = Vec::new();
    for (name, kind) in cfg.modes.iter().zip(&kinds) {
        let mut params = cparams.clone();
        let mut kind = kind.clone();
        if let (ModeKind::Leap(ec), Some(_)) = (&mut kind, &flash) {
            *ec = ec.clone().streamed();
            // `leap` (everything on) verifies trees of up to 4 leaves on a streamed target,
            // where the extra rows ride on the I/O.
            if name == "leap" {
                ec.max_branches = ec.max_branches.max(4);
            }
        }
        let kind = &kind;
        if let ModeKind::Server(t) = kind {
            let bin = server_bin.as_deref().expect("found above");
            eprintln!("bench: starting {} --spec-type {t}", bin.display());
            runners.push(Runner::Server(Box::new(stock::StockServer::start(
                &stock::ServerConfig {
                    bin,
                    model: &cfg.model,
                    draft: cfg.draft.as_deref(),
                    spec_type: t,
                    threads: cfg.threads,
                    ctx: cfg.ctx,
                },
            )?)));
            streamers.push(None);
            reserved.push(0);
            continue;
        }
        if let ModeKind::Leap(ec) = kind {
            params.n_seq_max = ec.max_branches as u32;
        }
        // `leap`'s resident vocabulary ([`leap_spec::vocab`]) comes out of its budget: its
        // blocks and output rows are planned for what is left.
        let reserve = match (kind, &flash) {
            (ModeKind::Leap(ec), Some((map, p))) => vocab_reserve(
                map,
                p.budget,
                model.n_vocab(),
                ec.vocab,
                cfg.sampling.temp <= 0.0,
            ),
            _ => 0,
        };
        reserved.push(reserve);
        let streamer = match &flash {
            Some((map, p)) => {
                let p = if reserve > 0 {
                    leap_flash::plan(
                        map,
                        p.budget.saturating_sub(reserve),
                        map.largest_block().max(1),
                        1,
                        cfg.flash_strategy,
                    )
                } else {
                    p.clone()
                };
                Some(leap_flash::Streamer::new(&cfg.model, map.clone(), p, 1)?)
            }
            None => None,
        };
        let mut observer = streamer.as_ref().map(|s| s.observer());
        streamers.push(streamer);
        // The early exit's observer on `leap`'s context.
        let mut exit = None;
        if let (ModeKind::Leap(ec), Some(h)) = (kind, &head) {
            if ec.exit && ec.on_demand {
                let (e, obs) = leap_host::exit::Exit::new(h.layer);
                observer = Some(match observer {
                    Some(o) => Box::new(leap_host::Chain::new(vec![o, obs])),
                    None => obs,
                });
                let pruner = leap_spec::exit::Pruner {
                    head: h.clone(),
                    n_layer: model.n_layer() as u32,
                };
                exit = Some((e, pruner));
            }
        }
        // Leap's output projection reads streamed output weights a chunk at a time.
        let chunked = |od: OnDemand, st: &Option<leap_flash::Streamer>| match st {
            Some(s) => s.stream_projection(od),
            None => od,
        };
        if let ModeKind::Leap(ec) = kind {
            let (target, od) = OnDemand::context_with(&model, &params, observer)
                .with_context(|| format!("creating the context for mode {name}"))?;
            // `leap:eager` keeps the projection for calibration's prefill; its engine verifies
            // with llama.cpp's logits (`EngineConfig::on_demand`).
            let od = od
                .filter(|_| ec.on_demand || ec.calibrate)
                .map(|od| chunked(od, streamers.last().expect("pushed above")));
            let mut engine = Engine::new(ec.clone()).with_on_demand(od).with_exit(exit);
            if name == "leap:draft" {
                let dm = draft_model.as_ref().expect("checked above");
                let dctx = Context::new(dm, &cparams)
                    .with_context(|| format!("creating the draft context for mode {name}"))?;
                let target: Arc<dyn Vocab + Send + Sync> = model.clone();
                engine = engine.with_drafter(Box::new(ModelDrafter::new(
                    LlamaDraft::new(dm.clone(), dctx),
                    target,
                )));
            }
            if name == "leap:oracle" {
                engine = engine.with_drafter(Box::new(oracle::Oracle::new(answer.clone())));
            }
            runners.push(Runner::Leap(target, Box::new(engine)));
            continue;
        }
        if *kind == ModeKind::Plain && flash.is_some() {
            // flash-AR: the same streaming as Leap's modes, without speculation.
            let (target, od) = OnDemand::context_with(&model, &params, observer)
                .with_context(|| format!("creating the context for mode {name}"))?;
            let od = od.map(|od| chunked(od, streamers.last().expect("pushed above")));
            runners.push(Runner::Plain(target, od));
            continue;
        }
        let target = Context::with_observer(&model, &params, observer)
            .with_context(|| format!("creating the context for mode {name}"))?;
        let runner = match kind {
            ModeKind::Plain => Runner::Plain(target, None),
            ModeKind::Leap(_) | ModeKind::Server(_) => unreachable!("created above"),
            ModeKind::Llama(t) => {
                let dctx = match (&draft_model, t.as_str()) {
                    (Some(dm), "draft-simple") => Some(Context::new(dm, &cparams)?),
                    _ => None,
                };
                let anchor = AnchorConfig {
                    sampling: cfg.sampling,
                    ..Default::default()
                };
                Runner::Llama(Box::new(
                    LlamaSpeculative::new(target, dctx, t, &anchor)
                        .with_context(|| format!("mode {name}"))?,
                ))
            }
        };
        runners.push(runner);
    }

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
    let mut per_mode: Vec<ModeReport> = vec![ModeReport::default(); runners.len()];
    let mut cpu = vec![0f64; runners.len()];
    let mut rss = vec![0u64; runners.len()];
    let mut read = vec![0u64; runners.len()];
    let mut peak = vec![0u64; runners.len()];
    let mut blocked = vec![0f64; runners.len()];

    let prompts = requests
        .iter()
        .map(|r| Ok(model.tokenize(&r.prompt, true, false)?))
        .collect::<Result<Vec<_>>>()?;
    let fits: Vec<bool> = (requests.iter().zip(&prompts))
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
    let bar = crate::progress::bar(
        cfg.progress,
        (requests.len() * runners.len()) as u64,
        "bench [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
    );
    for ((req, prompt), fits) in requests.iter().zip(&prompts).zip(fits) {
        if !fits {
            report.n_skipped += 1;
            bar.inc(runners.len() as u64);
            continue;
        }
        report.n_requests += 1;
        for (i, runner) in runners.iter_mut().enumerate() {
            bar.set_message(format!("{} {}", req.id, cfg.modes[i]));
            // llama.cpp's own modes run on llama.cpp's kernels alone; `leap:ggml` too.
            leap_backend::set_enabled(
                cfg.kernels && matches!(runner, Runner::Leap(..)) && cfg.modes[i] != "leap:ggml",
            );
            // Under flash each mode's plan runs alone: the others' pins are let go, its own
            // restored (plans differ: `leap` budgets its resident vocabulary out of its own).
            if let Some(st) = &streamers[i] {
                for (j, other) in streamers.iter().enumerate() {
                    if let (true, Some(o)) = (j != i, other) {
                        o.suspend();
                    }
                }
                st.resume()?;
            }
            let g = runner
                .run(prompt, req.max_tokens, cfg)
                .with_context(|| format!("request {} in mode {}", req.id, cfg.modes[i]))?;
            if cfg.modes[i] == "plain" {
                answer.set(&g.tokens);
            }
            cpu[i] += g.decode_cpu_seconds;
            rss[i] = rss[i].max(match runner {
                Runner::Server(s) => s.peak_rss_bytes(),
                _ => peak_rss_bytes(),
            });
            if let Some(st) = &streamers[i] {
                // The decode's calls are the last `target_calls` (prefill came first).
                st.flush();
                let calls = st.calls();
                let n = (g.target_calls as usize).min(calls.len());
                let decode = &calls[calls.len() - n..];
                read[i] += decode.iter().map(|c| c.read_bytes).sum::<u64>();
                blocked[i] += decode.iter().map(|c| c.blocked_seconds).sum::<f64>();
                // Calls that ran llama.cpp's projection node had the output resident whole:
                // where Leap's chunked projection ran the others (Leap's modes, flash-AR),
                // those are its one-off checks against llama.cpp's logits.
                let chunked = decode.iter().any(|c| !c.llama_output);
                peak[i] = peak[i].max(
                    decode
                        .iter()
                        .filter(|c| !(chunked && c.llama_output))
                        .map(|c| c.peak_streamed_resident + st.plan().pinned_bytes + reserved[i])
                        .max()
                        .unwrap_or(0),
                );
            }
            per_mode[i].requests.push(RequestReport {
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

    // Outputs are compared through their hashes (the report's own `output_sha256`).
    let plain_outputs: Option<Vec<String>> = kinds
        .iter()
        .position(|k| *k == ModeKind::Plain)
        .filter(|_| cfg.sampling.temp <= 0.0)
        .map(|p| {
            per_mode[p]
                .requests
                .iter()
                .map(|r| r.output_sha256.clone())
                .collect()
        });
    for (i, mut m) in per_mode.into_iter().enumerate() {
        m.total();
        m.cpu_seconds = cpu[i];
        m.peak_rss_bytes = rss[i];
        m.storage_read_bytes = flash.as_ref().map(|_| read[i]);
        m.flash_peak_resident_bytes = flash.as_ref().map(|_| peak[i]);
        m.flash_blocked_seconds = flash.as_ref().map(|_| blocked[i]);
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
    Ok(report)
}

/// Where a sweep writes the report of budget `b`: `out` with `.flashB` before the extension.
pub fn sweep_path(out: &std::path::Path, b: f64) -> std::path::PathBuf {
    let stem = out
        .file_stem()
        .map_or_else(|| "bench".into(), |s| s.to_string_lossy().into_owned());
    let ext = out
        .extension()
        .map_or_else(|| "json".into(), |e| e.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.flash{b}.{ext}"))
}

/// Lever's Table 6 for a sweep of flash budgets: decode tok/s of every mode at each budget
/// (with `plain` as flash-AR, each mode's speed-up over it and storage bytes per token), as
/// text, and as a bar chart written to `chart`.
///
/// # Errors
/// The chart cannot be written.
pub fn sweep(reports: &[Report], modes: &[String], chart: &std::path::Path) -> Result<String> {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = write!(s, "{:>8}", "budget");
    for m in modes {
        let _ = write!(
            s,
            " {:>16} {:>9} {:>10}",
            format!("{m} tok/s"),
            "vs AR",
            "MB/token"
        );
    }
    let _ = writeln!(s);
    let mut groups = Vec::new();
    for r in reports {
        let b = r.flash_budget.unwrap_or(1.0);
        let ar = r.modes.get("plain").map(|m| m.decode_tokens_per_s);
        let _ = write!(s, "{b:>8}");
        let mut values = Vec::new();
        for m in modes {
            let Some(x) = r.modes.get(m) else {
                let _ = write!(s, " {:>16} {:>9} {:>10}", "-", "-", "-");
                values.push(f64::NAN);
                continue;
            };
            let vs = ar
                .filter(|a| *a > 0.0)
                .map_or("-".into(), |a| format!("{:.2}x", x.decode_tokens_per_s / a));
            let mb =
                x.storage_read_bytes.unwrap_or(0) as f64 / 1e6 / x.generated_tokens.max(1) as f64;
            let _ = write!(s, " {:>16.2} {:>9} {:>10.1}", x.decode_tokens_per_s, vs, mb);
            values.push(x.decode_tokens_per_s);
        }
        let _ = writeln!(s);
        groups.push(chart::Group {
            label: format!("{b}"),
            values,
        });
    }
    let series: Vec<String> = modes
        .iter()
        .map(|m| {
            if m == "plain" {
                "flash-AR (plain)".into()
            } else {
                m.clone()
            }
        })
        .collect();
    let model = reports.first().map_or("", |r| r.model.as_str());
    chart::bar_chart_png(
        chart,
        &format!("Decode speed under a DRAM budget: {model}"),
        "DRAM budget (fraction of the weights)",
        "decode tok/s",
        &series,
        &groups,
    )?;
    Ok(s)
}

/// The human table for stderr: mode, tok/s, speed-up over plain, accepted per call, identical.
pub fn table(report: &Report, order: &[String]) -> String {
    use std::fmt::Write;
    let base = report.modes.get("plain").map(|m| m.decode_tokens_per_s);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<22} {:>9} {:>9} {:>10} {:>9} {:>10} {:>9} {:>11} {:>9} {:>10}  rows verify/exit/out",
        "mode",
        "tok/s",
        "vs plain",
        "acc/call",
        "ms/call",
        "verify ms",
        "draft ms",
        "calib ms/t",
        "cpu s",
        "identical",
    );
    for name in order {
        let Some(m) = report.modes.get(name) else {
            continue;
        };
        let speed = base
            .filter(|b| *b > 0.0)
            .map_or("-".into(), |b| format!("{:.2}x", m.decode_tokens_per_s / b));
        let ident = match m.identical_to_plain {
            Some(true) => "yes".to_string(),
            Some(false) => format!("NO ({})", m.differing_requests.len()),
            None => "-".into(),
        };
        let _ = writeln!(
            s,
            "{:<22} {:>9.2} {:>9} {:>10.2} {:>9.2} {:>10} {:>9.3} {:>11.4} {:>9.2} {:>10}  {}/{}/{}",
            name,
            m.decode_tokens_per_s,
            speed,
            m.mean_accepted_per_call,
            1e3 * m.decode_seconds / m.target_calls.max(1) as f64,
            if m.verify_ms_per_call > 0.0 {
                format!(
                    "{:.2}+{:.2}",
                    m.verify_ms_per_call - m.project_ms_per_call,
                    m.project_ms_per_call
                )
            } else {
                "-".into()
            },
            m.draft_ms_per_call,
            m.calib_ms_per_prompt_token,
            m.cpu_seconds,
            ident,
            m.verify_rows,
            m.rows_after_exit,
            m.output_rows
        );
        if m.exit_accepted > 0 {
            let _ = writeln!(
                s,
                "{:<22} early exit kept {:.0}% of rows past its layer; {}/{} accepted drafts \
                 on kept rows ({:.1}%); deciding {:.2} ms a call",
                "",
                100.0 * m.rows_after_exit as f64 / m.verify_rows.max(1) as f64,
                m.exit_accepted_kept,
                m.exit_accepted,
                100.0 * m.exit_accepted_kept as f64 / m.exit_accepted as f64,
                1e3 * m.exit_seconds / m.target_calls.max(1) as f64
            );
        }
    }
    if let Some(f) = report.flash_budget {
        let _ = writeln!(
            s,
            "flash budget {f}: {:<11} {:>12} {:>12} {:>14} {:>12}",
            "mode", "MB/token", "MB/call", "blocked s/tok", "peak MB"
        );
        for name in order {
            let Some(m) = report.modes.get(name) else {
                continue;
            };
            let read = m.storage_read_bytes.unwrap_or(0) as f64 / 1e6;
            let _ = writeln!(
                s,
                "{:>24} {:>12.1} {:>12.1} {:>14.4} {:>12.1}",
                name,
                read / m.generated_tokens.max(1) as f64,
                read / m.target_calls.max(1) as f64,
                m.flash_blocked_seconds.unwrap_or(0.0) / m.generated_tokens.max(1) as f64,
                m.flash_peak_resident_bytes.unwrap_or(0) as f64 / 1e6,
            );
        }
    }
    s.push_str(&anchor_table(report, order));
    let _ = write!(
        s,
        "{} requests ({} skipped), {} threads, ctx {}, flash-attn {}",
        report.n_requests, report.n_skipped, report.threads, report.ctx, report.flash_attn
    );
    s
}

/// End to end and per task, against the stock llama-server modes of the run (`server:*`):
/// each mode's time to first token, end-to-end tok/s, and decode tok/s per task, with its
/// decode and end-to-end ratios over every `server:*` mode (no ratio columns without one).
/// Empty with fewer than two modes.
pub fn anchor_table(report: &Report, order: &[String]) -> String {
    use std::fmt::Write;
    let anchors: Vec<&String> = order.iter().filter(|m| m.starts_with("server:")).collect();
    let modes: Vec<&String> = order
        .iter()
        .filter(|m| report.modes.contains_key(*m))
        .collect();
    let mut s = String::new();
    if modes.len() < 2 {
        return s;
    }
    let mut tasks: Vec<&str> = Vec::new();
    if let Some(m) = report.modes.get(modes[0]) {
        for r in &m.requests {
            if !tasks.contains(&r.task.as_str()) {
                tasks.push(&r.task);
            }
        }
    }
    tasks.sort_unstable();
    let _ = write!(s, "{:<22} {:>8} {:>9}", "mode", "TTFT s", "e2e tok/s");
    for t in &tasks {
        let _ = write!(s, " {:>12}", format!("{t} tok/s"));
    }
    for a in &anchors {
        let _ = write!(s, " {:>24}", format!("decode/e2e vs {a}"));
    }
    let _ = writeln!(s);
    for name in &modes {
        let m = &report.modes[*name];
        let _ = write!(
            s,
            "{:<22} {:>8.3} {:>9.2}",
            name, m.mean_ttft_seconds, m.e2e_tokens_per_s
        );
        for t in &tasks {
            let (n, secs) = m
                .requests
                .iter()
                .filter(|r| r.task == *t)
                .fold((0usize, 0f64), |(n, d), r| {
                    (n + r.generated_tokens, d + r.decode_seconds)
                });
            let v = if secs > 0.0 { n as f64 / secs } else { 0.0 };
            let _ = write!(s, " {v:>12.2}");
        }
        for a in &anchors {
            let x = &report.modes[*a];
            let r = |u: f64, v: f64| {
                if v > 0.0 {
                    format!("{:.2}x", u / v)
                } else {
                    "-".into()
                }
            };
            let _ = write!(
                s,
                " {:>24}",
                format!(
                    "{} / {}",
                    r(m.decode_tokens_per_s, x.decode_tokens_per_s),
                    r(m.e2e_tokens_per_s, x.e2e_tokens_per_s)
                )
            );
        }
        let _ = writeln!(s);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_names_parse() {
        assert_eq!(ModeKind::parse("plain").unwrap(), ModeKind::Plain);
        assert_eq!(
            ModeKind::parse("llama:ngram-mod").unwrap(),
            ModeKind::Llama("ngram-mod".into())
        );
        assert!(ModeKind::parse("llama:eagle9")
            .unwrap_err()
            .to_string()
            .contains("ngram-simple"));
        assert!(ModeKind::parse("fast").is_err());
        assert_eq!(
            ModeKind::parse("leap").unwrap(),
            ModeKind::Leap(EngineConfig::default())
        );
        assert!(
            matches!(ModeKind::parse("leap:tree").unwrap(), ModeKind::Leap(c) if c.max_branches > 1)
        );
        assert_eq!(
            ModeKind::parse("server:ngram-mod").unwrap(),
            ModeKind::Server("ngram-mod".into())
        );
        assert_eq!(
            ModeKind::parse("server:none").unwrap(),
            ModeKind::Server("none".into())
        );
        assert!(ModeKind::parse("server:leap")
            .unwrap_err()
            .to_string()
            .contains("server:ngram-mod"));
        assert!(ModeKind::parse("leap:warp")
            .unwrap_err()
            .to_string()
            .contains("leap:sam"));
    }
}

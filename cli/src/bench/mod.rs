//! `leap bench`: the benchmark contract of `../shared/BENCH.md`.
//!
//! Every mode gets its own llama.cpp context on the one shared model (so a drafter's state
//! lives across requests, as in llama-server), and the modes run interleaved per request:
//! request 1 in every mode, then request 2, so machine drift hits every mode alike.
//!
//! | module | owns |
//! |---|---|
//! | this one | [`BenchConfig`] and [`run`]: the modes set up, the requests run, the report filled |
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

mod modes;
mod runner;
mod summary;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use leap_host::anchor::{AnchorConfig, LlamaSpeculative};
use leap_host::project::OnDemand;
use leap_host::sampler::SamplingParams;
use leap_host::usage::peak_rss_bytes;
use leap_host::{Context, ContextParams, FlashAttn, Model, ModelParams};
use leap_spec::engine::Engine;
use leap_spec::model_draft::{LlamaDraft, ModelDrafter, Vocab};
use leap_spec::session::vocab_reserve;
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
            cfg.sampling.is_greedy(),
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
                cfg.sampling.is_greedy(),
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
        .filter(|_| cfg.sampling.is_greedy())
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

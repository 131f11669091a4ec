//! The modes of a run put together: what they share (the model, the draft model, the flash plan,
//! plain's answer for `leap:oracle`) and each mode's runner with its own context, device and
//! flash streamer. Leap's modes are sessions of a [`Runtime`] opened with the mode's options on
//! the shared model: the pipeline `leap serve` and the C API run, assembled in one place
//! (`leap_spec::session`); llama.cpp's anchors beside them.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use leap_host::anchor::{AnchorConfig, LlamaSpeculative};
use leap_host::project::OnDemand;
use leap_host::{Context, ContextParams, EvalObserver, Model, ModelParams};
use leap_spec::engine::EngineConfig;
use leap_spec::model_draft::{LlamaDraft, ModelDrafter, Vocab};
use leap_spec::session::{Mode as SessionMode, Options, Runtime};

use super::modes::ModeKind;
use super::runner::Runner;
use super::{oracle, stock, BenchConfig};

/// What every mode of a run shares.
pub(super) struct Shared {
    pub model: Arc<Model>,
    draft_model: Option<Arc<Model>>,
    /// Every mode's context parameters (a Leap mode's sequences set on top).
    cparams: ContextParams,
    /// Flash streaming: the layer map and the plan every mode starts from.
    pub flash: Option<(leap_flash::LayerMap, leap_flash::Plan)>,
    /// The stock llama-server of the `server:*` modes.
    server_bin: Option<PathBuf>,
    /// Plain's answer to the current request, for `leap:oracle`.
    pub answer: oracle::Answer,
}

/// One mode, ready to run requests.
pub(super) struct Mode {
    pub runner: Runner,
    /// Its flash streamer, for plain decoding (a Leap session has its own).
    streamer: Option<leap_flash::Streamer>,
    /// Bytes it keeps resident besides its plan's (budgeted out of the plan).
    pub reserved: u64,
}

impl Mode {
    /// Its flash streamer (each mode's context has its own hooks).
    pub fn streamer(&self) -> Option<&leap_flash::Streamer> {
        match &self.runner {
            Runner::Leap(s) => s.streamer(),
            _ => self.streamer.as_ref(),
        }
    }
}

impl Shared {
    /// Load the models and plan what the modes `kinds` need.
    pub fn open(cfg: &BenchConfig, kinds: &[ModeKind]) -> Result<Self> {
        let servers = kinds.iter().any(|k| matches!(k, ModeKind::Server(_)));
        let server_bin = if servers {
            Some(stock::find_server(cfg.server_bin.as_deref())?)
        } else {
            None
        };
        let model = Model::load(&cfg.model, &ModelParams::default())
            .with_context(|| format!("loading target {}", cfg.model.display()))?;
        leap_spec::session::check_ctx(&model, cfg.ctx)
            .map_err(|e| anyhow::anyhow!("--ctx: {e}"))?;
        let draft_model = match &cfg.draft {
            Some(p) => Some(
                Model::load(p, &ModelParams::default())
                    .with_context(|| format!("loading draft {}", p.display()))?,
            ),
            None => None,
        };
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
        Ok(Self {
            model,
            draft_model,
            cparams: ContextParams {
                n_ctx: cfg.ctx,
                n_threads: cfg.threads,
                n_threads_batch: cfg.threads,
                flash_attn: cfg.flash_attn,
                ..Default::default()
            },
            flash,
            server_bin,
            answer: oracle::Answer::default(),
        })
    }
}

/// Every mode of `cfg` (kinds `kinds`), in order.
pub(super) fn modes(cfg: &BenchConfig, kinds: &[ModeKind], shared: &Shared) -> Result<Vec<Mode>> {
    cfg.modes
        .iter()
        .zip(kinds)
        .map(|(name, kind)| mode(cfg, shared, name, kind))
        .collect()
}

/// Mode `name` (of kind `kind`): its runner on a context of its own.
fn mode(cfg: &BenchConfig, sh: &Shared, name: &str, kind: &ModeKind) -> Result<Mode> {
    match kind {
        ModeKind::Server(t) => {
            let bin = sh.server_bin.as_deref().expect("found in Shared::open");
            eprintln!("bench: starting {} --spec-type {t}", bin.display());
            let server = stock::StockServer::start(&stock::ServerConfig {
                bin,
                model: &cfg.model,
                draft: cfg.draft.as_deref(),
                spec_type: t,
                threads: cfg.threads,
                ctx: cfg.ctx,
            })?;
            Ok(Mode {
                runner: Runner::Server(Box::new(server)),
                streamer: None,
                reserved: 0,
            })
        }
        ModeKind::Leap(ec) => leap_mode(cfg, sh, name, ec),
        ModeKind::Plain | ModeKind::Llama(_) => {
            // llama.cpp's own modes run on llama.cpp's kernels alone.
            let device = leap_backend::Device::new(leap_backend::DeviceConfig::off());
            let streamer = sh
                .flash
                .as_ref()
                .map(|(map, p)| leap_flash::Streamer::new(&cfg.model, map.clone(), p.clone(), 1))
                .transpose()?;
            let observer = streamer.as_ref().map(|s| s.observer());
            let runner = match kind {
                ModeKind::Plain if streamer.is_some() => {
                    // flash-AR: the same streaming as Leap's modes, without speculation;
                    // Leap's output projection reads streamed output weights a chunk at a time.
                    let (target, od) = device
                        .bind(|| OnDemand::context_with(&sh.model, &sh.cparams, observer))
                        .with_context(|| format!("creating the context for mode {name}"))?;
                    let st = streamer.as_ref().expect("checked");
                    Runner::Plain(target, od.map(|od| st.stream_projection(od)))
                }
                ModeKind::Llama(t) => llama_runner(cfg, sh, name, t, &device, observer)?,
                _ => Runner::Plain(target(sh, &device, name, observer)?, None),
            };
            Ok(Mode {
                runner,
                streamer,
                reserved: 0,
            })
        }
    }
}

/// `llama:TYPE`: llama.cpp's speculative decoding of that type.
fn llama_runner(
    cfg: &BenchConfig,
    sh: &Shared,
    name: &str,
    t: &str,
    device: &leap_backend::Device,
    observer: Option<Box<dyn EvalObserver>>,
) -> Result<Runner> {
    let target = target(sh, device, name, observer)?;
    let dctx = match (&sh.draft_model, t) {
        (Some(dm), "draft-simple") => Some(device.bind(|| Context::new(dm, &sh.cparams))?),
        _ => None,
    };
    let anchor = AnchorConfig {
        sampling: cfg.sampling,
        ..Default::default()
    };
    Ok(Runner::Llama(Box::new(
        LlamaSpeculative::new(target, dctx, t, &anchor).with_context(|| format!("mode {name}"))?,
    )))
}

/// A mode's target context with llama.cpp's logits, on `device`.
fn target(
    sh: &Shared,
    device: &leap_backend::Device,
    name: &str,
    observer: Option<Box<dyn EvalObserver>>,
) -> Result<Context> {
    device
        .bind(|| Context::with_observer(&sh.model, &sh.cparams, observer))
        .with_context(|| format!("creating the context for mode {name}"))
}

/// A Leap mode: a session of a runtime on the shared model with the mode's engine
/// configuration `ec` (its own device: Leap's kernels unless `leap:ggml`; under flash its
/// streamer and resident vocabulary, `Runtime::flash_reserve`), with the draft model's drafter
/// (`leap:draft`) or the oracle's (`leap:oracle`) added.
fn leap_mode(cfg: &BenchConfig, sh: &Shared, name: &str, ec: &EngineConfig) -> Result<Mode> {
    let opts = Options {
        threads: cfg.threads,
        n_ctx: cfg.ctx,
        mode: SessionMode::Leap,
        leap_kernels: cfg.kernels && name != "leap:ggml",
        sidecar: cfg.sidecar.clone(),
        flash_budget: sh.flash.as_ref().map(|(_, p)| p.budget),
        flash_strategy: cfg.flash_strategy,
        flash_attn: cfg.flash_attn,
        engine: ec.clone(),
        ..Options::default()
    };
    let rt = Runtime::with_model(Arc::clone(&sh.model), &opts)
        .with_context(|| format!("mode {name}"))?;
    let mut session = rt
        .session()
        .with_context(|| format!("creating the context for mode {name}"))?;
    if name == "leap:draft" {
        let dm = sh
            .draft_model
            .as_ref()
            .expect("checked in modes::parse_all");
        let dctx = rt
            .new_device()
            .bind(|| Context::new(dm, &sh.cparams))
            .with_context(|| format!("creating the draft context for mode {name}"))?;
        let target: Arc<dyn Vocab + Send + Sync> = sh.model.clone();
        session.add_drafter(Box::new(ModelDrafter::new(
            LlamaDraft::new(dm.clone(), dctx),
            target,
        )));
    }
    if name == "leap:oracle" {
        session.add_drafter(Box::new(oracle::Oracle::new(sh.answer.clone())));
    }
    Ok(Mode {
        runner: Runner::Leap(Box::new(session)),
        streamer: None,
        reserved: rt.flash_reserve(),
    })
}

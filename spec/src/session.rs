//! The engine API every front end uses: `leap generate`, `leap serve` (`server/`) and the C API
//! (`capi/`, `include/leap.h`). A [`Runtime`] is an open model with its options (kernels, the
//! sidecar's early-exit head, a flash budget); a [`Session`] is one llama.cpp context on it with
//! the engine that decodes there, kept across requests so that the conversation's earlier
//! requests and answers feed the drafter (sd.npu's history) and the controller keeps what it
//! measured.
//!
//! ```no_run
//! use leap_spec::session::{Options, Request, Runtime};
//! let rt = Runtime::open("gemma-3-270m-it-Q4_K_M.gguf".as_ref(), &Options::default())?;
//! let mut s = rt.session()?;
//! let prompt = rt.model().tokenize("The capital of France is", true, false)?;
//! let out = s.generate(&prompt, &Request { max_tokens: 16, ..Default::default() }, &mut |_| true)?;
//! println!("{} tokens in {} target calls", out.tokens.len(), out.target_calls);
//! # Ok::<(), leap_spec::session::Error>(())
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use leap_host::exit::Exit;
use leap_host::model::ChatMessage;
use leap_host::project::OnDemand;
use leap_host::sampler::SamplingParams;
use leap_host::{Context, ContextParams, FlashAttn, Model, ModelParams, Token};

use crate::ahead::Ahead;
use crate::engine::{Engine, EngineConfig};
use crate::exit::{ModelShape, Pruner};
use crate::head::Head;
use crate::plain::{self, Generation};
use crate::sam::SuffixAutomaton;

/// How a session decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Leap's speculative engine: the tokens plain greedy decoding gives (or, sampled, the
    /// same distribution) in fewer target calls.
    #[default]
    Leap,
    /// llama.cpp alone: one target call per token.
    Plain,
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "leap" => Ok(Self::Leap),
            "plain" => Ok(Self::Plain),
            _ => Err(Error::InvalidArgument(format!(
                "mode {s:?}: `leap` or `plain`"
            ))),
        }
    }
}

/// What a [`Runtime`] is opened with.
#[derive(Debug, Clone)]
pub struct Options {
    /// Threads for decoding and prefill (each session's).
    pub threads: i32,
    /// Context length of each session, in tokens (prompt and output together).
    pub n_ctx: u32,
    /// Prefill batch.
    pub n_batch: usize,
    /// Leap's engine or plain decoding.
    pub mode: Mode,
    /// Leap's ggml device computes the quantized matrix products (else ggml's CPU backend
    /// alone). This runtime's sessions only: another runtime in the process keeps its own
    /// ([`Session::device`]).
    pub leap_kernels: bool,
    /// Leap's sparse attention (shadowAttn) on the device, with these settings; needs
    /// `leap_kernels` and flash attention. Approximate: output may differ from dense
    /// attention.
    pub sparse: Option<leap_backend::attn::Sparse>,
    /// The model's sidecar (default: `MODEL.leap.gguf` next to the model): its early-exit
    /// head lets the engine prune verification rows. A head it cannot use is ignored with a
    /// warning.
    pub sidecar: Option<PathBuf>,
    /// Flash streaming: bytes of the model's weights kept in DRAM, the rest read from storage
    /// by every target call (`None`: all resident).
    pub flash_budget: Option<u64>,
    /// What stays resident under the flash budget.
    pub flash_strategy: leap_flash::Strategy,
    /// llama.cpp's flash attention (off keeps speculative output identical to plain).
    pub flash_attn: FlashAttn,
    /// The engine's drafting and tree limits.
    pub engine: EngineConfig,
}

impl Options {
    /// Check the options a user sets are in range (what [`Runtime::open`] checks first; a
    /// server checks it before it listens).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the option and its range.
    pub fn validate(&self) -> Result<()> {
        if self.threads < 1 {
            return Err(Error::InvalidArgument(format!(
                "threads {}: at least 1",
                self.threads
            )));
        }
        if self.n_ctx < 16 {
            return Err(Error::InvalidArgument(format!(
                "context {}: at least 16 tokens",
                self.n_ctx
            )));
        }
        if self.n_batch == 0 {
            return Err(Error::InvalidArgument("n_batch: at least 1".into()));
        }
        if self.sparse.is_some() && !self.leap_kernels {
            return Err(Error::InvalidArgument(
                "sparse attention runs on Leap's device: it needs leap_kernels".into(),
            ));
        }
        Ok(())
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            threads: leap_host::par::default_threads(),
            n_ctx: 4096,
            n_batch: 512,
            mode: Mode::Leap,
            leap_kernels: true,
            sparse: None,
            sidecar: None,
            flash_budget: None,
            flash_strategy: leap_flash::Strategy::default(),
            flash_attn: FlashAttn::Off,
            engine: EngineConfig::default(),
        }
    }
}

/// What went wrong, with a kind a caller can branch on ([`Error::code`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter out of range or of the wrong form.
    #[error("{0}")]
    InvalidArgument(String),
    /// The prompt and the tokens asked for do not fit the session's context.
    #[error(
        "the prompt ({prompt} tokens) and max_tokens ({max_tokens}) exceed the context of \
         {n_ctx} tokens; shorten the prompt, lower max_tokens or raise the context length"
    )]
    ContextFull {
        prompt: usize,
        max_tokens: usize,
        n_ctx: u32,
    },
    /// llama.cpp or Leap's host layer failed (loading, decoding, tokenizing).
    #[error(transparent)]
    Host(#[from] leap_host::Error),
    /// Flash streaming could not map or read the model file.
    #[error(transparent)]
    Flash(#[from] leap_flash::Error),
}

impl Error {
    /// Whether a [`Session::set_cancel`] check stopped the generation.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, Error::Host(leap_host::Error::Cancelled))
    }

    /// A stable number per kind (the C API's `leap_status`): 1 invalid argument, 2 does not
    /// fit the context, 3 model file missing or unreadable, 4 anything else llama.cpp failed.
    pub fn code(&self) -> i32 {
        use leap_host::Error as H;
        match self {
            Error::InvalidArgument(_) => 1,
            Error::ContextFull { .. } | Error::Host(H::KvCacheFull { .. }) => 2,
            Error::Host(
                H::ModelNotFound { .. }
                | H::InvalidGguf { .. }
                | H::TruncatedGguf { .. }
                | H::ModelLoad { .. },
            ) => 3,
            Error::Host(H::Tokenize { .. } | H::InvalidToken { .. } | H::NulByte { .. }) => 1,
            Error::Host(_) | Error::Flash(_) => 4,
        }
    }
}

/// This module's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One generation's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling (greedy below [`SamplingParams::GREEDY_BELOW`]).
    pub sampling: SamplingParams,
}

impl Default for Request {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::default(),
        }
    }
}

/// An open model and how its sessions decode. Shareable between threads (`Arc`).
pub struct Runtime {
    model: Arc<Model>,
    opts: Options,
    head: Option<Arc<Head>>,
    /// The head that guesses the token after next ([`crate::ahead`]).
    ahead: Option<Arc<Ahead>>,
    /// The model's answers to other prompts ([`crate::corpus`]), shared by every session.
    corpus: Option<Arc<SuffixAutomaton>>,
    flash: Option<Flash>,
}

/// A flash plan for the model (each session streams with its own [`leap_flash::Streamer`]).
struct Flash {
    map: leap_flash::LayerMap,
    plan: leap_flash::Plan,
    /// Bytes of draft vocabulary kept resident besides the plan ([`vocab_reserve`]).
    reserve: u64,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("model", &self.model.desc())
            .field("opts", &self.opts)
            .field("head", &self.head.as_ref().map(|h| h.layer))
            .field("ahead", &self.ahead.is_some())
            .field("corpus", &self.corpus.as_ref().map(|c| c.len()))
            .finish()
    }
}

impl Runtime {
    /// Load the model at `path` with `opts`: registers Leap's ggml device first when
    /// `opts.leap_kernels` (its settings are this runtime's sessions' own,
    /// [`Runtime::device_config`]), and reads the sidecar's early-exit head in [`Mode::Leap`].
    ///
    /// # Errors
    /// Options out of range, a model file that is missing or that llama.cpp cannot load.
    pub fn open(path: &Path, opts: &Options) -> Result<Self> {
        Self::open_reporting(path, opts, None)
    }

    /// [`Runtime::open`], with the weights' load reported to `progress`
    /// ([`Model::load_reporting`]: a `false` stops it, `leap_host::Error::Cancelled`).
    ///
    /// # Errors
    /// As [`Runtime::open`]; the load stopped by `progress`.
    pub fn open_reporting(
        path: &Path,
        opts: &Options,
        progress: Option<&mut dyn FnMut(f32) -> bool>,
    ) -> Result<Self> {
        opts.validate()?;
        let model = Model::load_reporting(path, &ModelParams::default(), progress)?;
        Self::with_model(model, opts)
    }

    /// [`Runtime::open`] over a model already loaded (several runtimes, each with its own
    /// options, may share one: `leap bench`'s modes).
    ///
    /// # Errors
    /// Options out of range, a context the model cannot hold, a model file flash streaming
    /// cannot map.
    pub fn with_model(model: Arc<Model>, opts: &Options) -> Result<Self> {
        opts.validate()?;
        if opts.leap_kernels {
            leap_backend::register();
        }
        check_ctx(&model, opts.n_ctx)?;
        let flash = match opts.flash_budget {
            Some(budget) => {
                let map = leap_flash::LayerMap::open(model.path())?;
                let reserve = vocab_reserve(
                    &map,
                    budget,
                    model.n_vocab(),
                    opts.engine.vocab.filter(|_| opts.mode == Mode::Leap),
                    true,
                );
                let plan = leap_flash::plan(
                    &map,
                    budget.saturating_sub(reserve),
                    map.largest_block().max(1),
                    1,
                    opts.flash_strategy,
                );
                log::info!(
                    "flash budget {:.1} MB: {:.1} MB pinned, {:.1} MB of draft vocabulary, \
                     {:.1} MB read from storage every target call",
                    budget as f64 / 1e6,
                    plan.pinned_bytes as f64 / 1e6,
                    reserve as f64 / 1e6,
                    plan.streamed_bytes as f64 / 1e6
                );
                Some(Flash { map, plan, reserve })
            }
            None => None,
        };
        // The early-exit head (not under flash streaming, where a call's cost is its reads).
        let head = (opts.mode == Mode::Leap && flash.is_none())
            .then(|| load_head(&model, opts.sidecar.as_deref()))
            .flatten()
            .map(Arc::new);
        let ahead = (opts.mode == Mode::Leap && flash.is_none())
            .then(|| load_ahead(&model, opts.sidecar.as_deref()))
            .flatten()
            .map(Arc::new);
        let corpus = (opts.mode == Mode::Leap)
            .then(|| load_corpus(&model, opts.sidecar.as_deref()))
            .flatten();
        Ok(Self {
            model,
            opts: opts.clone(),
            head,
            ahead,
            corpus,
            flash,
        })
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Under a flash budget, the bytes of draft vocabulary each session keeps resident besides
    /// the plan's ([`vocab_reserve`]); 0 otherwise.
    pub fn flash_reserve(&self) -> u64 {
        self.flash.as_ref().map_or(0, |f| f.reserve)
    }

    /// What Leap's device does for this runtime's contexts (each session's context gets a
    /// [`leap_backend::Device`] of its own with these settings).
    pub fn device_config(&self) -> leap_backend::DeviceConfig {
        leap_backend::DeviceConfig {
            kernels: self.opts.leap_kernels,
            sparse: self.opts.sparse.clone(),
            ..leap_backend::DeviceConfig::default()
        }
    }

    /// A device with [`Runtime::device_config`], for a context of this model made elsewhere
    /// ([`leap_backend::Device::bind`]).
    pub fn new_device(&self) -> leap_backend::Device {
        leap_backend::Device::new(self.device_config())
    }

    /// `text` as the prompt `leap generate` and the C API decode: with `chat`, one user
    /// message in the model's chat template (the template's control tokens as control
    /// tokens, the text as text: [`Model::chat_tokens`]); else the text as it is (control-token
    /// text in it is text too). BOS as the model wants it.
    ///
    /// # Errors
    /// A template llama.cpp cannot apply; tokenization.
    pub fn prompt_tokens(&self, text: &str, chat: bool) -> Result<Vec<Token>> {
        if chat {
            let msg = ChatMessage {
                role: "user".into(),
                content: text.into(),
            };
            Ok(self.model.chat_tokens(&[msg], true)?)
        } else {
            Ok(self.model.tokenize(text, true, false)?)
        }
    }

    /// The options it was opened with.
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// Whether the sidecar's early-exit head is in use.
    pub fn has_exit_head(&self) -> bool {
        self.head.is_some()
    }

    /// A new session: its own context (KV cache) and engine.
    ///
    /// # Errors
    /// Context creation (memory), a streamed model file that cannot be opened.
    pub fn session(&self) -> Result<Session> {
        self.session_with_ctx(self.opts.n_ctx)
    }

    /// [`Runtime::session`] with a context of `n_ctx` tokens instead of the options'.
    ///
    /// # Errors
    /// As [`Runtime::session`].
    pub fn session_with_ctx(&self, n_ctx: u32) -> Result<Session> {
        let o = &self.opts;
        let mut params = ContextParams {
            n_ctx,
            n_threads: o.threads,
            n_threads_batch: o.threads,
            flash_attn: o.flash_attn,
            ..Default::default()
        };
        let mut config = o.engine.clone();
        let streamer = match &self.flash {
            Some(f) => {
                config = config.streamed();
                config.max_branches = config.max_branches.max(4);
                Some(leap_flash::Streamer::new(
                    self.model.path(),
                    f.map.clone(),
                    f.plan.clone(),
                    1,
                )?)
            }
            None => None,
        };
        params.n_seq_max = config.max_branches.max(1) as u32;
        let device = self.new_device();
        let exit = self.head.as_ref().map(|h| {
            let publish = {
                let device = device.clone();
                Arc::new(move |mask| device.exit_mask(mask)) as leap_host::exit::Publish
            };
            let (exit, obs) = Exit::new(h.layer, publish);
            let pruner = Pruner {
                head: Arc::clone(h),
                n_layer: self.model.n_layer() as u32,
            };
            ((exit, pruner), obs)
        });
        let (exit, exit_obs) = match exit {
            Some((e, o)) => (Some(e), Some(o)),
            None => (None, None),
        };
        let (ctx, od) = if o.mode == Mode::Leap || streamer.is_some() {
            let observers: Vec<_> = streamer
                .as_ref()
                .map(leap_flash::Streamer::observer)
                .into_iter()
                .chain(exit_obs)
                .collect();
            let first: Option<Box<dyn leap_host::EvalObserver>> = match observers.len() {
                0 => None,
                1 => observers.into_iter().next(),
                _ => Some(Box::new(leap_host::Chain::new(observers))),
            };
            device.bind(|| OnDemand::context_with(&self.model, &params, first))?
        } else {
            (device.bind(|| Context::new(&self.model, &params))?, None)
        };
        // Leap's projection reads streamed output weights a chunk at a time, within the budget.
        let od = od.map(|o| match &streamer {
            Some(s) => s.stream_projection(o),
            None => o,
        });
        let (engine, plain_od) = match o.mode {
            Mode::Leap => (
                Some(
                    Engine::new(config)
                        .with_on_demand(od)
                        .with_exit(exit)
                        .with_ahead(self.ahead.clone())
                        .with_corpus(self.corpus.clone()),
                ),
                None,
            ),
            Mode::Plain => (None, od.filter(OnDemand::streamed)),
        };
        Ok(Session {
            ctx,
            device,
            engine,
            plain_od,
            streamer,
            n_batch: o.n_batch,
            kv: Vec::new(),
            cached_tokens: 0,
            totals: Totals::default(),
        })
    }
}

/// What a session has done so far, summed over its generations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    /// Generations run.
    pub requests: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Target calls during decoding.
    pub target_calls: u64,
    /// Seconds of decoding (after each prompt's prefill).
    pub decode_seconds: f64,
    /// Seconds of prefill.
    pub prefill_seconds: f64,
}

impl Totals {
    /// Tokens per target call (1.0 for plain decoding).
    pub fn accepted_per_call(&self) -> f64 {
        if self.target_calls == 0 {
            0.0
        } else {
            self.tokens as f64 / self.target_calls as f64
        }
    }
}

/// One context and the engine decoding in it. Not shared between threads: give each thread
/// (a server's slot) its own. It keeps the KV cache of its last prompt and output, so a
/// request that extends them (a conversation's next turn) prefills only what is new.
pub struct Session {
    ctx: Context,
    /// Leap's device for `ctx`: its settings and counters.
    device: leap_backend::Device,
    engine: Option<Engine>,
    /// Plain decoding's streamed projection (flash).
    plain_od: Option<OnDemand>,
    streamer: Option<leap_flash::Streamer>,
    n_batch: usize,
    /// The tokens sequence 0 holds at positions `0..kv.len()` after the last generation.
    kv: Vec<Token>,
    /// Prompt tokens the last generation found in the cache.
    cached_tokens: usize,
    totals: Totals,
}

impl Session {
    /// Context length in tokens.
    pub fn n_ctx(&self) -> u32 {
        self.ctx.n_ctx()
    }

    /// Leap's device for this session's context: its settings and what it computed.
    pub fn device(&self) -> &leap_backend::Device {
        &self.device
    }

    /// Draft with `drafter` too (Leap's mode; plain decoding has no drafts), besides the
    /// engine's own sources ([`Engine::with_drafter`]).
    pub fn add_drafter(&mut self, drafter: Box<dyn crate::draft::Drafter + Send>) {
        self.engine = self.engine.take().map(|e| e.with_drafter(drafter));
    }

    /// Prompt tokens of the last generation whose KV cache was kept from the one before (a
    /// conversation's earlier turns), so not prefilled again.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// The tokens whose KV cache this session keeps: its last prompt and output (all but the
    /// last token, which never went through the target).
    pub fn held(&self) -> &[Token] {
        &self.kv
    }

    /// Forget the kept KV cache: the next generation prefills its whole prompt.
    pub fn forget_prefix(&mut self) {
        self.kv.clear();
    }

    /// Forget everything earlier generations left: the KV cache kept and the engine's history
    /// of their texts and drafts ([`Engine::forget`]). What the next generation does and how
    /// long it takes then say nothing about earlier ones (a server between two clients).
    pub fn forget(&mut self) {
        self.kv.clear();
        if let Some(e) = self.engine.as_mut() {
            e.forget();
        }
    }

    /// Check `cancel` during every decode from now on (`None`: stop checking): when it
    /// returns true, the generation stops within a graph node, prefill included, and fails
    /// with `leap_host::Error::Cancelled` ([`Error::is_cancelled`]).
    pub fn set_cancel(&mut self, cancel: Option<leap_host::Cancel>) {
        self.ctx.set_cancel(cancel);
    }

    /// Everything this session generated so far.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// The flash streamer, when the runtime streams weights.
    pub fn streamer(&self) -> Option<&leap_flash::Streamer> {
        self.streamer.as_ref()
    }

    /// Whether `prompt_len` tokens and `max_tokens` more fit this session's context.
    ///
    /// # Errors
    /// [`Error::ContextFull`], or an empty prompt.
    pub fn check_fits(&self, prompt_len: usize, max_tokens: usize) -> Result<()> {
        fits(prompt_len, max_tokens, self.n_ctx())
    }

    /// Generate from `prompt` (token ids, BOS included when the model wants one): up to
    /// `req.max_tokens` tokens or an end-of-generation token (kept, and not passed to
    /// `on_token`), calling `on_token` with each token as it is accepted; `on_token` returning
    /// false stops the generation there (the tokens so far are returned). Greedy output is
    /// token for token plain decoding's; sampled output keeps its distribution.
    ///
    /// # Errors
    /// [`Error::ContextFull`] before any work when the request does not fit; decode failures.
    pub fn generate(
        &mut self,
        prompt: &[Token],
        req: &Request,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        self.generate_with(prompt, req, None, on_token)
    }

    /// [`Session::generate`] under `grammar` (structured output): each token is chosen among
    /// those the grammar allows. Greedy output is plain decoding's under the same grammar
    /// (`plain::plain_from`), drafted in Leap's mode (drafts the grammar refuses are cut,
    /// see [`crate::engine::Engine::generate_from`]); sampled output is the target's
    /// distribution restricted to the grammar, decoded plainly in either mode.
    ///
    /// # Errors
    /// As [`Session::generate`].
    pub fn generate_constrained(
        &mut self,
        prompt: &[Token],
        req: &Request,
        grammar: &mut leap_host::grammar::Grammar,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        self.generate_with(prompt, req, Some(grammar), on_token)
    }

    fn generate_with(
        &mut self,
        prompt: &[Token],
        req: &Request,
        grammar: Option<&mut leap_host::grammar::Grammar>,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        self.check_fits(prompt.len(), req.max_tokens)?;
        if !(req.sampling.temp.is_finite()
            && (0.0..=1.0).contains(&req.sampling.top_p)
            && (0.0..=1.0).contains(&req.sampling.min_p))
        {
            return Err(Error::InvalidArgument(format!(
                "sampling parameters out of range: temperature {}, top_p {} and min_p {} \
                 (top_p and min_p from 0 to 1)",
                req.sampling.temp, req.sampling.top_p, req.sampling.min_p
            )));
        }
        let cached = common_prefix(&self.kv, prompt).min(prompt.len() - 1);
        // Until this generation ends well, nothing in the cache is known.
        self.kv.clear();
        let g = self.run(prompt, cached, req, grammar, on_token);
        // This thread may not decode again soon (a server slot between requests, an app's
        // thread): its OpenMP team goes, or teams of idle threads slow every other one.
        leap_host::par::release_team();
        let g = g?;
        // Every token but the last went through the target after the prompt.
        self.kv.extend_from_slice(prompt);
        self.kv
            .extend_from_slice(&g.tokens[..g.tokens.len().saturating_sub(1)]);
        self.cached_tokens = cached;
        let t = &mut self.totals;
        t.requests += 1;
        t.prompt_tokens += prompt.len() as u64;
        t.tokens += g.tokens.len() as u64;
        t.target_calls += g.target_calls;
        t.decode_seconds += g.decode_seconds;
        t.prefill_seconds += g.prefill_seconds;
        Ok(g)
    }

    /// The target's log-probabilities of `emitted` (a prefix of the tokens the last
    /// [`Session::generate`] from `prompt` returned) and, with each, the `top_n` most likely
    /// tokens at that position: what OpenAI's `logprobs` report. They are the log-softmax of
    /// the logits plain decoding computes at each position (temperature 1, nothing truncated),
    /// from one pass over the emitted tokens after the generation, so they are the same
    /// whether or not the tokens were drafted: the rows of a batch are computed as one row is
    /// (`leap_host`'s kernels are batch-invariant, flash attention is off). The pass costs
    /// about a prefill of `emitted` and rewrites only the cache cells it reads back.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `emitted` is not what the cache holds after `prompt`,
    /// or under flash streaming (the output weights are not llama.cpp's then); decode
    /// failures.
    pub fn score(
        &mut self,
        prompt: &[Token],
        emitted: &[Token],
        top_n: usize,
    ) -> Result<Vec<TokenLogprob>> {
        if emitted.is_empty() {
            return Ok(Vec::new());
        }
        if self.streamer.is_some() || self.plain_od.is_some() {
            return Err(Error::InvalidArgument(
                "log-probabilities are not available while the weights are streamed (--flash-budget)".into(),
            ));
        }
        let p = prompt.len();
        let held = p + emitted.len() - 1;
        if p == 0
            || self.kv.len() < held
            || self.kv[..p] != *prompt
            || self.kv[p..held] != emitted[..emitted.len() - 1]
        {
            return Err(Error::InvalidArgument(
                "score: the tokens are not the last generation's".into(),
            ));
        }
        // Row i reads the token before emitted[i] at position p - 1 + i.
        let inputs: Vec<Token> = std::iter::once(prompt[p - 1])
            .chain(emitted[..emitted.len() - 1].iter().copied())
            .collect();
        self.kv.truncate(p - 1);
        self.ctx.seq_rm(0, (p - 1) as i32, -1);
        const ROWS: usize = 16;
        let mut out = Vec::with_capacity(emitted.len());
        let mut bt = leap_host::Batch::new(ROWS, 1);
        for (c, chunk) in inputs.chunks(ROWS).enumerate() {
            bt.clear();
            for (j, &t) in chunk.iter().enumerate() {
                bt.add(t, (p - 1 + c * ROWS + j) as i32, &[0], true)?;
            }
            self.ctx.decode(&bt)?;
            self.kv.extend_from_slice(chunk);
            for j in 0..chunk.len() {
                let logits = self.ctx.logits(j as i32)?;
                out.push(TokenLogprob::of(logits, emitted[c * ROWS + j], top_n));
            }
        }
        // The cache holds the prompt and every emitted token but the last again.
        Ok(out)
    }

    /// The generation itself: Leap's engine, or plain decoding.
    fn run(
        &mut self,
        prompt: &[Token],
        cached: usize,
        req: &Request,
        grammar: Option<&mut leap_host::grammar::Grammar>,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        Ok(match self.engine.as_mut() {
            // Under a grammar too: greedy drafts, sampled decodes plainly (see the engine).
            Some(e) => e.generate_from(
                &mut self.ctx,
                prompt,
                cached,
                req.max_tokens,
                self.n_batch,
                &req.sampling,
                grammar,
                on_token,
            )?,
            None => plain::plain_from(
                &mut self.ctx,
                self.plain_od.as_ref(),
                prompt,
                cached,
                req.max_tokens,
                &req.sampling,
                self.n_batch,
                grammar,
                on_token,
            )?,
        })
    }
}

/// A token's log-probability and the most likely tokens at its position
/// ([`Session::score`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: Token,
    /// Natural log of its probability under the target.
    pub logprob: f32,
    /// The most likely tokens there, most likely first (ties: the lower id).
    pub top: Vec<(Token, f32)>,
}

impl TokenLogprob {
    /// The log-softmax of `logits` at `token`, and its `top_n` best entries: one pass for the
    /// maximum and the best entries, one for the normaliser.
    pub fn of(logits: &[f32], token: Token, top_n: usize) -> Self {
        let mut max = f32::NEG_INFINITY;
        let mut top: Vec<(Token, f32)> = Vec::with_capacity(top_n + 1);
        for (i, &l) in logits.iter().enumerate() {
            max = max.max(l);
            if top_n == 0 || (top.len() == top_n && l <= top[top_n - 1].1) {
                continue;
            }
            let at = top.partition_point(|&(_, x)| x >= l);
            top.insert(at, (i as Token, l));
            top.truncate(top_n);
        }
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let norm = f64::from(max) + sum.ln();
        let lp = |l: f32| (f64::from(l) - norm) as f32;
        Self {
            token,
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&l| lp(l)),
            top: top.into_iter().map(|(t, l)| (t, lp(l))).collect(),
        }
    }
}

/// Whether a context of `n_ctx` tokens is within what `model` was trained on: beyond it the
/// model's positions are ones it never saw (llama.cpp only warns), and a huge `--ctx` would
/// otherwise ask for a KV cache the machine cannot hold.
///
/// # Errors
/// [`Error::InvalidArgument`] saying the model's trained context.
pub fn check_ctx(model: &Model, n_ctx: u32) -> Result<()> {
    let train = model.n_ctx_train();
    if train > 0 && i64::from(n_ctx) > i64::from(train) {
        return Err(Error::InvalidArgument(format!(
            "context {n_ctx}: more than the {train} tokens the model ({}) was trained on",
            model.desc()
        )));
    }
    Ok(())
}

/// Whether a prompt of `prompt_len` tokens and `max_tokens` more fit a context of `n_ctx`
/// (what [`Session::generate`] checks first; a server checks it before queueing).
///
/// # Errors
/// [`Error::ContextFull`], or an empty prompt.
pub fn fits(prompt_len: usize, max_tokens: usize, n_ctx: u32) -> Result<()> {
    if prompt_len == 0 {
        return Err(Error::InvalidArgument("the prompt is empty".into()));
    }
    if prompt_len + max_tokens > n_ctx as usize {
        return Err(Error::ContextFull {
            prompt: prompt_len,
            max_tokens,
            n_ctx,
        });
    }
    Ok(())
}

/// How many tokens `a` and `b` begin with alike.
fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Bytes of the draft vocabulary's rows that greedy self-drafting keeps resident under a
/// flash budget ([`crate::vocab`]): they come out of the DRAM budget before the plan. None
/// for sampled decoding (trees), nor when `budget` holds the whole model (nothing streams, and
/// the rows are drafted from the resident weights' own budget-free copy).
pub fn vocab_reserve(
    map: &leap_flash::LayerMap,
    budget: u64,
    n_vocab: i32,
    vc: Option<crate::vocab::VocabConfig>,
    greedy: bool,
) -> u64 {
    if !greedy || budget >= map.per_call_bytes() {
        return 0;
    }
    vc.map_or(0, |v| {
        let out = if map.tied_output {
            leap_flash::Section::Embed
        } else {
            leap_flash::Section::Output
        };
        v.resident_rows() as u64 * (map.bytes(out) / n_vocab.max(1) as u64)
    })
}

/// The early-exit head for `model` from the sidecar at `sidecar` (default: next to the
/// model): `Ok(None)` without a sidecar or without a head in it, `Err` saying why when there
/// is one Leap cannot use (trained on another model, a corrupt file).
///
/// # Errors
/// As said: the reason a sidecar's head cannot be used.
pub fn head_for(model: &Model, sidecar: Option<&Path>) -> Result<Option<Head>, String> {
    let (path, side) = sidecar_at(model.path(), sidecar)?;
    let Some(side) = side else {
        return match sidecar {
            Some(_) => Err(format!("no sidecar at {}", path.display())),
            None => Ok(None),
        };
    };
    let shape = shape_of(model)?
        .ok_or_else(|| "the model has no output weights to score with".to_string())?;
    crate::exit::load(&side, &shape)
        .map_err(|why| format!("ignoring the early-exit head in {}: {why}", path.display()))
}

/// The sidecar's path (`sidecar`, default next to the model at `model`) and the sidecar there
/// (`None`: no file). `Err` when it cannot be read.
fn sidecar_at(
    model: &Path,
    sidecar: Option<&Path>,
) -> Result<(std::path::PathBuf, Option<leap_host::sidecar::Sidecar>), String> {
    let path = sidecar
        .map(Path::to_path_buf)
        .unwrap_or_else(|| leap_host::sidecar::path_for(model));
    match leap_host::sidecar::Sidecar::load(&path) {
        Ok(side) => Ok((path, side)),
        Err(e) => Err(format!("ignoring the sidecar {}: {e}", path.display())),
    }
}

/// What a sidecar's heads must match in `model` (`None`: it has no output weights Leap can
/// score with).
fn shape_of(model: &Model) -> Result<Option<ModelShape>, String> {
    Ok(leap_host::project::fingerprint(model)
        .map_err(|e| e.to_string())?
        .map(|fingerprint| ModelShape {
            fingerprint,
            n_embd: model.n_embd() as usize,
            n_layer: model.n_layer() as u32,
            n_vocab: model.n_vocab() as usize,
        }))
}

/// The head that guesses the token after next ([`crate::ahead`]) for `model` from the
/// sidecar at `sidecar` (default: next to the model), as [`head_for`] finds the early-exit
/// head: `Ok(None)` without one, `Err` saying why one there cannot be used.
///
/// # Errors
/// As said.
pub fn ahead_for(model: &Model, sidecar: Option<&Path>) -> Result<Option<Ahead>, String> {
    let (path, Some(side)) = sidecar_at(model.path(), sidecar)? else {
        return Ok(None);
    };
    let Some(shape) = shape_of(model)? else {
        return Ok(None);
    };
    crate::ahead::load(&side, &shape).map_err(|why| {
        format!(
            "ignoring the head guessing the token after next in {}: {why}",
            path.display()
        )
    })
}

/// The model's answers to other prompts ([`crate::corpus`]) from the sidecar at `sidecar`
/// (default: next to the model): `Ok(None)` without one, `Err` saying why one there cannot be
/// used.
///
/// # Errors
/// As said.
pub fn corpus_for(
    model: &Model,
    sidecar: Option<&Path>,
) -> Result<Option<crate::corpus::Corpus>, String> {
    corpus_at(model.path(), sidecar)
}

/// [`corpus_for`] the GGUF model at `model_path`, without loading it (a host that loads the
/// model itself: the C API's drafter).
///
/// # Errors
/// As [`corpus_for`]; the model file cannot be read.
pub fn corpus_at(
    model_path: &Path,
    sidecar: Option<&Path>,
) -> Result<Option<crate::corpus::Corpus>, String> {
    let (path, Some(side)) = sidecar_at(model_path, sidecar)? else {
        return Ok(None);
    };
    let Some((fingerprint, n_vocab)) =
        leap_host::project::fingerprint_file(model_path).map_err(|e| e.to_string())?
    else {
        return Ok(None);
    };
    crate::corpus::load(&side, &fingerprint, n_vocab)
        .map_err(|why| format!("ignoring the answers in {}: {why}", path.display()))
}

/// [`corpus_for`] as the automaton drafting reads, with a warning when the corpus is refused
/// (Leap then drafts without it).
pub fn load_corpus(model: &Model, sidecar: Option<&Path>) -> Option<Arc<SuffixAutomaton>> {
    match corpus_for(model, sidecar) {
        Ok(Some(c)) => {
            log::info!(
                "drafting from {} answers of the model's ({} tokens) too",
                c.answers(),
                c.len()
            );
            Some(c.automaton())
        }
        Ok(None) => None,
        Err(why) => {
            log::warn!("{why}; drafting without them");
            None
        }
    }
}

/// [`ahead_for`], with a warning when the head is refused (Leap then drafts without it).
pub fn load_ahead(model: &Model, sidecar: Option<&Path>) -> Option<Ahead> {
    match ahead_for(model, sidecar) {
        Ok(Some(h)) => {
            log::info!("a head guessing the token after next");
            Some(h)
        }
        Ok(None) => None,
        Err(why) => {
            log::warn!("{why}; drafting without it");
            None
        }
    }
}

/// [`head_for`], with a warning when the head is refused (Leap then runs without early
/// exit).
pub fn load_head(model: &Model, sidecar: Option<&Path>) -> Option<Head> {
    match head_for(model, sidecar) {
        Ok(Some(h)) => {
            log::info!("early-exit head at layer {}", h.layer);
            Some(h)
        }
        Ok(None) => None,
        Err(why) => {
            log::warn!("{why}; running without early exit");
            None
        }
    }
}

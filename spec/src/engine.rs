//! The speculative engine: drafts from the request (prompt and output so far), from the
//! conversation's earlier requests and answers and from segments of rejected drafts (see
//! [`crate::draft`]), verifies a token tree in one target call, accepts greedily (or by
//! speculative sampling) and rolls the KV cache back to the accepted path.
//!
//! The context's KV memory holds every accepted token but the last (`id_last`), as in
//! llama-server; each step puts `id_last` and the drafts in one batch, so even a step with
//! nothing drafted is exactly a plain decoding step.

use std::time::Instant;

use leap_host::grammar::Grammar;
use leap_host::project::OnDemand;
use leap_host::sampler::SamplingParams;
use leap_host::usage::cpu_seconds;
use leap_host::{Batch, Context, Error, Result, Token};

use crate::accept;
use crate::calib::{self, CalibratedDrafter, Calibration};
use crate::control::{Controller, Evidence};
use crate::corpus::CorpusDrafter;
use crate::dist::Truncation;
use crate::draft::{ContextDrafter, Drafter, HistoryDrafter, Proposal, ReuseDrafter};
use crate::exit::Pruner;
use crate::lever;
use crate::plain::{argmax, Generation};
use crate::sam::SuffixAutomaton;
use crate::tree::{KvOp, NodeId, TokenTree};
use crate::vocab::Resident;
use std::sync::Arc;

mod steps;
use steps::Steps;

/// How the engine drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Most drafted tokens on one path.
    pub max_draft: usize,
    /// Most leaves (KV sequences) in a tree; 1 drafts chains.
    pub max_branches: usize,
    /// Most rows (root included) of one verification call.
    pub max_rows: usize,
    /// Shortest suffix match to draft from.
    pub min_match: usize,
    /// Let the controller choose draft lengths (else always the longest available).
    pub adaptive: bool,
    /// Prior for the cost slope of extra rows (learned online).
    pub beta_prior: f64,
    /// Tokens of earlier requests and answers kept for drafting (0: no history).
    pub history_tokens: usize,
    /// Steps a reusable segment of a rejected draft is offered again (0: no reuse).
    pub reuse_lifetime: usize,
    /// Project only the rows acceptance reads (when the engine has an [`OnDemand`]; without
    /// this, the engine's [`OnDemand`] serves calibration only and verification reads
    /// llama.cpp's logits of every row).
    pub on_demand: bool,
    /// In-context calibration from the prompt's prefill (needs an [`OnDemand`]).
    pub calibrate: bool,
    /// Prune verification rows with an early-exit head when one is given
    /// ([`Engine::with_exit`]; needs on-demand projection).
    pub exit: bool,
    /// How the early-exit head prunes.
    pub prune: crate::exit::PruneConfig,
    /// Greedy decoding with on-demand projection, under a streamed output projection (flash)
    /// or where the projection is a large share of a call ([`Resident`]): the target drafts
    /// for itself over a resident vocabulary ([`crate::vocab`]) instead of building trees
    /// from the drafters. `None`: always trees.
    pub vocab: Option<crate::vocab::VocabConfig>,
    /// Draft from the model's own answers to other prompts when the runtime has them (the
    /// sidecar's corpus, [`Engine::with_corpus`]).
    pub corpus: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_draft: 16,
            max_branches: 1,
            max_rows: 17,
            min_match: 2,
            adaptive: true,
            beta_prior: 0.5,
            history_tokens: 1 << 16,
            reuse_lifetime: 3,
            on_demand: true,
            calibrate: true,
            exit: true,
            prune: Default::default(),
            vocab: Some(Default::default()),
            corpus: true,
        }
    }
}

impl EngineConfig {
    /// Limits for a streamed target (flash): a verification call reads the streamed weights
    /// once however many rows it has, so a row is cheap next to the I/O and a tree may grow
    /// (Lever §4.2). The controller still sizes every tree by the measured cost of calls.
    pub fn streamed(self) -> Self {
        Self {
            max_rows: self.max_rows.max(33),
            max_draft: self.max_draft.max(24),
            // Self-drafting's retrieval chains were measured with resident weights only.
            vocab: self
                .vocab
                .map(|v| crate::vocab::VocabConfig { min_match: 0, ..v }),
            ..self
        }
    }
}

/// The speculative engine. Keep one per conversation: its controller's estimates and its
/// history of earlier requests and answers carry over.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    control: Controller,
    history: HistoryDrafter,
    reuse: ReuseDrafter,
    calibrated: CalibratedDrafter,
    /// Retrieval from the model's own answers to other prompts (the sidecar's corpus).
    corpus: Option<CorpusDrafter>,
    /// A drafter of the caller's (a draft model).
    extra: Option<Extra>,
    /// On-demand output projection for the context this engine decodes with, and whether it
    /// was checked against llama.cpp's logits there (`None`: not yet).
    on_demand: Option<(OnDemand, Option<bool>)>,
    /// Early exit (Lever §4.3): the context's exit observer and the head that decides.
    exit: Option<(leap_host::exit::Exit, Pruner)>,
    /// Self-drafting's measured costs and acceptance ([`crate::vocab`]).
    vocab: crate::vocab::VocabState,
    /// [`Resident::Auto`]'s decision for this context, measured once.
    vocab_pays: Option<bool>,
}

/// A caller's drafter (opaque to `Debug`).
struct Extra(Box<dyn Drafter + Send>);

impl std::fmt::Debug for Extra {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Drafter")
    }
}

fn apply(ctx: &mut Context, ops: &[KvOp]) -> Result<()> {
    for &op in ops {
        match op {
            KvOp::Copy { src, dst, p0, p1 } => ctx.seq_cp(src, dst, p0, p1)?,
            KvOp::Keep { seq } => ctx.seq_keep(seq)?,
            KvOp::Remove { seq, p0, p1 } => {
                ctx.seq_rm(seq, p0, p1);
            }
        }
    }
    Ok(())
}

impl Engine {
    /// An engine with `cfg`.
    pub fn new(cfg: EngineConfig) -> Self {
        let control = Controller::new(cfg.beta_prior);
        Self {
            history: HistoryDrafter::new(cfg.min_match, cfg.history_tokens),
            reuse: ReuseDrafter::new(cfg.reuse_lifetime, 2),
            calibrated: CalibratedDrafter::new(cfg.min_match),
            corpus: None,
            cfg,
            control,
            on_demand: None,
            exit: None,
            extra: None,
            vocab: Default::default(),
            vocab_pays: None,
        }
    }

    /// Forget what earlier requests left: the history of their texts, drafts kept for reuse,
    /// calibration, and the acceptance learned from them (the machine's measured costs stay).
    /// The next request is drafted as if it were the first: nothing about another client's
    /// text can show in how it is drafted or how long it takes.
    pub fn forget(&mut self) {
        self.history = HistoryDrafter::new(self.cfg.min_match, self.cfg.history_tokens);
        self.reuse = ReuseDrafter::new(self.cfg.reuse_lifetime, 2);
        self.calibrated = CalibratedDrafter::new(self.cfg.min_match);
        self.control.forget_acceptance();
    }

    /// Draft with `d` too (a draft model: [`crate::model_draft::ModelDrafter`]).
    pub fn with_drafter(mut self, d: Box<dyn Drafter + Send>) -> Self {
        self.extra = Some(Extra(d));
        self
    }

    /// Draft from the model's own answers to other prompts too, unless
    /// [`EngineConfig::corpus`] is off ([`crate::corpus`]; `sam` is
    /// [`crate::corpus::Corpus::automaton`], shared between engines): in token trees, and in
    /// the retrieval chains of the target drafting for itself.
    pub fn with_corpus(mut self, sam: Option<Arc<SuffixAutomaton>>) -> Self {
        self.corpus = sam
            .filter(|_| self.cfg.corpus)
            .map(|s| CorpusDrafter::new(s, self.cfg.min_match));
        self
    }

    /// Verify with on-demand output projection (Lever §4.4): verification calls stop before
    /// the output projection and only rows acceptance reads are projected. `od` must belong
    /// to the context passed to [`Engine::generate_with`] ([`OnDemand::context`]); the first
    /// verification checks that its logits are llama.cpp's bit for bit and falls back to
    /// llama.cpp's logits for good if not (a log warning says so).
    pub fn with_on_demand(mut self, od: Option<OnDemand>) -> Self {
        self.on_demand = od.map(|o| (o, None));
        self.vocab_pays = None;
        self
    }

    /// Prune verification rows at an early-exit layer (Lever §4.3): `exit` is the observer
    /// on the context passed to [`Engine::generate_with`], `pruner` the head that decides.
    /// Needs on-demand projection (the pruned rows have no logits); calls of three rows or
    /// more are pruned, streamed targets never (their cost is the weights' I/O).
    pub fn with_exit(mut self, exit: Option<(leap_host::exit::Exit, Pruner)>) -> Self {
        if let Some((_, p)) = &exit {
            self.control.set_exit_share(p.share_after());
        }
        self.exit = exit;
        self
    }

    /// Guess the token after next when the target drafts for itself ([`crate::ahead`]): a
    /// step's call then takes the head's guess as a second row where that pays.
    pub fn with_ahead(mut self, head: Option<std::sync::Arc<crate::ahead::Ahead>>) -> Self {
        self.vocab.ahead = head;
        self
    }

    /// Whether on-demand projection is in use (`None`: not checked yet).
    pub fn on_demand_ok(&self) -> Option<bool> {
        self.on_demand.as_ref().and_then(|o| o.1)
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The drafters this configuration uses, for the current request.
    fn drafters<'a>(&'a mut self, local: &'a mut ContextDrafter) -> Vec<&'a mut dyn Drafter> {
        let mut d: Vec<&mut dyn Drafter> = vec![local];
        if self.cfg.history_tokens > 0 {
            d.push(&mut self.history);
        }
        if self.cfg.reuse_lifetime > 0 {
            d.push(&mut self.reuse);
        }
        if self.cfg.calibrate {
            d.push(&mut self.calibrated);
        }
        if let Some(c) = self.corpus.as_mut() {
            d.push(c);
        }
        if let Some(x) = self.extra.as_mut() {
            d.push(x.0.as_mut());
        }
        d
    }

    /// Build this step's tree: first what the last step accepted off the trunk (`carry`),
    /// then the drafters' proposals, best-backed first, each cut to the length the controller
    /// finds worth verifying.
    fn build_tree(
        &self,
        proposals: &mut Vec<Proposal>,
        id_last: Token,
        carry: &[Token],
        budget: usize,
        branches: usize,
    ) -> (TokenTree, Vec<Evidence>, f64) {
        if self.cfg.adaptive {
            if !carry.is_empty() {
                proposals.push(Proposal {
                    tokens: carry.to_vec(),
                    match_len: lever::CARRY_MATCH,
                    source: crate::draft::Source::Carry,
                });
            }
            let b = lever::build(
                id_last,
                proposals,
                &self.control,
                self.cfg.max_rows,
                branches,
                budget,
            );
            return (b.tree, b.evidence, b.expected);
        }
        let mut tree = TokenTree::new(id_last);
        let mut lens = vec![Evidence::default()];
        if budget == 0 {
            return (tree, lens, 0.0);
        }
        if !carry.is_empty() {
            tree.add_path(0, &carry[..carry.len().min(budget)]);
        }
        proposals.sort_by_key(|p| std::cmp::Reverse(p.match_len));
        for p in proposals.iter() {
            if tree.n_seqs() >= branches && !tree.is_empty() {
                break;
            }
            if tree.child(0, p.tokens[0]).is_some() {
                continue;
            }
            tree.add_path(0, &p.tokens[..p.tokens.len().min(budget)]);
        }
        lens.resize(tree.len(), Evidence::default());
        (tree, lens, 0.0)
    }

    /// Greedy generation: prefill `prompt` (sequence 0 of an empty context), then speculative
    /// steps until `max_tokens`, an end-of-generation token (kept), or `on_token` returning
    /// false. The output is token for token what plain greedy decoding produces, given the
    /// host's batch-invariant configuration (see `leap_host::backend::BATCH_INVARIANT_ENV`).
    ///
    /// # Errors
    /// Decode failures; a context with fewer sequences than `max_branches` is used with fewer
    /// branches.
    pub fn generate(
        &mut self,
        ctx: &mut Context,
        prompt: &[Token],
        max_tokens: usize,
        n_batch: usize,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        let greedy = SamplingParams::default();
        self.generate_with(ctx, prompt, max_tokens, n_batch, &greedy, on_token)
    }

    /// Greedy generation on a streamed output projection with the target drafting for
    /// itself over a resident vocabulary ([`crate::vocab`]), when configured and the
    /// projection reproduces llama.cpp's logits (checked here once, on the prompt's first
    /// token, which clears `ctx` and sets `cached` to 0). Sequence 0 may hold
    /// `prompt[..cached]` (see [`Engine::generate_from`]). `None`: not applicable, the
    /// caller builds trees.
    #[allow(clippy::too_many_arguments)]
    fn self_draft(
        &mut self,
        ctx: &mut Context,
        prompt: &[Token],
        cached: &mut usize,
        max_tokens: usize,
        n_batch: usize,
        sampled: bool,
        grammar: Option<&mut Grammar>,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Option<Generation>> {
        let Some(vc) = self.cfg.vocab.filter(|_| !sampled && self.cfg.on_demand) else {
            return Ok(None);
        };
        let Some((od, checked)) = self
            .on_demand
            .as_mut()
            .filter(|(od, _)| od.streamed() || vc.resident != Resident::Never)
        else {
            return Ok(None);
        };
        if checked.is_none() {
            ctx.clear(false);
            *cached = 0;
            let mut b = Batch::new(1, 1);
            b.add(prompt[0], 0, &[0], true)?;
            let ok = od.check(ctx, &b, 0)?;
            if !ok {
                log::warn!(
                    "on-demand output projection does not reproduce llama.cpp's logits for \
                     this model; verifying with llama.cpp's logits"
                );
            }
            *checked = Some(ok);
        }
        if *checked != Some(true) {
            return Ok(None);
        }
        if !od.streamed() && vc.resident == Resident::Auto {
            let pays = *self.vocab_pays.get_or_insert_with(|| {
                let share = od.head_share();
                let p = share >= crate::vocab::AUTO_SHARE;
                log::info!(
                    "the output projection is {:.0}% of the weights a one-row call reads: {}",
                    share * 100.0,
                    if p {
                        "the target drafts for itself over a resident vocabulary"
                    } else {
                        "token trees from the drafters"
                    }
                );
                p
            });
            if !pays {
                return Ok(None);
            }
        }
        let od = od.clone();
        crate::vocab::generate(
            ctx,
            &od,
            &vc,
            &mut self.vocab,
            prompt,
            *cached,
            max_tokens,
            n_batch,
            grammar,
            self.corpus.as_mut(),
            on_token,
        )
        .map(Some)
    }

    /// Generation with `sampling`: greedy when [`SamplingParams::is_greedy`] (as [`Engine::generate`]),
    /// else speculative sampling: each step's tree is accepted by coupling
    /// ([`accept::stochastic`]) against the distribution llama.cpp's sampler chain with the
    /// same parameters draws from ([`Truncation`]), each position's token drawn with the
    /// uniform of (`sampling.seed`, position): every token is distributed exactly as plain
    /// sampling's, and they are the tokens plain sampling gives with that seed.
    ///
    /// # Errors
    /// As [`Engine::generate`].
    pub fn generate_with(
        &mut self,
        ctx: &mut Context,
        prompt: &[Token],
        max_tokens: usize,
        n_batch: usize,
        sampling: &SamplingParams,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        self.generate_from(
            ctx, prompt, 0, max_tokens, n_batch, sampling, None, on_token,
        )
    }

    /// [`Engine::generate_with`] when sequence 0 of `ctx` already holds `prompt[..cached]`
    /// at positions `0..cached` (kept from an earlier request on this context, as
    /// [`crate::session::Session`] tracks): only the rest is prefilled. The output is the
    /// same as with `cached` 0: a row's results do not depend on its batch.
    ///
    /// Under a `grammar` (structured output), greedy generation drafts as without one: drafts
    /// are cut at the first token the grammar refuses, each verified row's token is the
    /// target's best among the tokens the grammar allows after the path to it (a copy of the
    /// grammar walks the path, so rejected drafts leave the grammar where it was), and the
    /// grammar accepts the tokens emitted. The output is plain decoding's under the same
    /// grammar ([`crate::plain::plain_from`]), which is also how sampled generation under a
    /// grammar runs (not drafted).
    ///
    /// # Errors
    /// As [`Engine::generate`].
    #[allow(clippy::too_many_arguments)]
    pub fn generate_from(
        &mut self,
        ctx: &mut Context,
        prompt: &[Token],
        cached: usize,
        max_tokens: usize,
        n_batch: usize,
        sampling: &SamplingParams,
        mut grammar: Option<&mut Grammar>,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<Generation> {
        let recurrent = ctx.model().is_recurrent();
        if recurrent || (grammar.is_some() && !sampling.is_greedy()) {
            // Verifying a draft would advance a recurrent state past tokens that are then not
            // kept: plain decoding (under flash streaming, through the streamed projection).
            if recurrent {
                warn_recurrent(ctx.model());
            }
            let od = self
                .on_demand
                .as_ref()
                .map(|(od, _)| od)
                .filter(|od| od.streamed());
            return crate::plain::plain_from(
                ctx, od, prompt, cached, max_tokens, sampling, n_batch, grammar, on_token,
            );
        }
        let mut cached = cached.min(prompt.len().saturating_sub(1));
        let sampled = !sampling.is_greedy();
        let trunc = Truncation::from(sampling);
        if prompt.is_empty() {
            return Err(Error::InvalidBatch {
                n_tokens: 0,
                reason: "empty prompt".into(),
            });
        }
        if let Some(g) = self.self_draft(
            ctx,
            prompt,
            &mut cached,
            max_tokens,
            n_batch,
            sampled,
            grammar.as_deref_mut(),
            on_token,
        )? {
            return Ok(g);
        }
        let cached = crate::plain::keep_prefix(ctx, cached);
        let mut g = self.prefill(ctx, prompt, cached, n_batch)?;
        let cpu0 = cpu_seconds();
        let t1 = Instant::now();
        let first = match grammar.as_deref_mut() {
            _ if sampled => accept::pick(
                &trunc.apply(ctx.logits(-1)?).entries,
                accept::position_uniform(sampling.seed, prompt.len()),
            ),
            Some(gr) => match gr.take_greedy(ctx.logits(-1)?, &mut Vec::new()) {
                Some(t) => t,
                None => {
                    g.decode_seconds = t1.elapsed().as_secs_f64();
                    return Ok(g);
                }
            },
            None => argmax(ctx.logits(-1)?),
        };
        g.tokens.push(first);
        // The first token goes out before the drafters take the prompt (a draft model
        // prefills it): nothing of drafting's set-up delays it.
        let done = ctx.model().is_eog(first) || !on_token(first) || g.tokens.len() >= max_tokens;
        let mut s = Steps::new(
            self,
            ctx,
            sampling,
            grammar,
            prompt.len(),
            max_tokens,
            g,
            first,
            done,
        );
        for d in self.drafters(&mut s.local) {
            d.begin(prompt);
        }
        for d in self.drafters(&mut s.local) {
            d.accepted(first);
        }
        while !s.done {
            s.step(self, on_token)?;
        }
        let mut g = std::mem::take(&mut s.g);
        g.decode_seconds = t1.elapsed().as_secs_f64();
        log::debug!(
            "acceptance by match length 1,2,3-4,5-8,9-16,17+: {:?}; cost of 2..9 rows: {:?}",
            [1, 2, 3, 5, 9, 17].map(|m| (self
                .control
                .acceptance(crate::control::Evidence::new(Default::default(), m))
                * 100.0)
                .round()
                / 100.0),
            (2..10)
                .map(|r| (self.control.cost(r) * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
        g.decode_cpu_seconds = cpu_seconds() - cpu0;
        for d in self.drafters(&mut s.local) {
            d.end(prompt, &g.tokens);
        }
        Ok(g)
    }

    /// Prefill `prompt[cached..]`: with in-context calibration from the prompt's rows when the
    /// engine projects on demand (checking the projection against llama.cpp's logits the
    /// first time), else llama.cpp's prefill. The generation's prefill times.
    ///
    /// # Errors
    /// Decode failures.
    fn prefill(
        &mut self,
        ctx: &mut Context,
        prompt: &[Token],
        cached: usize,
        n_batch: usize,
    ) -> Result<Generation> {
        let t0 = Instant::now();
        let mut calib_seconds = 0.0;
        match &mut self.on_demand {
            Some((od, checked)) if self.cfg.calibrate && *checked != Some(false) => {
                let p = calib::prefill_from(ctx, od, prompt, cached, n_batch, checked.is_none())?;
                if let Some(exact) = p.exact {
                    if !exact {
                        log::warn!(
                            "on-demand output projection does not reproduce llama.cpp's \
                             logits for this model; verifying with llama.cpp's logits"
                        );
                    }
                    *checked = Some(exact);
                }
                self.calibrated.set(&p.calib);
                calib_seconds = p.calib.seconds;
            }
            _ => {
                crate::plain::prefill_from(ctx, prompt, cached, n_batch)?;
                self.calibrated.set(&Calibration::default());
            }
        }
        Ok(Generation {
            prefill_seconds: t0.elapsed().as_secs_f64(),
            calib_seconds,
            ..Default::default()
        })
    }
}

/// Cut each proposal (drafts after the last emitted token) at the first token `grammar` does
/// not allow there, and drop those left empty: the target would refuse them anyway.
///
/// # Errors
/// The grammar cannot be copied.
fn allowed_drafts(grammar: &Grammar, proposals: &mut Vec<Proposal>) -> Result<()> {
    for p in proposals.iter_mut() {
        p.tokens.truncate(grammar.allowed_prefix(&p.tokens)?);
    }
    proposals.retain(|p| !p.tokens.is_empty());
    Ok(())
}

/// Most rows projected together in greedy verification.
const MAX_PROJECTED: usize = 8;

/// `node` and up to `len - 1` nodes below it, each the first (most likely) child of the last.
fn trunk_chain(tree: &TokenTree, node: NodeId, len: usize) -> Vec<NodeId> {
    let mut chain = vec![node];
    while chain.len() < len {
        match tree.nodes()[*chain.last().expect("not empty")]
            .children
            .first()
        {
            Some(&c) => chain.push(c),
            None => break,
        }
    }
    chain
}

/// The nodes from the root to `node`.
fn path_nodes(tree: &TokenTree, node: NodeId) -> Vec<NodeId> {
    let mut nodes = Vec::new();
    let mut at = Some(node);
    while let Some(n) = at {
        nodes.push(n);
        at = tree.nodes()[n].parent;
    }
    nodes.reverse();
    nodes
}

/// The drafted path verification checked furthest: root to `accepted`, then on along first
/// children to a leaf; with the target's token after each prefix of it (`predicted[i]` after
/// `draft[..i]`).
fn checked_path(
    tree: &TokenTree,
    accepted: NodeId,
    mut argmax: impl FnMut(NodeId) -> Token,
) -> (Vec<Token>, Vec<Token>) {
    let mut nodes = path_nodes(tree, accepted);
    let mut last = accepted;
    while let Some(&c) = tree.nodes()[last].children.first() {
        nodes.push(c);
        last = c;
    }
    let draft = nodes[1..].iter().map(|&n| tree.nodes()[n].token).collect();
    let predicted = nodes.iter().map(|&n| argmax(n)).collect();
    (draft, predicted)
}

/// Says once per process, in one warning line, that `model` keeps recurrent state
/// ([`leap_host::Model::is_recurrent`]), which llama.cpp cannot roll back past a rejected
/// draft, so the engine decodes it plainly.
fn warn_recurrent(model: &leap_host::Model) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        log::warn!(
            "{} ({}) keeps recurrent state, which llama.cpp cannot roll back past a \
             rejected draft: decoding plainly, one target call per token (same output, \
             no speed-up)",
            model.path().display(),
            model.meta("general.architecture").unwrap_or_default()
        );
    });
}

//! The speculative engine: drafts from a suffix automaton of the prompt and the output so far
//! and from one of the conversation's earlier requests and answers, verifies a token tree in
//! one target call, accepts greedily and rolls the KV cache back to
//! the accepted path. Greedy only for now; sampled decoding stays on [`crate::plain`].
//!
//! The context's KV memory holds every accepted token but the last (`id_last`), as in
//! llama-server; each step puts `id_last` and the drafts in one batch, so even a step with
//! nothing drafted is exactly a plain decoding step.

use std::time::Instant;

use leap_host::usage::cpu_seconds;
use leap_host::{Batch, Context, Error, Result, Token};

use crate::accept;
use crate::control::Controller;
use crate::plain::{argmax, prefill, Generation};
use crate::sam::{Matcher, SuffixAutomaton};
use crate::tree::{KvOp, TokenTree};

/// How the engine drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Most drafted tokens on one path.
    pub max_draft: usize,
    /// Most leaves (KV sequences) in a tree; 1 drafts chains.
    pub max_branches: usize,
    /// Shortest suffix match to draft from.
    pub min_match: usize,
    /// Let the controller choose draft lengths (else always the longest available).
    pub adaptive: bool,
    /// Prior for the cost slope of extra rows (learned online).
    pub beta_prior: f64,
    /// Tokens of earlier requests and answers kept for drafting (0: no history).
    pub history_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_draft: 16,
            max_branches: 1,
            min_match: 2,
            adaptive: true,
            beta_prior: 0.5,
            history_tokens: 1 << 16,
        }
    }
}

/// Separates requests in the history automaton, so no match spans two of them. Never a token.
const SEPARATOR: Token = -1;

/// The speculative engine. Keep one per conversation: its controller's estimates and its
/// history of earlier requests and answers carry over.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    control: Controller,
    history: SuffixAutomaton,
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
        let control = Controller::new(cfg.max_draft, cfg.beta_prior);
        Self {
            cfg,
            control,
            history: SuffixAutomaton::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Remember a finished request (prompt and answer) for drafting in later ones; the oldest
    /// half is dropped when the history outgrows its budget.
    fn remember(&mut self, prompt: &[Token], answer: &[Token]) {
        if self.cfg.history_tokens == 0 {
            return;
        }
        let incoming = prompt.len() + answer.len() + 1;
        if self.history.len() + incoming > self.cfg.history_tokens {
            let text = self.history.text();
            let keep = text[text.len().saturating_sub(self.cfg.history_tokens / 2)..].to_vec();
            self.history = SuffixAutomaton::with_capacity(keep.len() + incoming);
            self.history.extend(&keep);
        }
        self.history.extend(prompt);
        self.history.extend(answer);
        self.history.push(SEPARATOR);
    }

    /// Build this step's tree from the automaton of everything accepted so far and from the
    /// history's longest match of the current text.
    fn draft(
        &self,
        sam: &SuffixAutomaton,
        hist: Option<crate::sam::Match>,
        id_last: Token,
        remaining: usize,
        n_seq: usize,
    ) -> (TokenTree, usize) {
        let mut tree = TokenTree::new(id_last);
        let budget = remaining.saturating_sub(1).min(self.cfg.max_draft);
        if budget == 0 {
            return (tree, 0);
        }
        let branches = self.cfg.max_branches.min(n_seq).max(1);
        let mut first_match = 0;
        let local = sam
            .repeats(self.cfg.min_match, branches)
            .into_iter()
            .map(|m| (m, sam));
        let from_history = hist
            .filter(|m| m.len >= self.cfg.min_match)
            .map(|m| (m, &self.history));
        // Longest match first, wherever it comes from.
        let mut candidates: Vec<_> = local.chain(from_history).collect();
        candidates.sort_by_key(|c| std::cmp::Reverse(c.0.len));
        for (m, text) in candidates {
            let cont = text.continuation(m, budget);
            let cont = &cont[..cont
                .iter()
                .position(|&t| t == SEPARATOR)
                .unwrap_or(cont.len())];
            if cont.is_empty() {
                continue;
            }
            let g = if self.cfg.adaptive {
                self.control.draft_len(m.len, cont.len())
            } else {
                cont.len()
            };
            if g == 0 || tree.child(0, cont[0]).is_some() {
                continue;
            }
            if first_match == 0 {
                first_match = m.len;
            }
            tree.add_path(0, &cont[..g]);
            if tree.n_seqs() >= branches {
                break;
            }
        }
        (tree, first_match)
    }

    /// Greedy generation: prefill `prompt` (sequence 0 of an empty context), then speculative
    /// steps until `max_tokens`, an end-of-generation token (kept), or `on_token` returning
    /// false. The output is what plain greedy decoding produces, up to llama.cpp's batch-shape
    /// numerics (see the README).
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
        if prompt.is_empty() {
            return Err(Error::InvalidBatch {
                n_tokens: 0,
                reason: "empty prompt".into(),
            });
        }
        ctx.clear(false);
        let t0 = Instant::now();
        prefill(ctx, prompt, n_batch)?;
        let mut g = Generation {
            prefill_seconds: t0.elapsed().as_secs_f64(),
            ..Default::default()
        };
        let model = ctx.model().clone();
        let n_seq = ctx.n_seq_max() as usize;
        let cpu0 = cpu_seconds();
        let t1 = Instant::now();

        let mut sam = SuffixAutomaton::with_capacity(prompt.len() + max_tokens);
        sam.extend(prompt);
        let mut matcher = Matcher::new();
        for &t in prompt {
            matcher.push(&self.history, t);
        }
        let mut pos0 = prompt.len() as i32;
        let first = argmax(ctx.logits(-1)?);
        g.tokens.push(first);
        sam.push(first);
        matcher.push(&self.history, first);
        let mut id_last = first;
        let mut done = model.is_eog(first) || !on_token(first) || g.tokens.len() >= max_tokens;
        let mut batch = Batch::new(
            self.cfg.max_draft * self.cfg.max_branches.max(1) + 1,
            n_seq.max(1),
        );

        while !done {
            let td = Instant::now();
            let hist = matcher.current(&self.history);
            let (tree, match_len) =
                self.draft(&sam, hist, id_last, max_tokens - g.tokens.len(), n_seq);
            g.draft_seconds += td.elapsed().as_secs_f64();

            apply(ctx, &tree.prepare(pos0, 0))?;
            let rows = tree.rows(pos0, 0);
            batch.clear();
            for r in &rows {
                batch.add(r.token, r.pos, &r.seq_ids, true)?;
            }
            let tc = Instant::now();
            ctx.decode(&batch)?;
            let acc = accept::greedy(&tree, |node| {
                ctx.logits(node as i32).map(argmax).unwrap_or(-1)
            });
            self.control
                .record_cost(tree.len(), tc.elapsed().as_secs_f64());
            g.target_calls += 1;
            let drafted = tree.len() - 1;
            g.drafted_tokens += drafted as u64;
            if drafted > 0 {
                let path_len = tree.nodes()[acc.node].depth;
                let chain = tree
                    .leaves()
                    .iter()
                    .map(|&l| tree.nodes()[l].depth)
                    .max()
                    .unwrap_or(0);
                self.control.record_acceptance(match_len, chain, path_len);
            }
            apply(ctx, &tree.rollback(&rows, acc.node, 0))?;
            pos0 += acc.tokens.len() as i32;

            for &t in &acc.tokens {
                if t < 0 {
                    return Err(Error::NoLogits { row: -1 });
                }
                g.tokens.push(t);
                sam.push(t);
                matcher.push(&self.history, t);
                if model.is_eog(t) || !on_token(t) || g.tokens.len() >= max_tokens {
                    done = true;
                    break;
                }
            }
            id_last = *acc
                .tokens
                .last()
                .expect("acceptance yields at least one token");
        }
        g.decode_seconds = t1.elapsed().as_secs_f64();
        g.decode_cpu_seconds = cpu_seconds() - cpu0;
        self.remember(prompt, &g.tokens);
        Ok(g)
    }
}

//! Self-drafting's rounds after the first token ([`super::generate`]), in named steps. Each
//! round ([`Rounds::round`]):
//! 1. [`Rounds::chain`]: a retrieval chain after the next token (or the head's guess,
//!    [`crate::ahead`]) rides in the call that token needs, kept while each token is the
//!    resident vocabulary's best after the one before;
//! 2. [`Rounds::steps`]: steps, each drafting the resident best, as many as the cost model
//!    chose; a retrieval chain after the drafts so far (or the head's guess) rides in a
//!    step's call and stands as the first call's does;
//! 3. [`Rounds::project`]: one pass over the output weights for every state;
//! 4. [`Rounds::walk`]: the target's token after each state (under a grammar, the best it
//!    allows); a draft stands while it is that token;
//! 5. [`Rounds::learn`]: acceptance, the vocabulary grown after misses and by what was
//!    emitted, the rejected drafts' cells dropped;
//! 6. [`Rounds::emit`]: the tokens out.

use std::sync::Arc;
use std::time::Instant;

use leap_host::grammar::Grammar;
use leap_host::project::{DraftVocab, OnDemand};
use leap_host::{Batch, Context, Model, Result, Token};

use super::{run, VocabConfig, VocabState, GROW, MAX_CHAIN, RIDE};
use crate::corpus::CorpusDrafter;
use crate::draft::{ContextDrafter, Drafter, Proposal};
use crate::plain::Generation;

/// One generation's rounds: what carries from a round to the next, and the buffers each
/// reuses.
pub(super) struct Rounds<'a> {
    pub ctx: &'a mut Context,
    pub od: &'a OnDemand,
    pub cfg: &'a VocabConfig,
    pub state: &'a mut VocabState,
    pub grammar: Option<&'a mut Grammar>,
    pub model: Arc<Model>,
    pub max_tokens: usize,
    /// The output so far and the generation's counts.
    pub g: Generation,
    /// The resident vocabulary and the most ids it may hold; the prefix's limit.
    pub vocab: DraftVocab,
    pub cap: usize,
    pub prefix_max: usize,
    /// Retrieval from the prompt and the tokens emitted so far.
    pub context: Option<ContextDrafter>,
    /// Retrieval from the model's own answers to other prompts ([`crate::corpus`]), where
    /// `context` has no chain.
    pub corpus: Option<&'a mut CorpusDrafter>,
    /// The emitted token not yet in the cache, and its position.
    pub next: Token,
    pub pos: i32,
    pub done: bool,
    /// Rejected drafts in this request.
    misses: usize,
    batch: Batch,
    proposals: Vec<Proposal>,
    /// The round's final hidden states, `n` values each: after `next`, then after each draft.
    hs: Vec<f32>,
    /// The state `next` was chosen after (the last round's), for the head's guess in the
    /// round's first call; empty in the first round (its token came from llama.cpp's logits).
    prev: Vec<f32>,
    /// What rides in a step's call after its draft ([`Rounds::ride_after`]).
    ride: Vec<Token>,
    /// The head's scratch ([`Rounds::guess`]): the next token's row, the query, the input.
    guess_buf: Vec<f32>,
    n: usize,
    drafts: Vec<Token>,
    /// The pass's rows: their logits under a grammar, else their greedy tokens
    /// ([`OnDemand::try_argmax_rows`]).
    logits: Vec<Vec<f32>>,
    best: Vec<Token>,
    emitted: Vec<Token>,
    variants: Vec<Token>,
    /// A row's logits masked by the grammar.
    masked: Vec<f32>,
}

impl<'a> Rounds<'a> {
    /// The rounds of a generation whose first token `first` is emitted at `pos`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &'a mut Context,
        od: &'a OnDemand,
        cfg: &'a VocabConfig,
        state: &'a mut VocabState,
        grammar: Option<&'a mut Grammar>,
        max_tokens: usize,
        g: Generation,
        (vocab, cap, prefix_max): (DraftVocab, usize, usize),
        (context, corpus): (Option<ContextDrafter>, Option<&'a mut CorpusDrafter>),
        first: Token,
        pos: i32,
    ) -> Self {
        Self {
            model: ctx.model().clone(),
            ctx,
            od,
            cfg,
            state,
            grammar,
            max_tokens,
            g,
            vocab,
            cap,
            prefix_max,
            context,
            corpus,
            next: first,
            pos,
            done: false,
            misses: 0,
            batch: Batch::new(cfg.max_draft + 1, 1),
            proposals: Vec::new(),
            hs: Vec::new(),
            prev: Vec::new(),
            ride: Vec::new(),
            guess_buf: Vec::new(),
            n: od.n_embd(),
            drafts: Vec::new(),
            logits: Vec::new(),
            best: Vec::new(),
            emitted: Vec::new(),
            variants: Vec::new(),
            masked: Vec::new(),
        }
    }

    /// One round: draft (a chain, then steps), project, walk, learn, emit.
    ///
    /// # Errors
    /// Decode failures; the model file cannot be read.
    pub fn round(&mut self, on_token: &mut dyn FnMut(Token) -> bool) -> Result<()> {
        let tv = Instant::now();
        self.hs.clear();
        self.drafts.clear();
        // At most one token more than drafted is emitted.
        let k = self
            .state
            .next_steps(self.cfg.max_draft)
            .min(self.max_tokens - self.g.tokens.len() - 1);
        let ahead = self.chain(k)?;
        self.steps(k.max(self.drafts.len()), ahead)?;
        self.g.drafted_tokens += self.drafts.len() as u64;
        let rows = self.project()?;
        let stuck = self.walk(rows);
        let m = self.learn()?;
        self.g.verify_seconds += tv.elapsed().as_secs_f64();
        self.emit(m, stuck, on_token);
        Ok(())
    }

    /// The call after `next`, with a retrieval chain through the blocks in it (proposed
    /// whatever `k` is: it rides in the call the next token needs anyway, and its rows past
    /// the first the resident vocabulary disowns are dropped unprojected), or without one the
    /// head's guess ([`Rounds::guess`]), a chain of one. The drafts it keeps go to `drafts`;
    /// the next draft, when checking the chain already found it.
    fn chain(&mut self, k: usize) -> Result<Option<Token>> {
        let left = self.max_tokens - self.g.tokens.len() - 1;
        let td = Instant::now();
        let mut chain: Vec<Token> = Vec::new();
        let mut ahead = None;
        if let (Some(c), true) = (self.context.as_mut(), left > 0) {
            self.proposals.clear();
            c.propose(
                MAX_CHAIN.min(self.cfg.max_draft).min(left),
                1,
                &mut self.proposals,
            );
            if let Some(p) = self.proposals.first() {
                chain.clone_from(&p.tokens);
            }
            // Where the request's text has no chain, the model's answers to other prompts.
            if let (true, Some(corpus)) = (chain.is_empty(), self.corpus.as_deref_mut()) {
                self.proposals.clear();
                corpus.propose(
                    MAX_CHAIN.min(self.cfg.max_draft).min(left),
                    1,
                    &mut self.proposals,
                );
                if let Some(p) = self
                    .proposals
                    .first()
                    .filter(|p| p.match_len >= self.cfg.min_match)
                {
                    chain.clone_from(&p.tokens);
                }
            }
            // Under a grammar, up to the first token it refuses.
            if let Some(gr) = self.grammar.as_deref() {
                chain.truncate(gr.allowed_prefix(&chain)?);
            }
        }
        // Without a chain, the head's guess after `next` rides instead (as in a step).
        let mut guessed = false;
        if chain.is_empty()
            && left > 0
            && self.grammar.is_none()
            && !self.prev.is_empty()
            && !self.model.is_eog(self.next)
            && self.state.guess_pays(self.cfg.always_guess)
        {
            if let Some(g) = self.guess(None, self.next) {
                chain.push(g);
                guessed = true;
            }
        }
        self.g.draft_seconds += td.elapsed().as_secs_f64();
        // The stream reads the projection's first chunk ahead only in the call before a pass.
        self.od.prefetch(k == 0);
        let ts = Instant::now();
        self.g.verify_rows += 1 + chain.len() as u64;
        let (ctx, od, batch, hs) = (&mut *self.ctx, self.od, &mut self.batch, &mut self.hs);
        run(ctx, od, batch, self.next, &chain, self.pos, hs)?;
        let seconds = ts.elapsed().as_secs_f64();
        if chain.is_empty() {
            self.state.record_step(seconds);
        } else {
            let td = Instant::now();
            let kept;
            (kept, ahead) = self.keep_chain(&chain, 0, self.pos);
            if guessed {
                self.state.record_guess(kept == 1, seconds);
                self.g.guesses += 1;
                self.g.guesses_kept += kept as u64;
            }
            self.g.draft_seconds += td.elapsed().as_secs_f64();
        }
        self.g.target_calls += 1;
        Ok(ahead)
    }

    /// Steps until `k` drafts (or an end of generation, or the output's limit): each drafts
    /// the resident best after the last state (`ahead` first, when a chain found it) and runs
    /// it through the blocks, with what [`Rounds::ride_after`] puts in the same call. Under a
    /// grammar, a draft it refuses ends them.
    fn steps(&mut self, k: usize, mut ahead: Option<Token>) -> Result<()> {
        let n = self.n;
        // Under a grammar, a copy of it after the drafts so far (made at the first step).
        let mut walk: Option<Grammar> = None;
        while self.drafts.len() < k
            && !self.drafts.last().is_some_and(|&d| self.model.is_eog(d))
            && self.g.tokens.len() + self.drafts.len() + 1 < self.max_tokens
        {
            let td = Instant::now();
            let h = &self.hs[self.hs.len() - n..];
            let Some(d) = ahead
                .take()
                .or_else(|| self.vocab.argmax(h).map(|(d, _)| d))
            else {
                break;
            };
            if let Some(gr) = self.grammar.as_deref() {
                let w = match &mut walk {
                    Some(w) => w,
                    None => {
                        let mut w = gr.try_clone()?;
                        self.drafts.iter().for_each(|&t| w.accept(t));
                        walk.insert(w)
                    }
                };
                // The target would refuse it: no step for it.
                if !w.allows(d) {
                    break;
                }
                w.accept(d);
            }
            self.drafts.push(d);
            if self.model.is_eog(d) {
                // Nothing follows an end of generation: no step for it.
                self.g.draft_seconds += td.elapsed().as_secs_f64();
                break;
            }
            let guessed = self.ride_after(d, k);
            self.g.draft_seconds += td.elapsed().as_secs_f64();
            self.od.prefetch(self.drafts.len() + self.ride.len() >= k);
            let ts = Instant::now();
            let at = self.pos + self.drafts.len() as i32;
            run(
                self.ctx,
                self.od,
                &mut self.batch,
                d,
                &self.ride,
                at,
                &mut self.hs,
            )?;
            let seconds = ts.elapsed().as_secs_f64();
            self.g.target_calls += 1;
            self.g.verify_rows += 1 + self.ride.len() as u64;
            if self.ride.is_empty() {
                self.state.record_step(seconds);
                continue;
            }
            let td = Instant::now();
            // Out of `self` while `keep_chain` takes it, and back after (the buffer is kept).
            let ride = std::mem::take(&mut self.ride);
            let kept;
            (kept, ahead) = self.keep_chain(&ride, self.hs.len() / n - 1 - ride.len(), at);
            if guessed {
                self.state.record_guess(kept == 1, seconds);
                self.g.guesses += 1;
                self.g.guesses_kept += kept as u64;
            } else {
                self.g.rides += ride.len() as u64;
                self.g.rides_kept += kept as u64;
            }
            self.ride = ride;
            self.g.draft_seconds += td.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// What rides in the call of draft `d` (the last of `drafts`), into `ride`, not under a
    /// grammar (its walk would need it): a retrieval chain after the drafts so far, as after
    /// `next` in the round's first call ([`Rounds::chain`]) but at most [`RIDE`] tokens, so a
    /// round that comes to text the request holds copies up to `RIDE + 1` tokens a call rather
    /// than one; else the head's guess after `d`, while the drafts stay within `k`. Whether it
    /// is the guess.
    fn ride_after(&mut self, d: Token, k: usize) -> bool {
        self.ride.clear();
        if self.grammar.is_some() {
            return false;
        }
        // Drafts past what the output may still take are not drafted.
        let left = self.max_tokens - self.g.tokens.len() - 1 - self.drafts.len();
        let budget = RIDE.min(self.cfg.max_draft).min(left);
        if let Some(c) = self.context.as_ref() {
            if c.continue_after(&self.drafts, budget, &mut self.ride)
                .is_some()
            {
                // Nothing follows an end of generation.
                if let Some(e) = self.ride.iter().position(|&t| self.model.is_eog(t)) {
                    self.ride.truncate(e + 1);
                }
                return false;
            }
        }
        if self.drafts.len() < k && left > 0 && self.state.guess_pays(self.cfg.always_guess) {
            let row = self.hs.len() / self.n - 1;
            if let Some(g) = self.guess(Some(row), d) {
                self.ride.push(g);
                return true;
            }
        }
        false
    }

    /// Which tokens of `chain`, run after the state in row `base` of `hs` (the chain's own
    /// states the rows after it, the last of `hs`) at position `at`, stand: each while it is
    /// the resident vocabulary's best after the one before; from the first that is not
    /// (not the target's token: its best is the resident best or a token outside) the rows
    /// and cache cells go. The kept tokens join `drafts`. How many stood, and the resident
    /// best after the last that did where a token did not (the next draft; else the next
    /// step finds it).
    fn keep_chain(&mut self, chain: &[Token], base: usize, at: i32) -> (usize, Option<Token>) {
        let n = self.n;
        let mut kept = 0;
        let mut next = None;
        for (j, &c) in chain.iter().enumerate() {
            let h = &self.hs[(base + j) * n..(base + j + 1) * n];
            let best = self.vocab.argmax(h).map(|(r, _)| r);
            if best != Some(c) {
                next = best;
                break;
            }
            kept += 1;
        }
        self.hs.truncate((base + kept + 1) * n);
        self.drafts.extend_from_slice(&chain[..kept]);
        self.ctx.seq_rm(0, at + 1 + kept as i32, -1);
        (kept, next)
    }

    /// The head's guess at the token after `d`, chosen after state `row` of `hs` (`None`:
    /// `prev`, the last round's): the resident token that scores best against the head's
    /// query ([`crate::ahead::Ahead::query`]). Into buffers kept for it, no allocation a step.
    fn guess(&mut self, row: Option<usize>, d: Token) -> Option<Token> {
        let head = self.state.ahead.as_ref()?;
        let n = self.n;
        let h = match row {
            None => &self.prev[..],
            Some(r) => &self.hs[r * n..(r + 1) * n],
        };
        self.guess_buf.resize(4 * n, 0.0);
        let (e, rest) = self.guess_buf.split_at_mut(n);
        let (u, x) = rest.split_at_mut(n);
        self.od.row_f32(d as usize, e);
        head.query_into(h, e, x, u);
        self.vocab.argmax(u).map(|(t, _)| t)
    }

    /// One pass over the output weights for every state; how many rows.
    fn project(&mut self) -> Result<usize> {
        let tp = Instant::now();
        let views: Vec<&[f32]> = self.hs.chunks_exact(self.n).collect();
        let rows = views.len();
        if self.grammar.is_some() {
            // A grammar masks whole rows of logits.
            self.logits
                .resize_with(rows.max(self.logits.len()), Vec::new);
            self.od.try_logits_rows(&views, &mut self.logits[..rows])?;
        } else {
            // Only the greedy tokens: no logits written and read back.
            self.best = self.od.try_argmax_rows(&views)?;
        }
        let pass = tp.elapsed().as_secs_f64();
        self.state.record_pass(rows, pass);
        let g = &mut self.g;
        g.project_seconds += pass;
        g.output_rows += rows as u64;
        g.rows_after_exit += rows as u64;
        Ok(rows)
    }

    /// The target's token after each state into `emitted`; a draft stands while it is that
    /// token. Under a grammar, the best it allows (it accepts the token: every token emitted
    /// here is output, or the generation ends). Whether the grammar allowed none somewhere.
    fn walk(&mut self, rows: usize) -> bool {
        self.emitted.clear();
        for i in 0..rows {
            let t = match self.grammar.as_deref_mut() {
                Some(gr) => match gr.take_greedy(&self.logits[i], &mut self.masked) {
                    Some(t) => t,
                    None => return true,
                },
                None => self.best[i],
            };
            self.emitted.push(t);
            if self.drafts.get(i) != Some(&t) {
                break;
            }
        }
        false
    }

    /// What the round teaches: acceptance (the emitted tokens that were drafted: the last one
    /// emitted is the target's correction or its token after the last draft, unless it was a
    /// drafted end of generation without a state), more of the vocabulary's first ids after
    /// repeated misses, the emitted tokens and their spellings into the vocabulary. The cells
    /// past the accepted drafts (rejected ones) leave the cache. How many drafts stood.
    fn learn(&mut self) -> Result<usize> {
        let drafts = &self.drafts;
        let m = self
            .emitted
            .iter()
            .zip(drafts)
            .take_while(|(e, d)| e == d)
            .count();
        let state = &mut *self.state;
        state.accepted += m as f64;
        state.trials += (m + usize::from(m < drafts.len())) as f64;
        if m < drafts.len() {
            self.misses += 1;
            // Drafts keep missing in this request (more than 1 in 30, twice or more): more
            // of the vocabulary's first ids, while the set has room for them.
            let n_vocab = self.model.n_vocab() as usize;
            if self.misses >= 2
                && self.misses * 30 > self.g.drafted_tokens as usize
                && state.prefix < self.prefix_max.min(n_vocab)
            {
                let next = (state.prefix + GROW).min(self.prefix_max).min(n_vocab);
                let ids: Vec<Token> = (state.prefix as Token..next as Token).collect();
                self.vocab.add(&ids, self.cap)?;
                state.prefix = next;
            }
        }
        self.ctx.seq_rm(0, self.pos + 1 + m as i32, -1);
        self.vocab.add(&self.emitted, self.cap)?;
        self.variants.clear();
        state
            .spelled
            .of(&self.model, &self.emitted, &mut self.variants);
        self.vocab.add(&self.variants, self.cap)?;
        Ok(m)
    }

    /// The emitted tokens out (and to retrieval), up to an end of generation, the output's
    /// limit or `on_token` declining; the next round starts after them (`m` drafts stood).
    fn emit(&mut self, m: usize, stuck: bool, on_token: &mut dyn FnMut(Token) -> bool) {
        for &t in &self.emitted {
            if let Some(c) = self.context.as_mut() {
                c.accepted(t);
                if let Some(c) = self.corpus.as_deref_mut() {
                    c.accepted(t);
                }
            }
            self.g.tokens.push(t);
            if self.model.is_eog(t) || !on_token(t) || self.g.tokens.len() >= self.max_tokens {
                self.done = true;
                return;
            }
        }
        if stuck {
            self.done = true;
            return;
        }
        self.next = *self.emitted.last().expect("one token per pass at least");
        let n = self.n;
        self.prev.clear();
        self.prev.extend_from_slice(&self.hs[m * n..(m + 1) * n]);
        self.pos += 1 + m as i32;
    }
}

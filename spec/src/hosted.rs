//! Drafting for a host that verifies itself: llama.cpp's `--spec-type leap` (patches/), where
//! llama-server or llama-cli owns the context, decodes the drafts as a chain and accepts them,
//! and Leap only proposes. The C API hands one [`HostedDrafter`] to each of the host's
//! sequences (`leap_drafter_*` in include/leap.h).
//!
//! What the host's loop lets Leap do: retrieval from the request ([`ContextDrafter`]: prompt
//! and output so far, short suffix matches) and from the sequence's earlier requests and
//! answers ([`HistoryDrafter`]), and the cost model's decision of how much of the best
//! proposal to draft, or nothing ([`lever::build`] with one leaf: the chain whose expected
//! tokens per unit of cost beat a plain step). Acceptance and the cost of a call of `k` rows
//! are learned from what the host does: the tokens it appends after a draft tell how many
//! were taken (so this works whether or not the host reports it), and the time from handing
//! out a draft of `k` tokens to the next request for one is the host's cost of a step of
//! `k + 1` rows, decoding, sampling and bookkeeping included.
//!
//! What it cannot reach from there: token trees (the host verifies one chain), in-context
//! calibration and on-demand projection (the host owns the logits), draft reuse (the host
//! samples only up to the first rejection, so the target's predictions after it are never
//! known).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::control::{Controller, Evidence};
use crate::corpus::CorpusDrafter;
use crate::draft::{ContextDrafter, Drafter, HistoryDrafter, Proposal};
use crate::lever;
use crate::sam::{SuffixAutomaton, Token};

/// How a hosted drafter drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct HostedConfig {
    /// Most tokens in one draft.
    pub max_draft: usize,
    /// Shortest suffix match to draft from.
    pub min_match: usize,
    /// Tokens of the sequence's earlier requests and answers kept for drafting (0: none).
    pub history_tokens: usize,
    /// Prior for the cost slope of extra rows (learned online).
    pub beta_prior: f64,
}

impl Default for HostedConfig {
    fn default() -> Self {
        let e = crate::engine::EngineConfig::default();
        Self {
            max_draft: e.max_draft,
            min_match: e.min_match,
            history_tokens: e.history_tokens,
            beta_prior: e.beta_prior,
        }
    }
}

/// A draft handed out and not yet seen through: what was drafted, the evidence behind each
/// token, and what the construction expected of it.
#[derive(Debug)]
struct Pending {
    tokens: Vec<Token>,
    evidence: Vec<Evidence>,
    expected: f64,
}

/// What a hosted drafter has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostedStats {
    /// Calls to [`HostedDrafter::draft`].
    pub steps: u64,
    /// Of those, the ones that returned a draft.
    pub drafts: u64,
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafted tokens the host kept (as the tokens it appended after them show).
    pub accepted: u64,
}

/// One sequence's drafter (see the module documentation).
#[derive(Debug)]
pub struct HostedDrafter {
    cfg: HostedConfig,
    /// Acceptance and cost estimates, shared with the drafters of the host's other sequences
    /// ([`HostedDrafter::sibling`]): one model on one machine.
    control: Arc<Mutex<Controller>>,
    /// Retrieval from the generation's text, which it holds: the prompt, then every token
    /// the host appended to it.
    local: ContextDrafter,
    history: HistoryDrafter,
    /// The model's own answers to other prompts (`None`: no corpus; [`crate::corpus`]).
    corpus: Option<CorpusDrafter>,
    /// How much of `local`'s text was the generation's prompt (`None`: no generation yet).
    prompt_len: Option<usize>,
    /// The last draft, until the next step shows what became of it.
    pending: Option<Pending>,
    /// When the last step's draft (maybe empty) was handed out, and its rows (draft + 1).
    last_step: Option<(Instant, usize)>,
    /// The clock the host's calls are timed with (`Instant::now`; the tests' own ticks, so
    /// that a machine's hiccup between two steps cannot make their rows look dear).
    clock: fn() -> Instant,
    stats: HostedStats,
    proposals: Vec<Proposal>,
}

impl HostedDrafter {
    /// A drafter with no history.
    pub fn new(cfg: HostedConfig) -> Self {
        Self {
            control: Arc::new(Mutex::new(Controller::new(cfg.beta_prior))),
            local: ContextDrafter::new(cfg.min_match),
            history: HistoryDrafter::new(cfg.min_match, cfg.history_tokens),
            corpus: None,
            prompt_len: None,
            pending: None,
            last_step: None,
            clock: Instant::now,
            stats: HostedStats::default(),
            proposals: Vec::new(),
            cfg,
        }
    }

    /// A drafter for another sequence of the same host: its own text and history, the
    /// acceptance and cost estimates of this one (what one sequence learns, all use).
    pub fn sibling(&self) -> Self {
        Self {
            control: Arc::clone(&self.control),
            corpus: self.corpus.clone(),
            ..Self::new(self.cfg.clone())
        }
    }

    /// Draft from the model's own answers to other prompts too (`sam`:
    /// [`crate::corpus::Corpus::automaton`]); siblings made after this share them.
    pub fn set_corpus(&mut self, sam: Arc<SuffixAutomaton>) {
        self.corpus = Some(CorpusDrafter::new(sam, self.cfg.min_match));
    }

    fn control(&self) -> MutexGuard<'_, Controller> {
        // The estimates stay usable after a panic elsewhere: they are numbers.
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configuration.
    pub fn config(&self) -> &HostedConfig {
        &self.cfg
    }

    /// What it has done so far.
    pub fn stats(&self) -> HostedStats {
        self.stats
    }

    /// A new generation on this sequence starts from `prompt` (every token the host's
    /// context holds for it). The last generation, if any, goes into the history.
    pub fn begin(&mut self, prompt: &[Token]) {
        self.end();
        self.prompt_len = Some(prompt.len());
        self.local.begin(prompt);
        self.history.begin(prompt);
        if let Some(c) = self.corpus.as_mut() {
            c.begin(prompt);
        }
    }

    /// Close the current generation: its prompt and answer join the history.
    fn end(&mut self) {
        if let Some(n) = self.prompt_len.take() {
            let text = self.local.text();
            let (prompt, answer) = text.split_at(n.min(text.len()));
            self.history.end(prompt, answer);
        }
        self.pending = None;
        self.last_step = None;
    }

    /// The host is about to verify: its sequence holds `tokens`, followed by `id_last`
    /// (sampled, not yet decoded). Returns at most `max` tokens to verify after `id_last`,
    /// possibly none (then a plain step pays more than any draft would).
    ///
    /// A `tokens` that does not extend what this drafter saw (a host that did not call
    /// [`HostedDrafter::begin`], or edited its context) starts a new generation from it.
    pub fn draft(&mut self, tokens: &[Token], id_last: Token, max: usize) -> &[Token] {
        let now = (self.clock)();
        self.stats.steps += 1;
        let seen = self.local.text();
        let extends = self.prompt_len.is_some()
            && tokens.len() >= seen.len()
            && tokens[..seen.len()] == *seen;
        if !extends {
            self.begin(tokens);
        }
        // What the host appended since the last step: the accepted drafts and the token it
        // sampled after them.
        let appended = &tokens[self.local.text().len()..];
        if let Some((t, rows)) = self.last_step.take() {
            self.control()
                .record_cost(rows, now.duration_since(t).as_secs_f64());
        }
        if let Some(p) = self.pending.take() {
            self.learn(&p, appended, id_last);
        }
        for &t in appended.iter().chain(std::iter::once(&id_last)) {
            self.local.accepted(t);
            self.history.accepted(t);
            if let Some(c) = self.corpus.as_mut() {
                c.accepted(t);
            }
        }

        let budget = max.min(self.cfg.max_draft);
        self.proposals.clear();
        if budget > 0 {
            self.local.propose(budget, 1, &mut self.proposals);
            self.history.propose(budget, 1, &mut self.proposals);
            if let Some(c) = self.corpus.as_mut() {
                c.propose(budget, 1, &mut self.proposals);
            }
        }
        let built = lever::build(
            id_last,
            &self.proposals,
            &self.control(),
            budget + 1,
            1,
            budget,
        );
        // One leaf: the tree is a chain, its last node the leaf.
        let leaf = built.tree.len() - 1;
        if leaf == 0 {
            self.control().record_plain_step();
        } else {
            let tokens = built.tree.path(leaf);
            self.stats.drafts += 1;
            self.stats.drafted += tokens.len() as u64;
            self.pending = Some(Pending {
                tokens,
                evidence: built.evidence[1..].to_vec(),
                expected: built.expected,
            });
        }
        self.last_step = Some(((self.clock)(), leaf + 1));
        self.pending.as_ref().map_or(&[], |p| &p.tokens)
    }

    /// Learn from a draft and what the host appended after it (`appended`, the kept drafts,
    /// then `id_last`, the token the target chose where the draft went wrong or after its
    /// end).
    fn learn(&mut self, p: &Pending, appended: &[Token], id_last: Token) {
        // The kept drafts; the token after them is the target's own.
        let n = p
            .tokens
            .iter()
            .zip(appended.iter().chain(std::iter::once(&id_last)))
            .take_while(|(a, b)| a == b)
            .count()
            .min(appended.len());
        self.stats.accepted += n as u64;
        let mut control = self.control();
        // Every drafted token whose predecessor was accepted was checked: taken or not.
        for (i, &ev) in p.evidence.iter().enumerate().take(n + 1) {
            control.record_token(ev, i < n);
        }
        control.record_reliability(p.expected, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host that verifies greedily against `truth` (the text the target would write):
    /// it keeps the drafted tokens that match, then appends the target's own token.
    fn run(d: &mut HostedDrafter, prompt: &[Token], truth: &[Token]) -> (usize, usize) {
        d.begin(prompt);
        let mut tokens = prompt.to_vec();
        let mut id_last = truth[0];
        let mut at = 1;
        let mut calls = 0;
        while at < truth.len() {
            let draft = d.draft(&tokens, id_last, 16);
            calls += 1;
            tokens.push(id_last);
            let n = draft
                .iter()
                .zip(&truth[at..])
                .take_while(|(a, b)| a == b)
                .count();
            tokens.extend_from_slice(&truth[at..at + n]);
            at += n;
            if at < truth.len() {
                id_last = truth[at];
                at += 1;
            }
        }
        (truth.len(), calls)
    }

    /// A drafter on [`ticks`].
    fn drafter(cfg: HostedConfig) -> HostedDrafter {
        let mut d = HostedDrafter::new(cfg);
        d.clock = ticks;
        d
    }

    /// A clock that moves 1 ms each time it is read (in this thread): every host call
    /// takes the same time, whatever its rows, and whatever else the machine does.
    fn ticks() -> Instant {
        use std::cell::Cell;
        use std::time::Duration;
        thread_local! {
            static CLOCK: Cell<Option<Instant>> = const { Cell::new(None) };
        }
        CLOCK.with(|c| {
            let t = c.get().unwrap_or_else(Instant::now) + Duration::from_millis(1);
            c.set(Some(t));
            t
        })
    }

    fn text(seed: u64, n: usize) -> Vec<Token> {
        let mut rng = leap_kernels::rng::XorShift::new(seed);
        (0..n).map(|_| rng.below(5000) as Token).collect()
    }

    #[test]
    fn copies_a_passage_of_the_prompt_in_few_steps() {
        let passage = text(7, 200);
        let mut prompt = text(3, 50);
        prompt.extend_from_slice(&passage);
        prompt.extend_from_slice(&text(5, 20));
        prompt.extend_from_slice(&passage[..4]);
        let mut d = drafter(HostedConfig::default());
        let (tokens, calls) = run(&mut d, &prompt, &passage[4..]);
        assert!(calls * 4 < tokens, "{calls} calls for {tokens} tokens");
        let s = d.stats();
        assert!(s.accepted > 150 && s.accepted <= s.drafted, "{s:?}");
    }

    #[test]
    fn learns_to_stop_drafting_what_the_target_never_takes() {
        // The text ends in a 10-token repeat of an earlier passage, so the passage's
        // continuation is drafted; the target rejects its first token every time.
        let passage = text(9, 100);
        let mut prompt = passage.clone();
        prompt.extend_from_slice(&passage[..10]);
        let mut d = drafter(HostedConfig {
            history_tokens: 0,
            ..HostedConfig::default()
        });
        let mut lens = Vec::new();
        for _ in 0..30 {
            d.begin(&prompt);
            let draft = d.draft(&prompt, passage[10], 16);
            lens.push(draft.len());
            let mut after = prompt.clone();
            after.push(passage[10]);
            // The target took none of it: its own token came instead.
            let _ = d.draft(&after, 9999, 16);
        }
        assert!(lens[0] >= 2, "{lens:?}");
        // After a few rejections, nothing; but for one exploring draft now and then
        // (Controller::exploring), so that drafts come back when they would pay again.
        assert!(
            lens[5..].iter().filter(|&&l| l > 0).count() <= 1,
            "{lens:?}"
        );
        assert_eq!(d.stats().accepted, 0);
        // What it learned holds for its siblings (the host's other sequences) too, and not
        // for an unrelated drafter.
        let mut sibling = d.sibling();
        sibling.begin(&prompt);
        assert!(sibling.draft(&prompt, passage[10], 16).len() <= 1);
        let mut fresh = drafter(d.config().clone());
        fresh.begin(&prompt);
        assert!(fresh.draft(&prompt, passage[10], 16).len() >= 2);
    }

    #[test]
    fn drafts_from_the_sequences_earlier_answers() {
        let answer = text(11, 120);
        let mut d = drafter(HostedConfig::default());
        run(&mut d, &text(1, 30), &answer);
        let before = d.stats();
        // A new request whose answer repeats the last one: only the history has it.
        let (tokens, calls) = run(&mut d, &text(2, 30), &answer);
        let s = d.stats();
        assert!(s.accepted - before.accepted > 80, "{before:?} -> {s:?}");
        assert!(calls * 3 < tokens, "{calls} calls for {tokens} tokens");
        // Without history, the same request drafts nothing.
        let mut fresh = drafter(HostedConfig {
            history_tokens: 0,
            ..HostedConfig::default()
        });
        run(&mut fresh, &text(1, 30), &answer);
        let b = fresh.stats();
        run(&mut fresh, &text(2, 30), &answer);
        assert_eq!(fresh.stats().drafted, b.drafted);
    }

    #[test]
    fn drafts_from_the_model_s_answers_to_other_prompts() {
        let answer = text(13, 120);
        let mut corpus = crate::corpus::Corpus::new();
        corpus.push(&answer);
        let sam = corpus.automaton();
        let cfg = HostedConfig {
            history_tokens: 0,
            ..HostedConfig::default()
        };
        // The answer starts after its first two tokens (a match the corpus holds).
        let mut prompt = text(4, 30);
        prompt.extend_from_slice(&answer[..2]);
        let mut d = drafter(cfg.clone());
        d.set_corpus(Arc::clone(&sam));
        let (tokens, calls) = run(&mut d, &prompt, &answer[2..]);
        assert!(calls * 3 < tokens, "{calls} calls for {tokens} tokens");
        // A sibling (another of the host's sequences) drafts from it too.
        let mut sibling = d.sibling();
        sibling.clock = ticks;
        let (tokens, calls) = run(&mut sibling, &prompt, &answer[2..]);
        assert!(
            calls * 3 < tokens,
            "sibling: {calls} calls for {tokens} tokens"
        );
        // Without it, nothing to draft.
        let mut fresh = drafter(cfg);
        run(&mut fresh, &prompt, &answer[2..]);
        assert_eq!(fresh.stats().drafted, 0);
    }

    #[test]
    fn a_host_that_edits_its_context_starts_over() {
        let mut d = drafter(HostedConfig::default());
        d.begin(&[1, 2, 3, 1, 2]);
        let _ = d.draft(&[1, 2, 3, 1, 2], 3, 8);
        // The host dropped tokens (a context shift) and did not call begin.
        let draft = d.draft(&[7, 8, 9, 7, 8, 9, 7], 8, 8);
        assert_eq!(draft.first(), Some(&9), "{draft:?}");
        assert!(draft.len() <= 8);
        // Never more than asked for.
        assert!(d.draft(&[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], 9, 1).len() <= 1);
        assert!(d
            .draft(&[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7], 8, 0)
            .is_empty());
    }
}

//! Drafters: where the engine's candidate continuations come from, each behind [`Drafter`]
//! and testable without a model.
//!
//! - [`ContextDrafter`]: retrieval from the request itself (prompt and the text generated so
//!   far) with a suffix automaton (000 §4.1, SAM decoding): longest-suffix match over token
//!   ids, several candidate continuations, O(1) amortised update per token.
//! - [`HistoryDrafter`]: the same over the conversation's earlier requests and answers, kept
//!   across requests within a token budget.
//! - [`ReuseDrafter`]: draft reuse (000 §3.4, Eq. 3): the longest segment of a rejected draft
//!   on which the target's own predictions agreed, offered again after the correction, for a
//!   limited number of steps.

pub use crate::control::Source;
use crate::sam::{Match, Matcher, SuffixAutomaton, Token};

/// A candidate continuation of the text so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    /// The drafted tokens (not empty).
    pub tokens: Vec<Token>,
    /// How much evidence backs it: the length of the suffix match it continues (the
    /// controller's acceptance estimates are indexed by it and the source).
    pub match_len: usize,
    /// Which drafter proposed it.
    pub source: Source,
}

/// A source of draft continuations. The engine calls [`Drafter::begin`] with the prompt,
/// [`Drafter::accepted`] with every token it emits, [`Drafter::propose`] before each
/// verification, [`Drafter::verified`] after it, and [`Drafter::end`] with the answer.
pub trait Drafter {
    /// A request starts with `prompt`.
    fn begin(&mut self, prompt: &[Token]);
    /// `t` was emitted (appended to the text).
    fn accepted(&mut self, t: Token);
    /// Up to `max` candidates of at most `budget` tokens each, best first.
    fn propose(&mut self, budget: usize, max: usize, out: &mut Vec<Proposal>);
    /// One verification's outcome: `draft` was the drafted path that was checked furthest
    /// (the accepted path and what followed it), `predicted[i]` the target's token after
    /// `draft[..i]`, `accepted` how many of `draft` were kept.
    fn verified(&mut self, _draft: &[Token], _predicted: &[Token], _accepted: usize) {}
    /// The request ended; `prompt` and `answer` are the whole exchange.
    fn end(&mut self, _prompt: &[Token], _answer: &[Token]) {}
}

/// Separates requests in a history automaton, so no match spans two of them. Never a token.
pub const SEPARATOR: Token = -1;

/// Continuations from a match, cut at a [`SEPARATOR`].
fn continuation(sam: &SuffixAutomaton, m: Match, budget: usize) -> Vec<Token> {
    let c = sam.continuation(m, budget);
    c[..c.iter().position(|&t| t == SEPARATOR).unwrap_or(c.len())].to_vec()
}

/// The proposal of a text followed through another's automaton (`matcher` on `sam`): what
/// followed its match there, when the match has `min_match` tokens or more, as `source`.
pub(crate) fn followed(
    sam: &SuffixAutomaton,
    matcher: &Matcher,
    min_match: usize,
    budget: usize,
    source: Source,
) -> Option<Proposal> {
    let m = matcher.current(sam).filter(|m| m.len >= min_match)?;
    let tokens = continuation(sam, m, budget);
    (!tokens.is_empty()).then_some(Proposal {
        tokens,
        match_len: m.len,
        source,
    })
}

/// Retrieval from the current request: prompt and output so far.
#[derive(Debug, Default)]
pub struct ContextDrafter {
    sam: SuffixAutomaton,
    min_match: usize,
}

impl ContextDrafter {
    /// Drafts from suffix matches of at least `min_match` tokens.
    pub fn new(min_match: usize) -> Self {
        Self {
            sam: SuffixAutomaton::new(),
            min_match: min_match.max(1),
        }
    }

    /// The text taken in: the request's prompt and every token accepted since.
    pub fn text(&self) -> &[Token] {
        self.sam.text()
    }

    /// Up to `budget` tokens that may follow the text and then `drafts`, tokens not taken in
    /// (a self-drafting round's drafts, which only the round's pass accepts), into `out`
    /// (cleared first, so a caller drafting every step keeps one buffer): what followed the
    /// first occurrence in the text of the longest suffix of the two together, `min_match`
    /// tokens or more. That suffix's length, or `None` (`out` empty) where there is none or
    /// nothing follows it. A suffix of more than [`TAIL`] text tokens plus the drafts is
    /// matched as that long.
    pub fn continue_after(
        &self,
        drafts: &[Token],
        budget: usize,
        out: &mut Vec<Token>,
    ) -> Option<usize> {
        out.clear();
        if drafts.is_empty() || budget == 0 {
            return None;
        }
        let text = self.sam.text();
        let mut m = Matcher::new();
        for &t in text[text.len().saturating_sub(TAIL)..].iter().chain(drafts) {
            m.push(&self.sam, t);
        }
        let m = m.current(&self.sam).filter(|m| m.len >= self.min_match)?;
        // A request's text holds no SEPARATOR (that is the history's): no cut.
        out.extend_from_slice(self.sam.continuation(m, budget));
        (!out.is_empty()).then_some(m.len)
    }
}

/// Text tokens [`ContextDrafter::continue_after`] matches before the drafts.
pub const TAIL: usize = 32;

impl Drafter for ContextDrafter {
    fn begin(&mut self, prompt: &[Token]) {
        self.sam = SuffixAutomaton::with_capacity(prompt.len() + 1024);
        self.sam.extend(prompt);
    }

    fn accepted(&mut self, t: Token) {
        self.sam.push(t);
    }

    fn propose(&mut self, budget: usize, max: usize, out: &mut Vec<Proposal>) {
        let sam = &self.sam;
        let push = |m: crate::sam::Match, source: Source, out: &mut Vec<Proposal>| {
            let tokens = continuation(sam, m, budget);
            if !tokens.is_empty() {
                out.push(Proposal {
                    tokens,
                    match_len: m.len,
                    source,
                });
            }
        };
        let from = out.len();
        for m in sam.repeats(self.min_match, max) {
            push(m, Source::Request, out);
        }
        // With room for branches: the other tokens that followed the longest match, each
        // with its own continuation (the tree builder weighs them by what siblings earned).
        if max > 1 {
            let firsts: Vec<Token> = out[from..].iter().map(|p| p.tokens[0]).collect();
            for m in sam.alternatives(self.min_match, max - 1, &firsts) {
                push(m, Source::Sibling, out);
            }
        }
    }
}

/// Retrieval from the conversation's earlier requests and answers.
#[derive(Debug)]
pub struct HistoryDrafter {
    sam: SuffixAutomaton,
    matcher: Matcher,
    min_match: usize,
    budget: usize,
}

impl HistoryDrafter {
    /// Keeps up to `budget` tokens of history (the oldest half goes when it is full).
    pub fn new(min_match: usize, budget: usize) -> Self {
        Self {
            sam: SuffixAutomaton::new(),
            matcher: Matcher::new(),
            min_match: min_match.max(1),
            budget,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.sam.len()
    }

    /// Whether nothing is remembered yet.
    pub fn is_empty(&self) -> bool {
        self.sam.is_empty()
    }
}

impl Drafter for HistoryDrafter {
    fn begin(&mut self, prompt: &[Token]) {
        self.matcher = Matcher::after(&self.sam, prompt);
    }

    fn accepted(&mut self, t: Token) {
        self.matcher.push(&self.sam, t);
    }

    fn propose(&mut self, budget: usize, max: usize, out: &mut Vec<Proposal>) {
        if max == 0 {
            return;
        }
        out.extend(followed(
            &self.sam,
            &self.matcher,
            self.min_match,
            budget,
            Source::History,
        ));
    }

    fn end(&mut self, prompt: &[Token], answer: &[Token]) {
        if self.budget == 0 {
            return;
        }
        let incoming = prompt.len() + answer.len() + 1;
        if self.sam.len() + incoming > self.budget {
            let text = self.sam.text();
            let room = (self.budget / 2).min(self.budget.saturating_sub(incoming));
            let keep = text[text.len().saturating_sub(room)..].to_vec();
            self.sam = SuffixAutomaton::with_capacity(keep.len() + incoming);
            self.sam.extend(&keep);
        }
        self.sam.extend(prompt);
        self.sam.extend(answer);
        self.sam.push(SEPARATOR);
    }
}

/// Draft reuse (000 §3.4). When a draft `x` is rejected at `e` (the target said `y_e != x_e`),
/// the target's predictions after the rejection were made on a wrong prefix, but where they
/// still agree with the draft (`y_i = x_i`) the draft likely carries the right text, only
/// shifted (a synonym or a missing token before it). The longest such run (Eq. 3) is kept
/// and offered as a continuation of the correction `y_e`, for `lifetime` steps or until it is
/// used; segments shorter than `min_len` are not worth a row.
#[derive(Debug)]
pub struct ReuseDrafter {
    lifetime: usize,
    min_len: usize,
    /// The kept segment and the steps it has left.
    kept: Option<(Vec<Token>, usize)>,
}

impl ReuseDrafter {
    /// Keeps a segment for `lifetime` steps.
    pub fn new(lifetime: usize, min_len: usize) -> Self {
        Self {
            lifetime,
            min_len: min_len.max(1),
            kept: None,
        }
    }

    /// The segment of `draft` to reuse after a rejection at `e` (Eq. 3): the longest run of
    /// positions `i > e` with `predicted[i] == draft[i]`, as `draft[start..end]`.
    pub fn segment(draft: &[Token], predicted: &[Token], e: usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        let mut start = None;
        let n = draft.len().min(predicted.len());
        for i in e + 1..=n {
            let agrees = i < n && predicted[i] == draft[i];
            match (agrees, start) {
                (true, None) => start = Some(i),
                (false, Some(s)) => {
                    if best.is_none_or(|(a, b)| i - s > b - a) {
                        best = Some((s, i));
                    }
                    start = None;
                }
                _ => {}
            }
        }
        best
    }
}

impl Drafter for ReuseDrafter {
    fn begin(&mut self, _prompt: &[Token]) {
        self.kept = None;
    }

    fn accepted(&mut self, t: Token) {
        // A kept segment continues the text only from where it was made; once the text has
        // moved on past its first token without taking it, it stays until it expires.
        if let Some((seg, _)) = &mut self.kept {
            if seg.first() == Some(&t) {
                seg.remove(0);
                if seg.is_empty() {
                    self.kept = None;
                }
            }
        }
    }

    fn propose(&mut self, budget: usize, max: usize, out: &mut Vec<Proposal>) {
        if max == 0 {
            return;
        }
        if let Some((seg, left)) = &mut self.kept {
            out.push(Proposal {
                tokens: seg[..seg.len().min(budget)].to_vec(),
                match_len: seg.len().min(budget),
                source: Source::Reuse,
            });
            *left -= 1;
            if *left == 0 {
                self.kept = None;
            }
        }
    }

    fn verified(&mut self, draft: &[Token], predicted: &[Token], accepted: usize) {
        if accepted >= draft.len() {
            return;
        }
        if let Some((a, b)) = Self::segment(draft, predicted, accepted) {
            if b - a >= self.min_len {
                self.kept = Some((draft[a..b].to_vec(), self.lifetime));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_drafter_continues_a_repeat() {
        let mut d = ContextDrafter::new(2);
        d.begin(&[1, 2, 3, 4, 5, 9, 1, 2]);
        let mut out = Vec::new();
        d.propose(3, 2, &mut out);
        assert_eq!(out[0].tokens, [3, 4, 5]);
        assert_eq!(out[0].match_len, 2);
        d.accepted(3);
        out.clear();
        d.propose(8, 1, &mut out);
        assert_eq!(out[0].tokens[..3], [4, 5, 9]);
    }

    #[test]
    fn context_drafter_continues_after_drafts_not_taken_in() {
        // "4 5" then "6 7" follow "3" in the text; the text ends in "2 3", the drafts are "4".
        let mut d = ContextDrafter::new(3);
        d.begin(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3]);
        let mut out = vec![99];
        assert_eq!(d.continue_after(&[4], 3, &mut out), Some(3));
        assert_eq!(out, [5, 6, 7]);
        // The drafts stay out of the text: the same drafts again, the same continuation.
        assert_eq!(d.continue_after(&[4], 2, &mut out), Some(3));
        assert_eq!(out, [5, 6]);
        // A longer draft matches further on; the budget caps the continuation at the text's end.
        assert_eq!(d.continue_after(&[4, 5, 6], 9, &mut out), Some(5));
        assert_eq!(out, [7, 8, 9, 2, 3]);
        // Suffixes shorter than min_match (here "3 9" never occurs: "9" alone, one token).
        assert_eq!(d.continue_after(&[9], 4, &mut out), None);
        assert!(out.is_empty());
        // No drafts (the round's first call drafts with `propose`) or no budget: nothing.
        assert_eq!(d.continue_after(&[], 4, &mut out), None);
        assert_eq!(d.continue_after(&[4], 0, &mut out), None);
        // A match that ends where the text does has nothing after it.
        let mut e = ContextDrafter::new(2);
        e.begin(&[7, 1, 2]);
        assert_eq!(e.continue_after(&[1, 2], 4, &mut out), None);
        assert!(out.is_empty());
    }

    #[test]
    fn context_drafter_offers_the_other_tokens_that_followed_the_match() {
        // "1 2" was followed by 3, then by 7, then by 3 again; now the text ends in "1 2".
        let mut d = ContextDrafter::new(2);
        d.begin(&[1, 2, 3, 4, 1, 2, 7, 8, 1, 2, 3, 5, 1, 2]);
        let mut out = Vec::new();
        d.propose(2, 4, &mut out);
        let firsts: Vec<(Token, Source)> = out.iter().map(|p| (p.tokens[0], p.source)).collect();
        assert_eq!(firsts[0], (3, Source::Request));
        assert!(firsts.contains(&(7, Source::Sibling)), "{firsts:?}");
        let sibling = out.iter().find(|p| p.source == Source::Sibling).unwrap();
        assert_eq!(sibling.tokens, [7, 8]);
        assert_eq!(sibling.match_len, 2);
        // Chains (one branch) get no siblings.
        out.clear();
        d.propose(2, 1, &mut out);
        assert!(out.iter().all(|p| p.source == Source::Request));
    }

    #[test]
    fn history_drafter_remembers_earlier_answers_but_not_across_requests() {
        let mut d = HistoryDrafter::new(2, 1000);
        d.begin(&[7, 8]);
        d.end(&[7, 8], &[10, 11, 12, 13]);
        d.begin(&[5, 10, 11]);
        let mut out = Vec::new();
        d.propose(8, 1, &mut out);
        // The continuation stops at the end of the earlier answer.
        assert_eq!(out[0].tokens, [12, 13]);
        let mut small = HistoryDrafter::new(2, 10);
        for r in 0..5 {
            small.end(&[r, r + 1], &[r + 2, r + 3, r + 4]);
        }
        assert!(small.len() <= 10, "{}", small.len());
    }

    #[test]
    fn reuse_keeps_the_longest_agreeing_run_after_the_rejection() {
        // Draft 1 2 3 4 5 6 7; the target rejected at 1 (said 9 instead of 2), then agreed
        // with 4 5 (a one-token synonym) but not 6, then with 7.
        let draft = [1, 2, 3, 4, 5, 6, 7];
        let predicted = [1, 9, 0, 4, 5, 0, 7];
        assert_eq!(ReuseDrafter::segment(&draft, &predicted, 1), Some((3, 5)));
        assert_eq!(
            ReuseDrafter::segment(&draft, &[1, 9, 0, 0, 0, 0, 0], 1),
            None
        );
        let mut d = ReuseDrafter::new(2, 2);
        d.begin(&[]);
        d.verified(&draft, &predicted, 1);
        let mut out = Vec::new();
        d.propose(8, 1, &mut out);
        assert_eq!(out[0].tokens, [4, 5]);
        // Taken one token at a time as the text uses it; gone when used up or expired.
        d.accepted(4);
        out.clear();
        d.propose(8, 1, &mut out);
        assert_eq!(out[0].tokens, [5]);
        out.clear();
        d.propose(8, 1, &mut out);
        assert!(out.is_empty(), "expired after its lifetime of 2 proposals");
        let mut d = ReuseDrafter::new(5, 2);
        d.verified(&draft, &predicted, 1);
        d.accepted(4);
        d.accepted(5);
        out.clear();
        d.propose(8, 1, &mut out);
        assert!(out.is_empty(), "used up");
    }
}

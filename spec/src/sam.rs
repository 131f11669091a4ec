//! A suffix automaton over token ids: the retrieval index behind SAM drafting (sd.npu §4.1,
//! after Hu et al.'s SAM decoding).
//!
//! [`SuffixAutomaton`] indexes one token stream as it grows (the prompt plus the accepted
//! output, or a history of earlier requests and answers). Appending a token is amortised O(1).
//! Two queries serve drafting:
//!
//! - [`SuffixAutomaton::repeats`]: for the automaton's own text, the longest suffix that also
//!   occurs earlier, and the tokens that followed that earlier occurrence; shorter suffixes give
//!   further, different continuations (the branches of a token tree).
//! - [`Matcher`]: follows *another* stream (the current request) through this automaton (a
//!   history store), keeping the longest suffix of that stream that occurs in this text.
//!
//! Each state records the end of the *first* occurrence of its strings (`first_end`), the
//! classic `firstpos`; clones inherit it. So a continuation always starts right after a real
//! occurrence of the matched tokens.

use rustc_hash::FxHashMap;

/// A token id.
pub type Token = i32;

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct State {
    /// Length of the longest string of this state.
    len: u32,
    /// Suffix link (`NONE` for the root).
    link: u32,
    /// Index in the text of the last token of the first occurrence.
    first_end: u32,
}

/// The suffix automaton of a growing token stream.
#[derive(Debug, Clone)]
pub struct SuffixAutomaton {
    states: Vec<State>,
    /// Transitions, keyed by (state, token): the alphabet is large and sparse.
    next: FxHashMap<(u32, Token), u32>,
    /// The tokens each state has a transition on (needed to copy edges when cloning).
    edges: Vec<Vec<Token>>,
    last: u32,
    text: Vec<Token>,
}

impl Default for SuffixAutomaton {
    fn default() -> Self {
        Self::new()
    }
}

/// A match: `len` tokens of a query end at text index `end` (inclusive), so the continuation
/// starts at `end + 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// Matched length in tokens.
    pub len: usize,
    /// Index of the matched occurrence's last token in the text.
    pub end: usize,
}

impl SuffixAutomaton {
    /// An empty automaton.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty automaton with room for `n` tokens.
    pub fn with_capacity(n: usize) -> Self {
        let mut a = Self {
            states: Vec::with_capacity(2 * n + 1),
            next: FxHashMap::with_capacity_and_hasher(3 * n, Default::default()),
            edges: Vec::with_capacity(2 * n + 1),
            last: 0,
            text: Vec::with_capacity(n),
        };
        a.new_state(0, NONE, 0);
        a
    }

    fn new_state(&mut self, len: u32, link: u32, first_end: u32) -> u32 {
        self.states.push(State {
            len,
            link,
            first_end,
        });
        self.edges.push(Vec::new());
        (self.states.len() - 1) as u32
    }

    /// The indexed tokens.
    pub fn text(&self) -> &[Token] {
        &self.text
    }

    /// Number of tokens indexed.
    pub fn len(&self) -> usize {
        self.text.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    fn go(&self, state: u32, t: Token) -> Option<u32> {
        self.next.get(&(state, t)).copied()
    }

    /// Append one token (amortised O(1)).
    pub fn push(&mut self, t: Token) {
        let pos = self.text.len() as u32;
        self.text.push(t);
        let cur = self.new_state(self.states[self.last as usize].len + 1, 0, pos);
        let mut p = self.last;
        while p != NONE && self.go(p, t).is_none() {
            self.next.insert((p, t), cur);
            self.edges[p as usize].push(t);
            p = self.states[p as usize].link;
        }
        if p != NONE {
            let q = self
                .go(p, t)
                .expect("the loop stopped at an existing transition");
            let (p_len, q_state) = (self.states[p as usize].len, self.states[q as usize]);
            if p_len + 1 == q_state.len {
                self.states[cur as usize].link = q;
            } else {
                let clone = self.new_state(p_len + 1, q_state.link, q_state.first_end);
                let q_edges = self.edges[q as usize].clone();
                for &tok in &q_edges {
                    let to = self.next[&(q, tok)];
                    self.next.insert((clone, tok), to);
                }
                self.edges[clone as usize] = q_edges;
                while p != NONE && self.go(p, t) == Some(q) {
                    self.next.insert((p, t), clone);
                    p = self.states[p as usize].link;
                }
                self.states[q as usize].link = clone;
                self.states[cur as usize].link = clone;
            }
        }
        self.last = cur;
    }

    /// Append tokens.
    pub fn extend(&mut self, tokens: &[Token]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Suffixes of the text that also occur earlier, longest first, each with a different
    /// earlier occurrence: the longest repeated suffix, then shorter ones whose first
    /// occurrence ends elsewhere. At most `max` matches; only matches of at least `min_len`.
    pub fn repeats(&self, min_len: usize, max: usize) -> Vec<Match> {
        let mut out: Vec<Match> = Vec::new();
        let n = self.text.len();
        // The state of the whole text has only the occurrence ending now; its suffix link is
        // the longest suffix occurring at least twice, so its first occurrence is earlier.
        let mut s = self.states[self.last as usize].link;
        while s != NONE && s != 0 && out.len() < max {
            let st = self.states[s as usize];
            if (st.len as usize) < min_len {
                break;
            }
            let end = st.first_end as usize;
            if end + 1 < n && !out.iter().any(|m| m.end == end) {
                out.push(Match {
                    len: st.len as usize,
                    end,
                });
            }
            s = st.link;
        }
        out
    }

    /// Other continuations of the longest repeated suffix (the first of [`repeats`]): one
    /// match per distinct token that followed an earlier occurrence of it, other than
    /// `except` (in the automaton's edge order, roughly the order they first followed
    /// it). Each match ends right before
    /// the first occurrence of the suffix followed by that token, so its continuation starts
    /// with the token. At most `max`; none for a suffix shorter than `min_len`.
    ///
    /// [`repeats`]: SuffixAutomaton::repeats
    pub fn alternatives(&self, min_len: usize, max: usize, except: &[Token]) -> Vec<Match> {
        let s = self.states[self.last as usize].link;
        if s == NONE || s == 0 || max == 0 {
            return Vec::new();
        }
        let st = self.states[s as usize];
        if (st.len as usize) < min_len {
            return Vec::new();
        }
        let mut out = Vec::new();
        for &t in &self.edges[s as usize] {
            if out.len() == max {
                break;
            }
            if except.contains(&t) {
                continue;
            }
            // The suffix followed by `t` lives in the state `s` goes to on `t`; its first
            // occurrence ends at that state's `first_end`, `t` being the last token there.
            let to = self.go(s, t).expect("an edge of s");
            let end = self.states[to as usize].first_end as usize;
            debug_assert_eq!(self.text[end], t);
            out.push(Match {
                len: st.len as usize,
                end: end - 1,
            });
        }
        out
    }

    /// Up to `len` tokens that follow a match.
    pub fn continuation(&self, m: Match, len: usize) -> &[Token] {
        let start = (m.end + 1).min(self.text.len());
        &self.text[start..(start + len).min(self.text.len())]
    }
}

/// Follows a token stream through a [`SuffixAutomaton`] of another text, keeping the longest
/// suffix of the stream that occurs in that text (amortised O(1) per token).
#[derive(Debug, Clone, Copy, Default)]
pub struct Matcher {
    state: u32,
    len: usize,
}

impl Matcher {
    /// A matcher at the start (nothing matched).
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed the next token of the stream.
    pub fn push(&mut self, sam: &SuffixAutomaton, t: Token) {
        loop {
            if let Some(to) = sam.go(self.state, t) {
                self.state = to;
                self.len += 1;
                return;
            }
            if self.state == 0 {
                self.len = 0;
                return;
            }
            self.state = sam.states[self.state as usize].link;
            self.len = sam.states[self.state as usize].len as usize;
        }
    }

    /// A matcher that has been fed `tokens`.
    pub fn after(sam: &SuffixAutomaton, tokens: &[Token]) -> Self {
        let mut m = Self::new();
        for &t in tokens {
            m.push(sam, t);
        }
        m
    }

    /// The current match: the longest suffix of the stream found in the text, if any.
    pub fn current(&self, sam: &SuffixAutomaton) -> Option<Match> {
        (self.len > 0).then(|| Match {
            len: self.len,
            end: sam.states[self.state as usize].first_end as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator, so failures reproduce.
    use leap_kernels::rng::XorShift;
    struct Lcg(XorShift);
    impl Lcg {
        fn next(&mut self, k: u64) -> Token {
            self.0.below(k) as Token
        }
    }

    fn occurs_ending_at(text: &[Token], pat: &[Token], end: usize) -> bool {
        end + 1 >= pat.len() && &text[end + 1 - pat.len()..=end] == pat
    }

    /// Longest suffix of `text` that also occurs ending before the last position.
    fn brute_longest_repeat(text: &[Token]) -> usize {
        let n = text.len();
        (1..n)
            .rev()
            .find(|&l| (l - 1..n - 1).any(|e| occurs_ending_at(text, &text[n - l..], e)))
            .unwrap_or(0)
    }

    #[test]
    fn longest_repeat_matches_brute_force() {
        let mut rng = Lcg(XorShift::new(7));
        for alphabet in [2, 3, 5, 50] {
            let mut sam = SuffixAutomaton::new();
            let mut text = Vec::new();
            for _ in 0..300 {
                let t = rng.next(alphabet);
                sam.push(t);
                text.push(t);
                let want = brute_longest_repeat(&text);
                let got = sam.repeats(1, 8);
                match got.first() {
                    None => assert_eq!(want, 0, "alphabet {alphabet}, text {text:?}"),
                    Some(m) => {
                        assert_eq!(m.len, want, "alphabet {alphabet}, n {}", text.len());
                        let suffix = &text[text.len() - m.len..];
                        assert!(m.end + 1 < text.len() && occurs_ending_at(&text, suffix, m.end));
                    }
                }
                // Every further match is a real, earlier occurrence of a shorter suffix.
                for w in got.windows(2) {
                    assert!(w[1].len < w[0].len);
                }
                for m in &got {
                    assert!(occurs_ending_at(&text, &text[text.len() - m.len..], m.end));
                }
            }
        }
    }

    #[test]
    fn alternatives_are_every_other_token_after_the_longest_repeat() {
        let mut rng = Lcg(XorShift::new(5));
        for alphabet in [2, 3, 6] {
            let mut sam = SuffixAutomaton::new();
            let mut text = Vec::new();
            for _ in 0..200 {
                let t = rng.next(alphabet);
                sam.push(t);
                text.push(t);
                let n = text.len();
                let l = brute_longest_repeat(&text);
                let alts = sam.alternatives(1, usize::MAX, &[]);
                if l == 0 {
                    assert!(alts.is_empty());
                    continue;
                }
                let suffix = &text[n - l..];
                // The distinct tokens that followed an earlier occurrence of the suffix, in
                // the order they first did.
                let mut want: Vec<Token> = Vec::new();
                for e in l - 1..n - 1 {
                    if occurs_ending_at(&text, suffix, e) && !want.contains(&text[e + 1]) {
                        want.push(text[e + 1]);
                    }
                }
                let mut got: Vec<Token> = Vec::new();
                for m in &alts {
                    assert_eq!(m.len, l);
                    assert!(occurs_ending_at(&text, suffix, m.end), "a real occurrence");
                    got.push(sam.continuation(*m, 1)[0]);
                }
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "alphabet {alphabet}, text {text:?}");
                // `except` and `max` leave tokens out.
                let first = want[0];
                let fewer = sam.alternatives(1, usize::MAX, &[first]);
                assert_eq!(fewer.len(), want.len() - 1);
                assert!(fewer.iter().all(|m| sam.continuation(*m, 1)[0] != first));
                assert_eq!(sam.alternatives(1, 1, &[]).len(), 1);
                assert!(sam.alternatives(l + 1, 8, &[]).is_empty());
            }
        }
    }

    #[test]
    fn matcher_finds_the_longest_suffix_in_another_text() {
        let mut rng = Lcg(XorShift::new(11));
        let history: Vec<Token> = (0..400).map(|_| rng.next(4)).collect();
        let mut sam = SuffixAutomaton::new();
        sam.extend(&history);
        let mut m = Matcher::new();
        let mut stream = Vec::new();
        for _ in 0..300 {
            let t = rng.next(4);
            stream.push(t);
            m.push(&sam, t);
            let want = (0..=stream.len())
                .rev()
                .find(|&l| {
                    (0..history.len())
                        .any(|e| occurs_ending_at(&history, &stream[stream.len() - l..], e))
                })
                .unwrap_or(0);
            match m.current(&sam) {
                None => assert_eq!(want, 0),
                Some(mt) => {
                    assert_eq!(mt.len, want);
                    assert!(occurs_ending_at(
                        &history,
                        &stream[stream.len() - mt.len..],
                        mt.end
                    ));
                }
            }
        }
    }

    #[test]
    fn drafts_the_continuation_of_a_repeated_phrase() {
        let mut sam = SuffixAutomaton::new();
        // "a b c d e ... a b c" -> the continuation of the earlier "a b c" is "d e".
        sam.extend(&[1, 2, 3, 4, 5, 9, 9, 1, 2, 3]);
        let m = sam.repeats(2, 4)[0];
        assert_eq!(m.len, 3);
        assert_eq!(sam.continuation(m, 2), &[4, 5]);
        assert_eq!(sam.continuation(m, 100), &[4, 5, 9, 9, 1, 2, 3]);
        assert!(sam.repeats(4, 4).is_empty(), "no repeat of length 4");
    }
}

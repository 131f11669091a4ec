//! Retrieval from the model's own earlier answers, shipped in its sidecar: a datastore in the
//! manner of REST (retrieval-based speculative decoding), made of what this model answered
//! greedily to other prompts (`leap corpus`).
//!
//! The request's own text and the conversation's history ([`crate::draft`]) find what a prompt
//! repeats; they cannot know how the model phrases what is new (`    return `, `for i in
//! range(len(`, `is a module that provides`). A model's answers to other prompts of the kind
//! its users send hold those phrasings in its own words. On the dev workload's held-out
//! requests, a corpus of the model's answers to the 171 tuned-on ones let a longest-match
//! drafter take 8% (SmolLM2) and 14% (Gemma 3) more tokens a call in a replay of the answers,
//! and the engine 3.5-4% more; the time stayed level, its extra rows rarely taken (a corpus of
//! that size; docs/measurements.md, where the replay is said to be a script not in the tree).
//!
//! The corpus is fixed: [`CorpusDrafter`] shares one [`SuffixAutomaton`] between every session
//! of a runtime and keeps only its own [`Matcher`]; its drafts are a [`Source::Corpus`] of
//! their own, so the controller learns how far to trust them apart from the request's. A draft
//! is only a draft: greedy output stays plain decoding's whatever the corpus says.

use std::sync::Arc;

use leap_host::sidecar::{Sidecar, Value};

use crate::draft::{followed, Drafter, Proposal, Source, SEPARATOR};
use crate::sam::{Matcher, SuffixAutomaton, Token};

/// Sidecar keys of the corpus.
pub mod keys {
    /// The answers' tokens, each answer followed by [`super::SEPARATOR`].
    pub const TOKENS: &str = "leap.corpus.tokens";
    /// The fingerprint of the output weights of the model that answered
    /// ([`leap_host::project::fingerprint`]).
    pub const MODEL: &str = "leap.corpus.model";
    /// Where the prompts came from (a file name, for people).
    pub const SOURCE: &str = "leap.corpus.source";
}

/// The model's answers, each followed by a [`SEPARATOR`], as the sidecar holds them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Corpus {
    tokens: Vec<Token>,
}

impl Corpus {
    /// An empty corpus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one answer (an empty one adds nothing).
    pub fn push(&mut self, answer: &[Token]) {
        if answer.is_empty() {
            return;
        }
        self.tokens
            .extend(answer.iter().filter(|&&t| t != SEPARATOR));
        self.tokens.push(SEPARATOR);
    }

    /// Answers held (each closed by its separator).
    pub fn answers(&self) -> usize {
        self.tokens.iter().filter(|&&t| t == SEPARATOR).count()
    }

    /// Tokens held, separators included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no answer.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The automaton drafting reads.
    pub fn automaton(&self) -> Arc<SuffixAutomaton> {
        let mut sam = SuffixAutomaton::with_capacity(self.tokens.len());
        sam.extend(&self.tokens);
        Arc::new(sam)
    }
}

/// Put `corpus` (answers of the model with this [`fingerprint`] to prompts from `source`)
/// into `side`.
///
/// [`fingerprint`]: leap_host::project::fingerprint
pub fn store(side: &mut Sidecar, corpus: &Corpus, fingerprint: &str, source: &str) {
    side.set(keys::TOKENS, Value::I32s(corpus.tokens.clone()));
    side.set(keys::MODEL, Value::Str(fingerprint.to_string()));
    side.set(keys::SOURCE, Value::Str(source.to_string()));
}

/// The corpus in `side`, if it has one, for the model with output weights `fingerprint` and a
/// vocabulary of `n_vocab`. `Err` says why a corpus that is there cannot be used.
pub fn load(side: &Sidecar, fingerprint: &str, n_vocab: usize) -> Result<Option<Corpus>, String> {
    let Some(tokens) = side.i32s(keys::TOKENS) else {
        return Ok(None);
    };
    match side.get(keys::MODEL) {
        Some(Value::Str(s)) if s == fingerprint => {}
        Some(Value::Str(s)) => {
            return Err(format!(
                "its answers are another model's (output weights {s}, this model's {fingerprint})"
            ))
        }
        _ => return Err(format!("it has no {}", keys::MODEL)),
    }
    if let Some(t) = tokens
        .iter()
        .find(|&&t| t != SEPARATOR && !(0..n_vocab as i64).contains(&i64::from(t)))
    {
        return Err(format!(
            "{} holds token {t}, outside this model's {n_vocab}-token vocabulary",
            keys::TOKENS
        ));
    }
    let mut corpus = Corpus::new();
    for answer in tokens.split(|&t| t == SEPARATOR) {
        corpus.push(answer);
    }
    Ok(Some(corpus))
}

/// Retrieval from a fixed corpus: the longest suffix of the request's text (prompt and output
/// so far) found in the corpus, and what followed it there.
#[derive(Debug, Clone)]
pub struct CorpusDrafter {
    sam: Arc<SuffixAutomaton>,
    matcher: Matcher,
    min_match: usize,
}

impl CorpusDrafter {
    /// Drafts from `sam` ([`Corpus::automaton`]) after matches of `min_match` tokens or more.
    pub fn new(sam: Arc<SuffixAutomaton>, min_match: usize) -> Self {
        Self {
            sam,
            matcher: Matcher::new(),
            min_match: min_match.max(1),
        }
    }
}

impl Drafter for CorpusDrafter {
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
            Source::Corpus,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(answers: &[&[Token]]) -> Corpus {
        let mut c = Corpus::new();
        for a in answers {
            c.push(a);
        }
        c
    }

    #[test]
    fn drafts_what_followed_in_an_answer_and_never_past_its_end() {
        let c = corpus(&[&[1, 2, 3, 4, 5], &[7, 8, 9]]);
        let mut d = CorpusDrafter::new(c.automaton(), 2);
        d.begin(&[20, 21, 2]);
        let mut out = Vec::new();
        d.propose(16, 1, &mut out);
        assert!(out.is_empty(), "a one-token match is below min_match");
        d.accepted(3);
        d.propose(16, 1, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].tokens, vec![4, 5], "cut at the answer's end");
        assert_eq!((out[0].match_len, out[0].source), (2, Source::Corpus));
        out.clear();
        d.propose(1, 1, &mut out);
        assert_eq!(out[0].tokens, vec![4], "within the budget");
        // No match spans two answers.
        d.begin(&[4, 5, 7]);
        out.clear();
        d.propose(16, 1, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_new_request_starts_matching_afresh_and_the_corpus_does_not_learn() {
        let c = corpus(&[&[1, 2, 3, 4]]);
        let sam = c.automaton();
        let mut d = CorpusDrafter::new(Arc::clone(&sam), 2);
        d.begin(&[1, 2]);
        let mut out = Vec::new();
        d.propose(16, 1, &mut out);
        assert_eq!(out[0].tokens, vec![3, 4]);
        d.end(&[1, 2], &[9, 9, 9]);
        d.begin(&[9, 9]);
        out.clear();
        d.propose(16, 1, &mut out);
        assert!(out.is_empty(), "answers to requests are not added");
        assert_eq!(sam.len(), 5);
    }

    #[test]
    fn the_sidecar_keeps_the_answers_for_the_model_that_gave_them() {
        let c = corpus(&[&[1, 2, 3], &[], &[4, 5]]);
        assert_eq!((c.answers(), c.len()), (2, 7));
        let mut side = Sidecar::default();
        assert_eq!(load(&side, "m", 10), Ok(None));
        store(&mut side, &c, "m", "prompts.jsonl");
        assert_eq!(load(&side, "m", 10), Ok(Some(c.clone())));
        let other = load(&side, "n", 10).unwrap_err();
        assert!(other.contains("another model's"), "{other}");
        let small = load(&side, "m", 5).unwrap_err();
        assert!(small.contains("token 5"), "{small}");
        side.set(keys::MODEL, Value::U32(1));
        assert!(load(&side, "m", 10).unwrap_err().contains(keys::MODEL));
    }
}

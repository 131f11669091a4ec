//! `leap:oracle`: a drafter that knows the answer. It drafts what plain decoding produced for
//! the same request earlier in the run, so every draft is right as far as it goes; the
//! controller still prices each chain's length by the measured cost of a call. The mode's
//! tok/s is therefore the most any drafter could give with this machine's verification costs:
//! the ceiling that acceptance work (better drafters, learned heads) can approach and not pass.
//! A measurement, not a decoding mode: it needs `plain` earlier in `--modes` and greedy
//! decoding.

use std::sync::{Arc, Mutex};

use leap_spec::draft::{Drafter, Proposal, Source};
use leap_spec::model_draft::MODEL_MATCH;
use leap_spec::sam::Token;

/// Plain decoding's answer to the current request, shared between the bench loop (which
/// sets it after `plain` ran) and the drafter.
#[derive(Clone, Debug, Default)]
pub struct Answer(Arc<Mutex<Vec<Token>>>);

impl Answer {
    /// Set the answer to the next request.
    pub fn set(&self, tokens: &[Token]) {
        let mut a = self.0.lock().unwrap_or_else(|e| e.into_inner());
        a.clear();
        a.extend_from_slice(tokens);
    }
}

/// Drafts the next tokens of [`Answer`] after those emitted so far.
#[derive(Debug)]
pub struct Oracle {
    answer: Answer,
    /// Tokens emitted in this request.
    at: usize,
}

impl Oracle {
    /// A drafter reading `answer`.
    pub fn new(answer: Answer) -> Self {
        Self { answer, at: 0 }
    }
}

impl Drafter for Oracle {
    fn begin(&mut self, _prompt: &[Token]) {
        self.at = 0;
    }

    fn accepted(&mut self, _t: Token) {
        self.at += 1;
    }

    fn propose(&mut self, budget: usize, _max: usize, out: &mut Vec<Proposal>) {
        let a = self.answer.0.lock().unwrap_or_else(|e| e.into_inner());
        let end = (self.at + budget).min(a.len());
        if self.at < end {
            out.push(Proposal {
                tokens: a[self.at..end].to_vec(),
                match_len: MODEL_MATCH,
                source: Source::Model,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_the_answer_after_what_was_emitted() {
        let answer = Answer::default();
        answer.set(&[5, 6, 7, 8]);
        let mut o = Oracle::new(answer.clone());
        o.begin(&[1, 2]);
        let mut out = Vec::new();
        o.propose(3, 1, &mut out);
        assert_eq!(out[0].tokens, [5, 6, 7]);
        o.accepted(5);
        o.accepted(6);
        out.clear();
        o.propose(3, 1, &mut out);
        assert_eq!(out[0].tokens, [7, 8]);
        o.accepted(7);
        o.accepted(8);
        out.clear();
        o.propose(3, 1, &mut out);
        assert!(out.is_empty(), "nothing past the answer");
        // A new request starts from its own answer's first token.
        answer.set(&[9]);
        o.begin(&[1]);
        o.propose(3, 1, &mut out);
        assert_eq!(out[0].tokens, [9]);
    }
}

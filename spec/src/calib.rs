//! In-context distribution calibration (000 §3.3).
//!
//! Prefill computes the model's next-token distribution at every prompt position; sd.npu
//! uses those predictions to build a calibrated token tree by "sample + search" and drafts
//! from it alongside the raw context, so a draft follows the model's wording where it departs
//! from the document's (a lexical gap), not the document's.
//!
//! Leap gets the predictions nearly for free: the prefill batches are cut at the final hidden
//! states (`leap_host::project::OnDemand`), so llama.cpp never runs the output projection
//! for the prompt, and each position's hidden state is scored against the prompt's own
//! distinct tokens only (a few hundred rows of the output matrix, not 262144): drafting can
//! only ever continue with tokens it can find in the context again, so that is where the
//! model's preference matters. The last prompt row is projected in full, bit-identical to
//! llama.cpp's logits, for the first generated token.
//!
//! [`CalibratedDrafter`] drafts by sample + search: after the longest suffix match of the
//! text in the prompt, ending at position `i`, it proposes the model's preferred token
//! `pred[i]` (sample), finds where the text extended by that token occurs in the prompt
//! (search; the suffix automaton follows it in O(1)) and continues from the model's
//! preference there.

use std::time::Instant;

use leap_host::project::OnDemand;
use leap_host::{Batch, Context, Result};

use crate::draft::{Drafter, Proposal};
use crate::sam::{Matcher, SuffixAutomaton, Token};

/// The model's preferred next token at every prompt position, among the prompt's tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    /// `pred[i]`: the preferred token after `prompt[..=i]` (-1 where unknown).
    pub pred: Vec<Token>,
    /// Wall time spent on calibration beyond a plain prefill (scoring), in seconds.
    pub seconds: f64,
}

/// What [`prefill`] returns. The context's logits after the last prompt token are
/// llama.cpp's own (`Context::logits(-1)`), as after a plain prefill.
#[derive(Debug, Clone)]
pub struct Prefilled {
    /// The calibration.
    pub calib: Calibration,
    /// With `check`: whether projecting the last row on demand reproduced llama.cpp's logits
    /// bit for bit.
    pub exact: Option<bool>,
}

/// Rows per calibration chunk. Every row of a chunk is an output row, and llama.cpp sizes (and
/// fills) its logits buffer for the most output rows a batch had: 32 rows of Gemma 3's 262144
/// logits are 32 MB, 512 would be 512 MB. With Leap's one-row kernels a bigger chunk would not
/// be faster.
pub const CHUNK: usize = 32;

/// Prefill `prompt` (sequence 0 of an empty context) and calibrate on it. All but the last
/// token go through in chunks of at most `n_batch` and [`CHUNK`] tokens, cut at the hidden
/// states; the last one alone, run to
/// the end so its logits are llama.cpp's (the KV cache and those logits are what a plain
/// prefill leaves: a row's results do not depend on its batch here); with `check` the
/// on-demand projection of that row is compared with them (one full projection).
///
/// # Errors
/// Decode failures; hidden states missing (an `od` that does not belong to `ctx`).
pub fn prefill(
    ctx: &mut Context,
    od: &OnDemand,
    prompt: &[Token],
    n_batch: usize,
    check: bool,
) -> Result<Prefilled> {
    prefill_from(ctx, od, prompt, 0, n_batch, check)
}

/// [`prefill`] when sequence 0 already holds `prompt[..start]` at positions `0..start` (a
/// prefix kept from an earlier request; `start < prompt.len()`) and nothing after: only the
/// rest goes through the target, and the kept positions have no calibrated prediction (-1).
///
/// # Errors
/// As [`prefill`].
pub fn prefill_from(
    ctx: &mut Context,
    od: &OnDemand,
    prompt: &[Token],
    start: usize,
    n_batch: usize,
    check: bool,
) -> Result<Prefilled> {
    let start = start.min(prompt.len().saturating_sub(1));
    let mut vocab: Vec<Token> = prompt.to_vec();
    vocab.sort_unstable();
    vocab.dedup();
    let n = od.n_embd();
    let mut pred = Vec::with_capacity(prompt.len());
    let mut scores = Vec::new();
    let n_batch = n_batch.clamp(1, CHUNK);
    let mut batch = Batch::new(n_batch, 1);
    let mut seconds = 0.0;
    let mut score = |hidden: &[f32], pred: &mut Vec<Token>| {
        let t0 = Instant::now();
        for h in hidden.chunks(n) {
            od.logits_of(h, &vocab, &mut scores);
            let best = scores
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &s)| if s > b.1 { (i, s) } else { b },
                );
            pred.push(if best.1.is_finite() {
                vocab[best.0]
            } else {
                -1
            });
        }
        seconds += t0.elapsed().as_secs_f64();
    };
    pred.resize(start, -1);
    let (body, last) = prompt.split_at(prompt.len().saturating_sub(1));
    for (c, chunk) in body[start.min(body.len())..].chunks(n_batch).enumerate() {
        batch.clear();
        for (k, &t) in chunk.iter().enumerate() {
            batch.add(t, (start + c * n_batch + k) as i32, &[0], true)?;
        }
        od.arm(true);
        let r = ctx.decode(&batch);
        od.disarm();
        r?;
        score(&od.take_hidden()?, &mut pred);
    }
    batch.clear();
    for &t in last {
        batch.add(t, body.len() as i32, &[0], true)?;
    }
    od.arm(false);
    let r = ctx.decode(&batch);
    od.disarm();
    r?;
    let hidden = od.take_hidden()?;
    score(&hidden, &mut pred);
    let exact = if check {
        Some(od.reproduces(&hidden, ctx.logits(-1)?))
    } else {
        None
    };
    Ok(Prefilled {
        calib: Calibration { pred, seconds },
        exact,
    })
}

/// Drafts from a [`Calibration`] of the current request's prompt (see the module docs).
#[derive(Debug, Default)]
pub struct CalibratedDrafter {
    sam: SuffixAutomaton,
    pred: Vec<Token>,
    matcher: Matcher,
    min_match: usize,
}

impl CalibratedDrafter {
    /// Drafts after suffix matches of at least `min_match` tokens.
    pub fn new(min_match: usize) -> Self {
        Self {
            min_match: min_match.max(1),
            ..Default::default()
        }
    }

    /// Use `calib` (made on the prompt that [`Drafter::begin`] receives next).
    pub fn set(&mut self, calib: &Calibration) {
        self.pred = calib.pred.clone();
    }
}

impl Drafter for CalibratedDrafter {
    fn begin(&mut self, prompt: &[Token]) {
        self.sam = SuffixAutomaton::with_capacity(prompt.len());
        self.sam.extend(prompt);
        self.matcher = Matcher::new();
        for &t in prompt {
            self.matcher.push(&self.sam, t);
        }
        if self.pred.len() != prompt.len() {
            self.pred.clear();
        }
    }

    fn accepted(&mut self, t: Token) {
        self.matcher.push(&self.sam, t);
    }

    fn propose(&mut self, budget: usize, max: usize, out: &mut Vec<Proposal>) {
        if max == 0 || self.pred.is_empty() {
            return;
        }
        let Some(m) = self.matcher.current(&self.sam) else {
            return;
        };
        if m.len < self.min_match {
            return;
        }
        let mut tokens = Vec::new();
        let (mut at, mut walk) = (m.end, self.matcher);
        while tokens.len() < budget {
            let t = self.pred[at];
            if t < 0 {
                break;
            }
            tokens.push(t);
            walk.push(&self.sam, t);
            // Search: where the text so far, or at least the token just drafted, occurs.
            match walk.current(&self.sam) {
                Some(w) => at = w.end,
                None => break,
            }
        }
        if !tokens.is_empty() {
            out.push(Proposal {
                tokens,
                match_len: m.len,
                source: crate::draft::Source::Calibrated,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_the_models_wording_and_searches_the_context_for_it() {
        // Prompt: "a b c X d e"; the model would rather say "a b c d e" (it skips X).
        let (a, b, c, x, d, e) = (1, 2, 3, 9, 4, 5);
        let prompt = [a, b, c, x, d, e];
        let mut pred = vec![-1; 6];
        pred[2] = d; // after "a b c" the model says d, not X
        pred[4] = e; // after "... X d" it says e
        let mut dr = CalibratedDrafter::new(2);
        dr.set(&Calibration { pred, seconds: 0.0 });
        dr.begin(&prompt);
        for t in [7, a, b, c] {
            dr.accepted(t);
        }
        let mut out = Vec::new();
        dr.propose(8, 1, &mut out);
        // Sample d after "a b c"; search finds d (after X) and continues with the model's
        // preference there.
        assert_eq!(out[0].tokens, [d, e]);
        assert_eq!(out[0].match_len, 3);
    }

    #[test]
    fn follows_the_context_where_the_model_agrees() {
        let prompt = [1, 2, 3, 4, 5, 6];
        let pred = vec![2, 3, 4, 5, 6, -1];
        // (Position 5 has no prediction: the walk ends there.)
        let mut dr = CalibratedDrafter::new(2);
        dr.set(&Calibration { pred, seconds: 0.0 });
        dr.begin(&prompt);
        for t in [1, 2] {
            dr.accepted(t);
        }
        let mut out = Vec::new();
        dr.propose(8, 1, &mut out);
        assert_eq!(out[0].tokens, [3, 4, 5, 6]);
    }

    #[test]
    fn without_a_calibration_for_this_prompt_it_is_silent() {
        let mut dr = CalibratedDrafter::new(2);
        dr.set(&Calibration {
            pred: vec![1, 2],
            seconds: 0.0,
        });
        dr.begin(&[1, 2, 3]);
        dr.accepted(1);
        dr.accepted(2);
        let mut out = Vec::new();
        dr.propose(8, 1, &mut out);
        assert!(out.is_empty());
    }
}

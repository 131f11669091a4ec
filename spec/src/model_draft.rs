//! Drafting with a small language model, also one whose vocabulary differs from the target's
//! (SmolLM2 for Gemma 3 here; llama.cpp refuses: "draft model vocab type must match target
//! model"). The bridge is text: the target's accepted tokens are detokenized, the draft model
//! is kept in sync with that text in its own vocabulary, its greedy continuation is
//! detokenized and tokenized again in the target's vocabulary after the same text. Drafts only
//! have to be likely; verification keeps the output exact whatever they are.
//!
//! The model sits behind [`DraftLm`] and the target's vocabulary behind [`Vocab`], so the
//! translation is tested without a model; [`LlamaDraft`] is the real one.

use std::sync::Arc;

use leap_host::{Batch, Context, Model};

use crate::draft::{Drafter, Proposal};
use crate::sam::Token;

/// The match length drafts of a model are filed under in the controller's acceptance
/// estimates (their own bucket: longer than any retrieval match is evidence of).
pub const MODEL_MATCH: usize = 64;

/// Text of the target's tail used to anchor the translation (the draft's first tokens merge
/// with the end of the text in the target's tokenization).
const ANCHOR_TOKENS: usize = 8;

/// A vocabulary: text to tokens and back.
pub trait Vocab {
    /// Tokens of `text` (no BOS).
    fn tokenize(&self, text: &str) -> Vec<Token>;
    /// Text of `tokens` (special tokens dropped).
    fn detokenize(&self, tokens: &[Token]) -> String;
}

impl Vocab for Model {
    fn tokenize(&self, text: &str) -> Vec<Token> {
        Model::tokenize(self, text, false, false).unwrap_or_default()
    }

    fn detokenize(&self, tokens: &[Token]) -> String {
        Model::detokenize(self, tokens, true, false).unwrap_or_default()
    }
}

/// A draft language model, continuing a token sequence in its own vocabulary.
pub trait DraftLm: Vocab {
    /// Make the model's state hold exactly `tokens` (the text so far, its own vocabulary),
    /// reusing what it already holds.
    fn sync(&mut self, tokens: &[Token]) -> leap_host::Result<()>;
    /// Its greedy continuation of what [`DraftLm::sync`] set, up to `n` tokens.
    fn greedy(&mut self, n: usize) -> leap_host::Result<Vec<Token>>;
}

/// The [`Drafter`] over a draft model.
pub struct ModelDrafter<L: DraftLm> {
    lm: L,
    target: Arc<dyn Vocab + Send + Sync>,
    /// The target's tokens so far (prompt and accepted).
    tokens: Vec<Token>,
    /// The draft model failed in this request (its context full, say): draft without it.
    failed: bool,
    /// Most tokens the model drafts a step (each costs one of its decodes).
    max: usize,
}

impl<L: DraftLm> ModelDrafter<L> {
    /// A drafter drafting with `lm` for a target whose vocabulary is `target`.
    pub fn new(lm: L, target: Arc<dyn Vocab + Send + Sync>) -> Self {
        Self {
            lm,
            target,
            tokens: Vec::new(),
            failed: false,
            max: 4,
        }
    }

    /// Draft at most `n` tokens a step (default 4): on a CPU a small model's decode costs a
    /// good part of the target's, so long drafts rarely pay.
    pub fn with_max(mut self, n: usize) -> Self {
        self.max = n.max(1);
        self
    }

    /// The draft, in the target's tokens, of at most `budget` tokens.
    fn draft(&mut self, budget: usize) -> leap_host::Result<Vec<Token>> {
        let text = self.target.detokenize(&self.tokens);
        let own = self.lm.tokenize(&text);
        self.lm.sync(&own)?;
        let cont = self.lm.greedy(budget)?;
        let cont_text = self.lm.detokenize(&cont);
        Ok(translate(
            &*self.target,
            &self.tokens[self.tokens.len().saturating_sub(ANCHOR_TOKENS)..],
            &cont_text,
            budget,
        ))
    }
}

/// `cont` (text following the target tokens `tail`) in the target's tokens: the tokens of
/// `text(tail) + cont` after those of `text(tail)`, when the first are an extension of the
/// second (else the boundary merged differently: nothing). At most `budget`.
pub fn translate(target: &dyn Vocab, tail: &[Token], cont: &str, budget: usize) -> Vec<Token> {
    if cont.is_empty() {
        return Vec::new();
    }
    let anchor = target.detokenize(tail);
    let base = target.tokenize(&anchor);
    let full = target.tokenize(&(anchor + cont));
    if full.len() <= base.len() || full[..base.len()] != base[..] {
        return Vec::new();
    }
    let mut out = full[base.len()..].to_vec();
    // The last token may be a fragment of a longer one (the text was cut): drop it.
    out.pop();
    out.truncate(budget);
    out
}

impl<L: DraftLm> Drafter for ModelDrafter<L> {
    fn begin(&mut self, prompt: &[Token]) {
        self.tokens = prompt.to_vec();
        // Prefill the draft model with the prompt now, as part of prompt processing.
        let own = self.lm.tokenize(&self.target.detokenize(prompt));
        self.failed = match self.lm.sync(&own) {
            Ok(()) => false,
            Err(e) => {
                log::warn!("the draft model failed ({e}); drafting without it for this request");
                true
            }
        };
    }

    fn accepted(&mut self, t: Token) {
        self.tokens.push(t);
    }

    fn propose(&mut self, budget: usize, _max: usize, out: &mut Vec<Proposal>) {
        if self.failed || budget == 0 {
            return;
        }
        match self.draft(budget.min(self.max)) {
            Ok(tokens) if !tokens.is_empty() => out.push(Proposal {
                tokens,
                match_len: MODEL_MATCH,
                source: crate::draft::Source::Model,
            }),
            Ok(_) => {}
            Err(e) => {
                log::warn!("the draft model failed ({e}); drafting without it for this request");
                self.failed = true;
            }
        }
    }
}

/// A GGUF draft model in a llama.cpp context of its own (sequence 0).
pub struct LlamaDraft {
    model: Arc<Model>,
    ctx: Context,
    /// Tokens in the context's cache, in order.
    cached: Vec<Token>,
    /// Logits after the last cached token are current.
    fresh: bool,
    batch: Batch,
    /// The model's BOS token, when its tokenizer adds one.
    bos: Option<Token>,
}

impl LlamaDraft {
    /// A draft model decoding in `ctx` (made from `model`).
    pub fn new(model: Arc<Model>, ctx: Context) -> Self {
        let bos = model
            .tokenize("", true, false)
            .ok()
            .and_then(|t| t.first().copied());
        Self {
            model,
            ctx,
            cached: Vec::new(),
            fresh: false,
            batch: Batch::new(256, 1),
            bos,
        }
    }
}

impl Vocab for LlamaDraft {
    fn tokenize(&self, text: &str) -> Vec<Token> {
        let mut t: Vec<Token> = self.bos.into_iter().collect();
        t.extend(Vocab::tokenize(&*self.model, text));
        t
    }

    fn detokenize(&self, tokens: &[Token]) -> String {
        Vocab::detokenize(&*self.model, tokens)
    }
}

impl DraftLm for LlamaDraft {
    fn sync(&mut self, tokens: &[Token]) -> leap_host::Result<()> {
        let common = self
            .cached
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if common == tokens.len() && common == self.cached.len() && self.fresh {
            return Ok(());
        }
        // Keep at most all but the last token: it is decoded again, for its logits.
        let keep = common.min(tokens.len().saturating_sub(1));
        self.ctx.seq_rm(0, keep as i32, -1);
        self.cached.truncate(keep);
        for chunk in tokens[keep..].chunks(256) {
            self.batch.clear();
            let p0 = self.cached.len() as i32;
            let last = self.cached.len() + chunk.len() == tokens.len();
            self.batch.add_sequence(chunk, p0, 0, last)?;
            self.ctx.decode(&self.batch)?;
            self.cached.extend_from_slice(chunk);
        }
        self.fresh = true;
        Ok(())
    }

    fn greedy(&mut self, n: usize) -> leap_host::Result<Vec<Token>> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n && self.fresh {
            let t = crate::plain::argmax(self.ctx.logits(-1)?);
            if self.model.is_eog(t) {
                break;
            }
            out.push(t);
            if out.len() == n {
                break;
            }
            self.batch.clear();
            self.batch.add(t, self.cached.len() as i32, &[0], true)?;
            self.ctx.decode(&self.batch)?;
            self.cached.push(t);
        }
        // The logits now follow the draft, not the synced text.
        self.fresh = out.is_empty();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level vocabulary: each distinct space-separated word (with its leading space)
    /// is a token; ids by first appearance in a fixed list.
    struct Words(Vec<&'static str>);

    impl Vocab for Words {
        fn tokenize(&self, text: &str) -> Vec<Token> {
            let mut out = Vec::new();
            let mut rest = text;
            while !rest.is_empty() {
                let start = rest.starts_with(' ') as usize;
                let end = rest[start..].find(' ').map_or(rest.len(), |i| i + start);
                let w = &rest[..end];
                out.push(
                    self.0
                        .iter()
                        .position(|x| *x == w)
                        .map_or(-2, |i| i as Token),
                );
                rest = &rest[end..];
            }
            out
        }

        fn detokenize(&self, tokens: &[Token]) -> String {
            tokens.iter().map(|&t| self.0[t as usize]).collect()
        }
    }

    /// A character-level "model" that continues a fixed text.
    struct Chars {
        text: &'static str,
        at: usize,
    }

    impl Vocab for Chars {
        fn tokenize(&self, text: &str) -> Vec<Token> {
            text.chars().map(|c| c as Token).collect()
        }

        fn detokenize(&self, tokens: &[Token]) -> String {
            tokens
                .iter()
                .filter_map(|&t| char::from_u32(t as u32))
                .collect()
        }
    }

    impl DraftLm for Chars {
        fn sync(&mut self, tokens: &[Token]) -> leap_host::Result<()> {
            self.at = tokens.len();
            Ok(())
        }

        fn greedy(&mut self, n: usize) -> leap_host::Result<Vec<Token>> {
            Ok(self.text[self.at.min(self.text.len())..]
                .chars()
                .take(n)
                .map(|c| c as Token)
                .collect())
        }
    }

    fn words() -> Arc<Words> {
        Arc::new(Words(vec![
            "the", " cat", " sat", " on", " mat", " a", " dog", "The", " the",
        ]))
    }

    /// A character-level draft model's continuation arrives in the target's word tokens,
    /// without the word cut at the end of the draft.
    #[test]
    fn drafts_cross_vocabularies_through_text() {
        let target = words();
        let lm = Chars {
            text: "the cat sat on the mat",
            at: 0,
        };
        let mut d = ModelDrafter::new(lm, target.clone()).with_max(16);
        d.begin(&target.tokenize("the cat"));
        let mut out = Vec::new();
        // 10 characters: " sat on th" -> " sat", " on" (" th" is a cut word).
        d.propose(10, 1, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(target.detokenize(&out[0].tokens), " sat on");
        assert_eq!(out[0].match_len, MODEL_MATCH);
        // After the target accepts " sat", the draft follows the new text (8 characters:
        // " on the " -> " on", " the").
        d.accepted(target.tokenize(" sat")[0]);
        out.clear();
        d.propose(8, 1, &mut out);
        assert_eq!(target.detokenize(&out[0].tokens), " on the");
    }

    /// A budget caps the draft; text the target's vocabulary cannot continue cleanly gives
    /// nothing rather than a wrong boundary.
    #[test]
    fn translation_respects_budget_and_boundaries() {
        let target = words();
        let tail = target.tokenize("the cat");
        assert_eq!(
            translate(&*target, &tail, " sat on the mat now", 2).len(),
            2
        );
        assert!(translate(&*target, &tail, "", 4).is_empty());
        // "the cat" + "s sat" re-tokenizes " cats" as an unknown word: the boundary moved.
        assert!(translate(&*target, &tail, "s sat on", 4).is_empty());
    }
}

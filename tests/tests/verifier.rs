//! The verifier under adversarial drafts, on a real model: whatever a drafter proposes (all
//! wrong, all right, duplicates, shared prefixes, end-of-generation tokens, the longest and the
//! most proposals allowed, in chains and in trees, chosen by a seeded generator), greedy output
//! is plain decoding's token for token, and the KV cache the engine leaves behind is the one a
//! fresh prefill of the same tokens makes: sequence 0 holds exactly the text so far, every tree
//! sequence is gone, and the next token's logits are the fresh context's.

use leap_host::sampler::SamplingParams;
use leap_host::{Batch, Context, Token};
use leap_spec::accept::{SplitMix64, Uniform};
use leap_spec::draft::{Drafter, Proposal, Source};
use leap_spec::engine::{Engine, EngineConfig};
use leap_tests::{context, leap_context, model, plain_greedy, PROMPTS, SMOLLM};

const N_CTX: u32 = 1024;
const TOKENS: usize = 32;

/// What the adversary proposes, relative to what the target will choose (`oracle`: plain
/// greedy decoding's answer).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Every token wrong.
    AllWrong,
    /// The target's own continuation, as long as allowed.
    AllRight,
    /// A right prefix of random length, then wrong tokens.
    Mixed,
    /// The same proposal many times, and prefixes of it.
    Duplicates,
    /// As many proposals as allowed, each as long as allowed, random mixes of the above.
    Longest,
}

struct Adversary {
    kind: Kind,
    oracle: Vec<Token>,
    emitted: usize,
    rng: SplitMix64,
    n_vocab: i32,
    eog: Token,
}

impl Adversary {
    /// A token the target will not choose at `at`: among them (in every kind) end-of-generation
    /// tokens and the extreme token ids.
    fn wrong(&mut self, at: usize) -> Token {
        let right = self.right(at);
        loop {
            let r = self.rng.uniform();
            let t = if r < 0.1 {
                self.eog
            } else if r < 0.15 {
                0
            } else if r < 0.2 {
                self.n_vocab - 1
            } else {
                (self.rng.uniform() * f64::from(self.n_vocab)) as Token
            };
            if Some(t) != right && t >= 0 && t < self.n_vocab {
                return t;
            }
        }
    }

    fn right(&self, at: usize) -> Option<Token> {
        self.oracle.get(at).copied()
    }

    /// A draft of `len` tokens: the target's next `right` tokens, then wrong ones.
    fn draft(&mut self, right: usize, len: usize) -> Vec<Token> {
        let at = self.emitted;
        let mut v = Vec::with_capacity(len);
        for i in 0..len {
            match self.right(at + i).filter(|_| i < right) {
                Some(t) => v.push(t),
                None => v.push(self.wrong(at + i)),
            }
        }
        v
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.rng.uniform() * n as f64) as usize).min(n.saturating_sub(1))
    }
}

impl Drafter for Adversary {
    fn begin(&mut self, _prompt: &[Token]) {
        self.emitted = 0;
    }

    fn accepted(&mut self, _t: Token) {
        self.emitted += 1;
    }

    fn propose(&mut self, budget: usize, max: usize, out: &mut Vec<Proposal>) {
        if budget == 0 || max == 0 {
            return;
        }
        let drafts = match self.kind {
            Kind::AllWrong => vec![self.draft(0, budget)],
            Kind::AllRight => vec![self.draft(budget, budget)],
            Kind::Mixed => {
                let k = self.below(budget + 1);
                vec![self.draft(k, budget)]
            }
            Kind::Duplicates => {
                let k = self.below(budget + 1);
                let d = self.draft(k, budget);
                let mut v = vec![d.clone(); max.min(4)];
                for cut in 1..d.len() {
                    v.push(d[..cut].to_vec());
                }
                v
            }
            Kind::Longest => (0..max)
                .map(|_| {
                    let k = self.below(budget + 1);
                    self.draft(k, budget)
                })
                .collect(),
        };
        // None is empty (every draft is `budget` long, or a prefix of one of 1 token or more).
        out.extend(drafts.into_iter().map(|tokens| Proposal {
            tokens,
            // Trusted beyond any retrieval match: it goes first, whole.
            match_len: 1000,
            source: Source::Request,
        }));
    }
}

/// Chains (non-adaptive: every proposal verified as long as it comes) and trees (the gain/cost
/// builder), at the longest drafts the engine allows.
fn configs() -> Vec<(&'static str, EngineConfig)> {
    let chain = EngineConfig {
        adaptive: false,
        max_draft: 16,
        max_branches: 1,
        vocab: None,
        ..Default::default()
    };
    let tree = EngineConfig {
        adaptive: true,
        max_draft: 12,
        max_branches: 8,
        max_rows: 16,
        ..chain.clone()
    };
    let flat_tree = EngineConfig {
        max_draft: 8,
        max_branches: 4,
        ..chain.clone()
    };
    vec![("chain", chain), ("tree", tree), ("flat tree", flat_tree)]
}

/// The logits after `text` and `probe` in `ctx`, whose sequence 0 holds a prefix of `text`:
/// the rest of `text`, then `probe`, decoded a row at a time.
fn logits_after(ctx: &mut Context, text: &[Token], probe: Token) -> Vec<f32> {
    let from = (ctx.seq_pos_max(0) + 1) as usize;
    let mut b = Batch::new(1, 1);
    for (pos, &t) in text
        .iter()
        .enumerate()
        .skip(from)
        .chain([(text.len(), &probe)])
    {
        b.clear();
        b.add(t, pos as i32, &[0], true).expect("batch");
        ctx.decode(&b).expect("decode");
    }
    ctx.logits(0).expect("logits").to_vec()
}

#[test]
fn any_draft_gives_plain_greedy_output_and_a_fresh_prefills_cache() {
    let m = model(SMOLLM);
    let eog = (0..m.n_vocab())
        .find(|&t| m.is_eog(t))
        .expect("an end token");
    let mut plain_ctx = context(SMOLLM, N_CTX, 1);
    let mut cases = 0;
    let mut right_proposed = 0;
    for (ci, (cname, cfg)) in configs().into_iter().enumerate() {
        for (ki, kind) in [
            Kind::AllWrong,
            Kind::AllRight,
            Kind::Mixed,
            Kind::Duplicates,
            Kind::Longest,
        ]
        .into_iter()
        .enumerate()
        {
            // Per case a prompt chosen by the case's seed, then a follow-up request that
            // continues the whole exchange and reuses the cache the first one left behind
            // (as a server's slot does): both are plain's tokens.
            let seed = 0x5EED_0000 + (ci * 16 + ki) as u64;
            let mut pick = SplitMix64(seed);
            let p = PROMPTS[(pick.uniform() * PROMPTS.len() as f64) as usize % PROMPTS.len()];
            let (mut ctx, _) = leap_context(SMOLLM, N_CTX, cfg.max_branches as u32);
            let n_seq = ctx.n_seq_max() as i32;
            let mut engine = Engine::new(cfg.clone());
            let mut drafted = 0;
            let mut prompt = m.tokenize(p, true, false).unwrap();
            let mut cached = 0;
            for round in 0..2 {
                let want = plain_greedy(&mut plain_ctx, &prompt, TOKENS);
                let adversary = Adversary {
                    kind,
                    oracle: want.tokens.clone(),
                    emitted: 0,
                    rng: SplitMix64(seed ^ round),
                    n_vocab: m.n_vocab(),
                    eog,
                };
                engine = engine.with_drafter(Box::new(adversary));
                let got = engine
                    .generate_from(
                        &mut ctx,
                        &prompt,
                        cached,
                        TOKENS,
                        512,
                        &SamplingParams::default(),
                        None,
                        &mut |_| true,
                    )
                    .expect("engine generation");
                let what = format!("{cname}, {kind:?}, round {round}, {p:?}");
                eprintln!(
                    "{what}: {} tokens, {} calls, {} drafted, {:.1} s",
                    got.tokens.len(),
                    got.target_calls,
                    got.drafted_tokens,
                    got.decode_seconds
                );
                assert_eq!(got.tokens, want.tokens, "{what}: not plain's tokens");
                drafted += got.drafted_tokens;
                if !cfg.adaptive {
                    assert!(got.drafted_tokens > 0, "{what}: nothing was verified");
                }
                // (The gain/cost builder drafts what the measured costs say pays: on a busy
                // machine that may be little; only the fixed policies must take every draft.)
                if kind == Kind::AllRight && !cfg.adaptive {
                    right_proposed += 1;
                    assert!(
                        got.target_calls * 2 < got.tokens.len() as u64,
                        "{what}: right drafts were not accepted: {} calls for {} tokens",
                        got.target_calls,
                        got.tokens.len()
                    );
                }

                // The cache: sequence 0 is the prompt and the answer, all of it or all but
                // the last token (which no call needed unless it was a verified draft), at
                // positions from 0; nothing beyond; no tree sequence survives.
                let text: Vec<Token> = prompt.iter().chain(&got.tokens).copied().collect();
                let end = ctx.seq_pos_max(0);
                assert_eq!(ctx.seq_pos_min(0), 0, "{what}");
                assert!(
                    end == text.len() as i32 - 2 || end == text.len() as i32 - 1,
                    "{what}: sequence 0 ends at {end}, the text at {}",
                    text.len() - 1
                );
                for s in 1..n_seq {
                    assert_eq!(
                        ctx.seq_pos_max(s),
                        -1,
                        "{what}: sequence {s} was left behind"
                    );
                }
                // ... and what it holds is what a fresh prefill of the same text holds: the
                // next token's logits agree bit for bit.
                let follow = m
                    .tokenize(" Then, in two sentences:", false, false)
                    .unwrap();
                let after = logits_after(&mut ctx, &text, follow[0]);
                let mut fresh = context(SMOLLM, N_CTX, 1);
                leap_spec::plain::prefill(&mut fresh, &text, 512).expect("prefill");
                let fresh_logits = logits_after(&mut fresh, &text, follow[0]);
                assert!(
                    after == fresh_logits,
                    "{what}: the next logits differ from a fresh prefill's by up to {}",
                    leap_tests::max_abs_diff(&after, &fresh_logits)
                );
                // The cache now holds the text and the probe: the follow-up reuses the text.
                cached = text.len();
                prompt = text;
                prompt.extend(follow);
                cases += 1;
            }
            assert!(drafted > 0, "{cname}, {kind:?}: nothing was verified");
        }
    }
    assert_eq!(cases, 30);
    assert_eq!(right_proposed, 4);
}

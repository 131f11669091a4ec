//! Leap's speculative engine on a real model: greedy output is plain decoding's, token for
//! token, while drafts really are accepted.
//!
//! On short contexts SmolLM2 is computed bit-for-bit alike by llama.cpp whatever the batch
//! shape, so identity is exact there. On long contexts (both models) and for Gemma 3 at any
//! length, a k-row verification rounds differently from a 1-row call, and greedy output can
//! part ways at a near-tie; the tests check that it does so only there (see the README).

use leap_host::Context;
use leap_spec::engine::{Engine, EngineConfig};
use leap_spec::plain;
use leap_tests::{context, leap_greedy, model, plain_greedy, GEMMA, SMOLLM};

const PROMPTS: &[&str] = &[
    "The apt-get command installs packages. The apt-get command removes packages. The apt-get \
     command upgrades packages. The dpkg command installs a .deb file. Summary: the apt-get command",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Question: What is the capital of France?\nAnswer: Paris.\nQuestion: What is the capital of Italy?\nAnswer:",
];

fn ctx(name: &str, n_seq: u32) -> Context {
    context(name, 2048, n_seq)
}

/// Runs every prompt in plain and in the engine; returns (differing requests, accepted drafts).
fn compare(name: &str, cfg: EngineConfig) -> (usize, u64, u64) {
    let m = model(name);
    let mut pc = ctx(name, 1);
    let mut ec = ctx(name, cfg.max_branches as u32);
    let mut engine = Engine::new(cfg);
    let (mut differ, mut drafted, mut saved) = (0, 0, 0);
    for p in PROMPTS {
        let toks = m.tokenize(p, true, false).unwrap();
        let want = plain_greedy(&mut pc, &toks, 48);
        let got = leap_greedy(&mut engine, &mut ec, &toks, 48);
        if got.tokens != want.tokens {
            differ += 1;
        }
        assert!(
            got.tokens.len() == want.tokens.len()
                || got.tokens.last().is_some_and(|&t| m.is_eog(t))
        );
        drafted += got.drafted_tokens;
        saved += (got.tokens.len() as u64).saturating_sub(got.target_calls + 1);
    }
    (differ, drafted, saved)
}

#[test]
fn chain_output_is_plain_greedy_on_smollm() {
    let (differ, drafted, saved) = compare(SMOLLM, EngineConfig::default());
    assert_eq!(differ, 0);
    let m = model(SMOLLM);
    let toks = m.tokenize(PROMPTS[0], true, false).unwrap();
    let g = leap_greedy(
        &mut Engine::new(EngineConfig::default()),
        &mut ctx(SMOLLM, 1),
        &toks,
        32,
    );
    assert!(
        g.draft_seconds > 0.0 && g.draft_seconds < g.decode_seconds,
        "{} of {}",
        g.draft_seconds,
        g.decode_seconds
    );
    assert!(
        drafted > 0 && saved > 0,
        "drafted {drafted}, target calls saved {saved}"
    );
}

#[test]
fn tree_output_is_plain_greedy_on_smollm() {
    let cfg = EngineConfig {
        max_branches: 4,
        adaptive: false,
        max_draft: 6,
        ..Default::default()
    };
    let (differ, drafted, saved) = compare(SMOLLM, cfg);
    assert_eq!(differ, 0);
    assert!(
        drafted > 0 && saved > 0,
        "drafted {drafted}, target calls saved {saved}"
    );
}

#[test]
fn gemma_differences_are_reported() {
    let (differ, drafted, _) = compare(GEMMA, EngineConfig::default());
    eprintln!("gemma: {differ} of {} requests differ from plain (batch-shape numerics), {drafted} drafted", PROMPTS.len());
    assert!(drafted > 0);
}

/// A long, document-like prompt (~900 tokens) with the repetition retrieval drafting feeds on.
fn long_prompt() -> String {
    let para = "The apt-get command is the command-line tool for handling packages. It installs \
                new packages, upgrades existing ones, and removes those that are no longer \
                needed. Every operation resolves dependencies first, then downloads the archives \
                it needs, and finally unpacks and configures them with dpkg.";
    let mut s = String::new();
    for i in 0..12 {
        s.push_str(&format!("Section {i}. {para}\n"));
    }
    s.push_str("\nSummary of the sections above:");
    s
}

/// Where the engine's output leaves plain decoding's on a long context, plain's own logits
/// must show a near-tie between the two tokens: llama.cpp's kernels round a k-row batch
/// differently from a 1-row call at long contexts, while a real engine bug (a wrong KV cell, a
/// wrong position) would part ways at a clear winner.
#[test]
fn long_context_divergence_happens_only_at_near_ties() {
    // Bounds from the measured batch-shape noise: SmolLM2's logits move by a few hundredths,
    // Gemma 3's by up to ~1.0 (tests/host.rs).
    for (name, bound) in [(SMOLLM, 0.25f32), (GEMMA, 1.5)] {
        let m = model(name);
        let toks = m.tokenize(&long_prompt(), true, false).unwrap();
        assert!(toks.len() > 600, "{}", toks.len());
        let mut c = ctx(name, 1);
        let want = plain_greedy(&mut c, &toks, 96);
        let mut engine = Engine::new(EngineConfig::default());
        let got = leap_greedy(&mut engine, &mut c, &toks, 96);
        assert!(got.drafted_tokens > 0, "{name}: nothing drafted");
        let Some(i) = want
            .tokens
            .iter()
            .zip(&got.tokens)
            .position(|(a, b)| a != b)
        else {
            continue;
        };
        let context: Vec<i32> = toks.iter().chain(&want.tokens[..i]).copied().collect();
        c.clear(false);
        plain::prefill(&mut c, &context, 512).unwrap();
        let l = c.logits(-1).unwrap();
        let gap = l[want.tokens[i] as usize] - l[got.tokens[i] as usize];
        eprintln!("{name}: first divergence at token {i}, logit gap {gap:.4}");
        assert!(
            gap < bound,
            "{name}: diverged at token {i} with a logit gap of {gap}: not a near-tie"
        );
    }
}

#[test]
fn cost_curve_measures_every_requested_row_count() {
    let m = model(SMOLLM);
    let toks = m.tokenize(&long_prompt(), true, false).unwrap();
    let mut c = ctx(SMOLLM, 1);
    let curve =
        leap_spec::control::measure_cost_curve(&mut c, &toks[..200], &[1, 3, 5], 2).unwrap();
    assert_eq!(curve.iter().map(|p| p.rows).collect::<Vec<_>>(), [1, 3, 5]);
    assert!(curve
        .iter()
        .all(|p| p.all_logits > 0.0 && p.last_logits > 0.0));
    // Every measurement was rolled back: the cache holds exactly the context again.
    assert_eq!(c.seq_pos_max(0), 199);
}

#[test]
fn history_drafts_a_repeated_request_from_the_earlier_answer() {
    let m = model(SMOLLM);
    let toks = m
        .tokenize(
            "Once upon a time, in a small village by the sea, there lived",
            true,
            false,
        )
        .unwrap();
    let mut c = ctx(SMOLLM, 1);
    let want = plain_greedy(&mut c, &toks, 64);
    let mut engine = Engine::new(EngineConfig::default());
    let first = leap_greedy(&mut engine, &mut c, &toks, 64);
    let second = leap_greedy(&mut engine, &mut c, &toks, 64);
    assert_eq!(want.tokens.len(), 64, "the prompt must not end at once");
    assert_eq!(first.tokens, want.tokens);
    assert_eq!(second.tokens, want.tokens);
    let per_call = |g: &plain::Generation| g.tokens.len() as f64 / g.target_calls.max(1) as f64;
    assert!(
        per_call(&second) > 2.0 * per_call(&first).max(1.0),
        "{} vs {}",
        per_call(&second),
        per_call(&first)
    );
    // Without history the second run is no better than the first.
    let mut forgetful = Engine::new(EngineConfig {
        history_tokens: 0,
        ..Default::default()
    });
    leap_greedy(&mut forgetful, &mut c, &toks, 64);
    let again = leap_greedy(&mut forgetful, &mut c, &toks, 64);
    assert!(per_call(&again) < per_call(&second));
}

//! Leap's speculative engine on a real model: greedy output is plain decoding's, token for
//! token, while drafts really are accepted.
//!
//! SmolLM2 is computed bit-for-bit alike by llama.cpp whatever the batch shape, so identity is
//! exact there. Gemma 3 is not (see the README), so for it the test only reports differences.

use leap_host::sampler::SamplingParams;
use leap_host::{Context, ContextParams};
use leap_spec::engine::{Engine, EngineConfig};
use leap_spec::plain;
use leap_tests::{model, threads, GEMMA, SMOLLM};

const PROMPTS: &[&str] = &[
    "The apt-get command installs packages. The apt-get command removes packages. The apt-get \
     command upgrades packages. The dpkg command installs a .deb file. Summary: the apt-get command",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Question: What is the capital of France?\nAnswer: Paris.\nQuestion: What is the capital of Italy?\nAnswer:",
];

fn ctx(name: &str, n_seq: u32) -> Context {
    Context::new(
        &model(name),
        &ContextParams {
            n_ctx: 1024,
            n_seq_max: n_seq,
            n_threads: threads(),
            n_threads_batch: threads(),
            ..Default::default()
        },
    )
    .unwrap()
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
        let want = plain::plain(
            &mut pc,
            &toks,
            48,
            &SamplingParams::default(),
            512,
            &mut |_| true,
        )
        .unwrap();
        let got = engine
            .generate(&mut ec, &toks, 48, 512, &mut |_| true)
            .unwrap();
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

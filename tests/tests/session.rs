//! The engine API the CLI, `leap serve` and the C API share (`leap_spec::session`), on the real
//! models: a conversation's next turn reuses the KV cache of the turn before and still decodes
//! plain greedy decoding's tokens; a request that does not fit is refused before any work; a
//! callback that returns false stops the generation.

use leap_host::Token;
use leap_spec::session::{Error, Mode, Options, Request, Runtime};
use leap_tests::{kernels, model_path, threads, GEMMA, PROMPTS, SMOLLM};

fn runtime(name: &str, mode: Mode) -> Runtime {
    kernels();
    Runtime::open(
        &model_path(name),
        &Options {
            threads: threads(),
            n_ctx: 1024,
            mode,
            ..Options::default()
        },
    )
    .expect("runtime opens")
}

fn greedy(n: usize) -> Request {
    Request {
        max_tokens: n,
        ..Default::default()
    }
}

/// Three turns, each prompt extending the last prompt and its answer: the engine with the
/// kept prefix gives the tokens a fresh plain session gives for the whole prompt.
fn turns_reuse_the_cache_and_stay_exact(name: &str) {
    let leap = runtime(name, Mode::Leap);
    let plain = runtime(name, Mode::Plain);
    let model = leap.model().clone();
    let mut s = leap.session().expect("session");
    let mut conversation: Vec<Token> = model.tokenize(PROMPTS[2], true, false).unwrap();
    let follow_ups = [
        "\nQuestion: And of Spain?\nAnswer:",
        "\nQuestion: And of Peru?\nAnswer:",
    ];
    let mut prev_len = 0;
    for turn in 0..3 {
        let g = s
            .generate(&conversation, &greedy(20), &mut |_| true)
            .unwrap();
        assert!(
            s.cached_tokens() >= prev_len,
            "{name} turn {turn}: only {} prompt tokens came from the cache, the last prompt had {prev_len}",
            s.cached_tokens(),
        );
        prev_len = conversation.len();
        // A fresh plain session each time: nothing cached.
        let mut p = plain.session().unwrap();
        let want = p
            .generate(&conversation, &greedy(20), &mut |_| true)
            .unwrap();
        assert_eq!(
            g.tokens, want.tokens,
            "{name} turn {turn}: Leap with a kept prefix differs from plain"
        );
        conversation.extend(g.tokens.iter().filter(|&&t| !model.is_eog(t)));
        if let Some(f) = follow_ups.get(turn) {
            conversation.extend(model.tokenize(f, false, false).unwrap());
        }
    }
    // A plain session reuses its cache too, with the same tokens as a fresh one.
    let mut p = plain.session().unwrap();
    let first = p
        .generate(&conversation, &greedy(8), &mut |_| true)
        .unwrap();
    let mut longer = conversation.clone();
    longer.extend(first.tokens.iter().filter(|&&t| !model.is_eog(t)));
    let again = p.generate(&longer, &greedy(8), &mut |_| true).unwrap();
    assert!(
        p.cached_tokens() >= conversation.len(),
        "plain session kept its prefix"
    );
    let fresh = plain
        .session()
        .unwrap()
        .generate(&longer, &greedy(8), &mut |_| true)
        .unwrap();
    assert_eq!(
        again.tokens, fresh.tokens,
        "{name}: plain with a kept prefix differs"
    );
}

#[test]
fn smollm_turns_reuse_the_cache_and_stay_exact() {
    turns_reuse_the_cache_and_stay_exact(SMOLLM);
}

#[test]
fn gemma_turns_reuse_the_cache_and_stay_exact() {
    turns_reuse_the_cache_and_stay_exact(GEMMA);
}

#[test]
fn a_request_that_does_not_fit_is_refused_before_any_work() {
    let rt = runtime(SMOLLM, Mode::Leap);
    let mut s = rt.session().unwrap();
    let prompt: Vec<Token> = rt.model().tokenize(PROMPTS[0], true, false).unwrap();
    let mut called = false;
    let e = s
        .generate(&prompt, &greedy(1024), &mut |_| {
            called = true;
            true
        })
        .expect_err("too long");
    assert!(matches!(e, Error::ContextFull { n_ctx: 1024, .. }), "{e}");
    assert_eq!(e.code(), 2);
    assert!(!called);
    let e = s
        .generate(&[], &greedy(4), &mut |_| true)
        .expect_err("empty");
    assert_eq!(e.code(), 1);
    // Still usable.
    let g = s.generate(&prompt, &greedy(4), &mut |_| true).unwrap();
    assert!(!g.tokens.is_empty());
    assert_eq!(s.totals().requests, 1);
}

#[test]
fn a_callback_returning_false_stops_the_generation() {
    let rt = runtime(SMOLLM, Mode::Leap);
    let mut s = rt.session().unwrap();
    let prompt: Vec<Token> = rt.model().tokenize(PROMPTS[0], true, false).unwrap();
    let mut seen = 0;
    let g = s
        .generate(&prompt, &greedy(64), &mut |_| {
            seen += 1;
            seen < 5
        })
        .unwrap();
    assert_eq!(seen, 5);
    assert_eq!(g.tokens.len(), 5, "the tokens up to the refusing callback");
}

#[test]
fn a_missing_model_is_a_model_error() {
    let e = Runtime::open("/nonexistent/model.gguf".as_ref(), &Options::default())
        .expect_err("no such file");
    assert_eq!(e.code(), 3, "{e}");
    assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
}

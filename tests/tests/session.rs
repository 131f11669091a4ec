//! The engine API the CLI, `leap serve` and the C API share (`leap_spec::session`), on the real
//! models: a conversation's next turn reuses the KV cache of the turn before and still decodes
//! plain greedy decoding's tokens; a request that does not fit is refused before any work; a
//! callback that returns false stops the generation.

use leap_host::Token;
use leap_spec::session::{Error, Mode, Options, Request, Runtime};
use leap_tests::{kernels, model_path, threads, GEMMA, NOTES, PROMPTS, SMOLLM};

fn options(mode: Mode) -> Options {
    Options {
        threads: threads(),
        n_ctx: 1024,
        mode,
        ..Options::default()
    }
}

fn runtime(name: &str, mode: Mode) -> Runtime {
    kernels();
    Runtime::open(&model_path(name), &options(mode)).expect("runtime opens")
}

/// Leap's engine drafting the longest proposal available, not what the controller sizes: its
/// latency profile is measured online, so on a loaded machine (CI, the other tests running) a
/// slow call can make it draft less. For the tests that count calls.
fn fixed_drafts(name: &str) -> Runtime {
    kernels();
    let options = options(Mode::Leap);
    let engine = leap_spec::engine::EngineConfig {
        adaptive: false,
        ..options.engine
    };
    Runtime::open(&model_path(name), &Options { engine, ..options }).expect("runtime opens")
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
        // Gemma's 262k-row head: the target drafts for itself, after a kept prefix too.
        assert_eq!(
            g.self_drafted,
            name == GEMMA,
            "{name} turn {turn}: self-drafting {}",
            g.self_drafted
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

/// Sampled decoding: Leap's engine gives the tokens plain sampling gives with the same seed
/// (each position's token drawn with the uniform of (seed, position)), and so does a session
/// whose drafting history differs (the same request again, its answer now in the history).
/// The call counts come from drafts of fixed sizes; the default engine, whose controller sizes
/// them from timings, gives the same tokens too.
fn a_seed_gives_plain_sampling_s_tokens(name: &str) {
    let leap = fixed_drafts(name);
    let adaptive = runtime(name, Mode::Leap);
    let plain = runtime(name, Mode::Plain);
    let prompt: Vec<Token> = leap
        .model()
        .tokenize(leap_tests::SAMPLED_PROMPT, true, false)
        .unwrap();
    let mut s = leap.session().unwrap();
    let mut a = adaptive.session().unwrap();
    let mut p = plain.session().unwrap();
    let mut differ = 0;
    for seed in 1..=4 {
        let req = Request {
            max_tokens: 24,
            sampling: leap_host::sampler::SamplingParams {
                temp: 0.9,
                ..leap_tests::sampled_params(seed)
            },
        };
        let want = p.generate(&prompt, &req, &mut |_| true).unwrap().tokens;
        let first = s.generate(&prompt, &req, &mut |_| true).unwrap();
        let again = s.generate(&prompt, &req, &mut |_| true).unwrap();
        assert_eq!(first.tokens, want, "{name} seed {seed}: leap against plain");
        let sized = a.generate(&prompt, &req, &mut |_| true).unwrap();
        assert_eq!(sized.tokens, want, "{name} seed {seed}: the default engine");
        assert_eq!(
            again.tokens, want,
            "{name} seed {seed}: again, with its history"
        );
        if first.target_calls != again.target_calls {
            differ += 1;
        }
        assert!(
            again.target_calls < again.tokens.len() as u64,
            "{name} seed {seed}: drafts were accepted ({} calls for {} tokens)",
            again.target_calls,
            again.tokens.len()
        );
    }
    // The repeats were drafted otherwise (from their history): the same tokens were not a
    // matter of the same drafts.
    assert!(differ > 0, "{name}: every repeat was drafted as the first");
}

#[test]
fn smollm_a_seed_gives_plain_sampling_s_tokens() {
    a_seed_gives_plain_sampling_s_tokens(SMOLLM);
}

#[test]
fn gemma_a_seed_gives_plain_sampling_s_tokens() {
    a_seed_gives_plain_sampling_s_tokens(GEMMA);
}

/// A temperature too small to divide by decodes greedily (1e-38 made the softmax NaN).
#[test]
fn a_tiny_temperature_decodes_greedily() {
    let rt = runtime(SMOLLM, Mode::Leap);
    let mut s = rt.session().unwrap();
    let prompt: Vec<Token> = rt.model().tokenize(PROMPTS[0], true, false).unwrap();
    let want = s
        .generate(&prompt, &greedy(12), &mut |_| true)
        .unwrap()
        .tokens;
    for temp in [1e-38, 1e-6, 9e-5] {
        let req = Request {
            max_tokens: 12,
            sampling: leap_host::sampler::SamplingParams {
                temp,
                ..leap_tests::sampled_params(3)
            },
        };
        s.forget();
        let got = s.generate(&prompt, &req, &mut |_| true).unwrap().tokens;
        assert_eq!(got, want, "temperature {temp}");
    }
}

/// A cancel check stops a generation during its prefill (the decode aborts between graph
/// nodes); the session then decodes the next request exactly.
#[test]
fn a_cancel_check_stops_prefill_and_the_session_goes_on() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let rt = runtime(SMOLLM, Mode::Leap);
    let plain = runtime(SMOLLM, Mode::Plain);
    let model = rt.model().clone();
    let mut long: Vec<Token> = Vec::new();
    while long.len() < 700 {
        long.extend(model.tokenize(PROMPTS[0], long.is_empty(), false).unwrap());
    }
    let mut s = rt.session().unwrap();
    let checks = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&checks);
    // Asked once per graph node: give up a little way into the first batch.
    s.set_cancel(Some(Arc::new(move || {
        c.fetch_add(1, Ordering::Relaxed) > 50
    })));
    let mut tokens = 0;
    let e = s
        .generate(&long, &greedy(8), &mut |_| {
            tokens += 1;
            true
        })
        .expect_err("cancelled");
    assert!(e.is_cancelled(), "{e}");
    assert_eq!(tokens, 0, "no token came out of a cancelled prefill");
    assert!(checks.load(Ordering::Relaxed) > 50);
    s.set_cancel(None);
    let prompt: Vec<Token> = model.tokenize(PROMPTS[2], true, false).unwrap();
    let g = s.generate(&prompt, &greedy(16), &mut |_| true).unwrap();
    let want = plain
        .session()
        .unwrap()
        .generate(&prompt, &greedy(16), &mut |_| true)
        .unwrap();
    assert_eq!(g.tokens, want.tokens);
}

/// `forget` leaves nothing of earlier requests: the same request again is drafted as the first
/// time (the history would otherwise draft most of it). With the controller sizing drafts, CI's
/// loaded machine once made the repeat take 33 calls against the first's 22.
#[test]
fn forget_leaves_nothing_of_earlier_requests() {
    let rt = fixed_drafts(SMOLLM);
    let mut s = rt.session().unwrap();
    let prompt: Vec<Token> = rt.model().tokenize(PROMPTS[0], true, false).unwrap();
    let first = s.generate(&prompt, &greedy(48), &mut |_| true).unwrap();
    let kept = s.generate(&prompt, &greedy(48), &mut |_| true).unwrap();
    s.forget();
    assert!(s.held().is_empty());
    let forgotten = s.generate(&prompt, &greedy(48), &mut |_| true).unwrap();
    assert_eq!(kept.tokens, first.tokens);
    assert_eq!(forgotten.tokens, first.tokens);
    eprintln!(
        "calls: first {}, kept {}, forgotten {}",
        first.target_calls, kept.target_calls, forgotten.target_calls
    );
    assert!(
        kept.target_calls * 2 < first.target_calls,
        "with its history the repeat takes {} calls, the first {}",
        kept.target_calls,
        first.target_calls
    );
    assert!(
        forgotten.target_calls * 3 > first.target_calls * 2,
        "forgotten: {} calls, the first {}",
        forgotten.target_calls,
        first.target_calls
    );
}

/// Threads that generated and live on (an app's threads, a server's slots) keep no OpenMP
/// team: ggml makes one on each thread that runs a graph, and with more OpenMP threads alive
/// than CPUs libgomp all but stops spinning, which made every later call 3-4x slower.
#[test]
fn threads_that_generated_keep_no_openmp_team() {
    use std::sync::{Arc, Barrier};
    let rt = Arc::new(runtime(SMOLLM, Mode::Leap));
    let prompt = rt.model().tokenize(PROMPTS[0], true, false).unwrap();
    let barrier = Arc::new(Barrier::new(5));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let (rt, barrier, prompt) = (rt.clone(), barrier.clone(), prompt.clone());
            std::thread::Builder::new()
                .name(format!("gen-{i}"))
                .spawn(move || {
                    let mut s = rt.session().expect("session");
                    s.generate(&prompt, &greedy(4), &mut |_| true).unwrap();
                    barrier.wait();
                    barrier.wait();
                })
                .unwrap()
        })
        .collect();
    // Every thread has generated and still lives.
    barrier.wait();
    // OpenMP's workers take the name of the thread that made them.
    let named = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("gen-"))
        .count();
    barrier.wait();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(
        named, 4,
        "threads named gen-*: the 4 that generated, and no team of theirs"
    );
}

/// `Session::score` after a greedy generation: the same log-probabilities whether the tokens
/// were drafted (Leap) or not (plain), bit for bit, and they are plain decoding's own: the
/// log-softmax of the logits a fresh context computes one row at a time. Each emitted token
/// is its position's most likely one.
fn logprobs_are_plain_decoding_s(name: &str) {
    let emitted_and_scores = |mode| {
        let rt = runtime(name, mode);
        let prompt = rt.model().tokenize(PROMPTS[0], true, false).unwrap();
        let mut s = rt.session().unwrap();
        let mut emitted = Vec::new();
        s.generate(&prompt, &greedy(24), &mut |t| {
            emitted.push(t);
            true
        })
        .unwrap();
        let scores = s.score(&prompt, &emitted, 5).unwrap();
        // The cache still holds the generation: the next turn reuses it.
        let mut next = prompt.clone();
        next.extend_from_slice(&emitted);
        s.generate(&next, &greedy(2), &mut |_| true).unwrap();
        assert!(
            s.cached_tokens() >= next.len() - 1,
            "{name}: {}",
            s.cached_tokens()
        );
        (prompt, emitted, scores)
    };
    let (prompt, emitted, leap) = emitted_and_scores(Mode::Leap);
    let (_, plain_emitted, plain) = emitted_and_scores(Mode::Plain);
    assert_eq!(emitted, plain_emitted, "{name}");
    assert_eq!(leap, plain, "{name}: drafted tokens scored otherwise");
    assert_eq!(leap.len(), emitted.len());
    let reference =
        leap_tests::greedy_logits(name, &prompt, emitted.len(), leap_host::FlashAttn::Off);
    for (i, (l, &t)) in leap.iter().zip(&emitted).enumerate() {
        let want = leap_spec::session::TokenLogprob::of(&reference[i], t, 5);
        assert_eq!(*l, want, "{name}: position {i}");
        assert_eq!(
            l.top[0],
            (t, l.logprob),
            "{name}: greedy token {i} is not the most likely"
        );
        assert!(l.logprob <= 0.0 && l.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    // A probability distribution: the top 5 of Gemma's 262k or SmolLM2's 49k tokens sum to
    // at most 1.
    let mass: f32 = leap[0].top.iter().map(|&(_, lp)| lp.exp()).sum();
    assert!(mass <= 1.0 + 1e-5, "{mass}");
}

#[test]
fn smollm_logprobs_are_plain_decoding_s() {
    logprobs_are_plain_decoding_s(SMOLLM);
}

#[test]
fn gemma_logprobs_are_plain_decoding_s() {
    logprobs_are_plain_decoding_s(GEMMA);
}

/// Structured output: under a JSON schema the greedy answer parses as JSON of that schema, it
/// is plain decoding's under the same grammar (a Leap session and a plain one agree, the Leap
/// one after a drafted request on it too), a GBNF grammar holds the answer to its words, and a
/// grammar llama.cpp cannot parse is an error that says so.
fn grammars_constrain_greedy_output(name: &str) {
    use leap_host::grammar::Grammar;
    let leap = runtime(name, Mode::Leap);
    let plain = runtime(name, Mode::Plain);
    let model = leap.model().clone();
    let prompt = leap
        .prompt_tokens("What is the capital of France? Answer in JSON.", true)
        .unwrap();
    let schema = r#"{"type": "object", "properties": {"capital": {"type": "string",
        "enum": ["Paris", "London", "Rome"]}, "population_millions": {"type": "integer"}},
        "required": ["capital", "population_millions"]}"#;
    let mut s = leap.session().unwrap();
    // A drafted request first: the constrained one must not depend on what the engine did.
    s.generate(&prompt, &greedy(16), &mut |_| true).unwrap();
    let run = |s: &mut leap_spec::session::Session| {
        let mut g = Grammar::json_schema(&model, schema).unwrap();
        s.generate_constrained(&prompt, &greedy(64), &mut g, &mut |_| true)
            .unwrap()
            .tokens
    };
    let got = run(&mut s);
    let want = run(&mut plain.session().unwrap());
    assert_eq!(got, want, "{name}: the Leap session's is plain decoding's");
    assert!(model.is_eog(*got.last().unwrap()), "{name}: the JSON ended");
    let text = model
        .detokenize(&got[..got.len() - 1], true, false)
        .unwrap();
    let cap = text
        .split("\"capital\"")
        .nth(1)
        .unwrap_or_else(|| panic!("{name}: no capital in {text:?}"));
    assert!(
        text.trim_start().starts_with('{') && text.trim_end().ends_with('}'),
        "{name}: {text:?}"
    );
    assert!(
        ["Paris", "London", "Rome"].iter().any(|c| cap.contains(c)),
        "{name}: {text:?}"
    );
    assert!(text.contains("\"population_millions\""), "{name}: {text:?}");

    let mut yes_no = Grammar::gbnf(&model, r#"root ::= "yes" | "no""#).unwrap();
    let g = s
        .generate_constrained(&prompt, &greedy(8), &mut yes_no, &mut |_| true)
        .unwrap();
    let text = model.detokenize(&g.tokens, true, false).unwrap();
    assert!(text == "yes" || text == "no", "{name}: {text:?}");
    // The session drafts again afterwards, and stays exact.
    let after = s.generate(&prompt, &greedy(16), &mut |_| true).unwrap();
    let fresh = plain
        .session()
        .unwrap()
        .generate(&prompt, &greedy(16), &mut |_| true)
        .unwrap();
    assert_eq!(after.tokens, fresh.tokens, "{name}");

    let e = Grammar::gbnf(&model, "root ::= (").unwrap_err().to_string();
    assert!(e.starts_with("grammar: "), "{e}");
    let e = Grammar::json_schema(&model, "{not json")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("JSON schema: "), "{e}");
}

#[test]
fn smollm_grammars_constrain_greedy_output() {
    grammars_constrain_greedy_output(SMOLLM);
}

#[test]
fn gemma_grammars_constrain_greedy_output() {
    grammars_constrain_greedy_output(GEMMA);
}

/// Structured output drafts: asked to quote a text as JSON of a schema, a Leap session drafts
/// (the quotes are in the prompt) and takes fewer target calls than tokens, and its tokens are
/// a plain session's under the same grammar. The grammar's own operations agree: the greedy
/// choice is the best of the masked row, and a copy walks drafts without moving the original.
fn grammars_draft_and_stay_exact(name: &str) {
    use leap_host::grammar::Grammar;
    let leap = runtime(name, Mode::Leap);
    let plain = runtime(name, Mode::Plain);
    let model = leap.model().clone();
    let para = &NOTES[NOTES.find("\n\n").unwrap() + 2..];
    let para = &para[..para.find("\n\n").unwrap()];
    let ask = format!(
        "{para}\n\nCopy the first three sentences of the text above word for word. Answer in \
         JSON, with the sentences in a list called quotes."
    );
    let prompt = leap.prompt_tokens(&ask, true).unwrap();
    let schema = r#"{"type": "object", "properties": {"quotes": {"type": "array",
        "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}, "required": ["quotes"]}"#;
    let run = |s: &mut leap_spec::session::Session| {
        let mut g = Grammar::json_schema(&model, schema).unwrap();
        s.generate_constrained(&prompt, &greedy(160), &mut g, &mut |_| true)
            .unwrap()
    };
    let got = run(&mut leap.session().unwrap());
    let want = run(&mut plain.session().unwrap());
    let text = model.detokenize(&got.tokens, true, false).unwrap();
    assert_eq!(got.tokens, want.tokens, "{name}: {text:?}");
    eprintln!(
        "{name}: {} tokens in {} calls ({} drafted, self-drafted {}): {text:?}",
        got.tokens.len(),
        got.target_calls,
        got.drafted_tokens,
        got.self_drafted
    );
    assert!(
        got.drafted_tokens > 0 && got.target_calls < got.tokens.len() as u64,
        "{name}: {} calls for {} tokens, {} drafted: {text:?}",
        got.target_calls,
        got.tokens.len(),
        got.drafted_tokens
    );
    assert!(
        text.starts_with('{') && text.contains("\"quotes\": ["),
        "{name}: {text:?}"
    );

    // The grammar's operations. A copy walks the whole output (it is the grammar's, its end
    // of generation included); the original stays at the start (it allows the first token
    // again below, which a complete grammar would not).
    let mut g = Grammar::json_schema(&model, schema).unwrap();
    let walked = g.allowed_prefix(&want.tokens).unwrap();
    assert_eq!(walked, want.tokens.len(), "{name}: {text:?}");
    let n_vocab = model.n_vocab() as usize;
    let mut masked = Vec::new();
    for (i, &t) in want.tokens.iter().take(12).enumerate() {
        // A row where the best overall is refused (`{` is the only start), and rows where
        // it is allowed: the greedy choice is the masked row's best either way.
        let mut row: Vec<f32> = (0..n_vocab)
            .map(|v| ((v * 7919 + i * 104_729) % 1000) as f32)
            .collect();
        let chosen = g.choose_greedy(&row, &mut masked).unwrap();
        assert!(g.mask(&mut row));
        assert_eq!(chosen, leap_host::sampler::argmax(&row), "{name}: row {i}");
        assert!(g.allows(t) && g.allowed_prefix(&[t]).unwrap() == 1);
        g.accept(t);
    }
}

#[test]
fn smollm_grammars_draft_and_stay_exact() {
    grammars_draft_and_stay_exact(SMOLLM);
}

#[test]
fn gemma_grammars_draft_and_stay_exact() {
    grammars_draft_and_stay_exact(GEMMA);
}

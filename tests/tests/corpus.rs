//! The model's own answers as a drafting corpus (`leap_spec::corpus`) on the real models:
//! `leap corpus` writes them into a sidecar that Leap loads back (and another model refuses);
//! drafting from them takes fewer target calls where the request's own text has nothing to
//! copy, and output stays plain decoding's: greedy token for token, sampled with a seed the
//! tokens plain sampling draws.

use std::path::{Path, PathBuf};

use leap_spec::session::{Mode, Options, Request, Runtime};
use leap_tests::{kernels, model, model_path, scratch, threads, GEMMA, SMOLLM};

/// Prompts the request's own text says little about: what follows is the model's phrasing.
const ASKED: &[&str] = &[
    "Explain in two sentences what a compiler does.\n",
    "Write a Python function that returns the largest of three numbers.\n",
    "What is the difference between a list and a tuple in Python?\n",
];

const ANSWER: usize = 32;

/// `leap corpus` for `name` on [`ASKED`], into a sidecar of its own.
fn sidecar(name: &str) -> PathBuf {
    let dir = scratch();
    let prompts = dir.join("asked.jsonl");
    let lines: Vec<String> = ASKED
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let out = dir.join(format!("{name}.corpus.leap.gguf"));
    kernels();
    let b = leap_cli::corpus::build_corpus(&leap_cli::corpus::BuildCorpus {
        model: model_path(name).to_string_lossy().into_owned(),
        prompts,
        skip: 0,
        limit: None,
        max_tokens: ANSWER,
        out: Some(out.clone()),
        threads: threads(),
        ctx: 1024,
        progress: false,
    })
    .expect("leap corpus");
    assert_eq!((b.answers, b.too_long), (ASKED.len(), 0), "{name}");
    assert!(b.tokens > ASKED.len() * 8, "{name}: {} tokens", b.tokens);
    out
}

fn runtime(name: &str, mode: Mode, side: Option<&Path>, adaptive: bool) -> Runtime {
    kernels();
    let base = Options {
        threads: threads(),
        n_ctx: 1024,
        mode,
        // Without one: no sidecar next to the model is read either.
        sidecar: Some(side.map_or_else(|| scratch().join("none.leap.gguf"), Path::to_path_buf)),
        ..Options::default()
    };
    let engine = leap_spec::engine::EngineConfig {
        adaptive,
        // The corpus's drafts on their own: no answers of earlier requests to copy.
        history_tokens: 0,
        ..base.engine.clone()
    };
    Runtime::open(&model_path(name), &Options { engine, ..base }).expect("runtime opens")
}

#[test]
fn the_sidecar_s_answers_load_for_their_model_only() {
    let side = sidecar(SMOLLM);
    let c = leap_spec::session::corpus_for(&model(SMOLLM), Some(&side))
        .expect("the corpus loads")
        .expect("the sidecar has one");
    assert_eq!(c.answers(), ASKED.len());
    let other = leap_spec::session::corpus_for(&model(GEMMA), Some(&side));
    assert!(
        other.as_ref().is_err_and(|e| e.contains("another model's")),
        "{other:?}"
    );
    // No early-exit head there: the corpus has keys of its own.
    assert_eq!(
        leap_spec::session::head_for(&model(SMOLLM), Some(&side)),
        Ok(None)
    );
}

/// Greedy: each prompt again, now with the model's answer to it in the corpus, gives plain's
/// tokens in fewer calls than without the corpus.
fn greedy_answers_stay_plain_in_fewer_calls(name: &str) {
    let side = sidecar(name);
    let plain = runtime(name, Mode::Plain, None, false);
    let with = runtime(name, Mode::Leap, Some(&side), false);
    let without = runtime(name, Mode::Leap, None, false);
    let (mut p, mut w, mut o) = (
        plain.session().unwrap(),
        with.session().unwrap(),
        without.session().unwrap(),
    );
    let req = Request {
        max_tokens: ANSWER,
        ..Request::default()
    };
    let (mut calls_with, mut calls_without) = (0, 0);
    for q in ASKED {
        let prompt = plain.prompt_tokens(q, false).unwrap();
        let want = p.generate(&prompt, &req, &mut |_| true).unwrap().tokens;
        let a = w.generate(&prompt, &req, &mut |_| true).unwrap();
        let b = o.generate(&prompt, &req, &mut |_| true).unwrap();
        assert_eq!(a.tokens, want, "{name} {q:?}: with the corpus");
        assert_eq!(b.tokens, want, "{name} {q:?}: without");
        calls_with += a.target_calls;
        calls_without += b.target_calls;
    }
    eprintln!("{name}: {calls_with} calls with the corpus, {calls_without} without");
    assert!(
        calls_with < calls_without,
        "{name}: the corpus's drafts took no call away ({calls_with} against {calls_without})"
    );
}

#[test]
fn smollm_greedy_answers_stay_plain_in_fewer_calls() {
    greedy_answers_stay_plain_in_fewer_calls(SMOLLM);
}

#[test]
fn gemma_greedy_answers_stay_plain_in_fewer_calls() {
    greedy_answers_stay_plain_in_fewer_calls(GEMMA);
}

/// Sampled with a seed: the tokens plain sampling draws with that seed, drafts from the corpus
/// or not.
#[test]
fn a_seed_gives_plain_sampling_s_tokens_with_the_corpus() {
    let name = SMOLLM;
    let side = sidecar(name);
    let plain = runtime(name, Mode::Plain, None, false);
    let with = runtime(name, Mode::Leap, Some(&side), true);
    let (mut p, mut w) = (plain.session().unwrap(), with.session().unwrap());
    let prompt = plain.prompt_tokens(ASKED[1], false).unwrap();
    let mut drafted = 0;
    for seed in 1..=3 {
        let req = Request {
            max_tokens: ANSWER,
            sampling: leap_host::sampler::SamplingParams {
                temp: 0.7,
                ..leap_tests::sampled_params(seed)
            },
        };
        let want = p.generate(&prompt, &req, &mut |_| true).unwrap().tokens;
        let got = w.generate(&prompt, &req, &mut |_| true).unwrap();
        assert_eq!(got.tokens, want, "{name} seed {seed}");
        drafted += got.drafted_tokens;
    }
    assert!(drafted > 0, "{name}: nothing was drafted");
}

/// The C API's drafter (llama.cpp's `--spec-type leap`) loads the sidecar's answers given the
/// target's GGUF path, and refuses another model's with LEAP_ERR_MODEL.
#[test]
fn the_c_api_s_drafter_loads_the_answers_of_its_target_only() {
    use leap::drafter::{leap_drafter_free, leap_drafter_new, leap_drafter_use_corpus};
    use std::ffi::CString;
    let side = sidecar(SMOLLM);
    let c = |p: &Path| CString::new(p.to_str().unwrap()).unwrap();
    let (smol, gemma, side_c) = (c(&model_path(SMOLLM)), c(&model_path(GEMMA)), c(&side));
    let missing = c(&scratch().join("missing.leap.gguf"));
    unsafe {
        let mut d = std::ptr::null_mut();
        assert_eq!(leap_drafter_new(std::ptr::null(), &mut d), 0);
        let mut n = 99;
        assert_eq!(
            leap_drafter_use_corpus(d, smol.as_ptr(), side_c.as_ptr(), &mut n),
            0
        );
        assert_eq!(n, ASKED.len());
        assert_eq!(
            leap_drafter_use_corpus(d, gemma.as_ptr(), side_c.as_ptr(), &mut n),
            leap::error::LEAP_ERR_MODEL
        );
        assert_eq!(n, 0);
        assert_eq!(
            leap_drafter_use_corpus(d, smol.as_ptr(), missing.as_ptr(), std::ptr::null_mut()),
            0
        );
        assert_eq!(
            leap_drafter_use_corpus(d, std::ptr::null(), side_c.as_ptr(), &mut n),
            leap::error::LEAP_ERR_INVALID_ARGUMENT
        );
        leap_drafter_free(d);
    }
}

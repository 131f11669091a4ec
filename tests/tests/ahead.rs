//! The head that guesses the token after next (`leap_spec::ahead`) on a real model: `leap
//! train-heads --ahead` writes one Leap loads back (and refuses for another model); with it the
//! target drafting for itself puts guesses in its steps' calls, keeps the right ones, and its
//! greedy output stays plain decoding's, token for token.

use std::path::PathBuf;
use std::sync::Arc;

use leap_spec::ahead::Ahead;
use leap_spec::engine::{Engine, EngineConfig};
use leap_spec::vocab::{Resident, VocabConfig};
use leap_tests::{
    context, kernels, leap_context, leap_greedy, model, model_path, plain_greedy, scratch, GEMMA,
    PROMPTS, SMOLLM,
};

/// A head for `name` trained (briefly) on the test corpus into a sidecar of its own; training
/// moved it from its start towards the target's choices on held-out positions.
fn sidecar(name: &str) -> PathBuf {
    let out = scratch().join(format!("{name}.ahead.leap.gguf"));
    let t = leap_cli::heads::train_heads(&leap_cli::heads::TrainHeads {
        model: model_path(name).to_string_lossy().into_owned(),
        corpus: concat!(env!("CARGO_MANIFEST_DIR"), "/data/attention-notes.txt").into(),
        skip: 0,
        layer: 0,
        ahead: true,
        out: Some(out.clone()),
        positions: 600,
        window: 128,
        epochs: 3,
        threads: leap_tests::threads(),
        progress: false,
    })
    .expect("train-heads --ahead");
    assert!(matches!(t.head, leap_cli::heads::TrainedHead::Ahead(_)));
    assert!(t.held_out > 0 && t.train_samples > t.held_out);
    // Training moved it from guessing the next token again towards the target's choice.
    assert!(
        t.eval.kd < t.lens.kd && t.eval.top1 > t.lens.top1,
        "{name}: {:?} -> {:?}",
        t.lens,
        t.eval
    );
    out
}

/// A head that guesses the token just chosen again (`A = [0 | I]`, what training starts
/// from): right where the text repeats a token, wrong elsewhere, whatever training would make
/// of it.
fn repeating(d: usize) -> Ahead {
    let mut a = vec![0.0; 2 * d * d];
    for i in 0..d {
        a[i * 2 * d + d + i] = 1.0;
    }
    Ahead { n_embd: d, a }
}

#[test]
fn a_trained_head_loads_back_and_another_model_refuses_it() {
    let m = model(GEMMA);
    let side = sidecar(GEMMA);
    let head = leap_spec::session::ahead_for(&m, Some(&side))
        .expect("the head loads")
        .expect("the sidecar has one");
    assert_eq!(head.n_embd, m.n_embd() as usize);
    // The early-exit head's loader finds none there: the keys are the ahead head's own.
    assert_eq!(leap_spec::session::head_for(&m, Some(&side)), Ok(None));
    let other = leap_spec::session::ahead_for(&model(SMOLLM), Some(&side));
    assert!(
        other.as_ref().is_err_and(|e| e.contains("another model")),
        "{other:?}"
    );
}

#[test]
fn guesses_ride_in_the_steps_and_output_stays_plain_greedy() {
    assert!(kernels());
    let name = GEMMA;
    let m = model(name);
    let mut pc = context(name, 2048, 1);
    let (mut ec, od) = leap_context(name, 2048, 1);
    let mut engine = Engine::new(EngineConfig {
        vocab: Some(VocabConfig {
            resident: Resident::Always,
            // No retrieval chains: every draft is the target's own or the head's.
            min_match: 0,
            always_guess: true,
            ..Default::default()
        }),
        ..EngineConfig::default()
    })
    .with_on_demand(od)
    .with_ahead(Some(Arc::new(repeating(m.n_embd() as usize))));
    // Repeated words first, while the guesses' prior lets every step guess.
    let mut prompts = vec!["ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha"];
    prompts.extend_from_slice(PROMPTS);
    let (mut guesses, mut kept) = (0, 0);
    for p in prompts {
        let toks = m.tokenize(p, true, false).unwrap();
        let want = plain_greedy(&mut pc, &toks, 40);
        let got = leap_greedy(&mut engine, &mut ec, &toks, 40);
        assert_eq!(got.tokens, want.tokens, "{name}: {p:?}");
        assert!(got.self_drafted);
        eprintln!("{p:?}: {} guesses, {} kept", got.guesses, got.guesses_kept);
        guesses += got.guesses;
        kept += got.guesses_kept;
    }
    eprintln!("{name}: {guesses} guesses, {kept} kept");
    assert!(kept > 0, "no guess was kept ({guesses} made)");
    assert!(
        kept < guesses,
        "every guess kept: the rejection path untested"
    );
}

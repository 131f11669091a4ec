//! Leap's speculative engine on a real model: greedy output is plain decoding's, token for
//! token, while drafts really are accepted. Exact, not "close": with Leap's batch-invariant
//! configuration (host::backend::BATCH_INVARIANT_ENV, no repacking, no flash attention) a
//! token verified in a k-row batch gets bit-for-bit the logits it gets decoded alone.

use leap_host::Context;
use leap_spec::engine::{Engine, EngineConfig};
use leap_spec::plain;
use leap_tests::{context, leap_context, leap_greedy, model, plain_greedy, GEMMA, PROMPTS, SMOLLM};

/// The engine drafting whatever it finds, up to 8 tokens, whatever the measured costs: tests
/// that count drafts must not depend on timings (the controller's decisions do, and tests run
/// in parallel on 2 cores).
fn eager_drafting() -> EngineConfig {
    EngineConfig {
        adaptive: false,
        max_draft: 8,
        // Trees, not the target drafting for itself (Gemma's head would choose that).
        vocab: None,
        ..Default::default()
    }
}

fn ctx(name: &str, n_seq: u32) -> Context {
    context(name, 2048, n_seq)
}

/// Runs every prompt in plain and in the engine, with llama.cpp's logits for every verified
/// row and with on-demand output projection; returns (differing requests, accepted drafts).
fn compare(name: &str, cfg: EngineConfig) -> (usize, u64, u64) {
    let m = model(name);
    let mut pc = ctx(name, 1);
    let (mut differ, mut drafted, mut saved) = (0, 0, 0);
    let (mut verify_rows, mut output_rows) = (0u64, 0u64);
    // The engine's contexts' own device (with the default settings).
    let device = leap_backend::Device::new(leap_backend::DeviceConfig::default());
    for on_demand in [false, true] {
        let (mut ec, od) = device.bind(|| leap_context(name, 2048, cfg.max_branches as u32));
        assert!(od.is_some(), "{name}: on-demand projection applies");
        let mut engine = Engine::new(cfg.clone()).with_on_demand(od.filter(|_| on_demand));
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
            // Row counts: every call verifies its tree's rows; without pruning heads every
            // row goes past the exit layer; llama.cpp's logits cover every row, on-demand
            // projection only the rows acceptance reads.
            assert_eq!(
                got.verify_rows,
                got.target_calls + got.drafted_tokens,
                "{name}"
            );
            assert_eq!(got.rows_after_exit, got.verify_rows, "{name}");
            if on_demand {
                assert!(got.output_rows <= got.verify_rows, "{name}: {got:?}");
                verify_rows += got.verify_rows;
                output_rows += got.output_rows;
            } else {
                assert_eq!(got.output_rows, got.verify_rows, "{name}");
            }
        }
        if on_demand {
            assert_eq!(
                engine.on_demand_ok(),
                Some(true),
                "{name}: the self-check passed"
            );
        }
    }
    // Verification's small batches went through Leap's ggml device (registered by the test
    // helpers), whose results are what ggml computes row by row (counted per context).
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert!(device.calls() > 0, "{name}: Leap's device computed nothing");
    }
    if drafted > 0 {
        assert!(
            output_rows < verify_rows,
            "{name}: on-demand projection computed {output_rows} of {verify_rows} rows"
        );
    }
    (differ, drafted, saved)
}

#[test]
fn chain_output_is_plain_greedy_on_smollm() {
    let (differ, drafted, saved) = compare(SMOLLM, eager_drafting());
    assert_eq!(differ, 0);
    let m = model(SMOLLM);
    let toks = m.tokenize(PROMPTS[0], true, false).unwrap();
    let g = leap_greedy(
        &mut Engine::new(eager_drafting()),
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

/// Trees of up to 4 leaves, drafting whatever the drafters find (6 tokens a path).
fn tree_output_is_plain_greedy(name: &str) {
    let cfg = EngineConfig {
        max_branches: 4,
        max_draft: 6,
        ..eager_drafting()
    };
    let (differ, drafted, saved) = compare(name, cfg);
    assert_eq!(differ, 0);
    assert!(drafted > 0 && saved > 0, "drafted {drafted}, saved {saved}");
}

#[test]
fn tree_output_is_plain_greedy_on_smollm() {
    tree_output_is_plain_greedy(SMOLLM);
}

#[test]
fn chain_output_is_plain_greedy_on_gemma() {
    let (differ, drafted, saved) = compare(GEMMA, eager_drafting());
    assert_eq!(differ, 0);
    assert!(drafted > 0 && saved > 0, "drafted {drafted}, saved {saved}");
}

#[test]
fn tree_output_is_plain_greedy_on_gemma() {
    tree_output_is_plain_greedy(GEMMA);
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

/// On a long context (past Gemma 3's 512-token sliding window, where the KV cells of the
/// window layers are reused) the engine still reproduces plain decoding exactly, chain and
/// tree. Where it did not, the test names the first differing token and plain's logit gap
/// there, which tells a rounding near-tie (a regression of batch invariance) from an engine
/// bug (a clear winner lost: a wrong KV cell or position).
#[test]
fn long_context_output_is_plain_greedy() {
    for name in [SMOLLM, GEMMA] {
        let m = model(name);
        let toks = m.tokenize(&long_prompt(), true, false).unwrap();
        assert!(toks.len() > 600, "{}", toks.len());
        let (mut c, od) = leap_context(name, 2048, 4);
        let want = plain_greedy(&mut c, &toks, 96);
        // Drafting everything it finds (chain, tree), then Leap's own configuration (Lever
        // trees, calibration; how much it drafts depends on measured costs).
        let configs = [
            eager_drafting(),
            EngineConfig {
                max_branches: 4,
                ..eager_drafting()
            },
            EngineConfig {
                max_branches: 4,
                ..Default::default()
            },
        ];
        for (k, cfg) in configs.into_iter().enumerate() {
            let branches = cfg.max_branches;
            let mut engine = Engine::new(cfg).with_on_demand(od.clone());
            let got = leap_greedy(&mut engine, &mut c, &toks, 96);
            assert!(k == 2 || got.drafted_tokens > 0, "{name}: nothing drafted");
            let Some(i) = want
                .tokens
                .iter()
                .zip(&got.tokens)
                .position(|(a, b)| a != b)
            else {
                assert_eq!(got.tokens.len(), want.tokens.len());
                continue;
            };
            let context: Vec<i32> = toks.iter().chain(&want.tokens[..i]).copied().collect();
            c.clear(false);
            plain::prefill(&mut c, &context, 512).unwrap();
            let l = c.logits(-1).unwrap();
            let gap = l[want.tokens[i] as usize] - l[got.tokens[i] as usize];
            panic!("{name} ({branches} branches): differs from plain at token {i}, plain's logit gap {gap:.4}");
        }
    }
}

#[test]
fn cost_curve_measures_every_requested_row_count() {
    let m = model(SMOLLM);
    let toks = m.tokenize(&long_prompt(), true, false).unwrap();
    let mut c = ctx(SMOLLM, 1);
    let measure = |c: &mut leap_host::Context, paths| {
        leap_spec::control::measure_cost_curve(c, None, &toks[..200], &[1, 3, 5], 2, paths).unwrap()
    };
    let curve = measure(&mut c, leap_spec::control::Paths::BOTH);
    assert_eq!(curve.iter().map(|p| p.rows).collect::<Vec<_>>(), [1, 3, 5]);
    assert!(curve.iter().all(|p| p.all_logits.is_some_and(|s| s > 0.0)
        && p.last_logits.is_some_and(|s| s > 0.0)
        && p.cut.is_none()));
    // Every measurement was rolled back: the cache holds exactly the context again.
    assert_eq!(c.seq_pos_max(0), 199);
    // The engine's path alone: without an on-demand projection it is the call with every
    // row's logits, and llama.cpp's last-row call is not timed.
    let engine = measure(
        &mut c,
        leap_spec::control::Paths {
            llama: false,
            engine: true,
        },
    );
    assert!(engine
        .iter()
        .all(|p| p.all_logits.is_some() && p.last_logits.is_none() && p.engine() == p.all_logits));
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
    let mut engine = Engine::new(eager_drafting());
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
        ..eager_drafting()
    });
    leap_greedy(&mut forgetful, &mut c, &toks, 64);
    let again = leap_greedy(&mut forgetful, &mut c, &toks, 64);
    assert!(per_call(&again) < per_call(&second));
}

/// Sampled speculative decoding on a real model keeps the target's distribution. The second
/// token goes through the engine's stochastic acceptance of a retrieval draft; over many seeds
/// the first two tokens must follow the joint distribution llama.cpp's sampler chain draws
/// from (chi-square over the pairs).
#[test]
fn sampled_output_follows_the_target_distribution() {
    let m = model(SMOLLM);
    let toks = m.tokenize(leap_tests::SAMPLED_PROMPT, true, false).unwrap();
    let params = leap_tests::sampled_params;
    let mut c = ctx(SMOLLM, 1);
    let mut engine = Engine::new(EngineConfig {
        adaptive: false,
        history_tokens: 0,
        reuse_lifetime: 0,
        ..Default::default()
    });
    let runs: Vec<_> = (0..300)
        .map(|seed| {
            engine
                .generate_with(&mut c, &toks, 3, 512, &params(seed), &mut |_| true)
                .unwrap()
        })
        .collect();
    assert!(
        // A draft follows when the first token continues the prompt's cycle: about a third
        // of the runs.
        runs.iter().filter(|g| g.drafted_tokens > 0).count() > 60,
        "the second token must go through acceptance of a draft"
    );
    let pairs: Vec<(i32, i32)> = runs.iter().map(|g| (g.tokens[0], g.tokens[1])).collect();

    leap_tests::assert_pairs_follow_the_target(&mut c, &toks, &params(0), &pairs);
}

/// In-context calibration: the calibrating prefill leaves llama.cpp's own logits for the last
/// prompt token (bit for bit), and its prediction at every prompt position is the model's
/// most likely next token among the prompt's tokens, as llama.cpp's full logits there say.
#[test]
fn calibration_predicts_the_models_choice_among_the_prompts_tokens() {
    use leap_host::Batch;
    use leap_spec::calib;
    for name in [SMOLLM, GEMMA] {
        let m = model(name);
        let toks = m
            .tokenize(
                "Packages are installed with apt. Packages are removed with apt. Packages are",
                true,
                false,
            )
            .unwrap();
        let (mut c, od) = leap_context(name, 512, 1);
        let od = od.unwrap();
        // Small chunks, so the cut-at-hidden-states path runs several times.
        let p = calib::prefill(&mut c, &od, &toks, 7, true).unwrap();
        assert_eq!(
            p.exact,
            Some(true),
            "{name}: on-demand projection is bit-exact"
        );
        assert_eq!(p.calib.pred.len(), toks.len());

        // Reference: llama.cpp's logits at every position, in one plain batch.
        let mut r = ctx(name, 1);
        let mut b = Batch::new(toks.len(), 1);
        for (i, &t) in toks.iter().enumerate() {
            b.add(t, i as i32, &[0], true).unwrap();
        }
        r.decode(&b).unwrap();
        assert_eq!(
            c.logits(-1)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            r.logits(toks.len() as i32 - 1)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            "{name}: the last prompt token's logits"
        );
        for (i, &pred) in p.calib.pred.iter().enumerate() {
            let l = r.logits(i as i32).unwrap();
            let best = toks
                .iter()
                .copied()
                .max_by(|&a, &b| l[a as usize].total_cmp(&l[b as usize]).then(b.cmp(&a)))
                .unwrap();
            assert_eq!(
                l[pred as usize], l[best as usize],
                "{name} position {i}: predicted {pred}, the model prefers {best} there"
            );
        }
    }
}

/// A draft model with another vocabulary (SmolLM2 drafting for Gemma 3, through text): the
/// output is still plain decoding's, and its drafts are taken.
#[test]
fn draft_model_across_vocabularies_keeps_plain_output() {
    use leap_spec::model_draft::{LlamaDraft, ModelDrafter, Vocab};
    let (target, draft) = (model(GEMMA), model(SMOLLM));
    let mut pc = ctx(GEMMA, 1);
    let (mut ec, od) = leap_context(GEMMA, 2048, 1);
    let vocab: std::sync::Arc<dyn Vocab + Send + Sync> = target.clone();
    let lm = LlamaDraft::new(draft.clone(), context(SMOLLM, 2048, 1));
    let mut engine = Engine::new(eager_drafting())
        .with_on_demand(od)
        .with_drafter(Box::new(ModelDrafter::new(lm, vocab)));
    let (mut drafted, mut saved) = (0, 0);
    for p in &PROMPTS[..2] {
        let toks = target.tokenize(p, true, false).unwrap();
        let want = plain_greedy(&mut pc, &toks, 32);
        let got = leap_greedy(&mut engine, &mut ec, &toks, 32);
        assert_eq!(got.tokens, want.tokens, "{p}");
        drafted += got.drafted_tokens;
        saved += (got.tokens.len() as u64).saturating_sub(got.target_calls + 1);
    }
    assert!(drafted > 0 && saved > 0, "drafted {drafted}, saved {saved}");
}

/// The target drafting for itself over a resident vocabulary (`leap_spec::vocab`, what `leap`
/// does on a streamed target and `leap:vocab` always): plain greedy decoding's tokens on both
/// models, with its drafts accepted; with 16 resident rows (nearly every draft rejected) and
/// with retrieval chains batched into its calls too.
#[test]
fn self_drafting_over_a_resident_vocabulary_is_plain_greedy() {
    use leap_spec::vocab::VocabConfig;
    for name in [SMOLLM, GEMMA] {
        let m = model(name);
        let mut pc = ctx(name, 1);
        for vc in [
            VocabConfig {
                resident: leap_spec::vocab::Resident::Always,
                min_match: 0,
                ..Default::default()
            },
            VocabConfig {
                resident: leap_spec::vocab::Resident::Always,
                ..Default::default()
            },
            VocabConfig {
                resident: leap_spec::vocab::Resident::Always,
                prefix: 16,
                resident_prefix: 16,
                extra: 0,
                min_match: 2,
                max_draft: 6,
                always_guess: false,
            },
        ] {
            let (mut ec, od) = leap_context(name, 2048, 1);
            let mut engine = Engine::new(EngineConfig {
                vocab: Some(vc),
                ..EngineConfig::default()
            })
            .with_on_demand(od);
            let (mut accepted, mut drafted) = (0, 0);
            for p in PROMPTS {
                let toks = m.tokenize(p, true, false).unwrap();
                let want = plain_greedy(&mut pc, &toks, 40);
                let got = leap_greedy(&mut engine, &mut ec, &toks, 40);
                assert_eq!(got.tokens, want.tokens, "{name} {vc:?}: {p}");
                drafted += got.drafted_tokens;
                // Calls: one per round and one per drafted step (no chains); tokens: one per
                // round and one per accepted draft.
                accepted +=
                    got.tokens.len() as i64 - got.target_calls as i64 + got.drafted_tokens as i64;
            }
            // Rejected drafts shorten later runs (Eq. 4.1), but the first ones are drafted.
            assert!(drafted > 0, "{name} {vc:?}");
            if vc.min_match == 0 {
                assert!(accepted > 0, "{name}: no draft accepted");
            }
        }
    }
}

/// Self-drafting over text the prompt holds: after a round's first drafts, retrieval chains
/// ride in its steps' calls (`Rounds::ride_after`) and stand as drafts, and the output is
/// still plain greedy decoding's, on both models.
#[test]
fn retrieval_chains_ride_in_self_drafting_steps_and_output_stays_plain() {
    use leap_spec::vocab::VocabConfig;
    const COPY: &str = "Copy this list exactly, twice.\nList: apples, pears, plums, \
        cherries, grapes, lemons, melons, figs, dates, limes, peaches.\nCopy 1: apples, \
        pears, plums, cherries, grapes, lemons, melons, figs, dates, limes, peaches.\nCopy 2:";
    for name in [SMOLLM, GEMMA] {
        let m = model(name);
        let mut pc = ctx(name, 1);
        let (mut ec, od) = leap_context(name, 2048, 1);
        let mut engine = Engine::new(EngineConfig {
            vocab: Some(VocabConfig {
                resident: leap_spec::vocab::Resident::Always,
                ..Default::default()
            }),
            ..EngineConfig::default()
        })
        .with_on_demand(od);
        let toks = m.tokenize(COPY, true, false).unwrap();
        let want = plain_greedy(&mut pc, &toks, 40);
        let got = leap_greedy(&mut engine, &mut ec, &toks, 40);
        assert_eq!(got.tokens, want.tokens, "{name}");
        assert!(got.self_drafted, "{name}");
        assert!(
            got.rides_kept > 0,
            "{name}: {} ride tokens, {} kept",
            got.rides,
            got.rides_kept
        );
    }
}

/// Whether the target drafts for itself ([`leap_spec::vocab::Resident::Auto`]) is read off the
/// model's weights, not timed: Gemma 3's tied 262k-row head is most of what a call reads,
/// SmolLM2's is not, and the figure is the same however often (and under whatever load) it
/// is asked.
#[test]
fn the_self_drafting_choice_is_the_model_s_weights() {
    use leap_spec::vocab::AUTO_SHARE;
    let mut shares = Vec::new();
    for name in [GEMMA, SMOLLM] {
        let (_ctx, od) = leap_context(name, 256, 1);
        let od = od.expect("a plain output projection");
        let share = od.head_share();
        let (_ctx2, again) = leap_context(name, 256, 1);
        assert_eq!(share, again.unwrap().head_share(), "{name}");
        assert!(share > 0.0 && share < 1.0, "{name}: {share}");
        shares.push(share);
    }
    assert!(
        shares[0] >= AUTO_SHARE + 0.1 && shares[1] + 0.1 <= AUTO_SHARE,
        "Gemma {:.3} and SmolLM2 {:.3} against the threshold {AUTO_SHARE}",
        shares[0],
        shares[1]
    );
}

/// The device times its nodes by kind only while asked (`leap profile --ops`): a 4-row call
/// on SmolLM2 counts its 30 layers' seven weight products, two attention products, softmax,
/// two cache writes, SwiGLU unit and nine small ops, with time on each kind that ran; a call
/// after `take_timing` adds nothing.
#[test]
fn the_device_times_its_nodes_by_kind_while_asked() {
    use leap_backend::OpClass;
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("avx2") {
        eprintln!("the device's kernels need AVX2 here");
        return;
    }
    let m = model(SMOLLM);
    let device = leap_backend::Device::new(leap_backend::DeviceConfig::default());
    let mut ctx = device.bind(|| context(SMOLLM, 256, 1));
    let toks = m.tokenize(PROMPTS[0], true, false).unwrap();
    let mut batch = leap_host::Batch::new(4, 1);
    let mut call = |ctx: &mut Context, at: i32| {
        batch.clear();
        for (i, &t) in toks[..4].iter().enumerate() {
            batch.add(t, at + i as i32, &[0], true).unwrap();
        }
        ctx.decode(&batch).unwrap();
    };
    call(&mut ctx, 0);
    device.start_timing();
    call(&mut ctx, 4);
    let t = device.take_timing();
    call(&mut ctx, 8);
    assert_eq!(
        device.take_timing(),
        Default::default(),
        "nothing after take"
    );
    let nodes = |c: OpClass| t.nodes[c as usize];
    assert_eq!(nodes(OpClass::Weights), 30 * 7, "{t:?}");
    assert_eq!(nodes(OpClass::Attention), 30 * 2, "{t:?}");
    assert_eq!(nodes(OpClass::FlashAttention), 0, "{t:?}");
    // A softmax a layer, and the layer's keys and values written into the cache.
    assert_eq!(nodes(OpClass::Softmax), 30, "{t:?}");
    assert_eq!(nodes(OpClass::CacheWrites), 30 * 2, "{t:?}");
    // SwiGLU's unit a layer.
    assert_eq!(nodes(OpClass::Glu), 30, "{t:?}");
    // A layer's two RMS norms and their weights' products, RoPE of its queries and keys,
    // attention's output copied into rows and the two residual adds; then the output norm
    // (its weight's product stays with the output projection in ggml's split).
    assert_eq!(nodes(OpClass::RowOps), 30 * 9 + 1, "{t:?}");
    // Every kind that computed nodes took time, and only those.
    for c in OpClass::ALL {
        assert_eq!(t.of(c) > 0.0, nodes(c) > 0, "{c:?}: {t:?}");
    }
}

/// Attention's scores over cells the mask hides are left out by the device (Gemma 3's
/// sliding-window layers see 512 of a full-size cache): a verification batch after a long
/// prompt still gets, row for row, the logits ggml's CPU backend alone gives each token decoded
/// by itself, bit for bit, both models.
#[test]
fn verification_rows_past_the_window_are_ggml_s_lone_rows() {
    let off = leap_backend::Device::new(leap_backend::DeviceConfig::off());
    let on = leap_backend::Device::new(leap_backend::DeviceConfig::default());
    for name in [GEMMA, SMOLLM] {
        let m = model(name);
        let prompt = m.tokenize(&long_prompt(), true, false).unwrap();
        assert!(prompt.len() > 600, "{}", prompt.len());
        let rows: Vec<i32> = m
            .tokenize(
                " The dpkg tool unpacks archives and configures",
                false,
                false,
            )
            .unwrap();
        let prefill = |c: &mut Context| plain::prefill(c, &prompt, 512).unwrap();
        // ggml alone: each row decoded by itself.
        let mut lone = off.bind(|| context(name, 2048, 1));
        prefill(&mut lone);
        let mut want = Vec::new();
        for (i, &t) in rows.iter().enumerate() {
            let mut b = leap_host::Batch::new(1, 1);
            b.add(t, (prompt.len() + i) as i32, &[0], true).unwrap();
            lone.decode(&b).unwrap();
            want.push(lone.logits(-1).unwrap().to_vec());
        }
        // The device: every row in one batch.
        let mut batch = on.bind(|| context(name, 2048, 1));
        prefill(&mut batch);
        let mut b = leap_host::Batch::new(rows.len(), 1);
        for (i, &t) in rows.iter().enumerate() {
            b.add(t, (prompt.len() + i) as i32, &[0], true).unwrap();
        }
        batch.decode(&b).unwrap();
        assert!(on.calls() > 0, "{name}: the device computed nothing");
        for (i, want) in want.iter().enumerate() {
            let got = batch.logits(i as i32).unwrap();
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{name}: row {i} of {} differs from ggml's lone row",
                rows.len()
            );
        }
    }
}

//! Early-exit heads (Lever §4.3) on real models: `leap train-heads` writes a head Leap loads
//! back; a head trained on another model, or a corrupt sidecar, is refused with a message;
//! pruning rows at the exit layer really skips work in Leap's device and leaves greedy output
//! plain decoding's, token for token, and sampled output the target's distribution.

use std::path::PathBuf;
use std::sync::Arc;

use leap_host::exit::Exit;
use leap_host::{Context, Model};
use leap_spec::engine::{Engine, EngineConfig};
use leap_spec::exit::{PruneConfig, Pruner};
use leap_spec::head::Head;
use leap_tests::{
    context, kernels, model, model_path, params, plain_greedy, sampled_params, scratch, GEMMA,
    PROMPTS, SAMPLED_PROMPT, SMOLLM,
};

/// A head for `name` trained (briefly) on the test corpus into a sidecar of its own, once.
fn sidecar(name: &str) -> PathBuf {
    static DONE: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = done.iter().find(|(n, _)| n == name) {
        return p.clone();
    }
    let out = scratch().join(format!("{name}.leap.gguf"));
    let layer = (model(name).n_layer() / 2) as u32;
    let t = leap_cli::heads::train_heads(&leap_cli::heads::TrainHeads {
        model: model_path(name).to_string_lossy().into_owned(),
        corpus: concat!(env!("CARGO_MANIFEST_DIR"), "/data/attention-notes.txt").into(),
        skip: 0,
        layer,
        ahead: false,
        out: Some(out.clone()),
        positions: 400,
        window: 64,
        epochs: 3,
        threads: leap_tests::threads(),
        progress: false,
    })
    .expect("train-heads");
    assert_eq!(t.out, out);
    let leap_cli::heads::TrainedHead::Exit(h) = &t.head else {
        panic!("an early-exit head was asked for");
    };
    assert_eq!(h.layer, layer);
    assert_eq!(h.shadow.len(), 16);
    assert!(t.held_out > 0 && t.train_samples > t.held_out);
    // Training moved the head from the logit lens towards the teacher (held-out positions).
    assert!(
        t.eval.kd < t.lens.kd,
        "{name}: distillation loss {} not below the lens's {}",
        t.eval.kd,
        t.lens.kd
    );
    done.push((name.to_string(), out.clone()));
    out
}

fn head(name: &str) -> Head {
    leap_cli::heads::head_for(&model(name), Some(&sidecar(name)))
        .expect("the head loads")
        .expect("the sidecar has a head")
}

/// A context for the engine with on-demand projection and the exit observer, its device (the
/// exit's row masks go to it), and the engine.
fn pruning_engine(
    m: &Arc<Model>,
    h: Head,
    cfg: EngineConfig,
    prune: PruneConfig,
) -> (Context, leap_backend::Device, Engine) {
    let device = leap_backend::Device::new(leap_backend::DeviceConfig::default());
    let publish = {
        let device = device.clone();
        Arc::new(move |mask| device.exit_mask(mask)) as leap_host::exit::Publish
    };
    let (exit, obs) = Exit::new(h.layer, publish);
    let (ctx, od) = device
        .bind(|| {
            leap_host::project::OnDemand::context_with(
                m,
                &params(2048, cfg.max_branches as u32),
                Some(obs),
            )
        })
        .expect("context");
    assert!(od.is_some());
    let pruner = Pruner {
        head: Arc::new(h),
        n_layer: m.n_layer() as u32,
    };
    let engine = Engine::new(EngineConfig { prune, ..cfg })
        .with_on_demand(od)
        .with_exit(Some((exit, pruner)));
    (ctx, device, engine)
}

/// Trees of up to 4 leaves and 8 drafted tokens whatever the timings, pruned hard.
fn trees() -> EngineConfig {
    EngineConfig {
        adaptive: false,
        max_draft: 8,
        max_branches: 4,
        vocab: None,
        ..Default::default()
    }
}

fn aggressive() -> PruneConfig {
    PruneConfig {
        threshold: 0.6,
        root_children: 1,
        backbone_floor: 0.5,
        measure_only: false,
    }
}

fn pruned_output_is_plain_greedy(name: &str) {
    assert!(kernels());
    let m = model(name);
    let mut pc = context(name, 2048, 1);
    let (mut ec, device, mut engine) = pruning_engine(&m, head(name), trees(), aggressive());
    let (mut verify, mut after, mut output) = (0, 0, 0);
    for p in PROMPTS {
        let toks = m.tokenize(p, true, false).unwrap();
        let want = plain_greedy(&mut pc, &toks, 40);
        let got = leap_tests::leap_greedy(&mut engine, &mut ec, &toks, 40);
        assert_eq!(got.tokens, want.tokens, "{name}: {p:?}");
        verify += got.verify_rows;
        after += got.rows_after_exit;
        output += got.output_rows;
        assert!(got.drafted_tokens > 0, "{name}: nothing drafted for {p:?}");
    }
    assert!(
        after < verify,
        "{name}: nothing pruned ({after} of {verify})"
    );
    assert!(output <= verify, "{name}");
    // The device skipped rows of the later layers' products (counted for this context).
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert!(
            device.skipped_rows() > 0,
            "{name}: the device computed every row"
        );
    }
}

#[test]
fn pruned_output_is_plain_greedy_on_smollm() {
    pruned_output_is_plain_greedy(SMOLLM);
}

#[test]
fn pruned_output_is_plain_greedy_on_gemma() {
    pruned_output_is_plain_greedy(GEMMA);
}

/// Sampling through pruned trees: the first two tokens follow the target's joint
/// distribution (a pruned tree is just another draft tree for multi-round rejection).
#[test]
fn pruned_sampled_output_follows_the_target_distribution() {
    assert!(kernels());
    let m = model(SMOLLM);
    let toks = m.tokenize(SAMPLED_PROMPT, true, false).unwrap();
    let params = sampled_params;
    let cfg = EngineConfig {
        history_tokens: 0,
        reuse_lifetime: 0,
        calibrate: false,
        ..trees()
    };
    let (mut c, _device, mut engine) = pruning_engine(&m, head(SMOLLM), cfg, aggressive());
    let runs: Vec<_> = (0..300)
        .map(|seed| {
            engine
                .generate_with(&mut c, &toks, 6, 512, &params(seed), &mut |_| true)
                .unwrap()
        })
        .collect();
    let pruned: u64 = runs.iter().map(|g| g.verify_rows - g.rows_after_exit).sum();
    assert!(pruned > 0, "no row was pruned");
    let pairs: Vec<(i32, i32)> = runs.iter().map(|g| (g.tokens[0], g.tokens[1])).collect();
    let mut plain_ctx = context(SMOLLM, 2048, 1);
    leap_tests::assert_pairs_follow_the_target(&mut plain_ctx, &toks, &params(0), &pairs);
}

#[test]
fn a_head_for_another_model_or_a_corrupt_sidecar_is_refused() {
    // SmolLM2's head next to Gemma.
    let why = leap_cli::heads::head_for(&model(GEMMA), Some(&sidecar(SMOLLM)))
        .expect_err("a head trained on SmolLM2 is refused for Gemma");
    assert!(why.contains("another model"), "{why}");
    // Not a GGUF file.
    let bad = scratch().join("corrupt.leap.gguf");
    std::fs::write(&bad, b"GGUF but not really: half a header").unwrap();
    let why = leap_cli::heads::head_for(&model(GEMMA), Some(&bad)).expect_err("refused");
    assert!(why.contains("corrupt.leap.gguf"), "{why}");
    // A head whose matrix lost values.
    let mut side = leap_host::sidecar::Sidecar::load(&sidecar(GEMMA))
        .unwrap()
        .unwrap();
    let a = side.f32s(leap_spec::exit::keys::A).unwrap().to_vec();
    side.set(
        leap_spec::exit::keys::A,
        leap_host::sidecar::Value::F32s(a[..a.len() - 1].to_vec()),
    );
    let cut = scratch().join("cut.leap.gguf");
    side.save(&cut).unwrap();
    let why = leap_cli::heads::head_for(&model(GEMMA), Some(&cut)).expect_err("refused");
    assert!(why.contains("leap.exit.a"), "{why}");
    // Without a sidecar there is no head and nothing to say; an explicit missing one is said.
    assert!(leap_cli::heads::head_for(&model(GEMMA), Some(&scratch().join("none.gguf"))).is_err());
}

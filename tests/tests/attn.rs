//! Sparse attention through Leap's ggml device on a real model: the device takes llama.cpp's
//! flash-attention nodes and K cache writes, its dense path agrees with ggml's flash
//! attention, and its sparse path keeps the budget and the model's predictions.
//!
//! Each context's device has its own settings and counts (`leap_backend::Device`).

use leap_backend::attn::Sparse;
use leap_backend::{Device, DeviceConfig};
use leap_host::{Context, ContextParams, FlashAttn};
use leap_spec::plain::argmax;
use leap_tests::{greedy_logits, max_abs_diff, model, threads, SMOLLM};

/// A fixed text (tests/data), repeated past the contexts below: the outcome must not depend on
/// the repository's sources changing.
fn text() -> String {
    include_str!("../data/attention-notes.txt").repeat(3)
}

/// A device with sparse attention `sparse` (or none).
fn device(sparse: Option<Sparse>) -> Device {
    Device::new(DeviceConfig {
        sparse,
        ..DeviceConfig::default()
    })
}

/// [`greedy_logits`] with flash attention, in a context on `device`.
fn run(device: &Device, prompt: &[i32], steps: usize) -> Vec<Vec<f32>> {
    device.bind(|| greedy_logits(SMOLLM, prompt, steps, FlashAttn::On))
}

#[test]
fn sparse_attention_on_smollm2() {
    leap_tests::kernels();
    let m = model(SMOLLM);
    let prompt: Vec<i32> = m.tokenize(&text(), true, false).unwrap()[..1500].to_vec();
    let steps = 8;

    let off = device(None);
    let dense = run(&off, &prompt, steps);
    // ggml's two attention paths (flash attention converts queries to f16 and accumulates
    // values in f16) differ this much from each other: the yardstick for the device's.
    let nofa = greedy_logits(SMOLLM, &prompt, steps, FlashAttn::Off);
    let ggml_spread = dense
        .iter()
        .zip(&nofa)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f32::max);
    assert_eq!(off.attn_stats().nodes, 0, "off: ggml computes attention");

    // keep = 1: every visible key, through the device's own path (f32 queries, f32 sums):
    // within twice the distance between ggml's two attention paths (which round queries and
    // sums to f16 in different places); a wrong head or key moves logits by several units and
    // changes the predictions.
    let keep_all = device(Some(Sparse {
        keep: 1.0,
        ..Sparse::default()
    }));
    let all = run(&keep_all, &prompt, steps);
    let st = keep_all.attn_stats();
    assert!(st.nodes > 0, "the device took the attention nodes");
    assert_eq!(st.sparse_rows, 0, "keep = 1 is dense");
    for (s, (a, b)) in dense.iter().zip(&all).enumerate() {
        let d = max_abs_diff(a, b);
        eprintln!("step {s}: device dense vs ggml: {d} (ggml's paths: {ggml_spread})");
        assert!(
            d <= 2.0 * ggml_spread.max(0.5),
            "step {s}: dense paths differ by {d}"
        );
        assert_eq!(argmax(a), argmax(b), "step {s}");
    }

    // keep = 0.2: a fifth of the keys (plus sinks and the recent window) per query that
    // sees 512 keys or more.
    let fifth = device(Some(Sparse {
        min_keys: 512,
        ..Sparse::default()
    }));
    let sparse = run(&fifth, &prompt, steps);
    let st = fifth.attn_stats();
    let (rows, visible, kept) = (st.sparse_rows, st.keys_visible, st.keys_kept);
    assert!(rows > 0, "long queries attend sparsely");
    let ratio = kept as f64 / visible as f64;
    eprintln!("sparse: {rows} query-heads, kept {kept} of {visible} keys ({ratio:.3})");
    assert!(ratio < 0.5, "kept {ratio:.3} of the keys");
    let agree = dense
        .iter()
        .zip(&sparse)
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let worst = dense
        .iter()
        .zip(&sparse)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f32::max);
    eprintln!(
        "sparse vs dense: top-1 agrees at {agree} of {} steps, max |dlogit| {worst}",
        steps + 1
    );
    assert!(
        agree >= steps,
        "sparse attention changed the model's predictions"
    );

    // Under sparse attention Leap's engine still decodes plain decoding's tokens: the device
    // computes each row of a verification batch as it computes a row decoded alone.
    let p = ContextParams {
        n_ctx: 2048,
        n_batch: 2048,
        n_seq_max: 8,
        n_threads: threads(),
        n_threads_batch: threads(),
        flash_attn: FlashAttn::On,
        ..Default::default()
    };
    let single = ContextParams {
        n_seq_max: 1,
        ..p.clone()
    };
    let mut pc = fifth.bind(|| Context::new(&m, &single)).unwrap();
    let want = leap_tests::plain_greedy(&mut pc, &prompt, 40);
    let (mut ec, od) = fifth
        .bind(|| leap_host::project::OnDemand::context(&m, &p))
        .unwrap();
    let mut engine = leap_spec::engine::Engine::new(leap_spec::engine::EngineConfig {
        adaptive: false,
        max_draft: 8,
        vocab: None,
        ..Default::default()
    })
    .with_on_demand(od);
    let got = leap_tests::leap_greedy(&mut engine, &mut ec, &prompt, 40);
    eprintln!(
        "sparse: engine {} tokens in {} target calls ({} drafted)",
        got.tokens.len(),
        got.target_calls,
        got.drafted_tokens
    );
    assert_eq!(
        got.tokens, want.tokens,
        "speculative decoding under sparse attention"
    );
    assert!(
        got.target_calls < got.tokens.len() as u64,
        "speculation verified batches"
    );
}

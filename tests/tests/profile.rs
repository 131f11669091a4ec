//! `leap profile-heads` on SmolLM2: per-head importances measured by ablation land in a
//! sidecar GGUF that sparse attention then loads. Its own test binary: profiling switches
//! process-wide device settings (every attention node on the device, heads zeroed).

use leap_cli::attn::{keys, profile_heads, with_sidecar_at, ProfileHeads};
use leap_host::sidecar::Sidecar;
use leap_tests::{threads, SMOLLM};

#[test]
fn profile_heads_writes_a_sidecar_sparse_attention_uses() {
    leap_tests::kernels();
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        [leap_tests::NOTES, leap_tests::CODE_SAMPLE].concat(),
    )
    .unwrap();
    let out = dir.path().join("smol.leap.gguf");
    // A sidecar with someone else's key: profiling must keep it.
    let mut other = Sidecar::default();
    other.set("leap.other.key", leap_host::sidecar::Value::U32(7));
    other.save(&out).unwrap();
    let written = profile_heads(&ProfileHeads {
        model: SMOLLM.into(),
        corpus,
        ctx: 256,
        tail: 16,
        windows: 1,
        keep: 0.2,
        out: Some(out.clone()),
        threads: threads(),
    })
    .expect("profile-heads");
    assert_eq!(written, out);
    let side = Sidecar::load(&out).unwrap().expect("sidecar written");
    assert_eq!(side.u32("leap.other.key"), Some(7), "other keys kept");
    let (nl, nh) = (
        side.u32(keys::N_LAYER).unwrap() as usize,
        side.u32(keys::N_HEAD).unwrap() as usize,
    );
    assert_eq!((nl, nh), (30, 9), "SmolLM2-135M: 30 layers of 9 heads");
    let keep = side.f32s(keys::KEEP).unwrap();
    let head_imp = side.f32s(keys::HEAD_IMPORTANCE).unwrap();
    let layer_imp = side.f32s(keys::LAYER_IMPORTANCE).unwrap();
    assert_eq!(
        (keep.len(), head_imp.len(), layer_imp.len()),
        (nl * nh, nl * nh, nl)
    );
    let mean = keep.iter().sum::<f32>() / keep.len() as f32;
    assert!(
        (mean - 0.2).abs() < 1e-3,
        "budgets average the global keep: {mean}"
    );
    // Removing a whole layer's attention costs the model something on average; heads differ.
    assert!(layer_imp.iter().sum::<f32>() > 0.0, "{layer_imp:?}");
    let (lo, hi) = keep
        .iter()
        .fold((1f32, 0f32), |(l, h), &k| (l.min(k), h.max(k)));
    assert!(hi > 2.0 * lo, "per-head budgets are uneven: {lo}..{hi}");

    let s = with_sidecar_at(leap_backend::attn::Sparse::default(), &out).unwrap();
    let heads = s.heads.clone().expect("the profile is used");
    assert_eq!(heads.layers.len(), nl);
    assert_eq!(heads.layers[3][4], keep[3 * nh + 4]);
    assert_eq!(s.keep_for(Some(3), 4), keep[3 * nh + 4]);
}

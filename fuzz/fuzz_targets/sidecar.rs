//! The sidecar reader (`MODEL.leap.gguf`, parsed by ggml's own gguf code), then what Leap does
//! with a sidecar it has read: the early-exit head and the attention profile checked, and a
//! tool's load-update-save, which must keep every value.
#![no_main]

use leap_host::sidecar::{Sidecar, Value};
use leap_spec::exit::{self, keys, ModelShape};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = leap_fuzz::scratch("m.leap.gguf", data);
    let Ok(Some(side)) = Sidecar::load(&path) else {
        return;
    };

    // The head, checked against the model it names, so that the checks after the model's
    // identity run too.
    let shape = ModelShape {
        fingerprint: match side.get(keys::MODEL) {
            Some(Value::Str(s)) => s.clone(),
            _ => String::new(),
        },
        n_embd: side.u32(keys::N_EMBD).unwrap_or(0) as usize,
        n_layer: side.u32(keys::N_LAYER).unwrap_or(0),
        n_vocab: 262_144,
    };
    if let Ok(Some(head)) = exit::load(&side, &shape) {
        // The exit layer is one the model computes after, with the layers after it to prune.
        assert!(u64::from(head.layer) + 1 < u64::from(shape.n_layer));
        assert_eq!(head.a.len(), head.n_embd * head.n_embd);
    }

    // The per-head attention budgets.
    let sparse = leap_cli::attn::sparse_config(0.5).expect("0.5 is a fraction");
    if let Ok(s) = leap_cli::attn::with_sidecar_at(sparse, &path) {
        if let Some(h) = &s.heads {
            assert!(h.layers.iter().flatten().all(|k| !(*k > 1.0 || *k < 0.0)));
        }
    }

    // `leap profile-heads` / `leap train-heads`: load, set a key, save.
    let mut updated = side.clone();
    updated.set("leap.fuzz.touched", Value::U32(1));
    let out = leap_fuzz::scratch_path("saved.leap.gguf");
    if updated.save(&out).is_ok() {
        let back = Sidecar::load(&out)
            .expect("a sidecar Leap saved reads back")
            .expect("the saved sidecar exists");
        for (k, v) in &updated.kv {
            if k == "leap.sidecar.version" {
                continue;
            }
            let got = back.get(k);
            assert!(
                got.is_some_and(|g| same(g, v)),
                "{k}: saved {v:?}, read back {got:?}"
            );
        }
    }
});

/// Equal, floats bit for bit (a NaN read back is the NaN saved).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F32s(x), Value::F32s(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits())
        }
        _ => a == b,
    }
}

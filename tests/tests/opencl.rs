//! The `leap-opencl` device on PoCL (`make test` installs it; `LEAP_SKIP_OPENCL=1` skips):
//! registered in ggml's registry, it takes llama.cpp's attention nodes when sparse attention's
//! estimate is asked to run on OpenCL, and decodes what the CPU estimate decodes.
//!
//! Its own test binary: the device list and sparse attention are process-wide.

use leap_backend::attn::{self, EstimateOn, Sparse};
use leap_host::{Batch, Context, ContextParams, FlashAttn};
use leap_spec::plain::argmax;
use leap_tests::{model, threads, SMOLLM};

fn logits_after(prompt: &[i32], steps: usize) -> Vec<Vec<f32>> {
    let p = ContextParams {
        n_ctx: 2048,
        n_batch: 2048,
        n_threads: threads(),
        n_threads_batch: threads(),
        flash_attn: FlashAttn::On,
        ..Default::default()
    };
    let mut c = Context::new(&model(SMOLLM), &p).expect("context");
    let mut b = Batch::new(prompt.len(), 1);
    b.add_sequence(prompt, 0, 0, true).unwrap();
    c.decode(&b).unwrap();
    let mut out = vec![c.logits(-1).unwrap().to_vec()];
    for s in 0..steps {
        let t = argmax(out.last().unwrap());
        let mut b = Batch::new(1, 1);
        b.add(t, (prompt.len() + s) as i32, &[0], true).unwrap();
        c.decode(&b).unwrap();
        out.push(c.logits(-1).unwrap().to_vec());
    }
    out
}

#[test]
fn opencl_estimate_decodes_like_the_cpu_estimate() {
    if std::env::var_os("LEAP_SKIP_OPENCL").is_some() {
        return;
    }
    leap_backend::want_opencl();
    leap_tests::kernels();
    assert!(
        leap_backend::opencl_registered(),
        "leap-opencl is not registered: {} (install PoCL: scripts/setup)",
        leap_backend::opencl_unavailable_reason()
    );
    let m = model(SMOLLM);
    let text = [
        include_str!("../../backend/src/attn.rs"),
        include_str!("../../host/src/qdot.rs"),
    ]
    .concat();
    let prompt: Vec<i32> = m.tokenize(&text, true, false).unwrap()[..1200].to_vec();
    // Prefill (1200 rows) stays with ggml in both runs: PoCL estimating it would take minutes
    // on these two cores, and the decode steps are what the comparison needs.
    let cfg = Sparse {
        min_keys: 512,
        max_rows: 16,
        ..Sparse::default()
    };

    attn::set_sparse(Some(cfg.clone()));
    let cpu = logits_after(&prompt, 4);
    let before = attn::opencl_calls();
    attn::set_sparse(Some(Sparse {
        estimate_on: EstimateOn::OpenCl,
        ..cfg
    }));
    let cl = logits_after(&prompt, 4);
    attn::set_sparse(None);
    assert!(
        attn::opencl_calls() > before,
        "the OpenCL device estimated the decode steps' attention"
    );
    for (s, (a, b)) in cpu.iter().zip(&cl).enumerate() {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        eprintln!("step {s}: CPU vs OpenCL estimate: max |dlogit| {d}");
        // Both estimates are f32 queries times the same int8 keys, summed in another order:
        // a near-tie at the cut may fall the other way, which the exact re-ranking settles.
        assert!(d < 0.5, "step {s}: {d}");
        assert_eq!(argmax(a), argmax(b), "step {s}");
    }
}

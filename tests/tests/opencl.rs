//! The `leap-opencl` device on PoCL (`make test` installs it; `LEAP_SKIP_OPENCL=1` skips):
//! registered in ggml's registry, it takes llama.cpp's attention nodes when sparse attention's
//! estimate is asked to run on OpenCL, and decodes what the CPU estimate decodes.
//!
//! Its own test binary: the device list and sparse attention are process-wide.

use leap_backend::attn::{self, EstimateOn, Sparse};
use leap_host::FlashAttn;
use leap_spec::plain::argmax;
use leap_tests::{greedy_logits, max_abs_diff, model, SMOLLM};

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
    let prompt: Vec<i32> =
        m.tokenize(leap_tests::CODE_SAMPLE, true, false).unwrap()[..1200].to_vec();
    // Prefill (1200 rows) stays with ggml in both runs: PoCL estimating it would take minutes
    // on these two cores, and the decode steps are what the comparison needs.
    let cfg = Sparse {
        min_keys: 512,
        max_rows: 16,
        ..Sparse::default()
    };

    attn::set_sparse(Some(cfg.clone()));
    let cpu = greedy_logits(SMOLLM, &prompt, 4, FlashAttn::On);
    let before = attn::opencl_calls();
    attn::set_sparse(Some(Sparse {
        estimate_on: EstimateOn::OpenCl,
        ..cfg.clone()
    }));
    let cl = greedy_logits(SMOLLM, &prompt, 4, FlashAttn::On);
    // The head-wise pipeline (the device estimates the next head while the CPU attends this
    // one; on by default only for a GPU) decodes the same.
    attn::set_sparse(Some(Sparse {
        estimate_on: EstimateOn::OpenCl,
        pipeline: Some(true),
        ..cfg.clone()
    }));
    let piped = greedy_logits(SMOLLM, &prompt, 4, FlashAttn::On);
    attn::set_sparse(None);
    assert!(
        attn::opencl_calls() > before,
        "the OpenCL device estimated the decode steps' attention"
    );
    for (s, (a, b)) in cpu.iter().zip(&cl).enumerate() {
        let d = max_abs_diff(a, b);
        eprintln!("step {s}: CPU vs OpenCL estimate: max |dlogit| {d}");
        // Both estimates are f32 queries times the same int8 keys, summed in another order:
        // a near-tie at the cut may fall the other way, which the exact re-ranking settles.
        assert!(d < 0.5, "step {s}: {d}");
        assert_eq!(argmax(a), argmax(b), "step {s}");
    }
    assert_eq!(
        cl, piped,
        "pipelined or not, the same estimates and the same attention"
    );
}

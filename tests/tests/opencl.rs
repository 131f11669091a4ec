//! The `leap-opencl` device on PoCL (`make test` installs it; `LEAP_SKIP_OPENCL=1` skips):
//! registered in ggml's registry, it takes llama.cpp's attention nodes when sparse attention's
//! estimate is asked to run on OpenCL, and decodes what the CPU estimate decodes.
//!
//! Its own test binary: the device list is process-wide.

use leap_backend::attn::{self, EstimateOn, Sparse};
use leap_backend::{Device, DeviceConfig};
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

    // Greedy logits in a context whose device has these sparse settings.
    let logits = |s: Sparse| {
        let device = Device::new(DeviceConfig {
            sparse: Some(s),
            ..DeviceConfig::default()
        });
        device.bind(|| greedy_logits(SMOLLM, &prompt, 4, FlashAttn::On))
    };
    let cpu = logits(cfg.clone());
    let before = attn::opencl_calls();
    let cl = logits(Sparse {
        estimate_on: EstimateOn::OpenCl,
        ..cfg.clone()
    });
    // The head-wise pipeline (the device estimates the next head while the CPU attends this
    // one; on by default only for a GPU) decodes the same.
    let piped = logits(Sparse {
        estimate_on: EstimateOn::OpenCl,
        pipeline: Some(true),
        ..cfg.clone()
    });
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

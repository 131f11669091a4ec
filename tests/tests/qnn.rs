//! The QNN device on Qualcomm's real x86-64 `libQnnHtp.so` (the HTP emulator from the
//! `onnxruntime-qnn` 2.7.0 wheel, which `scripts/setup` fetches through `scripts/fetch-qnn`).
//! Tests that need the library are `#[ignore]`d with that reason, so a plain `cargo test` runs
//! only the error-path tests, which need none; `make test` fetches the library and runs the
//! others with `--ignored`, where a missing library fails them.
//!
//! Its own test binary: the QNN library and its emulator threads are process-wide.

use leap_ggml_qnn::library::{self, Api};
use leap_ggml_qnn::ops::{self, Lcg};
use leap_ggml_qnn::tensor::{f32_bytes, f32_bytes_mut};
use leap_ggml_qnn::{Backend, Context, Device, Error, Status};
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The library, loaded once per test binary; a test that needs it fails without it.
fn api() -> Arc<Api> {
    static API: OnceLock<Arc<Api>> = OnceLock::new();
    API.get_or_init(|| match Api::load(None) {
        Ok(api) => api,
        Err(Error::LibraryNotFound { dirs, .. }) => panic!(
            "no libQnnHtp.so in {dirs:?}: run scripts/fetch-qnn (make test does) or set {}",
            library::LIB_DIR_ENV
        ),
        Err(e) => panic!("the QNN library is present but unusable: {e}"),
    })
    .clone()
}

/// A shared library that is not QNN's, to stand in for a wrong one.
fn libm() -> &'static str {
    [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib/aarch64-linux-gnu/libm.so.6",
        "/usr/lib/aarch64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).is_file())
    .expect("a libm.so.6 to stand in for a non-QNN library")
}

fn context(api: &Arc<Api>) -> (Device, Context) {
    let backend = Backend::new(api.clone()).expect("backendCreate");
    let device = Device::new(&backend, None).expect("deviceCreate");
    let ctx = Context::new(&device).expect("contextCreate");
    (device, ctx)
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn provider_and_versions_are_the_wheels() {
    let api = api();
    assert_eq!(api.backend_id, library::BACKEND_ID_HTP);
    assert_eq!(api.provider, "HTP_QTI_AISW");
    assert_eq!(api.core_api.major, 2);
    assert!(api.core_api.minor >= library::CORE_API_MIN_MINOR);
    assert!(
        api.system.is_some(),
        "libQnnSystem.so loads next to libQnnHtp.so"
    );
    eprintln!(
        "{} core {} backend {} build {:?}",
        api.provider,
        api.core_api,
        api.backend_api,
        api.build_id()
    );
}

/// Tests that decode a model: sparse attention's settings and its capture are process-wide.
static MODEL_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn model_lock() -> std::sync::MutexGuard<'static, ()> {
    MODEL_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `leap qnn-selftest` (with `--capture MODEL` if given) at context 1024, and its report.
fn selftest(capture: Option<&str>) -> serde_json::Value {
    let _one = capture.map(|_| model_lock());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    leap_cli::qnn::qnn_selftest(&leap_cli::qnn::QnnSelftestArgs {
        lib_dir: None,
        out: out.clone(),
        graph_dir: Some(dir.path().join("graphs")),
        capture: capture.map(Into::into),
        text: concat!(env!("CARGO_MANIFEST_DIR"), "/data/attention-notes.txt").into(),
        ctx: 1024,
    })
    .expect("qnn-selftest passes");
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn selftest_report_has_every_field_and_passes() {
    api();
    let r = selftest(None);
    for key in [
        "provider",
        "core_api",
        "backend_api",
        "ops",
        "estimation_recall",
        "finalize_ms",
        "context_binary",
        "schedule",
    ] {
        assert!(r.get(key).is_some(), "report lacks {key}: {r}");
    }
    assert_eq!(r["provider"], "HTP_QTI_AISW");
    let ops = r["ops"].as_array().unwrap();
    assert!(ops.len() >= 3);
    for op in ops {
        for key in ["op", "shape", "dtype", "max_abs_err", "ok"] {
            assert!(op.get(key).is_some(), "op lacks {key}: {op}");
        }
        assert_eq!(op["ok"], true, "{op}");
    }
    assert_eq!(
        r["context_binary"]["saved"], true,
        "{}",
        r["context_binary"]
    );
    assert_eq!(r["context_binary"]["identical"], true);
    assert!(r["context_binary"]["reload_ms"].as_f64().unwrap() > 0.0);
    assert!(r["schedule"].get("sync_ms").is_some());
    let recall = r["estimation_recall"].as_f64().unwrap();
    assert!(recall >= 0.9, "int8 estimate recall@20% {recall}");
    eprintln!("{}", serde_json::to_string_pretty(&r).unwrap());
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn undersized_buffers_are_refused_before_qnn_sees_them() {
    let api = api();
    let (_device, ctx) = context(&api);
    let w = Lcg(3).vec(16 * 8, 1.0);
    let (g, _) = ops::matmul_f32(&ctx, "short_buffers", (2, 16, 8), &w).unwrap();
    let x = vec![0.5f32; 2 * 16];
    let mut y = vec![0f32; 2 * 8];
    // One element short on either side would crash the process inside graphExecute.
    let err = g
        .execute(&[f32_bytes(&x[1..])], &mut [f32_bytes_mut(&mut y)])
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferSize {
                expected: 128,
                got: 124,
                ..
            }
        ),
        "{err}"
    );
    let err = g
        .execute(&[f32_bytes(&x)], &mut [f32_bytes_mut(&mut y[1..])])
        .unwrap_err();
    assert!(matches!(err, Error::BufferSize { .. }), "{err}");
    let err = g.execute(&[], &mut [f32_bytes_mut(&mut y)]).unwrap_err();
    assert!(matches!(err, Error::TensorCount { .. }), "{err}");
    // The right sizes run and match the reference.
    g.execute(&[f32_bytes(&x)], &mut [f32_bytes_mut(&mut y)])
        .unwrap();
    let want = ops::matmul_ref(&x, &w, (2, 16, 8));
    assert!(ops::max_abs_err(&y, &want) < 1e-4);
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn qnn_failures_are_typed_statuses() {
    let api = api();
    let (device, ctx) = context(&api);
    // A duplicate graph name.
    let w = vec![0f32; 4];
    let _first = ops::matmul_f32(&ctx, "dup", (1, 2, 2), &w).unwrap();
    let err = ctx.graph("dup").err().expect("duplicate name refused");
    assert!(
        matches!(
            err,
            Error::Status {
                call: "graphCreate",
                status: Status(6003)
            }
        ),
        "{err}"
    );
    // An op the backend does not know is caught by validation, before graphAddNode.
    let mut g = ctx.graph("bad_op").unwrap();
    let t = leap_ggml_qnn::TensorSpec::new(
        "x",
        leap_ggml_qnn::Role::Input,
        leap_ggml_qnn::DataType::F32,
        &[1, 2],
    );
    let x = g.tensor(t, None).unwrap();
    let err = g.node("n", "NoSuchOp", &[], &[x], &[x]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Status {
                call: "backendValidateOpConfig",
                ..
            }
        ),
        "{err}"
    );
    // A corrupted context binary.
    let err = Context::from_binary(&device, &[0x5a; 4096])
        .err()
        .expect("garbage refused");
    assert!(
        matches!(
            err,
            Error::Status {
                call: "contextCreateFromBinary",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn missing_library_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = Api::load(Some(dir.path())).unwrap_err();
    assert!(
        matches!(err, Error::LibraryNotFound { ref file, .. } if file == "libQnnHtp.so"),
        "{err}"
    );
    assert!(err.to_string().contains("scripts/fetch-qnn"), "{err}");
}

/// Build a fake `libQnnHtp.so` whose one provider reports core API `major.minor`.
fn fake_library(dir: &Path, major: u32, minor: u32) -> bool {
    let src = dir.join("fake.c");
    std::fs::write(
        &src,
        format!(
            r#"#include <stdint.h>
typedef struct {{ uint32_t major, minor, patch; }} V;
typedef struct {{ uint32_t id; const char* name; V core; V backend; void* fns[64]; }} I;
static I iface = {{ 6, "FAKE_QTI_AISW", {{ {major}, {minor}, 0 }}, {{ 1, 0, 0 }}, {{ 0 }} }};
static const I* list[1] = {{ &iface }};
uint64_t QnnInterface_getProviders(const I*** out, uint32_t* n) {{ *out = list; *n = 1; return 0; }}
"#
        ),
    )
    .unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    std::process::Command::new(cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libQnnHtp.so"))
        .arg(&src)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn wrong_api_version_is_refused_with_a_typed_error() {
    for (major, minor) in [(1, 9), (2, 3), (3, 0)] {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            fake_library(dir.path(), major, minor),
            "no C compiler (cc, or $CC) to build a fake QNN library"
        );
        let err = Api::load(Some(dir.path())).unwrap_err();
        match &err {
            Error::UnsupportedApi {
                provider, found, ..
            } => {
                assert_eq!(provider, "FAKE_QTI_AISW");
                assert_eq!((found.major, found.minor), (major, minor));
            }
            other => panic!("{major}.{minor}: expected UnsupportedApi, got {other}"),
        }
        assert!(
            err.to_string().contains("Leap supports 2.x from 2.14"),
            "{err}"
        );
    }
}

#[test]
fn a_library_that_is_not_qnn_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let libm = libm();
    std::fs::copy(libm, dir.path().join("libQnnHtp.so")).unwrap();
    let err = Api::load(Some(dir.path())).unwrap_err();
    assert!(matches!(err, Error::NotQnn { .. }), "{err}");
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn a_soc_device_config_gives_phone_numerics() {
    let api = api();
    // The emulator keeps the SoC model process-wide (measured: with a SoC-57 device alive,
    // another test's default-device f32 MatMul came out in fp16 and this graph's execute
    // failed with 1100), so this runs in a child process of its own.
    const CHILD: &str = "LEAP_QNN_SOC_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_soc_device_config_gives_phone_numerics",
                "--include-ignored",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    // SM8650 (57): the emulator then computes f32 graphs in fp16 as the phone's HTP does. With
    // the custom-config union at the wrong offset this fails with 14001 (probe §2).
    let backend = Backend::new(api.clone()).unwrap();
    let device = Device::new(&backend, Some(57)).expect("deviceCreate with SoC 57");
    let ctx = Context::new(&device).unwrap();
    let (m, k, n) = (4u32, 64u32, 64u32);
    let mut rng = Lcg(9);
    let x = rng.vec((m * k) as usize, 1.0);
    let w = rng.vec((k * n) as usize, 1.0);
    let (g, _) = ops::matmul_f32(&ctx, "soc57", (m, k, n), &w).unwrap();
    let mut y = vec![0f32; (m * n) as usize];
    g.execute(&[f32_bytes(&x)], &mut [f32_bytes_mut(&mut y)])
        .unwrap();
    let want = ops::matmul_ref(&x, &w, (m as usize, k as usize, n as usize));
    let err = ops::max_abs_err(&y, &want);
    let top = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    eprintln!("SoC 57 f32 MatMul: max abs err {err:.2e} at |y| <= {top:.2}");
    assert!(err > 1e-5, "fp16 numerics expected, got exact f32 ({err})");
    assert!(err < 3e-3 * top.max(1.0), "{err}");
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn estimate_recall_on_gemma_queries_and_keys() {
    api();
    leap_tests::model_path(leap_tests::GEMMA);
    let r = selftest(Some(leap_tests::GEMMA));
    let recall = r["estimation_recall"].as_f64().unwrap();
    let kept = r["estimation_recall_kept"].as_f64().unwrap();
    eprintln!(
        "Gemma 3 270M, ctx 1024, full-attention layers: recall@20% of the estimate alone \
         {recall:.4}, of the kept set {kept:.4} (simulated {}, 16-bit keys {}, per-head \
         buckets {}, without smoothing {}); {}",
        r["estimation_recall_simulated"],
        r["estimation_recall_key16"],
        r["estimation_recall_buckets"],
        r["estimation_recall_unsmoothed"],
        r["estimation_data"]
    );
    for op in r["ops"].as_array().unwrap() {
        assert_eq!(op["ok"], true, "{op}");
    }
    assert!(recall >= 0.99, "estimate alone: {recall}");
    assert!(kept >= 0.995, "kept set: {kept}");
}

/// The first 1280 tokens of a text, as Gemma tokens.
fn gemma_prompt() -> Vec<i32> {
    let m = leap_tests::model(leap_tests::GEMMA);
    m.tokenize(leap_tests::CODE_SAMPLE, true, false).unwrap()[..1280].to_vec()
}

/// Prefill `prompt` in a Gemma context as [`leap_tests::greedy_logits`] makes it (flash
/// attention, sparse attention off) and capture the attention nodes of the first greedy
/// decode step.
fn capture_gemma(prompt: &[i32]) -> Vec<leap_backend::attn::Captured> {
    use leap_host::{Batch, ContextParams, FlashAttn};
    let m = leap_tests::model(leap_tests::GEMMA);
    let device = leap_backend::Device::new(leap_backend::DeviceConfig::default());
    let p = ContextParams {
        n_batch: 2048,
        flash_attn: FlashAttn::On,
        ..leap_tests::params(2048, 1)
    };
    let mut ctx = device.bind(|| leap_host::Context::new(&m, &p)).unwrap();
    let mut b = Batch::new(prompt.len(), 1);
    b.add_sequence(prompt, 0, 0, true).unwrap();
    ctx.decode(&b).unwrap();
    let t = leap_spec::plain::argmax(ctx.logits(-1).unwrap());
    device.start_capture();
    let mut b = Batch::new(1, 1);
    b.add(t, prompt.len() as i32, &[0], true).unwrap();
    let r = ctx.decode(&b);
    let nodes = device.take_capture();
    r.unwrap();
    nodes
}

#[test]
#[ignore = "needs libQnnHtp.so: scripts/fetch-qnn, then --ignored (make test runs them)"]
fn sparse_decode_step_estimates_on_qnn_like_the_cpu() {
    use leap_backend::attn::{self, Sparse};
    api();
    let _one = model_lock();
    let prompt = gemma_prompt();
    let nodes = capture_gemma(&prompt);
    // The full-attention layers: their decode row sees every key (the sliding-window layers'
    // see 512), so it attends sparsely.
    let full: Vec<_> = nodes
        .iter()
        .filter(|c| {
            c.n_q == 1
                && c.mask[..c.n_kv]
                    .iter()
                    .filter(|&&x| leap_backend::f16::to_f32(x).is_finite())
                    .count()
                    == prompt.len() + 1
        })
        .collect();
    assert_eq!(full.len(), 3, "Gemma 3 270M has 3 full-attention layers");
    let threads = leap_tests::threads() as usize;
    let (mut same, mut total, mut worst) = (0usize, 0usize, 0f32);
    for c in full {
        let (_buf, k8) = c.shadow();
        let keep = vec![0.2f32; c.n_head];
        let run = |qnn: bool| {
            let cfg = Sparse {
                qnn: Some(qnn),
                ..Sparse::default()
            };
            let mut dst = vec![0f32; c.n_q * c.n_head * c.dv];
            let mut chosen = Vec::new();
            let before = attn::qnn_calls();
            // SAFETY: the operands and the shadow are copies that live through the call.
            let st = unsafe {
                attn::compute(
                    &c.operands(&mut dst),
                    Some(&k8),
                    &cfg,
                    &keep,
                    threads,
                    Some(&mut chosen),
                )
            };
            (dst, chosen, st, attn::qnn_calls() - before)
        };
        let (cpu, cpu_kept, cpu_st, cpu_calls) = run(false);
        let (npu, npu_kept, npu_st, npu_calls) = run(true);
        assert_eq!(cpu_calls, 0);
        // One launch per KV head of the decode row.
        assert_eq!(npu_calls, c.n_head_kv as u64, "layer {}", c.layer);
        assert_eq!(cpu_st.sparse_rows, c.n_head as u64);
        assert_eq!(cpu_st.keys_kept, npu_st.keys_kept, "the same budgets");
        for (a, b) in cpu_kept.iter().zip(&npu_kept) {
            total += a.len();
            same += b.iter().filter(|j| a.binary_search(j).is_ok()).count();
        }
        let top = cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = ops::max_abs_err(&cpu, &npu);
        eprintln!(
            "layer {}: QNN launches {npu_calls}, max |out diff| {err:.2e} (|out| <= {top:.2})",
            c.layer
        );
        worst = worst.max(err / top.max(1e-6));
    }
    let agree = same as f64 / total as f64;
    eprintln!("kept keys: QNN and CPU estimates agree on {agree:.4}; worst relative output diff {worst:.2e}");
    // Both kept sets are re-ranked by exact scores, so they differ only where a key near the
    // cut was outside one estimate's candidates; with the same keys the outputs differ only
    // by the order of the sums.
    assert!(agree >= 0.995, "{agree}");
    assert!(worst < 5e-3, "{worst}");

    // The same through llama.cpp: decode steps of a Gemma context with sparse attention (the
    // prompt's prefill, 1280 rows, stays with ggml: on the emulator it would take minutes).
    let cfg = Sparse {
        max_rows: 16,
        ..Sparse::default()
    };
    let steps = 2;
    let decode = |qnn: Option<bool>| {
        let device = leap_backend::Device::new(leap_backend::DeviceConfig {
            sparse: qnn.map(|on| Sparse {
                qnn: Some(on),
                ..cfg.clone()
            }),
            ..Default::default()
        });
        let (calls, t) = (attn::qnn_calls(), std::time::Instant::now());
        let logits = device.bind(|| {
            leap_tests::greedy_logits(leap_tests::GEMMA, &prompt, steps, leap_host::FlashAttn::On)
        });
        (logits, attn::qnn_calls() - calls, t.elapsed().as_secs_f64())
    };
    let (dense, _, _) = decode(None);
    let (cpu, cpu_calls, cpu_s) = decode(Some(false));
    let (npu, npu_calls, npu_s) = decode(Some(true));
    eprintln!(
        "{steps} decode steps after a 1280-token prompt: CPU estimate {cpu_s:.1} s, QNN {npu_s:.1} s \
         ({npu_calls} launches; prefill included in both)"
    );
    assert_eq!(cpu_calls, 0);
    // Every decode step: one launch per full-attention layer (one KV head each).
    assert_eq!(npu_calls, 3 * steps as u64);
    for s in 1..=steps {
        let (d, d_cpu, d_npu) = (
            leap_tests::max_abs_diff(&cpu[s], &npu[s]),
            leap_tests::max_abs_diff(&cpu[s], &dense[s]),
            leap_tests::max_abs_diff(&npu[s], &dense[s]),
        );
        eprintln!(
            "step {s}: max |dlogit| CPU vs QNN estimate {d:.3}; sparse vs dense: CPU {d_cpu:.3}, QNN {d_npu:.3}"
        );
        // The two estimates may keep different keys where exact scores nearly tie at the cut;
        // that moves the logits less than sparse attention itself does (compared while dense
        // decoding has fed the same tokens).
        if (1..s).all(|p| leap_spec::plain::argmax(&dense[p]) == leap_spec::plain::argmax(&cpu[p]))
        {
            assert!(d <= d_cpu.max(d_npu), "step {s}: {d} vs {d_cpu} / {d_npu}");
        }
        assert_eq!(
            leap_spec::plain::argmax(&cpu[s]),
            leap_spec::plain::argmax(&npu[s]),
            "step {s}"
        );
    }
}

/// With `LEAP_QNN=on` and a library that is not QNN in `LEAP_QNN_LIB_DIR`, sparse attention
/// warns and decodes on the CPU estimate, as it does with QNN off. Runs in a child process: the
/// QNN state and the logger are process-wide.
#[test]
fn a_wrong_qnn_library_warns_and_decoding_carries_on() {
    use leap_backend::attn::{self, Sparse};
    const CHILD: &str = "LEAP_QNN_WRONG_LIB_CHILD";
    let libm = libm();
    if std::env::var_os(CHILD).is_none() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(libm, dir.path().join("libQnnHtp.so")).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_wrong_qnn_library_warns_and_decoding_carries_on",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env("LEAP_QNN", "on")
            .env(library::LIB_DIR_ENV, dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    struct Warnings;
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    impl log::Log for Warnings {
        fn enabled(&self, m: &log::Metadata) -> bool {
            m.level() <= log::Level::Warn
        }
        fn log(&self, r: &log::Record) {
            if self.enabled(r.metadata()) {
                SEEN.lock().unwrap().push(r.args().to_string());
            }
        }
        fn flush(&self) {}
    }
    log::set_logger(&Warnings).unwrap();
    log::set_max_level(log::LevelFilter::Warn);
    let m = leap_tests::model(leap_tests::SMOLLM);
    let prompt: Vec<i32> =
        m.tokenize(leap_tests::CODE_SAMPLE, true, false).unwrap()[..1100].to_vec();
    let cfg = Sparse {
        max_rows: 16,
        ..Sparse::default()
    };
    // The default for this process is on (LEAP_QNN=on): the library is tried here.
    let with_qnn_default = leap_backend::Device::new(leap_backend::DeviceConfig {
        sparse: Some(cfg.clone()),
        ..Default::default()
    });
    let warned = SEEN.lock().unwrap().clone();
    eprintln!("warnings: {warned:?}");
    assert!(
        warned
            .iter()
            .any(|w| w.contains("QNN unavailable") && w.contains("is not a QNN library")),
        "{warned:?}"
    );
    let with = with_qnn_default.bind(|| {
        leap_tests::greedy_logits(leap_tests::SMOLLM, &prompt, 2, leap_host::FlashAttn::On)
    });
    assert!(
        with_qnn_default.attn_stats().sparse_rows > 0,
        "decode steps attended sparsely"
    );
    assert_eq!(attn::qnn_calls(), 0);
    let cpu_only = leap_backend::Device::new(leap_backend::DeviceConfig {
        sparse: Some(Sparse {
            qnn: Some(false),
            ..cfg
        }),
        ..Default::default()
    });
    let cpu = cpu_only.bind(|| {
        leap_tests::greedy_logits(leap_tests::SMOLLM, &prompt, 2, leap_host::FlashAttn::On)
    });
    assert_eq!(with, cpu, "the same CPU estimate either way");
}

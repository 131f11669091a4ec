//! Helpers for the tests on real models. `make test` fetches the models first; a test run
//! without them fails with the command that fetches them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use leap_host::{Model, ModelParams};

/// The default target, Gemma 3 270M Q4_K_M.
pub const GEMMA: &str = "gemma3-270m";
/// SmolLM2-135M-Instruct Q4_1.
pub const SMOLLM: &str = "smollm2-135m";

/// Holds the lock that makes the tests taking it in one test binary run one at a time (each
/// binary its own lock; a test that panicked does not poison it for the others). The callers
/// say why they need it.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// `../shared/workloads/dev-longtext.txt` (a long real document) tokenized for `m`, for the
/// diagnostics in `examples/`.
pub fn longtext_tokens(m: &Model) -> Vec<leap_host::Token> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/workloads/dev-longtext.txt"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    m.tokenize(&text, true, false).expect("tokenize")
}

/// target/release (or debug), where cargo puts the workspace's libraries (`libggml_leap.so`,
/// `libleap.so`) next to the test executables' `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// A library of the workspace in [`profile_dir`], asserted to be built (`package` names the
/// crate that builds it, for the message).
pub fn built_library(file: &str, package: &str) -> PathBuf {
    let p = profile_dir().join(file);
    assert!(
        p.exists(),
        "{} is missing: build it with `cargo build --release -p {package}` (`make test` does)",
        p.display()
    );
    p
}

/// Path of a fetched model.
pub fn model_path(name: &str) -> PathBuf {
    leap_cli::models::resolve(name).unwrap_or_else(|e| panic!("{e:#}\n(run `make models` first)"))
}

type Loaded = Mutex<Vec<(String, Arc<Model>)>>;

/// A model loaded once per test binary.
pub fn model(name: &str) -> Arc<Model> {
    static CACHE: OnceLock<Loaded> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap();
    if let Some((_, m)) = c.iter().find(|(n, _)| n == name) {
        return m.clone();
    }
    kernels();
    let m = Model::load(&model_path(name), &ModelParams::default()).expect("model loads");
    c.push((name.to_string(), m.clone()));
    m
}

/// Register Leap's ggml device for small-batch matrix products (as `leap` does by default),
/// so every test context verifies through it (contexts made outside `Device::bind` take the
/// device's default settings: on). Returns whether it is on.
pub fn kernels() -> bool {
    leap_backend::register();
    leap_backend::defaults().kernels
}

/// A directory for this test binary's files (sidecars written by the tests), removed when the
/// process exits normally.
pub fn scratch() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
        .to_path_buf()
}

/// Threads for tests: the machine's cores (2 in CI).
pub fn threads() -> i32 {
    std::thread::available_parallelism().map_or(2, |n| n.get() as i32)
}

/// Plain greedy decoding of up to `n` tokens after `prompt`.
pub fn plain_greedy(
    ctx: &mut leap_host::Context,
    prompt: &[i32],
    n: usize,
) -> leap_spec::plain::Generation {
    let greedy = leap_host::sampler::SamplingParams::default();
    leap_spec::plain::plain(ctx, prompt, n, &greedy, 512, &mut |_| true).expect("plain decoding")
}

/// Leap's engine generating up to `n` tokens after `prompt`.
pub fn leap_greedy(
    engine: &mut leap_spec::engine::Engine,
    ctx: &mut leap_host::Context,
    prompt: &[i32],
    n: usize,
) -> leap_spec::plain::Generation {
    engine
        .generate(ctx, prompt, n, 512, &mut |_| true)
        .expect("engine generation")
}

/// Context parameters: `n_ctx` tokens, `n_seq_max` sequences, all cores, Leap's defaults.
pub fn params(n_ctx: u32, n_seq_max: u32) -> leap_host::ContextParams {
    leap_host::ContextParams {
        n_ctx,
        n_seq_max,
        n_threads: threads(),
        n_threads_batch: threads(),
        ..Default::default()
    }
}

/// A context on `name` with `n_ctx` tokens and `n_seq_max` sequences, on all cores.
pub fn context(name: &str, n_ctx: u32, n_seq_max: u32) -> leap_host::Context {
    leap_host::Context::new(&model(name), &params(n_ctx, n_seq_max)).expect("context")
}

/// A context for Leap's engine on `name` (as [`context`]) with its on-demand output projection.
pub fn leap_context(
    name: &str,
    n_ctx: u32,
    n_seq_max: u32,
) -> (leap_host::Context, Option<leap_host::project::OnDemand>) {
    leap_host::project::OnDemand::context(&model(name), &params(n_ctx, n_seq_max)).expect("context")
}

/// Logits after `prompt` (decoded in one batch) and after each of `steps` greedy tokens
/// (decoded one at a time), in a fresh context on `name` with 2048 tokens and this flash
/// attention setting.
pub fn greedy_logits(
    name: &str,
    prompt: &[i32],
    steps: usize,
    flash_attn: leap_host::FlashAttn,
) -> Vec<Vec<f32>> {
    let p = leap_host::ContextParams {
        n_batch: 2048,
        flash_attn,
        ..params(2048, 1)
    };
    let mut c = leap_host::Context::new(&model(name), &p).expect("context");
    let mut b = leap_host::Batch::new(prompt.len(), 1);
    b.add_sequence(prompt, 0, 0, true).unwrap();
    c.decode(&b).unwrap();
    let mut out = vec![c.logits(-1).unwrap().to_vec()];
    for s in 0..steps {
        let t = leap_spec::plain::argmax(out.last().unwrap());
        let mut b = leap_host::Batch::new(1, 1);
        b.add(t, (prompt.len() + s) as i32, &[0], true).unwrap();
        c.decode(&b).unwrap();
        out.push(c.logits(-1).unwrap().to_vec());
    }
    out
}

/// Largest absolute difference between two logit vectors.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Prompts the engine tests decode with Leap and with plain decoding: repetition (summary),
/// code and a pattern (question and answer), so retrieval finds drafts in each.
/// Prose for long prompts and corpora (`tests/data/attention-notes.txt`).
pub const NOTES: &str = include_str!("../data/attention-notes.txt");

/// Rust source for long prompts: a fixed copy of two of Leap's files (`tests/data/code-sample.txt`,
/// backend's `attn.rs` then host's `qdot.rs` as they were), so that prompts do not change when
/// the code does.
pub const CODE_SAMPLE: &str = include_str!("../data/code-sample.txt");

pub const PROMPTS: &[&str] = &[
    "The apt-get command installs packages. The apt-get command removes packages. The apt-get \
     command upgrades packages. The dpkg command installs a .deb file. Summary: the apt-get command",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Question: What is the capital of France?\nAnswer: Paris.\nQuestion: What is the capital of Italy?\nAnswer:",
];

/// The prompt of the sampled-distribution tests: a short cycle whose continuation the
/// drafters find, so the second token goes through acceptance of a draft.
pub const SAMPLED_PROMPT: &str =
    "red green blue red green blue red green blue red green blue red green";

/// The sampler settings of the sampled-distribution tests (seeded): hot and top-4, so the
/// first two tokens spread over a handful of pairs a chi-square test can check.
pub fn sampled_params(seed: u32) -> leap_host::sampler::SamplingParams {
    leap_host::sampler::SamplingParams {
        temp: 1.5,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        seed,
    }
}

/// Chi-square test (p = 0.001) that `pairs`, the first two tokens of seeded sampled
/// generations after `toks`, follow the joint distribution llama.cpp's sampler chain with
/// `params` draws from on `c`'s model (computed from plain prefill logits).
pub fn assert_pairs_follow_the_target(
    c: &mut leap_host::Context,
    toks: &[i32],
    params: &leap_host::sampler::SamplingParams,
    pairs: &[(i32, i32)],
) {
    use leap_spec::dist::Truncation;
    // The target's joint distribution of the first two tokens, from plain prefill logits.
    let chain = Truncation::from(params);
    c.clear(false);
    leap_spec::plain::prefill(c, toks, 512).unwrap();
    let first = chain.apply(c.logits(-1).unwrap());
    let mut want: Vec<((i32, i32), f64)> = Vec::new();
    for &(t1, p1) in &first.entries {
        let context: Vec<i32> = toks.iter().copied().chain([t1]).collect();
        c.clear(false);
        leap_spec::plain::prefill(c, &context, 512).unwrap();
        for &(t2, p2) in &chain.apply(c.logits(-1).unwrap()).entries {
            want.push(((t1, t2), f64::from(p1) * f64::from(p2)));
        }
    }
    let outside = pairs
        .iter()
        .filter(|p| !want.iter().any(|w| w.0 == **p))
        .count();
    assert_eq!(outside, 0, "pairs the sampler chain can never draw");
    let n = pairs.len() as f64;
    // Pairs expected fewer than 5 times are pooled into one category.
    let (mut chi2, mut cells, mut pooled_o, mut pooled_e) = (0.0, 0usize, 0.0, 0.0);
    for &(pair, p) in &want {
        let observed = pairs.iter().filter(|&&q| q == pair).count() as f64;
        let expected = n * p;
        if expected < 5.0 {
            pooled_o += observed;
            pooled_e += expected;
        } else {
            chi2 += (observed - expected).powi(2) / expected;
            cells += 1;
        }
    }
    if pooled_e > 0.0 {
        chi2 += (pooled_o - pooled_e).powi(2) / pooled_e.max(1.0);
        cells += 1;
    }
    assert!(cells >= 2, "the distribution must not be a single token");
    // P(chi2 > x) = 0.001 for 1..=8 degrees of freedom.
    let bound = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12][(cells - 2).min(7)];
    assert!(
        chi2 < bound,
        "chi2 {chi2:.2} over {cells} cells: {want:?} vs {pairs:?}"
    );
}

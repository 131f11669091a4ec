//! Helpers for the tests on real models. `make test` fetches the models first; a test run
//! without them fails with the command that fetches them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use leap_host::{Model, ModelParams};

/// The default target, Gemma 3 270M Q4_K_M.
pub const GEMMA: &str = "gemma3-270m";
/// SmolLM2-135M-Instruct Q4_1.
pub const SMOLLM: &str = "smollm2-135m";

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
/// so every test context verifies through it. Returns whether it is on.
pub fn kernels() -> bool {
    leap_backend::register();
    leap_backend::set_enabled(true);
    true
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

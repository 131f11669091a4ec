//! Diagnostic: what an eval observer (on-demand projection's capture) costs a 1-row decode.
//! Interleaves 1-row decodes in a context without and one with the observer.
use leap_host::{Batch, Context, ContextParams, Model, ModelParams};
use leap_tests::{model_path, threads};
fn main() {
    let name = std::env::args().nth(1).unwrap_or("gemma3-270m".into());
    let m = Model::load(&model_path(&name), &ModelParams::default()).unwrap();
    let p = ContextParams {
        n_ctx: 2048,
        n_threads: threads(),
        n_threads_batch: threads(),
        ..Default::default()
    };
    let toks = leap_tests::longtext_tokens(&m);
    let mut a = Context::new(&m, &p).unwrap();
    let mut b = leap_host::project::OnDemand::context(&m, &p).unwrap().0;
    for c in [&mut a, &mut b] {
        leap_spec::plain::prefill(c, &toks[..500], 256).unwrap();
    }
    let mut t = [0.0f64; 2];
    let mut bt = Batch::new(1, 1);
    for i in 0..200 {
        for (k, c) in [&mut a, &mut b].into_iter().enumerate() {
            bt.clear();
            bt.add(toks[500 + i], (500 + i) as i32, &[0], true).unwrap();
            let t0 = std::time::Instant::now();
            c.decode(&bt).unwrap();
            c.logits(-1).unwrap();
            t[k] += t0.elapsed().as_secs_f64();
        }
    }
    println!(
        "{name}: without observer {:.2} ms/token, with {:.2} ms/token",
        t[0] * 5.0,
        t[1] * 5.0
    );
}

//! Model calls on 1000 tokens of context, all cores (criterion; the models `make models`
//! fetches):
//!
//! - `hidden/DEVICE/MODEL/ROWS`: a call cut before its output projection (what Leap's
//!   on-demand projection leaves to llama.cpp), 1 to 8 rows, with Leap's device (`leap`) or on
//!   llama.cpp's kernels alone (`ggml`). Run one under `perf record` to see where its time
//!   goes (`cargo bench -p leap-tests --bench calls -- hidden/leap/gemma3-270m/1
//!   --profile-time 20`).
//! - `projection/ROWS`: Leap's projection of those rows' hidden states (Gemma 3 270M);
//!   `full/ROWS`: llama.cpp's whole call with logits, for comparison.
//! - `observer/MODEL/{without,with}`: a one-row decode in a context without and one with an
//!   eval observer (on-demand projection's capture), what the observer costs.
//!
//! `cargo bench -p leap-tests --bench calls [-- FILTER]`. Times vary with the machine and its
//! load: read them as ratios within one run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use leap_backend::{Device, DeviceConfig};
use leap_host::{Batch, Context, Token};
use leap_tests::{context, leap_context, longtext_tokens, model, GEMMA, SMOLLM};

/// Context tokens before the measured rows.
const CONTEXT: usize = 1000;

/// `rows` rows at positions `CONTEXT..` into `bt` (tokens after the context, shifted by `i`).
fn fill(bt: &mut Batch, toks: &[Token], rows: usize, i: usize) {
    bt.clear();
    for r in 0..rows {
        bt.add(
            toks[CONTEXT + (i % 50) + r],
            (CONTEXT + r) as i32,
            &[0],
            true,
        )
        .unwrap();
    }
}

fn hidden(c: &mut Criterion) {
    for name in [GEMMA, SMOLLM] {
        let toks = longtext_tokens(&model(name));
        for (dev, cfg) in [
            ("leap", DeviceConfig::default()),
            ("ggml", DeviceConfig::off()),
        ] {
            let device = Device::new(cfg);
            let (mut ctx, od) = device.bind(|| leap_context(name, 2048, 4));
            let od = od.expect("on-demand projection");
            leap_spec::plain::prefill(&mut ctx, &toks[..CONTEXT], 256).unwrap();
            let mut g = c.benchmark_group(format!("hidden/{dev}/{name}"));
            let mut bt = Batch::new(8, 1);
            for rows in [1usize, 2, 4, 8] {
                let mut i = 0;
                g.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
                    b.iter(|| {
                        fill(&mut bt, &toks, rows, i);
                        i += 1;
                        od.arm(true);
                        ctx.decode(&bt).unwrap();
                        od.disarm();
                        let h = od.take_hidden().unwrap();
                        ctx.seq_rm(0, CONTEXT as i32, -1);
                        h
                    })
                });
            }
            g.finish();
        }
    }
}

fn projection(c: &mut Criterion) {
    let toks = longtext_tokens(&model(GEMMA));
    let (mut ctx, od) = leap_context(GEMMA, 2048, 1);
    let od = od.expect("on-demand projection");
    leap_spec::plain::prefill(&mut ctx, &toks[..CONTEXT], 256).unwrap();
    let mut bt = Batch::new(8, 1);
    let mut g = c.benchmark_group("projection");
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); 8];
    for rows in [1usize, 2, 4] {
        fill(&mut bt, &toks, rows, 0);
        od.arm(true);
        ctx.decode(&bt).unwrap();
        od.disarm();
        let h = od.take_hidden().unwrap();
        ctx.seq_rm(0, CONTEXT as i32, -1);
        let hs: Vec<&[f32]> = h.chunks_exact(od.n_embd()).collect();
        g.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
            b.iter(|| od.logits_rows(&hs, &mut outs[..rows]))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("full");
    for rows in [1usize, 2, 4] {
        let mut i = 0;
        g.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
            b.iter(|| {
                fill(&mut bt, &toks, rows, i);
                i += 1;
                ctx.decode(&bt).unwrap();
                let l = ctx.logits(-1).unwrap()[0];
                ctx.seq_rm(0, CONTEXT as i32, -1);
                l
            })
        });
    }
    g.finish();
}

fn observer(c: &mut Criterion) {
    for name in [GEMMA, SMOLLM] {
        let toks = longtext_tokens(&model(name));
        let without: Context = context(name, 2048, 1);
        let with = leap_context(name, 2048, 1).0;
        let mut g = c.benchmark_group(format!("observer/{name}"));
        for (label, mut ctx) in [("without", without), ("with", with)] {
            leap_spec::plain::prefill(&mut ctx, &toks[..CONTEXT], 256).unwrap();
            let mut bt = Batch::new(1, 1);
            let mut i = 0;
            g.bench_function(label, |b| {
                b.iter(|| {
                    fill(&mut bt, &toks, 1, i);
                    i += 1;
                    ctx.decode(&bt).unwrap();
                    let l = ctx.logits(-1).unwrap()[0];
                    ctx.seq_rm(0, CONTEXT as i32, -1);
                    l
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(3));
    targets = hidden, projection, observer
}
criterion_main!(benches);

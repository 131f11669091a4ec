//! Diagnostic: does a k-row verification batch compute the same logits as 1-row decoding?
//!
//! ```sh
//! cargo run --release -p leap-tests --example batchinv -- gemma3-270m norepack off 1500
//! #   model, weight repacking (repack|norepack), flash attention (off|on|auto), context tokens
//! ```
//!
//! Prints, for verification batches of 4..16 rows after `plen` tokens of
//! `../shared/workloads/dev-longtext.txt`, the largest logit difference from decoding the same
//! tokens one at a time (and which rows differ). With Leap's configuration every line says 0;
//! `GGML_CPU_TILED_MM=1`, `repack` or `on` show what each of those does.
use leap_host::{Batch, Context, ContextParams, FlashAttn, Model, ModelParams};
use leap_tests::{model_path, threads};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("gemma3-270m");
    let extra = args.get(2).map(|s| s == "repack").unwrap_or(true);
    let fa: FlashAttn = args
        .get(3)
        .map(|s| s.parse().unwrap())
        .unwrap_or(FlashAttn::Off);
    let plen: usize = args.get(4).map(|s| s.parse().unwrap()).unwrap_or(40);
    let m = Model::load(
        &model_path(name),
        &ModelParams {
            extra_bufts: extra,
            ..Default::default()
        },
    )
    .unwrap();
    let text = std::fs::read_to_string("/work/shared/workloads/dev-longtext.txt")
        .unwrap_or_else(|_| "The quick brown fox jumps over the lazy dog. ".repeat(200));
    let toks = m.tokenize(&text, true, false).unwrap();
    let prompt = &toks[..plen];
    let cont = &toks[plen..plen + 64];
    let mk = || {
        Context::new(
            &m,
            &ContextParams {
                n_ctx: 4096,
                n_seq_max: 1,
                n_threads: threads(),
                n_threads_batch: threads(),
                flash_attn: fa,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let mut a = mk();
    let mut b = mk();
    let tp = std::time::Instant::now();
    for c in [&mut a, &mut b] {
        for (j, chunk) in prompt.chunks(256).enumerate() {
            let mut bt = Batch::new(chunk.len(), 1);
            bt.add_sequence(chunk, (j * 256) as i32, 0, true).unwrap();
            c.decode(&bt).unwrap();
        }
    }
    println!(
        "prefill {:.1} tok/s",
        (2 * plen) as f64 / tp.elapsed().as_secs_f64()
    );
    // a: one token per call
    let mut ref_logits = Vec::new();
    let t0 = std::time::Instant::now();
    for (i, &t) in cont.iter().enumerate() {
        let mut bt = Batch::new(1, 1);
        bt.add(t, (plen + i) as i32, &[0], true).unwrap();
        a.decode(&bt).unwrap();
        ref_logits.push(a.logits(-1).unwrap().to_vec());
    }
    println!(
        "1-row decode {:.2} ms",
        t0.elapsed().as_secs_f64() * 1000.0 / cont.len() as f64
    );
    for k in [4usize, 5, 6, 7, 8, 16] {
        b.seq_rm(0, plen as i32, -1);
        let mut bt = Batch::new(k, 1);
        for (i, &t) in cont[..k].iter().enumerate() {
            bt.add(t, (plen + i) as i32, &[0], true).unwrap();
        }
        b.decode(&bt).unwrap();
        let mut worst = 0f32;
        for (i, want) in ref_logits.iter().enumerate().take(k) {
            let l = b.logits(i as i32).unwrap();
            let d = l
                .iter()
                .zip(want)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            worst = worst.max(d);
            if d > 0.0 {
                print!("r{i}:{d:.3} ");
            }
        }
        println!("{name} repack={extra} fa={fa:?} plen={plen} k={k}: max |diff| {worst:e}");
    }
}

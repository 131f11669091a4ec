//! Diagnostic: Leap's projection pass right after a decode, by rows. Leap's ggml device is
//! not registered here, so the decodes (the "hidden" and "full call" columns) run on
//! llama.cpp's own kernels.
use leap_host::Batch;
fn main() {
    let toks = leap_tests::longtext_tokens(&leap_tests::model(leap_tests::GEMMA));
    let (mut c, od) = leap_tests::leap_context(leap_tests::GEMMA, 2048, 1);
    let od = od.expect("on-demand projection");
    leap_spec::plain::prefill(&mut c, &toks[..1000], 256).unwrap();
    let mut bt = Batch::new(8, 1);
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); 8];
    for rows in [1usize, 2, 4, 1, 2, 4] {
        let (mut td, mut tp, mut tl) = (0.0, 0.0, 0.0);
        for i in 0..20 {
            bt.clear();
            for r in 0..rows {
                bt.add(toks[1000 + i + r], (1000 + r) as i32, &[0], true)
                    .unwrap();
            }
            od.arm(true);
            let t0 = std::time::Instant::now();
            c.decode(&bt).unwrap();
            od.disarm();
            td += t0.elapsed().as_secs_f64();
            let h = od.take_hidden().unwrap();
            let hs: Vec<&[f32]> = h.chunks_exact(od.n_embd()).collect();
            let t1 = std::time::Instant::now();
            od.logits_rows(&hs, &mut outs[..rows]);
            tp += t1.elapsed().as_secs_f64();
            c.seq_rm(0, 1000, -1);
            // llama.cpp's own: the same rows with logits
            bt.clear();
            for r in 0..rows {
                bt.add(toks[1000 + i + r], (1000 + r) as i32, &[0], true)
                    .unwrap();
            }
            let t2 = std::time::Instant::now();
            c.decode(&bt).unwrap();
            c.logits(-1).unwrap();
            tl += t2.elapsed().as_secs_f64();
            c.seq_rm(0, 1000, -1);
        }
        println!(
            "rows {rows}: hidden {:.2} ms, leap projection {:.2} ms, llama.cpp full call {:.2} ms",
            td * 50.0,
            tp * 50.0,
            tl * 50.0
        );
    }
}

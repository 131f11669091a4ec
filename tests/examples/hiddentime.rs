//! Diagnostic: the mean time of a call cut before its output projection (what Leap's on-demand
//! projection leaves to llama.cpp), on 1000 tokens of context; Gemma 3 270M unless MODEL.
//!
//! `hiddentime ROWS REPS [leap|ggml] [MODEL]`: Leap's ggml device registered (`leap`, the
//! default) or not (`ggml`). ROWS is a row count or a list the calls cycle through (`1,2`:
//! llama.cpp then rebuilds its graph every call; the line printed says how many calls reused
//! it). Run it under `perf record` to see where a call's time goes.
use leap_host::Batch;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 3 {
        eprintln!("usage: hiddentime ROWS REPS [leap|ggml] [MODEL]");
        std::process::exit(2);
    }
    // ROWS may be a list (`1,2`): calls cycle through it, as a speculative engine's do.
    let cycle: Vec<usize> = a[1]
        .split(',')
        .map(|r| r.parse().expect("ROWS: numbers"))
        .collect();
    let reps: usize = a[2].parse().expect("REPS: a number");
    assert!(cycle.iter().all(|r| (1..=8).contains(r)), "ROWS: 1 to 8");
    let model = a.get(4).map_or(leap_tests::GEMMA, String::as_str);
    let device = leap_backend::Device::new(match a.get(3).map_or("leap", String::as_str) {
        "leap" => leap_backend::DeviceConfig::default(),
        "ggml" => leap_backend::DeviceConfig::off(),
        other => panic!("kernels: leap or ggml, not {other}"),
    });
    let toks = leap_tests::longtext_tokens(&leap_tests::model(model));
    let (mut c, od) = device.bind(|| leap_tests::leap_context(model, 2048, 4));
    let od = od.expect("on-demand projection");
    leap_spec::plain::prefill(&mut c, &toks[..1000], 256).unwrap();
    let mut bt = Batch::new(8, 1);
    let t = std::time::Instant::now();
    for i in 0..reps {
        let rows = cycle[i % cycle.len()];
        bt.clear();
        for r in 0..rows {
            bt.add(toks[1000 + (i % 50) + r], (1000 + r) as i32, &[0], true)
                .unwrap();
        }
        od.arm(true);
        c.decode(&bt).unwrap();
        od.disarm();
        let _ = od.take_hidden().unwrap();
        c.seq_rm(0, 1000, -1);
    }
    println!(
        "rows {}: hidden {:.3} ms ({} of {reps} calls reused llama.cpp's graph)",
        a[1],
        t.elapsed().as_secs_f64() * 1e3 / reps as f64,
        c.graphs_reused()
    );
}

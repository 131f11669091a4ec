//! Micro-benchmark of the sparse-attention kernels on a synthetic decode-shaped node
//! (`cargo run --release -p leap-cli --example attn_micro -- N_KV HEADS KV_HEADS D`).
use leap_backend::attn::{Captured, Sparse};
use leap_backend::f16;
use leap_cli::attn_bench;

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    let (n_kv, n_head, n_head_kv, d) = (
        a.first().copied().unwrap_or(4096),
        a.get(1).copied().unwrap_or(9),
        a.get(2).copied().unwrap_or(3),
        a.get(3).copied().unwrap_or(64),
    );
    let threads: usize = std::env::var("T")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let mut rng = leap_kernels::rng::XorShift::new(1);
    let mut rnd = || rng.signed();
    let c = Captured {
        layer: 0,
        swa: false,
        d,
        dv: d,
        n_q: 1,
        n_head,
        n_head_kv,
        n_kv,
        q: (0..n_head * d).map(|_| rnd()).collect(),
        k: (0..n_kv * n_head_kv * d)
            .map(|_| f16::from_f32(rnd()))
            .collect(),
        v: (0..n_kv * n_head_kv * d)
            .map(|_| f16::from_f32(rnd()))
            .collect(),
        mask: vec![0; n_kv],
        scale: 1.0 / (d as f32).sqrt(),
        softcap: 0.0,
    };
    unsafe { leap_backend::ffi::ggml_cpu_init() };
    let keep: f32 = std::env::var("KEEP")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0.2);
    let refine: f32 = std::env::var("REFINE")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0.25);
    let cfg = Sparse {
        keep,
        refine,
        ..Sparse::default()
    };
    if let Ok(o) = std::env::var("ONLY") {
        only(&c, &cfg, threads, o == "sparse");
        return;
    }
    for _ in 0..3 {
        let r = attn_bench::measure(&c, &cfg, threads, 50);
        println!(
            "ggml {:.3} ms  leap dense {:.3} ms  sparse {:.3} ms",
            r.dense_ms, r.leap_dense_ms, r.sparse_ms
        );
    }
}

/// `ONLY=sparse|dense`: loop one path for profiling.
#[allow(dead_code)]
pub fn only(c: &Captured, cfg: &Sparse, threads: usize, sparse: bool) {
    let (_buf, k8) = c.shadow();
    let mut out = vec![0f32; c.n_q * c.n_head * c.dv];
    let keep = vec![cfg.keep; c.n_head];
    let t = std::time::Instant::now();
    for _ in 0..500 {
        let op = c.operands(&mut out);
        unsafe {
            leap_backend::attn::compute(&op, sparse.then_some(&k8), cfg, &keep, threads, None)
        };
    }
    println!(
        "{} {:.3} ms",
        if sparse { "sparse" } else { "dense" },
        t.elapsed().as_secs_f64() * 1e3 / 500.0
    );
}

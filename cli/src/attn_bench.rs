//! Replaying captured flash-attention nodes ([`leap_backend::attn::Captured`]): ggml's own CPU flash
//! attention on them against Leap's sparse path, with the quality of the keys Leap kept.
//! `leap attn-bench` reports this per context length.

use std::time::Instant;

use llama_cpp_sys_2 as sys;

use leap_backend::attn::{self, Captured, Chosen, Sparse};
use leap_kernels::{est, f16};
use leap_spec::control::median;

/// One node's measurements.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeResult {
    pub layer: usize,
    pub swa: bool,
    pub n_kv: usize,
    /// Whether Leap's path is timed on this node: a cache of at least `min_keys` cells not
    /// tagged `swa` (this llama.cpp tags none: sliding-window layers count too, attended
    /// densely over their window); otherwise ggml computes it in both columns.
    pub taken: bool,
    /// Visible and kept keys summed over (row, head) pairs.
    pub visible: u64,
    pub kept: u64,
    /// ggml's CPU flash attention (median over the repetitions).
    pub dense_ms: f64,
    /// Leap's path with every key (its dense fallback).
    pub leap_dense_ms: f64,
    /// Leap's sparse path (estimate, top-k, exact over the kept keys).
    pub sparse_ms: f64,
    /// Of the keys the estimate picked, the fraction among as many top keys by exact f32
    /// score (same candidates: the sinks and the recent window are kept regardless).
    pub recall: f64,
    /// The same for the int8 estimate's own top-k (before the exact re-ranking of the
    /// candidates near the cut, [`Sparse::refine`]).
    pub estimate_recall: f64,
    /// Attention probability (exact softmax) of the kept keys.
    pub mass: f64,
    /// (row, head) pairs attended sparsely.
    pub sparse_rows: u64,
    /// Largest |sparse output - ggml's dense output|.
    pub max_abs_err: f32,
}

/// ggml's CPU flash attention on `c`: median milliseconds over `reps` runs, and its output
/// (`[i][h][dv]`).
pub fn ggml_dense(c: &Captured, threads: usize, reps: usize) -> (f64, Vec<f32>) {
    let bytes = c.q.len() * 4 + (c.k.len() + c.v.len() + c.mask.len()) * 2;
    let out_len = c.n_q * c.n_head * c.dv;
    // Tensors, the graph, and a work buffer per compute call (ggml takes it from the context).
    let mem = bytes
        + out_len * 4
        + (reps + 2) * (threads * (c.d + 2 * c.dv) * 4 * 64 + (1 << 20))
        + (16 << 20);
    // SAFETY: plain ggml graph construction on a context we own and free below; every
    // tensor's data is written before the graph runs; shapes follow ggml_flash_attn_ext's
    // contract (q [d, n_q, n_head], k/v [d, n_kv, n_head_kv] views, mask [n_kv, n_q] f16).
    unsafe {
        let ctx = sys::ggml_init(sys::ggml_init_params {
            mem_size: mem,
            mem_buffer: std::ptr::null_mut(),
            no_alloc: false,
        });
        assert!(!ctx.is_null(), "ggml_init");
        let (d, dv, nq, nh, nhk, nkv) = (
            c.d as i64,
            c.dv as i64,
            c.n_q as i64,
            c.n_head as i64,
            c.n_head_kv as i64,
            c.n_kv as i64,
        );
        let qt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, d, nh, nq);
        let kt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F16, d, nhk, nkv);
        let vt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F16, dv, nhk, nkv);
        let mt = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F16, nkv, nq);
        std::ptr::copy_nonoverlapping(c.q.as_ptr(), sys::ggml_get_data(qt).cast(), c.q.len());
        std::ptr::copy_nonoverlapping(c.k.as_ptr(), sys::ggml_get_data(kt).cast(), c.k.len());
        std::ptr::copy_nonoverlapping(c.v.as_ptr(), sys::ggml_get_data(vt).cast(), c.v.len());
        std::ptr::copy_nonoverlapping(c.mask.as_ptr(), sys::ggml_get_data(mt).cast(), c.mask.len());
        let q = sys::ggml_permute(ctx, qt, 0, 2, 1, 3);
        let k = sys::ggml_permute(ctx, kt, 0, 2, 1, 3);
        let v = sys::ggml_permute(ctx, vt, 0, 2, 1, 3);
        let fa = sys::ggml_flash_attn_ext(ctx, q, k, v, mt, c.scale, 0.0, c.softcap);
        sys::ggml_flash_attn_ext_set_prec(fa, sys::GGML_PREC_F32);
        let gf = sys::ggml_new_graph(ctx);
        sys::ggml_build_forward_expand(gf, fa);
        let mut times = Vec::with_capacity(reps);
        for r in 0..reps + 1 {
            let t = Instant::now();
            let st = sys::ggml_graph_compute_with_ctx(ctx, gf, threads as i32);
            assert_eq!(st, sys::GGML_STATUS_SUCCESS, "ggml flash attention");
            if r > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let out =
            std::slice::from_raw_parts(sys::ggml_get_data(fa).cast::<f32>(), out_len).to_vec();
        sys::ggml_free(ctx);
        (median(&mut times), out)
    }
}

/// Leap's path on `c` with `keep` per head (`None`: dense): median milliseconds, output,
/// stats, and the keys each (row, head) kept.
fn leap(
    c: &Captured,
    cfg: &Sparse,
    keeps: &[f32],
    sparse: bool,
    threads: usize,
    reps: usize,
) -> (f64, Vec<f32>, attn::Stats, Vec<Chosen>) {
    let (_buf, k8) = c.shadow();
    let mut out = vec![0f32; c.n_q * c.n_head * c.dv];
    let mut chosen = Vec::new();
    let mut times = Vec::with_capacity(reps);
    let mut stats = attn::Stats::default();
    for r in 0..reps + 1 {
        let op = c.operands(&mut out);
        let t = Instant::now();
        // SAFETY: the operands point into `c` and `out`; the shadow covers every key.
        stats = unsafe { attn::compute(&op, sparse.then_some(&k8), cfg, keeps, threads, None) };
        if r > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let op = c.operands(&mut out);
    // SAFETY: as above (once more, recording the kept keys, untimed).
    unsafe {
        attn::compute(
            &op,
            sparse.then_some(&k8),
            cfg,
            keeps,
            threads,
            Some(&mut chosen),
        )
    };
    (median(&mut times), out, stats, chosen)
}

/// Quality of the kept keys over the (row, head) pairs that were sparse: recall of the
/// estimate's top-k (the keys it picked beyond the always-kept sinks and recent window)
/// against the top-k of exact f32 scores over the same candidates, and the attention
/// probability (exact softmax over all visible keys) the kept keys carry.
fn quality(c: &Captured, cfg: &Sparse, chosen: &[Chosen]) -> (f64, f64, f64) {
    let (mut recall, mut mass, mut n) = (0.0, 0.0, 0usize);
    let mut est_recall = 0.0;
    let (_buf, k8) = c.shadow();
    for i in 0..c.n_q {
        for h in 0..c.n_head {
            let hk = h / (c.n_head / c.n_head_kv);
            let q = &c.q[(i * c.n_head + h) * c.d..][..c.d];
            let scores: Vec<(f64, u32)> = (0..c.n_kv)
                .filter(|&j| f16::to_f32(c.mask[i * c.n_kv + j]) != f32::NEG_INFINITY)
                .map(|j| {
                    let k = &c.k[(j * c.n_head_kv + hk) * c.d..][..c.d];
                    let s: f64 = q
                        .iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * f16::to_f32(b) as f64)
                        .sum();
                    (s * c.scale as f64, j as u32)
                })
                .collect();
            let kept = &chosen[i * c.n_head + h];
            let visible = scores.len();
            if kept.len() >= visible {
                continue;
            }
            let max = scores.iter().map(|s| s.0).fold(f64::MIN, f64::max);
            let z: f64 = scores.iter().map(|s| (s.0 - max).exp()).sum();
            let mut m = 0.0;
            for &j in kept {
                if let Ok(x) = scores.binary_search_by_key(&j, |s| s.1) {
                    m += (scores[x].0 - max).exp() / z;
                }
            }
            // The estimated part: candidates between the sinks and the recent window.
            let lo = cfg.sink.min(visible);
            let hi = visible - cfg.recent.min(visible - lo);
            let take = kept.len() - lo - (visible - hi);
            if take > 0 {
                let mut middle: Vec<(f64, u32)> = scores[lo..hi].to_vec();
                middle.sort_by(|a, b| b.0.total_cmp(&a.0));
                let mut top: Vec<u32> = middle[..take].iter().map(|s| s.1).collect();
                top.sort_unstable();
                let (j_lo, j_hi) = (scores[lo].1, scores[hi - 1].1);
                let hits = kept
                    .iter()
                    .filter(|&&j| j >= j_lo && j <= j_hi && top.binary_search(&j).is_ok())
                    .count();
                recall += hits as f64 / take as f64;
                // The int8 estimate's own top-k, before the exact re-ranking.
                let mut e = vec![0f32; hi - lo];
                // SAFETY: the shadow holds every key's int8 row.
                unsafe {
                    let mut outs = [e.as_mut_slice()];
                    let key = |x: usize| k8.at(scores[lo + x].1 as usize, hk);
                    est::scores_f32q(q, 1, c.d, hi - lo, key, &mut outs);
                }
                let mut by_est: Vec<(f32, u32)> = e
                    .iter()
                    .zip(&scores[lo..hi])
                    .map(|(&v, s)| (v, s.1))
                    .collect();
                by_est.sort_by(|a, b| b.0.total_cmp(&a.0));
                let hits = by_est[..take]
                    .iter()
                    .filter(|s| top.binary_search(&s.1).is_ok())
                    .count();
                est_recall += hits as f64 / take as f64;
            } else {
                recall += 1.0;
                est_recall += 1.0;
            }
            mass += m;
            n += 1;
        }
    }
    if n == 0 {
        (1.0, 1.0, 1.0)
    } else {
        let n = n as f64;
        (recall / n, mass / n, est_recall / n)
    }
}

/// Measure one captured node: ggml dense, Leap dense, Leap sparse with `cfg` (keep per
/// `cfg.keep_for`), and the sparse output's quality.
pub fn measure(c: &Captured, cfg: &Sparse, threads: usize, reps: usize) -> NodeResult {
    let taken = !c.swa && c.n_kv >= cfg.min_keys;
    let keeps: Vec<f32> = (0..c.n_head)
        .map(|h| cfg.keep_for(Some(c.layer), h))
        .collect();
    let (dense_ms, want) = ggml_dense(c, threads, reps);
    let (leap_dense_ms, _, _, _) = leap(c, cfg, &vec![1.0; c.n_head], false, threads, reps);
    let (sparse_ms, got, st, chosen) = if taken {
        leap(c, cfg, &keeps, true, threads, reps)
    } else {
        (dense_ms, want.clone(), attn::Stats::default(), Vec::new())
    };
    let (recall, mass, estimate_recall) = if taken && st.sparse_rows > 0 {
        quality(c, cfg, &chosen)
    } else {
        (1.0, 1.0, 1.0)
    };
    let max_abs_err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    NodeResult {
        layer: c.layer,
        swa: c.swa,
        n_kv: c.n_kv,
        taken,
        visible: st.keys_visible,
        kept: st.keys_kept,
        dense_ms,
        leap_dense_ms,
        sparse_ms,
        recall,
        estimate_recall,
        mass,
        max_abs_err,
        sparse_rows: st.sparse_rows,
    }
}

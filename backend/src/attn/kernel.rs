//! The attention kernel, [`compute`]: for every (query row, head) of a node the keys it
//! sees, the budget's best by the estimate ([`Sparse::keep`]; sinks and the recent window
//! always), then exact attention over them in f32 on the f16 cache; rows with few keys, or
//! without a shadow, densely by the same code. Work is split across threads by (row, KV head
//! group), or for a decode step by key ranges then heads.

use std::sync::Mutex;

use super::estimate::{estimate, pipelined};
use super::{EstimateOn, Keys8, Operands, Sparse, Stats};
use crate::f16;
use crate::par::{parallel, Ptr};

/// One query row's shared state: the keys it sees and the estimates of a group of heads.
#[derive(Default)]
pub(super) struct Row {
    pub(super) cand: Vec<u32>,
    bias: Vec<f32>,
    /// Candidates `lo..hi` are estimated; the first `lo` (sinks) and the last `n - hi`
    /// (recent window) are always kept.
    pub(super) lo: usize,
    pub(super) hi: usize,
    sparse: bool,
    /// Estimate on the OpenCL device.
    pub(super) on_opencl: bool,
    /// Estimate on QNN (one launch per KV head over all candidates).
    pub(super) on_qnn: bool,
    pub(super) est: Vec<Vec<f32>>,
    /// The queries as they are (the estimate quantizes only the keys).
    pub(super) qf: Vec<f32>,
}

thread_local! {
    /// Scratch of the thread computing attention (ggml's OpenMP team and the scheduler's
    /// thread live as long as the process): the per-key buffers (candidates, estimates,
    /// picks, scores) are reused from node to node; only a few per-head vectors are not.
    static SCRATCH: std::cell::RefCell<(Row, Head)> = std::cell::RefCell::new(Default::default());
}

/// One head's scratch for selection and exact attention.
#[derive(Default)]
pub(super) struct Head {
    top: Vec<(f32, u32)>,
    pick: Vec<u32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
    rows: Vec<*const u16>,
    gone: Vec<bool>,
}

/// Which keys a (row, head) pair attends (for recall measurements).
pub type Chosen = Vec<u32>;

/// Keys kept of `n` visible at fraction `keep` (never fewer than the sinks and the window).
fn budget(keep: f32, n: usize, cfg: &Sparse) -> usize {
    ((keep * n as f32).ceil() as usize).max(cfg.sink + cfg.recent)
}

#[inline]
unsafe fn query(op: &Operands, i: usize, h: usize) -> &[f32] {
    std::slice::from_raw_parts(op.q.add(i * op.q_row + h * op.q_head).cast::<f32>(), op.d)
}

/// The keys row `i` sees with their mask bias, and whether heads `h0..h0+g` attend sparsely
/// (then their f32 queries are copied to `r.qf` and `r.est` sized, not yet filled).
unsafe fn prepare(
    op: &Operands,
    sparse: bool,
    cfg: &Sparse,
    keep: &[f32],
    i: usize,
    (h0, g): (usize, usize),
    r: &mut Row,
) {
    r.cand.clear();
    r.bias.clear();
    if op.mask.is_null() {
        r.cand.extend(0..op.n_kv as u32);
        r.bias.resize(op.n_kv, 0.0);
    } else {
        let m = std::slice::from_raw_parts(op.mask.add(i * op.mask_row).cast::<u16>(), op.n_kv);
        for (j, &b) in m.iter().enumerate() {
            if b != leap_kernels::f16::NEG_INFINITY {
                r.cand.push(j as u32);
                r.bias.push(if b == 0 { 0.0 } else { f16::to_f32(b) });
            }
        }
    }
    let n = r.cand.len();
    r.lo = cfg.sink.min(n);
    r.hi = n - cfg.recent.min(n - r.lo);
    r.on_opencl = cfg.estimate_on == EstimateOn::OpenCl;
    r.sparse = sparse && n >= cfg.min_keys && (0..g).any(|x| budget(keep[h0 + x], n, cfg) < n);
    r.on_qnn = r.sparse && !r.on_opencl && crate::qnn::use_for(cfg.qnn);
    if r.sparse {
        r.qf.clear();
        for x in 0..g {
            // f32 queries against the int8 keys, on the CPU and in OpenCL alike.
            r.qf.extend_from_slice(query(op, i, h0 + x));
        }
        r.est.resize_with(g, Vec::new);
        for e in r.est.iter_mut() {
            e.resize(r.hi - r.lo, 0.0);
        }
    }
}

/// Select head `h`'s keys (group member `x`) and attend them exactly; adds to `stats`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn finish(
    op: &Operands,
    cfg: &Sparse,
    keep: f32,
    i: usize,
    (h, x): (usize, usize),
    r: &Row,
    s: &mut Head,
    stats: &mut Stats,
    chosen: Option<&mut Chosen>,
) {
    let hk = h / (op.n_head / op.n_head_kv);
    let n = r.cand.len();
    let want = budget(keep, n, cfg);
    s.pick.clear();
    let mut drop = 0;
    if r.sparse && want < n {
        let take = want - r.lo - (n - r.hi);
        let extra = ((take as f32 * cfg.refine).ceil() as usize).min(r.hi - r.lo - take);
        let take = take + extra;
        drop = extra;
        s.top.clear();
        s.top.extend(
            r.est[x]
                .iter()
                .enumerate()
                .map(|(c, &e)| (e * op.scale + r.bias[r.lo + c], (r.lo + c) as u32)),
        );
        if take < s.top.len() {
            s.top
                .select_nth_unstable_by(take, |a, b| b.0.total_cmp(&a.0));
            s.top.truncate(take);
        }
        s.pick.extend(0..r.lo as u32);
        s.pick.extend(s.top.iter().map(|&(_, c)| c));
        s.pick.extend(r.hi as u32..n as u32);
        stats.sparse_rows += 1;
    } else {
        s.pick.extend(0..n as u32);
        stats.dense_rows += 1;
    }
    stats.keys_visible += n as u64;
    stats.keys_kept += (s.pick.len() - drop) as u64;
    exact(op, query(op, i, h), hk, i, h, r, s, drop);
    if let Some(ch) = chosen {
        ch.clear();
        ch.extend(s.pick.iter().map(|&c| r.cand[c as usize]));
        ch.sort_unstable();
    }
}

/// Exact attention of one (row, head) over the picked keys (`s.pick`, indices into
/// `r.cand`), written to the output; first the `drop` lowest-scoring estimated picks (those
/// between the sinks and the recent window) are dropped from `s.pick`.
#[allow(clippy::too_many_arguments)]
unsafe fn exact(
    op: &Operands,
    q: &[f32],
    hk: usize,
    i: usize,
    h: usize,
    r: &Row,
    s: &mut Head,
    drop: usize,
) {
    let (scale, cap) = if op.softcap != 0.0 {
        (op.scale / op.softcap, op.softcap)
    } else {
        (op.scale, 0.0)
    };
    s.scores.clear();
    let mut max = f32::NEG_INFINITY;
    // Picked rows are scattered over the cache: fetch a few ahead.
    const AHEAD: usize = 4;
    let k_bytes = op.d * 2;
    for (t, &c) in s.pick.iter().enumerate() {
        if let Some(&next) = s.pick.get(t + AHEAD) {
            let p =
                op.k.add(r.cand[next as usize] as usize * op.k_row + hk * op.k_head);
            f16::prefetch(p, k_bytes);
        }
        let j = r.cand[c as usize] as usize;
        let mut x = f16::dot(q, op.k.add(j * op.k_row + hk * op.k_head).cast()) * scale;
        if cap != 0.0 {
            x = cap * x.tanh();
        }
        x += r.bias[c as usize];
        max = max.max(x);
        s.scores.push(x);
    }
    if drop > 0 {
        // Rank the estimated picks by exact score; keep all but the `drop` lowest.
        let (lo, hi) = (r.lo, s.pick.len() - (r.cand.len() - r.hi));
        s.top.clear();
        s.top.extend((lo..hi).map(|t| (s.scores[t], t as u32)));
        let keep = s.top.len() - drop;
        s.top
            .select_nth_unstable_by(keep, |a, b| b.0.total_cmp(&a.0));
        s.gone.clear();
        s.gone.resize(s.pick.len(), false);
        for &(_, t) in &s.top[keep..] {
            s.gone[t as usize] = true;
        }
        let mut w = 0;
        for (t, &g) in s.gone.iter().enumerate() {
            if !g {
                s.pick[w] = s.pick[t];
                s.scores[w] = s.scores[t];
                w += 1;
            }
        }
        s.pick.truncate(w);
        s.scores.truncate(w);
        max = s.scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
    let mut sum = 0f32;
    for x in s.scores.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    s.rows.clear();
    s.rows.extend(s.pick.iter().map(|&c| {
        let j = r.cand[c as usize] as usize;
        op.v.add(j * op.v_row + hk * op.v_head).cast::<u16>()
    }));
    s.acc.resize(op.dv, 0.0);
    f16::weighted_sum(&mut s.acc, &s.scores, &s.rows);
    let out = std::slice::from_raw_parts_mut(
        op.dst.add(i * op.dst_row + h * op.dst_head).cast::<f32>(),
        op.dv,
    );
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for (o, a) in out.iter_mut().zip(&s.acc) {
        *o = a * inv;
    }
}

fn add(tot: &Mutex<Stats>, s: &Stats) {
    let mut t = tot.lock().unwrap_or_else(|e| e.into_inner());
    t.sparse_rows += s.sparse_rows;
    t.dense_rows += s.dense_rows;
    t.keys_visible += s.keys_visible;
    t.keys_kept += s.keys_kept;
}

/// Compute a node's attention, sparse where `keys8` is given: `keep[h]` per head.
/// Returns the (row, head) pairs' stats, and fills `chosen[i*n_head+h]` if given.
///
/// Work is split by (row, KV head group) — the heads of a group share the estimate's key
/// loads — when there are enough rows for the threads (prefill, verification); a decode step
/// (one row) instead splits the estimate by key ranges, then the heads.
///
/// # Safety
/// `op`'s pointers are valid for its shape; `keys8` (if any) holds every cell's int8 copy.
pub unsafe fn compute(
    op: &Operands,
    keys8: Option<&Keys8>,
    cfg: &Sparse,
    keep: &[f32],
    threads: usize,
    chosen: Option<&mut Vec<Chosen>>,
) -> Stats {
    let g = op.n_head / op.n_head_kv;
    let totals = Mutex::new(Stats::default());
    let chosen_ptr = chosen.map(|c| {
        c.resize_with(op.n_q * op.n_head, Vec::new);
        Ptr(c.as_mut_ptr().cast())
    });
    let slot = |i: usize, h: usize| {
        // SAFETY: every (row, head) slot is written by one task only.
        chosen_ptr.map(|p| unsafe { &mut *p.at(0).cast::<Chosen>().add(i * op.n_head + h) })
    };
    let groups = op.n_q * op.n_head_kv;
    if groups >= 2 * threads || threads <= 1 {
        parallel(threads.min(groups).max(1), &|tid, nth| {
            let mut scratch = SCRATCH.with(|c| c.take());
            let (r, s) = (&mut scratch.0, &mut scratch.1);
            let mut local = Stats::default();
            let mut t = tid;
            while t < groups {
                let (i, hk) = (t / op.n_head_kv, t % op.n_head_kv);
                let h0 = hk * g;
                // SAFETY: each task writes its own output rows and `chosen` slots.
                unsafe {
                    prepare(op, keys8.is_some(), cfg, keep, i, (h0, g), r);
                    if r.sparse {
                        let est: Vec<Ptr> = r
                            .est
                            .iter_mut()
                            .map(|e| Ptr(e.as_mut_ptr().cast()))
                            .collect();
                        estimate(op, keys8.unwrap(), hk, (0, g), r, &est, (0, r.hi - r.lo));
                    }
                    for x in 0..g {
                        finish(
                            op,
                            cfg,
                            keep[h0 + x],
                            i,
                            (h0 + x, x),
                            r,
                            s,
                            &mut local,
                            slot(i, h0 + x),
                        );
                    }
                }
                t += nth;
            }
            SCRATCH.with(|c| c.replace(scratch));
            add(&totals, &local);
        });
    } else {
        // Few rows (decode): per row, every head's estimate split by key ranges, then the
        // heads' selection and exact attention split by heads.
        thread_local! {
            static ROW: std::cell::RefCell<Row> = std::cell::RefCell::new(Row::default());
        }
        let mut r = ROW.with(|c| c.take());
        for i in 0..op.n_q {
            prepare(op, keys8.is_some(), cfg, keep, i, (0, op.n_head), &mut r);
            if r.sparse && r.on_opencl {
                let mut local = Stats::default();
                if pipelined(op, keys8.unwrap(), cfg, keep, i, &mut r, &mut local, &slot) {
                    add(&totals, &local);
                    continue;
                }
            }
            if r.sparse {
                let m = r.hi - r.lo;
                let est: Vec<Ptr> = r
                    .est
                    .iter_mut()
                    .map(|e| Ptr(e.as_mut_ptr().cast()))
                    .collect();
                let (rr, est) = (&r, &est);
                // The OpenCL device and QNN take the whole range in one launch (QNN's
                // estimate depends on all of a row's candidates: its scales are theirs).
                let split = if r.on_opencl || r.on_qnn { 1 } else { threads };
                parallel(split, &|tid, nth| {
                    let (c0, c1) = (m * tid / nth, m * (tid + 1) / nth);
                    for hk in 0..op.n_head_kv {
                        // SAFETY: threads write disjoint ranges of the estimate rows.
                        unsafe { estimate(op, keys8.unwrap(), hk, (hk * g, g), rr, est, (c0, c1)) };
                    }
                });
            }
            // Heads to threads by expected work (their budgets: 004 §3.4 reorders heads for
            // the same reason), largest first onto the least loaded thread.
            let nth = threads.min(op.n_head);
            let mut order: Vec<usize> = (0..op.n_head).collect();
            order.sort_by(|&a, &b| keep[b].total_cmp(&keep[a]));
            let mut load = vec![0f32; nth];
            let mut owner = vec![0usize; op.n_head];
            for &h in &order {
                let t = (0..nth)
                    .min_by(|&a, &b| load[a].total_cmp(&load[b]))
                    .unwrap();
                owner[h] = t;
                load[t] += keep[h].max(0.01);
            }
            let (rr, owner) = (&r, &owner);
            parallel(nth, &|tid, team| {
                let mut scratch = SCRATCH.with(|c| c.take());
                let mut local = Stats::default();
                // (A smaller team than asked for still covers every head.)
                for h in (0..op.n_head).filter(|&h| owner[h] % team == tid) {
                    // SAFETY: each thread writes its own heads' output rows.
                    unsafe {
                        finish(
                            op,
                            cfg,
                            keep[h],
                            i,
                            (h, h),
                            rr,
                            &mut scratch.1,
                            &mut local,
                            slot(i, h),
                        )
                    };
                }
                SCRATCH.with(|c| c.replace(scratch));
                add(&totals, &local);
            });
        }
        ROW.with(|c| c.replace(r));
    }
    let mut s = totals.into_inner().unwrap_or_else(|e| e.into_inner());
    s.nodes = 1;
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attn::Captured;
    use crate::ffi as g;

    /// A random attention problem in cache layout (cell-major rows of all heads), as a node
    /// captured from a model would be.
    type Problem = Captured;

    fn rng(r: &mut leap_kernels::rng::XorShift) -> f32 {
        r.signed()
    }

    fn problem(n_q: usize, n_kv: usize, seed: u64) -> Problem {
        let (d, n_head, n_head_kv) = (64, 4, 2);
        let mut s = leap_kernels::rng::XorShift::new(seed);
        // A few "important" keys per head get large scores; the rest are noise.
        let q: Vec<f32> = (0..n_q * n_head * d).map(|_| rng(&mut s)).collect();
        let mut k: Vec<u16> = (0..n_kv * n_head_kv * d)
            .map(|_| f16::from_f32(rng(&mut s) * 0.3))
            .collect();
        for j in (7..n_kv).step_by(97) {
            for x in 0..n_head_kv * d {
                let qv = q[x % d];
                k[j * n_head_kv * d + x] = f16::from_f32(qv * 4.0);
            }
        }
        let v = (0..n_kv * n_head_kv * d)
            .map(|_| f16::from_f32(rng(&mut s)))
            .collect();
        // Causal: row i sees cells 0..n_kv - n_q + i + 1.
        let mut mask = vec![f16::from_f32(f32::NEG_INFINITY); n_q * n_kv];
        for i in 0..n_q {
            for j in 0..n_kv - n_q + i + 1 {
                mask[i * n_kv + j] = 0;
            }
        }
        Captured {
            layer: 0,
            swa: false,
            d,
            dv: d,
            n_q,
            n_head,
            n_head_kv,
            n_kv,
            q,
            k,
            v,
            mask,
            scale: 1.0 / (d as f32).sqrt(),
            softcap: 0.0,
        }
    }

    fn operands(p: &Problem, dst: &mut [f32]) -> Operands {
        p.operands(dst)
    }

    /// Textbook softmax attention in f64.
    fn reference(p: &Problem) -> Vec<f32> {
        let d = p.d;
        let mut out = vec![0f32; p.n_q * p.n_head * d];
        for i in 0..p.n_q {
            for h in 0..p.n_head {
                let hk = h / (p.n_head / p.n_head_kv);
                let q = &p.q[(i * p.n_head + h) * d..][..d];
                let mut sc = Vec::new();
                for j in 0..p.n_kv {
                    if f16::to_f32(p.mask[i * p.n_kv + j]) == f32::NEG_INFINITY {
                        continue;
                    }
                    let k = &p.k[(j * p.n_head_kv + hk) * d..][..d];
                    let s: f64 = q
                        .iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * f16::to_f32(b) as f64)
                        .sum();
                    sc.push((j, s / (d as f64).sqrt()));
                }
                let m = sc.iter().map(|x| x.1).fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|x| (x.1 - m).exp()).sum();
                for x in 0..d {
                    let mut a = 0f64;
                    for &(j, s) in &sc {
                        a += (s - m).exp() / z
                            * f16::to_f32(p.v[(j * p.n_head_kv + hk) * d + x]) as f64;
                    }
                    out[(i * p.n_head + h) * d + x] = a as f32;
                }
            }
        }
        out
    }

    fn keys8(p: &Problem) -> (Vec<u8>, Keys8) {
        p.shadow()
    }

    fn init() {
        // SAFETY: idempotent.
        unsafe { g::ggml_cpu_init() };
    }

    #[test]
    fn dense_matches_softmax_attention() {
        init();
        let p = problem(3, 300, 1);
        let mut dst = vec![0f32; p.n_q * p.n_head * p.d];
        let op = operands(&p, &mut dst);
        let cfg = Sparse::default();
        // SAFETY: operands point into `p` and `dst`.
        let st = unsafe { compute(&op, None, &cfg, &[0.2; 4], 2, None) };
        assert_eq!(st.sparse_rows, 0);
        let want = reference(&p);
        let err = dst
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-4, "max abs err {err}");
    }

    #[test]
    fn sparse_keeps_the_budget_and_the_important_keys() {
        init();
        let p = problem(2, 2000, 7);
        let (_buf, k8) = keys8(&p);
        let mut dst = vec![0f32; p.n_q * p.n_head * p.d];
        let op = operands(&p, &mut dst);
        let cfg = Sparse {
            min_keys: 256,
            ..Sparse::default()
        };
        let mut chosen = Vec::new();
        // SAFETY: as above; k8 covers every cell.
        let st = unsafe { compute(&op, Some(&k8), &cfg, &[0.2; 4], 2, Some(&mut chosen)) };
        assert_eq!(st.sparse_rows, (p.n_q * p.n_head) as u64);
        for (t, ch) in chosen.iter().enumerate() {
            let i = t / p.n_head;
            let visible = p.n_kv - p.n_q + i + 1;
            assert_eq!(ch.len(), (0.2 * visible as f32).ceil() as usize, "budget");
            // Sinks, the recent window and every planted key are in.
            for j in 0..4 {
                assert!(ch.contains(&j));
            }
            for j in visible - 64..visible {
                assert!(ch.contains(&(j as u32)));
            }
            if t == 0 {
                for j in (7..visible).step_by(97) {
                    assert!(
                        ch.contains(&(j as u32)),
                        "planted key {j} missing in task {t}"
                    );
                }
            }
            assert!(ch.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
            assert!(ch.iter().all(|&j| (j as usize) < visible), "causal");
        }
        // The planted keys carry most of row 0 head 0's attention: its output stays close.
        let want = reference(&p);
        let d = p.d;
        let err = dst[..d]
            .iter()
            .zip(&want[..d])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 0.02, "max abs err {err}");
    }

    #[test]
    fn a_row_attends_alike_in_any_batch() {
        init();
        let p = problem(12, 1500, 11);
        let (_buf, k8) = keys8(&p);
        let cfg = Sparse {
            min_keys: 256,
            ..Sparse::default()
        };
        let mut all = vec![0f32; p.n_q * p.n_head * p.d];
        // SAFETY: operands point into `p` and `all`; k8 covers every cell.
        unsafe { compute(&operands(&p, &mut all), Some(&k8), &cfg, &[0.2; 4], 2, None) };
        for i in 0..p.n_q {
            // Row i alone: a one-row problem with that row's query and mask.
            let one = Problem {
                q: p.q[i * p.n_head * p.d..(i + 1) * p.n_head * p.d].to_vec(),
                mask: p.mask[i * p.n_kv..(i + 1) * p.n_kv].to_vec(),
                n_q: 1,
                k: p.k.clone(),
                v: p.v.clone(),
                ..p
            };
            let mut out = vec![0f32; p.n_head * p.d];
            // SAFETY: as above.
            unsafe {
                compute(
                    &operands(&one, &mut out),
                    Some(&k8),
                    &cfg,
                    &[0.2; 4],
                    2,
                    None,
                )
            };
            assert_eq!(
                out,
                all[i * p.n_head * p.d..(i + 1) * p.n_head * p.d],
                "row {i}"
            );
        }
    }

    #[test]
    fn keep_one_is_dense() {
        init();
        let p = problem(1, 1000, 3);
        let (_buf, k8) = keys8(&p);
        let mut a = vec![0f32; p.n_head * p.d];
        let mut b = a.clone();
        let cfg = Sparse {
            min_keys: 256,
            ..Sparse::default()
        };
        // SAFETY: as above.
        unsafe {
            compute(&operands(&p, &mut a), Some(&k8), &cfg, &[1.0; 4], 1, None);
            compute(&operands(&p, &mut b), None, &cfg, &[1.0; 4], 1, None);
        }
        assert_eq!(a, b);
    }
}

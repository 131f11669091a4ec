//! The training loss of an early-exit head and its gradient with respect to `A`: `L_kd + λ
//! L_cand` (Eq. 8-10) over a mini-batch, the student logits over the restricted vocabulary one
//! product split across threads by vocabulary ranges (forward, then backward per range), and
//! the small vector kernels it runs on.

use std::ops::Range;

use super::dot;
use super::train::Prep;

/// The loss's knobs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Params {
    pub(super) temperature: f32,
    pub(super) lambda: f32,
    pub(super) threads: usize,
}

/// Sums over a mini-batch.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Stats {
    /// Samples in the batch.
    n: usize,
    /// Sum of L_kd.
    pub(super) kd: f64,
    /// Sum of L_cand (without λ).
    pub(super) cand: f64,
    /// Samples whose student argmax over the vocabulary is the teacher's top-1.
    pub(super) top1: usize,
    /// Samples whose best candidate by the student is the teacher's.
    pub(super) cand_top1: usize,
    /// Samples with a `top` / with a `cand`.
    pub(super) n_top: usize,
    pub(super) n_cand: usize,
}

impl Stats {
    /// The mean loss the gradient is of.
    pub(super) fn objective(&self, lambda: f32) -> f64 {
        (self.kd + f64::from(lambda) * self.cand) / self.n.max(1) as f64
    }
}

/// The loss `mean_b (L_kd + λ L_cand)` of a mini-batch and, into `grad` (the shape of `A`:
/// d rows of the input's length, overwritten),
/// its gradient with respect to `A`. The student logits are `Z = E U` (rows of E: the
/// vocabulary, columns of U: `u_b = A n_b`); `dZ = T (q - p)` per term; `dU = E^T dZ`;
/// `dA = sum_b du_b ⊗ n_b`.
pub(super) fn loss_and_grad(
    batch: &[&Prep],
    rows: &[f32],
    d: usize,
    a: &[f32],
    p: &Params,
    grad: Option<&mut [f32]>,
) -> Stats {
    let bsz = batch.len();
    let nv = rows.len() / d.max(1);
    let mut stats = Stats {
        n: bsz,
        ..Stats::default()
    };
    if bsz == 0 || nv == 0 || d == 0 {
        if let Some(g) = grad {
            g.fill(0.0);
        }
        return stats;
    }
    let inv_t = 1.0 / p.temperature;
    let threads = p.threads.max(1);
    let u = project_samples(batch, a, d, threads);
    let ranges = split(nv, threads);
    let (z, parts) = forward_ranges(rows, d, &u, bsz, &ranges, inv_t);
    let soft = Softmax::combine(&parts, bsz, inv_t);
    let (corr, qw) = loss_terms(batch, rows, d, &u, &soft, p, &mut stats);
    let Some(grad) = grad else {
        return stats;
    };
    let din = batch[0].norm.len();
    assert_eq!(grad.len(), d * din, "grad is not the shape of A");
    let du = backward_ranges(rows, d, bsz, &ranges, &parts, &z, &soft, &qw, &corr, inv_t);
    grad_of_a(grad, &du, batch, d, threads);
    stats
}

/// U: one row of `d` per sample, `A` times the sample's normalised input.
fn project_samples(batch: &[&Prep], a: &[f32], d: usize, threads: usize) -> Vec<f32> {
    let mut u = vec![0.0f32; batch.len() * d];
    let din = batch[0].norm.len();
    let per = batch.len().div_ceil(threads);
    run_all(
        u.chunks_mut(per * d)
            .zip(batch.chunks(per))
            .map(|(chunk, batch)| {
                move || {
                    for (ub, pr) in chunk.chunks_exact_mut(d).zip(batch) {
                        for (o, arow) in ub.iter_mut().zip(a.chunks_exact(din)) {
                            *o = dot(arow, &pr.norm);
                        }
                    }
                }
            })
            .collect(),
    );
    u
}

/// Forward, per vocabulary range: z = e_c · u_b stored [c][b], the range's max per sample,
/// then exp((z - max) / T) in place and its sum.
fn forward_ranges(
    rows: &[f32],
    d: usize,
    u: &[f32],
    bsz: usize,
    ranges: &[std::ops::Range<usize>],
    inv_t: f32,
) -> (Vec<f32>, Vec<Part>) {
    let nv = rows.len() / d;
    let mut z = vec![0.0f32; nv * bsz];
    let parts: Vec<Part> = {
        let mut rest = z.as_mut_slice();
        let mut chunks = Vec::with_capacity(ranges.len());
        for r in ranges {
            let (head, tail) = rest.split_at_mut(r.len() * bsz);
            chunks.push(head);
            rest = tail;
        }
        run_all(
            ranges
                .iter()
                .zip(chunks)
                .map(|(r, zc)| {
                    let r = r.clone();
                    move || forward(&rows[r.start * d..r.end * d], r.start, d, u, zc, inv_t)
                })
                .collect(),
        )
    };
    (z, parts)
}

/// The ranges combined, per sample: the global max of z, its row, and the sum of
/// exp((z - max) / T).
struct Softmax {
    max: Vec<f32>,
    arg: Vec<usize>,
    sum: Vec<f64>,
}

impl Softmax {
    fn combine(parts: &[Part], bsz: usize, inv_t: f32) -> Self {
        let mut max = vec![f32::NEG_INFINITY; bsz];
        let mut arg = vec![0usize; bsz];
        for part in parts {
            for b in 0..bsz {
                if part.max[b] > max[b] {
                    max[b] = part.max[b];
                    arg[b] = part.arg[b];
                }
            }
        }
        let mut sum = vec![0.0f64; bsz];
        for part in parts {
            for b in 0..bsz {
                sum[b] += part.sum[b] * (f64::from(part.max[b] - max[b]) * f64::from(inv_t)).exp();
            }
        }
        Self { max, arg, sum }
    }
}

/// A sparse correction to dZ: (vocabulary row, sample, value).
type Correction = (usize, usize, f32);

/// Per sample: the loss terms into `stats`, and the sparse part of dZ (on top and cand rows,
/// sorted by row then sample) with each sample's weight of the dense softmax part.
fn loss_terms(
    batch: &[&Prep],
    rows: &[f32],
    d: usize,
    u: &[f32],
    soft: &Softmax,
    p: &Params,
    stats: &mut Stats,
) -> (Vec<Correction>, Vec<f32>) {
    let bsz = batch.len();
    let temp = p.temperature;
    let inv_t = 1.0 / temp;
    let w = 1.0 / bsz as f32;
    let t2 = f64::from(temp) * f64::from(temp);
    let mut corr: Vec<Correction> = Vec::new();
    let mut qw = vec![0.0f32; bsz];
    for (b, pr) in batch.iter().enumerate() {
        let ub = &u[b * d..(b + 1) * d];
        let lse = f64::from(soft.max[b]) * f64::from(inv_t) + soft.sum[b].ln();
        if !pr.top.is_empty() {
            stats.n_top += 1;
            stats.top1 += usize::from(pr.top1 == Some(soft.arg[b]));
            qw[b] = w * temp;
            let teacher: Vec<f32> = pr.top.iter().map(|&(_, l)| l).collect();
            let pt = softmax64(&teacher, inv_t);
            let mut kd = 0.0;
            for (&(r, _), &pc) in pr.top.iter().zip(&pt) {
                if pc > 0.0 {
                    let zc = dot(&rows[r * d..(r + 1) * d], ub);
                    kd += pc * (pc.ln() - (f64::from(zc) * f64::from(inv_t) - lse));
                }
                corr.push((r, b, -w * temp * pc as f32));
            }
            stats.kd += t2 * kd;
        }
        if !pr.cand.is_empty() {
            stats.n_cand += 1;
            let teacher: Vec<f32> = pr.cand.iter().map(|&(_, l)| l).collect();
            let student: Vec<f32> = pr
                .cand
                .iter()
                .map(|&(r, _)| dot(&rows[r * d..(r + 1) * d], ub))
                .collect();
            stats.cand_top1 += usize::from(argmax(&teacher) == argmax(&student));
            let pc = softmax64(&teacher, inv_t);
            let qc = softmax64(&student, inv_t);
            let lse_s = logsumexp(&student, inv_t);
            let mut kl = 0.0;
            for (((&(r, _), &pj), &qj), &zj) in pr.cand.iter().zip(&pc).zip(&qc).zip(&student) {
                if pj > 0.0 {
                    kl += pj * (pj.ln() - (f64::from(zj) * f64::from(inv_t) - lse_s));
                }
                corr.push((r, b, w * p.lambda * temp * (qj - pj) as f32));
            }
            stats.cand += t2 * kl;
        }
    }
    corr.sort_unstable_by_key(|&(r, b, _)| (r, b));
    (corr, qw)
}

/// Backward, per vocabulary range: dZ = qw * softmax + corrections, dU_t = E_t^T dZ_t; the
/// ranges' dU summed.
#[allow(clippy::too_many_arguments)]
fn backward_ranges(
    rows: &[f32],
    d: usize,
    bsz: usize,
    ranges: &[std::ops::Range<usize>],
    parts: &[Part],
    z: &[f32],
    soft: &Softmax,
    qw: &[f32],
    corr: &[Correction],
    inv_t: f32,
) -> Vec<f32> {
    let (max, sum) = (&soft.max, &soft.sum);
    let partials = run_all(
        ranges
            .iter()
            .zip(parts)
            .map(|(r, part)| {
                let r = r.clone();
                move || {
                    // q = e_range * exp((max_range - max) / T) / sum.
                    let f: Vec<f32> = (0..bsz)
                        .map(|b| {
                            let scale =
                                (f64::from(part.max[b] - max[b]) * f64::from(inv_t)).exp() / sum[b];
                            (f64::from(qw[b]) * scale) as f32
                        })
                        .collect();
                    let lo = corr.partition_point(|c| c.0 < r.start);
                    let hi = corr.partition_point(|c| c.0 < r.end);
                    backward(
                        &rows[r.start * d..r.end * d],
                        r.start,
                        d,
                        &z[r.start * bsz..r.end * bsz],
                        &f,
                        &corr[lo..hi],
                    )
                }
            })
            .collect(),
    );
    let mut partials = partials.into_iter();
    let mut du = partials.next().expect("at least one range");
    for part in partials {
        du.iter_mut().zip(&part).for_each(|(x, y)| *x += y);
    }
    du
}

/// dA[i][j] = sum_b du_b[i] * n_b[j] into `grad`, split across threads by rows of A.
fn grad_of_a(grad: &mut [f32], du: &[f32], batch: &[&Prep], d: usize, threads: usize) {
    let per = d.div_ceil(threads);
    let din = batch[0].norm.len();
    run_all(
        grad.chunks_mut(per * din)
            .enumerate()
            .map(|(k, chunk)| {
                move || {
                    for (i, grow) in chunk.chunks_exact_mut(din).enumerate() {
                        let i = k * per + i;
                        grow.fill(0.0);
                        for (b, pr) in batch.iter().enumerate() {
                            let g = du[b * d + i];
                            if g != 0.0 {
                                axpy(grow, g, &pr.norm);
                            }
                        }
                    }
                }
            })
            .collect(),
    );
}

/// What a forward thread found in its vocabulary range.
struct Part {
    /// Max of z per sample over the range.
    max: Vec<f32>,
    /// Its vocabulary row.
    arg: Vec<usize>,
    /// sum over the range of exp((z - max) / T), per sample.
    sum: Vec<f64>,
}

/// The forward pass over one vocabulary range: `rows` (its embedding rows, the first being
/// vocabulary row `start`), `u` (B x d), into `z` ([c][b]); leaves exp((z - max) / T) in `z`.
/// One dot product per (row, sample): a blocked kernel (several rows against one `u`) came out
/// 2-5x slower, LLVM's SLP pass vectorising it across the rows with shuffles, while the single
/// dot vectorises cleanly; the row stays in L1 while the batch's `u` (B x d) sits in L2.
fn forward(rows: &[f32], start: usize, d: usize, u: &[f32], z: &mut [f32], inv_t: f32) -> Part {
    let bsz = u.len() / d;
    for (c, e) in rows.chunks_exact(d).enumerate() {
        for (b, ub) in u.chunks_exact(d).enumerate() {
            z[c * bsz + b] = dot(e, ub);
        }
    }
    let mut max = vec![f32::NEG_INFINITY; bsz];
    let mut arg = vec![start; bsz];
    for (c, zr) in z.chunks_exact(bsz).enumerate() {
        for (b, &x) in zr.iter().enumerate() {
            if x > max[b] {
                max[b] = x;
                arg[b] = start + c;
            }
        }
    }
    let mut sum = vec![0.0f64; bsz];
    for zr in z.chunks_exact_mut(bsz) {
        for ((x, &m), s) in zr.iter_mut().zip(&max).zip(&mut sum) {
            *x = ((*x - m) * inv_t).exp();
            *s += f64::from(*x);
        }
    }
    Part { max, arg, sum }
}

/// The backward pass over one vocabulary range: dZ[c][b] = f[b] * ez[c][b] plus the
/// corrections on (row, sample); returns this range's dU (B x d).
fn backward(
    rows: &[f32],
    start: usize,
    d: usize,
    ez: &[f32],
    f: &[f32],
    corr: &[(usize, usize, f32)],
) -> Vec<f32> {
    let bsz = f.len();
    let nr = rows.len() / d;
    let mut du = vec![0.0f32; bsz * d];
    let mut dz = vec![0.0f32; 4 * bsz];
    let mut ci = 0;
    let mut c = 0;
    while c < nr {
        let n = (nr - c).min(4);
        for k in 0..n {
            let dzr = &mut dz[k * bsz..(k + 1) * bsz];
            for ((o, &e), &fb) in dzr
                .iter_mut()
                .zip(&ez[(c + k) * bsz..(c + k + 1) * bsz])
                .zip(f)
            {
                *o = e * fb;
            }
            while ci < corr.len() && corr[ci].0 == start + c + k {
                dzr[corr[ci].1] += corr[ci].2;
                ci += 1;
            }
        }
        if n == 4 {
            let e = &rows[c * d..(c + 4) * d];
            let (e0, e) = e.split_at(d);
            let (e1, e) = e.split_at(d);
            let (e2, e3) = e.split_at(d);
            for (b, dub) in du.chunks_exact_mut(d).enumerate() {
                let g = [dz[b], dz[bsz + b], dz[2 * bsz + b], dz[3 * bsz + b]];
                axpy4(dub, g, e0, e1, e2, e3);
            }
        } else {
            for k in 0..n {
                let e = &rows[(c + k) * d..(c + k + 1) * d];
                for (b, dub) in du.chunks_exact_mut(d).enumerate() {
                    let g = dz[k * bsz + b];
                    if g != 0.0 {
                        axpy(dub, g, e);
                    }
                }
            }
        }
        c += n;
    }
    du
}

/// Run `jobs`, the first on this thread and the others on scoped threads; their results in
/// order.
fn run_all<T: Send, F: FnOnce() -> T + Send>(jobs: Vec<F>) -> Vec<T> {
    let mut jobs = jobs.into_iter();
    let Some(first) = jobs.next() else {
        return Vec::new();
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs.map(|job| s.spawn(job)).collect();
        let mut out = Vec::with_capacity(handles.len() + 1);
        out.push(first());
        out.extend(
            handles
                .into_iter()
                .map(|h| h.join().expect("head worker panicked")),
        );
        out
    })
}

/// Threads worth using for a mini-batch of `bsz` samples over `nv` rows of width `d`: one per
/// 2^21 multiply-adds of the forward product at least, spawning costs more below that.
pub(super) fn threads_for(threads: usize, nv: usize, bsz: usize, d: usize) -> usize {
    threads.clamp(1, 1 + nv * bsz * d / (1 << 21))
}

/// `n` contiguous near-equal ranges covering `0..len` (fewer if `len < n`).
fn split(len: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.clamp(1, len.max(1));
    (0..n).map(|k| k * len / n..(k + 1) * len / n).collect()
}

/// `y += g * x`.
fn axpy(y: &mut [f32], g: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += g * x;
    }
}

/// `y += g0 e0 + g1 e1 + g2 e2 + g3 e3`: one read and write of `y` for four rows.
fn axpy4(y: &mut [f32], g: [f32; 4], e0: &[f32], e1: &[f32], e2: &[f32], e3: &[f32]) {
    let d = y.len();
    let (e0, e1, e2, e3) = (&e0[..d], &e1[..d], &e2[..d], &e3[..d]);
    for i in 0..d {
        y[i] += g[0] * e0[i] + g[1] * e1[i] + g[2] * e2[i] + g[3] * e3[i];
    }
}

/// softmax(x * inv_t) in f64.
fn softmax64(x: &[f32], inv_t: f32) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = x
        .iter()
        .map(|&v| ((f64::from(v) - f64::from(max)) * f64::from(inv_t)).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// log sum exp(x * inv_t), in f64.
fn logsumexp(x: &[f32], inv_t: f32) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m = f64::from(max) * f64::from(inv_t);
    m + x
        .iter()
        .map(|&v| (f64::from(v) * f64::from(inv_t) - m).exp())
        .sum::<f64>()
        .ln()
}

/// The index of the largest value (the first on ties).
fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accept::SplitMix64;
    use crate::head::tests::{random, sym};
    use crate::head::train::prepare;
    use crate::head::{Sample, Vocab};

    #[test]
    fn the_gradient_matches_finite_differences() {
        let (d, nv) = (37, 13);
        let mut rng = SplitMix64(5);
        let vocab = Vocab {
            ids: (0..nv as i32).collect(),
            rows: random(&mut rng, nv * d, 1.0),
        };
        let samples: Vec<Sample> = (0..5)
            .map(|k| Sample {
                hidden: random(&mut rng, d, 2.0),
                top: (0..3)
                    .map(|j| ((k + 2 * j) % nv as i32, 4.0 - j as f32))
                    .collect(),
                cand: (0..3)
                    .map(|j| ((k + 5 * j + 1) % nv as i32, sym(&mut rng) * 3.0))
                    .collect(),
            })
            .collect();
        let prep = prepare(&samples, &vocab, d);
        let batch: Vec<&Prep> = prep.iter().collect();
        let a = random(&mut rng, d * d, 0.3);
        let p = Params {
            temperature: 1.7,
            lambda: 0.6,
            threads: 2,
        };
        let loss =
            |a: &[f32]| loss_and_grad(&batch, &vocab.rows, d, a, &p, None).objective(p.lambda);
        let mut grad = vec![0.0; d * d];
        let stats = loss_and_grad(&batch, &vocab.rows, d, &a, &p, Some(&mut grad));
        assert!((stats.objective(p.lambda) - loss(&a)).abs() < 1e-9);
        // The same on one and on three threads.
        for threads in [1, 3] {
            let mut g = vec![0.0; d * d];
            let q = Params { threads, ..p };
            let s = loss_and_grad(&batch, &vocab.rows, d, &a, &q, Some(&mut g));
            assert!((s.objective(p.lambda) - stats.objective(p.lambda)).abs() < 1e-5);
            assert!(g.iter().zip(&grad).all(|(x, y)| (x - y).abs() < 1e-5));
        }
        let eps = 1e-2;
        let mut checked = 0;
        for k in (0..d * d).step_by(37) {
            let mut plus = a.clone();
            plus[k] += eps;
            let mut minus = a.clone();
            minus[k] -= eps;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * f64::from(eps));
            let g = f64::from(grad[k]);
            assert!(
                (fd - g).abs() < 1e-3 + 1e-2 * g.abs(),
                "A[{k}]: analytic {g}, numeric {fd}"
            );
            checked += 1;
        }
        assert!(checked >= 9);
        assert!(
            grad.iter().any(|&g| g.abs() > 1e-2),
            "a trivial gradient checks nothing"
        );
    }
}

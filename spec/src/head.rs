//! Early-exit heads (Lever §4.3, Eq. 7-11): a predictor at a middle layer `L` of the target
//! model that scores candidate next tokens from the hidden state there, so that token-tree
//! branches the full model would reject can be pruned before the remaining layers run.
//!
//! Lever's predictor is a `vocab x d` matrix. Leap's head is factored through the model's own
//! frozen output embedding instead, so it can score any token without shipping a second
//! `vocab x d` matrix:
//!
//! ```text
//! score(c | h) = e_c · u,   u = A · n(h),   n(h) = h / sqrt(mean(h_i^2) + 1e-6)
//! ```
//!
//! where `e_c` is row `c` of the output matrix and `A` (`d x d`) is the only thing training
//! learns. Training (Eq. 8-10) distils the full model's final distribution into the head over a
//! restricted vocabulary (the tokens the training samples mention): a knowledge-distillation
//! term towards the teacher's top-K and a candidate-set term that ranks each position's
//! draft candidates like the teacher does. At inference the scores of a node's candidates
//! (its children plus shadow tokens) are normalised among themselves ([`candidate_softmax`],
//! Eq. 11).
//!
//! Training is a few passes of mini-batch Adam; per mini-batch the student logits over the
//! restricted vocabulary are one `|vocab| x d` by `d x B` product, split across threads by
//! vocabulary ranges.

use std::ops::Range;

use rustc_hash::FxHashMap;

use crate::accept::{SplitMix64, Uniform};

/// The epsilon under the square root of [`rms_normalize`].
const RMS_EPS: f64 = 1e-6;

/// An early-exit head.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    /// The layer whose output (`l_out-{layer}`) the head reads.
    pub layer: u32,
    /// Hidden-state width d.
    pub n_embd: usize,
    /// d x d, row-major: `u[i] = sum_j a[i * d + j] * n(h)[j]`.
    pub a: Vec<f32>,
    /// Temperature of the candidate normalisation (Eq. 11).
    pub temperature: f32,
    /// Shadow tokens: comparison references always added to a node's candidate set (Eq. 11),
    /// so that a lone child is still compared with something.
    pub shadow: Vec<i32>,
}

impl Head {
    /// The head's query vector `u = A · n(h)` into `out` (length d): a token's score is the
    /// dot product of its output-embedding row with `u`. Panics if `h`, `out` or `a` do not
    /// have the lengths `n_embd` says.
    pub fn project(&self, h: &[f32], out: &mut [f32]) {
        let d = self.n_embd;
        assert_eq!(h.len(), d, "hidden state length");
        assert_eq!(out.len(), d, "output length");
        assert_eq!(self.a.len(), d * d, "A is not d x d");
        let mut n = vec![0.0; d];
        rms_normalize(h, &mut n);
        for (o, row) in out.iter_mut().zip(self.a.chunks_exact(d.max(1))) {
            *o = dot(row, &n);
        }
    }
}

/// `n(h) = h / sqrt(mean(h_i^2) + 1e-6)` into `out`: the scale of a hidden state varies from
/// position to position, the head only looks at its direction. Panics if the lengths differ.
pub fn rms_normalize(h: &[f32], out: &mut [f32]) {
    assert_eq!(h.len(), out.len(), "rms_normalize: lengths differ");
    if h.is_empty() {
        return;
    }
    let ms = h.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / h.len() as f64;
    let inv = (1.0 / (ms + RMS_EPS).sqrt()) as f32;
    for (o, &x) in out.iter_mut().zip(h) {
        *o = x * inv;
    }
}

/// Eq. 11: the softmax of `scores / temperature` over a node's candidate set (its children
/// and the shadow tokens), in the order given. The result is a local relative score, not a
/// probability over the vocabulary. Scores of -inf get 0 (all zeros if every score is -inf);
/// an empty input gives an empty output. Panics unless `temperature > 0`.
pub fn candidate_softmax(scores: &[f32], temperature: f32) -> Vec<f32> {
    assert!(
        temperature > 0.0,
        "candidate_softmax: temperature must be positive"
    );
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return vec![0.0; scores.len()];
    }
    let t = f64::from(temperature);
    let e: Vec<f64> = scores
        .iter()
        .map(|&s| ((f64::from(s) - f64::from(max)) / t).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|&x| (x / sum) as f32).collect()
}

/// One training position.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Hidden state at layer L (length d).
    pub hidden: Vec<f32>,
    /// The teacher's (the full model's final) top-K tokens and their final logits, best first.
    pub top: Vec<(i32, f32)>,
    /// The candidate set of this position (Eq. 10): tokens with the teacher's final logits.
    pub cand: Vec<(i32, f32)>,
}

/// The restricted vocabulary training works over: the union of every sample's `top` and
/// `cand` tokens, with their output-embedding rows. Scoring the whole vocabulary per position
/// would cost 10-20x more and teach the head little: tokens no sample mentions are tokens the
/// teacher gives next to no probability.
#[derive(Debug, Clone)]
pub struct Vocab {
    /// The token ids, one per row.
    pub ids: Vec<i32>,
    /// ids.len() x d, row-major f32: row `r` is the output-embedding row of `ids[r]`.
    pub rows: Vec<f32>,
}

impl Vocab {
    /// The ids a set of samples needs (sorted, deduplicated): every `top` and `cand` token.
    pub fn needed(samples: &[Sample]) -> Vec<i32> {
        let mut ids: Vec<i32> = samples
            .iter()
            .flat_map(|s| s.top.iter().chain(&s.cand).map(|&(t, _)| t))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// How [`train`] trains.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Passes over the samples.
    pub epochs: usize,
    /// Samples per mini-batch.
    pub batch: usize,
    /// Adam's learning rate.
    pub lr: f32,
    /// The distillation temperature T of Eq. 9 (and of Eq. 10's softmaxes).
    pub kd_temperature: f32,
    /// The weight λ of the candidate-set term (Eq. 8).
    pub lambda: f32,
    /// Threads the per-batch products are split across.
    pub threads: usize,
    /// Seed of the per-epoch shuffle.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 4,
            batch: 64,
            lr: 1e-3,
            kd_temperature: 1.0,
            lambda: 1.0,
            threads: 2,
            seed: 0,
        }
    }
}

/// Progress callback payload: sent after every mini-batch.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// The epoch, from 0.
    pub epoch: usize,
    /// Mini-batches done in this epoch (1 after the first).
    pub step: usize,
    /// Mini-batches per epoch.
    pub steps: usize,
    /// The mini-batch's mean loss `L_kd + λ L_cand`, before the update.
    pub loss: f32,
}

/// Quality of a head on samples (use held-out ones).
#[derive(Debug, Clone, Copy, Default)]
pub struct Eval {
    /// How often the head's best token over the restricted vocabulary is the teacher's top-1
    /// (over the samples with a `top`).
    pub top1: f64,
    /// How often, within each sample's candidate set, the head's best candidate is the
    /// teacher's best candidate (over the samples with a `cand`).
    pub cand_top1: f64,
    /// Mean distillation term (Eq. 9) at temperature 1.
    pub kd: f64,
    /// Mean candidate-set term (Eq. 10) at temperature 1.
    pub cand: f64,
}

/// Train `A` from `init` (d x d) on `samples` over `vocab`; returns the trained `A`. The loss
/// of a sample is `L_kd + λ L_cand` (Eq. 8-10) at temperature `cfg.kd_temperature`, averaged
/// over mini-batches of shuffled samples, minimised with Adam. Tokens of a sample that are not
/// in `vocab` are left out of its loss (build `vocab` from [`Vocab::needed`] so none is).
/// `progress` hears of every mini-batch. Panics if the lengths disagree (`init` is not d x d,
/// `vocab.rows` not `ids.len() x d`, a hidden state not of length d).
pub fn train(
    samples: &[Sample],
    vocab: &Vocab,
    init: Vec<f32>,
    cfg: &TrainConfig,
    progress: &mut dyn FnMut(Progress),
) -> Vec<f32> {
    let mut a = init;
    let Some(d) = samples.first().map(|s| s.hidden.len()) else {
        return a;
    };
    assert_eq!(a.len(), d * d, "init is not d x d");
    let prep = prepare(samples, vocab, d);
    if vocab.ids.is_empty() {
        return a;
    }
    let params = Params {
        temperature: cfg.kd_temperature,
        lambda: cfg.lambda,
        threads: threads_for(cfg.threads, vocab.ids.len(), cfg.batch.max(1), d),
    };
    let bsz = cfg.batch.max(1);
    let steps = samples.len().div_ceil(bsz);
    let mut order: Vec<usize> = (0..samples.len()).collect();
    let mut rng = SplitMix64(cfg.seed ^ 0x4EAD_5EED_0000_0000);
    let mut grad = vec![0.0f32; d * d];
    let mut m = vec![0.0f32; d * d];
    let mut v = vec![0.0f32; d * d];
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    let mut t = 0i32;
    for epoch in 0..cfg.epochs {
        for i in (1..order.len()).rev() {
            let j = ((rng.uniform() * (i + 1) as f64) as usize).min(i);
            order.swap(i, j);
        }
        for (step, idx) in order.chunks(bsz).enumerate() {
            let batch: Vec<&Prep> = idx.iter().map(|&i| &prep[i]).collect();
            let stats = loss_and_grad(&batch, &vocab.rows, d, &a, &params, Some(&mut grad));
            t += 1;
            let c1 = 1.0 - b1.powi(t);
            let c2 = 1.0 - b2.powi(t);
            for (((w, g), m), v) in a.iter_mut().zip(&grad).zip(&mut m).zip(&mut v) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *w -= cfg.lr * (*m / c1) / ((*v / c2).sqrt() + eps);
            }
            progress(Progress {
                epoch,
                step: step + 1,
                steps,
                loss: stats.objective(cfg.lambda) as f32,
            });
        }
    }
    a
}

/// Evaluate `A` on `samples` over `vocab` (which should hold every token they mention: a
/// teacher top-1 missing from it counts as a miss), in mini-batches of 64 on the default
/// config's threads. Panics if the lengths disagree.
pub fn evaluate(samples: &[Sample], vocab: &Vocab, a: &[f32]) -> Eval {
    let Some(d) = samples.first().map(|s| s.hidden.len()) else {
        return Eval::default();
    };
    assert_eq!(a.len(), d * d, "A is not d x d");
    let prep = prepare(samples, vocab, d);
    if vocab.ids.is_empty() {
        return Eval::default();
    }
    let params = Params {
        temperature: 1.0,
        lambda: 1.0,
        threads: threads_for(TrainConfig::default().threads, vocab.ids.len(), 64, d),
    };
    let mut total = Stats::default();
    for chunk in prep.chunks(64) {
        let batch: Vec<&Prep> = chunk.iter().collect();
        let s = loss_and_grad(&batch, &vocab.rows, d, a, &params, None);
        total.kd += s.kd;
        total.cand += s.cand;
        total.top1 += s.top1;
        total.cand_top1 += s.cand_top1;
        total.n_top += s.n_top;
        total.n_cand += s.n_cand;
    }
    let ratio = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
    Eval {
        top1: ratio(total.top1 as f64, total.n_top),
        cand_top1: ratio(total.cand_top1 as f64, total.n_cand),
        kd: ratio(total.kd, total.n_top),
        cand: ratio(total.cand, total.n_cand),
    }
}

/// A sample with its hidden state normalised and its tokens mapped to vocabulary rows.
#[derive(Debug, Clone)]
struct Prep {
    /// n(h).
    norm: Vec<f32>,
    /// (row, teacher logit) of the `top` tokens found in the vocabulary.
    top: Vec<(usize, f32)>,
    /// The row of the teacher's top-1 (None if it is not in the vocabulary or `top` is empty).
    top1: Option<usize>,
    /// (row, teacher logit) of the `cand` tokens found in the vocabulary.
    cand: Vec<(usize, f32)>,
}

fn prepare(samples: &[Sample], vocab: &Vocab, d: usize) -> Vec<Prep> {
    assert_eq!(
        vocab.rows.len(),
        vocab.ids.len() * d,
        "vocab rows are not ids.len() x d"
    );
    let index: FxHashMap<i32, usize> = vocab.ids.iter().enumerate().map(|(r, &t)| (t, r)).collect();
    let map = |list: &[(i32, f32)]| -> Vec<(usize, f32)> {
        list.iter()
            .filter_map(|&(t, l)| index.get(&t).map(|&r| (r, l)))
            .collect()
    };
    samples
        .iter()
        .map(|s| {
            assert_eq!(s.hidden.len(), d, "hidden state length");
            let mut norm = vec![0.0; d];
            rms_normalize(&s.hidden, &mut norm);
            Prep {
                norm,
                top: map(&s.top),
                top1: s.top.first().and_then(|(t, _)| index.get(t).copied()),
                cand: map(&s.cand),
            }
        })
        .collect()
}

/// The loss's knobs.
#[derive(Debug, Clone, Copy)]
struct Params {
    temperature: f32,
    lambda: f32,
    threads: usize,
}

/// Sums over a mini-batch.
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    /// Samples in the batch.
    n: usize,
    /// Sum of L_kd.
    kd: f64,
    /// Sum of L_cand (without λ).
    cand: f64,
    /// Samples whose student argmax over the vocabulary is the teacher's top-1.
    top1: usize,
    /// Samples whose best candidate by the student is the teacher's.
    cand_top1: usize,
    /// Samples with a `top` / with a `cand`.
    n_top: usize,
    n_cand: usize,
}

impl Stats {
    /// The mean loss the gradient is of.
    fn objective(&self, lambda: f32) -> f64 {
        (self.kd + f64::from(lambda) * self.cand) / self.n.max(1) as f64
    }
}

/// The loss `mean_b (L_kd + λ L_cand)` of a mini-batch and, into `grad` (d x d, overwritten),
/// its gradient with respect to `A`. The student logits are `Z = E U` (rows of E: the
/// vocabulary, columns of U: `u_b = A n_b`); `dZ = T (q - p)` per term; `dU = E^T dZ`;
/// `dA = sum_b du_b ⊗ n_b`.
fn loss_and_grad(
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
    let temp = p.temperature;
    let inv_t = 1.0 / temp;
    let threads = p.threads.max(1);

    // U: one row of d per sample.
    let mut u = vec![0.0f32; bsz * d];
    let per = bsz.div_ceil(threads);
    run_all(
        u.chunks_mut(per * d)
            .zip(batch.chunks(per))
            .map(|(chunk, batch)| {
                move || {
                    for (ub, pr) in chunk.chunks_exact_mut(d).zip(batch) {
                        for (o, arow) in ub.iter_mut().zip(a.chunks_exact(d)) {
                            *o = dot(arow, &pr.norm);
                        }
                    }
                }
            })
            .collect(),
    );

    // Forward, per vocabulary range: z = e_c · u_b stored [c][b], the range's max per sample,
    // then exp((z - max) / T) in place and its sum.
    let ranges = split(nv, threads);
    let mut z = vec![0.0f32; nv * bsz];
    let parts: Vec<Part> = {
        let mut rest = z.as_mut_slice();
        let mut chunks = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let (head, tail) = rest.split_at_mut(r.len() * bsz);
            chunks.push(head);
            rest = tail;
        }
        let u = &u;
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

    // Combine the ranges: the global max, argmax and sum of exp((z - max) / T) per sample.
    let mut max = vec![f32::NEG_INFINITY; bsz];
    let mut arg = vec![0usize; bsz];
    for part in &parts {
        for b in 0..bsz {
            if part.max[b] > max[b] {
                max[b] = part.max[b];
                arg[b] = part.arg[b];
            }
        }
    }
    let mut sum = vec![0.0f64; bsz];
    for part in &parts {
        for b in 0..bsz {
            sum[b] += part.sum[b] * (f64::from(part.max[b] - max[b]) * f64::from(inv_t)).exp();
        }
    }

    // Per sample: the loss terms and the sparse part of dZ (on top and cand rows).
    let w = 1.0 / bsz as f32;
    let t2 = f64::from(temp) * f64::from(temp);
    let mut corr: Vec<(usize, usize, f32)> = Vec::new();
    let mut qw = vec![0.0f32; bsz];
    for (b, pr) in batch.iter().enumerate() {
        let ub = &u[b * d..(b + 1) * d];
        let lse = f64::from(max[b]) * f64::from(inv_t) + sum[b].ln();
        if !pr.top.is_empty() {
            stats.n_top += 1;
            stats.top1 += usize::from(pr.top1 == Some(arg[b]));
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
    let Some(grad) = grad else {
        return stats;
    };
    assert_eq!(grad.len(), d * d, "grad is not d x d");
    corr.sort_unstable_by_key(|&(r, b, _)| (r, b));

    // Backward, per vocabulary range: dZ = qw * softmax + corrections, dU_t = E_t^T dZ_t.
    let (z, corr) = (&z, &corr);
    let (max, sum, qw) = (&max, &sum, &qw);
    let partials = run_all(
        ranges
            .iter()
            .zip(&parts)
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

    // dA[i][j] = sum_b du_b[i] * n_b[j], split across threads by rows of A.
    let per = d.div_ceil(threads);
    let du = &du;
    run_all(
        grad.chunks_mut(per * d)
            .enumerate()
            .map(|(k, chunk)| {
                move || {
                    for (i, grow) in chunk.chunks_exact_mut(d).enumerate() {
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
    stats
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
fn threads_for(threads: usize, nv: usize, bsz: usize, d: usize) -> usize {
    threads.clamp(1, 1 + nv * bsz * d / (1 << 21))
}

/// `n` contiguous near-equal ranges covering `0..len` (fewer if `len < n`).
fn split(len: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.clamp(1, len.max(1));
    (0..n).map(|k| k * len / n..(k + 1) * len / n).collect()
}

/// Lanes of the unrolled dot product: four AVX registers of f32, four independent chains.
const LANES: usize = 32;

/// `a · b` with LANES independent accumulators, so LLVM vectorises it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..LANES {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
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

    /// Uniform in [-1, 1).
    fn sym(rng: &mut SplitMix64) -> f32 {
        (rng.uniform() * 2.0 - 1.0) as f32
    }

    fn random(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| sym(rng) * scale).collect()
    }

    fn identity(d: usize) -> Vec<f32> {
        let mut a = vec![0.0; d * d];
        for i in 0..d {
            a[i * d + i] = 1.0;
        }
        a
    }

    #[test]
    fn project_and_rms_normalize_match_a_hand_computation() {
        let head = Head {
            layer: 7,
            n_embd: 3,
            a: vec![1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0, 1.0],
            temperature: 1.0,
            shadow: vec![],
        };
        // mean(h^2) = (1 + 4 + 4) / 3 = 3, so n(h) = h / sqrt(3).
        let mut u = [0.0; 3];
        head.project(&[1.0, 2.0, 2.0], &mut u);
        let s = (3.0f64 + 1e-6).sqrt() as f32;
        for (got, want) in u.iter().zip([1.0 / s, 4.0 / s, 5.0 / s]) {
            assert!((got - want).abs() < 1e-5, "{u:?}");
        }
        let mut n = [0.0; 7];
        rms_normalize(&[-3.0; 7], &mut n);
        assert!(n.iter().all(|&x| (x + 1.0).abs() < 1e-5), "{n:?}");
        rms_normalize(&[2.5; 7], &mut n);
        assert!(n.iter().all(|&x| (x - 1.0).abs() < 1e-5), "{n:?}");
    }

    #[test]
    #[should_panic]
    fn project_panics_on_a_wrong_length() {
        let head = Head {
            layer: 0,
            n_embd: 3,
            a: identity(3),
            temperature: 1.0,
            shadow: vec![],
        };
        head.project(&[1.0, 2.0], &mut [0.0; 3]);
    }

    #[test]
    fn candidate_softmax_normalises_in_order_and_zeroes_neg_inf() {
        let q = candidate_softmax(&[1.0, 3.0, 2.0, f32::NEG_INFINITY], 0.5);
        assert_eq!(q.len(), 4);
        assert!((q.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{q:?}");
        assert!(q[1] > q[2] && q[2] > q[0], "{q:?}");
        assert_eq!(q[3], 0.0);
        // Temperature 0.5: a gap of 1 is a factor e^2.
        assert!((q[1] / q[2] - 2f32.exp()).abs() < 1e-4, "{q:?}");
        assert_eq!(candidate_softmax(&[f32::NEG_INFINITY; 2], 1.0), [0.0, 0.0]);
        assert!(candidate_softmax(&[], 1.0).is_empty());
        assert_eq!(candidate_softmax(&[4.0], 1.0), [1.0]);
    }

    /// Samples of a planted head `a_true` over `vocab`: teacher logits exactly `e_c · A* n(h)`.
    fn planted(
        rng: &mut SplitMix64,
        n: usize,
        d: usize,
        vocab: &Vocab,
        a_true: &[f32],
    ) -> Vec<Sample> {
        let head = Head {
            layer: 0,
            n_embd: d,
            a: a_true.to_vec(),
            temperature: 1.0,
            shadow: vec![],
        };
        let nv = vocab.ids.len();
        let mut u = vec![0.0; d];
        (0..n)
            .map(|_| {
                let hidden: Vec<f32> = random(rng, d, 3.0);
                head.project(&hidden, &mut u);
                let logits: Vec<f32> = vocab.rows.chunks_exact(d).map(|e| dot(e, &u)).collect();
                let mut order: Vec<usize> = (0..nv).collect();
                order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
                let top: Vec<(i32, f32)> = order[..20]
                    .iter()
                    .map(|&r| (vocab.ids[r], logits[r]))
                    .collect();
                // The true best, one more of the top 20, two random others.
                let mut rows = vec![order[0], order[1 + (rng.uniform() * 19.0) as usize]];
                while rows.len() < 4 {
                    let r = (rng.uniform() * nv as f64) as usize;
                    if !rows.contains(&r) {
                        rows.push(r);
                    }
                }
                rows.swap(0, (rng.uniform() * 4.0) as usize);
                let cand = rows.iter().map(|&r| (vocab.ids[r], logits[r])).collect();
                Sample { hidden, top, cand }
            })
            .collect()
    }

    #[test]
    fn training_recovers_a_planted_head() {
        let (d, nv) = (16, 200);
        let mut rng = SplitMix64(11);
        let vocab = Vocab {
            ids: (0..nv as i32).map(|i| 1000 + 3 * i).collect(),
            rows: random(&mut rng, nv * d, 1.0),
        };
        // z = e · A* n(h) has a standard deviation of about 16 * 0.75 / 3 = 4.
        let a_true = random(&mut rng, d * d, 0.75);
        let train_set = planted(&mut rng, 3000, d, &vocab, &a_true);
        let held_out = planted(&mut rng, 500, d, &vocab, &a_true);
        let needed = Vocab::needed(&train_set);
        assert!(needed.windows(2).all(|w| w[0] < w[1]));
        assert!(needed.iter().all(|t| vocab.ids.contains(t)));

        let before = evaluate(&held_out, &vocab, &identity(d));
        let cfg = TrainConfig {
            epochs: 6,
            batch: 32,
            lr: 2e-2,
            ..TrainConfig::default()
        };
        let mut losses: Vec<Vec<f32>> = vec![Vec::new(); cfg.epochs];
        let mut steps = 0;
        let a = train(&train_set, &vocab, identity(d), &cfg, &mut |p| {
            assert_eq!(p.steps, 3000usize.div_ceil(32));
            assert!(p.loss.is_finite());
            losses[p.epoch].push(p.loss);
            steps += 1;
        });
        assert_eq!(steps, cfg.epochs * 3000usize.div_ceil(32));
        let after = evaluate(&held_out, &vocab, &a);
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        let first = mean(&losses[0][..10]);
        let last = mean(losses.last().unwrap());
        eprintln!(
            "planted head: identity {before:?}\n  trained {after:?}\n  loss first 10 steps {first:.3}, last epoch {last:.3}"
        );
        assert!(after.top1 > 0.9, "{after:?}");
        assert!(after.top1 > before.top1 + 0.5, "{before:?} -> {after:?}");
        assert!(after.cand_top1 > 0.95, "{after:?}");
        assert!(after.kd < before.kd / 2.0 && after.cand < before.cand / 2.0);
        assert!(last < first / 2.0, "loss {first} -> {last}");
    }

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

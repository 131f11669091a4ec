//! Training an early-exit head: the samples ([`Sample`]: a hidden state with the teacher's
//! top-K and candidate set), the restricted vocabulary they mention ([`Vocab`]), [`train`]
//! (shuffled mini-batches, Adam on `A`) and [`evaluate`] (top-1 agreement and the loss terms
//! on held-out samples). The loss and its gradient are `loss.rs`'s.

use rustc_hash::FxHashMap;

use super::loss::{loss_and_grad, threads_for, Params, Stats};
use super::rms_normalize;
use crate::accept::{SplitMix64, Uniform};

/// One training position.
#[derive(Debug, Clone)]
pub struct Sample {
    /// The head's input: the hidden state at layer L (length d); for a head that looks ahead
    /// ([`crate::ahead`]) the final hidden state and then the next token's output-embedding
    /// row (length 2d). Each d-vector is normalised on its own.
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

/// Train `A` from `init` (d x (inputs x d), d x d for an early-exit head) on `samples` over `vocab`; returns the trained `A`. The loss
/// of a sample is `L_kd + λ L_cand` (Eq. 8-10) at temperature `cfg.kd_temperature`, averaged
/// over mini-batches of shuffled samples, minimised with Adam. Tokens of a sample that are not
/// in `vocab` are left out of its loss (build `vocab` from [`Vocab::needed`] so none is).
/// `progress` hears of every mini-batch. Panics if the lengths disagree (`init` is not d by
/// the input's length, `vocab.rows` not `ids.len() x d`, an input not a whole number of
/// d-vectors).
pub fn train(
    samples: &[Sample],
    vocab: &Vocab,
    init: Vec<f32>,
    cfg: &TrainConfig,
    progress: &mut dyn FnMut(Progress),
) -> Vec<f32> {
    let mut a = init;
    let Some((d, din)) = widths(samples, vocab) else {
        return a;
    };
    assert_eq!(a.len(), d * din, "init is not d x (inputs x d)");
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
    let mut grad = vec![0.0f32; d * din];
    let mut m = vec![0.0f32; d * din];
    let mut v = vec![0.0f32; d * din];
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
    let Some((d, din)) = widths(samples, vocab) else {
        return Eval::default();
    };
    assert_eq!(a.len(), d * din, "A is not d x (inputs x d)");
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

/// The width `d` of the vocabulary's rows and of a sample's input (`d` times the vectors in
/// it), `None` without samples. Panics if the input is not a whole number of `d`-vectors.
fn widths(samples: &[Sample], vocab: &Vocab) -> Option<(usize, usize)> {
    let din = samples.first()?.hidden.len();
    let d = if vocab.ids.is_empty() {
        din
    } else {
        vocab.rows.len() / vocab.ids.len()
    };
    assert!(
        d > 0 && din % d == 0,
        "inputs of {din} values over rows of {d}"
    );
    Some((d, din))
}

/// A sample with its input normalised and its tokens mapped to vocabulary rows.
#[derive(Debug, Clone)]
pub(super) struct Prep {
    /// The input with each of its d-vectors normalised: n(h), or [n(h), n(e)] (a head that
    /// looks ahead, [`crate::ahead`]).
    pub(super) norm: Vec<f32>,
    /// (row, teacher logit) of the `top` tokens found in the vocabulary.
    pub(super) top: Vec<(usize, f32)>,
    /// The row of the teacher's top-1 (None if it is not in the vocabulary or `top` is empty).
    pub(super) top1: Option<usize>,
    /// (row, teacher logit) of the `cand` tokens found in the vocabulary.
    pub(super) cand: Vec<(usize, f32)>,
}

pub(super) fn prepare(samples: &[Sample], vocab: &Vocab, d: usize) -> Vec<Prep> {
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
            assert_eq!(s.hidden.len() % d, 0, "hidden state length");
            let mut norm = vec![0.0; s.hidden.len()];
            for (o, h) in norm.chunks_exact_mut(d).zip(s.hidden.chunks_exact(d)) {
                rms_normalize(h, o);
            }
            Prep {
                norm,
                top: map(&s.top),
                top1: s.top.first().and_then(|(t, _)| index.get(t).copied()),
                cand: map(&s.cand),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::head::tests::{identity, random};
    use crate::head::{dot, Head};

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

    /// A head with two inputs (as [`crate::ahead::Ahead`]) trains as one with one: samples of
    /// a planted d x 2d `A*`, recovered from a d x 2d start.
    #[test]
    fn training_recovers_a_planted_head_of_two_inputs() {
        let (d, nv) = (12, 150);
        let mut rng = SplitMix64(5);
        let vocab = Vocab {
            ids: (0..nv as i32).collect(),
            rows: random(&mut rng, nv * d, 1.0),
        };
        let truth = crate::ahead::Ahead {
            n_embd: d,
            a: random(&mut rng, 2 * d * d, 0.6),
        };
        let mut u = vec![0.0; d];
        let mut samples = |n: usize| -> Vec<Sample> {
            (0..n)
                .map(|_| {
                    // The second input on another scale: each is normalised on its own.
                    let mut x = random(&mut rng, d, 3.0);
                    x.extend(random(&mut rng, d, 0.2));
                    truth.query(&x[..d], &x[d..], &mut u);
                    let z: Vec<f32> = vocab.rows.chunks_exact(d).map(|e| dot(e, &u)).collect();
                    let mut order: Vec<usize> = (0..nv).collect();
                    order.sort_by(|&p, &q| z[q].total_cmp(&z[p]));
                    let top: Vec<(i32, f32)> =
                        order[..20].iter().map(|&r| (r as i32, z[r])).collect();
                    let cand = top[..4].to_vec();
                    Sample {
                        hidden: x,
                        top,
                        cand,
                    }
                })
                .collect()
        };
        let (train_set, held_out) = (samples(3000), samples(400));
        let init = vec![0.0; 2 * d * d];
        let before = evaluate(&held_out, &vocab, &init);
        let cfg = TrainConfig {
            epochs: 6,
            batch: 32,
            lr: 2e-2,
            ..TrainConfig::default()
        };
        let a = train(&train_set, &vocab, init, &cfg, &mut |_| {});
        let after = evaluate(&held_out, &vocab, &a);
        assert!(after.top1 > 0.85, "{before:?} -> {after:?}");
        assert!(after.top1 > before.top1 + 0.5, "{before:?} -> {after:?}");
        // The second input's half of A learned something: without it the guesses fall.
        let mut first_only = a.clone();
        for row in first_only.chunks_exact_mut(2 * d) {
            row[d..].fill(0.0);
        }
        let blind = evaluate(&held_out, &vocab, &first_only);
        assert!(blind.top1 < after.top1 - 0.2, "{blind:?} vs {after:?}");
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
}

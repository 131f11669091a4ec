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
//!
//! | file | owns |
//! |---|---|
//! | `head.rs` | the head ([`Head`]) and how it scores: [`rms_normalize`], [`candidate_softmax`] |
//! | `head/train.rs` | training data ([`Sample`], [`Vocab`]), [`train()`] (mini-batch Adam), [`evaluate`] |
//! | `head/loss.rs` | the loss (Eq. 8-10) and its gradient over the restricted vocabulary, split across threads |
//!
//! The head's place in a model's sidecar (writing and reading it) is [`crate::exit`]'s.

mod loss;
mod train;

pub use train::{evaluate, train, Eval, Progress, Sample, TrainConfig, Vocab};

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

/// Lanes of the unrolled dot product: four AVX registers of f32, four independent chains.
const LANES: usize = 32;

/// `a · b` with LANES independent accumulators, so LLVM vectorises it.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accept::{SplitMix64, Uniform};

    /// Uniform in [-1, 1).
    pub(super) fn sym(rng: &mut SplitMix64) -> f32 {
        (rng.uniform() * 2.0 - 1.0) as f32
    }

    pub(super) fn random(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| sym(rng) * scale).collect()
    }

    pub(super) fn identity(d: usize) -> Vec<f32> {
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
}

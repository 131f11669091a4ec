//! The target's next-token distribution under a sampler chain, for stochastic acceptance.
//!
//! Sampled speculative decoding keeps the target's distribution only if acceptance uses the
//! distribution the plain sampler draws from. Leap's plain sampler is llama.cpp's chain
//! `top_k -> top_p -> min_p -> temp -> dist` (host's `Sampler::new`); [`Truncation::apply`]
//! is that chain in Rust, with llama.cpp's semantics:
//!
//! - `top_k` keeps the k largest logits (`<= 0`: all);
//! - `top_p` takes the softmax of what is left (temperature 1), sorts it, and keeps the
//!   shortest prefix whose mass reaches `p` (at least one token);
//! - `min_p` keeps the tokens whose logit is at least `max + ln(min_p)` (probability at least
//!   `min_p` times the largest);
//! - `temp` divides the logits; the result is the softmax of what is left.

use leap_host::sampler::SamplingParams;

use crate::sam::Token;

/// A sparse normalised distribution: tokens with probability > 0, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct Sparse {
    /// `(token, probability)`, probabilities summing to 1.
    pub entries: Vec<(Token, f32)>,
}

impl Sparse {
    /// The probability of `t` (0 if truncated away).
    pub fn prob(&self, t: Token) -> f32 {
        self.entries.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1)
    }
}

/// The sampler chain's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Truncation {
    /// Temperature (> 0).
    pub temp: f32,
    /// Top-k (`<= 0`: off).
    pub top_k: i32,
    /// Top-p (`>= 1`: off).
    pub top_p: f32,
    /// Min-p (`<= 0`: off).
    pub min_p: f32,
}

impl From<&SamplingParams> for Truncation {
    fn from(p: &SamplingParams) -> Self {
        Self {
            temp: p.temp,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
        }
    }
}

impl Truncation {
    /// The distribution the chain samples from after `logits`.
    pub fn apply(&self, logits: &[f32]) -> Sparse {
        let n = logits.len();
        let k = if self.top_k <= 0 {
            n
        } else {
            (self.top_k as usize).min(n)
        };
        // The k largest logits, sorted descending (ties by token id, for determinism).
        let mut idx: Vec<u32> = (0..n as u32).collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if k < n {
            idx.select_nth_unstable_by(k - 1, by_logit);
            idx.truncate(k);
        }
        idx.sort_unstable_by(by_logit);
        let mut cand: Vec<(Token, f32)> = idx
            .into_iter()
            .map(|i| (i as Token, logits[i as usize]))
            .collect();

        if self.top_p < 1.0 {
            let p = softmax(cand.iter().map(|c| c.1));
            let mut cum = 0.0f64;
            let mut keep = cand.len();
            for (i, &x) in p.iter().enumerate() {
                cum += x as f64;
                if cum >= self.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if self.min_p > 0.0 {
            let floor = cand[0].1 + self.min_p.ln();
            let keep = cand.iter().take_while(|c| c.1 >= floor).count().max(1);
            cand.truncate(keep);
        }
        let temp = self.temp.max(f32::MIN_POSITIVE);
        let p = softmax(cand.iter().map(|c| c.1 / temp));
        Sparse {
            entries: cand.into_iter().map(|c| c.0).zip(p).collect(),
        }
    }
}

fn softmax(logits: impl Iterator<Item = f32> + Clone) -> Vec<f32> {
    let max = logits.clone().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.map(|l| ((l - max) as f64).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| (x / sum) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(temp: f32, top_k: i32, top_p: f32, min_p: f32) -> Truncation {
        Truncation {
            temp,
            top_k,
            top_p,
            min_p,
        }
    }

    #[test]
    fn without_truncation_it_is_the_tempered_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let d = t(0.5, 0, 1.0, 0.0).apply(&logits);
        let z: f64 = logits.iter().map(|&l| (l as f64 / 0.5).exp()).sum();
        for (i, &l) in logits.iter().enumerate() {
            let want = (l as f64 / 0.5).exp() / z;
            assert!((d.prob(i as Token) as f64 - want).abs() < 1e-6);
        }
        assert_eq!(d.entries[0].0, 1, "most likely first");
    }

    #[test]
    fn top_k_top_p_and_min_p_cut_like_llama_cpp() {
        // Raw probabilities (temperature 1): ~0.64, 0.24, 0.09, 0.03.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        assert_eq!(t(1.0, 2, 1.0, 0.0).apply(&logits).entries.len(), 2);
        // top-p 0.8: 0.64 < 0.8 <= 0.88 keeps two.
        assert_eq!(t(1.0, 0, 0.8, 0.0).apply(&logits).entries.len(), 2);
        // min-p 0.1: keeps p >= 0.064, i.e. three (0.09 / 0.64 = 0.135 >= 0.1).
        assert_eq!(t(1.0, 0, 1.0, 0.1).apply(&logits).entries.len(), 3);
        // Temperature applies after truncation: the two kept renormalise at temp 2.
        let d = t(2.0, 2, 1.0, 0.0).apply(&logits);
        let want = 1.0 / (1.0 + (-0.5f64).exp());
        assert!((d.prob(0) as f64 - want).abs() < 1e-6);
        assert_eq!(d.prob(3), 0.0);
    }
}

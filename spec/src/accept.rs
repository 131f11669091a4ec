//! Acceptance: which drafted tokens the target keeps after one verification call.
//!
//! Both functions walk a [`TokenTree`] from the root and always yield at least one token (the
//! llama.cpp contract): the accepted draft tokens, then the target's own token at the first
//! node where no draft survived (a correction, or a bonus token after a fully accepted path).
//!
//! - [`greedy`]: token equality with the target's argmax; the output is exactly what plain
//!   greedy decoding would produce, whatever the drafts.
//! - [`stochastic`]: speculative sampling for deterministic drafts by coupling: at a node with
//!   target distribution `p`, the target's token is drawn from `p` with the uniform of its
//!   position ([`position_uniform`]: a function of the seed and the position only), and the
//!   child drafting that token, if any, is accepted. Every emitted token is then distributed
//!   exactly as the target's `p` given the tokens before it, a node accepts with probability
//!   `sum p(c_i)` over its candidates (as SpecInfer's multi-round rejection with one-hot
//!   drafts), and the tokens are those plain sampling draws with the same seed, whatever was
//!   drafted.

use crate::sam::Token;
use crate::tree::{NodeId, TokenTree};

/// What one verification accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Accepted draft tokens followed by the target's own token (length >= 1).
    pub tokens: Vec<Token>,
    /// The last tree node on the accepted path (the root if no draft was accepted).
    pub node: NodeId,
}

/// Greedy acceptance. `argmax(node)` is the target's most likely next token after `node`'s
/// path (from the verification row of that node).
pub fn greedy(tree: &TokenTree, mut argmax: impl FnMut(NodeId) -> Token) -> Accepted {
    let mut at = 0;
    let mut tokens = Vec::new();
    loop {
        let next = argmax(at);
        tokens.push(next);
        match tree.child(at, next) {
            Some(c) => at = c,
            None => return Accepted { tokens, node: at },
        }
    }
}

/// A source of uniform random numbers in `[0, 1)`.
pub trait Uniform {
    /// The next number.
    fn uniform(&mut self) -> f64;
}

/// SplitMix64: small, fast, seedable; good enough for acceptance tests and sampling.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl Uniform for SplitMix64 {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The uniform number in `[0, 1)` that draws the token at sequence position `pos` of a
/// generation seeded with `seed`. Every sampling path draws position `pos`'s token from the
/// target's distribution with this number, so a seed gives the same text whatever was drafted
/// (and whether anything was).
pub fn position_uniform(seed: u32, pos: usize) -> f64 {
    SplitMix64((u64::from(seed) << 32) ^ (pos as u64) ^ 0x1EA9_5EED_0000_0000).uniform()
}

/// The token `u` (uniform in `[0, 1)`) picks from `entries` (`(token, probability)`, summing
/// to 1): the first whose cumulative probability exceeds `u` (the last one when rounding left
/// `u` beyond the sum).
pub fn pick(entries: &[(Token, f32)], u: f64) -> Token {
    let mut r = u;
    for &(t, p) in entries {
        r -= f64::from(p);
        if r < 0.0 {
            return t;
        }
    }
    entries.last().map_or(0, |e| e.0)
}

/// Stochastic acceptance. `dist(node)` is the target's distribution after `node`'s path
/// (`(token, probability)`, in a fixed order: the sampler chain's); `uniform(k)` the uniform
/// number of the `k`-th token this acceptance emits (its position's: [`position_uniform`]).
pub fn stochastic(
    tree: &TokenTree,
    mut dist: impl FnMut(NodeId) -> Vec<(Token, f32)>,
    mut uniform: impl FnMut(usize) -> f64,
) -> Accepted {
    let mut at = 0;
    let mut tokens = Vec::new();
    loop {
        let t = pick(&dist(at), uniform(tokens.len()));
        tokens.push(t);
        match tree.child(at, t) {
            Some(c) => at = c,
            None => return Accepted { tokens, node: at },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic "model": the greedy next token after a path.
    fn f(path: &[Token], vocab: i32) -> Token {
        let h = path.iter().fold(0x811C_9DC5u32, |h, &t| {
            (h ^ t as u32).wrapping_mul(0x0100_0193)
        });
        (h % vocab as u32) as Token
    }

    fn plain(root: Token, n: usize, vocab: i32) -> Vec<Token> {
        let mut path = vec![root];
        let mut out = Vec::new();
        for _ in 0..n {
            let t = f(&path, vocab);
            out.push(t);
            path.push(t);
        }
        out
    }

    #[test]
    fn greedy_equals_plain_decoding_on_random_and_adversarial_trees() {
        let vocab = 5;
        let mut rng = SplitMix64(42);
        for case in 0..2000 {
            let root = (case % vocab) as Token;
            let truth = plain(root, 12, vocab);
            let mut tree = TokenTree::new(root);
            let n_paths = 1 + (rng.uniform() * 4.0) as usize;
            for _ in 0..n_paths {
                let len = 1 + (rng.uniform() * 8.0) as usize;
                let mut path: Vec<Token> = truth[..len].to_vec();
                // Adversarial: the true continuation with one token changed, or random.
                match (rng.uniform() * 3.0) as u32 {
                    0 => {
                        let k = (rng.uniform() * len as f64) as usize;
                        path[k] =
                            (path[k] + 1 + (rng.uniform() * (vocab - 1) as f64) as i32) % vocab;
                    }
                    1 => path
                        .iter_mut()
                        .for_each(|t| *t = (rng.uniform() * vocab as f64) as Token),
                    _ => {}
                }
                tree.add_path(0, &path);
            }
            let acc = greedy(&tree, |node| {
                let mut p = vec![root];
                p.extend(tree.path(node));
                f(&p, vocab)
            });
            assert!(!acc.tokens.is_empty());
            assert_eq!(acc.tokens, truth[..acc.tokens.len()], "case {case}");
            assert_eq!(
                tree.path(acc.node),
                acc.tokens[..acc.tokens.len() - 1],
                "case {case}"
            );
        }
    }

    /// Target distributions over a 6-token vocabulary that depend on the path.
    fn target(path: &[Token]) -> Vec<f32> {
        let base = [0.30, 0.25, 0.20, 0.10, 0.10, 0.05];
        let shift = path.iter().map(|&t| t as usize).sum::<usize>() % 6;
        (0..6).map(|i| base[(i + shift) % 6]).collect()
    }

    /// A dense distribution's entries, normalised.
    fn sparse(p: &[f32]) -> Vec<(Token, f32)> {
        let z: f32 = p.iter().sum();
        p.iter()
            .enumerate()
            .filter(|(_, &x)| x > 0.0)
            .map(|(i, &x)| (i as Token, x / z))
            .collect()
    }

    #[test]
    fn a_seed_gives_the_same_tokens_whatever_was_drafted() {
        // The target: after any path, tokens 0..6 with target(path)'s probabilities.
        let d = |path: &[Token]| sparse(&target(path));
        let seed = 11;
        // Plain sampling: one token per position.
        let mut path = vec![0];
        for pos in 0..8 {
            let t = pick(&d(&path), position_uniform(seed, pos));
            path.push(t);
        }
        let plain = &path[1..];
        // Any drafts, right or wrong: the tokens are plain sampling's.
        let mut rng = SplitMix64(5);
        for _ in 0..200 {
            let mut out: Vec<Token> = Vec::new();
            while out.len() < 8 {
                let mut root_path = vec![0];
                root_path.extend(&out);
                let mut tree = TokenTree::new(*root_path.last().unwrap());
                for _ in 0..3 {
                    let draft: Vec<Token> =
                        (0..3).map(|_| (rng.uniform() * 6.0) as Token).collect();
                    tree.add_path(0, &draft);
                }
                let base = out.len();
                let a = stochastic(
                    &tree,
                    |n| {
                        let mut p = root_path.clone();
                        p.extend(tree.path(n));
                        d(&p)
                    },
                    |k| position_uniform(seed, base + k),
                );
                out.extend(a.tokens);
            }
            assert_eq!(&out[..8], plain);
        }
    }

    /// Pearson's chi-square statistic of counts against probabilities.
    fn chi2(counts: &[u64], p: &[f32]) -> f64 {
        let n: u64 = counts.iter().sum();
        let z: f32 = p.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&c, &q)| {
                let e = n as f64 * (q / z) as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn run(
        trials: u64,
        seed: u64,
        accept: impl Fn(&TokenTree, &mut SplitMix64) -> Accepted,
    ) -> (Vec<u64>, Vec<u64>) {
        // Root 0 with candidates 2, 0, 5; candidate 2 has its own candidates 1 and 3.
        let mut tree = TokenTree::new(0);
        tree.add_path(0, &[2, 1]);
        tree.add_path(0, &[2, 3]);
        tree.add_path(0, &[0]);
        tree.add_path(0, &[5]);
        let mut rng = SplitMix64(seed);
        let mut first = vec![0u64; 6];
        let mut second_after_2 = vec![0u64; 6];
        for _ in 0..trials {
            let a = accept(&tree, &mut rng);
            first[a.tokens[0] as usize] += 1;
            if a.tokens[0] == 2 {
                second_after_2[a.tokens[1] as usize] += 1;
            }
        }
        (first, second_after_2)
    }

    // 5 degrees of freedom: P(chi2 > 20.52) = 0.001.
    const CHI2_5_P001: f64 = 20.52;

    #[test]
    fn stochastic_acceptance_keeps_the_target_distribution() {
        let tree_dist = |tree: &TokenTree, node: NodeId| {
            let mut p = vec![0];
            p.extend(tree.path(node));
            target(&p)
        };
        let (first, second) = run(60_000, 7, |tree, rng| {
            stochastic(tree, |n| sparse(&tree_dist(tree, n)), |_| rng.uniform())
        });
        let c1 = chi2(&first, &target(&[0]));
        let c2 = chi2(&second, &target(&[0, 2]));
        assert!(c1 < CHI2_5_P001, "first token: chi2 {c1}, counts {first:?}");
        assert!(
            c2 < CHI2_5_P001,
            "second token after 2: chi2 {c2}, counts {second:?}"
        );
        // Drafts are accepted, not just resampled: some steps emit two or more tokens.
        let mut rng = SplitMix64(1);
        let mut tree = TokenTree::new(0);
        tree.add_path(0, &[0, 0]);
        let long = (0..1000)
            .filter(|_| {
                stochastic(&tree, |n| sparse(&tree_dist(&tree, n)), |_| rng.uniform())
                    .tokens
                    .len()
                    > 1
            })
            .count();
        assert!(long > 200, "{long}");
    }

    #[test]
    fn the_chi_square_test_catches_greedy_posing_as_sampling() {
        // A known bug elsewhere: "sampling" that silently became greedy.
        let (first, _) = run(60_000, 7, |tree, _| {
            greedy(tree, |n| {
                let mut p = vec![0];
                p.extend(tree.path(n));
                let d = target(&p);
                (0..6).max_by(|&a, &b| d[a].total_cmp(&d[b])).unwrap() as Token
            })
        });
        assert!(chi2(&first, &target(&[0])) > CHI2_5_P001);
    }

    #[test]
    fn a_tree_without_drafts_yields_one_sampled_token() {
        let tree = TokenTree::new(3);
        let mut rng = SplitMix64(3);
        let a = stochastic(&tree, |_| vec![(2, 1.0)], |_| rng.uniform());
        assert_eq!(
            a,
            Accepted {
                tokens: vec![2],
                node: 0
            }
        );
        let g = greedy(&tree, |_| 4);
        assert_eq!(
            g,
            Accepted {
                tokens: vec![4],
                node: 0
            }
        );
    }
}

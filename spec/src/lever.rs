//! Gain/cost token-tree construction (Lever §4.2, Eq. 1-6, Algorithm 1) for retrieval drafts.
//!
//! The drafters' proposals are merged into a candidate trie. Each candidate child `c` of a
//! node `n` gets the estimated probability that the target takes it once verification has
//! reached `n` (Eq. 3): `a(c) * a(c) / sum_j a(j)` over the siblings `j`, where `a` is the
//! controller's per-token acceptance for the evidence behind `c` (the length of the suffix
//! match its proposal continues). That keeps the ranking among siblings and lets a lone
//! candidate keep its full estimate. The reach probability `R(c)` is the product along the
//! path times `rho`, the online reliability factor, at most 1; the gain of a tree is
//! `G = 1 + sum R` (Eq. 2), its cost `C = c(rows)` from the controller's online latency
//! profile of this machine (Eq. 4; drafting costs microseconds and is left out).
//!
//! `rho` is measured as a ratio of sums (the drafts a tree got over the `sum R` it expected),
//! so it scales each reach once. Eq. 3 puts it in every level's probability instead, where it
//! compounds with depth: at `rho` = 1.16 a 15-token chain of per-token acceptance 0.82 looked
//! like 13 expected tokens, where such chains gave 5.5 (llama-server `--spec-type leap`,
//! Gemma 3, tuned-on requests 101-124; docs/measurements.md).
//!
//! Greedy expansion (Algorithm 1) inserts the frontier node with the largest `R / dC` (Eq. 5);
//! with a cost indexed by rows, `dC` is the same for every candidate, so that is the largest
//! `R`. Eq. 6 stops at the first node that does not raise `G / C`. On a CPU the cost curve
//! has steps (a 3-row call can cost more than a 4-row one), where that rule stops one node
//! short of a better tree, so Leap follows the greedy order up to the row cap and keeps the
//! prefix with the best `G / C`; and no tree at all unless it beats a plain step, or the
//! controller has gone long without drafting and explores ([`Controller::exploring`]).

use crate::control::{Controller, Evidence};
use crate::draft::Proposal;
use crate::sam::Token;
use crate::tree::TokenTree;

/// Match length credited to tokens carried over from the last step (accepted there, off the
/// trunk): as reliable as the longest matches.
pub const CARRY_MATCH: usize = 64;

/// One candidate node of the trie.
#[derive(Debug, Clone)]
struct Cand {
    token: Token,
    parent: usize,
    children: Vec<usize>,
    /// The best-backed proposal through this node (the one with the highest estimated
    /// acceptance): its source and suffix-match length.
    ev: Evidence,
    /// Reach probability.
    reach: f64,
}

/// A built tree with what the construction expected of it.
#[derive(Debug, Clone)]
pub struct Built {
    /// The tree (root = the last accepted token).
    pub tree: TokenTree,
    /// The evidence behind each tree node (default for the root), for the controller's
    /// feedback.
    pub evidence: Vec<Evidence>,
    /// Expected accepted drafts, `sum R` over the tree's nodes.
    pub expected: f64,
}

/// Build the tree after `root` from `proposals` with at most `max_rows` rows (root
/// included), `max_leaves` leaves (KV sequences) and paths of at most `max_depth` drafted
/// tokens.
pub fn build(
    root: Token,
    proposals: &[Proposal],
    control: &Controller,
    max_rows: usize,
    max_leaves: usize,
    max_depth: usize,
) -> Built {
    // The candidate trie; node 0 is the root.
    let mut trie = vec![Cand {
        token: root,
        parent: usize::MAX,
        children: Vec::new(),
        ev: Evidence::default(),
        reach: 1.0,
    }];
    for p in proposals {
        let mut at = 0;
        for &t in p.tokens.iter().take(max_depth) {
            let next = trie[at]
                .children
                .iter()
                .copied()
                .find(|&c| trie[c].token == t);
            at = match next {
                Some(c) => {
                    let ev = Evidence::new(p.source, p.match_len);
                    if control.acceptance(ev) > control.acceptance(trie[c].ev) {
                        trie[c].ev = ev;
                    }
                    c
                }
                None => {
                    let id = trie.len();
                    trie.push(Cand {
                        token: t,
                        parent: at,
                        children: Vec::new(),
                        ev: Evidence::new(p.source, p.match_len),
                        reach: 0.0,
                    });
                    trie[at].children.push(id);
                    id
                }
            };
        }
    }
    // Reach probabilities, parents before children (ids grow with depth along a path): the
    // estimates' product along the path, then scaled by the reliability once.
    for n in 0..trie.len() {
        let kids = trie[n].children.clone();
        let a: Vec<f64> = kids
            .iter()
            .map(|&c| control.acceptance(trie[c].ev))
            .collect();
        let sum: f64 = a.iter().sum();
        for (&c, &ac) in kids.iter().zip(&a) {
            trie[c].reach = (trie[n].reach * ac * ac / sum).min(trie[n].reach);
        }
    }
    let rho = control.reliability();
    for c in &mut trie[1..] {
        c.reach = (rho * c.reach).min(1.0);
    }
    // Greedy order: the frontier node with the largest reach first.
    // A node added under a parent that already has a child in the tree opens a new leaf.
    let mut order = Vec::new();
    let mut has_child = vec![false; trie.len()];
    let mut leaves = 1;
    let mut frontier: Vec<usize> = trie[0].children.clone();
    while order.len() + 1 < max_rows && !frontier.is_empty() {
        let (i, _) = frontier
            .iter()
            .enumerate()
            .max_by(|a, b| trie[*a.1].reach.total_cmp(&trie[*b.1].reach))
            .expect("frontier is not empty");
        let n = frontier.swap_remove(i);
        let parent = trie[n].parent;
        if has_child[parent] {
            if leaves >= max_leaves {
                continue;
            }
            leaves += 1;
        }
        has_child[parent] = true;
        order.push(n);
        frontier.extend(trie[n].children.iter().copied());
    }
    // The prefix of that order with the best gain per cost; the empty prefix is a plain step
    // (rate 1 / cost(1) = 1), and a tree must beat it by 2%. Exploring (see
    // `Controller::exploring`): the best non-empty prefix, even if it does not.
    let (mut best_len, mut best_rate) = (0usize, 1.0f64);
    let (mut any_len, mut any_rate) = (0usize, 0.0f64);
    let mut gain = 1.0;
    for (k, &n) in order.iter().enumerate() {
        gain += trie[n].reach;
        let rate = gain / control.tree_cost(k + 2);
        if rate > best_rate * 1.02 {
            best_rate = rate;
            best_len = k + 1;
        }
        if rate > any_rate {
            any_rate = rate;
            any_len = k + 1;
        }
    }
    if best_len == 0 && control.exploring() {
        best_len = any_len;
    }
    // Insert depth-first, most likely child first: every node after its parent, and the
    // first chain inserted (the tree's trunk, see `TokenTree::trunk_end`) is the most likely
    // path.
    let mut chosen = vec![false; trie.len()];
    for &n in &order[..best_len] {
        chosen[n] = true;
    }
    insert_dfs(&trie, &chosen, root)
}

/// The chosen trie nodes as a tree, inserted depth-first with the most likely child first.
fn insert_dfs(trie: &[Cand], chosen: &[bool], root: Token) -> Built {
    let mut b = Built {
        tree: TokenTree::new(root),
        evidence: vec![Evidence::default()],
        expected: 0.0,
    };
    fn visit(trie: &[Cand], chosen: &[bool], n: usize, at: usize, b: &mut Built) {
        let mut kids: Vec<usize> = trie[n]
            .children
            .iter()
            .copied()
            .filter(|&c| chosen[c])
            .collect();
        kids.sort_by(|x, y| trie[*y].reach.total_cmp(&trie[*x].reach));
        for c in kids {
            let id = b.tree.add(at, trie[c].token, None);
            b.evidence.push(trie[c].ev);
            b.expected += trie[c].reach;
            visit(trie, chosen, c, id, b);
        }
    }
    visit(trie, chosen, 0, 0, &mut b);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Source;

    fn prop(tokens: &[Token], match_len: usize) -> Proposal {
        Proposal {
            tokens: tokens.to_vec(),
            match_len,
            source: Source::Request,
        }
    }

    const ALL: [Source; 8] = [
        Source::Request,
        Source::Corpus,
        Source::Sibling,
        Source::History,
        Source::Reuse,
        Source::Calibrated,
        Source::Model,
        Source::Carry,
    ];

    /// A controller that has seen per-token acceptance `acc` at every match length and a
    /// linear cost curve of slope `slope`.
    fn trained(acc: f64, slope: f64) -> Controller {
        let mut c = Controller::new(slope);
        for s in ALL {
            for m in [1, 2, 4, 8, 16, 32, CARRY_MATCH] {
                for i in 0..1000 {
                    c.record_token(Evidence::new(s, m), (i as f64) < acc * 1000.0);
                }
            }
        }
        for _ in 0..50 {
            c.record_cost(1, 0.02);
            for r in 2..=17 {
                c.record_cost(r, 0.02 * (1.0 + slope * (r - 1) as f64));
            }
        }
        c
    }

    #[test]
    fn a_reliable_lone_proposal_is_a_chain_as_long_as_it_pays() {
        let cheap = trained(0.9, 0.05);
        let b = build(0, &[prop(&[1, 2, 3, 4, 5, 6, 7, 8], 20)], &cheap, 17, 4, 16);
        assert_eq!(b.tree.n_seqs(), 1);
        assert_eq!(b.tree.len(), 9, "cheap rows: the whole chain");
        // A chain's gain is the thesis' closed form (003 Eq. 4.1), scaled by the reliability.
        let a = cheap.acceptance(Evidence::new(Source::Request, 20));
        let want = cheap.reliability() * (crate::control::expected_tokens(a, 8) - 1.0);
        assert!((b.expected - want).abs() < 1e-9, "{} vs {want}", b.expected);
        let dear = trained(0.9, 0.9);
        let b = build(0, &[prop(&[1, 2, 3, 4, 5, 6, 7, 8], 20)], &dear, 17, 4, 16);
        assert!(b.tree.len() <= 3, "dear rows: {} rows", b.tree.len());
    }

    #[test]
    fn trees_beating_their_estimates_scale_a_long_chain_once_not_per_token() {
        // Per-token acceptance 0.8; recent trees got 30% more than expected.
        let mut c = trained(0.8, 0.15);
        for _ in 0..50 {
            c.record_reliability(10.0, 13);
        }
        let rho = c.reliability();
        assert!(rho > 1.25, "{rho}");
        let chain: Vec<Token> = (1..=15).collect();
        let b = build(0, &[prop(&chain, 6)], &c, 17, 1, 16);
        let a = c.acceptance(Evidence::new(Source::Request, 6));
        // Each token's reach is rho * a^k (at most 1): 0.8 * 1.3 > 1 per level would make
        // every token of the chain look certain.
        let n = b.tree.len() - 1;
        let want: f64 = (1..=n as i32).map(|k| (rho * a.powi(k)).min(1.0)).sum();
        assert!((b.expected - want).abs() < 1e-9, "{} vs {want}", b.expected);
        // The best prefix at this cost stops well short of the 15 tokens.
        assert!((2..=8).contains(&n), "{n} drafted");
    }

    #[test]
    fn unreliable_drafts_are_not_verified() {
        let c = trained(0.1, 0.5);
        let b = build(0, &[prop(&[1, 2, 3], 2)], &c, 17, 4, 16);
        assert!(b.tree.is_empty());
        assert_eq!(b.expected, 0.0);
    }

    #[test]
    fn a_controller_that_has_not_drafted_for_long_verifies_a_tree_anyway() {
        let mut c = trained(0.1, 0.5);
        for _ in 0..crate::control::EXPLORE_AFTER - 1 {
            c.record_plain_step();
        }
        assert!(build(0, &[prop(&[1, 2, 3], 2)], &c, 17, 4, 16)
            .tree
            .is_empty());
        c.record_plain_step();
        let b = build(0, &[prop(&[1, 2, 3], 2)], &c, 17, 4, 16);
        assert_eq!(b.tree.len(), 2, "the best tree, however poor: {:?}", b.tree);
        // Once it is verified, the estimates decide again.
        c.record_reliability(b.expected, 0);
        assert!(build(0, &[prop(&[1, 2, 3], 2)], &c, 17, 4, 16)
            .tree
            .is_empty());
    }

    #[test]
    fn alternatives_branch_and_the_most_likely_chain_is_the_trunk() {
        let c = trained(0.9, 0.05);
        let b = build(
            0,
            &[prop(&[7, 8], 3), prop(&[1, 2, 3, 4], 30), prop(&[1, 5], 2)],
            &c,
            17,
            4,
            16,
        );
        let chain = build(
            0,
            &[prop(&[7, 8], 3), prop(&[1, 2, 3, 4], 30), prop(&[1, 5], 2)],
            &c,
            17,
            1,
            16,
        );
        assert_eq!(chain.tree.n_seqs(), 1, "one leaf allowed: a chain");
        assert_eq!(chain.tree.path(chain.tree.len() - 1), [1, 2, 3, 4]);
        let t = &b.tree;
        // The trunk (nodes 1, 2, 3, ...) follows the best-backed proposal.
        let trunk: Vec<Token> = (1..4).map(|i| t.nodes()[i].token).collect();
        assert_eq!(trunk, [1, 2, 3]);
        assert_eq!(t.trunk_end(3), 3);
        assert!(t.n_seqs() >= 2, "{t:?}");
        // Every node's parent comes before it.
        for (i, n) in t.nodes().iter().enumerate().skip(1) {
            assert!(n.parent.unwrap() < i);
        }
        assert_eq!(b.evidence.len(), t.len());
    }

    #[test]
    fn a_failing_source_gives_way_to_its_siblings() {
        // Same match length, but calibrated drafts have been failing: the request's
        // continuation is the trunk, with most of the reach.
        let mut c = trained(0.9, 0.05);
        for _ in 0..2000 {
            c.record_token(Evidence::new(Source::Calibrated, 3), false);
        }
        let calib = Proposal {
            source: Source::Calibrated,
            ..prop(&[5, 6, 7], 3)
        };
        let b = build(0, &[calib, prop(&[1, 2, 3], 3)], &c, 17, 4, 16);
        let t = &b.tree;
        assert_eq!(t.nodes()[1].token, 1, "{t:?}");
        assert_eq!(b.evidence[1].source, Source::Request);
        assert!(
            t.child(0, 5).is_none(),
            "the failing source is not worth a row: {t:?}"
        );
    }

    #[test]
    fn the_row_cap_bounds_the_tree() {
        let c = trained(0.95, 0.01);
        let b = build(0, &[prop(&[1; 30], 30)], &c, 5, 4, 16);
        assert_eq!(b.tree.len(), 5);
    }
}

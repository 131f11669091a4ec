//! Token trees and their verification plan.
//!
//! A [`TokenTree`] holds draft continuations of the last accepted token (the root). One target
//! call verifies the whole tree (Lever §4.2, SpecInfer): every node is one batch row at
//! position `pos0 + depth`; every leaf owns a KV sequence id, and every node belongs to the
//! sequences of all leaves below it, so llama.cpp's unified KV cache stores each shared prefix
//! once and the attention mask lets a node see exactly its ancestors. After acceptance only
//! the accepted path stays, as sequence 0: [`TokenTree::rollback`] says how, as an explicit
//! list of KV operations the engine applies (and tests check without a model).

use crate::sam::Token;

/// Index of a node in its tree; the root is 0.
pub type NodeId = usize;

/// One node: a drafted token (or, for the root, the last accepted token).
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The token.
    pub token: Token,
    /// Parent node (`None` for the root).
    pub parent: Option<NodeId>,
    /// Depth: 0 for the root.
    pub depth: usize,
    /// Children in insertion order.
    pub children: Vec<NodeId>,
    /// The drafter's probability of this token given its parent path, when it has one
    /// (stochastic acceptance needs it; retrieval drafts are deterministic).
    pub q: Option<f32>,
}

/// A tree of drafted tokens rooted at the last accepted token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenTree {
    nodes: Vec<Node>,
}

/// One row of the verification batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The node this row computes.
    pub node: NodeId,
    /// Its token.
    pub token: Token,
    /// Its position: `pos0 + depth`.
    pub pos: i32,
    /// The sequence ids of every leaf at or below the node (the first one is its "own").
    pub seq_ids: Vec<i32>,
}

/// A KV-cache operation (llama.cpp's memory API), applied in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOp {
    /// Give `dst` the cells of `src` in positions `[p0, p1)` (`-1`: open end).
    Copy {
        src: i32,
        dst: i32,
        p0: i32,
        p1: i32,
    },
    /// Drop every cell not in `seq`.
    Keep { seq: i32 },
    /// Remove `seq`'s cells in `[p0, p1)` (`-1`: open end).
    Remove { seq: i32, p0: i32, p1: i32 },
}

impl TokenTree {
    /// A tree with only the root.
    pub fn new(root: Token) -> Self {
        Self {
            nodes: vec![Node {
                token: root,
                parent: None,
                depth: 0,
                children: Vec::new(),
                q: None,
            }],
        }
    }

    /// All nodes; index = [`NodeId`].
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Number of nodes, root included (= rows of the verification batch).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether only the root is there (nothing drafted).
    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    /// The child of `parent` with `token`, if any.
    pub fn child(&self, parent: NodeId, token: Token) -> Option<NodeId> {
        self.nodes[parent]
            .children
            .iter()
            .copied()
            .find(|&c| self.nodes[c].token == token)
    }

    /// Add `token` under `parent` (returns the existing child if there is one).
    pub fn add(&mut self, parent: NodeId, token: Token, q: Option<f32>) -> NodeId {
        if let Some(c) = self.child(parent, token) {
            return c;
        }
        let id = self.nodes.len();
        let depth = self.nodes[parent].depth + 1;
        self.nodes.push(Node {
            token,
            parent: Some(parent),
            depth,
            children: Vec::new(),
            q,
        });
        self.nodes[parent].children.push(id);
        id
    }

    /// Add a chain of tokens under `parent`, sharing existing prefixes; returns its last node.
    pub fn add_path(&mut self, parent: NodeId, tokens: &[Token]) -> NodeId {
        tokens.iter().fold(parent, |at, &t| self.add(at, t, None))
    }

    /// The tree of the nodes `keep` marks (the root and every kept node's ancestors must be
    /// kept), and for each of its nodes the id it had here: what verification reads after an
    /// early exit pruned rows.
    ///
    /// # Panics
    /// `keep` of the wrong length, or not closed under ancestors.
    pub fn retain(&self, keep: &[bool]) -> (TokenTree, Vec<NodeId>) {
        assert_eq!(keep.len(), self.nodes.len());
        assert!(keep[0], "the root is always kept");
        let mut new_id = vec![usize::MAX; self.nodes.len()];
        let mut old = vec![0];
        new_id[0] = 0;
        let mut out = TokenTree::new(self.nodes[0].token);
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            if !keep[i] {
                continue;
            }
            let p = new_id[n.parent.expect("not the root")];
            assert!(p != usize::MAX, "node {i} kept without its parent");
            new_id[i] = out.add(p, n.token, n.q);
            old.push(i);
        }
        (out, old)
    }

    /// Leaves in node order.
    pub fn leaves(&self) -> Vec<NodeId> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].children.is_empty())
            .collect()
    }

    /// The tokens from the root's first child down to `node`.
    pub fn path(&self, node: NodeId) -> Vec<Token> {
        let mut out = Vec::with_capacity(self.nodes[node].depth);
        let mut at = node;
        while let Some(p) = self.nodes[at].parent {
            out.push(self.nodes[at].token);
            at = p;
        }
        out.reverse();
        out
    }

    /// The deepest node on the path from the root to `node` that lies on the trunk: the chain
    /// of the first nodes added (ids 0, 1, 2, ... with id = depth). Rows go into the batch in
    /// node order, so the trunk's KV cells follow the context's without a gap, exactly where
    /// plain decoding puts them; a node off the trunk sits after other branches' cells, and
    /// ggml's attention sums over cells in SIMD lanes by cell index, so its logits may round
    /// differently from plain decoding's. Greedy verification keeps only the trunk part of an
    /// accepted path and verifies the rest again in the next step.
    pub fn trunk_end(&self, node: NodeId) -> NodeId {
        let mut at = node;
        while at != self.nodes[at].depth {
            at = self.nodes[at].parent.expect("the root is on the trunk");
        }
        at
    }

    /// Leaf `i` (in [`TokenTree::leaves`] order) owns sequence `seq0 + i`. Sequence `seq0`
    /// is the one whose cells hold the context.
    pub fn rows(&self, pos0: i32, seq0: i32) -> Vec<Row> {
        let leaves = self.leaves();
        let mut seqs: Vec<Vec<i32>> = vec![Vec::new(); self.nodes.len()];
        for (i, &leaf) in leaves.iter().enumerate() {
            let mut at = Some(leaf);
            while let Some(n) = at {
                seqs[n].push(seq0 + i as i32);
                at = self.nodes[n].parent;
            }
        }
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| Row {
                node: i,
                token: n.token,
                pos: pos0 + n.depth as i32,
                seq_ids: std::mem::take(&mut seqs[i]),
            })
            .collect()
    }

    /// Number of KV sequences the verification needs.
    pub fn n_seqs(&self) -> usize {
        self.leaves().len()
    }

    /// KV operations before the verification call: every leaf sequence but the first must see
    /// the context, which lives in `seq0` (positions below `pos0`).
    pub fn prepare(&self, pos0: i32, seq0: i32) -> Vec<KvOp> {
        (1..self.n_seqs() as i32)
            .map(|i| KvOp::Copy {
                src: seq0,
                dst: seq0 + i,
                p0: 0,
                p1: pos0,
            })
            .collect()
    }

    /// KV operations after acceptance: keep the context and the path root..`accepted` (the
    /// last accepted tree node), as sequence `seq0`, and nothing else. `rows` are the rows
    /// this tree was verified with ([`TokenTree::rows`] with the same `seq0`).
    pub fn rollback(&self, rows: &[Row], accepted: NodeId, seq0: i32) -> Vec<KvOp> {
        let own = rows[accepted].seq_ids[0];
        let end = rows[accepted].pos + 1;
        let mut ops = vec![
            KvOp::Keep { seq: own },
            KvOp::Remove {
                seq: own,
                p0: end,
                p1: -1,
            },
        ];
        if own != seq0 {
            ops.push(KvOp::Copy {
                src: own,
                dst: seq0,
                p0: -1,
                p1: -1,
            });
            ops.push(KvOp::Remove {
                seq: own,
                p0: -1,
                p1: -1,
            });
        }
        ops
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn retain_keeps_marked_nodes_and_maps_them_back() {
        let mut t = TokenTree::new(1);
        t.add_path(0, &[2, 3, 4]); // nodes 1, 2, 3
        t.add_path(1, &[5]); // node 4, under node 1
        let (r, old) = t.retain(&[true, true, false, false, true]);
        assert_eq!(old, vec![0, 1, 4]);
        assert_eq!(r.path(2), vec![2, 5]);
        assert_eq!(r.child(0, 2), Some(1));
        assert_eq!(r.child(1, 3), None, "the pruned branch is gone");
    }

    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn sample() -> TokenTree {
        // root(9) -> 1 -> 2 -> 3
        //               -> 4
        //         -> 5
        let mut t = TokenTree::new(9);
        t.add_path(0, &[1, 2, 3]);
        t.add_path(0, &[1, 4]);
        t.add_path(0, &[5]);
        t
    }

    #[test]
    fn trunk_is_the_first_chain_added() {
        let t = sample();
        // Nodes 1, 2, 3 are the first path (tokens 1 2 3); node 4 (token 4) hangs off node 1,
        // node 5 (token 5) off the root.
        let ends: Vec<NodeId> = (0..t.len()).map(|n| t.trunk_end(n)).collect();
        assert_eq!(ends, [0, 1, 2, 3, 1, 0]);
    }

    #[test]
    fn shared_prefixes_are_stored_once() {
        let mut t = sample();
        assert_eq!(t.len(), 6);
        assert_eq!(t.leaves().len(), 3);
        assert_eq!(t.path(t.leaves()[0]), vec![1, 2, 3]);
        assert_eq!(t.add_path(0, &[1, 2]), 2, "existing path");
    }

    #[test]
    fn rows_carry_the_sequences_of_all_leaves_below() {
        let t = sample();
        let rows = t.rows(100, 0);
        let by_token: BTreeMap<Token, (i32, Vec<i32>)> = rows
            .iter()
            .map(|r| (r.token, (r.pos, r.seq_ids.clone())))
            .collect();
        assert_eq!(by_token[&9], (100, vec![0, 1, 2]));
        assert_eq!(by_token[&1], (101, vec![0, 1]));
        assert_eq!(by_token[&2], (102, vec![0]));
        assert_eq!(by_token[&3], (103, vec![0]));
        assert_eq!(by_token[&4], (102, vec![1]));
        assert_eq!(by_token[&5], (101, vec![2]));
    }

    /// A model of llama.cpp's KV cells: position -> set of sequences, plus the attention rule
    /// "a row sees a cell if they share a sequence and the cell is not later".
    #[derive(Default)]
    struct Cells(Vec<(i32, BTreeSet<i32>, Token)>);

    impl Cells {
        fn apply(&mut self, op: KvOp) {
            let inr = |p: i32, p0: i32, p1: i32| (p0 < 0 || p >= p0) && (p1 < 0 || p < p1);
            match op {
                KvOp::Copy { src, dst, p0, p1 } => {
                    for c in &mut self.0 {
                        if c.1.contains(&src) && inr(c.0, p0, p1) {
                            c.1.insert(dst);
                        }
                    }
                }
                KvOp::Keep { seq } => {
                    for c in &mut self.0 {
                        c.1.retain(|&s| s == seq);
                    }
                }
                KvOp::Remove { seq, p0, p1 } => {
                    for c in &mut self.0 {
                        if inr(c.0, p0, p1) {
                            c.1.remove(&seq);
                        }
                    }
                }
            }
            self.0.retain(|c| !c.1.is_empty());
        }
        /// Cells holding `context` at positions from 0 in sequence 0.
        fn with_context(context: &[Token]) -> Self {
            let cells = context.iter().enumerate();
            Self(
                cells
                    .map(|(p, &t)| (p as i32, BTreeSet::from([0]), t))
                    .collect(),
            )
        }
        /// Prepare `t`'s verification after the context (every cell so far) and add its rows'
        /// cells.
        fn verify(&mut self, t: &TokenTree) -> Vec<Row> {
            let pos0 = self.0.len() as i32;
            for op in t.prepare(pos0, 0) {
                self.apply(op);
            }
            let rows = t.rows(pos0, 0);
            for r in &rows {
                let seqs = r.seq_ids.iter().copied().collect();
                self.0.push((r.pos, seqs, r.token));
            }
            rows
        }
        /// The tokens row `r` attends: cells that share a sequence with it, not later.
        fn seen_by(&self, r: &Row) -> Vec<Token> {
            let own: BTreeSet<i32> = r.seq_ids.iter().copied().collect();
            let mut seen: Vec<(i32, Token)> = self
                .0
                .iter()
                .filter(|c| c.0 <= r.pos && !c.1.is_disjoint(&own))
                .map(|c| (c.0, c.2))
                .collect();
            seen.sort();
            seen.into_iter().map(|c| c.1).collect()
        }
        fn seq(&self, s: i32) -> Vec<Token> {
            let mut v: Vec<_> = self
                .0
                .iter()
                .filter(|c| c.1.contains(&s))
                .map(|c| (c.0, c.2))
                .collect();
            v.sort();
            v.into_iter().map(|c| c.1).collect()
        }
    }

    #[test]
    fn each_row_sees_exactly_its_ancestors_and_rollback_keeps_the_path() {
        let t = sample();
        let mut cells = Cells::with_context(&[70, 71, 72]);
        let rows = cells.verify(&t);
        // Attention: row r sees cells that share a sequence with it at positions <= r.pos.
        for r in &rows {
            let want: Vec<Token> = [70, 71, 72, 9].into_iter().chain(t.path(r.node)).collect();
            assert_eq!(cells.seen_by(r), want, "row {}", r.node);
        }
        // Accept root -> 1 -> 4: sequence 0 must hold the context and exactly that path.
        let accepted = t.child(t.child(0, 1).unwrap(), 4).unwrap();
        for op in t.rollback(&rows, accepted, 0) {
            cells.apply(op);
        }
        assert_eq!(cells.seq(0), vec![70, 71, 72, 9, 1, 4]);
        assert_eq!(cells.0.len(), 6, "no other cells survive");
        // Accepting only the root also works.
        let mut cells2 = Cells::default();
        cells2.0.push((0, BTreeSet::from([0, 1, 2]), 9));
        cells2.0.push((1, BTreeSet::from([2]), 5));
        for op in t.rollback(&t.rows(0, 0), 0, 0) {
            cells2.apply(op);
        }
        assert_eq!(cells2.seq(0), vec![9]);
    }

    /// Random trees (random shapes, repeated tokens, paths added twice, one to 40 nodes), a
    /// random context length and any accepted node: every row sees exactly the context and its
    /// own path, and after the rollback sequence 0 holds exactly the context and the accepted
    /// path, with no other cell left.
    #[test]
    fn any_tree_and_any_accepted_node_roll_back_to_the_accepted_path() {
        use crate::accept::{SplitMix64, Uniform};
        let mut rng = SplitMix64(0x7EE5);
        let mut below = |n: usize| ((rng.uniform() * n as f64) as usize).min(n - 1);
        for case in 0..2000 {
            let mut t = TokenTree::new(1000);
            let adds = 1 + below(12);
            for _ in 0..adds {
                let parent = below(t.len());
                let path: Vec<Token> = (0..1 + below(6)).map(|_| below(4) as Token).collect();
                let end = t.add_path(parent, &path);
                if below(4) == 0 {
                    let n = t.len();
                    let again = t.add_path(parent, &path);
                    assert_eq!(
                        (again, t.len()),
                        (end, n),
                        "case {case}: a path added twice"
                    );
                }
            }
            let context: Vec<Token> = (0..below(5) as Token).map(|p| 500 + p).collect();
            // The context, the root and `node`'s path: what a row sees, what rollback keeps.
            let text = |node| -> Vec<Token> {
                context
                    .iter()
                    .copied()
                    .chain([1000])
                    .chain(t.path(node))
                    .collect()
            };
            let mut cells = Cells::with_context(&context);
            let rows = cells.verify(&t);
            for r in &rows {
                assert_eq!(
                    cells.seen_by(r),
                    text(r.node),
                    "case {case}, row {}",
                    r.node
                );
            }
            let accepted = below(t.len());
            for op in t.rollback(&rows, accepted, 0) {
                cells.apply(op);
            }
            let want = text(accepted);
            assert_eq!(cells.seq(0), want, "case {case}: accepted node {accepted}");
            assert_eq!(
                cells.0.len(),
                want.len(),
                "case {case}: other cells survive"
            );
        }
    }
}

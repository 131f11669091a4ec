//! Verification pruning with an early-exit head (Lever §4.3, Eq. 11 and its safeguards), and
//! the head's place in the model's sidecar.
//!
//! At the exit layer every tree row has a hidden state. For each node with children the head
//! scores the children's tokens and the head's shadow tokens (comparison references that
//! never enter the tree) and normalises over that candidate set (Eq. 11): a child's edge
//! score says how much more likely the target takes it than the alternatives. A node's path
//! score is the product of the edge scores from the root. [`keep_set`] keeps:
//!
//! - the root, and every node whose path score reaches the threshold;
//! - the best-scored children of the root (branch coverage where the next token is least
//!   certain);
//! - a backbone: from the root, the best-scored child at each depth, while its edge score is
//!   not negligible;
//!
//! and, since all of those are closed under ancestors by construction, a kept node's
//! ancestors are kept. A decision that keeps nothing beyond the root is rejected (the
//! backbone's first step always survives). The rows after the exit layer are then computed
//! for the kept nodes only ([`leap_host::exit`]); acceptance still reads the full target's
//! logits, so greedy output is exactly plain decoding's.

use std::sync::Arc;

use leap_host::exit::Decide;
use leap_host::project::OnDemand;
use leap_host::sidecar::{Sidecar, Value};

use crate::head::{candidate_softmax, Head};
use crate::sam::Token;
use crate::tree::TokenTree;

/// Sidecar keys of the head.
pub mod keys {
    pub const LAYER: &str = "leap.exit.layer";
    pub const N_EMBD: &str = "leap.exit.n_embd";
    pub const N_LAYER: &str = "leap.exit.n_layer";
    pub const A: &str = "leap.exit.a";
    pub const TEMPERATURE: &str = "leap.exit.temperature";
    pub const SHADOW: &str = "leap.exit.shadow";
    /// [`leap_host::project::fingerprint`] of the model the head was trained on.
    pub const MODEL: &str = "leap.exit.model";
    pub const CORPUS: &str = "leap.exit.corpus";
}

/// The pruning rule's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct PruneConfig {
    /// Path score (product of edge scores from the root) a node needs to be kept.
    pub threshold: f32,
    /// Children of the root kept by rank whatever their score.
    pub root_children: usize,
    /// Edge score below which the backbone stops.
    pub backbone_floor: f32,
    /// Decide but do not prune: every row runs every layer, and the engine counts what
    /// pruning would have kept and how many of the accepted tokens were among it (Lever's
    /// "accepted-token retention on the same trees").
    pub measure_only: bool,
}

impl Default for PruneConfig {
    fn default() -> Self {
        Self {
            threshold: 0.1,
            root_children: 2,
            backbone_floor: 0.02,
            measure_only: false,
        }
    }
}

/// Which nodes continue past the exit layer, from each node's edge score (`edge[0]`, the
/// root's, is ignored). `None` when the decision is rejected (keep everything).
pub fn keep_set(tree: &TokenTree, edge: &[f32], cfg: &PruneConfig) -> Option<Vec<bool>> {
    let nodes = tree.nodes();
    assert_eq!(edge.len(), nodes.len());
    let mut keep = vec![false; nodes.len()];
    keep[0] = true;
    // Path scores, parents before children (a child's id is above its parent's).
    let mut path = vec![1f32; nodes.len()];
    for (i, n) in nodes.iter().enumerate().skip(1) {
        let p = n.parent.expect("not the root");
        path[i] = path[p] * edge[i];
        keep[i] = keep[p] && path[i] >= cfg.threshold;
    }
    let by_score = |kids: &[usize]| {
        let mut k = kids.to_vec();
        k.sort_by(|&a, &b| edge[b].total_cmp(&edge[a]));
        k
    };
    for &c in by_score(&nodes[0].children).iter().take(cfg.root_children) {
        keep[c] = true;
    }
    let mut at = 0;
    let mut first = true;
    while let Some(&best) = by_score(&nodes[at].children).first() {
        if !first && edge[best] < cfg.backbone_floor {
            break;
        }
        keep[best] = true;
        at = best;
        first = false;
    }
    if keep.iter().filter(|&&k| k).count() < 2 {
        return None;
    }
    // Closed under ancestors: every rule above only adds a node whose parent is kept.
    debug_assert!(nodes
        .iter()
        .enumerate()
        .all(|(i, n)| !keep[i] || n.parent.is_none_or(|p| keep[p])));
    Some(keep)
}

/// Edge scores (Eq. 11) of every node of `tree` from the rows' hidden states at the exit
/// layer (`hidden`: `tree.len() x n_embd`).
pub fn edge_scores(tree: &TokenTree, hidden: &[f32], head: &Head, od: &OnDemand) -> Vec<f32> {
    let d = head.n_embd;
    let mut edge = vec![1f32; tree.len()];
    let mut u = vec![0f32; d];
    let mut cand: Vec<Token> = Vec::new();
    let mut logits = Vec::new();
    for (i, n) in tree.nodes().iter().enumerate() {
        if n.children.is_empty() {
            continue;
        }
        head.project(&hidden[i * d..(i + 1) * d], &mut u);
        cand.clear();
        cand.extend(n.children.iter().map(|&c| tree.nodes()[c].token));
        for &s in &head.shadow {
            if !cand.contains(&s) {
                cand.push(s);
            }
        }
        od.logits_of(&u, &cand, &mut logits);
        let p = candidate_softmax(&logits, head.temperature);
        for (k, &c) in n.children.iter().enumerate() {
            edge[c] = p[k];
        }
    }
    edge
}

/// An early-exit head at work for one context: the decision the engine arms on the
/// context's [`leap_host::exit::Exit`] for a verification call.
#[derive(Debug, Clone)]
pub struct Pruner {
    pub head: Arc<Head>,
    /// The model's layer count.
    pub n_layer: u32,
}

impl Pruner {
    /// The share of a row's cost spent after the exit layer, counting layers (the output
    /// projection is on demand, so not a row's cost).
    pub fn share_after(&self) -> f64 {
        let after = self.n_layer.saturating_sub(self.head.layer + 1);
        f64::from(after) / f64::from(self.n_layer.max(1))
    }

    /// The decision for verifying `tree` under `cfg` (moved into the observer).
    pub fn decide(&self, tree: &TokenTree, od: &OnDemand, cfg: &PruneConfig) -> Decide {
        let (tree, head, od, cfg) = (tree.clone(), self.head.clone(), od.clone(), cfg.clone());
        Box::new(move |hidden: &[f32], rows: usize| {
            if rows != tree.len() || hidden.len() != rows * head.n_embd {
                return None;
            }
            let edge = edge_scores(&tree, hidden, &head, &od);
            keep_set(&tree, &edge, &cfg)
        })
    }
}

/// Put `head` (trained on `corpus`, on the model with this [`fingerprint`]) into `side`.
///
/// [`fingerprint`]: leap_host::project::fingerprint
pub fn store(side: &mut Sidecar, head: &Head, n_layer: u32, fingerprint: &str, corpus: &str) {
    side.set(keys::LAYER, Value::U32(head.layer));
    side.set(keys::N_EMBD, Value::U32(head.n_embd as u32));
    side.set(keys::N_LAYER, Value::U32(n_layer));
    side.set(keys::A, Value::F32s(head.a.clone()));
    side.set(keys::TEMPERATURE, Value::F32(head.temperature));
    side.set(keys::SHADOW, Value::I32s(head.shadow.clone()));
    side.set(keys::MODEL, Value::Str(fingerprint.to_string()));
    side.set(keys::CORPUS, Value::Str(corpus.to_string()));
}

/// The model a head must match: its output weights' fingerprint
/// ([`leap_host::project::fingerprint`]) and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    pub fingerprint: String,
    pub n_embd: usize,
    pub n_layer: u32,
    pub n_vocab: usize,
}

/// The head in `side`, if it has one, checked against `model`. `Err` says why a head that
/// is there cannot be used.
pub fn load(side: &Sidecar, model: &ModelShape) -> Result<Option<Head>, String> {
    let (n_layer, n_vocab) = (model.n_layer, model.n_vocab);
    let Some(layer) = side.u32(keys::LAYER) else {
        return Ok(None);
    };
    let trained_on = match side.get(keys::MODEL) {
        Some(Value::Str(s)) => s.clone(),
        _ => return Err(format!("its head has no {}", keys::MODEL)),
    };
    let here = &model.fingerprint;
    if trained_on != *here {
        return Err(format!(
            "its head was trained on another model (output weights {trained_on}, this \
             model's {here})"
        ));
    }
    let d = side.u32(keys::N_EMBD).unwrap_or(0) as usize;
    // The exit layer needs a layer after it (`layer + 1 < n_layer`, written so that a
    // `layer` of u32::MAX cannot wrap round to 0 and pass).
    if d != model.n_embd
        || side.u32(keys::N_LAYER) != Some(n_layer)
        || layer >= n_layer.saturating_sub(1)
    {
        return Err(format!(
            "its head is for {d}-wide hidden states at layer {layer} of {:?} layers; this \
             model has {}-wide states and {n_layer} layers",
            side.u32(keys::N_LAYER),
            model.n_embd
        ));
    }
    let a = side.f32s(keys::A).unwrap_or(&[]);
    if a.len() != d * d || a.iter().any(|x| !x.is_finite()) {
        return Err(format!(
            "{} has {} values (want {} finite ones)",
            keys::A,
            a.len(),
            d * d
        ));
    }
    let temperature = match side.get(keys::TEMPERATURE) {
        Some(Value::F32(t)) if *t > 0.0 && t.is_finite() => *t,
        _ => return Err(format!("{} is missing or not positive", keys::TEMPERATURE)),
    };
    let shadow = side.i32s(keys::SHADOW).unwrap_or(&[]).to_vec();
    if shadow.iter().any(|&t| t < 0 || t as usize >= n_vocab) {
        return Err(format!(
            "{} has tokens outside the vocabulary",
            keys::SHADOW
        ));
    }
    Ok(Some(Head {
        layer,
        n_embd: d,
        a: a.to_vec(),
        temperature,
        shadow,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root 0 with children 1 (-> 2 -> 3) and 4 (-> 5), and 6.
    fn tree() -> TokenTree {
        let mut t = TokenTree::new(0);
        t.add_path(0, &[10, 11, 12]);
        t.add_path(0, &[20, 21]);
        t.add_path(0, &[30]);
        t
    }

    #[test]
    fn confident_paths_stay_and_unlikely_ones_go() {
        let t = tree();
        // Node:        0    1    2    3    4    5    6
        let edge = [1.0, 0.9, 0.8, 0.05, 0.3, 0.9, 0.05];
        let cfg = PruneConfig {
            threshold: 0.2,
            root_children: 1,
            backbone_floor: 0.1,
            measure_only: false,
        };
        let keep = keep_set(&t, &edge, &cfg).unwrap();
        // 3: path 0.036 and under the backbone floor; 4: path 0.3; 5: 0.27; 6: 0.05.
        assert_eq!(keep, vec![true, true, true, false, true, true, false]);
    }

    #[test]
    fn the_backbone_survives_a_pessimistic_head() {
        let t = tree();
        let edge = [1.0, 0.04, 0.5, 0.5, 0.01, 0.9, 0.01];
        let cfg = PruneConfig {
            threshold: 0.9,
            root_children: 0,
            backbone_floor: 0.1,
            measure_only: false,
        };
        let keep = keep_set(&t, &edge, &cfg).unwrap();
        // The backbone starts at the best root child (1) and follows 2, 3.
        assert_eq!(keep, vec![true, true, true, true, false, false, false]);
    }

    /// Found by `make fuzz` (target `sidecar`): `layer + 1` overflowed for a layer of
    /// u32::MAX (a panic with overflow checks; without them it wrapped to 0 and the head
    /// passed the check).
    #[test]
    fn a_head_needs_a_layer_after_its_own() {
        let model = ModelShape {
            fingerprint: "m".into(),
            n_embd: 1,
            n_layer: 2,
            n_vocab: 8,
        };
        let side = |layer: u32| {
            let mut s = Sidecar::default();
            s.set(keys::LAYER, Value::U32(layer));
            s.set(keys::N_EMBD, Value::U32(1));
            s.set(keys::N_LAYER, Value::U32(2));
            s.set(keys::A, Value::F32s(vec![1.0]));
            s.set(keys::TEMPERATURE, Value::F32(1.0));
            s.set(keys::MODEL, Value::Str("m".into()));
            s
        };
        assert_eq!(load(&side(0), &model).unwrap().unwrap().layer, 0);
        for layer in [1, 2, u32::MAX] {
            assert!(load(&side(layer), &model).is_err(), "layer {layer}");
        }
        let no_layers = ModelShape {
            n_layer: 0,
            ..model
        };
        let mut s = side(0);
        s.set(keys::N_LAYER, Value::U32(0));
        assert!(load(&s, &no_layers).is_err());
    }

    #[test]
    fn kept_nodes_always_have_their_ancestors() {
        let t = tree();
        let mut rng = crate::accept::SplitMix64(7);
        use crate::accept::Uniform;
        for _ in 0..500 {
            let edge: Vec<f32> = (0..t.len()).map(|_| rng.uniform() as f32).collect();
            let cfg = PruneConfig {
                threshold: rng.uniform() as f32,
                root_children: (rng.uniform() * 3.0) as usize,
                backbone_floor: rng.uniform() as f32 * 0.5,
                measure_only: false,
            };
            if let Some(keep) = keep_set(&t, &edge, &cfg) {
                assert!(keep[0]);
                for (i, n) in t.nodes().iter().enumerate() {
                    if keep[i] {
                        if let Some(p) = n.parent {
                            assert!(keep[p], "{edge:?} {cfg:?}");
                        }
                    }
                }
                // retain() accepts every decision.
                let (r, _) = t.retain(&keep);
                assert_eq!(r.len(), keep.iter().filter(|&&k| k).count());
            }
        }
    }
}

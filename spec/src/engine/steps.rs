//! The engine's decode loop after the prompt's first token ([`Engine::generate_from`]), in
//! named steps. Each step of [`Steps::step`]:
//! 1. [`Steps::propose`]: the drafters' proposals (cut to what a grammar allows) become this
//!    step's token tree, with what the last step accepted off the trunk first;
//! 2. [`Steps::verify`]: one target call over the tree's rows (on-demand projection and early
//!    exit armed around it);
//! 3. [`Steps::accept`]: the target's token after each node on the accepted path, greedily or
//!    by speculative sampling, under the grammar if there is one;
//! 4. [`Steps::record`]: timing, the controller's costs and acceptance, the step's counts;
//! 5. [`Steps::commit`]: the KV cache rolled back to the kept path, the drafters told, the
//!    tokens emitted.

use std::time::Instant;

use leap_host::grammar::Grammar;
use leap_host::sampler::SamplingParams;
use leap_host::{Batch, Context, Error, Result, Token};

use super::{allowed_drafts, apply, checked_path, path_nodes, trunk_chain, Engine, MAX_PROJECTED};
use crate::accept;
use crate::control::Evidence;
use crate::dist::Truncation;
use crate::draft::ContextDrafter;
use crate::plain::{argmax, Generation};
use crate::tree::{NodeId, TokenTree};

/// One generation's loop state: what carries from a step to the next, and the buffers every
/// step reuses.
pub(super) struct Steps<'a> {
    pub ctx: &'a mut Context,
    pub sampling: &'a SamplingParams,
    pub trunc: Truncation,
    pub grammar: Option<&'a mut Grammar>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// The output so far and the generation's counts.
    pub g: Generation,
    /// Retrieval from this request's prompt and output.
    pub local: ContextDrafter,
    /// The last token emitted (the tree's root; not yet in the cache).
    pub id_last: Token,
    /// Accepted off the trunk in the last step, verified again in this one.
    pub carry: Vec<Token>,
    /// The position of `id_last`.
    pub pos0: i32,
    pub branches: usize,
    pub done: bool,
    batch: Batch,
    proposals: Vec<crate::draft::Proposal>,
    /// Vocabulary-sized buffers for projected logits.
    row: Vec<f32>,
    projected: Vec<Vec<f32>>,
    /// Every row's logits, when the output weights are streamed.
    every: Vec<Vec<f32>>,
    /// A row's logits masked by the grammar.
    masked: Vec<f32>,
}

/// A step's tree and what the controller expected of it.
struct Drafted {
    tree: TokenTree,
    evidence: Vec<Evidence>,
    expected: f64,
}

/// What the verification call left.
struct Verified {
    /// The tree's rows at their positions (for the rollback).
    rows: Vec<crate::tree::Row>,
    /// Hidden states of every row when the output projection is done on demand.
    hidden: Option<Vec<f32>>,
    /// The rows an early exit kept past its layer (`None`: every row).
    kept: Option<Vec<bool>>,
    /// Whether an early exit pruned this call.
    pruning: bool,
    /// When the call began (the step's verification time runs to the end of acceptance).
    started: Instant,
    decode_seconds: f64,
}

/// What acceptance found, in the tree's node ids.
struct Judged {
    acc: accept::Accepted,
    /// The target's token after each node (none where acceptance read no logits).
    predicted: Vec<Option<Token>>,
    /// The grammar allowed no token at the end of the accepted path.
    stuck: bool,
    /// How many nodes acceptance walked (the pruned tree's size).
    walked: usize,
}

impl<'a> Steps<'a> {
    /// The loop after `first` (emitted, at position `prompt_len`), for `e`'s configuration.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        e: &Engine,
        ctx: &'a mut Context,
        sampling: &'a SamplingParams,
        grammar: Option<&'a mut Grammar>,
        prompt_len: usize,
        max_tokens: usize,
        g: Generation,
        first: Token,
        done: bool,
    ) -> Self {
        let n_seq = ctx.n_seq_max() as usize;
        Self {
            trunc: Truncation::from(sampling),
            sampling,
            grammar,
            prompt_len,
            max_tokens,
            g,
            local: ContextDrafter::new(e.cfg.min_match),
            id_last: first,
            carry: Vec::new(),
            pos0: prompt_len as i32,
            branches: e.cfg.max_branches.min(n_seq).max(1),
            done,
            batch: Batch::new(
                (e.cfg.max_draft * e.cfg.max_branches.max(1) + 1).max(e.cfg.max_rows),
                n_seq.max(1),
            ),
            ctx,
            proposals: Vec::new(),
            row: Vec::new(),
            projected: Vec::new(),
            every: Vec::new(),
            masked: Vec::new(),
        }
    }

    fn sampled(&self) -> bool {
        !self.sampling.is_greedy()
    }

    /// One speculative step: propose, verify, accept, record, commit.
    ///
    /// # Errors
    /// Decode failures; a row without logits.
    pub fn step(&mut self, e: &mut Engine, on_token: &mut dyn FnMut(Token) -> bool) -> Result<()> {
        let d = self.propose(e)?;
        let v = self.verify(e, &d)?;
        let j = self.accept(e, &d, &v)?;
        self.record(e, &d, &v, &j);
        self.commit(e, &d, &v, &j, on_token)
    }

    /// This step's tree: the carried tokens and the drafters' proposals, each cut to what a
    /// grammar allows and to the length the controller finds worth verifying.
    fn propose(&mut self, e: &mut Engine) -> Result<Drafted> {
        let td = Instant::now();
        let budget = (self.max_tokens - self.g.tokens.len())
            .saturating_sub(1)
            .min(e.cfg.max_draft);
        self.proposals.clear();
        if budget > 0 {
            for d in e.drafters(&mut self.local) {
                d.propose(budget, self.branches, &mut self.proposals);
            }
            if let Some(gr) = self.grammar.as_deref() {
                allowed_drafts(gr, &mut self.proposals)?;
            }
        }
        let (tree, evidence, expected) = e.build_tree(
            &mut self.proposals,
            self.id_last,
            &self.carry,
            budget,
            self.branches,
        );
        self.g.draft_seconds += td.elapsed().as_secs_f64();
        Ok(Drafted {
            tree,
            evidence,
            expected,
        })
    }

    /// One target call over the tree's rows: with the projection on demand (the rows' hidden
    /// states kept, an early exit pruning rows when it pays), or llama.cpp's logits.
    fn verify(&mut self, e: &mut Engine, d: &Drafted) -> Result<Verified> {
        let tree = &d.tree;
        apply(self.ctx, &tree.prepare(self.pos0, 0))?;
        let rows = tree.rows(self.pos0, 0);
        self.batch.clear();
        for r in &rows {
            self.batch.add(r.token, r.pos, &r.seq_ids, true)?;
        }
        let started = Instant::now();
        let mut hidden = None;
        let mut kept = None;
        let mut pruning = false;
        let (ctx, batch) = (&mut *self.ctx, &self.batch);
        match &mut e.on_demand {
            // A lone row too, once the projection is checked: Leap's pass is faster than
            // llama.cpp's (Gemma 3: 4.5 against ~6 ms, `tests/benches/calls.rs`, `projection`), and
            // a streamed one (flash) is read from storage by every pass anyway.
            Some((od, checked))
                if e.cfg.on_demand
                    && (tree.len() > 1 || od.streamed() || *checked == Some(true))
                    && *checked != Some(false) =>
            {
                if checked.is_none() {
                    let ok = od.check(ctx, batch, 0)?;
                    if !ok {
                        log::warn!(
                            "on-demand output projection does not reproduce llama.cpp's \
                             logits for this model; verifying with llama.cpp's logits"
                        );
                    }
                    *checked = Some(ok);
                } else {
                    let exit = e
                        .exit
                        .as_ref()
                        .filter(|_| e.cfg.exit && tree.len() > 2 && !od.streamed());
                    if let Some((ex, pruner)) = exit {
                        let cfg = &e.cfg.prune;
                        ex.arm(pruner.decide(tree, od, cfg), !cfg.measure_only);
                        pruning = true;
                    }
                    od.arm(true);
                    let r = ctx.decode(batch);
                    od.disarm();
                    if let Some((ex, _)) = exit {
                        let (k, seconds) = ex.disarm();
                        kept = k;
                        self.g.exit_seconds += seconds;
                    }
                    r?;
                    hidden = Some(od.take_hidden()?);
                }
            }
            _ => ctx.decode(batch)?,
        }
        Ok(Verified {
            rows,
            hidden,
            kept,
            pruning,
            decode_seconds: started.elapsed().as_secs_f64(),
            started,
        })
    }

    /// The target's tokens along the accepted path of the tree (or of what an early exit kept
    /// of it): the greedy walk reads each node's best token (under a grammar, the best it
    /// allows after the path), the sampled one draws from each node's distribution.
    fn accept(&mut self, e: &Engine, d: &Drafted, v: &Verified) -> Result<Judged> {
        let sampled = self.sampled();
        let Self {
            ctx,
            sampling,
            trunc,
            grammar,
            prompt_len,
            g,
            row,
            projected,
            every,
            masked,
            ..
        } = self;
        let (tree, expected) = (&d.tree, d.expected);
        // What acceptance walks: the tree, or what an early exit kept of it (`map`: each
        // node's id in `tree`, which is also its row). Measuring only, the whole tree.
        let measure_only = e.cfg.prune.measure_only;
        let pruned = match &v.kept {
            Some(k) if !measure_only => Some(tree.retain(k)),
            _ => None,
        };
        let (vt, map) = match &pruned {
            Some((t, m)) => (t, Some(m.as_slice())),
            None => (tree, None),
        };
        let old = |n: NodeId| map.map_or(n, |m| m[n]);
        let hidden = &v.hidden;
        // The target's best token after a node of `vt` (unconstrained).
        let mut predicted: Vec<Option<Token>> = vec![None; vt.len()];
        let od = e.on_demand.as_ref().map(|o| &o.0);
        let all_projected = match (hidden, od) {
            (Some(h), Some(od)) if od.streamed() => {
                project_every(od, h, vt.len(), &old, every, &mut predicted, g)?;
                true
            }
            _ => false,
        };
        let projected_all = &*every;
        let ctx = &**ctx;
        // Rows projected one at a time (sampled acceptance, grammar corrections).
        let singles = std::cell::Cell::new(0u64);
        // The target's logits after a node of `vt`: projected on demand (into `row`), or
        // llama.cpp's. A node without logits leaves `f` uncalled.
        let mut logits_of = |node: NodeId, f: &mut dyn FnMut(&[f32])| match (hidden, od) {
            (Some(_), Some(_)) if all_projected => f(&projected_all[node]),
            (Some(h), Some(od)) => {
                let n = od.n_embd();
                singles.set(singles.get() + 1);
                let r = old(node);
                od.logits(&h[r * n..(r + 1) * n], row);
                f(row);
            }
            _ => {
                if let Ok(l) = ctx.logits(old(node) as i32) {
                    f(l);
                }
            }
        };
        // Under a grammar, a copy walks the accepted path: each row's token is the best the
        // grammar allows after the tokens before it. `stuck`: it allowed none.
        let mut walker = grammar.as_deref().map(Grammar::try_clone).transpose()?;
        let mut stuck = false;
        let acc = if sampled {
            // The k-th token emitted here is at sequence position `base + k`.
            let base = *prompt_len + g.tokens.len();
            accept::stochastic(
                vt,
                |node| {
                    let mut d = Vec::new();
                    logits_of(node, &mut |l| d = trunc.apply(l).entries);
                    d
                },
                |k| accept::position_uniform(sampling.seed, base + k),
            )
        } else {
            accept::greedy(vt, |node| {
                if predicted[node].is_none() {
                    match (hidden, od) {
                        // Project the node and the most likely path below it in one pass over
                        // the output weights (a row more costs a fraction of a pass): as deep
                        // as acceptance is expected to go, plus one.
                        (Some(h), Some(od)) => {
                            let n = od.n_embd();
                            let depth = vt.nodes()[node].depth as f64;
                            // Without an estimate (fixed drafting), two rows: a second costs a
                            // fraction of a pass and drafts that were proposed are usually
                            // taken at least once.
                            let ahead = if expected > 0.0 {
                                (expected - depth).max(0.0).ceil() as usize + 1
                            } else {
                                2
                            };
                            let chain = trunk_chain(vt, node, ahead.min(MAX_PROJECTED));
                            let hs: Vec<&[f32]> = chain
                                .iter()
                                .map(|&c| &h[old(c) * n..(old(c) + 1) * n])
                                .collect();
                            projected.resize_with(chain.len(), Vec::new);
                            let tp = Instant::now();
                            od.logits_rows(&hs, &mut projected[..chain.len()]);
                            g.output_rows += chain.len() as u64;
                            g.project_seconds += tp.elapsed().as_secs_f64();
                            for (&c, l) in chain.iter().zip(projected.iter()) {
                                predicted[c] = Some(argmax(l));
                            }
                        }
                        _ => logits_of(node, &mut |l| predicted[node] = Some(argmax(l))),
                    }
                }
                let best = predicted[node].unwrap_or(-1);
                let Some(w) = walker.as_mut().filter(|_| best >= 0) else {
                    return best;
                };
                // The best overall when the grammar allows it, else the best allowed from the
                // row's logits (projected again: rare).
                let t = if w.allows(best) {
                    Some(best)
                } else {
                    let mut t = None;
                    logits_of(node, &mut |l| t = w.choose_greedy(l, masked));
                    t
                };
                let Some(t) = t else {
                    stuck = true;
                    return -1;
                };
                w.accept(t);
                predicted[node] = Some(t);
                t
            })
        };
        g.output_rows += singles.get();
        // Back to `tree`'s ids: the accepted node, and the target's token after each node
        // (none for a pruned one).
        let mut predicted_at: Vec<Option<Token>> = vec![None; tree.len()];
        for (i, &p) in predicted.iter().enumerate() {
            predicted_at[old(i)] = p;
        }
        Ok(Judged {
            acc: accept::Accepted {
                node: old(acc.node),
                tokens: acc.tokens,
            },
            predicted: predicted_at,
            stuck,
            walked: vt.len(),
        })
    }

    /// The step's timing and counts, and what the controller learns from it: the cost of a
    /// call of this many rows, and which drafted tokens were taken.
    fn record(&mut self, e: &mut Engine, d: &Drafted, v: &Verified, j: &Judged) {
        let (tree, g) = (&d.tree, &mut self.g);
        let verify = v.started.elapsed().as_secs_f64();
        log::trace!(
            "call rows {} decode {:.2} ms verify {:.2} ms accepted {}",
            tree.len(),
            v.decode_seconds * 1e3,
            verify * 1e3,
            tree.nodes()[j.acc.node].depth
        );
        g.verify_seconds += verify;
        // The profile holds calls of full rows: a pruned call counts as fewer.
        let full = e.control.full_rows(tree.len(), j.walked);
        e.control.record_cost(full.round() as usize, verify);
        if v.pruning {
            e.control.record_kept(tree.len(), j.walked);
        }
        g.target_calls += 1;
        if g.target_calls.is_multiple_of(32) {
            log::debug!("controller: {}", e.control.summary());
        }
        g.verify_rows += tree.len() as u64;
        let measure_only = e.cfg.prune.measure_only;
        let would_keep = match (&v.kept, measure_only) {
            (Some(k), true) => k.iter().filter(|&&x| x).count(),
            _ => j.walked,
        };
        g.rows_after_exit += would_keep as u64;
        if v.pruning {
            // Accepted drafts, and those on a kept prefix of the accepted path.
            let path = path_nodes(tree, j.acc.node);
            let kept_prefix = match (&v.kept, measure_only) {
                (Some(k), true) => path[1..].iter().take_while(|&&n| k[n]).count(),
                _ => path.len() - 1,
            };
            g.exit_accepted += (path.len() - 1) as u64;
            g.exit_accepted_kept += kept_prefix as u64;
        }
        if v.hidden.is_none() {
            // llama.cpp computed the logits of every row.
            g.output_rows += tree.len() as u64;
        }
        let drafted = tree.len() - 1;
        g.drafted_tokens += drafted as u64;
        if drafted > 0 && e.cfg.adaptive {
            // Every drafted node whose parent verification reached was checked: taken if it
            // is on the accepted path.
            let on_path = path_nodes(tree, j.acc.node);
            // A node an early exit pruned was never checked: its outcome is unknown.
            let checked = |n: usize| measure_only || v.kept.as_ref().is_none_or(|k| k[n]);
            for (n, node) in tree.nodes().iter().enumerate().skip(1) {
                if let Some(p) = node.parent {
                    if on_path.contains(&p) && checked(n) {
                        e.control.record_token(d.evidence[n], on_path.contains(&n));
                    }
                }
            }
            e.control
                .record_reliability(d.expected, tree.nodes()[j.acc.node].depth);
        } else if e.cfg.adaptive {
            e.control.record_plain_step();
        }
    }

    /// Keep the accepted path's trunk and the target's token after it in the cache, tell the
    /// drafters, and emit the tokens (the grammar accepting each). The rest of the path is
    /// drafted again first thing next step (`carry`, see `TokenTree::trunk_end`); sampling
    /// keeps the whole path: rounding does not change whose distribution a token follows,
    /// and accepting a token twice would.
    fn commit(
        &mut self,
        e: &mut Engine,
        d: &Drafted,
        v: &Verified,
        j: &Judged,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> Result<()> {
        let (tree, acc) = (&d.tree, &j.acc);
        let sampled = self.sampled();
        let trunk = if sampled || j.stuck {
            acc.node
        } else {
            tree.trunk_end(acc.node)
        };
        if tree.len() > 1 && !sampled {
            // Rows acceptance did not read have no logits under on-demand projection; they
            // count as disagreeing.
            let ctx = &*self.ctx;
            let (draft, predicted) = checked_path(tree, acc.node, |n| {
                j.predicted[n].unwrap_or_else(|| match v.hidden {
                    Some(_) => -1,
                    None => ctx.logits(n as i32).map(argmax).unwrap_or(-1),
                })
            });
            let accepted = tree.nodes()[acc.node].depth;
            for dr in e.drafters(&mut self.local) {
                dr.verified(&draft, &predicted, accepted);
            }
        }
        let keep = tree.nodes()[trunk].depth + 1;
        self.carry = acc.tokens[keep..].to_vec();
        let acc_tokens = &acc.tokens[..keep];
        apply(self.ctx, &tree.rollback(&v.rows, trunk, 0))?;
        self.pos0 += acc_tokens.len() as i32;
        let model = self.ctx.model().clone();
        for &t in acc_tokens {
            if t < 0 && j.stuck {
                log::warn!("the grammar allows no token here: the output ends");
                self.done = true;
                break;
            }
            if t < 0 {
                return Err(Error::NoLogits { row: -1 });
            }
            if let Some(gr) = self.grammar.as_deref_mut() {
                gr.accept(t);
            }
            self.g.tokens.push(t);
            for dr in e.drafters(&mut self.local) {
                dr.accepted(t);
            }
            if model.is_eog(t) || !on_token(t) || self.g.tokens.len() >= self.max_tokens {
                self.done = true;
                break;
            }
        }
        self.id_last = *acc_tokens
            .last()
            .expect("acceptance yields at least one token");
        Ok(())
    }
}

/// Streamed output weights: every one of `rows` rows (node `c`'s hidden state at row
/// `old(c)` of `h`) projected in one pass, as a second pass would read them from storage
/// again; each row's best token into `predicted`.
fn project_every(
    od: &leap_host::project::OnDemand,
    h: &[f32],
    rows: usize,
    old: &dyn Fn(NodeId) -> NodeId,
    every: &mut Vec<Vec<f32>>,
    predicted: &mut [Option<Token>],
    g: &mut Generation,
) -> Result<()> {
    let n = od.n_embd();
    let hs: Vec<&[f32]> = (0..rows)
        .map(|c| &h[old(c) * n..(old(c) + 1) * n])
        .collect();
    every.resize_with(rows.max(every.len()), Vec::new);
    let tp = Instant::now();
    od.try_logits_rows(&hs, &mut every[..rows])?;
    g.output_rows += rows as u64;
    g.project_seconds += tp.elapsed().as_secs_f64();
    for (p, l) in predicted.iter_mut().zip(every.iter()) {
        *p = Some(argmax(l));
    }
    Ok(())
}

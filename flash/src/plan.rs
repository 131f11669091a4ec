//! Which sections stay resident under a DRAM budget.

use crate::map::{LayerMap, Section};

/// How the planner picks the resident sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Lever's choice (Table 6): the first blocks, in order, then the output projection.
    FirstLayers,
    /// The output projection first (for Gemma, the tied embedding matrix: 70% of the
    /// weights), then the first blocks.
    OutputFirst,
    /// The first blocks, then as much of the output projection as fits: a prefix of its
    /// rows stays resident and only the rest streams (Leap's projection reads it a chunk at
    /// a time, so a partial pin saves its bytes on every call). What every call reads is then
    /// the weights minus the budget (less the window), the least any split can read. The
    /// default.
    #[default]
    Fill,
}

/// A resident/streamed split of the sections a target call reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The DRAM budget for weights, bytes.
    pub budget: u64,
    /// Room kept for streamed data in flight: the chunk being computed and the ones read
    /// ahead.
    pub window: u64,
    /// Sections kept resident (locked or re-read never), in pinning order.
    pub pinned: Vec<Section>,
    /// Sections read from storage every call, in call order.
    pub streamed: Vec<Section>,
    pub pinned_bytes: u64,
    pub streamed_bytes: u64,
    /// Bytes at the start of the output projection's section kept resident although the
    /// section is streamed ([`Strategy::Fill`]); counted in `pinned_bytes`, not in
    /// `streamed_bytes`.
    pub output_pinned: u64,
}

/// Split `map`'s per-call sections for a budget of `budget` bytes: streamed data goes
/// through a window of `chunk * (1 + ahead)` bytes (the chunk computed and `ahead` read
/// ahead; a section smaller than a chunk is one unit), and what fits in the rest is pinned in
/// `strategy`'s order ([`Strategy::FirstLayers`] stops at the first section that does not
/// fit). A section that does not fit whole is streamed, except that with [`Strategy::Fill`],
/// once every block is pinned, the budget left pins a prefix of the output projection's
/// section in whole pages ([`Plan::output_pinned`]).
pub fn plan(map: &LayerMap, budget: u64, chunk: u64, ahead: usize, strategy: Strategy) -> Plan {
    let per_call = map.per_call();
    let size = |s: Section| map.bytes(s);
    let largest = per_call.iter().map(|&s| size(s)).max().unwrap_or(0);
    let unit = chunk.min(largest).max(1);
    // Nothing streams when everything fits: no window then.
    let everything: u64 = per_call.iter().map(|&s| size(s)).sum();
    let window = if everything <= budget {
        0
    } else {
        (unit * (1 + ahead as u64)).min(budget)
    };
    let mut order: Vec<Section> = per_call
        .iter()
        .copied()
        .filter(|s| matches!(s, Section::Block(_)))
        .collect();
    let out = *per_call
        .iter()
        .find(|s| matches!(s, Section::Output | Section::Embed))
        .expect("per_call has the output projection");
    match strategy {
        Strategy::FirstLayers | Strategy::Fill => order.push(out),
        Strategy::OutputFirst => order.insert(0, out),
    }
    // The small rest (norms) is always resident: it is read by every block.
    let mut left = budget - window;
    let mut pinned = vec![Section::Rest];
    left = left.saturating_sub(size(Section::Rest));
    for s in order {
        if size(s) <= left {
            left -= size(s);
            pinned.push(s);
        } else if strategy == Strategy::FirstLayers {
            // Lever pins a prefix: stop at the first section that does not fit.
            break;
        }
    }
    let streamed: Vec<Section> = per_call
        .into_iter()
        .filter(|s| !pinned.contains(s))
        .collect();
    // Fill: whatever is left holds a prefix of the output projection, in whole pages.
    let all_blocks = streamed.iter().all(|s| !matches!(s, Section::Block(_)));
    let output_pinned = if strategy == Strategy::Fill && all_blocks && streamed.contains(&out) {
        (left / 4096 * 4096).min(size(out))
    } else {
        0
    };
    Plan {
        budget,
        window,
        pinned_bytes: pinned.iter().map(|&s| size(s)).sum::<u64>() + output_pinned,
        streamed_bytes: streamed.iter().map(|&s| size(s)).sum::<u64>() - output_pinned,
        pinned,
        streamed,
        output_pinned,
    }
}

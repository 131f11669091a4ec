//! Which sections stay resident under a DRAM budget.

use crate::map::{LayerMap, Section};

/// How the planner picks the resident sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Lever's choice (Table 6): the first blocks, in order, then the output projection.
    FirstLayers,
    /// The output projection first (for Gemma, the tied embedding matrix: 70% of the
    /// weights), then the first blocks.
    OutputFirst,
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
}

/// Split `map`'s per-call sections for a budget of `budget` bytes: streamed data goes
/// through a window of `chunk * (1 + ahead)` bytes (the chunk computed and `ahead` read
/// ahead; a section smaller than a chunk is one unit), and what fits in the rest is pinned in
/// `strategy`'s order. A section that does not fit whole is streamed (no partial pins).
pub fn plan(map: &LayerMap, budget: u64, chunk: u64, ahead: usize, strategy: Strategy) -> Plan {
    let per_call = map.per_call();
    let size = |s: Section| map.bytes(s);
    let largest = per_call.iter().map(|&s| size(s)).max().unwrap_or(0);
    let unit = chunk.min(largest).max(1);
    let window = (unit * (1 + ahead as u64)).min(budget);
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
        Strategy::FirstLayers => order.push(out),
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
    Plan {
        budget,
        window,
        pinned_bytes: pinned.iter().map(|&s| size(s)).sum(),
        streamed_bytes: streamed.iter().map(|&s| size(s)).sum(),
        pinned,
        streamed,
    }
}

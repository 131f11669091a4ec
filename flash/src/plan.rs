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

#[cfg(test)]
mod tests {
    use super::*;

    /// A model of `blocks` blocks of `block` bytes, an output projection of `output` bytes
    /// (the embedding matrix when `tied`) and 100 bytes of the rest, laid out in that order.
    fn map(blocks: usize, block: u64, output: u64, tied: bool) -> LayerMap {
        let mut at = 0;
        let mut take = |n: u64| {
            let r = at..at + n;
            at += n;
            vec![r]
        };
        let mut sections: Vec<(Section, Vec<std::ops::Range<u64>>)> = Vec::new();
        let out = if tied {
            Section::Embed
        } else {
            Section::Output
        };
        sections.push((out, take(output)));
        if !tied {
            sections.push((Section::Embed, take(output)));
        }
        for i in 0..blocks {
            sections.push((Section::Block(i), take(block)));
        }
        sections.push((Section::Rest, take(100)));
        LayerMap {
            file_size: at,
            sections,
            tied_output: tied,
        }
    }

    /// Every plan splits exactly what a call reads, and keeps pinned data inside the budget
    /// less the window.
    fn check(m: &LayerMap, p: &Plan) {
        assert_eq!(
            p.pinned_bytes + p.streamed_bytes,
            m.per_call_bytes(),
            "{p:?}"
        );
        assert!(p.pinned_bytes + p.window <= p.budget, "{p:?}");
        for s in m.per_call() {
            assert!(
                p.pinned.contains(&s) != p.streamed.contains(&s),
                "{s:?} in one list: {p:?}"
            );
        }
    }

    #[test]
    fn a_tied_model_reads_its_embeddings_every_call() {
        let tied = map(4, 1000, 7000, true);
        assert_eq!(tied.per_call().len(), 6);
        assert_eq!(tied.per_call_bytes(), 4 * 1000 + 7000 + 100);
        assert_eq!(tied.largest_block(), 1000);
        let untied = map(4, 1000, 7000, false);
        assert_eq!(untied.per_call_bytes(), 4 * 1000 + 7000 + 100);
        assert_eq!(
            untied.total(),
            untied.per_call_bytes() + 7000,
            "embeddings: rows only"
        );
        assert_eq!(untied.bytes(Section::Embed), 7000);
    }

    #[test]
    fn everything_fits_nothing_streams() {
        let m = map(4, 1000, 7000, true);
        let p = plan(&m, 20_000, 1000, 1, Strategy::Fill);
        check(&m, &p);
        assert_eq!((p.window, p.streamed_bytes, p.output_pinned), (0, 0, 0));
        assert!(p.streamed.is_empty());
    }

    #[test]
    fn first_layers_stop_at_the_first_section_that_does_not_fit() {
        // Budget 4000, window 2 x 1000: the rest (100) and one block fit, the next does not.
        let m = map(4, 1000, 7000, true);
        let p = plan(&m, 4000, 1000, 1, Strategy::FirstLayers);
        check(&m, &p);
        assert_eq!(p.window, 2000);
        assert_eq!(p.pinned, vec![Section::Rest, Section::Block(0)]);
        assert_eq!(p.output_pinned, 0);
    }

    #[test]
    fn fill_pins_the_blocks_then_whole_pages_of_the_output() {
        let m = map(4, 10_000, 100_000, true);
        let budget = 4 * 10_000 + 100 + 2 * 10_000 + 30_000;
        let p = plan(&m, budget, 10_000, 1, Strategy::Fill);
        check(&m, &p);
        assert_eq!(p.streamed, vec![Section::Embed]);
        assert_eq!(p.output_pinned % 4096, 0);
        assert_eq!(p.output_pinned, 30_000 / 4096 * 4096);
        // What a call reads from storage is the weights beyond the budget, within a page.
        assert!(p.streamed_bytes < m.per_call_bytes() + p.window - budget + 4096);
        // First-layers leaves the same output wholly streamed.
        let q = plan(&m, budget, 10_000, 1, Strategy::FirstLayers);
        check(&m, &q);
        assert_eq!((q.output_pinned, q.streamed_bytes), (0, 100_000));
    }

    #[test]
    fn output_first_pins_the_output_before_the_blocks() {
        let m = map(4, 10_000, 50_000, true);
        let p = plan(&m, 90_000, 10_000, 1, Strategy::OutputFirst);
        check(&m, &p);
        assert_eq!(p.pinned[..2], [Section::Rest, Section::Embed]);
        assert!(p.streamed.iter().all(|s| matches!(s, Section::Block(_))));
    }
}

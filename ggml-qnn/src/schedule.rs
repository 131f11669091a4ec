//! Progressive graph switching (sd.npu, 000 §3.2). Pure code.
//!
//! The model is split into `N` blocks, each with a prefill-shaped graph `G1` (loaded) and a
//! decode-shaped graph `G2` (to be loaded). Synchronous switching prefills every chunk on `G1`
//! and then loads all of `G2`. Progressive switching loads `G2` block by block from the last
//! block backwards while prefill computes: before computing block `i` it picks the smallest `k*`
//! with `T_load(P_j; G2) ≤ Σ_{l<k} T_compute(P_{i+l})` (Eq. 1-2), computes those `k*` blocks
//! (switched blocks run `G2`, repeated over sub-chunks) while block `j` loads, and repeats. A
//! block is never computed while it loads; loads left when prefill ends run after it.

/// Profiled times of one block, in ms.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct BlockTimes {
    /// One prefill chunk on the prefill-shaped graph `G1`.
    pub compute_g1: f64,
    /// The same chunk on the decode-shaped graph `G2` (executed repeatedly over sub-chunks).
    pub compute_g2: f64,
    /// Loading `G2` for the block (e.g. a context binary).
    pub load_g2: f64,
}

/// One step of a plan: compute blocks `first..first+count` of `chunk` while `loading` loads.
#[derive(Clone, Debug, PartialEq)]
pub struct Round {
    pub chunk: usize,
    pub first: usize,
    pub count: usize,
    pub loading: Option<usize>,
    pub start_ms: f64,
    pub end_ms: f64,
}

/// A simulated schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub rounds: Vec<Round>,
    /// When prefill and the switch to `G2` are both done.
    pub total_ms: f64,
}

/// Synchronous switching: all chunks on `G1`, then every `G2` load.
pub fn synchronous_ms(blocks: &[BlockTimes], chunks: usize) -> f64 {
    chunks as f64 * blocks.iter().map(|b| b.compute_g1).sum::<f64>()
        + blocks.iter().map(|b| b.load_g2).sum::<f64>()
}

/// Progressive switching with the greedy `k*` rule (Eq. 2).
pub fn progressive(blocks: &[BlockTimes], chunks: usize) -> Plan {
    let n = blocks.len();
    let mut switched = vec![false; n];
    let compute = |i: usize, sw: &[bool]| {
        if sw[i] {
            blocks[i].compute_g2
        } else {
            blocks[i].compute_g1
        }
    };
    // The next block to load: the last one not switched.
    let next_load = |sw: &[bool]| (0..n).rev().find(|&j| !sw[j]);
    let mut t = 0.0;
    let mut rounds = Vec::new();
    for chunk in 0..chunks {
        let mut i = 0;
        while i < n {
            // The block to load: the last one not switched. Blocks are computed in order, so
            // its load overlaps the blocks before it (when it is ahead) or the rest of the
            // chunk (when it was already computed in this chunk).
            let window_end = match next_load(&switched) {
                Some(j) if j > i => Some((j, j)),
                Some(j) if j < i => Some((j, n)),
                _ => None,
            };
            let Some((j, window_end)) = window_end else {
                // Nothing to load, or the block to load is the next one: compute one block.
                let dt = compute(i, &switched);
                rounds.push(Round {
                    chunk,
                    first: i,
                    count: 1,
                    loading: None,
                    start_ms: t,
                    end_ms: t + dt,
                });
                t += dt;
                i += 1;
                continue;
            };
            // k*: the fewest blocks whose compute covers j's load (Eq. 2).
            let mut k = 0;
            let mut covered = 0.0;
            while i + k < window_end {
                covered += compute(i + k, &switched);
                k += 1;
                if covered >= blocks[j].load_g2 {
                    break;
                }
            }
            let end = t + covered.max(blocks[j].load_g2);
            rounds.push(Round {
                chunk,
                first: i,
                count: k,
                loading: Some(j),
                start_ms: t,
                end_ms: end,
            });
            switched[j] = true;
            t = end;
            i += k;
        }
    }
    // Loads prefill could not hide.
    while let Some(j) = next_load(&switched) {
        rounds.push(Round {
            chunk: chunks,
            first: 0,
            count: 0,
            loading: Some(j),
            start_ms: t,
            end_ms: t + blocks[j].load_g2,
        });
        t += blocks[j].load_g2;
        switched[j] = true;
    }
    Plan {
        rounds,
        total_ms: t,
    }
}

/// The faster of synchronous and progressive switching for these times, and its total.
/// Progressive switching runs switched blocks on `G2` during prefill; when `G2` repeated over
/// sub-chunks is much slower than `G1` (e.g. per-launch overhead dominating, as on the x86
/// emulator), hiding the loads does not pay for that, and synchronous switching wins.
pub fn best(blocks: &[BlockTimes], chunks: usize) -> (&'static str, f64) {
    let sync = synchronous_ms(blocks, chunks);
    let prog = progressive(blocks, chunks).total_ms;
    if prog < sync {
        ("progressive", prog)
    } else {
        ("sync", sync)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(n: usize, g1: f64, g2: f64, load: f64) -> Vec<BlockTimes> {
        vec![
            BlockTimes {
                compute_g1: g1,
                compute_g2: g2,
                load_g2: load,
            };
            n
        ]
    }

    #[test]
    fn paper_example_two_blocks_hide_one_load() {
        // N = 6, two chunks, a load costs two blocks of compute (000 Fig. 8).
        let b = uniform(6, 1.0, 1.0, 2.0);
        assert_eq!(synchronous_ms(&b, 2), 12.0 + 12.0);
        let p = progressive(&b, 2);
        // Chunk 1: P1,P2 || load P6; P3,P4 || load P5; P5,P6 (now on G2) || load P4.
        // Chunk 2: P1,P2 || load P3; P3,P4 || load P2; P5,P6 || load P1 (k* = 2 each time).
        let loads: Vec<_> = p
            .rounds
            .iter()
            .map(|r| (r.first, r.count, r.loading))
            .collect();
        assert_eq!(
            loads,
            vec![
                (0, 2, Some(5)),
                (2, 2, Some(4)),
                (4, 2, Some(3)),
                (0, 2, Some(2)),
                (2, 2, Some(1)),
                (4, 2, Some(0)),
            ]
        );
        // Every load hidden: the total is pure compute.
        assert_eq!(p.total_ms, 12.0);
    }

    #[test]
    fn slow_decode_graphs_make_sync_the_better_plan() {
        let b = uniform(6, 1.0, 4.0, 0.5);
        let (name, ms) = best(&b, 2);
        assert_eq!(name, "sync");
        assert_eq!(ms, synchronous_ms(&b, 2));
        let b = uniform(6, 1.0, 1.0, 2.0);
        assert_eq!(best(&b, 2).0, "progressive");
    }

    #[test]
    fn cheap_loads_take_k_star_one() {
        let b = uniform(4, 2.0, 2.0, 1.0);
        let p = progressive(&b, 1);
        assert!(p
            .rounds
            .iter()
            .filter(|r| r.loading.is_some())
            .all(|r| r.count <= 1));
        assert_eq!(p.total_ms, 8.0);
    }

    #[test]
    fn loads_that_cannot_hide_cost_their_excess_and_never_exceed_sync() {
        let b = uniform(3, 1.0, 1.5, 10.0);
        let p = progressive(&b, 1);
        let s = synchronous_ms(&b, 1);
        assert!(p.total_ms <= s, "{} > {s}", p.total_ms);
        // Each load of 10 overlaps at most the compute before its block.
        let loads = p.rounds.iter().filter(|r| r.loading.is_some()).count();
        assert_eq!(loads, 3);
    }

    #[test]
    fn a_block_is_never_computed_while_it_loads() {
        for load in [0.5, 1.0, 3.0, 7.0] {
            let b = uniform(5, 1.0, 0.8, load);
            for chunks in 1..4 {
                let p = progressive(&b, chunks);
                for r in &p.rounds {
                    if let Some(j) = r.loading {
                        assert!(!(r.first..r.first + r.count).contains(&j), "{r:?}");
                    }
                    assert!(r.end_ms >= r.start_ms);
                }
                // Every block ends up switched exactly once.
                let mut loaded: Vec<usize> = p.rounds.iter().filter_map(|r| r.loading).collect();
                loaded.sort();
                assert_eq!(loaded, vec![0, 1, 2, 3, 4]);
            }
        }
    }
}

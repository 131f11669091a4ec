//! When speculation pays, and how much to draft (the thesis' analytic model, 003 Eq. 4.1).
//!
//! With per-token acceptance `a` and a draft of `g` tokens, a verification call yields
//! `(1 - a^(g+1)) / (1 - a)` tokens on average and costs `c(g + 1)`, the time of a call of
//! `g + 1` rows; speculation pays when that ratio beats a plain step. [`crate::lever`]
//! generalises it to trees (a chain's gain there is exactly [`expected_tokens`]) and makes
//! the decision every step, drafting nothing when no tree beats a plain step. The inputs are
//! measured online: acceptance per bucket of match length (longer suffix matches are more
//! reliable), a latency profile of this machine per row count (Lever's `c(rows)`), and for row
//! counts not seen yet the slope `beta` in `c(k) = c(1) * (1 + beta * (k - 1))`, fitted by
//! least squares to the observed call times.

/// Buckets of suffix-match length: 1, 2, 3-4, 5-8, 9-16, 17+.
const BUCKETS: usize = 6;

/// Where a drafted token came from: each source's acceptance is learned on its own, so a
/// source whose drafts fail (on this model, this request) stops crowding out the others as
/// a sibling in trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Source {
    /// Retrieval from the request (prompt and output so far).
    #[default]
    Request,
    /// Retrieval from earlier requests and answers.
    History,
    /// A rejected draft's segment the target agreed with, offered again.
    Reuse,
    /// The in-context calibrated predictions.
    Calibrated,
    /// A draft model.
    Model,
    /// Tokens accepted off the trunk in the last step.
    Carry,
    /// Retrieval from the request: another token that followed the longest match earlier
    /// (a sibling of the [`Source::Request`] continuation).
    Sibling,
    /// Retrieval from the model's own answers to other prompts, shipped in its sidecar
    /// ([`crate::corpus`]).
    Corpus,
}

const SOURCES: usize = 8;

/// What backs a drafted token: its source and the length of the suffix match behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Evidence {
    pub source: Source,
    pub match_len: usize,
}

impl Evidence {
    /// `match_len` from `source`.
    pub fn new(source: Source, match_len: usize) -> Self {
        Self { source, match_len }
    }

    fn cell(self) -> (usize, usize) {
        (self.source as usize, bucket(self.match_len))
    }
}

fn bucket(match_len: usize) -> usize {
    match match_len {
        0 | 1 => 0,
        2 => 1,
        3..=4 => 2,
        5..=8 => 3,
        9..=16 => 4,
        _ => 5,
    }
}

/// Expected tokens from one call that verifies a chain of `g` drafts with acceptance `a`.
pub fn expected_tokens(a: f64, g: usize) -> f64 {
    if a >= 1.0 {
        return (g + 1) as f64;
    }
    (1.0 - a.powi(g as i32 + 1)) / (1.0 - a)
}

/// Row counts the latency profile keeps one estimate for each (more rows: the linear fit).
const PROFILE_ROWS: usize = 65;

/// Online acceptance and cost estimates, and the draft-length decision.
#[derive(Debug, Clone)]
pub struct Controller {
    /// Latency profile (Lever §4.2): a call of `r` rows over the 1-row time when it was
    /// recorded (EMA), 0 if never seen.
    profile: [f64; PROFILE_ROWS],
    /// Row counts called at least once.
    seen: [bool; PROFILE_ROWS],
    /// Reliability factor: observed accepted drafts over the expected (EMA), scaling the
    /// per-token acceptance estimates of trees.
    reliability: f64,
    /// Accepted draft tokens per source and bucket (with a prior).
    accepted: [[f64; BUCKETS]; SOURCES],
    /// Rejections per source and bucket (at most one per verified draft), with a prior.
    rejected: [[f64; BUCKETS]; SOURCES],
    /// Seconds of a 1-row call (EMA).
    t1: f64,
    /// Least-squares sums for beta: sum x*y and sum x*x with x = k-1, y = t/t1 - 1.
    sxy: f64,
    sxx: f64,
    /// Early exit: the share of a drafted row's cost spent after the exit layer (0: no
    /// early exit), and the fraction of drafted rows kept past it (EMA).
    exit_share: f64,
    keep_rate: f64,
    /// Steps since the last one that verified a draft.
    idle: usize,
}

/// Steps without a verified draft after which the next tree is verified even if the
/// estimates say it does not pay ([`Controller::exploring`]).
pub const EXPLORE_AFTER: usize = 48;

impl Controller {
    /// A controller with weak, optimistic priors: acceptance rising with the match length
    /// (0.6 for one token to 0.9 for 17+; a controller that never drafts never learns), worth
    /// four observations, and cost slope `beta_prior`.
    pub fn new(beta_prior: f64) -> Self {
        Self::with_priors(beta_prior)
    }

    /// Forget the acceptance learned from the drafts of earlier requests (what their texts
    /// were like), keeping the machine's measured costs.
    pub fn forget_acceptance(&mut self) {
        let fresh = Self::with_priors(0.0);
        self.reliability = fresh.reliability;
        self.accepted = fresh.accepted;
        self.rejected = fresh.rejected;
        self.keep_rate = fresh.keep_rate;
        self.idle = 0;
    }

    fn with_priors(beta_prior: f64) -> Self {
        const PRIOR: [f64; BUCKETS] = [0.6, 0.7, 0.75, 0.8, 0.85, 0.9];
        const WEIGHT: f64 = 4.0;
        let mut accepted = [PRIOR.map(|a| a * WEIGHT); SOURCES];
        let mut rejected = [PRIOR.map(|a| WEIGHT * (1.0 - a)); SOURCES];
        // A sibling is the road not taken the last time the match occurred: half as likely
        // until it shows otherwise, so it does not crowd out the continuation it competes
        // with (nor, rejected, drag down the reliability of every tree).
        let s = Source::Sibling as usize;
        accepted[s] = PRIOR.map(|a| a * 0.5 * WEIGHT);
        rejected[s] = PRIOR.map(|a| WEIGHT * (1.0 - a * 0.5));
        Self {
            profile: [0.0; PROFILE_ROWS],
            seen: [false; PROFILE_ROWS],
            reliability: 1.0,
            accepted,
            rejected,
            t1: 0.0,
            sxy: beta_prior * 4.0,
            sxx: 4.0,
            exit_share: 0.0,
            keep_rate: 0.7,
            idle: 0,
        }
    }

    /// Estimated per-token acceptance for drafts with evidence `ev`.
    pub fn acceptance(&self, ev: Evidence) -> f64 {
        let (s, b) = ev.cell();
        self.accepted[s][b] / (self.accepted[s][b] + self.rejected[s][b])
    }

    /// A one-line account of the estimates (for debug logs): costs of 2-5 rows,
    /// reliability, steps since a draft, and request retrieval's acceptance per bucket.
    pub fn summary(&self) -> String {
        let acc: Vec<String> = (0..BUCKETS)
            .map(|b| {
                let s = Source::Request as usize;
                let (a, r) = (self.accepted[s][b], self.rejected[s][b]);
                format!("{:.2}/{:.0}", a / (a + r), a + r)
            })
            .collect();
        format!(
            "cost(2..5) {:.2} {:.2} {:.2} {:.2}, beta {:.2}, t1 {:.1} ms, reliability {:.2}, \
             idle {}, request acceptance by match length {}",
            self.cost(2),
            self.cost(3),
            self.cost(4),
            self.cost(5),
            self.beta(),
            self.t1 * 1e3,
            self.reliability,
            self.idle,
            acc.join(" ")
        )
    }

    /// Estimated cost slope.
    pub fn beta(&self) -> f64 {
        (self.sxy / self.sxx).max(0.01)
    }

    /// Relative cost of a call of `rows` rows (a 1-row call is 1): from the latency profile
    /// where this row count was measured, else from the fitted slope with a 10% penalty for
    /// the unseen shape.
    pub fn cost(&self, rows: usize) -> f64 {
        let rows = rows.max(1);
        let linear = 1.0 + self.beta() * (rows - 1) as f64;
        if rows == 1 {
            return 1.0;
        }
        match self.profile.get(rows) {
            Some(&r) if r > 0.0 => r,
            _ => linear * 1.1,
        }
    }

    /// Verification prunes rows at an early-exit layer: `share` of a drafted row's cost is
    /// spent after it (the later layers' fraction of the layers).
    pub fn set_exit_share(&mut self, share: f64) {
        self.exit_share = share.clamp(0.0, 1.0);
    }

    /// A call's rows counted as full rows: the root, the drafted rows' share before the
    /// exit, and after it the drafted rows that went on (`kept`, root included).
    pub fn full_rows(&self, rows: usize, kept: usize) -> f64 {
        let d = rows.saturating_sub(1) as f64;
        let k = kept.saturating_sub(1) as f64;
        1.0 + d * (1.0 - self.exit_share) + k * self.exit_share
    }

    /// Record how many of a call's rows went past the exit layer.
    pub fn record_kept(&mut self, rows: usize, kept: usize) {
        if rows > 1 && self.exit_share > 0.0 {
            let r = kept.saturating_sub(1) as f64 / (rows - 1) as f64;
            self.keep_rate = 0.9 * self.keep_rate + 0.1 * r;
        }
    }

    /// The fraction of drafted rows kept past the exit layer (EMA).
    pub fn keep_rate(&self) -> f64 {
        self.keep_rate
    }

    /// Relative cost of verifying a tree of `rows` rows, counting the rows after the exit
    /// layer separately: the expected kept rows pay them, the others only the layers before
    /// (interpolating the profile between whole row counts). Without an early exit, [`cost`].
    ///
    /// [`cost`]: Controller::cost
    pub fn tree_cost(&self, rows: usize) -> f64 {
        if self.exit_share == 0.0 || rows <= 1 {
            return self.cost(rows);
        }
        let d = (rows - 1) as f64;
        let full = 1.0 + d * (1.0 - self.exit_share * (1.0 - self.keep_rate));
        let lo = full.floor() as usize;
        let f = full - lo as f64;
        self.cost(lo) * (1.0 - f) + self.cost(lo + 1) * f
    }

    /// The reliability factor (1: acceptance estimates are borne out).
    pub fn reliability(&self) -> f64 {
        self.reliability
    }

    /// Record one tree verification: `expected` accepted drafts were predicted, `got` came.
    pub fn record_reliability(&mut self, expected: f64, got: usize) {
        self.idle = 0;
        if expected <= 0.0 {
            return;
        }
        let r = (got as f64 / expected).clamp(0.25, 2.0);
        self.reliability = (0.9 * self.reliability + 0.1 * r).clamp(0.3, 1.5);
    }

    /// Record that a drafted token with evidence `ev` was checked (its parent was reached)
    /// and whether the target took it.
    pub fn record_token(&mut self, ev: Evidence, accepted: bool) {
        let (s, b) = ev.cell();
        if accepted {
            self.accepted[s][b] += 1.0;
        } else {
            self.rejected[s][b] += 1.0;
        }
    }

    /// Record a step that verified no draft: the reliability factor drifts back towards 1
    /// (1% a step). It is only measured on trees, so without this a run of bad trees that
    /// stops drafting would keep it low for good, and the engine would never draft again
    /// once drafts are good again; now it tries a tree within some dozens of steps.
    pub fn record_plain_step(&mut self) {
        self.reliability += 0.01 * (1.0 - self.reliability);
        self.idle += 1;
    }

    /// Whether the next tree should be verified whatever the estimates say: after
    /// [`EXPLORE_AFTER`] steps without a draft. Estimates only change on drafted calls, so
    /// without this a few slow multi-row calls (the machine has a slow spell) or an unlucky
    /// run of rejections would stop drafting for good: this costs one multi-row call in that
    /// many steps.
    pub fn exploring(&self) -> bool {
        self.idle >= EXPLORE_AFTER
    }

    /// Record the wall time of a call of `rows` rows.
    pub fn record_cost(&mut self, rows: usize, seconds: f64) {
        // Multi-row calls are kept relative to the 1-row time of their moment: a row count
        // seen while the machine ran slow, and not since, does not look dear for good once
        // it runs fast again (and 1-row calls keep coming).
        // A row count's first call is left out (of the profile and the slope): it can pay
        // one-off costs.
        if rows > 1 && rows < PROFILE_ROWS && !std::mem::replace(&mut self.seen[rows], true) {
            return;
        }
        if let (Some(r), true) = (self.profile.get_mut(rows), rows > 1 && self.t1 > 0.0) {
            let ratio = seconds / self.t1;
            *r = if *r == 0.0 {
                ratio
            } else {
                0.8 * *r + 0.2 * ratio
            };
        }
        if rows <= 1 {
            self.t1 = if self.t1 == 0.0 {
                seconds
            } else {
                0.9 * self.t1 + 0.1 * seconds
            };
            return;
        }
        if self.t1 > 0.0 {
            let x = (rows - 1) as f64;
            let y = seconds / self.t1 - 1.0;
            // Forget slowly so the fit follows the machine (and the context length).
            self.sxy = 0.98 * self.sxy + x * y;
            self.sxx = 0.98 * self.sxx + x * x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_is_the_geometric_sum() {
        assert!((expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
        assert_eq!(expected_tokens(0.0, 5), 1.0);
        assert_eq!(expected_tokens(1.0, 3), 4.0);
    }

    #[test]
    fn pruned_rows_make_trees_cheaper() {
        let mut c = Controller::new(0.5);
        c.record_cost(1, 0.02);
        for _ in 0..2 {
            for r in 2..10 {
                c.record_cost(r, 0.02 * (1.0 + 0.5 * (r - 1) as f64));
            }
        }
        assert_eq!(c.tree_cost(5), c.cost(5), "no exit: the profile");
        c.set_exit_share(0.5);
        for _ in 0..100 {
            c.record_kept(9, 3);
        }
        // 8 drafted rows: half their cost before the exit, a quarter of them after it.
        assert!((c.keep_rate() - 0.25).abs() < 1e-3);
        let full = 1.0 + 8.0 * (1.0 - 0.5 * 0.75);
        assert!((c.tree_cost(9) - (1.0 + 0.5 * (full - 1.0))).abs() < 1e-3);
        assert!(c.tree_cost(9) < c.cost(9));
        assert_eq!(c.full_rows(9, 3), 1.0 + 4.0 + 1.0);
    }

    #[test]
    fn a_controller_that_stopped_drafting_tries_again() {
        let mut c = Controller::new(0.5);
        for _ in 0..40 {
            c.record_reliability(2.0, 0);
        }
        assert!(c.reliability() < 0.35, "{}", c.reliability());
        for _ in 0..150 {
            c.record_plain_step();
        }
        assert!(c.reliability() > 0.8, "{}", c.reliability());
        // A sibling starts below the continuation it competes with.
        let ev = |source| Evidence::new(source, 4);
        assert!(c.acceptance(ev(Source::Sibling)) < 0.5 * c.acceptance(ev(Source::Request)) + 0.01);
    }

    #[test]
    fn a_slow_spell_does_not_make_row_counts_dear_for_good() {
        let mut c = Controller::new(0.5);
        // A row count's first call (its graph's first build) is left out.
        c.record_cost(1, 0.020);
        c.record_cost(3, 0.200);
        assert!((c.cost(3) - 1.1 * (1.0 + 2.0 * c.beta())).abs() < 1e-9);
        // Measured while the machine ran at half speed...
        for _ in 0..60 {
            c.record_cost(1, 0.040);
            c.record_cost(3, 0.060);
        }
        // ...then only 1-row calls, at full speed.
        for _ in 0..200 {
            c.record_cost(1, 0.020);
        }
        assert!((c.cost(3) - 1.5).abs() < 0.01, "{}", c.cost(3));
    }

    #[test]
    fn a_median_ignores_one_stray_time() {
        assert_eq!(super::median(&mut [0.020, 0.210, 0.021]), 0.021);
        assert_eq!(super::median(&mut [0.030, 0.010, 0.020, 0.900]), 0.025);
        assert_eq!(super::median(&mut []), 0.0);
    }

    #[test]
    fn learns_the_cost_slope_from_call_times() {
        let mut c = Controller::new(0.1);
        for _ in 0..200 {
            c.record_cost(1, 0.020);
            for k in [2usize, 4, 8] {
                c.record_cost(k, 0.020 * (1.0 + 0.6 * (k - 1) as f64));
            }
        }
        assert!((c.beta() - 0.6).abs() < 0.05, "{}", c.beta());
        // Measured row counts come from the profile, others from the fit (with a penalty).
        assert!((c.cost(4) - 2.8).abs() < 0.01, "{}", c.cost(4));
        assert!((c.cost(3) - 1.1 * (1.0 + 2.0 * c.beta())).abs() < 1e-9);
    }
}

/// Which of a call's paths [`measure_cost_curve`] times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paths {
    /// llama.cpp's own: the call with every row's logits, and with the last row's only.
    pub llama: bool,
    /// The engine's: with an on-demand projection, the call cut at the hidden states and then
    /// every row projected in one pass; without one, the call with every row's logits.
    pub engine: bool,
}

impl Paths {
    /// Both paths, alternated within each round.
    pub const BOTH: Self = Self {
        llama: true,
        engine: true,
    };
}

/// One point of a verification cost curve (`None`: that path was not timed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostPoint {
    /// Rows in the target call.
    pub rows: usize,
    /// Median seconds with logits for every row.
    pub all_logits: Option<f64>,
    /// Median seconds with logits for the last row only.
    pub last_logits: Option<f64>,
    /// With an on-demand projection: median seconds of the call cut at the hidden states (every
    /// row's), and of projecting all k rows in one pass afterwards.
    pub cut: Option<(f64, f64)>,
}

impl CostPoint {
    /// Seconds of the engine's path with an on-demand projection (the call cut at the hidden
    /// states, then every row projected), else of the call with every row's logits.
    #[must_use]
    pub fn engine(&self) -> Option<f64> {
        self.cut.map(|(c, p)| c + p).or(self.all_logits)
    }
}

/// The median of `xs` (the mean of the middle two for an even count); 0 when empty. Sorts
/// `xs`. Also `leap attn-bench`'s.
#[must_use]
pub fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// One target call of `k` rows after `context` (which sequence 0 of `ctx` holds), rolled
/// back: its seconds. `all`: every row's logits (else the last row's); `cut`: the decode stops
/// at the hidden states (an armed on-demand projection), so there are no logits to read.
/// `batch` holds at least `k` tokens.
///
/// # Errors
/// Decode failures.
pub fn timed_call(
    ctx: &mut leap_host::Context,
    batch: &mut leap_host::Batch,
    context: &[crate::sam::Token],
    k: usize,
    all: bool,
    cut: bool,
) -> leap_host::Result<f64> {
    let pos0 = context.len() as i32;
    batch.clear();
    for i in 0..k {
        let t = context[(i * 7919) % context.len()];
        batch.add(t, pos0 + i as i32, &[0], all || i + 1 == k)?;
    }
    let t0 = std::time::Instant::now();
    ctx.decode(batch)?;
    if !cut {
        ctx.logits(-1)?;
    }
    let s = t0.elapsed().as_secs_f64();
    ctx.seq_rm(0, pos0, -1);
    Ok(s)
}

/// Measure what a target call of `k` rows costs on this machine, for each `k` in `rows`,
/// after `context` tokens are in the KV cache (sequence 0 of an empty context), on the `paths`
/// asked for. Each call is rolled back, so every measurement sees the same cache.
///
/// The measurements are taken in `reps` rounds, each round timing every row count and variant
/// once, and each point reports the median over the rounds: a shared machine's slow spell (a
/// neighbour's burst, a descheduled thread) then lands on every row count alike instead of on
/// whichever was being measured, and a stray call that took ten times as long moves no median.
///
/// # Errors
/// Decode failures.
pub fn measure_cost_curve(
    ctx: &mut leap_host::Context,
    od: Option<&leap_host::project::OnDemand>,
    context: &[crate::sam::Token],
    rows: &[usize],
    reps: usize,
    paths: Paths,
) -> leap_host::Result<Vec<CostPoint>> {
    ctx.clear(false);
    crate::plain::prefill(ctx, context, 512)?;
    let max_rows = rows.iter().copied().max().unwrap_or(1);
    let mut batch = leap_host::Batch::new(max_rows, 1);
    let mut once = |ctx: &mut leap_host::Context, k: usize, all: bool, cut: bool| {
        timed_call(ctx, &mut batch, context, k, all, cut)
    };
    // The engine's path without an on-demand projection is the call with every row's logits.
    let cut_od = od.filter(|_| paths.engine);
    let all = paths.llama || (paths.engine && od.is_none());
    // A warm-up call, then per row count: all logits, last logits, cut, projection.
    once(ctx, 1, true, false)?;
    let mut samples = vec![[(); 4].map(|()| Vec::with_capacity(reps.max(1))); rows.len()];
    // The projection's output rows, kept between calls as the engine keeps its own.
    let mut outs = vec![Vec::new(); max_rows];
    for _ in 0..reps.max(1) {
        for (&k, s) in rows.iter().zip(&mut samples) {
            if all {
                s[0].push(once(ctx, k, true, false)?);
            }
            if paths.llama {
                s[1].push(once(ctx, k, false, false)?);
            }
            if let Some(od) = cut_od {
                od.arm(true);
                let t = once(ctx, k, true, true);
                od.disarm();
                s[2].push(t?);
                let hidden = od.take_hidden()?;
                let hs: Vec<&[f32]> = hidden.chunks_exact(od.n_embd()).collect();
                let t0 = std::time::Instant::now();
                od.logits_rows(&hs, &mut outs[..hs.len()]);
                s[3].push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let timed = |xs: &mut Vec<f64>| (!xs.is_empty()).then(|| median(xs));
    Ok(rows
        .iter()
        .zip(&mut samples)
        .map(|(&k, [all, last, cut, proj])| CostPoint {
            rows: k,
            all_logits: timed(all),
            last_logits: timed(last),
            cut: timed(cut).zip(timed(proj)),
        })
        .collect())
}

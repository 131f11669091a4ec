//! Plain decoding through llama.cpp: prefill, then one target call per token. This is the
//! baseline every speculative mode is measured against.

use std::time::Instant;

use leap_host::grammar::Grammar;
use leap_host::project::OnDemand;
use leap_host::sampler::SamplingParams;
use leap_host::usage::cpu_seconds;
use leap_host::{Batch, Context, Result, Token};

use crate::accept::{pick, position_uniform};
use crate::dist::Truncation;

/// What one generation produced and what it cost.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    /// Generated tokens (the prompt excluded).
    pub tokens: Vec<Token>,
    /// Wall time of the prompt pass.
    pub prefill_seconds: f64,
    /// Wall time from the end of prefill to the last token.
    pub decode_seconds: f64,
    /// User + system CPU time of the process during decode.
    pub decode_cpu_seconds: f64,
    /// Target model calls during decode.
    pub target_calls: u64,
    /// Tokens proposed by a drafter (0 for plain decoding).
    pub drafted_tokens: u64,
    /// Wall time spent drafting (building token trees), part of `decode_seconds`.
    pub draft_seconds: f64,
    /// Wall time of in-context calibration, part of `prefill_seconds`.
    pub calib_seconds: f64,
    /// Wall time of verification: the target calls and the on-demand output projection of
    /// the rows acceptance read (part of `decode_seconds`; 0 for plain decoding).
    pub verify_seconds: f64,
    /// The on-demand projection's part of `verify_seconds`.
    pub project_seconds: f64,
    /// Rows that entered verification (target-call rows during decode).
    pub verify_rows: u64,
    /// Rows that went on past the early-exit layer (all of them without pruning heads).
    pub rows_after_exit: u64,
    /// Seconds the early-exit head took deciding which rows go on.
    pub exit_seconds: f64,
    /// In calls the early-exit head decided on: drafted tokens accepted, and how many of them
    /// the pruning kept (with `measure_only`, what it would have kept; when it prunes, all).
    pub exit_accepted: u64,
    pub exit_accepted_kept: u64,
    /// Rows whose logits were computed (the output projection's rows).
    pub output_rows: u64,
    /// The target drafted for itself over a resident vocabulary ([`crate::vocab`]) rather
    /// than verifying the drafters' trees.
    pub self_drafted: bool,
    /// There, the head's guesses at the token after next that rode in a step's call
    /// ([`crate::ahead`]), and how many were the resident best (kept as drafts).
    pub guesses: u64,
    pub guesses_kept: u64,
    /// There, the tokens of retrieval chains that rode in a step's call after the round's
    /// drafts, and how many stood as drafts.
    pub rides: u64,
    pub rides_kept: u64,
}

/// Run the prompt through the target (sequence 0 from position 0), logits for the last token
/// only. The context's memory must be empty.
///
/// # Errors
/// Decode failures.
pub fn prefill(ctx: &mut Context, prompt: &[Token], n_batch: usize) -> Result<()> {
    prefill_from(ctx, prompt, 0, n_batch)
}

/// [`prefill`] when sequence 0 already holds `prompt[..start]` at positions `0..start`
/// (`start < prompt.len()`): only the rest goes through the target.
///
/// # Errors
/// Decode failures.
pub fn prefill_from(
    ctx: &mut Context,
    prompt: &[Token],
    start: usize,
    n_batch: usize,
) -> Result<()> {
    let start = start.min(prompt.len().saturating_sub(1));
    let rest = &prompt[start..];
    let mut batch = Batch::new(n_batch, 1);
    for (c, chunk) in rest.chunks(n_batch).enumerate() {
        batch.clear();
        let last_chunk = (c + 1) * n_batch >= rest.len();
        batch.add_sequence(chunk, (start + c * n_batch) as i32, 0, last_chunk)?;
        ctx.decode(&batch)?;
    }
    Ok(())
}

/// Empty the context's memory but for sequence 0's first `keep` positions (a prompt prefix
/// the next request reuses; 0 clears everything). Returns the positions kept: `keep`, or 0
/// when the memory cannot drop a sequence's tail (recurrent state that went past `keep`),
/// which is then cleared whole.
pub fn keep_prefix(ctx: &mut Context, keep: usize) -> usize {
    if keep > 0 {
        for s in 1..ctx.n_seq_max() as i32 {
            ctx.seq_rm(s, -1, -1);
        }
        if ctx.seq_rm(0, keep as i32, -1) {
            return keep;
        }
    }
    ctx.clear(false);
    0
}

/// Index of the largest logit (the first on ties, as llama.cpp's greedy sampler).
pub use leap_host::sampler::argmax;

/// Plain decoding: greedy when [`SamplingParams::is_greedy`], else llama.cpp's sampler chain
/// ([`Truncation`]) drawn with the uniform of (seed, position) ([`position_uniform`]). Stops
/// after `max_tokens`, at an end-of-generation token (kept in the output), or when `on_token`
/// returns false.
///
/// # Errors
/// Decode failures.
pub fn plain(
    ctx: &mut Context,
    prompt: &[Token],
    max_tokens: usize,
    sampling: &SamplingParams,
    n_batch: usize,
    on_token: &mut dyn FnMut(Token) -> bool,
) -> Result<Generation> {
    plain_with(ctx, None, prompt, max_tokens, sampling, n_batch, on_token)
}

/// [`plain`] whose greedy steps project the logits with `od` (Leap's output projection of
/// `ctx`, bit-identical to llama.cpp's): under flash streaming it reads the output weights a
/// chunk at a time within the DRAM budget, where llama.cpp's single node has them resident
/// whole. Sampled decoding uses llama.cpp's logits.
///
/// # Errors
/// Decode failures.
pub fn plain_with(
    ctx: &mut Context,
    od: Option<&OnDemand>,
    prompt: &[Token],
    max_tokens: usize,
    sampling: &SamplingParams,
    n_batch: usize,
    on_token: &mut dyn FnMut(Token) -> bool,
) -> Result<Generation> {
    plain_from(
        ctx, od, prompt, 0, max_tokens, sampling, n_batch, None, on_token,
    )
}

/// [`plain_with`] when sequence 0 already holds `prompt[..cached]` (from an earlier request):
/// only the rest is prefilled.
///
/// Under a `grammar` (structured output) the tokens it does not allow at a position are masked
/// out of the logits ([`Grammar::mask`]) before the greedy or sampled choice, which the
/// grammar then accepts. It ends, without a token, where the grammar allows none (it cannot go
/// on, and the model's end-of-generation token was not allowed either).
///
/// # Errors
/// Decode failures.
#[allow(clippy::too_many_arguments)]
pub fn plain_from(
    ctx: &mut Context,
    od: Option<&OnDemand>,
    prompt: &[Token],
    cached: usize,
    max_tokens: usize,
    sampling: &SamplingParams,
    n_batch: usize,
    mut grammar: Option<&mut Grammar>,
    on_token: &mut dyn FnMut(Token) -> bool,
) -> Result<Generation> {
    // The grammar masks llama.cpp's logits.
    let mut od = od.filter(|_| sampling.is_greedy() && grammar.is_none());
    // Checked against llama.cpp's logits on the first step.
    let mut checked = false;
    let cached = keep_prefix(ctx, cached.min(prompt.len().saturating_sub(1)));
    let t0 = Instant::now();
    prefill_from(ctx, prompt, cached, n_batch)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();

    let model = ctx.model().clone();
    let trunc = (!sampling.is_greedy()).then(|| Truncation::from(sampling));
    let mut g = Generation {
        prefill_seconds,
        ..Default::default()
    };
    let cpu0 = cpu_seconds();
    let t1 = Instant::now();
    let mut batch = Batch::new(1, 1);
    let mut pos = prompt.len() as i32;
    let mut row = Vec::new();
    let mut hidden: Option<Vec<f32>> = None;
    while g.tokens.len() < max_tokens {
        let tok = match (trunc.as_ref(), grammar.as_deref_mut(), hidden.take(), od) {
            // Position `pos`'s token, with the uniform of (seed, pos) as every sampling path;
            // under a grammar, from the masked logits.
            (Some(tr), gr, _, _) => {
                let logits = match gr {
                    Some(gr) => {
                        row.clear();
                        row.extend_from_slice(ctx.logits(-1)?);
                        if !gr.mask(&mut row) {
                            log::warn!("the grammar allows no token here: the output ends");
                            break;
                        }
                        &row
                    }
                    None => ctx.logits(-1)?,
                };
                pick(
                    &tr.apply(logits).entries,
                    position_uniform(sampling.seed, pos as usize),
                )
            }
            (None, Some(gr), _, _) => match gr.choose_greedy(ctx.logits(-1)?, &mut row) {
                Some(t) => t,
                None => {
                    log::warn!("the grammar allows no token here: the output ends");
                    break;
                }
            },
            (None, None, Some(h), Some(od)) => {
                let tp = Instant::now();
                od.try_logits(&h, &mut row)?;
                g.project_seconds += tp.elapsed().as_secs_f64();
                argmax(&row)
            }
            (None, None, _, _) => argmax(ctx.logits(-1)?),
        };
        if let Some(gr) = grammar.as_deref_mut() {
            gr.accept(tok);
        }
        g.tokens.push(tok);
        if model.is_eog(tok) || !on_token(tok) || g.tokens.len() >= max_tokens {
            break;
        }
        batch.clear();
        batch.add(tok, pos, &[0], true)?;
        match od {
            Some(o) if !checked => {
                checked = true;
                if !o.check(ctx, &batch, 0)? {
                    log::warn!(
                        "on-demand output projection does not reproduce llama.cpp's logits \
                         for this model; decoding with llama.cpp's"
                    );
                    od = None;
                }
            }
            Some(od) => {
                od.arm(true);
                let r = ctx.decode(&batch);
                od.disarm();
                r?;
                hidden = Some(od.take_hidden()?);
            }
            None => ctx.decode(&batch)?,
        }
        g.target_calls += 1;
        g.verify_rows += 1;
        g.rows_after_exit += 1;
        g.output_rows += 1;
        pos += 1;
    }
    g.decode_seconds = t1.elapsed().as_secs_f64();
    g.decode_cpu_seconds = cpu_seconds() - cpu0;
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn argmax_takes_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[0.0, 3.0, 1.0, 3.0]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
    }
}

//! One runner per mode: how a request is generated in it (plain decoding, llama.cpp's
//! speculative decoding, a stock llama-server, or a Leap session), as a [`Generation`].

use std::time::Instant;

use anyhow::Result;
use leap_host::anchor::LlamaSpeculative;
use leap_host::project::OnDemand;
use leap_host::usage::cpu_seconds;
use leap_host::{Context, Token};
use leap_spec::plain::{self, Generation};
use leap_spec::session::{Request, Session};

use super::{stock, BenchConfig};

pub(super) enum Runner {
    /// Plain decoding; under flash streaming with Leap's chunked output projection.
    Plain(Context, Option<OnDemand>),
    Llama(Box<LlamaSpeculative>),
    /// Leap's modes: a session of a runtime with the mode's options, as `leap serve` and the C
    /// API make them. Each request starts from an empty cache (the engine's history of
    /// earlier requests stays, as in a server).
    Leap(Box<Session>),
    Server(Box<stock::StockServer>),
}

impl Runner {
    pub(super) fn run(
        &mut self,
        prompt: &[Token],
        max_tokens: usize,
        cfg: &BenchConfig,
    ) -> Result<Generation> {
        match self {
            Runner::Plain(ctx, od) => Ok(plain::plain_with(
                ctx,
                od.as_ref(),
                prompt,
                max_tokens,
                &cfg.sampling,
                512,
                &mut |_| true,
            )?),
            Runner::Llama(spec) => run_anchor(spec, prompt, max_tokens),
            Runner::Server(server) => {
                let c = server.complete(prompt, max_tokens, &cfg.sampling)?;
                // The first token comes with the prompt; every decode call yields one token
                // plus the drafts it accepted, from a row per token and per draft.
                let decoded = (c.tokens.len() as u64).saturating_sub(1);
                let rows = decoded + c.drafted;
                Ok(Generation {
                    target_calls: decoded.saturating_sub(c.accepted),
                    drafted_tokens: c.drafted,
                    verify_rows: rows,
                    rows_after_exit: rows,
                    output_rows: rows,
                    tokens: c.tokens,
                    prefill_seconds: c.prompt_seconds,
                    decode_seconds: c.decode_seconds,
                    decode_cpu_seconds: c.cpu_seconds,
                    ..Default::default()
                })
            }
            Runner::Leap(session) => {
                session.forget_prefix();
                let req = Request {
                    max_tokens,
                    sampling: cfg.sampling,
                };
                Ok(session.generate(prompt, &req, &mut |_| true)?)
            }
        }
    }
}

/// Generate with llama.cpp's speculative decoding; stops at `max_tokens` or end of generation.
fn run_anchor(
    spec: &mut LlamaSpeculative,
    prompt: &[Token],
    max_tokens: usize,
) -> Result<Generation> {
    let t0 = Instant::now();
    spec.prefill(prompt)?;
    let mut g = Generation {
        prefill_seconds: t0.elapsed().as_secs_f64(),
        ..Default::default()
    };
    let model = spec.target().model().clone();
    let cpu0 = cpu_seconds();
    let t1 = Instant::now();
    let first = spec.first()?;
    g.tokens.push(first);
    let mut done = model.is_eog(first);
    while !done && g.tokens.len() < max_tokens {
        let step = spec.step(max_tokens - g.tokens.len())?;
        g.target_calls += 1;
        g.drafted_tokens += step.drafted as u64;
        // llama.cpp verifies the last token and the draft, logits for every row.
        g.verify_rows += 1 + step.drafted as u64;
        g.rows_after_exit += 1 + step.drafted as u64;
        g.output_rows += 1 + step.drafted as u64;
        for t in step.tokens {
            g.tokens.push(t);
            if model.is_eog(t) || g.tokens.len() >= max_tokens {
                done = true;
                break;
            }
        }
    }
    g.decode_seconds = t1.elapsed().as_secs_f64();
    g.decode_cpu_seconds = cpu_seconds() - cpu0;
    Ok(g)
}

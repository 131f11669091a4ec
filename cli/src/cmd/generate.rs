//! `leap generate`: one prompt, its answer streamed to stdout, the speed on stderr.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context as _, Result};
use clap::Args;
use leap_cli::models;
use leap_host::FlashAttn;
use leap_spec::session::{Mode, Options, Request, Runtime};

use super::options::{parse_budget, RuntimeArgs, SamplingArgs};

#[derive(Args)]
pub struct GenerateArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// The prompt text.
    #[arg(short, long, conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the prompt from a file (`-` for stdin).
    #[arg(short, long)]
    file: Option<PathBuf>,
    /// Most tokens to generate; -1 generates until the model ends its answer or the context
    /// is full (as llama.cpp's `-n -1`).
    #[arg(
        short = 'n',
        long,
        visible_alias = "n-predict",
        default_value_t = 128,
        allow_negative_numbers = true
    )]
    pub(crate) max_tokens: i64,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// The chat template for --chat instead of the GGUF's: the name of one llama.cpp knows
    /// (`chatml`, `llama3`, `gemma`, ...) or a template's text, as llama.cpp's.
    #[arg(long, requires = "chat")]
    chat_template: Option<String>,
    /// Decoding: `leap` (Leap's speculative engine: the same tokens as plain greedy decoding,
    /// or with --temp the same distribution as plain sampling, in fewer target calls) or
    /// `plain` (llama.cpp, one target call per token).
    #[arg(long, default_value = "leap", value_parser = ["plain", "leap"])]
    mode: String,
    /// Flash streaming: keep this much of the model's weights in DRAM, a fraction (0.25) or
    /// a size (64M), and read the rest from storage for every target call (for a model
    /// larger than the memory an app may use). Greedy `leap` then drafts with the target
    /// itself over a small resident vocabulary (budgeted out of this) and verifies a run of
    /// drafts with one streamed pass over the output weights.
    #[arg(long)]
    flash_budget: Option<String>,
    #[command(flatten)]
    pub(crate) runtime: RuntimeArgs,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    // LEAP_STATS=1: at exit, how many nodes Leap's device computed (as the plugin reports it).
    leap_backend::stats_at_exit_from_env("leap");
    let path = models::resolve(&a.model)?;
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
            s
        }
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading prompt file {}", f.display()))?,
        (None, None) => bail!("give a prompt: --prompt TEXT or --file PATH"),
    };
    let mode: Mode = a.mode.parse()?;
    if mode == Mode::Leap && a.runtime.sparse == "off" && a.runtime.flash_attn != FlashAttn::Off {
        eprintln!(
            "leap: warning: --flash-attn {}: ggml's CPU flash attention rounds a batch of rows \
             otherwise than one row, so `leap` may not give plain decoding's exact tokens \
             (--flash-attn off does)",
            a.runtime.flash_attn.as_str()
        );
    }
    let device = a.runtime.setup_for(Some(&path))?;
    let flash_budget = match &a.flash_budget {
        Some(b) => Some(parse_budget(
            b,
            leap_flash::LayerMap::open(&path)?.per_call_bytes(),
        )?),
        None => None,
    };
    let rt = Runtime::open(
        &path,
        &Options {
            threads: a.runtime.threads,
            n_ctx: a.runtime.ctx,
            mode,
            leap_kernels: device.kernels,
            sparse: device.sparse,
            sidecar: a.runtime.sidecar.clone(),
            flash_budget,
            flash_attn: a.runtime.flash_attn(),
            ..Options::default()
        },
    )?;
    let model = rt.model().clone();
    if let Some(t) = &a.chat_template {
        model
            .set_chat_template(t)
            .with_context(|| format!("--chat-template {t:?}"))?;
    }
    let prompt = rt.prompt_tokens(&text, a.chat)?;
    let max_tokens = fit_context(prompt.len(), a.max_tokens, a.runtime.ctx)?;
    let mut session = rt.session()?;
    if let Some(b) = flash_budget {
        eprintln!(
            "leap: flash budget {:.1} MB (-v for the plan)",
            b as f64 / 1e6
        );
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    // Print only complete UTF-8; a split multi-byte character waits for the next token.
    let mut utf8 = leap_spec::text::TextStream::default();
    let mut io_err: Option<std::io::Error> = None;
    let mut on_token = |tok| {
        if model.is_eog(tok) {
            return false;
        }
        if let Ok(piece) = model.token_to_piece(tok, false) {
            let r = out
                .write_all(&utf8.push_bytes(&piece))
                .and_then(|()| out.flush());
            if let Err(e) = r {
                io_err = Some(e);
                return false;
            }
        }
        true
    };
    let g = session.generate(
        &prompt,
        &Request {
            max_tokens,
            sampling: a.sampling.params(),
        },
        &mut on_token,
    )?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    out.write_all(&utf8.finish_bytes())?;
    writeln!(out)?;
    let tps = if g.decode_seconds > 0.0 {
        g.tokens.len() as f64 / g.decode_seconds
    } else {
        0.0
    };
    eprintln!(
        "leap: {} tokens in {:.2} s: {:.1} tok/s (prompt {} tokens in {:.2} s, {})",
        g.tokens.len(),
        g.decode_seconds,
        tps,
        prompt.len(),
        g.prefill_seconds,
        model.desc()
    );
    if let Some(st) = session.streamer() {
        st.flush();
        let calls = st.calls();
        let n = (g.target_calls as usize).min(calls.len());
        let decode = &calls[calls.len() - n..];
        let read: u64 = decode.iter().map(|c| c.read_bytes).sum();
        let blocked: f64 = decode.iter().map(|c| c.blocked_seconds).sum();
        eprintln!(
            "leap: flash: {:.1} MB read from storage a token ({} target calls), {:.2} s waiting for reads",
            read as f64 / 1e6 / g.tokens.len().max(1) as f64,
            g.target_calls,
            blocked
        );
    }
    Ok(())
}

/// How many tokens `leap generate` makes after a prompt of `prompt` tokens in a context of
/// `ctx`: `max_tokens`, or fewer, with a warning, when the two do not fit together (generation
/// stops at the context's end, as llama-cli's does without context shift). A prompt that fills
/// the context by itself is an error.
fn fit_context(prompt: usize, max_tokens: i64, ctx: u32) -> Result<usize> {
    ensure!(
        max_tokens >= 1 || max_tokens == -1,
        "-n {max_tokens}: at least 1 token, or -1 for up to the context's end"
    );
    ensure!(
        prompt < ctx as usize,
        "the prompt is {prompt} tokens and --ctx {ctx} leaves no room to generate: raise --ctx \
         or shorten the prompt"
    );
    let room = ctx as usize - prompt;
    if max_tokens == -1 {
        return Ok(room);
    }
    let max_tokens = max_tokens as usize;
    if max_tokens > room {
        eprintln!(
            "leap: warning: the prompt's {prompt} tokens and -n {max_tokens} exceed --ctx {ctx}: \
             stopping at the context's end, after at most {room} tokens"
        );
        return Ok(room);
    }
    Ok(max_tokens)
}

#[cfg(test)]
mod tests {
    use super::fit_context;

    #[test]
    fn generation_stops_at_the_contexts_end_and_a_full_prompt_is_refused() {
        assert_eq!(fit_context(10, 100, 4096).unwrap(), 100);
        assert_eq!(fit_context(10, 100, 110).unwrap(), 100);
        assert_eq!(fit_context(10, 100, 64).unwrap(), 54);
        let e = fit_context(101, 4, 32).unwrap_err().to_string();
        assert!(e.contains("101 tokens") && e.contains("--ctx 32"), "{e}");
        assert!(fit_context(32, 4, 32).is_err());
        assert!(fit_context(5, 0, 32).is_err());
        assert!(fit_context(5, -2, 32).is_err());
        // -1: up to the context's end, without a warning.
        assert_eq!(fit_context(10, -1, 64).unwrap(), 54);
    }
}

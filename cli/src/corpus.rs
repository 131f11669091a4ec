//! `leap corpus`: the model's own greedy answers to a file of prompts, written into its
//! sidecar, where `leap` drafts from them ([`leap_spec::corpus`]).
//!
//! A distributor runs it once on prompts like the ones the model's users send, and ships the
//! sidecar next to the GGUF. The answers are decoded with Leap's engine, whose greedy output is
//! plain decoding's token for token, so the corpus is what the model itself says.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{ensure, Context as _, Result};
use leap_host::sidecar::Sidecar;
use leap_spec::corpus::{self, Corpus};
use leap_spec::session::{Options, Request, Runtime};

use crate::{models, progress};

/// What `leap corpus` is asked for.
#[derive(Debug, Clone)]
pub struct BuildCorpus {
    /// A model name or GGUF path.
    pub model: String,
    /// The prompts: a `.jsonl` file of `{"prompt", "max_tokens"?}` (a `leap bench` workload),
    /// or text whose paragraphs (separated by blank lines) are the prompts.
    pub prompts: PathBuf,
    /// Leave out the first N prompts (keep them for a benchmark).
    pub skip: usize,
    /// Answer at most N prompts.
    pub limit: Option<usize>,
    /// Tokens an answer may have where the prompt does not say.
    pub max_tokens: usize,
    /// The sidecar to write (default next to the model; its other keys are kept).
    pub out: Option<PathBuf>,
    pub threads: i32,
    pub ctx: u32,
    pub progress: bool,
}

/// What it wrote.
#[derive(Debug)]
pub struct Built {
    pub out: PathBuf,
    pub answers: usize,
    pub tokens: usize,
    /// Prompts left out because prompt and answer would not fit `ctx`.
    pub too_long: usize,
    pub seconds: f64,
}

/// One prompt and the most tokens its answer may have.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    pub max_tokens: usize,
}

/// The prompts in `path` (see [`BuildCorpus::prompts`]), answers of `max_tokens` unless a
/// line says otherwise.
///
/// # Errors
/// I/O, a line that is not JSON or has no `"prompt"`, or no prompt at all.
pub fn prompts(path: &Path, max_tokens: usize) -> Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    if path.extension().is_some_and(|e| e == "jsonl") {
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
            let p = v["prompt"]
                .as_str()
                .with_context(|| format!("{}:{}: no \"prompt\"", path.display(), i + 1))?;
            let n = match &v["max_tokens"] {
                serde_json::Value::Null => max_tokens,
                m => m.as_u64().with_context(|| {
                    format!("{}:{}: max_tokens is not a count", path.display(), i + 1)
                })? as usize,
            };
            out.push(Prompt {
                text: p.to_string(),
                max_tokens: n,
            });
        }
    } else {
        let norm = text.replace("\r\n", "\n");
        out.extend(
            norm.split("\n\n")
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| Prompt {
                    text: p.to_string(),
                    max_tokens,
                }),
        );
    }
    ensure!(!out.is_empty(), "{} has no prompts", path.display());
    Ok(out)
}

/// `leap corpus` (see the module docs).
///
/// # Errors
/// The prompts or the model cannot be read, decoding fails, the sidecar cannot be written, or
/// no answer came out.
pub fn build_corpus(a: &BuildCorpus) -> Result<Built> {
    ensure!(a.max_tokens > 0, "--max-tokens must be at least 1");
    let path = models::resolve(&a.model)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| leap_host::sidecar::path_for(&path));
    let mut todo = prompts(&a.prompts, a.max_tokens)?;
    todo.drain(..a.skip.min(todo.len()));
    if let Some(l) = a.limit {
        todo.truncate(l);
    }
    ensure!(
        !todo.is_empty(),
        "{} has no prompts left after --skip {}",
        a.prompts.display(),
        a.skip
    );
    let rt = Runtime::open(
        &path,
        &Options {
            threads: a.threads,
            n_ctx: a.ctx,
            // What the sidecar being written already holds (a head, an older corpus) may
            // speed the answers up; greedy answers are plain decoding's either way.
            sidecar: Some(out.clone()).filter(|o| o.exists()),
            ..Options::default()
        },
    )?;
    let fingerprint = leap_host::project::fingerprint(rt.model())?
        .context("the model has no output weights to check answers against later")?;
    let mut session = rt.session()?;
    let bar = progress::bar(
        a.progress,
        todo.len() as u64,
        "corpus: answering [{bar:30}] {pos}/{len} prompts {msg}",
    );
    let t0 = Instant::now();
    let mut c = Corpus::new();
    let mut too_long = 0;
    for (i, p) in todo.iter().enumerate() {
        let prompt = rt.prompt_tokens(&p.text, false)?;
        if session.check_fits(prompt.len(), p.max_tokens).is_err() {
            log::warn!(
                "prompt {} ({} tokens) and {} more do not fit --ctx {}: left out",
                a.skip + i + 1,
                prompt.len(),
                p.max_tokens,
                a.ctx
            );
            too_long += 1;
            continue;
        }
        let req = Request {
            max_tokens: p.max_tokens,
            ..Request::default()
        };
        let g = session.generate(&prompt, &req, &mut |_| true)?;
        // An end of generation closes an answer; the separator does that in the corpus.
        let n = g
            .tokens
            .iter()
            .position(|&t| rt.model().is_eog(t))
            .unwrap_or(g.tokens.len());
        c.push(&g.tokens[..n]);
        bar.inc(1);
        bar.set_message(format!("{} tokens", c.len() - c.answers()));
        if a.progress && bar.is_hidden() {
            // Not a terminal (a log, a pipe): a line a prompt, as `leap bench` writes.
            eprintln!("corpus: answered {}/{} ({n} tokens)", i + 1, todo.len());
        }
    }
    bar.finish_and_clear();
    ensure!(!c.is_empty(), "no prompt gave an answer: nothing to write");
    let mut side = Sidecar::load_or_new(&out);
    let source = a
        .prompts
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    corpus::store(&mut side, &c, &fingerprint, &source);
    side.save(&out)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(Built {
        out,
        answers: c.answers(),
        tokens: c.len() - c.answers(),
        too_long,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn prompts_from_a_workload_or_paragraphs() {
        let dir = std::env::temp_dir().join(format!("leap-corpus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let w = dir.join("w.jsonl");
        let mut f = std::fs::File::create(&w).unwrap();
        writeln!(f, r#"{{"id":"a","prompt":"one","max_tokens":7}}"#).unwrap();
        writeln!(f).unwrap();
        writeln!(f, r#"{{"prompt":"two"}}"#).unwrap();
        drop(f);
        let p = prompts(&w, 64).unwrap();
        assert_eq!(
            p,
            vec![
                Prompt {
                    text: "one".into(),
                    max_tokens: 7
                },
                Prompt {
                    text: "two".into(),
                    max_tokens: 64
                }
            ]
        );
        let t = dir.join("t.txt");
        std::fs::write(&t, "first\nline\r\n\r\nsecond\n\n\n").unwrap();
        let p = prompts(&t, 9).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].text.as_str(), p[1].max_tokens), ("first\nline", 9));
        std::fs::write(&w, "{\"text\":1}\n").unwrap();
        let e = prompts(&w, 9).unwrap_err().to_string();
        assert!(e.contains(":1: no \"prompt\""), "{e}");
        std::fs::write(&t, "\n\n").unwrap();
        assert!(prompts(&t, 9).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

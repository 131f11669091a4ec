//! `leap train-heads`: an early-exit head (Lever §4.3) trained on a corpus and written into the
//! model's sidecar; and loading it back for `leap generate` / `leap bench`, refusing a head
//! trained on another model or a sidecar that cannot be read (with a warning: Leap then runs
//! without early exit).
//!
//! Training data comes from llama.cpp running the model over the corpus in windows: the eval
//! callback copies every row's hidden state at the exit layer (`l_out-L`), and the row's final
//! logits give the teacher (its top 32 tokens) and the candidate set. The candidate set of a
//! position is what Leap's drafters put in a tree there: the corpus's own next token (retrieval
//! copies text), the teacher's top 3, and the shadow tokens (the corpus's most frequent tokens,
//! the same comparison references the head uses at run time).
//!
//! With `ahead` it trains the head that guesses the token after next ([`leap_spec::ahead`])
//! instead: the copied state is `result_norm` (what the output projection reads), a sample's
//! input is that state and the next token's output-embedding row, and its teacher the final
//! logits one position later; only positions whose next corpus token is the target's own
//! choice are kept, as it always is when the target drafts for itself.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context as _, Result};
use leap_host::eval::{EvalObserver, TensorView};
use leap_host::project::OnDemand;
use leap_host::sampler::argmax;
use leap_host::sidecar::Sidecar;
use leap_host::{Batch, ContextParams, Model, ModelParams};
use leap_spec::ahead::{self, Ahead};
use leap_spec::exit;
use leap_spec::head::{self, Head, Sample, TrainConfig, Vocab};

use crate::{models, progress};

/// Teacher tokens kept per position.
const TOP_K: usize = 32;
/// Teacher tokens in a position's candidate set.
const CAND_TOP: usize = 3;
/// Shadow tokens.
const SHADOW: usize = 16;

/// What `leap train-heads` was asked to do.
#[derive(Debug, Clone)]
pub struct TrainHeads {
    /// A model name or GGUF path.
    pub model: String,
    /// Text, or a `leap bench` workload (`.jsonl`: its prompts).
    pub corpus: PathBuf,
    /// Documents (workload requests) at the start of the corpus to leave out: the ones a
    /// benchmark of the head then runs on.
    pub skip: usize,
    /// The exit layer (its output `l_out-L` is what the head reads); not used with `ahead`.
    pub layer: u32,
    /// Train the head that guesses the token after next ([`leap_spec::ahead`]) instead of an
    /// early-exit head.
    pub ahead: bool,
    /// The sidecar to write (default next to the model).
    pub out: Option<PathBuf>,
    /// Corpus positions to train and evaluate on.
    pub positions: usize,
    /// Window length in tokens.
    pub window: usize,
    /// Training passes.
    pub epochs: usize,
    pub threads: i32,
    pub progress: bool,
}

/// The head trained.
#[derive(Debug, Clone)]
pub enum TrainedHead {
    Exit(Head),
    Ahead(Ahead),
}

/// What training measured.
#[derive(Debug, Clone)]
pub struct Trained {
    pub out: PathBuf,
    pub head: TrainedHead,
    pub train_samples: usize,
    pub held_out: usize,
    /// The head before training (an early-exit head: the model's own final norm and output
    /// projection applied at layer L, the "logit lens"; a head looking ahead: the next
    /// token's own row) and after, on the held-out positions.
    pub lens: head::Eval,
    pub eval: head::Eval,
}

/// The corpus as documents: a `.jsonl` workload's prompts (read as `leap corpus` reads them),
/// or the whole text.
fn documents(path: &Path) -> Result<Vec<String>> {
    if path.extension().is_some_and(|e| e == "jsonl") {
        return Ok(crate::corpus::prompts(path, 1)?
            .into_iter()
            .map(|p| p.text)
            .collect());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    ensure!(!text.trim().is_empty(), "{} is empty", path.display());
    Ok(vec![text])
}

/// Copies `l_out-L` out of every decode.
struct Capture {
    name: String,
    rows: Arc<Mutex<Vec<f32>>>,
}

impl EvalObserver for Capture {
    fn wants(&mut self, t: &TensorView<'_>) -> bool {
        t.name() == self.name
    }

    fn observe(&mut self, t: &TensorView<'_>) -> bool {
        if let Some(v) = t.read_f32() {
            *self.rows.lock().unwrap_or_else(|e| e.into_inner()) = v;
        }
        true
    }
}

/// The `output_norm.weight` of the model (f32), the logit lens's scale.
fn output_norm(model: &Model) -> Result<Option<Vec<f32>>> {
    use std::io::{Read, Seek, SeekFrom};
    let info = leap_host::GgufInfo::open(model.path())?;
    let Some(t) = info
        .tensors
        .iter()
        .find(|t| t.name == "output_norm.weight" && t.ggml_type == "f32")
    else {
        return Ok(None);
    };
    let mut f = std::fs::File::open(model.path())?;
    f.seek(SeekFrom::Start(t.offset))?;
    let mut b = vec![0u8; t.size as usize];
    f.read_exact(&mut b)?;
    Ok(Some(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// `leap train-heads` (see the module docs).
pub fn train_heads(a: &TrainHeads) -> Result<Trained> {
    ensure!(a.window >= 16, "--window must be at least 16 tokens");
    ensure!(a.positions >= 100, "--positions must be at least 100");
    let path = models::resolve(&a.model)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| leap_host::sidecar::path_for(&path));
    let model = Model::load(&path, &ModelParams::default())?;
    let (n_layer, d) = (model.n_layer() as u32, model.n_embd() as usize);
    ensure!(
        a.ahead || a.layer + 1 < n_layer,
        "--layer {} leaves no layer after it to skip: this model has {n_layer} layers (0..{})",
        a.layer,
        n_layer - 1
    );
    let fingerprint = leap_host::project::fingerprint(&model)?
        .context("the model has no output weights a head can score with")?;

    let (windows, total, shadow) = corpus_windows(a, &model)?;
    let (samples, od) = capture_samples(a, &model, &windows, total, &shadow)?;

    // Hold out the last tenth of the windows.
    let cut = windows.len() - (windows.len() / 10).max(1);
    let (train, held): (Vec<_>, Vec<_>) = samples.into_iter().partition(|(w, _)| *w < cut);
    let train: Vec<Sample> = train.into_iter().map(|(_, s)| s).collect();
    let held: Vec<Sample> = held.into_iter().map(|(_, s)| s).collect();
    ensure!(
        !train.is_empty() && !held.is_empty(),
        "the corpus is too short to hold out positions (make it longer or --window shorter)"
    );
    let mut ids = Vocab::needed(&train);
    ids.extend(Vocab::needed(&held));
    ids.sort_unstable();
    ids.dedup();
    let mut vrows = vec![0f32; ids.len() * d];
    for (r, &t) in ids.iter().enumerate() {
        od.row_f32(t as usize, &mut vrows[r * d..(r + 1) * d]);
    }
    let vocab = Vocab { ids, rows: vrows };

    let init = if a.ahead {
        // Guessing the next token again: A = [0 | I].
        let mut init = vec![0f32; 2 * d * d];
        for i in 0..d {
            init[i * 2 * d + d + i] = 1.0;
        }
        init
    } else {
        // From the logit lens: A = diag(final norm weight).
        let mut init = vec![0f32; d * d];
        let scale = output_norm(&model)?.filter(|w| w.len() == d);
        for i in 0..d {
            init[i * d + i] = scale.as_ref().map_or(1.0, |w| w[i]);
        }
        init
    };
    let lens = head::evaluate(&held, &vocab, &init);
    let cfg = TrainConfig {
        epochs: a.epochs,
        threads: a.threads.max(1) as usize,
        ..TrainConfig::default()
    };
    let steps = train.len().div_ceil(cfg.batch) * cfg.epochs;
    let bar = progress::bar(
        a.progress,
        steps as u64,
        "train-heads: training [{bar:30}] {pos}/{len} steps {msg}",
    );
    let trained = head::train(&train, &vocab, init, &cfg, &mut |p| {
        bar.inc(1);
        bar.set_message(format!("epoch {} loss {:.3}", p.epoch + 1, p.loss));
    });
    bar.finish_and_clear();
    let eval = head::evaluate(&held, &vocab, &trained);
    let mut side = Sidecar::load_or_new(&out);
    let corpus = a
        .corpus
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let head = if a.ahead {
        let h = Ahead {
            n_embd: d,
            a: trained,
        };
        ahead::store(&mut side, &h, &fingerprint, &corpus);
        TrainedHead::Ahead(h)
    } else {
        let h = Head {
            layer: a.layer,
            n_embd: d,
            a: trained,
            temperature: 1.0,
            shadow,
        };
        exit::store(&mut side, &h, n_layer, &fingerprint, &corpus);
        TrainedHead::Exit(h)
    };
    side.save(&out)?;
    Ok(Trained {
        out,
        head,
        train_samples: train.len(),
        held_out: held.len(),
        lens,
        eval,
    })
}

pub use leap_spec::session::{head_for, load_head};

/// Windows of `a.window` tokens of the corpus (after `a.skip` documents) up to `a.positions`
/// positions, how many positions they hold, and the corpus's most frequent tokens (the
/// shadow tokens a head always scores).
///
/// # Errors
/// The corpus cannot be read or tokenized, or gives fewer than 100 positions.
fn corpus_windows(a: &TrainHeads, model: &Model) -> Result<(Vec<Vec<i32>>, usize, Vec<i32>)> {
    let mut windows: Vec<Vec<i32>> = Vec::new();
    let mut counts = std::collections::HashMap::<i32, usize>::new();
    let mut total = 0;
    for doc in documents(&a.corpus)?.into_iter().skip(a.skip) {
        if total >= a.positions {
            break;
        }
        let toks = model.tokenize(&doc, true, false)?;
        for w in toks.chunks(a.window).filter(|w| w.len() >= 16) {
            for &t in &w[1..] {
                *counts.entry(t).or_default() += 1;
            }
            total += w.len() - 1;
            windows.push(w.to_vec());
            if total >= a.positions {
                break;
            }
        }
    }
    ensure!(
        total >= 100,
        "{} gives only {total} positions",
        a.corpus.display()
    );
    let mut freq: Vec<(i32, usize)> = counts.into_iter().collect();
    freq.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    let shadow: Vec<i32> = freq.iter().take(SHADOW).map(|&(t, _)| t).collect();

    Ok((windows, total, shadow))
}

/// What the model answers at each position of `windows`: its hidden state at the exit layer
/// (`l_out-{a.layer}`), the teacher's top tokens and the candidates a head is trained to rank
/// (the next token, the teacher's best, the `shadow` tokens), each with the window it came
/// from; and the output projection that scores them.
///
/// # Errors
/// A context cannot be made or a window decoded; the graph has no such layer output; the
/// model's output projection is not one Leap can score with.
fn capture_samples(
    a: &TrainHeads,
    model: &Arc<Model>,
    windows: &[Vec<i32>],
    total: usize,
    shadow: &[i32],
) -> Result<(Vec<(usize, Sample)>, OnDemand)> {
    let d = model.n_embd() as usize;
    let rows = Arc::new(Mutex::new(Vec::new()));
    // A head looking ahead reads what the output projection reads.
    let name = if a.ahead {
        "result_norm".to_string()
    } else {
        format!("l_out-{}", a.layer)
    };
    let capture = Box::new(Capture {
        name: name.clone(),
        rows: rows.clone(),
    });
    let params = ContextParams {
        n_ctx: a.window as u32,
        n_batch: a.window as u32,
        n_ubatch: a.window as u32,
        n_threads: a.threads,
        n_threads_batch: a.threads,
        ..Default::default()
    };
    let (mut ctx, od) = OnDemand::context_with(model, &params, Some(capture))?;
    let od = od.context("the model's output projection is not one Leap can score with")?;
    let bar = progress::bar(
        a.progress,
        total as u64,
        "train-heads: reading the model's answers [{bar:30}] {pos}/{len} positions",
    );
    let mut samples: Vec<(usize, Sample)> = Vec::with_capacity(total);
    let mut idx: Vec<u32> = Vec::new();
    for (wi, w) in windows.iter().enumerate() {
        ctx.clear(true);
        let mut b = Batch::new(w.len(), 1);
        for (i, &t) in w.iter().enumerate() {
            // `result_norm` has only the rows with outputs.
            b.add(t, i as i32, &[0], a.ahead || i + 1 < w.len())?;
        }
        ctx.decode(&b)?;
        let hidden = std::mem::take(&mut *rows.lock().unwrap_or_else(|e| e.into_inner()));
        ensure!(
            hidden.len() == w.len() * d,
            "the model's graph has no {name} of every row (got {} values for {} rows)",
            hidden.len(),
            w.len()
        );
        // A head looking ahead learns the target's token at i + 2 from the state at i and
        // the token at i + 1, where that token is the target's own choice (as it is when
        // the target drafts for itself).
        let shift = usize::from(a.ahead);
        for i in 0..w.len() - 1 - shift {
            if a.ahead && argmax(ctx.logits(i as i32)?) != w[i + 1] {
                continue;
            }
            let logits = ctx.logits((i + shift) as i32)?;
            idx.clear();
            idx.extend(0..logits.len() as u32);
            let by = |x: &u32, y: &u32| logits[*y as usize].total_cmp(&logits[*x as usize]);
            idx.select_nth_unstable_by(TOP_K, by);
            idx.truncate(TOP_K);
            idx.sort_by(by);
            let top: Vec<(i32, f32)> = idx
                .iter()
                .map(|&t| (t as i32, logits[t as usize]))
                .collect();
            let mut cand: Vec<i32> = vec![w[i + 1 + shift]];
            let teacher = top.iter().take(CAND_TOP).map(|&(t, _)| t);
            for t in teacher.chain(shadow.iter().copied()) {
                if !cand.contains(&t) {
                    cand.push(t);
                }
            }
            let cand = cand.iter().map(|&t| (t, logits[t as usize])).collect();
            samples.push((
                wi,
                Sample {
                    hidden: {
                        let mut x = hidden[i * d..(i + 1) * d].to_vec();
                        if a.ahead {
                            x.resize(2 * d, 0.0);
                            od.row_f32(w[i + 1] as usize, &mut x[d..]);
                        }
                        x
                    },
                    top,
                    cand,
                },
            ));
        }
        bar.inc(w.len() as u64 - 1);
    }
    bar.finish_and_clear();
    Ok((samples, od))
}

//! [`OnDemand`], the projection as a context's callers see it: a context whose decodes stop
//! at `result_norm` (llama.cpp's eval callback copies the hidden states out), the logits of
//! any of those rows bit-identical to llama.cpp's, and the [`RowStream`] a flash streamer
//! plugs in to feed the output weights a chunk at a time.

use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use super::{DraftVocab, Projection};
use crate::eval::{EvalObserver, TensorView};
use crate::{Context, ContextParams, Error, Model, Result, Token};

/// The tensor llama.cpp names the final normalised hidden states.
const HIDDEN: &str = "result_norm";

#[derive(Debug, Default)]
struct Shared {
    /// Copy the hidden states at `result_norm` in every decode until [`OnDemand::disarm`]
    /// (else let decodes run untouched).
    armed: bool,
    /// Stop after copying (else copy and continue: for the self-check).
    stop: bool,
    /// Hidden states of the last armed decode, one row of `n_embd` per output row.
    hidden: Vec<f32>,
    /// Rows in `hidden`.
    rows: usize,
}

/// The eval-callback half: lives in the context.
struct Capture(Arc<Mutex<Shared>>);

impl EvalObserver for Capture {
    fn wants(&mut self, t: &TensorView<'_>) -> bool {
        // The name first: asked about every node of every call, the lock only for one.
        t.name_is(HIDDEN) && self.0.lock().unwrap_or_else(|e| e.into_inner()).armed
    }

    fn observe(&mut self, t: &TensorView<'_>) -> bool {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = t.read_f32() {
            s.rows = t.ne()[1] as usize;
            s.hidden = v;
        }
        !s.stop
    }
}

/// Told which rows of the output weights a projection pass is about to read and has done
/// with (flash streaming: the weights are read from storage a chunk at a time while the
/// previous chunk computes, and dropped after use). Rows are vocabulary entries.
pub trait RowStream: Send + Sync {
    /// Rows per chunk the pass works through.
    fn chunk_rows(&self) -> usize;
    /// Rows `rows` are about to be read: return once they are in memory, or why they
    /// cannot be (the model file was truncated or deleted). `Some(p)`: the stream read them
    /// into its own memory (bypassing the page cache), `p` pointing at the first row's bytes
    /// and valid until [`RowStream::after`] for these rows; `None`: they are in the page
    /// cache, read through the model's mapping.
    ///
    /// # Errors
    /// The rows cannot be read.
    fn before(
        &self,
        rows: std::ops::Range<usize>,
    ) -> std::result::Result<Option<*const u8>, String>;
    /// The pass is done with rows `rows`.
    fn after(&self, rows: std::ops::Range<usize>);
    /// Whether a projection pass follows the next target calls: a stream reads its first
    /// chunk ahead during a call's last layers when one does (the default).
    fn prefetch(&self, _on: bool) {}
}

/// On-demand output projection for one context (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct OnDemand {
    shared: Arc<Mutex<Shared>>,
    proj: Arc<Projection>,
    stream: Option<Arc<dyn RowStream>>,
}

impl std::fmt::Debug for OnDemand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnDemand")
            .field("n_embd", &self.proj.n_embd)
            .field("n_vocab", &self.proj.n_vocab)
            .finish()
    }
}

impl OnDemand {
    /// A context on `model` with `params` whose decodes can be cut before the output
    /// projection, and the projection itself. `None` when the model's head is not a plain
    /// matrix product Leap can reproduce (logit soft-capping, an unknown weight type).
    ///
    /// # Errors
    /// Context creation; a model file that cannot be read or mapped.
    pub fn context(model: &Arc<Model>, params: &ContextParams) -> Result<(Context, Option<Self>)> {
        Self::context_with(model, params, None)
    }

    /// As [`OnDemand::context`], with another observer on the context too (called first:
    /// flash streaming's layer hooks).
    ///
    /// # Errors
    /// As [`OnDemand::context`].
    pub fn context_with(
        model: &Arc<Model>,
        params: &ContextParams,
        first: Option<Box<dyn crate::EvalObserver>>,
    ) -> Result<(Context, Option<Self>)> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let capture: Box<dyn crate::EvalObserver> = Box::new(Capture(shared.clone()));
        let observer: Box<dyn crate::EvalObserver> = match first {
            Some(f) => Box::new(crate::Chain::new(vec![f, capture])),
            None => capture,
        };
        let ctx = Context::with_observer(model, params, Some(observer))?;
        let proj = Projection::for_model(model, params.n_threads.max(1) as usize)?;
        Ok((
            ctx,
            proj.map(|p| Self {
                shared,
                proj: Arc::new(p),
                stream: None,
            }),
        ))
    }

    /// Embedding width (hidden state length).
    pub fn n_embd(&self) -> usize {
        self.proj.n_embd
    }

    /// Bytes of one row of the output weights (one vocabulary entry).
    pub fn row_bytes(&self) -> usize {
        self.proj.row_bytes
    }

    /// The output weights' share of the weights a one-row call reads: all of their rows
    /// against every other weight but the token embeddings (a call reads one row of those per
    /// token; a tied head reads them whole as the projection). From the model file's tensor
    /// table, so the same whatever the machine is doing.
    pub fn head_share(&self) -> f64 {
        self.proj.head_share
    }

    /// Work through the output weights a chunk at a time, telling `stream` before and after
    /// each (flash streaming), or all at once (`None`).
    pub fn with_stream(mut self, stream: Option<Arc<dyn RowStream>>) -> Self {
        self.stream = stream;
        self
    }

    /// Tell a streamed projection whether a pass follows the next target calls (see
    /// [`RowStream::prefetch`]): calls that only draft leave it off, so the first chunk is not
    /// read ahead for nothing.
    pub fn prefetch(&self, on: bool) {
        if let Some(st) = &self.stream {
            st.prefetch(on);
        }
    }

    /// Whether the output weights are streamed: each projection pass reads them from
    /// storage again, so a caller should project every row it may need in one pass.
    pub fn streamed(&self) -> bool {
        self.stream.is_some()
    }

    /// Cut the next decodes at the hidden states (`stop`), or copy them and let the decode
    /// finish (`!stop`: llama.cpp's logits are computed too). Disarmed by [`OnDemand::disarm`].
    pub fn arm(&self, stop: bool) {
        let mut s = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        s.armed = true;
        s.stop = stop;
        s.rows = 0;
    }

    /// Let decodes run normally again.
    pub fn disarm(&self) {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).armed = false;
    }

    /// Take the hidden states of the last armed decode: `rows x n_embd`, in output-row order.
    ///
    /// # Errors
    /// [`Error::NoLogits`] when the last armed decode did not reach them (or they were taken).
    pub fn take_hidden(&self) -> Result<Vec<f32>> {
        let mut s = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if s.rows == 0 || s.hidden.len() != s.rows * self.proj.n_embd {
            return Err(Error::NoLogits { row: -1 });
        }
        s.rows = 0;
        Ok(std::mem::take(&mut s.hidden))
    }

    /// The logits after hidden state `h` (`n_embd` values), bit-identical to llama.cpp's.
    pub fn logits(&self, h: &[f32], out: &mut Vec<f32>) {
        self.logits_rows(&[h], std::slice::from_mut(out));
    }

    /// The logits after each hidden state of `hs` (`n_embd` values each) into `outs` (one
    /// vector per state), in one pass over the output weights: projecting k rows together
    /// costs much less than k times one row. Bit-identical to llama.cpp's.
    ///
    /// # Panics
    /// When `hs` and `outs` differ in length or a state is not `n_embd` long.
    ///
    /// Streamed output weights ([`OnDemand::with_stream`]) that cannot be read make this
    /// panic: use [`OnDemand::try_logits_rows`] there.
    pub fn logits_rows(&self, hs: &[&[f32]], outs: &mut [Vec<f32>]) {
        if let Err(e) = self.try_logits_rows(hs, outs) {
            panic!("output projection: {e}");
        }
    }

    /// [`OnDemand::logits_rows`], with the error of a stream that cannot read the weights.
    ///
    /// # Errors
    /// [`Error::Stopped`]: the stream could not read a chunk (nothing is computed from it).
    pub fn try_logits_rows(&self, hs: &[&[f32]], outs: &mut [Vec<f32>]) -> Result<()> {
        match &self.stream {
            None => self.proj.logits_rows(hs, outs, 0..self.proj.n_vocab, None),
            Some(st) => {
                for o in outs.iter_mut() {
                    o.clear();
                    o.resize(self.proj.n_vocab, 0.0);
                }
                self.streamed_chunks(st.as_ref(), &mut |r, src| {
                    self.proj.logits_rows(hs, outs, r, src)
                })?;
            }
        }
        Ok(())
    }

    /// The stream's chunks of the output weights in order, each read (`before`), handed to
    /// `f(rows, src)` and released (`after`).
    ///
    /// # Errors
    /// [`Error::Stopped`]: the stream could not read a chunk (none after it is handed out).
    fn streamed_chunks(
        &self,
        st: &dyn RowStream,
        f: &mut dyn FnMut(std::ops::Range<usize>, Option<*const u8>),
    ) -> Result<()> {
        let n = self.proj.n_vocab;
        let step = st.chunk_rows().max(1);
        for v0 in (0..n).step_by(step) {
            let r = v0..(v0 + step).min(n);
            let src = st
                .before(r.clone())
                .map_err(|reason| Error::Stopped { reason })?;
            f(r.clone(), src);
            st.after(r);
        }
        Ok(())
    }

    /// The target's greedy token after each hidden state of `hs` (the first of equal maxima,
    /// as [`crate::sampler::argmax`] over [`OnDemand::logits_rows`]' logits, which are
    /// llama.cpp's), from the same pass over the output weights without writing any logits
    /// (a megabyte a state on Gemma 3, read back by the argmax).
    ///
    /// # Errors
    /// As [`OnDemand::try_logits_rows`].
    pub fn try_argmax_rows(&self, hs: &[&[f32]]) -> Result<Vec<Token>> {
        let mut best = vec![(usize::MAX, f32::NEG_INFINITY); hs.len()];
        match &self.stream {
            None => self
                .proj
                .argmax_rows(hs, &mut best, 0..self.proj.n_vocab, None),
            Some(st) => self.streamed_chunks(st.as_ref(), &mut |r, src| {
                self.proj.argmax_rows(hs, &mut best, r, src)
            })?,
        }
        // No logit above -inf (or only NaN): entry 0, as the scan gives.
        Ok(best
            .into_iter()
            .map(|(i, _)| if i == usize::MAX { 0 } else { i as Token })
            .collect())
    }

    /// [`OnDemand::logits`], with the error of a stream that cannot read the weights.
    ///
    /// # Errors
    /// As [`OnDemand::try_logits_rows`].
    pub fn try_logits(&self, h: &[f32], out: &mut Vec<f32>) -> Result<()> {
        self.try_logits_rows(&[h], std::slice::from_mut(out))
    }

    /// Whether several rows are projected with Leap's weight-stationary kernel (else ggml's
    /// `vec_dot` per row and state).
    pub fn multi_row_kernel(&self) -> bool {
        self.proj.kernel.is_some()
    }

    /// The logits of just `tokens` after hidden state `h` (one thread; for calibration, which
    /// ranks a few hundred candidates at every prompt position).
    pub fn logits_of(&self, h: &[f32], tokens: &[i32], out: &mut Vec<f32>) {
        let act = self.proj.quantize(h);
        out.clear();
        out.resize(tokens.len(), f32::NEG_INFINITY);
        for (o, &t) in out.iter_mut().zip(tokens) {
            if t >= 0 && (t as usize) < self.proj.n_vocab {
                self.proj.dot(t as usize, &act, o);
            }
        }
    }

    /// Row `token` of the output weights (its embedding for a tied head) as f32, into `out`
    /// (`n_embd` values): what early-exit heads score candidates with, for training.
    ///
    /// # Panics
    /// `token` outside the vocabulary, or `out` not `n_embd` long.
    pub fn row_f32(&self, token: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.proj.n_embd);
        let row = self.proj.rows(token, 1);
        // SAFETY: ggml's static traits table for a valid type.
        let to_float = unsafe { (*sys::ggml_get_type_traits(self.proj.ty)).to_float };
        match to_float {
            // SAFETY: one full row of the type in, `n_embd` floats out.
            Some(f) => unsafe {
                f(
                    row.as_ptr().cast(),
                    out.as_mut_ptr(),
                    self.proj.n_embd as i64,
                )
            },
            None if self.proj.ty == sys::GGML_TYPE_F32 => {
                for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            None => out.fill(0.0),
        }
    }

    /// A resident copy of the output weights' rows for `tokens` (see [`DraftVocab`]), read
    /// from the model file. Under flash streaming the reads go around the page cache
    /// (`O_DIRECT`, or plain reads whose pages are dropped again where the file system
    /// refuses it), so the copy is the only resident one.
    ///
    /// # Errors
    /// The model file cannot be read.
    pub fn draft_vocab(&self, tokens: &[Token]) -> Result<DraftVocab> {
        let mut v = DraftVocab {
            proj: self.proj.clone(),
            drop_cache: self.stream.is_some(),
            tokens: Vec::new(),
            sorted: Vec::new(),
            bytes: Vec::new(),
        };
        v.add(tokens, usize::MAX)?;
        Ok(v)
    }

    /// Check on this context that projecting row `row` of the hidden states reproduces
    /// llama.cpp's logits bit for bit. Decodes `batch` once, hidden states copied and the
    /// graph run to the end. Returns whether they matched.
    ///
    /// # Errors
    /// Decode failures.
    pub fn check(&self, ctx: &mut Context, batch: &crate::Batch, row: i32) -> Result<bool> {
        self.arm(false);
        let r = ctx.decode(batch);
        self.disarm();
        r?;
        let hidden = self.take_hidden()?;
        let n = self.proj.n_embd;
        // The row's place among the output rows.
        let Some(k) = (0..batch.len())
            .filter(|&i| batch.wants_logits(i))
            .position(|i| i as i32 == row)
        else {
            return Ok(false);
        };
        let mut got = Vec::new();
        self.try_logits(&hidden[k * n..(k + 1) * n], &mut got)?;
        let want = ctx.logits(row)?;
        Ok(got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits()))
    }

    /// Whether projecting hidden state `h` gives exactly `want` (llama.cpp's logits), bit for bit.
    pub fn reproduces(&self, h: &[f32], want: &[f32]) -> bool {
        let mut got = Vec::new();
        self.try_logits(h, &mut got).is_ok()
            && got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

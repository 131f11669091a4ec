//! On-demand output projection (Lever §4.4) without patching llama.cpp.
//!
//! A verification call of k rows normally pays the output projection (for Gemma 3 270M a
//! 262144 x 640 matrix, ~10 ms a row on 2 cores here) for every row, though acceptance only
//! ever reads the rows on the accepted path and the one after it. [`OnDemand`] cuts the graph
//! at `result_norm` (the final normalised hidden states, just before the projection) through
//! llama.cpp's eval callback: when armed, the callback copies those hidden states out and
//! stops the computation there. [`OnDemand::logits`] then projects one row at a time with
//! ggml's own CPU kernels (the type's `from_float` and `vec_dot`, exactly what ggml's
//! `mul_mat` runs per output element), so a projected row is bit-identical to the logits
//! llama.cpp computes; [`OnDemand::check`] proves that on the model at hand before use.
//!
//! The weights are the GGUF's `output.weight` (or the tied `token_embd.weight`), memory-mapped
//! read-only from the model file: the page cache is shared with llama.cpp's own mapping.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use crate::eval::{EvalObserver, TensorView};
use crate::{Context, ContextParams, Error, GgufInfo, Model, Result, Token};

/// The tensor llama.cpp names the final normalised hidden states.
const HIDDEN: &str = "result_norm";

#[derive(Debug, Default)]
struct Shared {
    /// Cut the next decode at `result_norm` (else let it run to the end).
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
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.armed && t.name() == HIDDEN
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

/// A read-only memory map of a byte range of a file.
struct Mapped {
    base: *mut c_void,
    len: usize,
    /// Where the wanted range starts inside the mapping (page alignment).
    skip: usize,
}

// SAFETY: the mapping is read-only and never unmapped while shared.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    fn new(path: &std::path::Path, offset: u64, size: usize) -> Result<Self> {
        use std::os::unix::io::AsRawFd;
        let f = std::fs::File::open(path).map_err(|_| Error::ModelNotFound {
            path: path.to_path_buf(),
        })?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let start = offset / page * page;
        let skip = (offset - start) as usize;
        let len = skip + size;
        // SAFETY: a fresh read-only shared mapping of an open file; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::InvalidGguf {
                path: path.to_path_buf(),
                reason: format!(
                    "cannot map the output weights: {}",
                    std::io::Error::last_os_error()
                ),
            });
        }
        Ok(Self { base, len, skip })
    }

    /// One mapping per file range for the whole process: every context's projection shares
    /// it (each mapping's resident pages count again in the process's RSS).
    fn shared(path: &std::path::Path, offset: u64, size: usize) -> Result<Arc<Self>> {
        type Key = (std::path::PathBuf, u64);
        static MAPS: Mutex<Vec<(Key, std::sync::Weak<Mapped>)>> = Mutex::new(Vec::new());
        let mut maps = MAPS.lock().unwrap_or_else(|e| e.into_inner());
        maps.retain(|(_, w)| w.strong_count() > 0);
        let key = (path.to_path_buf(), offset);
        if let Some(m) = maps
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(m);
        }
        let m = Arc::new(Self::new(path, offset, size)?);
        maps.push((key, Arc::downgrade(&m)));
        Ok(m)
    }

    fn bytes(&self) -> *const u8 {
        // SAFETY: `skip < len`, inside the mapping.
        unsafe { (self.base as *const u8).add(self.skip) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are this mapping's.
        unsafe { libc::munmap(self.base, self.len) };
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

/// The output projection's weights: `output.weight`, or the tied `token_embd.weight`.
fn output_tensor(info: &GgufInfo) -> Option<&crate::gguf::GgufTensor> {
    let named = |n: &str| info.tensors.iter().find(|t| t.name == n);
    named("output.weight").or_else(|| named("token_embd.weight"))
}

/// What identifies a model's output weights (`output.weight`, or the tied `token_embd.weight`):
/// their shape, type and a hash of their first megabyte. A sidecar trained on another model
/// does not match. `None` for a model without either tensor.
///
/// # Errors
/// The model file cannot be read.
pub fn fingerprint(model: &Model) -> Result<Option<String>> {
    use std::io::{Read, Seek, SeekFrom};
    let info = GgufInfo::open(model.path())?;
    let Some(t) = output_tensor(&info) else {
        return Ok(None);
    };
    let io = |e: std::io::Error| Error::InvalidGguf {
        path: model.path().to_path_buf(),
        reason: format!("reading the output weights: {e}"),
    };
    let mut f = std::fs::File::open(model.path()).map_err(io)?;
    f.seek(SeekFrom::Start(t.offset)).map_err(io)?;
    let mut bytes = vec![0u8; t.size.min(1 << 20) as usize];
    f.read_exact(&mut bytes).map_err(io)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in &bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    Ok(Some(format!(
        "{} {}x{} fnv1a:{h:016x}",
        t.ggml_type, t.ne[0], t.ne[1]
    )))
}

/// The output weights and ggml's kernels for them.
struct Projection {
    weights: Arc<Mapped>,
    /// The model file and where the weights start in it (for reads that bypass the mapping).
    path: std::path::PathBuf,
    offset: u64,
    /// The weights' ggml type.
    ty: sys::ggml_type,
    vec_dot_type: sys::ggml_type,
    n_embd: usize,
    n_vocab: usize,
    row_bytes: usize,
    traits: *const sys::ggml_type_traits_cpu,
    threads: usize,
    /// Leap's weight-stationary kernel for several rows at once, when there is one for the
    /// type and it reproduces ggml's `vec_dot` here (see `qdot::checked`).
    kernel: Option<crate::qdot::Kernel>,
}

// SAFETY: `traits` points at ggml's static, immutable type-traits table.
unsafe impl Send for Projection {}
unsafe impl Sync for Projection {}

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

fn type_by_name(name: &str) -> Option<sys::ggml_type> {
    (0..sys::GGML_TYPE_COUNT).find(|&t| {
        // SAFETY: any value below GGML_TYPE_COUNT is a valid type id; names are static.
        let n = unsafe { sys::ggml_type_name(t) };
        !n.is_null() && unsafe { std::ffi::CStr::from_ptr(n) }.to_str() == Ok(name)
    })
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
                let n = self.proj.n_vocab;
                let step = st.chunk_rows().max(1);
                for v0 in (0..n).step_by(step) {
                    let r = v0..(v0 + step).min(n);
                    let src = st
                        .before(r.clone())
                        .map_err(|reason| Error::Stopped { reason })?;
                    self.proj.logits_rows(hs, outs, r.clone(), src);
                    st.after(r);
                }
            }
        }
        Ok(())
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
    /// from the model file with plain reads. Under flash streaming the pages those reads
    /// leave in the page cache are dropped again, so the copy is the only resident one.
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

/// Read `buf.len()` bytes at `at` from `f`, opened with `O_DIRECT`: whole aligned pages
/// into an aligned bounce buffer.
fn read_direct(f: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const ALIGN: u64 = 4096;
    let start = at / ALIGN * ALIGN;
    let end = (at + buf.len() as u64).div_ceil(ALIGN) * ALIGN;
    let len = (end - start) as usize;
    let layout = std::alloc::Layout::from_size_align(len, ALIGN as usize)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a non-zero size (buf is not empty when called) with a valid alignment.
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        return Err(std::io::ErrorKind::OutOfMemory.into());
    }
    // SAFETY: `p` points at `len` freshly allocated bytes, freed below.
    let bounce = unsafe { std::slice::from_raw_parts_mut(p, len) };
    let mut done = 0;
    let r = loop {
        if done == len {
            break Ok(());
        }
        match f.read_at(&mut bounce[done..], start + done as u64) {
            // The end of the file inside the last page: what was read must cover `buf`.
            Ok(0) => {
                break if (start + done as u64) >= at + buf.len() as u64 {
                    Ok(())
                } else {
                    Err(std::io::ErrorKind::UnexpectedEof.into())
                }
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if r.is_ok() {
        let off = (at - start) as usize;
        buf.copy_from_slice(&bounce[off..off + buf.len()]);
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(p, layout) };
    r
}

/// Some rows of the output weights, copied out and kept resident: the vocabulary a draft
/// is allowed to choose from when the full output projection is streamed from storage.
/// Projecting a hidden state onto these rows only ([`DraftVocab::argmax`]) costs a few
/// thousand dot products and no I/O; the token is a draft, checked by the full projection.
pub struct DraftVocab {
    proj: Arc<Projection>,
    /// Drop the pages plain reads leave in the page cache (flash: keep the budget honest).
    drop_cache: bool,
    /// The rows' tokens, in the order they were added, each once.
    tokens: Vec<Token>,
    /// The same tokens ascending (lookups).
    sorted: Vec<Token>,
    /// The rows' bytes, in `tokens` order.
    bytes: Vec<u8>,
}

impl std::fmt::Debug for DraftVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftVocab")
            .field("rows", &self.tokens.len())
            .finish()
    }
}

impl DraftVocab {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no row.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Resident bytes (the rows).
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Whether `token`'s row is held.
    pub fn contains(&self, token: Token) -> bool {
        self.sorted.binary_search(&token).is_ok()
    }

    /// Add the rows of `tokens` not held yet, in ascending order while fewer than `cap` are
    /// held (tokens outside the vocabulary are ignored).
    ///
    /// # Errors
    /// The model file cannot be read.
    pub fn add(&mut self, tokens: &[Token], cap: usize) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let p = &*self.proj;
        let mut new: Vec<Token> = tokens
            .iter()
            .copied()
            .filter(|&t| t >= 0 && (t as usize) < p.n_vocab && !self.contains(t))
            .collect();
        new.sort_unstable();
        new.dedup();
        new.truncate(cap.saturating_sub(self.len()));
        if new.is_empty() {
            return Ok(());
        }
        let io = |e: std::io::Error| Error::InvalidGguf {
            path: p.path.clone(),
            reason: format!("reading output weight rows: {e}"),
        };
        // Streamed weights: read around the page cache, which would keep (large) folios of
        // the streamed matrix resident behind the budget's back. Plain reads otherwise, or
        // where the file system refuses O_DIRECT.
        let direct = if self.drop_cache {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&p.path)
                .ok()
        } else {
            None
        };
        let mut buffered: Option<std::fs::File> = None;
        let rb = p.row_bytes;
        let start = self.bytes.len();
        self.bytes.resize(start + new.len() * rb, 0);
        let drop_cache = self.drop_cache;
        let bytes = &mut self.bytes;
        // Runs of consecutive tokens in one read each.
        let mut read = || -> Result<()> {
            let mut i = 0;
            while i < new.len() {
                let mut j = i + 1;
                while j < new.len() && new[j] == new[j - 1] + 1 {
                    j += 1;
                }
                let at = p.offset + new[i] as u64 * rb as u64;
                let buf = &mut bytes[start + i * rb..start + j * rb];
                let read_direct = direct
                    .as_ref()
                    .is_some_and(|d| read_direct(d, buf, at).is_ok());
                if !read_direct {
                    let f = match &mut buffered {
                        Some(f) => f,
                        None => buffered.insert(std::fs::File::open(&p.path).map_err(io)?),
                    };
                    f.read_exact_at(buf, at).map_err(io)?;
                    if drop_cache {
                        use std::os::unix::io::AsRawFd;
                        // SAFETY: an advisory call on an open descriptor; no memory is touched.
                        unsafe {
                            libc::posix_fadvise(
                                f.as_raw_fd(),
                                at as libc::off_t,
                                buf.len() as libc::off_t,
                                libc::POSIX_FADV_DONTNEED,
                            )
                        };
                    }
                }
                i = j;
            }
            Ok(())
        };
        if let Err(e) = read() {
            // Rows and tokens stay in step: nothing of a failed add is kept.
            self.bytes.truncate(start);
            return Err(e);
        }
        self.tokens.extend_from_slice(&new);
        self.sorted.extend_from_slice(&new);
        self.sorted.sort_unstable();
        Ok(())
    }

    /// The held token with the largest logit after hidden state `h` (the smallest id among
    /// equal maxima), and its logit; `None` when nothing is held. Each logit is bit-identical
    /// to the full projection's for that token (Leap's kernel is checked against ggml's).
    pub fn argmax(&self, h: &[f32]) -> Option<(Token, f32)> {
        let p = &*self.proj;
        let act = p.quantize(h);
        let rb = p.row_bytes;
        let n = self.tokens.len();
        let prepared = p
            .kernel
            .map(|k| (k, k.prepare(p.n_embd, &[act.as_slice()])));
        let (prepared, act) = (&prepared, &act);
        // Rows are in arrival order: the larger logit wins, the smaller id a tie.
        let better = |(i, v): (usize, f32), best: Option<(usize, f32)>| {
            best.is_none_or(|(bi, b)| v > b || (v == b && self.tokens[i] < self.tokens[bi]))
        };
        let bests: Mutex<Vec<(usize, f32)>> = Mutex::new(Vec::new());
        // On the OpenMP team ggml's decode just used (its workers are still awake).
        crate::par::parallel(p.threads, &|t, threads| {
            let per = n.div_ceil(threads).max(1);
            let (lo, hi) = ((t * per).min(n), ((t + 1) * per).min(n));
            let mut best: Option<(usize, f32)> = None;
            let mut vals = [0.0f32; 256];
            for i0 in (lo..hi).step_by(256) {
                let m = 256.min(hi - i0);
                let vals = &mut vals[..m];
                let w = &self.bytes[i0 * rb..(i0 + m) * rb];
                match prepared {
                    Some((k, a)) => k.dot_many(a, w, vals),
                    None => {
                        for (j, v) in vals.iter_mut().enumerate() {
                            p.dot_row(&w[j * rb..(j + 1) * rb], act, v);
                        }
                    }
                }
                for (j, &v) in vals.iter().enumerate() {
                    if better((i0 + j, v), best) {
                        best = Some((i0 + j, v));
                    }
                }
            }
            if let Some(b) = best {
                bests.lock().unwrap_or_else(|e| e.into_inner()).push(b);
            }
        });
        let mut best = None;
        for b in bests.into_inner().unwrap_or_else(|e| e.into_inner()) {
            if better(b, best) {
                best = Some(b);
            }
        }
        best.map(|(i, v)| (self.tokens[i], v))
    }
}

impl Projection {
    fn for_model(model: &Model, threads: usize) -> Result<Option<Self>> {
        let info = GgufInfo::open(model.path())?;
        let arch = info.architecture().unwrap_or("").to_string();
        let softcap =
            info.get(&format!("{arch}.final_logit_softcapping"))
                .map_or(0.0, |v| match v {
                    crate::gguf::GgufValue::Float(x) => *x,
                    crate::gguf::GgufValue::Int(x) => *x as f64,
                    _ => 0.0,
                });
        if softcap != 0.0 {
            return Ok(None);
        }
        let Some(t) = output_tensor(&info) else {
            return Ok(None);
        };
        let Some(ty) = type_by_name(&t.ggml_type) else {
            return Ok(None);
        };
        crate::backend::init();
        // SAFETY: ggml_cpu_init is idempotent; the traits table is static.
        let traits = unsafe {
            sys::ggml_cpu_init();
            sys::ggml_get_type_traits_cpu(ty)
        };
        // SAFETY: non-null pointers into ggml's static table.
        let Some(tr) = (unsafe { traits.as_ref() }) else {
            return Ok(None);
        };
        if tr.vec_dot.is_none() {
            return Ok(None);
        }
        let vdt = tr.vec_dot_type;
        // SAFETY: as above, for the activation type.
        let from = unsafe { sys::ggml_get_type_traits_cpu(vdt).as_ref() };
        if vdt != sys::GGML_TYPE_F32 && from.and_then(|f| f.from_float).is_none() {
            return Ok(None);
        }
        let (n_embd, n_vocab) = (t.ne[0] as usize, t.ne[1] as usize);
        // SAFETY: plain size arithmetic on a valid type.
        let row_bytes = unsafe { sys::ggml_row_size(ty, n_embd as i64) };
        if row_bytes * n_vocab != t.size as usize || n_embd != model.n_embd() as usize {
            return Ok(None);
        }
        let weights = Mapped::shared(model.path(), t.offset, t.size as usize)?;
        let mut p = Self {
            weights,
            path: model.path().to_path_buf(),
            offset: t.offset,
            ty,
            vec_dot_type: vdt,
            n_embd,
            n_vocab,
            row_bytes,
            traits,
            threads: threads.max(1),
            kernel: None,
        };
        // The kernel checks itself against ggml's vec_dot once per process and type.
        p.kernel = crate::qdot::Kind::from_ggml_name(&t.ggml_type)
            .and_then(crate::qdot::checked)
            .filter(|k| k.kind().act_block() * (n_embd / 32) == p.act_bytes());
        Ok(Some(p))
    }

    /// Bytes of one quantized activation row.
    fn act_bytes(&self) -> usize {
        if self.vec_dot_type == sys::GGML_TYPE_F32 {
            return self.n_embd * 4;
        }
        // SAFETY: plain size arithmetic on a valid type.
        unsafe { sys::ggml_row_size(self.vec_dot_type, self.n_embd as i64) }
    }

    /// Weight rows `vocab..vocab + n`.
    fn rows(&self, vocab: usize, n: usize) -> &[u8] {
        assert!(vocab + n <= self.n_vocab);
        // SAFETY: the rows lie inside the read-only mapping, which lives as long as `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.weights.bytes().add(vocab * self.row_bytes),
                n * self.row_bytes,
            )
        }
    }

    /// One output row (`vocab` entry) against quantized activations.
    fn dot(&self, vocab: usize, act: &[u8], out: &mut f32) {
        self.dot_row(self.rows(vocab, 1), act, out);
    }

    /// One output row's bytes against quantized activations.
    fn dot_row(&self, row: &[u8], act: &[u8], out: &mut f32) {
        assert_eq!(row.len(), self.row_bytes);
        // SAFETY: static traits table (see `for_model`).
        let vec_dot = unsafe { (*self.traits).vec_dot }.expect("checked in for_model");
        let row = row.as_ptr().cast::<c_void>();
        // SAFETY: `row` is one full weight row; `act` one row of the vec_dot type; nrc = 1 as
        // ggml's mul_mat calls it on x86 (strides unused).
        unsafe {
            vec_dot(
                self.n_embd as i32,
                out,
                0,
                row,
                0,
                act.as_ptr().cast(),
                0,
                1,
            )
        };
    }

    /// The activations in the kernel's type, quantized as ggml's mul_mat does (from_float of
    /// the vec_dot type).
    fn quantize(&self, h: &[f32]) -> Vec<u8> {
        assert_eq!(h.len(), self.n_embd, "hidden state of the wrong width");
        if self.vec_dot_type == sys::GGML_TYPE_F32 {
            return h.iter().flat_map(|x| x.to_ne_bytes()).collect();
        }
        let mut q = vec![0u8; self.act_bytes()];
        // SAFETY: static traits table (checked in `for_model`).
        let from = unsafe { (*sys::ggml_get_type_traits_cpu(self.vec_dot_type)).from_float }
            .expect("checked in for_model");
        // SAFETY: `q` has room for one row of the vec_dot type; `h` has n_embd floats.
        unsafe { from(h.as_ptr(), q.as_mut_ptr().cast(), self.n_embd as i64) };
        q
    }

    /// The logits of several hidden states for vocabulary entries `vocab` in one pass over
    /// those weights: each weight row is read once for all of them (with the
    /// weight-stationary kernel; one `vec_dot` per row and state without one). The entries
    /// are split across the threads. `outs` must be vocabulary-sized when `vocab` is not the
    /// whole vocabulary (they are resized otherwise).
    ///
    /// `src`: where the rows of `vocab` are when a stream read them into its own memory
    /// (else they are read through the mapping).
    fn logits_rows(
        &self,
        hs: &[&[f32]],
        outs: &mut [Vec<f32>],
        vocab: std::ops::Range<usize>,
        src: Option<*const u8>,
    ) {
        assert_eq!(hs.len(), outs.len());
        let acts: Vec<Vec<u8>> = hs.iter().map(|h| self.quantize(h)).collect();
        let acts: Vec<&[u8]> = acts.iter().map(Vec::as_slice).collect();
        // Every entry of `vocab` is written below: a buffer already vocabulary-sized (the
        // callers reuse theirs) is not zeroed again, a megabyte a row on Gemma 3.
        for o in outs.iter_mut() {
            if o.len() != self.n_vocab {
                o.clear();
                o.resize(self.n_vocab, 0.0);
            }
        }
        let first = vocab.start;
        let len = vocab.len();
        let src = src.map(|p| p as usize);
        let rows_of = move |v: usize, n: usize| -> &[u8] {
            match src {
                // SAFETY: the stream's memory holds rows `vocab` until `after` (see
                // `RowStream::before`), and `v..v + n` lies inside them.
                Some(p) => {
                    assert!(v >= vocab.start && v + n <= vocab.end);
                    unsafe {
                        std::slice::from_raw_parts(
                            (p as *const u8).add((v - first) * self.row_bytes),
                            n * self.row_bytes,
                        )
                    }
                }
                None => self.rows(v, n),
            }
        };
        // Each thread writes its own vocabulary chunk of every output row.
        let outs_at: Vec<usize> = outs.iter_mut().map(|o| o.as_mut_ptr() as usize).collect();
        let (acts, outs_at) = (&acts, &outs_at);
        let prepared = self.kernel.map(|k| (k, k.prepare(self.n_embd, acts)));
        let prepared = &prepared;
        // The OpenMP team ggml's decode just used: no threads spawned, none left spinning
        // against ours.
        crate::par::parallel(self.threads, &|t, threads| {
            let per = len.div_ceil(threads).max(1);
            let (lo, hi) = ((t * per).min(len), ((t + 1) * per).min(len));
            let r = acts.len();
            // Weight rows a pass: their results for every state stay in cache.
            const TILE: usize = 256;
            let mut tmp = vec![0.0f32; TILE * r];
            for i0 in (lo..hi).step_by(TILE) {
                let n = TILE.min(hi - i0);
                let v0 = first + i0;
                let tmp = &mut tmp[..n * r];
                match prepared {
                    Some((k, a)) => k.dot_many(a, rows_of(v0, n), tmp),
                    None => {
                        for (i, t) in tmp.chunks_exact_mut(r).enumerate() {
                            for (a, t) in acts.iter().zip(t) {
                                self.dot_row(rows_of(v0 + i, 1), a, t);
                            }
                        }
                    }
                }
                for (j, &o) in outs_at.iter().enumerate() {
                    for i in 0..n {
                        // SAFETY: every output is vocabulary-sized (resized above) and this
                        // thread alone writes entries `first + lo..first + hi` of each.
                        unsafe { *(o as *mut f32).add(v0 + i) = tmp[i * r + j] };
                    }
                }
            }
        });
    }
}

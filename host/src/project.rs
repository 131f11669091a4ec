//! On-demand output projection (Lever §4.4) without patching llama.cpp.
//!
//! A verification call of k rows normally pays the output projection (for Gemma 3 270M a
//! 262144 x 640 matrix, ~10 ms a row on 2 cores here) for every row, though acceptance only
//! ever reads the rows on the accepted path and the one after it. [`OnDemand`] cuts the graph
//! at `result_norm` (the final normalised hidden states, just before the projection) through
//! llama.cpp's eval callback: when armed, the callback copies those hidden states out and
//! stops the computation there. [`OnDemand::logits_rows`] then projects the rows wanted, in
//! one pass over the weights, with ggml's own CPU kernels (the type's `from_float` and
//! `vec_dot`, exactly what ggml's `mul_mat` runs per output element) or, where it reproduces
//! `vec_dot` bit for bit, Leap's weight-stationary kernel for several rows ([`crate::qdot`]),
//! so a projected row is bit-identical to the logits llama.cpp computes; [`OnDemand::check`]
//! proves that on the model at hand before use.
//!
//! The weights are the GGUF's `output.weight` (or the tied `token_embd.weight`), memory-mapped
//! read-only from the model file: the page cache is shared with llama.cpp's own mapping.
//! Under flash streaming a [`RowStream`] may read them into its own memory instead.
//!
//! | file | owns |
//! |---|---|
//! | `project.rs` | the output weights (one mapping per process), their [`fingerprint`], ggml's kernels and Leap's multi-row kernel over them |
//! | `project/on_demand.rs` | [`OnDemand`]: the decode cut at `result_norm`, the logits of its hidden states, the [`RowStream`] hook of flash streaming |
//! | `project/draft_vocab.rs` | [`DraftVocab`]: some rows copied out and kept resident, to draft from under a streamed projection |

mod draft_vocab;
mod on_demand;

pub use draft_vocab::DraftVocab;
pub use on_demand::{OnDemand, RowStream};

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use crate::{Error, GgufInfo, Model, Result};

/// A read-only memory map of a byte range of a file ([`crate::fileio::Mapping`]).
struct Mapped(crate::fileio::Mapping);

impl Mapped {
    fn new(path: &std::path::Path, offset: u64, size: usize) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|_| Error::ModelNotFound {
            path: path.to_path_buf(),
        })?;
        crate::fileio::Mapping::new(&f, offset, size)
            .map(Self)
            .map_err(|e| Error::InvalidGguf {
                path: path.to_path_buf(),
                reason: format!("cannot map the output weights: {e}"),
            })
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
        self.0.as_ptr()
    }
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
    Ok(fingerprint_file(model.path())?.map(|(f, _)| f))
}

/// [`fingerprint`] of the GGUF file at `path`, without loading the model (a host that loaded
/// it itself: the C API's drafter), and the output weights' rows (the vocabulary's size).
///
/// # Errors
/// The file cannot be read or is not GGUF.
pub fn fingerprint_file(path: &std::path::Path) -> Result<Option<(String, usize)>> {
    use std::io::{Read, Seek, SeekFrom};
    let info = GgufInfo::open(path)?;
    let Some(t) = output_tensor(&info) else {
        return Ok(None);
    };
    let io = |e: std::io::Error| Error::InvalidGguf {
        path: path.to_path_buf(),
        reason: format!("reading the output weights: {e}"),
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    f.seek(SeekFrom::Start(t.offset)).map_err(io)?;
    let mut bytes = vec![0u8; t.size.min(1 << 20) as usize];
    f.read_exact(&mut bytes).map_err(io)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in &bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    Ok(Some((
        format!("{} {}x{} fnv1a:{h:016x}", t.ggml_type, t.ne[0], t.ne[1]),
        t.ne[1] as usize,
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
    /// The output weights' share of the weights a one-row call reads (see
    /// [`OnDemand::head_share`]).
    head_share: f64,
    traits: *const sys::ggml_type_traits_cpu,
    threads: usize,
    /// Leap's weight-stationary kernel for several rows at once, when there is one for the
    /// type and it reproduces ggml's `vec_dot` here (see `qdot::checked`).
    kernel: Option<crate::qdot::Kernel>,
}

// SAFETY: `traits` points at ggml's static, immutable type-traits table.
unsafe impl Send for Projection {}
unsafe impl Sync for Projection {}

fn type_by_name(name: &str) -> Option<sys::ggml_type> {
    (0..sys::GGML_TYPE_COUNT).find(|&t| {
        // SAFETY: any value below GGML_TYPE_COUNT is a valid type id; names are static.
        let n = unsafe { sys::ggml_type_name(t) };
        !n.is_null() && unsafe { std::ffi::CStr::from_ptr(n) }.to_str() == Ok(name)
    })
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
        // Every other weight a call reads whole: all but the token embeddings (one row a
        // token) and the head itself.
        let rest: u64 = info
            .tensors
            .iter()
            .filter(|o| o.name != "token_embd.weight" && o.name != "output.weight")
            .map(|o| o.size)
            .sum();
        let head_share = t.size as f64 / (t.size + rest).max(1) as f64;
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
            head_share,
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
        // Every entry of `vocab` is written below: a buffer already vocabulary-sized (the
        // callers reuse theirs) is not zeroed again, a megabyte a row on Gemma 3.
        for o in outs.iter_mut() {
            if o.len() != self.n_vocab {
                o.clear();
                o.resize(self.n_vocab, 0.0);
            }
        }
        let r = hs.len();
        // Each thread writes its own vocabulary chunk of every output row.
        let outs_at: Vec<usize> = outs.iter_mut().map(|o| o.as_mut_ptr() as usize).collect();
        let outs_at = &outs_at;
        self.pass(hs, vocab, src, &|_, v0, n, tmp| {
            // Each state's run of the tile in order, 8 x 8 blocks through registers (a float
            // at a time, Gemma's 8-row projection took 6-8% longer).
            // SAFETY: every output is vocabulary-sized (resized above) and this thread alone
            // writes entries `v0..v0 + n` of each.
            unsafe {
                leap_kernels::transpose::columns_to(tmp, r, n, |j| (outs_at[j] as *mut f32).add(v0))
            };
        });
    }

    /// The largest logit of each hidden state of `hs` over vocabulary entries `vocab`, and its
    /// entry, folded into `best` (one per state, from earlier entries; `(usize::MAX,
    /// -inf)` before any): the first of equal maxima, as [`crate::sampler::argmax`] over the
    /// logits [`Projection::logits_rows`] gives (the same products, in the same tiles), with no
    /// logits written or read back (a megabyte a state on Gemma 3).
    fn argmax_rows(
        &self,
        hs: &[&[f32]],
        best: &mut [(usize, f32)],
        vocab: std::ops::Range<usize>,
        src: Option<*const u8>,
    ) {
        assert_eq!(hs.len(), best.len());
        let r = hs.len();
        // Thread t's best (entry, logit) for each state, over its ascending run of entries.
        let mine: Vec<std::sync::Mutex<Vec<(usize, f32)>>> = (0..self.threads.max(1))
            .map(|_| std::sync::Mutex::new(vec![(usize::MAX, f32::NEG_INFINITY); r]))
            .collect();
        self.pass(hs, vocab, src, &|t, v0, n, tmp| {
            let mut mine = mine[t].lock().unwrap_or_else(|e| e.into_inner());
            for (i, row) in tmp.chunks_exact(r).take(n).enumerate() {
                for (b, &v) in mine.iter_mut().zip(row) {
                    if v > b.1 {
                        *b = (v0 + i, v);
                    }
                }
            }
        });
        // In thread order a later maximum wins only when larger, as in one scan.
        for m in mine {
            for (b, m) in best
                .iter_mut()
                .zip(m.into_inner().unwrap_or_else(|e| e.into_inner()))
            {
                if m.1 > b.1 {
                    *b = m;
                }
            }
        }
    }

    /// One pass over vocabulary entries `vocab` for the states `hs`, split over at most
    /// `self.threads` threads, each taking an ascending run of entries a tile of weight rows
    /// at a time: `tile(t, v0, n, tmp)` on thread t for entries `v0..v0 + n`, with
    /// `tmp[i * states + j]` entry `v0 + i`'s result for state j. `src` as for
    /// [`Projection::logits_rows`].
    fn pass(
        &self,
        hs: &[&[f32]],
        vocab: std::ops::Range<usize>,
        src: Option<*const u8>,
        tile: &(impl Fn(usize, usize, usize, &[f32]) + Sync),
    ) {
        let acts: Vec<Vec<u8>> = hs.iter().map(|h| self.quantize(h)).collect();
        let acts: Vec<&[u8]> = acts.iter().map(Vec::as_slice).collect();
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
        let acts = &acts;
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
                tile(t, v0, n, tmp);
            }
        });
    }
}

//! A llama.cpp context: decoding, logits per output row, and the KV memory operations that
//! speculative decoding rolls back with.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::eval::eval_trampoline;
use crate::{backend, Batch, Error, EvalObserver, Model, Pos, Result, SeqId};

/// llama.cpp's flash-attention setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlashAttn {
    /// llama.cpp decides (it turns flash attention on where the device supports it).
    #[default]
    Auto,
    /// Always on.
    On,
    /// Always off.
    Off,
}

impl FlashAttn {
    /// `auto`, `on` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            FlashAttn::Auto => "auto",
            FlashAttn::On => "on",
            FlashAttn::Off => "off",
        }
    }
}

impl std::str::FromStr for FlashAttn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FlashAttn::Auto),
            "on" => Ok(FlashAttn::On),
            "off" => Ok(FlashAttn::Off),
            other => Err(format!(
                "flash attention must be on, off or auto, not {other:?}"
            )),
        }
    }
}

/// How to make a [`Context`].
#[derive(Debug, Clone)]
pub struct ContextParams {
    /// Context length in tokens (0: the model's training length).
    pub n_ctx: u32,
    /// Largest batch `decode` accepts.
    pub n_batch: u32,
    /// Physical micro-batch.
    pub n_ubatch: u32,
    /// Sequences the KV memory tracks (tree verification uses one per leaf).
    pub n_seq_max: u32,
    /// Threads for single-token decoding.
    pub n_threads: i32,
    /// Threads for batches (prefill).
    pub n_threads_batch: i32,
    /// Flash attention; off by default. ggml's CPU flash attention splits the KV cache for a
    /// single query row (from 512 cells) and tiles several rows, so it is not batch-invariant;
    /// without it a token's logits do not depend on how many rows its batch had.
    pub flash_attn: FlashAttn,
    /// One KV buffer shared by all sequences (what tree verification needs: shared prefixes).
    pub kv_unified: bool,
    /// Full-size cache for sliding-window layers (on by default). Needed to roll back across
    /// the window, and for exactness: a window-sized cache is a ring whose cell order depends
    /// on the batch shapes and on the number of sequences (its size does), and the attention
    /// sums over cells in SIMD lanes by cell index, so a token's logits would depend on them.
    pub swa_full: bool,
    /// Pool each sequence's final hidden states into one embedding ([`Context::embedding`])
    /// instead of computing logits; `None` for a generating context.
    pub pooling: Option<Pooling>,
}

/// How an embedding context pools a sequence's rows (llama.cpp's pooling types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every row.
    Mean,
    /// The last row.
    Last,
    /// The first row.
    Cls,
}

impl Default for ContextParams {
    fn default() -> Self {
        let threads = crate::par::default_threads();
        Self {
            n_ctx: 4096,
            n_batch: 512,
            n_ubatch: 512,
            n_seq_max: 1,
            n_threads: threads,
            n_threads_batch: threads,
            flash_attn: FlashAttn::Off,
            kv_unified: true,
            swa_full: true,
            pooling: None,
        }
    }
}

/// A llama.cpp context on a shared [`Model`].
pub struct Context {
    raw: NonNull<sys::llama_context>,
    model: Arc<Model>,
    n_seq_max: u32,
    n_ctx: u32,
    // Keeps the eval observer at a stable address for the C callback; never touched while
    // llama_decode runs. Declared after `raw` so it drops after the context is freed.
    observer: Option<Box<crate::eval::Hook>>,
    // What llama.cpp's abort callback reads, at a stable address (same drop order).
    abort: Box<Abort>,
}

/// A check that stops a decode: returning true aborts `llama_decode` between graph nodes
/// (the decode then fails with [`Error::Cancelled`]). Set with [`Context::set_cancel`].
pub type Cancel = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

/// What the abort callback consults: the observer's failure flag and the caller's check.
struct Abort {
    flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cancel: Option<Cancel>,
}

/// llama.cpp's abort callback: `data` is the context's [`Abort`].
unsafe extern "C" fn abort_trampoline(data: *mut c_void) -> bool {
    if data.is_null() {
        return false;
    }
    // SAFETY: the Context keeps its Abort alive as long as llama.cpp may call this, and
    // changes it only through `&mut self` (never while llama_decode runs).
    let a = unsafe { &*(data as *const Abort) };
    a.flag.load(std::sync::atomic::Ordering::Relaxed)
        || a.cancel.as_ref().is_some_and(|c| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c())).unwrap_or(true)
        })
}

// SAFETY: a llama_context may move between threads; it is not used concurrently (`&mut self`
// on every mutating call), and the observer it calls is `Send`.
unsafe impl Send for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `raw` came from llama_init_from_model and is freed exactly once, before
        // the Model (held by `self.model`) and the observer.
        unsafe { sys::llama_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("model", &self.model.path())
            .field("n_ctx", &self.n_ctx)
            .field("n_seq_max", &self.n_seq_max)
            .finish()
    }
}

impl Context {
    /// A context on `model`.
    ///
    /// # Errors
    /// [`Error::ContextInit`].
    pub fn new(model: &Arc<Model>, params: &ContextParams) -> Result<Self> {
        Self::with_observer(model, params, None)
    }

    /// A context whose decodes report intermediate tensors to `observer`.
    ///
    /// # Errors
    /// [`Error::ContextInit`].
    pub fn with_observer(
        model: &Arc<Model>,
        params: &ContextParams,
        observer: Option<Box<dyn EvalObserver>>,
    ) -> Result<Self> {
        backend::init();
        // SAFETY: returns a plain struct of defaults.
        let mut cp = unsafe { sys::llama_context_default_params() };
        cp.n_ctx = params.n_ctx;
        cp.n_batch = params.n_batch;
        cp.n_ubatch = params.n_ubatch.min(params.n_batch);
        cp.n_seq_max = params.n_seq_max.max(1);
        cp.n_threads = params.n_threads;
        cp.n_threads_batch = params.n_threads_batch;
        cp.flash_attn_type = match params.flash_attn {
            FlashAttn::Auto => sys::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttn::On => sys::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttn::Off => sys::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        };
        cp.kv_unified = params.kv_unified;
        cp.swa_full = params.swa_full;
        if let Some(p) = params.pooling {
            cp.embeddings = true;
            cp.pooling_type = match p {
                Pooling::Mean => sys::LLAMA_POOLING_TYPE_MEAN,
                Pooling::Last => sys::LLAMA_POOLING_TYPE_LAST,
                Pooling::Cls => sys::LLAMA_POOLING_TYPE_CLS,
            };
        }
        let mut observer = observer.map(|obs| {
            Box::new(crate::eval::Hook {
                obs,
                abort: Default::default(),
            })
        });
        if let Some(hook) = observer.as_mut() {
            cp.cb_eval = Some(eval_trampoline);
            cp.cb_eval_user_data = (&mut **hook as *mut crate::eval::Hook).cast::<c_void>();
        }
        let abort = Box::new(Abort {
            flag: observer
                .as_ref()
                .map_or_else(Default::default, |h| std::sync::Arc::clone(&h.abort)),
            cancel: None,
        });
        cp.abort_callback = Some(abort_trampoline);
        cp.abort_callback_data = (&*abort as *const Abort).cast_mut().cast::<c_void>();
        backend::take_last_problem();
        // SAFETY: the model is live (held by the Arc we clone below); `cp` is initialised; the
        // observer box outlives the context (field order in `Context`).
        let raw = unsafe { sys::llama_init_from_model(model.raw(), cp) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::ContextInit {
            n_ctx: params.n_ctx,
            reason: backend::reason_or("llama_init_from_model returned null"),
        })?;
        // SAFETY: live context.
        let n_ctx = unsafe { sys::llama_n_ctx(raw.as_ptr()) };
        Ok(Self {
            raw,
            model: Arc::clone(model),
            n_seq_max: cp.n_seq_max,
            n_ctx,
            observer,
            abort,
        })
    }

    /// Check `cancel` during every decode from now on (`None`: no check): when it returns
    /// true, the decode stops between graph nodes and fails with [`Error::Cancelled`]. The
    /// KV cells of a cancelled batch are not to be relied on.
    pub fn set_cancel(&mut self, cancel: Option<Cancel>) {
        self.abort.cancel = cancel;
    }

    /// The raw pointer, for the anchor shim in this crate.
    pub(crate) fn raw(&self) -> *mut sys::llama_context {
        self.raw.as_ptr()
    }

    /// How many decodes reused llama.cpp's previous compute graph (no graph build and no
    /// scheduling: llama.cpp reuses a graph when the batch's shape and the KV cells it sees
    /// are unchanged), since the context was created.
    pub fn graphs_reused(&self) -> u64 {
        // SAFETY: a live context.
        unsafe { sys::llama_perf_context(self.raw.as_ptr()).n_reused.max(0) as u64 }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Context length in tokens.
    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    /// Sequences the KV memory tracks.
    pub fn n_seq_max(&self) -> u32 {
        self.n_seq_max
    }

    /// Set the thread counts for decoding and for batches.
    pub fn set_threads(&mut self, n_threads: i32, n_threads_batch: i32) {
        // SAFETY: live context.
        unsafe { sys::llama_set_n_threads(self.raw(), n_threads, n_threads_batch) }
    }

    /// Run the batch through the model, appending its tokens to the KV memory.
    ///
    /// # Errors
    /// [`Error::KvCacheFull`], [`Error::Cancelled`], [`Error::Aborted`],
    /// [`Error::InvalidBatch`], [`Error::Decode`].
    pub fn decode(&mut self, batch: &Batch) -> Result<()> {
        // llama.cpp asserts (aborts the process) on a batch larger than n_batch.
        // SAFETY: live context.
        let n_batch = unsafe { sys::llama_n_batch(self.raw()) } as usize;
        if batch.len() > n_batch {
            return Err(Error::InvalidBatch {
                n_tokens: batch.len(),
                reason: format!("more tokens than the context's batch size ({n_batch})"),
            });
        }
        backend::take_last_problem();
        if let Some(h) = &self.observer {
            h.abort.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        // SAFETY: live context; the batch's arrays are valid for `n_tokens` entries.
        let rc = unsafe { sys::llama_decode(self.raw(), batch.raw()) };
        if let Some(reason) = self.observer.as_mut().and_then(|h| h.obs.failure()) {
            return Err(Error::Stopped { reason });
        }
        match rc {
            0 => Ok(()),
            1 => Err(Error::KvCacheFull {
                n_tokens: batch.len(),
                n_ctx: self.n_ctx,
            }),
            2 if self.abort.cancel.as_ref().is_some_and(|c| c()) => Err(Error::Cancelled),
            2 => Err(Error::Aborted),
            -1 => Err(Error::InvalidBatch {
                n_tokens: batch.len(),
                reason: backend::reason_or("llama.cpp gave no reason"),
            }),
            code => Err(Error::Decode {
                code,
                reason: backend::reason_or("llama.cpp gave no reason"),
            }),
        }
    }

    /// The logits of batch row `row` of the last decode (`-1`: the last output row), one per
    /// vocabulary entry.
    ///
    /// # Errors
    /// [`Error::NoLogits`] when that row did not ask for output.
    pub fn logits(&self, row: i32) -> Result<&[f32]> {
        // SAFETY: live context; llama.cpp returns null (and logs) for a row without output.
        let p = unsafe { sys::llama_get_logits_ith(self.raw(), row) };
        if p.is_null() {
            backend::take_last_problem();
            return Err(Error::NoLogits { row });
        }
        // SAFETY: a non-null result points to n_vocab floats owned by the context, valid
        // until the next decode, which needs `&mut self` and so cannot overlap this borrow.
        Ok(unsafe { std::slice::from_raw_parts(p, self.model.n_vocab() as usize) })
    }

    /// Sequence `seq`'s pooled embedding after a decode, in a context made with
    /// [`ContextParams::pooling`] (`n_embd` values).
    ///
    /// # Errors
    /// [`Error::NoLogits`] (row -1) when the context does not pool or `seq` was not decoded.
    pub fn embedding(&self, seq: SeqId) -> Result<&[f32]> {
        self.check_seq(seq)?;
        // SAFETY: live context; llama.cpp returns null for a context or sequence without
        // a pooled embedding.
        let p = unsafe { sys::llama_get_embeddings_seq(self.raw(), seq) };
        if p.is_null() {
            backend::take_last_problem();
            return Err(Error::NoLogits { row: -1 });
        }
        // SAFETY: a non-null result points to n_embd floats owned by the context, valid until
        // the next decode, which needs `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts(p, self.model.n_embd() as usize) })
    }

    fn mem(&self) -> sys::llama_memory_t {
        // SAFETY: live context; the memory lives as long as the context.
        unsafe { sys::llama_get_memory(self.raw()) }
    }

    fn check_seq(&self, seq: SeqId) -> Result<()> {
        if seq >= 0 && (seq as u32) < self.n_seq_max {
            Ok(())
        } else {
            Err(Error::SeqIdOutOfRange {
                seq,
                n_seq_max: self.n_seq_max,
            })
        }
    }

    /// Remove the cells of `seq` (any sequence when negative) with positions in `[p0, p1)`
    /// (`p0 < 0`: from 0, `p1 < 0`: to the end). Returns false when llama.cpp cannot remove
    /// part of a sequence (recurrent memory); removing a whole sequence always works.
    pub fn seq_rm(&mut self, seq: SeqId, p0: Pos, p1: Pos) -> bool {
        // SAFETY: live memory; llama.cpp handles any id/range values.
        unsafe { sys::llama_memory_seq_rm(self.mem(), seq, p0, p1) }
    }

    /// Make `dst` share `src`'s cells in `[p0, p1)` (no copy in a unified cache).
    ///
    /// # Errors
    /// [`Error::SeqIdOutOfRange`].
    pub fn seq_cp(&mut self, src: SeqId, dst: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        self.check_seq(src)?;
        self.check_seq(dst)?;
        // SAFETY: live memory; ids were range-checked (llama.cpp asserts on them).
        unsafe { sys::llama_memory_seq_cp(self.mem(), src, dst, p0, p1) };
        Ok(())
    }

    /// Drop every cell that does not belong to `seq`.
    ///
    /// # Errors
    /// [`Error::SeqIdOutOfRange`].
    pub fn seq_keep(&mut self, seq: SeqId) -> Result<()> {
        self.check_seq(seq)?;
        // SAFETY: live memory; id range-checked.
        unsafe { sys::llama_memory_seq_keep(self.mem(), seq) };
        Ok(())
    }

    /// Shift positions of `seq` in `[p0, p1)` by `delta`.
    ///
    /// # Errors
    /// [`Error::SeqIdOutOfRange`].
    pub fn seq_add(&mut self, seq: SeqId, p0: Pos, p1: Pos, delta: Pos) -> Result<()> {
        self.check_seq(seq)?;
        // SAFETY: live memory; id range-checked.
        unsafe { sys::llama_memory_seq_add(self.mem(), seq, p0, p1, delta) };
        Ok(())
    }

    /// Largest position of `seq` in memory, or -1 when it is empty.
    pub fn seq_pos_max(&self, seq: SeqId) -> Pos {
        // SAFETY: live memory.
        unsafe { sys::llama_memory_seq_pos_max(self.mem(), seq) }
    }

    /// Smallest position of `seq` in memory, or -1 when it is empty.
    pub fn seq_pos_min(&self, seq: SeqId) -> Pos {
        // SAFETY: live memory.
        unsafe { sys::llama_memory_seq_pos_min(self.mem(), seq) }
    }

    /// Empty the KV memory (and zero its buffers when `data`).
    pub fn clear(&mut self, data: bool) {
        // SAFETY: live memory.
        unsafe { sys::llama_memory_clear(self.mem(), data) }
    }
}

#[cfg(test)]
mod tests {
    use super::FlashAttn;

    #[test]
    fn flash_attn_parses_its_own_names() {
        for f in [FlashAttn::Auto, FlashAttn::On, FlashAttn::Off] {
            assert_eq!(f.as_str().parse::<FlashAttn>().unwrap(), f);
        }
        assert!("yes"
            .parse::<FlashAttn>()
            .unwrap_err()
            .contains("on, off or auto"));
    }
}

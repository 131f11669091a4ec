//! Flash-streamed target weights (Lever's setting, `../shared/papers/002`): a GGUF layer map,
//! a DRAM budget planner, and residency control over the model file's pages, with I/O
//! accounting.
//!
//! What is here: [`LayerMap`] (each block's byte ranges, the embeddings and the output
//! projection, from ggml's own GGUF parser), [`plan`] (which sections stay resident under a
//! budget, leaving room for the layers in flight), and [`Pages`] (a read-only mapping of the
//! model file whose ranges can be prefetched, evicted from DRAM — the page cache included —
//! and measured with `mincore`), plus [`io_read_bytes`] (what the process really read from
//! storage), and [`Streamer`], the driver that reads blocks ahead and evicts them during a
//! target call (llama.cpp's eval callback at layer boundaries). A streamed output projection
//! goes through Leap's own projection a chunk at a time ([`Streamer::stream_projection`]):
//! the next chunk is read while one computes (with `O_DIRECT` into Leap's buffers where the
//! file system allows) and each leaves memory once done; where llama.cpp projects instead (a
//! single node), the output weights are resident whole while that node runs.
//!
//! Used by `leap_spec::session` (`leap generate --flash-budget`): the engine lets token trees
//! grow under streaming (`EngineConfig::streamed`) and sizes them by the measured cost of
//! calls, their I/O included; by `leap bench --flash-budget` (one budget, or a sweep as in
//! Lever's Table 6); and by `leap info --flash-budget` (the plan).

mod map;
mod pages;
mod plan;
mod stream;

pub use map::{LayerMap, Section};
pub use pages::{io_read_bytes, mappings_of, Mapping, Pages};
pub use plan::{plan, Plan, Strategy};
pub use stream::{CallStats, Streamer};

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

static SIGBUS_MSG: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static SIGBUS_LEN: AtomicUsize = AtomicUsize::new(0);

/// For a program (not a library: the handler is process-wide): a SIGBUS, which is how a read
/// through a file mapping fails (the model file truncated under llama.cpp's mapping between
/// two of [`Streamer`]'s checks, or outside flash streaming where nothing checks; a storage
/// error), prints `message` on stderr and exits with status 1 instead of dying by the signal.
/// The computation cannot go on (the faulting read has no data), so this is the cleanest end.
pub fn exit_on_sigbus(message: &'static str) {
    SIGBUS_LEN.store(message.len(), Ordering::SeqCst);
    SIGBUS_MSG.store(message.as_ptr().cast_mut(), Ordering::SeqCst);
    extern "C" fn on_sigbus(_sig: libc::c_int) {
        let (p, n) = (
            SIGBUS_MSG.load(Ordering::SeqCst),
            SIGBUS_LEN.load(Ordering::SeqCst),
        );
        // SAFETY: write(2) and _exit(2) are async-signal-safe; `p` points at `n` bytes of a
        // `&'static str`.
        unsafe {
            if !p.is_null() {
                libc::write(2, p.cast(), n);
            }
            libc::_exit(1);
        }
    }
    // SAFETY: a zeroed sigaction with a plain handler and an empty mask is a valid argument.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

/// Errors of the flash layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file cannot be read or mapped.
    #[error("{path}: {what}: {source}")]
    Io {
        path: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The GGUF cannot be parsed.
    #[error(transparent)]
    Gguf(#[from] leap_host::Error),
    /// A range outside the file (a truncated or replaced model).
    #[error("{path}: bytes {start}..{end} are outside the file ({len} bytes): was it truncated or replaced?")]
    OutOfFile {
        path: String,
        start: u64,
        end: u64,
        len: u64,
    },
}

/// Results of the flash layer.
pub type Result<T> = std::result::Result<T, Error>;

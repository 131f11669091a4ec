//! Running a node's work on the threads ggml's CPU backend uses.

pub(crate) use leap_host::par::{parallel, parallel_phased};

/// A pointer shared with the worker threads (each writes disjoint elements).
#[derive(Clone, Copy)]
pub(crate) struct Ptr(pub(crate) *mut u8);
// SAFETY: see above; the node's buffers outlive the parallel region.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Ptr {
    pub(crate) fn at(self, offset: usize) -> *mut u8 {
        // SAFETY: callers stay inside the tensor's data.
        unsafe { self.0.add(offset) }
    }
}

/// The first `len` elements of `v`, which grows (zero-filled) only where it was shorter: for
/// buffers reused from node to node whose first `len` elements the caller then writes in full.
/// `Vec::resize` to a length between two nodes' would zero-fill the difference again each time
/// (attention's query rows alternate between a `kq` node's few and a `kqv` node's many).
pub(crate) fn prefix<T: Copy + Default>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    if v.len() < len {
        v.resize(len, T::default());
    }
    &mut v[..len]
}

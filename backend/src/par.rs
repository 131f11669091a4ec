//! Running a node's work on the threads ggml's CPU backend uses.

pub(crate) use leap_host::par::parallel;

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

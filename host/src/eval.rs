//! llama.cpp's eval callback: observe named intermediate tensors (`l_out-12`, `attn_norm-3`,
//! ...) while a graph computes. Early-exit heads and the backend's attention estimator read
//! hidden states this way.

use std::ffi::{c_void, CStr};

use llama_cpp_sys_2 as sys;

/// A tensor seen by the eval callback. Valid only inside the callback.
pub struct TensorView<'a> {
    raw: &'a sys::ggml_tensor,
}

impl TensorView<'_> {
    /// The tensor's name in llama.cpp's graph.
    pub fn name(&self) -> &str {
        // SAFETY: `name` is a fixed NUL-terminated char array inside the tensor.
        unsafe { CStr::from_ptr(self.raw.name.as_ptr()) }
            .to_str()
            .unwrap_or("")
    }

    /// Whether the name is `name`, compared in place (a graph's callback asks about every
    /// node: no `strlen` of each name).
    pub fn name_is(&self, name: &str) -> bool {
        let (have, want) = (&self.raw.name, name.as_bytes());
        have.len() > want.len()
            && have[want.len()] == 0
            && have.iter().zip(want).all(|(&a, &b)| a as u8 == b)
    }

    /// Shape, ggml order.
    pub fn ne(&self) -> [i64; 4] {
        self.raw.ne
    }

    /// ggml type name (`f32`, `q4_K`, ...).
    pub fn type_name(&self) -> &'static str {
        // SAFETY: returns a static string for any type value.
        unsafe { CStr::from_ptr(sys::ggml_type_name(self.raw.type_)) }
            .to_str()
            .unwrap_or("?")
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        // SAFETY: `raw` is a live tensor for the duration of the callback.
        unsafe { sys::ggml_nbytes(self.raw) }
    }

    /// Copy the data out as `f32`, if the tensor is a contiguous `f32` tensor with data.
    pub fn read_f32(&self) -> Option<Vec<f32>> {
        let contiguous = self.raw.nb[0] == 4
            && self.raw.nb[1] == 4 * self.raw.ne[0] as usize
            && self.raw.nb[2] == self.raw.nb[1] * self.raw.ne[1] as usize
            && self.raw.nb[3] == self.raw.nb[2] * self.raw.ne[2] as usize;
        if self.raw.type_ != sys::GGML_TYPE_F32 || !contiguous || self.raw.buffer.is_null() {
            return None;
        }
        let n = self.nbytes() / 4;
        let mut out = vec![0f32; n];
        // SAFETY: the tensor is allocated in a backend buffer (checked non-null) and has
        // `nbytes` bytes of computed data (the callback's observe phase); `out` has room.
        unsafe { sys::ggml_backend_tensor_get(self.raw, out.as_mut_ptr().cast(), 0, n * 4) };
        Some(out)
    }
}

/// Observes tensors during `llama_decode`. Both methods run on llama.cpp's compute thread.
pub trait EvalObserver: Send {
    /// Whether to observe this tensor (its data is not computed yet).
    fn wants(&mut self, tensor: &TensorView<'_>) -> bool;
    /// The tensor's data is ready. Return `false` to stop the computation (the rest of the
    /// decode is skipped; [`EvalObserver::failure`] says whether that is an error).
    fn observe(&mut self, tensor: &TensorView<'_>) -> bool;
    /// Why the observer stopped the computation, when that is a failure the decode must
    /// report (a model file truncated under a streamed mapping) rather than a planned stop
    /// (Leap's on-demand projection cutting the graph).
    fn failure(&mut self) -> Option<String> {
        None
    }
}

/// Several observers on one context (llama.cpp has one callback): a tensor goes to every
/// observer that wants it, in order; the computation stops if any of them says so.
pub struct Chain {
    observers: Vec<Box<dyn EvalObserver>>,
    /// Which observers wanted the tensor being computed.
    wanted: Vec<bool>,
}

impl Chain {
    /// The observers, called in this order.
    pub fn new(observers: Vec<Box<dyn EvalObserver>>) -> Self {
        let n = observers.len();
        Self {
            observers,
            wanted: vec![false; n],
        }
    }
}

impl EvalObserver for Chain {
    fn wants(&mut self, t: &TensorView<'_>) -> bool {
        let mut any = false;
        for (o, w) in self.observers.iter_mut().zip(self.wanted.iter_mut()) {
            *w = o.wants(t);
            any |= *w;
        }
        any
    }

    fn observe(&mut self, t: &TensorView<'_>) -> bool {
        let mut go_on = true;
        for (o, &w) in self.observers.iter_mut().zip(&self.wanted) {
            if w {
                go_on &= o.observe(t);
            }
        }
        go_on
    }

    fn failure(&mut self) -> Option<String> {
        self.observers.iter_mut().find_map(|o| o.failure())
    }
}

/// What the `cb_eval` trampoline gets: the observer, and the flag llama.cpp's abort
/// callback reads (set when the observer stops a decode for a failure).
pub(crate) struct Hook {
    pub(crate) obs: Box<dyn EvalObserver>,
    pub(crate) abort: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The `cb_eval` trampoline. `user` is a `*mut Hook` owned by the Context.
pub(crate) unsafe extern "C" fn eval_trampoline(
    t: *mut sys::ggml_tensor,
    ask: bool,
    user: *mut c_void,
) -> bool {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if t.is_null() || user.is_null() {
            return !ask;
        }
        // SAFETY: the Context keeps the hook alive (and does not touch it) while
        // llama_decode runs; ggml passes a live tensor.
        let (hook, raw) = unsafe { (&mut *(user as *mut Hook), &*t) };
        let view = TensorView { raw };
        if ask {
            hook.obs.wants(&view)
        } else {
            let go_on = hook.obs.observe(&view);
            if !go_on && hook.obs.failure().is_some() {
                // Stop every later split too (a false here only ends the current one).
                hook.abort.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            go_on
        }
    }));
    result.unwrap_or_else(|_| {
        log::error!("eval observer panicked; ignoring it for this tensor");
        !ask
    })
}

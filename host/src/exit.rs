//! Early exit inside a verification call (Lever §4.3) without patching llama.cpp.
//!
//! llama.cpp cannot run a graph from layer L on, so Leap prunes rows where the work is: an
//! eval-callback observer ([`Exit`]) reads every row's hidden state `l_out-L` while the graph
//! computes, asks the engine which rows go on, and publishes the answer as a row mask (to the
//! context's Leap device, `leap_backend::Device::exit_mask`, through the [`Publish`] the
//! engine gives). The device, which computes the layers' matrix products for small batches,
//! then skips the pruned rows in every product of a layer after L (their outputs are zeros).
//! Nothing else changes:
//!
//! - a kept row attends only to its ancestors in the token tree, and the engine keeps every
//!   ancestor of a kept row, so kept rows never read what a pruned row wrote to the KV cache;
//! - pruned rows get no logits (the engine never projects them) and their cells are removed
//!   with the rest of the rejected tree.
//!
//! The mask is the context's: other contexts never see it.

use std::sync::{Arc, Mutex};

use crate::eval::{EvalObserver, TensorView};

/// Where an exit's row mask goes: `Some((layer, keep))` for the current call (rows past
/// `layer` are computed only where `keep` says so), `None` to clear it.
pub type Publish = Arc<dyn Fn(Option<(u32, Vec<bool>)>) + Send + Sync>;

/// The engine's decision at the exit layer: given every row's hidden state (`rows x n_embd`,
/// row-major) and the row count, which rows continue (`None`: all of them).
pub type Decide = Box<dyn FnMut(&[f32], usize) -> Option<Vec<bool>> + Send>;

#[derive(Default)]
struct Shared {
    /// The decision for the next decode (taken by it).
    decide: Option<Decide>,
    /// Publish the decision as the row mask (else only record it: a measurement of what
    /// pruning would keep, every row computed).
    apply: bool,
    /// What the last armed decode decided.
    kept: Option<Vec<bool>>,
    /// Seconds the decision took.
    seconds: f64,
}

/// The engine's handle on a context's exit observer (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct Exit {
    layer: u32,
    shared: Arc<Mutex<Shared>>,
    /// Where the mask goes (cleared at [`Exit::disarm`]).
    publish: Publish,
}

impl std::fmt::Debug for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exit").field("layer", &self.layer).finish()
    }
}

/// The observer half, living in the context.
struct Observer {
    name: String,
    layer: u32,
    shared: Arc<Mutex<Shared>>,
    /// Where the mask goes.
    publish: Publish,
}

impl EvalObserver for Observer {
    fn wants(&mut self, t: &TensorView<'_>) -> bool {
        t.name() == self.name && self.lock().decide.is_some()
    }

    fn observe(&mut self, t: &TensorView<'_>) -> bool {
        let Some(mut decide) = self.lock().decide.take() else {
            return true;
        };
        let rows = t.ne()[1] as usize;
        let t0 = std::time::Instant::now();
        let keep = t.read_f32().and_then(|h| decide(&h, rows));
        let mut s = self.lock();
        s.seconds = t0.elapsed().as_secs_f64();
        if let Some(k) = keep.as_ref().filter(|_| s.apply) {
            (self.publish)(Some((self.layer, k.clone())));
        }
        s.kept = keep;
        true
    }
}

impl Observer {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Exit {
    /// An exit at layer `layer` (after its output `l_out-{layer}`) whose row masks go to
    /// `publish`, and the observer to put on the context (with
    /// [`crate::Context::with_observer`], in a [`crate::Chain`] with others).
    pub fn new(layer: u32, publish: Publish) -> (Self, Box<dyn EvalObserver>) {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let obs = Observer {
            name: format!("l_out-{layer}"),
            layer,
            shared: shared.clone(),
            publish: Arc::clone(&publish),
        };
        (
            Self {
                layer,
                shared,
                publish,
            },
            Box::new(obs),
        )
    }

    /// The exit layer.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decide with `decide` in the next decode; prune if `apply`, else only
    /// record the decision (every row is computed).
    pub fn arm(&self, decide: Decide, apply: bool) {
        let mut s = self.lock();
        s.decide = Some(decide);
        s.apply = apply;
        s.kept = None;
        s.seconds = 0.0;
    }

    /// After the decode: drop the mask and the decision if the decode did not reach the
    /// exit layer, and return which rows went on (`None`: all of them) and the seconds the
    /// decision took.
    pub fn disarm(&self) -> (Option<Vec<bool>>, f64) {
        (self.publish)(None);
        let mut s = self.lock();
        s.decide = None;
        (s.kept.take(), s.seconds)
    }
}

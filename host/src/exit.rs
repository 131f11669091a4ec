//! Early exit inside a verification call (Lever §4.3) without patching llama.cpp.
//!
//! llama.cpp cannot run a graph from layer L on, so Leap prunes rows where the work is: an
//! eval-callback observer ([`Exit`]) reads every row's hidden state `l_out-L` while the graph
//! computes, asks the engine which rows go on, and publishes the answer as a row mask
//! ([`rows_kept`]) on the decoding thread. Leap's ggml device, which computes the layers'
//! matrix products for small batches, then skips the pruned rows in every product of a
//! layer after L (their outputs are zeros). Nothing else changes:
//!
//! - a kept row attends only to its ancestors in the token tree, and the engine keeps every
//!   ancestor of a kept row, so kept rows never read what a pruned row wrote to the KV cache;
//! - pruned rows get no logits (the engine never projects them) and their cells are removed
//!   with the rest of the rejected tree.
//!
//! The mask is thread-local: ggml's scheduler calls the eval callback and the device's
//! compute on the thread that called `llama_decode`, so contexts decoding on other threads
//! never see it.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use crate::eval::{EvalObserver, TensorView};

/// Which rows of the current call continue past layer `layer`.
#[derive(Debug, Clone)]
struct Mask {
    layer: u32,
    keep: Vec<bool>,
}

thread_local! {
    static MASK: RefCell<Option<Mask>> = const { RefCell::new(None) };
}

/// For a matrix product with the weight named `weight` (`blk.N.…`) over `n_rows` rows computed
/// on this thread: which rows to compute (`None`: all). Only products of layers after the
/// exit layer, over exactly the rows of the masked call, are masked; without a mask the name
/// is not even parsed.
pub fn rows_kept(weight: &str, n_rows: usize) -> Option<Vec<bool>> {
    MASK.with(|m| {
        let m = m.borrow();
        let m = m.as_ref().filter(|m| m.keep.len() == n_rows)?;
        (layer_of(weight)? > m.layer).then(|| m.keep.clone())
    })
}

/// The layer of a weight tensor named `blk.N.…` (llama.cpp's naming).
pub fn layer_of(weight_name: &str) -> Option<u32> {
    let rest = weight_name.strip_prefix("blk.")?;
    rest[..rest.find('.')?].parse().ok()
}

fn set_mask(mask: Option<Mask>) {
    MASK.with(|m| *m.borrow_mut() = mask);
}

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
            set_mask(Some(Mask {
                layer: self.layer,
                keep: k.clone(),
            }));
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
    /// An exit at layer `layer` (after its output `l_out-{layer}`), and the observer to put
    /// on the context (with [`crate::Context::with_observer`], in a [`crate::Chain`] with
    /// others).
    pub fn new(layer: u32) -> (Self, Box<dyn EvalObserver>) {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let obs = Observer {
            name: format!("l_out-{layer}"),
            layer,
            shared: shared.clone(),
        };
        (Self { layer, shared }, Box::new(obs))
    }

    /// The exit layer.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decide with `decide` in the next decode on this thread; prune if `apply`, else only
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
        set_mask(None);
        let mut s = self.lock();
        s.decide = None;
        (s.kept.take(), s.seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_names_give_their_layer() {
        assert_eq!(layer_of("blk.12.ffn_up.weight"), Some(12));
        assert_eq!(layer_of("blk.0.attn_q.weight"), Some(0));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn the_mask_covers_later_layers_of_the_same_call_on_this_thread_only() {
        const L4: &str = "blk.4.ffn_up.weight";
        const L5: &str = "blk.5.attn_q.weight";
        set_mask(Some(Mask {
            layer: 4,
            keep: vec![true, false, true],
        }));
        assert_eq!(rows_kept(L5, 3), Some(vec![true, false, true]));
        assert_eq!(
            rows_kept(L4, 3),
            None,
            "the exit layer itself runs every row"
        );
        assert_eq!(rows_kept(L5, 4), None, "another call's shape");
        assert_eq!(rows_kept("output.weight", 3), None, "not a layer's weight");
        std::thread::spawn(|| assert_eq!(rows_kept(L5, 3), None))
            .join()
            .unwrap();
        let (exit, _obs) = Exit::new(4);
        assert_eq!(exit.disarm().0, None);
        assert_eq!(rows_kept(L5, 3), None, "disarm clears the mask");
    }
}

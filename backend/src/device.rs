//! The device as an object: what one llama.cpp context's Leap backends do ([`DeviceConfig`])
//! and what they counted, owned by those backends rather than by the process.
//!
//! ggml's scheduler asks a *device* whether it takes a node (`supports_op` gets the device,
//! not the backend instance), so every backend instance the plugin makes gets a device object
//! of its own: a copy of the registered device whose context is the instance's state. A node
//! is then claimed, and computed, under the settings of the context whose graph it is in:
//!
//! - a host that knows Leap makes a [`Device`] from its settings and creates its llama.cpp
//!   context inside [`Device::bind`]; the backends made for that context share the device's
//!   state ([`Instance`]), which the host keeps reading (counters) and steering (the early
//!   exit's row mask, profiling) through the handle;
//! - a context created outside `bind` (an unmodified llama.cpp that loaded the plugin, or
//!   llama.cpp built with `LLAMA_LEAP=ON`) gets a fresh state with the process's default
//!   settings ([`use_by_default`], from [`crate::configure_from_env`] in the plugin).
//!
//! So two models (or two contexts) with different settings in one process each keep their
//! own. A context's settings are fixed when it is made; what changes between decodes (the
//! early exit's mask, capture, ablation) is the context's own too.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::attn::{self, Ablation, Captured, Sparse, Stats};

/// What Leap's device does for a context.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Let the device claim work (default). `false`: the context computes as llama.cpp alone
    /// would (the baselines in `leap bench`).
    pub kernels: bool,
    /// Let the device take the output projection (`result_output`) too. Off by default:
    /// Leap's own engine projects on demand and stops the graph at the hidden states, which
    /// only works while the projection sits in ggml's split. A host that computes every row's
    /// logits itself (llama.cpp with `--spec-type leap`) gains from it: a verified draft row
    /// then costs the device's small-batch product instead of a ggml dot product per
    /// vocabulary row, and the row's logits are still exactly what ggml computes for the row
    /// alone.
    pub take_output: bool,
    /// Sparse attention (with these settings) or none: the device then leaves attention and
    /// the cache writes to ggml. Contexts must use flash attention for the device to see
    /// attention at all.
    pub sparse: Option<Sparse>,
    /// Profiling: the device takes every flash-attention node (dense unless sparse attention
    /// is on), so that [`Device::ablate`] reaches every layer. Affects graphs built afterwards.
    pub take_all: bool,
    /// Dense flash attention's calls of 1 to 63 query rows (decoding, verification, a prompt's
    /// last rows) computed row by row as ggml computes a lone row ([`crate::lone`]), so that a
    /// verification row rounds as plain decoding's row with flash attention on. Off by
    /// default: an unmodified llama.cpp's automatic flash attention (`auto`) wants the node on
    /// the layer's own device and turns flash attention off when the device takes it.
    /// `leap_backend_register` (the C API call of llama.cpp with Leap's patches, whose
    /// patches/0003 keeps `auto` on) turns it on.
    pub lone_attention: bool,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            kernels: true,
            take_output: false,
            sparse: None,
            take_all: false,
            lone_attention: false,
        }
    }
}

impl DeviceConfig {
    /// llama.cpp alone: the device claims nothing.
    pub fn off() -> Self {
        Self {
            kernels: false,
            ..Self::default()
        }
    }
}

/// The rows of the current call that continue past `layer` (an early exit, Lever §4.3): the
/// device skips the others in every matrix product of a later layer.
#[derive(Debug, Clone)]
pub(crate) struct ExitMask {
    pub layer: u32,
    pub keep: Vec<bool>,
}

/// What kind of work a node the device computed was, for [`Device::start_timing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    /// Matrix products over quantized weights.
    Weights,
    /// Attention's f16 products over the KV cache (`kq`, `kqv`).
    Attention,
    /// Flash attention (dense, lone-row or sparse).
    FlashAttention,
    /// Attention's softmax.
    Softmax,
    /// Gated linear units.
    Glu,
    /// Writes into the KV cache (`SET_ROWS`).
    CacheWrites,
    /// The small ops between them: RMS norms, multiplies, adds, scales, RoPE, copies.
    RowOps,
}

impl OpClass {
    /// How many classes there are.
    pub const COUNT: usize = 7;

    /// Every class, in [`OpTimes`]'s order.
    pub const ALL: [OpClass; OpClass::COUNT] = [
        OpClass::Weights,
        OpClass::Attention,
        OpClass::FlashAttention,
        OpClass::Softmax,
        OpClass::Glu,
        OpClass::CacheWrites,
        OpClass::RowOps,
    ];

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Weights => "weights",
            OpClass::Attention => "attention",
            OpClass::FlashAttention => "flash attn",
            OpClass::Softmax => "softmax",
            OpClass::Glu => "glu",
            OpClass::CacheWrites => "cache writes",
            OpClass::RowOps => "norms, rope",
        }
    }
}

/// Wall time the device spent on each [`OpClass`] of nodes, and how many nodes, since
/// [`Device::start_timing`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTimes {
    /// Seconds per class, in [`OpClass::ALL`]'s order.
    pub seconds: [f64; OpClass::COUNT],
    /// Nodes per class.
    pub nodes: [u64; OpClass::COUNT],
}

impl OpTimes {
    /// Seconds of `class`.
    pub fn of(&self, class: OpClass) -> f64 {
        self.seconds[class as usize]
    }

    /// A node of `class` that took `seconds`.
    pub(crate) fn add(&mut self, class: OpClass, seconds: f64) {
        self.seconds[class as usize] += seconds;
        self.nodes[class as usize] += 1;
    }

    /// `other`'s nodes and times added to these.
    fn add_all(&mut self, other: &OpTimes) {
        for c in OpClass::ALL {
            self.seconds[c as usize] += other.seconds[c as usize];
            self.nodes[c as usize] += other.nodes[c as usize];
        }
    }
}

/// One context's device state, shared by its backends (`leap-cpu` and, with OpenCL,
/// `leap-opencl`) and by the host's [`Device`] handle.
#[derive(Debug, Default)]
pub(crate) struct Instance {
    /// Fixed when the device is made.
    config: DeviceConfig,
    /// Threads for the device's kernels (ggml's `set_n_threads`, per decode).
    pub threads: AtomicUsize,
    /// Nodes computed.
    calls: AtomicU64,
    /// Batch rows of matrix products skipped for an early exit.
    skipped: AtomicU64,
    exit: Mutex<Option<ExitMask>>,
    ablation: Mutex<Option<Ablation>>,
    /// Flash-attention nodes copied while capturing ([`Device::start_capture`]).
    capture: Mutex<Option<Vec<Captured>>>,
    stats: Mutex<Stats>,
    /// Whether nodes are timed ([`Device::start_timing`]); read once per graph.
    timing: AtomicBool,
    times: Mutex<OpTimes>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Instance {
    fn new(config: DeviceConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The settings.
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// A node computed (and the early exit's rows it skipped).
    pub fn counted(&self, skipped_rows: u64) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        TOTALS.nodes.fetch_add(1, Ordering::Relaxed);
        if skipped_rows > 0 {
            self.skipped.fetch_add(skipped_rows, Ordering::Relaxed);
        }
    }

    /// The early exit's rows for a matrix product over `n_rows` rows whose weight's layer
    /// `layer` gives (`None`: all): only layers after the exit layer, over exactly the masked
    /// call's rows. Without a mask the layer is not asked for.
    pub fn rows_kept(
        &self,
        n_rows: usize,
        layer: impl FnOnce() -> Option<u32>,
    ) -> Option<Vec<bool>> {
        let m = lock(&self.exit);
        let m = m.as_ref().filter(|m| m.keep.len() == n_rows)?;
        (layer()? > m.layer).then(|| m.keep.clone())
    }

    pub fn ablation(&self) -> Option<Ablation> {
        *lock(&self.ablation)
    }

    pub fn capturing(&self) -> bool {
        lock(&self.capture).is_some()
    }

    /// Keep `c` if capturing; else hand it back.
    pub fn capture(&self, c: Captured) -> Option<Captured> {
        match lock(&self.capture).as_mut() {
            Some(list) => {
                list.push(c);
                None
            }
            None => Some(c),
        }
    }

    pub fn add_stats(&self, st: &Stats) {
        lock(&self.stats).add(st);
    }

    /// Whether the device times its nodes ([`Device::start_timing`]).
    pub fn timing(&self) -> bool {
        self.timing.load(Ordering::Relaxed)
    }

    /// A graph's node times, added to the context's.
    pub fn add_times(&self, t: &OpTimes) {
        lock(&self.times).add_all(t);
    }
}

/// A context's device: its settings and what it did. Cheap to clone (a shared handle).
#[derive(Clone, Debug)]
pub struct Device(Arc<Instance>);

thread_local! {
    /// The device whose state backends made on this thread take ([`Device::bind`]): llama.cpp
    /// initialises a context's backends on the thread that creates it.
    static BOUND: RefCell<Option<Arc<Instance>>> = const { RefCell::new(None) };
}

/// What the process chose before contexts exist.
struct Setup {
    /// Settings for contexts created outside [`Device::bind`]; `None`:
    /// [`DeviceConfig::default`].
    defaults: Option<DeviceConfig>,
    /// The `leap-opencl` device is wanted in the registry ([`crate::want_opencl`]).
    opencl: bool,
}

static SETUP: RwLock<Setup> = RwLock::new(Setup {
    defaults: None,
    opencl: false,
});

fn setup() -> std::sync::RwLockReadGuard<'static, Setup> {
    SETUP.read().unwrap_or_else(|e| e.into_inner())
}

fn setup_mut() -> std::sync::RwLockWriteGuard<'static, Setup> {
    SETUP.write().unwrap_or_else(|e| e.into_inner())
}

/// The settings of contexts created outside [`Device::bind`] from now on (a host that knows
/// nothing of Leap: the plugin, llama.cpp with `LLAMA_LEAP=ON`). Contexts that exist keep
/// theirs.
pub fn use_by_default(config: DeviceConfig) {
    prepare(&config);
    setup_mut().defaults = Some(config);
}

/// The settings of contexts created outside [`Device::bind`].
pub fn defaults() -> DeviceConfig {
    setup().defaults.clone().unwrap_or_default()
}

pub(crate) fn want_opencl() {
    setup_mut().opencl = true;
}

pub(crate) fn opencl_wanted() -> bool {
    setup().opencl
}

/// What every context's devices did, since the process started (`LEAP_STATS`, the plugin's
/// `leap_total_calls`).
pub(crate) struct Totals {
    /// Graph nodes computed.
    pub nodes: AtomicU64,
    /// Estimates run on OpenCL.
    pub opencl_estimates: AtomicU64,
    /// Batch rows of products over repacked `Q4_K` weights (`crate::matmul`).
    pub repacked_rows: AtomicU64,
    /// Sparse attention's.
    pub attn: Mutex<Stats>,
}

impl Totals {
    pub fn add_attn(&self, st: &Stats) {
        lock(&self.attn).add(st);
    }
}

pub(crate) static TOTALS: Totals = Totals {
    nodes: AtomicU64::new(0),
    opencl_estimates: AtomicU64::new(0),
    repacked_rows: AtomicU64::new(0),
    attn: Mutex::new(Stats::ZERO),
};

/// What settings need before a node runs under them: QNN loaded when wanted, so that a
/// missing library is reported at once.
fn prepare(config: &DeviceConfig) {
    if let Some(s) = &config.sparse {
        if s.estimate_on == attn::EstimateOn::Cpu {
            crate::qnn::use_for(s.qnn);
        }
    }
}

/// The state for a backend being made now: the bound device's, or a fresh one with the
/// default settings.
pub(crate) fn for_new_backend() -> Arc<Instance> {
    BOUND
        .with(|b| b.borrow().clone())
        .unwrap_or_else(|| Arc::new(Instance::new(defaults())))
}

impl Device {
    /// A device with these settings, for the contexts created in [`Device::bind`].
    pub fn new(config: DeviceConfig) -> Self {
        prepare(&config);
        Self(Arc::new(Instance::new(config)))
    }

    /// Run `create` (which creates llama.cpp contexts on this thread) with this device's
    /// state given to every Leap backend made meanwhile.
    pub fn bind<R>(&self, create: impl FnOnce() -> R) -> R {
        struct Unbind(Option<Arc<Instance>>);
        impl Drop for Unbind {
            fn drop(&mut self) {
                let prev = self.0.take();
                BOUND.with(|b| *b.borrow_mut() = prev);
            }
        }
        let prev = BOUND.with(|b| b.borrow_mut().replace(Arc::clone(&self.0)));
        let _unbind = Unbind(prev);
        create()
    }

    /// The settings (fixed when the device is made).
    pub fn config(&self) -> &DeviceConfig {
        self.0.config()
    }

    /// Nodes the device computed for this context.
    pub fn calls(&self) -> u64 {
        self.0.calls.load(Ordering::Relaxed)
    }

    /// Rows of matrix products skipped for early exits (a row of one product each).
    pub fn skipped_rows(&self) -> u64 {
        self.0.skipped.load(Ordering::Relaxed)
    }

    /// What sparse attention did in this context.
    pub fn attn_stats(&self) -> Stats {
        *lock(&self.0.stats)
    }

    /// The early exit's decision for the current call: rows past `layer` are computed only
    /// where `keep` says so (`None`: every row, the mask cleared).
    pub fn exit_mask(&self, mask: Option<(u32, Vec<bool>)>) {
        *lock(&self.0.exit) = mask.map(|(layer, keep)| ExitMask { layer, keep });
    }

    /// Zero a head's or a layer's attention output in the nodes computed from now on (the
    /// device must take them: [`DeviceConfig::take_all`]).
    pub fn ablate(&self, a: Option<Ablation>) {
        *lock(&self.0.ablation) = a;
    }

    /// Capture the flash-attention nodes of the decodes that follow (graphs built from now
    /// on): the device takes them, copies their operands and computes them densely.
    pub fn start_capture(&self) {
        *lock(&self.0.capture) = Some(Vec::new());
    }

    /// Stop capturing; the nodes captured since [`Device::start_capture`].
    pub fn take_capture(&self) -> Vec<Captured> {
        lock(&self.0.capture).take().unwrap_or_default()
    }

    /// Time every node the device computes from now on, by [`OpClass`] (a clock read per
    /// node; off by default), from zero.
    pub fn start_timing(&self) {
        *lock(&self.0.times) = OpTimes::default();
        self.0.timing.store(true, Ordering::Relaxed);
    }

    /// Stop timing; the times since [`Device::start_timing`].
    pub fn take_timing(&self) -> OpTimes {
        self.0.timing.store(false, Ordering::Relaxed);
        std::mem::take(&mut *lock(&self.0.times))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_made_inside_bind_share_its_state_and_others_get_the_defaults() {
        let a = Device::new(DeviceConfig::off());
        let inside = a.bind(for_new_backend);
        assert!(Arc::ptr_eq(&inside, &a.0));
        let b = Device::new(DeviceConfig::default());
        let nested = a.bind(|| b.bind(for_new_backend));
        assert!(Arc::ptr_eq(&nested, &b.0), "the innermost bind wins");
        assert!(
            Arc::ptr_eq(&a.bind(for_new_backend), &a.0),
            "and is undone after"
        );
        let outside = for_new_backend();
        assert!(!Arc::ptr_eq(&outside, &a.0) && !Arc::ptr_eq(&outside, &b.0));
        assert!(outside.config().kernels, "the default settings");
        std::thread::spawn(move || {
            let other = a.bind(|| std::thread::spawn(for_new_backend).join().unwrap());
            assert!(!Arc::ptr_eq(&other, &a.0), "bind covers this thread only");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_exit_mask_covers_later_layers_of_the_same_call_only() {
        let d = Device::new(DeviceConfig::default());
        d.exit_mask(Some((4, vec![true, false, true])));
        assert_eq!(d.0.rows_kept(3, || Some(5)), Some(vec![true, false, true]));
        assert_eq!(
            d.0.rows_kept(3, || Some(4)),
            None,
            "the exit layer runs every row"
        );
        assert_eq!(d.0.rows_kept(4, || Some(5)), None, "another call's shape");
        assert_eq!(d.0.rows_kept(3, || None), None, "not a layer's weight");
        let other = Device::new(DeviceConfig::default());
        assert_eq!(
            other.0.rows_kept(3, || Some(5)),
            None,
            "another context's device"
        );
        d.exit_mask(None);
        assert_eq!(d.0.rows_kept(3, || Some(5)), None, "cleared");
    }
}

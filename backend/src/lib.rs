//! Leap's ggml backend plugin: a device llama.cpp's scheduler registers like its own.
//!
//! What it does: an accelerator (`ACCEL`) device, `leap-cpu`, that claims the quantized
//! matrix products of decoding, speculative verification and prefill (1 to 4096 rows)
//! whose weights are `Q8_0`, `Q5_0`, `Q4_1`, `Q4_K` or `Q6_K` in host memory, and computes them with Leap's
//! weight-stationary kernels ([`leap_host::qdot`]): each weight block is unpacked once for all
//! rows instead of once per row, and every row's result is bit-identical to what ggml's CPU
//! backend computes for that row alone, so speculative output stays token-identical to plain
//! decoding. It also claims attention's two f16 products over the KV cache (without flash
//! attention) in calls of up to 4096 rows ([`kqmm`]): each cache row converted once for every
//! head and row that reads it, with ggml's `vec_dot_f16` arithmetic, the gated feed-forward
//! units (Gemma's GELU, SmolLM2's SwiGLU: [`glu`]), softmax, the KV cache's writes, and the
//! small ops between them (RMS norms, multiplies, adds, scales, RoPE, attention's output
//! copied into rows: `rowops`), each checked bit for bit against the loaded ggml's own op, so
//! that a layer is one split of ggml's scheduler instead of ten. Everything else (other types
//! and ops) stays on ggml's CPU backend.
//!
//! How it plugs in, with an unmodified llama.cpp: [`register`] adds the device to ggml's
//! registry; every llama.cpp context created afterwards initialises an `ACCEL` backend for it
//! (as it does for BLAS) and the scheduler gives it a matrix product when its weights' buffer
//! (ggml's CPU buffer type, which this device accepts) and [`supports_op`](device) agree. Its
//! buffer type *is* the CPU's, so model loading is unchanged. Threads: the same OpenMP team
//! ggml's CPU backend uses (`GOMP_parallel`, found at run time), else scoped threads.
//!
//! With sparse attention on ([`DeviceConfig::sparse`], contexts with flash attention), the device
//! also takes `FLASH_ATTN_EXT` (decode, verification and prefill batches alike, unless
//! [`attn::Sparse::max_rows`] sets a limit; none by default) and the K cache writes that feed
//! its int8 copy of the cache: shadowAttn's estimated top-k attention ([`attn`]). A second
//! device, `leap-opencl` ([`want_opencl`]; feature `opencl`), takes the attention instead
//! when its estimate is to run on OpenCL ([`opencl`]). On a phone with Qualcomm's QNN
//! (feature `qnn`), `leap-cpu`'s estimate runs on the NPU ([`qnn`]).
//!
//! With [`DeviceConfig::lone_attention`] (llama.cpp with Leap's patches turns it on through
//! the C API), flash attention on and no sparse attention, it takes dense `FLASH_ATTN_EXT` of
//! 1 to 63 query rows and computes each row as ggml computes a lone row ([`lone`], checked bit
//! for bit against the loaded ggml), so that a verification row rounds as plain decoding's.
//!
//! Two ways in: [`register`] in-process (what `leap` does), or the cdylib of `backend/plugin`
//! (`libggml_leap.so`), which exports `ggml_backend_init` for an unmodified llama.cpp that
//! loads it through `GGML_BACKEND_PATH`.

pub mod attn;
mod check;
mod device;
mod est;
pub mod f16;
pub mod ffi;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod glu;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod kqmm;
pub mod lone;
mod matmul;
#[cfg(feature = "opencl")]
pub mod opencl;
mod par;
pub mod qnn;
mod rowops;
mod rows;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod softmax;

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use device::Instance;
pub use device::{defaults, use_by_default, Device, DeviceConfig, OpClass, OpTimes};
use ffi as g;

// The interface this code fills in (struct layouts of `ggml-backend-impl.h`): bindgen reads
// the header of the llama.cpp tree being built, and a different version fails the build
// here instead of crashing at run time.
const _: () = assert!(
    g::GGML_BACKEND_API_VERSION == 3,
    "ggml backend API changed: review backend/src/lib.rs against ggml-backend-impl.h"
);

/// Fewest and most rows of a batch the device claims: from one-row decoding (each thread
/// streams a contiguous part of the weights, which made Gemma's one-row call 14% faster than
/// on ggml's kernels: 5.3 against 6.1 ms before its output projection, `hiddentime 1 300` at
/// `29d29c2` against `0495727`) and verification's
/// small batches to prefill's (whose matrix products the kernels also compute faster than
/// one row at a time).
pub const MIN_ROWS: i64 = 1;
/// See [`MIN_ROWS`].
pub const MAX_ROWS: i64 = 4096;

/// The plugin's registry and devices (addresses), made once: ggml's loader requires the same
/// registry from every `ggml_backend_init` call, and ggml's registry owns them for the rest of
/// the process once they are in it.
struct Plugin {
    reg: usize,
    devices: Vec<usize>,
    /// Done once the registry is in ggml's ([`register`]).
    registered: std::sync::Once,
}

static PLUGIN: OnceLock<Plugin> = OnceLock::new();

/// Add the `leap-cpu` device to ggml's backend registry (once per process; later calls do
/// nothing). Contexts created afterwards use it; contexts created before do not.
pub fn register() {
    let reg = registry();
    plugin().registered.call_once(|| {
        // SAFETY: `reg` is a complete, leaked registry whose devices outlive the process.
        unsafe { g::ggml_backend_register(reg) };
        log::info!("registered ggml device leap-cpu (small-batch quantized matrix products, sparse attention)");
    });
}

/// The plugin's registry, for ggml's loader (`ggml_backend_init` of the cdylib) or
/// [`register`]. Created on first use; the same pointer every time.
pub fn registry() -> g::ggml_backend_reg_t {
    plugin().reg as g::ggml_backend_reg_t
}

fn plugin() -> &'static Plugin {
    PLUGIN.get_or_init(|| {
        // SAFETY: ggml_cpu_init is idempotent (the kernels' type traits need it).
        unsafe { g::ggml_cpu_init() };
        let reg = Box::into_raw(Box::new(g::ggml_backend_reg {
            api_version: g::GGML_BACKEND_API_VERSION as i32,
            iface: g::ggml_backend_reg_i {
                get_name: Some(reg_name),
                get_device_count: Some(reg_device_count),
                get_device: Some(reg_device),
                get_proc_address: Some(reg_proc_address),
            },
            context: std::ptr::null_mut(),
        }));
        let device = |kind: &'static DevCtx| {
            Box::into_raw(Box::new(g::ggml_backend_device {
                iface: g::ggml_backend_device_i {
                    get_name: Some(dev_name),
                    get_description: Some(dev_description),
                    get_memory: Some(dev_memory),
                    get_type: Some(dev_type),
                    get_props: Some(dev_props),
                    init_backend: Some(dev_init_backend),
                    get_buffer_type: Some(dev_buffer_type),
                    get_host_buffer_type: None,
                    buffer_from_host_ptr: None,
                    supports_op: Some(dev_supports_op),
                    supports_buft: Some(dev_supports_buft),
                    offload_op: None,
                    event_new: None,
                    event_free: None,
                    event_synchronize: None,
                },
                reg,
                context: kind as *const DevCtx as *mut c_void,
            }))
        };
        static CPU: DevCtx = DevCtx {
            kind: Kind::Cpu,
            inst: None,
        };
        static OPENCL: DevCtx = DevCtx {
            kind: Kind::OpenCl,
            inst: None,
        };
        let mut devices = vec![device(&CPU)];
        if device::opencl_wanted() && opencl_available() {
            devices.push(device(&OPENCL));
        }
        let devices: &'static [g::ggml_backend_dev_t] = Box::leak(devices.into_boxed_slice());
        // SAFETY: leaked above, not shared yet; the registry's context is its device list.
        unsafe {
            (*reg).context =
                (devices as *const [g::ggml_backend_dev_t]).cast::<Devices>() as *mut c_void
        };
        Plugin {
            reg: reg as usize,
            devices: devices.iter().map(|&d| d as usize).collect(),
            registered: std::sync::Once::new(),
        }
    })
}

/// With `LEAP_STATS=1` (not `0`, `off` or empty), print at exit how many graph nodes
/// `leap-cpu` computed, how many of them were attention, how many query rows attended
/// sparsely: `WHO: leap-cpu computed N nodes (A attention nodes, S query rows sparse)`, the
/// way to see on any CPU that the device ran; and, where it computed any ([`lone`]), `WHO:
/// leap-cpu computed L flash-attention query rows as ggml computes a lone row` (and `R batch
/// rows over repacked Q4_K weights` likewise, [`matmul`]). Once per process (the first `who`
/// wins).
pub fn stats_at_exit_from_env(who: &'static str) {
    static WHO: OnceLock<&'static str> = OnceLock::new();
    extern "C" fn report() {
        // Nothing may unwind out of an exit handler.
        let _ = std::panic::catch_unwind(|| {
            let a = attn::stats();
            eprintln!(
                "{}: leap-cpu computed {} nodes ({} attention nodes, {} query rows sparse)",
                WHO.get().copied().unwrap_or("leap"),
                total_calls(),
                a.nodes,
                a.sparse_rows
            );
            let repacked = device::TOTALS.repacked_rows.load(Ordering::Relaxed);
            if repacked > 0 {
                eprintln!(
                    "{}: leap-cpu computed {repacked} batch rows over repacked Q4_K weights as ggml computes a lone row",
                    WHO.get().copied().unwrap_or("leap"),
                );
            }
            let lone = lone::rows_computed();
            if lone > 0 {
                eprintln!(
                    "{}: leap-cpu computed {lone} flash-attention query rows as ggml computes a lone row",
                    WHO.get().copied().unwrap_or("leap"),
                );
            }
        });
    }
    if std::env::var("LEAP_STATS").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "off")) {
        // SAFETY: `report` is a plain function that stays valid as long as this library
        // (glibc runs a library's exit handlers when it is unloaded, too).
        if WHO.set(who).is_ok() {
            unsafe { libc::atexit(report) };
        }
    }
}

/// The device's settings from the environment, for a host that knows nothing of Leap (ggml's
/// plugin loader, or llama.cpp built with `LLAMA_LEAP=ON`), starting from `base`; `who`
/// prefixes what it prints. The caller gives them to contexts created afterwards
/// ([`use_by_default`]). The variables: `LEAP_KERNELS` (`on`, `off`), `LEAP_SPARSE` (`off` or
/// the fraction of keys a query attends), `LEAP_ESTIMATE` (`cpu`, `opencl`: asks for the
/// `leap-opencl` device, [`want_opencl`]), `LEAP_OUTPUT` (`device` or `ggml`: who computes the
/// output projection, [`DeviceConfig::take_output`]; unset, as `base` says), and `LEAP_STATS`
/// ([`stats_at_exit_from_env`]). `LEAP_QNN` is read where the estimate starts.
pub fn configure_from_env(who: &'static str, base: DeviceConfig) -> DeviceConfig {
    stats_at_exit_from_env(who);
    let mut cfg = base;
    if let Ok(v) = std::env::var("LEAP_KERNELS") {
        cfg.kernels = !matches!(v.trim(), "off" | "0" | "false");
    }
    match std::env::var("LEAP_OUTPUT").as_deref().map(str::trim) {
        Ok("device") => cfg.take_output = true,
        Ok("ggml") => cfg.take_output = false,
        Ok("") | Err(_) => {}
        Ok(v) => eprintln!("{who}: LEAP_OUTPUT must be device or ggml, not {v:?}; ignored"),
    }
    let estimate_on = match std::env::var("LEAP_ESTIMATE").as_deref().map(str::trim) {
        Ok("opencl") => {
            want_opencl();
            attn::EstimateOn::OpenCl
        }
        Ok("") | Ok("cpu") | Err(_) => attn::EstimateOn::Cpu,
        Ok(v) => {
            eprintln!("{who}: LEAP_ESTIMATE must be cpu or opencl, not {v:?}; using cpu");
            attn::EstimateOn::Cpu
        }
    };
    match std::env::var("LEAP_SPARSE").as_deref().map(str::trim) {
        Ok("") | Ok("off") | Ok("0") | Err(_) => {}
        Ok(v) => match v.parse::<f32>() {
            Ok(keep) if keep > 0.0 && keep <= 1.0 => {
                cfg.sparse = Some(attn::Sparse {
                    keep,
                    estimate_on,
                    ..attn::Sparse::default()
                })
            }
            _ => eprintln!(
                "{who}: LEAP_SPARSE must be off or a fraction in (0, 1], not {v:?}; sparse attention stays off"
            ),
        },
    }
    cfg
}

/// Whether [`register`] has run.
pub fn registered() -> bool {
    PLUGIN.get().is_some_and(|p| p.registered.is_completed())
}

/// Nodes the device has computed in this process.
pub fn total_calls() -> u64 {
    device::TOTALS.nodes.load(Ordering::Relaxed)
}

/// The device's name in ggml's registry (`--list-devices`, `GGML_SCHED_DEBUG`).
pub const DEVICE_NAME: &str = "leap-cpu";
/// The OpenCL device's name.
pub const OPENCL_DEVICE_NAME: &str = "leap-opencl";
const NAME: &CStr = c"leap-cpu";
const DESCRIPTION: &CStr = c"Leap CPU: small-batch quantized matrix products, sparse attention";
const CL_NAME: &CStr = c"leap-opencl";
const CL_DESCRIPTION: &CStr = c"Leap OpenCL: sparse attention's estimate on an OpenCL device";

/// Run an `extern "C"` entry point's body; a panic (a bug) must not unwind into C: it is
/// logged and `fallback` returned.
fn guard<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log::error!("leap-cpu: panic in {what}");
        fallback
    })
}

/// `leap_total_calls`, reachable through the registry's `get_proc_address` (a program that
/// loaded the plugin as a `.so` asks it whether the device did anything).
unsafe extern "C" fn proc_total_calls() -> u64 {
    total_calls()
}

unsafe extern "C" fn reg_name(_: g::ggml_backend_reg_t) -> *const c_char {
    NAME.as_ptr()
}

/// Marker type of the registry context (the device list, see [`Plugin`]).
enum Devices {}

unsafe extern "C" fn reg_device_count(_: g::ggml_backend_reg_t) -> usize {
    PLUGIN.get().map_or(0, |p| p.devices.len())
}

unsafe extern "C" fn reg_device(_: g::ggml_backend_reg_t, i: usize) -> g::ggml_backend_dev_t {
    PLUGIN
        .get()
        .and_then(|p| p.devices.get(i))
        .map_or(std::ptr::null_mut(), |&p| p as g::ggml_backend_dev_t)
}

/// Which of the plugin's devices a `ggml_backend_device` is, and for a backend instance's own
/// device object ([`device`]), its context's state.
struct DevCtx {
    kind: Kind,
    /// `None`: a device of the registry itself (its settings: [`defaults`]).
    inst: Option<Arc<Instance>>,
}

/// See [`DevCtx`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `leap-cpu`: small-batch matrix products, K cache writes, attention estimated on the
    /// CPU.
    Cpu,
    /// `leap-opencl`: attention whose estimate runs on an OpenCL device.
    OpenCl,
}

/// # Safety
/// `dev` is one of the plugin's devices (the registry's, or a backend instance's own).
unsafe fn dev_ctx<'a>(dev: g::ggml_backend_dev_t) -> &'a DevCtx {
    &*((*dev).context as *const DevCtx)
}

unsafe fn kind<'a>(dev: g::ggml_backend_dev_t) -> &'a Kind {
    &dev_ctx(dev).kind
}

/// Ask for the `leap-opencl` device; call before [`register`] / [`registry`] (setting OpenCL
/// up compiles its kernels, which takes a moment, so a run that does not use it skips it).
pub fn want_opencl() {
    device::want_opencl();
}

/// Whether the `leap-opencl` device is in the registry.
pub fn opencl_registered() -> bool {
    PLUGIN.get().is_some_and(|p| p.devices.len() > 1)
}

/// Why `leap-opencl` is not available (empty if it is).
pub fn opencl_unavailable_reason() -> String {
    #[cfg(feature = "opencl")]
    {
        opencl::estimator().err().unwrap_or("").to_string()
    }
    #[cfg(not(feature = "opencl"))]
    {
        "built without the opencl feature".into()
    }
}

/// Whether an OpenCL device with Leap's kernels is usable here (the `leap-opencl` device is
/// registered only then, and only if [`want_opencl`] was called; the debug log says why not).
pub fn opencl_available() -> bool {
    #[cfg(feature = "opencl")]
    {
        opencl::estimator().is_ok()
    }
    #[cfg(not(feature = "opencl"))]
    {
        false
    }
}

unsafe extern "C" fn set_n_threads(b: g::ggml_backend_t, n: i32) {
    // ggml finds this through the registry and may call it for another registry's backend.
    if !b.is_null() && !(*b).guid.is_null() && *(*b).guid.cast::<[u8; 16]>() == GUID {
        backend_inst(b)
            .threads
            .store(n.max(1) as usize, Ordering::Relaxed);
    }
}

unsafe extern "C" fn reg_proc_address(
    _: g::ggml_backend_reg_t,
    name: *const c_char,
) -> *mut c_void {
    if name.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: ggml passes a NUL-terminated name.
    match CStr::from_ptr(name).to_bytes() {
        b"ggml_backend_set_n_threads" => {
            let f: unsafe extern "C" fn(g::ggml_backend_t, i32) = set_n_threads;
            f as *mut c_void
        }
        b"leap_total_calls" => {
            let f: unsafe extern "C" fn() -> u64 = proc_total_calls;
            f as *mut c_void
        }
        _ => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn dev_name(dev: g::ggml_backend_dev_t) -> *const c_char {
    match kind(dev) {
        Kind::Cpu => NAME.as_ptr(),
        Kind::OpenCl => CL_NAME.as_ptr(),
    }
}

unsafe extern "C" fn dev_description(dev: g::ggml_backend_dev_t) -> *const c_char {
    match kind(dev) {
        Kind::Cpu => DESCRIPTION.as_ptr(),
        Kind::OpenCl => CL_DESCRIPTION.as_ptr(),
    }
}

unsafe extern "C" fn dev_memory(_: g::ggml_backend_dev_t, free: *mut usize, total: *mut usize) {
    // Host memory: the device allocates nothing of its own.
    *free = 0;
    *total = 0;
}

unsafe extern "C" fn dev_type(_: g::ggml_backend_dev_t) -> g::ggml_backend_dev_type {
    g::GGML_BACKEND_DEVICE_TYPE_ACCEL
}

unsafe extern "C" fn dev_props(dev: g::ggml_backend_dev_t, props: *mut g::ggml_backend_dev_props) {
    let p = &mut *props;
    p.name = dev_name(dev);
    p.description = dev_description(dev);
    p.memory_free = 0;
    p.memory_total = 0;
    p.type_ = dev_type(dev);
    p.device_id = std::ptr::null();
    p.caps = g::ggml_backend_dev_caps {
        async_: false,
        host_buffer: false,
        buffer_from_host_ptr: false,
        events: false,
        mmap_support: false,
    };
}

unsafe extern "C" fn dev_buffer_type(_: g::ggml_backend_dev_t) -> g::ggml_backend_buffer_type_t {
    g::ggml_backend_cpu_buffer_type()
}

unsafe extern "C" fn dev_supports_buft(
    _: g::ggml_backend_dev_t,
    buft: g::ggml_backend_buffer_type_t,
) -> bool {
    // Repacked weights too: the device reads repacked `Q4_K` (`matmul::supports`).
    g::ggml_backend_buft_is_host(buft) || matmul::is_repack_buft(buft)
}

unsafe extern "C" fn dev_supports_op(
    dev: g::ggml_backend_dev_t,
    op: *const g::ggml_tensor,
) -> bool {
    if op.is_null() {
        return false;
    }
    // SAFETY: ggml passes a valid node.
    let op = &*op;
    let ctx = dev_ctx(dev);
    guard("supports_op", false, || match &ctx.inst {
        Some(inst) => supports(&ctx.kind, op, inst.config(), Some(inst)),
        None => supports(&ctx.kind, op, &defaults(), None),
    })
}

/// Whether a device of `kind` takes `op` under `cfg`, for the context of `inst` (`None`: a
/// device of the registry).
fn supports(
    kind: &Kind,
    op: &g::ggml_tensor,
    cfg: &DeviceConfig,
    inst: Option<&Arc<Instance>>,
) -> bool {
    if !cfg.kernels {
        return false;
    }
    let on_opencl = || {
        cfg.sparse
            .as_ref()
            .is_some_and(|s| s.estimate_on == attn::EstimateOn::OpenCl)
    };
    let fa = || attn::supports_fa(op, cfg, inst.is_some_and(|i| i.capturing()));
    match (kind, op.op) {
        // Attention's f16 products and Gemma's GELU unit have x86-64 and AArch64 kernels only.
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        (Kind::Cpu, g::GGML_OP_MUL_MAT) => {
            matmul::supports(op, cfg.take_output) || kqmm::supports(op)
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        (Kind::Cpu, g::GGML_OP_MUL_MAT) => matmul::supports(op, cfg.take_output),
        (Kind::Cpu, g::GGML_OP_SET_ROWS) => attn::supports_set_rows(op, cfg) || rows::supports(op),
        (
            Kind::Cpu,
            g::GGML_OP_RMS_NORM
            | g::GGML_OP_MUL
            | g::GGML_OP_ADD
            | g::GGML_OP_SCALE
            | g::GGML_OP_CONT
            | g::GGML_OP_ROPE,
        ) => rowops::supports(op, cfg.take_output),
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        (Kind::Cpu, g::GGML_OP_GLU) => glu::supports(op),
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        (Kind::Cpu, g::GGML_OP_SOFT_MAX) => softmax::supports(op),
        // Attention goes to the device its estimate runs on.
        (Kind::Cpu, g::GGML_OP_FLASH_ATTN_EXT) => {
            (!on_opencl() && fa()) || lone::supports(op, cfg, inst.is_some_and(|i| i.capturing()))
        }
        (Kind::OpenCl, g::GGML_OP_FLASH_ATTN_EXT) => on_opencl() && fa(),
        _ => false,
    }
}

/// Whether `t`'s name is `name`, compared in place (no `strlen`: asked for graph nodes).
pub(crate) fn named(t: &g::ggml_tensor, name: &[u8]) -> bool {
    let n = name.len();
    // `name` is a NUL-terminated char array inside the tensor.
    t.name.len() > n && t.name[n] == 0 && t.name[..n].iter().zip(name).all(|(&a, &b)| a as u8 == b)
}

/// Pseudo-random values for the kernels' checks against ggml ([`leap_kernels::rng`] from
/// `seed`): each call gives a value in `[-scale / 2, scale / 2)`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn check_values(seed: u64) -> impl FnMut(f32) -> f32 {
    let mut rng = leap_kernels::rng::XorShift::new(seed);
    move |scale| rng.centered() * scale
}

/// The backends' identity (ggml compares its bytes).
const GUID: [u8; 16] = *b"leap-small-batch";

/// A backend instance's own: the device object ggml's scheduler asks about nodes (a copy of
/// the registry's whose context is `ctx`), and its context's state.
struct Owned {
    device: g::ggml_backend_device,
    ctx: DevCtx,
}

/// # Safety
/// `b` is a backend [`dev_init_backend`] made and not yet freed.
unsafe fn backend_inst<'a>(b: g::ggml_backend_t) -> &'a Instance {
    let owned = &*((*b).context as *const Owned);
    owned
        .ctx
        .inst
        .as_deref()
        .expect("a backend instance has its state")
}

unsafe extern "C" fn backend_name(b: g::ggml_backend_t) -> *const c_char {
    dev_name((*b).device)
}

unsafe extern "C" fn backend_free(b: g::ggml_backend_t) {
    let b = Box::from_raw(b.cast::<g::ggml_backend>());
    drop(Box::from_raw(b.context.cast::<Owned>()));
}

unsafe extern "C" fn backend_graph_compute(
    b: g::ggml_backend_t,
    cgraph: *mut g::ggml_cgraph,
) -> g::ggml_status {
    let inst = backend_inst(b);
    let threads = inst.threads.load(Ordering::Relaxed).max(1);
    let timing = inst.timing();
    let mut times = device::OpTimes::default();
    let mut quantized = matmul::Quantized::default();
    let status = guard("graph_compute", g::GGML_STATUS_FAILED, || {
        for i in 0..g::ggml_graph_n_nodes(cgraph) {
            let node = &mut *g::ggml_graph_node(cgraph, i);
            let started = timing.then(std::time::Instant::now);
            // The kind of work, and the batch rows an early exit skipped (matrix products
            // only).
            let (class, skipped) = match node.op {
                g::GGML_OP_NONE
                | g::GGML_OP_VIEW
                | g::GGML_OP_RESHAPE
                | g::GGML_OP_PERMUTE
                | g::GGML_OP_TRANSPOSE => continue,
                g::GGML_OP_MUL_MAT if matmul::supports(node, true) => (
                    OpClass::Weights,
                    matmul::compute(node, threads, inst, &mut quantized),
                ),
                #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                g::GGML_OP_MUL_MAT if kqmm::supports(node) => {
                    let mask = kqmm::mask_of(node, cgraph, i);
                    kqmm::compute(node, threads, mask);
                    (OpClass::Attention, 0)
                }
                #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                g::GGML_OP_GLU => {
                    glu::compute(node, threads);
                    (OpClass::Glu, 0)
                }
                #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                g::GGML_OP_SOFT_MAX => {
                    softmax::compute(node, threads);
                    (OpClass::Softmax, 0)
                }
                g::GGML_OP_FLASH_ATTN_EXT
                    if lone::supports(node, inst.config(), inst.capturing()) =>
                {
                    lone::compute(node, threads);
                    (OpClass::FlashAttention, 0)
                }
                g::GGML_OP_FLASH_ATTN_EXT => {
                    attn::flash_attn(node, threads, inst);
                    (OpClass::FlashAttention, 0)
                }
                g::GGML_OP_SET_ROWS if attn::supports_set_rows(node, inst.config()) => {
                    attn::set_rows(node);
                    (OpClass::CacheWrites, 0)
                }
                g::GGML_OP_SET_ROWS => {
                    rows::compute(node, threads);
                    (OpClass::CacheWrites, 0)
                }
                g::GGML_OP_RMS_NORM
                | g::GGML_OP_MUL
                | g::GGML_OP_ADD
                | g::GGML_OP_SCALE
                | g::GGML_OP_CONT
                | g::GGML_OP_ROPE => {
                    rowops::compute(node, threads);
                    (OpClass::RowOps, 0)
                }
                _ => {
                    log::error!("leap-cpu: asked to compute a node it does not support");
                    return g::GGML_STATUS_FAILED;
                }
            };
            quantized.wrote(node);
            inst.counted(skipped);
            if let Some(t) = started {
                times.add(class, t.elapsed().as_secs_f64());
            }
        }
        g::GGML_STATUS_SUCCESS
    });
    if timing {
        inst.add_times(&times);
    }
    status
}

/// A backend for a new llama.cpp context: with its own device object, and the state of the
/// device bound on this thread ([`Device::bind`]) or a fresh one with the default settings.
unsafe extern "C" fn dev_init_backend(
    dev: g::ggml_backend_dev_t,
    _: *const c_char,
) -> g::ggml_backend_t {
    let owned = Box::into_raw(Box::new(Owned {
        device: std::ptr::read(dev),
        ctx: DevCtx {
            kind: *kind(dev),
            inst: Some(device::for_new_backend()),
        },
    }));
    // The copy's context is the instance's (its address is fixed inside the box).
    (*owned).device.context = std::ptr::addr_of_mut!((*owned).ctx).cast();
    Box::into_raw(Box::new(g::ggml_backend {
        guid: (&GUID as *const [u8; 16]).cast_mut().cast(),
        iface: g::ggml_backend_i {
            get_name: Some(backend_name),
            free: Some(backend_free),
            set_tensor_async: None,
            get_tensor_async: None,
            set_tensor_2d_async: None,
            get_tensor_2d_async: None,
            cpy_tensor_async: None,
            synchronize: None,
            graph_plan_create: None,
            graph_plan_free: None,
            graph_plan_update: None,
            graph_plan_compute: None,
            graph_compute: Some(backend_graph_compute),
            event_record: None,
            event_wait: None,
            graph_optimize: None,
        },
        device: std::ptr::addr_of_mut!((*owned).device),
        context: owned.cast(),
    }))
}

//! Estimated sparse attention (shadowAttn, `../shared/papers/004`, §3) for ggml's
//! `FLASH_ATTN_EXT` on host memory.
//!
//! For every query row and head: a cheap low-precision estimate of `q · k` over all visible
//! keys, the top keys by that estimate (a per-head budget, the first keys and the most recent
//! ones always kept), then exact attention (f32 arithmetic on the f16 cache) over those keys
//! only. A query that sees fewer than [`Sparse::min_keys`] keys attends densely (same code).
//!
//! The estimate reads an int8 shadow of the K cache (ggml's `Q8_0`: a scale per 32 values)
//! instead of the f16 cache: the device takes the cache's `SET_ROWS` writes too (bit-identical
//! to ggml's) and quantizes each new key once, so estimation reads half the bytes of exact
//! attention and runs on int8 dot products. 004 estimates on the NPU with a scale per head
//! (static graphs need fixed scales); a scale per block is as cheap on a CPU and closer. Cells
//! the device did not write (it was off, or the context predates sparse mode) are quantized
//! from the f16 cache the first time a node reads them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::ffi as g;
use crate::par::{parallel, Ptr};
use crate::{est, f16};

/// Sparse-attention settings (see the module docs).
#[derive(Debug, Clone)]
pub struct Sparse {
    /// Fraction of a query's visible keys attended exactly (004: 20%).
    pub keep: f32,
    /// Visible keys below which a query attends densely.
    pub min_keys: usize,
    /// First keys (attention sinks) always kept.
    pub sink: usize,
    /// Most recent keys always kept.
    pub recent: usize,
    /// Query rows above which the device leaves a node to ggml (unlimited by default). Every
    /// row is computed alike whatever its batch only while the device takes every node:
    /// with a limit, a prompt token prefilled in a long batch (ggml, dense) and the same token
    /// in a short one (sparse) attend differently, and speculative decoding, whose prompt
    /// calibration prefills in short chunks, no longer reproduces plain decoding exactly. A
    /// limit suits plain decoding of long prompts: on a CPU the estimate of a long batch is a
    /// full `Q·K` product, about as costly as ggml's tiled dense attention.
    pub max_rows: usize,
    /// Extra candidates (a fraction of the estimated budget) whose exact scores are
    /// computed, so that the estimate's errors near the cut are corrected: the budget's
    /// best by exact score are kept.
    pub refine: f32,
    /// Per layer and head keep fractions from an offline profile (`leap profile-heads`);
    /// [`Sparse::keep`] where it has none.
    pub heads: Option<Arc<HeadProfile>>,
    /// Where the estimate runs (the device that takes attention: `leap-cpu` or
    /// `leap-opencl`).
    pub estimate_on: EstimateOn,
    /// With the estimate on OpenCL, run the head-wise pipeline (004 §3.4: the device
    /// estimates the next head while the CPU attends this one). `None`: when the OpenCL
    /// device is a GPU; on a CPU device (PoCL) the launches cost more than they hide.
    pub pipeline: Option<bool>,
    /// Whether the estimate (on `leap-cpu`) runs on Qualcomm's NPU through QNN ([`crate::qnn`],
    /// feature `qnn`): `None` (default) when its library loads and the platform uses it
    /// (Android; elsewhere only with `LEAP_QNN=on`); `Some(true)` whenever it loads;
    /// `Some(false)` never. Without the library the CPU estimates (a warning says why).
    pub qnn: Option<bool>,
}

/// Where sparse attention's int8 estimate runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EstimateOn {
    /// Leap's SIMD kernels on the CPU (`leap-cpu`).
    #[default]
    Cpu,
    /// An OpenCL device (`leap-opencl`): the GPU of a phone, PoCL here.
    OpenCl,
}

impl std::str::FromStr for EstimateOn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(EstimateOn::Cpu),
            "opencl" => Ok(EstimateOn::OpenCl),
            x => Err(format!("the estimate runs on cpu or opencl, not {x:?}")),
        }
    }
}

impl Default for Sparse {
    fn default() -> Self {
        Self {
            keep: 0.2,
            min_keys: 1024,
            sink: 4,
            recent: 64,
            refine: 0.25,
            max_rows: usize::MAX,
            heads: None,
            estimate_on: EstimateOn::Cpu,
            pipeline: None,
            qnn: None,
        }
    }
}

/// Keep fractions per layer and head.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadProfile {
    /// `layers[il][h]`: the fraction of visible keys head `h` of layer `il` keeps.
    pub layers: Vec<Vec<f32>>,
}

impl Sparse {
    /// The fraction of visible keys head `head` of `layer` keeps.
    pub fn keep_for(&self, layer: Option<usize>, head: usize) -> f32 {
        layer
            .and_then(|il| self.heads.as_ref()?.layers.get(il)?.get(head).copied())
            .unwrap_or(self.keep)
            .clamp(0.0, 1.0)
    }
}

static CONFIG: RwLock<Option<Sparse>> = RwLock::new(None);
/// Bumped whenever the configuration changes: shadows written before may be stale (while the
/// device was off, ggml wrote the cache).
static EPOCH: AtomicU64 = AtomicU64::new(1);

/// Turn sparse attention on (with these settings) or off. Off, the device leaves attention
/// and the cache writes to ggml. Contexts must use flash attention for the device to see
/// attention at all.
pub fn set_sparse(config: Option<Sparse>) {
    if let Some(c) = &config {
        if c.estimate_on == EstimateOn::Cpu {
            // Load QNN now if it is wanted, so that a missing library is reported at once.
            crate::qnn::use_for(c.qnn);
        }
    }
    *CONFIG.write().unwrap_or_else(|e| e.into_inner()) = config;
    EPOCH.fetch_add(1, Ordering::Relaxed);
}

/// The current settings, if sparse attention is on.
pub fn sparse() -> Option<Sparse> {
    CONFIG.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Invalidate every K shadow (call after the device was off while contexts decoded).
pub(crate) fn invalidate() {
    EPOCH.fetch_add(1, Ordering::Relaxed);
}

/// What sparse attention did, summed over nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Flash-attention nodes computed.
    pub nodes: u64,
    /// (query row, head) pairs attended sparsely.
    pub sparse_rows: u64,
    /// (query row, head) pairs attended densely (too few visible keys).
    pub dense_rows: u64,
    /// Visible keys over all pairs.
    pub keys_visible: u64,
    /// Keys attended exactly over all pairs.
    pub keys_kept: u64,
}

static STATS: Mutex<Stats> = Mutex::new(Stats {
    nodes: 0,
    sparse_rows: 0,
    dense_rows: 0,
    keys_visible: 0,
    keys_kept: 0,
});

/// Totals since the process started.
pub fn stats() -> Stats {
    *STATS.lock().unwrap_or_else(|e| e.into_inner())
}

const QK: usize = 32;
const Q8_BYTES: usize = 34;

fn name_of(t: &g::ggml_tensor) -> &str {
    let bytes: &[u8] = {
        let n = t.name.iter().position(|&c| c == 0).unwrap_or(t.name.len());
        // SAFETY: `name` is a char array; reinterpreting its first n bytes as u8.
        unsafe { std::slice::from_raw_parts(t.name.as_ptr().cast(), n) }
    };
    std::str::from_utf8(bytes).unwrap_or("")
}

/// A K cache (`cache_k_l7`, `cache_swa_k_l3`): its layer, and whether it is a
/// sliding-window layer's.
fn any_k_cache(root: &g::ggml_tensor) -> Option<(usize, bool)> {
    let rest = name_of(root).strip_prefix("cache_")?;
    let (tag, layer) = rest.rsplit_once("_l")?;
    if !tag.ends_with('k') {
        return None;
    }
    Some((layer.parse().ok()?, tag.contains("swa")))
}

/// The K cache of a full-attention layer (`cache_k_l7`; sliding-window caches, whose
/// queries see a window of a few hundred keys, stay with ggml), and its layer.
fn k_cache_layer(root: &g::ggml_tensor) -> Option<usize> {
    match any_k_cache(root)? {
        (il, false) => Some(il),
        (_, true) => None,
    }
}

/// A flash-attention node copied from a real decode (`leap attn-bench` replays it), in
/// compact layouts: `q[i][h][d]`, `k[j][hk][d]`, `v[j][hk][dv]`, `mask[i][j]` (f16 bits).
#[derive(Debug, Clone)]
pub struct Captured {
    /// The layer, and whether it is a sliding-window one.
    pub layer: usize,
    pub swa: bool,
    pub d: usize,
    pub dv: usize,
    pub n_q: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_kv: usize,
    pub q: Vec<f32>,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
    pub mask: Vec<u16>,
    pub scale: f32,
    pub softcap: f32,
}

impl Captured {
    /// Operands over this copy, writing `dst` (`n_q * n_head * dv` floats).
    pub fn operands(&self, dst: &mut [f32]) -> Operands {
        assert_eq!(dst.len(), self.n_q * self.n_head * self.dv);
        Operands {
            d: self.d,
            dv: self.dv,
            n_q: self.n_q,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            n_kv: self.n_kv,
            q: self.q.as_ptr().cast(),
            q_row: self.n_head * self.d * 4,
            q_head: self.d * 4,
            k: self.k.as_ptr().cast(),
            k_row: self.n_head_kv * self.d * 2,
            k_head: self.d * 2,
            v: self.v.as_ptr().cast(),
            v_row: self.n_head_kv * self.dv * 2,
            v_head: self.dv * 2,
            mask: self.mask.as_ptr().cast(),
            mask_row: self.n_kv * 2,
            dst: dst.as_mut_ptr().cast(),
            dst_row: self.n_head * self.dv * 4,
            dst_head: self.dv * 4,
            scale: self.scale,
            softcap: self.softcap,
        }
    }

    /// The int8 shadow of the keys (what the device keeps up to date while decoding), and
    /// the view [`compute`] reads it through. The buffer must outlive the view.
    pub fn shadow(&self) -> (Vec<u8>, Keys8) {
        let n = self.n_head_kv * self.d;
        let row = q8_row_bytes(n);
        let mut buf = vec![0u8; self.n_kv * row];
        // SAFETY: `k` holds n_kv rows of n halves; `buf` has room for their Q8_0 rows.
        unsafe {
            quantize_f16_rows(
                self.k.as_ptr().cast(),
                n * 2,
                self.n_kv,
                n,
                buf.as_mut_ptr(),
            )
        };
        let k8 = Keys8 {
            base: buf.as_ptr(),
            len: buf.len(),
            cell0: 0,
            row,
            col0: 0,
            head: q8_row_bytes(self.d),
        };
        (buf, k8)
    }
}

static CAPTURE: Mutex<Option<Vec<Captured>>> = Mutex::new(None);

/// Capture the flash-attention nodes of the decodes that follow (on contexts with flash
/// attention whose graphs are built from now on): the device takes them, copies their
/// operands and computes them densely.
pub fn start_capture() {
    *CAPTURE.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
}

/// Stop capturing; the nodes captured since [`start_capture`].
pub fn take_capture() -> Vec<Captured> {
    CAPTURE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or_default()
}

fn capturing() -> bool {
    CAPTURE.lock().unwrap_or_else(|e| e.into_inner()).is_some()
}

/// Copy a node's operands (it passed [`supports_fa`]).
unsafe fn capture(node: &g::ggml_tensor, op: &Operands) -> Captured {
    let root = &*(*node.src[1]).view_src;
    let (layer, swa) = any_k_cache(root).unwrap_or((usize::MAX, false));
    let mut c = Captured {
        layer,
        swa,
        d: op.d,
        dv: op.dv,
        n_q: op.n_q,
        n_head: op.n_head,
        n_head_kv: op.n_head_kv,
        n_kv: op.n_kv,
        q: Vec::with_capacity(op.n_q * op.n_head * op.d),
        k: Vec::with_capacity(op.n_kv * op.n_head_kv * op.d),
        v: Vec::with_capacity(op.n_kv * op.n_head_kv * op.dv),
        mask: Vec::with_capacity(op.n_q * op.n_kv),
        scale: op.scale,
        softcap: op.softcap,
    };
    for i in 0..op.n_q {
        for h in 0..op.n_head {
            let p = op.q.add(i * op.q_row + h * op.q_head).cast::<f32>();
            c.q.extend_from_slice(std::slice::from_raw_parts(p, op.d));
        }
        if op.mask.is_null() {
            c.mask.resize(c.mask.len() + op.n_kv, 0);
        } else {
            let m = op.mask.add(i * op.mask_row).cast::<u16>();
            c.mask
                .extend_from_slice(std::slice::from_raw_parts(m, op.n_kv));
        }
    }
    for j in 0..op.n_kv {
        for h in 0..op.n_head_kv {
            let k = op.k.add(j * op.k_row + h * op.k_head).cast::<u16>();
            c.k.extend_from_slice(std::slice::from_raw_parts(k, op.d));
            let v = op.v.add(j * op.v_row + h * op.v_head).cast::<u16>();
            c.v.extend_from_slice(std::slice::from_raw_parts(v, op.dv));
        }
    }
    c
}

fn cpu_traits(t: g::ggml_type) -> &'static g::ggml_type_traits_cpu {
    // SAFETY: ggml returns a static table entry for every type.
    unsafe { &*g::ggml_get_type_traits_cpu(t) }
}

type FromFloat = unsafe extern "C" fn(*const f32, *mut std::ffi::c_void, i64);

fn quantizer(t: g::ggml_type) -> FromFloat {
    cpu_traits(t).from_float.expect("ggml quantizes this type")
}

/// An int8 copy of one K cache.
struct Shadow {
    base: usize,
    cells: usize,
    n_embd: usize,
    row_bytes: usize,
    data: Vec<u8>,
    valid: Vec<bool>,
    epoch: u64,
    used: u64,
}

static SHADOWS: Mutex<(u64, Vec<Shadow>)> = Mutex::new((0, Vec::new()));
/// Shadows kept (one per layer per context; the least recently used goes first).
const MAX_SHADOWS: usize = 256;

fn shadow_for<'a>(list: &'a mut (u64, Vec<Shadow>), root: &g::ggml_tensor) -> &'a mut Shadow {
    list.0 += 1;
    let tick = list.0;
    let base = root.data as usize;
    let n_embd = root.ne[0] as usize;
    let cells = (root.ne[1] * root.ne[2] * root.ne[3]) as usize;
    let epoch = EPOCH.load(Ordering::Relaxed);
    let pos = list
        .1
        .iter()
        .position(|s| s.base == base && s.cells == cells && s.n_embd == n_embd);
    let i = match pos {
        Some(i) => i,
        None => {
            if list.1.len() >= MAX_SHADOWS {
                let lru = (0..list.1.len()).min_by_key(|&i| list.1[i].used).unwrap();
                list.1.swap_remove(lru);
            }
            let row_bytes = n_embd / QK * Q8_BYTES;
            list.1.push(Shadow {
                base,
                cells,
                n_embd,
                row_bytes,
                data: vec![0; cells * row_bytes],
                valid: vec![false; cells],
                epoch,
                used: tick,
            });
            list.1.len() - 1
        }
    };
    let s = &mut list.1[i];
    if s.epoch != epoch {
        s.valid.fill(false);
        s.epoch = epoch;
    }
    s.used = tick;
    s
}

/// Whether the device takes this `SET_ROWS` (a write of new keys into a K cache whose
/// attention it takes).
pub(crate) fn supports_set_rows(op: &g::ggml_tensor) -> bool {
    if op.op != g::GGML_OP_SET_ROWS || op.type_ != g::GGML_TYPE_F16 || sparse().is_none() {
        return false;
    }
    let (s0, s1, root) = (op.src[0], op.src[1], op.view_src);
    if s0.is_null() || s1.is_null() || root.is_null() {
        return false;
    }
    // SAFETY: ggml's sources and view source of a node are valid tensors.
    let (s0, s1, root) = unsafe { (&*s0, &*s1, &*root) };
    k_cache_layer(root).is_some()
        && s0.type_ == g::GGML_TYPE_F32
        && (s1.type_ == g::GGML_TYPE_I64 || s1.type_ == g::GGML_TYPE_I32)
        && s0.ne[0] == op.ne[0]
        && (s0.ne[0] as usize).is_multiple_of(QK)
        && s0.ne[2] == 1
        && s0.ne[3] == 1
        && s1.ne[0] == s0.ne[1]
        && s1.ne[1] == 1
        && s0.nb[0] == 4
        && op.nb[0] == 2
        && op.nb[1] == root.nb[1]
}

/// Write the new keys (as ggml would) and their int8 shadow.
///
/// # Safety
/// `node` passed [`supports_set_rows`] and its sources hold their data.
pub(crate) unsafe fn set_rows(node: &mut g::ggml_tensor) {
    let (s0, s1, root) = (&*node.src[0], &*node.src[1], &*node.view_src);
    let n = s0.ne[0] as usize;
    let to_f16 = quantizer(g::GGML_TYPE_F16);
    let to_q8 = quantizer(g::GGML_TYPE_Q8_0);
    let mut list = SHADOWS.lock().unwrap_or_else(|e| e.into_inner());
    let sh = shadow_for(&mut list, root);
    for r in 0..s0.ne[1] as usize {
        let p = (s1.data as *const u8).add(r * s1.nb[0]);
        let idx = if s1.type_ == g::GGML_TYPE_I64 {
            *p.cast::<i64>() as usize
        } else {
            *p.cast::<i32>() as usize
        };
        let src = (s0.data as *const u8).add(r * s0.nb[1]).cast::<f32>();
        let dst = (node.data as *mut u8).add(idx * node.nb[1]);
        to_f16(src, dst.cast(), n as i64);
        let cell = (dst as usize - root.data as usize) / root.nb[1];
        if cell < sh.cells {
            to_q8(
                src,
                sh.data.as_mut_ptr().add(cell * sh.row_bytes).cast(),
                n as i64,
            );
            sh.valid[cell] = true;
        }
    }
}

/// Whether the device takes this flash-attention node.
pub(crate) fn supports_fa(op: &g::ggml_tensor) -> bool {
    let capturing = capturing() || TAKE_ALL.load(Ordering::Relaxed);
    let cfg = match sparse() {
        Some(c) => c,
        None if capturing => Sparse::default(),
        None => return false,
    };
    if op.op != g::GGML_OP_FLASH_ATTN_EXT || op.type_ != g::GGML_TYPE_F32 {
        return false;
    }
    let (q, k, v, mask, sinks) = (op.src[0], op.src[1], op.src[2], op.src[3], op.src[4]);
    if q.is_null() || k.is_null() || v.is_null() || !sinks.is_null() {
        return false;
    }
    // SAFETY: ggml's sources of a node are valid tensors.
    let (q, k, v) = unsafe { (&*q, &*k, &*v) };
    if k.view_src.is_null() {
        return false;
    }
    // SAFETY: as above.
    let root = unsafe { &*k.view_src };
    let mask_ok = mask.is_null() || {
        // SAFETY: as above.
        let m = unsafe { &*mask };
        m.type_ == g::GGML_TYPE_F16 && m.ne[2] == 1 && m.ne[3] == 1 && m.ne[0] >= k.ne[1]
    };
    let max_bias = f32::from_bits(op.op_params[1] as u32);
    let taken = if capturing {
        any_k_cache(root).is_some()
    } else {
        // Every node up to `max_rows` rows, short contexts included (attended densely by the
        // same per-row code): a row's attention then does not depend on its batch, so
        // speculative decoding under sparse attention still gives plain decoding's tokens.
        k_cache_layer(root).is_some() && q.ne[1] as usize <= cfg.max_rows
    };
    taken
        && mask_ok
        && max_bias == 0.0
        && q.type_ == g::GGML_TYPE_F32
        && k.type_ == g::GGML_TYPE_F16
        && v.type_ == g::GGML_TYPE_F16
        && q.ne[3] == 1
        && k.ne[3] == 1
        && v.ne[3] == 1
        && q.nb[0] == 4
        && k.nb[0] == 2
        && v.nb[0] == 2
        && k.nb[1] == root.nb[1]
        && q.ne[0] == k.ne[0]
        && (q.ne[0] as usize).is_multiple_of(QK)
        && k.ne[1] == v.ne[1]
        && k.ne[2] > 0
        && q.ne[2] % k.ne[2] == 0
        && v.ne[2] == k.ne[2]
        && op.nb[0] == 4
}

/// One flash-attention node's operands as strided views in ggml's layout (byte strides).
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    /// Head size of queries and keys.
    pub d: usize,
    /// Head size of values.
    pub dv: usize,
    /// Query rows.
    pub n_q: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention: `n_head` is a multiple).
    pub n_head_kv: usize,
    /// Key/value cells.
    pub n_kv: usize,
    /// f32 queries: row `i`, head `h` at `q + i*q_row + h*q_head`.
    pub q: *const u8,
    pub q_row: usize,
    pub q_head: usize,
    /// f16 keys: cell `j`, head `h` at `k + j*k_row + h*k_head`.
    pub k: *const u8,
    pub k_row: usize,
    pub k_head: usize,
    /// f16 values, like the keys.
    pub v: *const u8,
    pub v_row: usize,
    pub v_head: usize,
    /// f16 mask (0 or -inf), row `i` at `mask + i*mask_row`; null: every key visible.
    pub mask: *const u8,
    pub mask_row: usize,
    /// f32 output: row `i`, head `h` at `dst + i*dst_row + h*dst_head`.
    pub dst: *mut u8,
    pub dst_row: usize,
    pub dst_head: usize,
    /// Score scale (1/sqrt(d) usually).
    pub scale: f32,
    /// Logit soft-capping (0: off).
    pub softcap: f32,
}

// SAFETY: plain views; `compute`'s tasks read the inputs and write disjoint output rows.
unsafe impl Send for Operands {}
unsafe impl Sync for Operands {}

impl Operands {
    /// The operands of a flash-attention node.
    ///
    /// # Safety
    /// `op` is a valid FLASH_ATTN_EXT node that passed [`supports_fa`].
    unsafe fn of(op: &g::ggml_tensor) -> Self {
        let (q, k, v, mask) = (&*op.src[0], &*op.src[1], &*op.src[2], op.src[3]);
        Operands {
            d: q.ne[0] as usize,
            dv: v.ne[0] as usize,
            n_q: q.ne[1] as usize,
            n_head: q.ne[2] as usize,
            n_head_kv: k.ne[2] as usize,
            n_kv: k.ne[1] as usize,
            q: q.data as *const u8,
            q_row: q.nb[1],
            q_head: q.nb[2],
            k: k.data as *const u8,
            k_row: k.nb[1],
            k_head: k.nb[2],
            v: v.data as *const u8,
            v_row: v.nb[1],
            v_head: v.nb[2],
            mask: if mask.is_null() {
                std::ptr::null()
            } else {
                (*mask).data as *const u8
            },
            mask_row: if mask.is_null() { 0 } else { (*mask).nb[1] },
            dst: op.data as *mut u8,
            dst_row: op.nb[2],
            dst_head: op.nb[1],
            scale: f32::from_bits(op.op_params[0] as u32),
            softcap: f32::from_bits(op.op_params[2] as u32),
        }
    }
}

/// Where the int8 copy of key `j` of head `h` is: `base + (cell0 + j)*row + col0 + h*head`
/// (`len` bytes from `base` are readable).
#[derive(Clone, Copy, Debug)]
pub struct Keys8 {
    pub base: *const u8,
    pub len: usize,
    pub cell0: usize,
    pub row: usize,
    pub col0: usize,
    pub head: usize,
}

// SAFETY: a read-only view.
unsafe impl Send for Keys8 {}
unsafe impl Sync for Keys8 {}

impl Keys8 {
    #[inline]
    pub(crate) unsafe fn at(&self, j: usize, h: usize) -> *const u8 {
        self.base
            .add((self.cell0 + j) * self.row + self.col0 + h * self.head)
    }
}

/// One query row's shared state: the keys it sees and the estimates of a group of heads.
#[derive(Default)]
struct Row {
    cand: Vec<u32>,
    bias: Vec<f32>,
    /// Candidates `lo..hi` are estimated; the first `lo` (sinks) and the last `n - hi`
    /// (recent window) are always kept.
    lo: usize,
    hi: usize,
    sparse: bool,
    /// Estimate on the OpenCL device.
    on_opencl: bool,
    /// Estimate on QNN (one launch per KV head over all candidates).
    on_qnn: bool,
    est: Vec<Vec<f32>>,
    /// The queries as they are (the estimate quantizes only the keys).
    qf: Vec<f32>,
}

thread_local! {
    /// Scratch of the thread computing attention (ggml's OpenMP team and the scheduler's
    /// thread live as long as the process): the per-key buffers (candidates, estimates,
    /// picks, scores) are reused from node to node; only a few per-head vectors are not.
    static SCRATCH: std::cell::RefCell<(Row, Head)> = std::cell::RefCell::new(Default::default());
}

/// One head's scratch for selection and exact attention.
#[derive(Default)]
struct Head {
    top: Vec<(f32, u32)>,
    pick: Vec<u32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
    rows: Vec<*const u16>,
    gone: Vec<bool>,
}

/// Which keys a (row, head) pair attends (for recall measurements).
pub type Chosen = Vec<u32>;

/// f16 bits of -inf: a masked key.
const F16_NEG_INF: u16 = 0xfc00;

/// Keys kept of `n` visible at fraction `keep` (never fewer than the sinks and the window).
fn budget(keep: f32, n: usize, cfg: &Sparse) -> usize {
    ((keep * n as f32).ceil() as usize).max(cfg.sink + cfg.recent)
}

#[inline]
unsafe fn query(op: &Operands, i: usize, h: usize) -> &[f32] {
    std::slice::from_raw_parts(op.q.add(i * op.q_row + h * op.q_head).cast::<f32>(), op.d)
}

/// The keys row `i` sees with their mask bias, and whether heads `h0..h0+g` attend sparsely
/// (then their queries are quantized and `r.est` sized, not yet filled).
unsafe fn prepare(
    op: &Operands,
    sparse: bool,
    cfg: &Sparse,
    keep: &[f32],
    i: usize,
    (h0, g): (usize, usize),
    r: &mut Row,
) {
    r.cand.clear();
    r.bias.clear();
    if op.mask.is_null() {
        r.cand.extend(0..op.n_kv as u32);
        r.bias.resize(op.n_kv, 0.0);
    } else {
        let m = std::slice::from_raw_parts(op.mask.add(i * op.mask_row).cast::<u16>(), op.n_kv);
        for (j, &b) in m.iter().enumerate() {
            if b != F16_NEG_INF {
                r.cand.push(j as u32);
                r.bias.push(if b == 0 { 0.0 } else { f16::to_f32(b) });
            }
        }
    }
    let n = r.cand.len();
    r.lo = cfg.sink.min(n);
    r.hi = n - cfg.recent.min(n - r.lo);
    r.on_opencl = cfg.estimate_on == EstimateOn::OpenCl;
    r.sparse = sparse && n >= cfg.min_keys && (0..g).any(|x| budget(keep[h0 + x], n, cfg) < n);
    r.on_qnn = r.sparse && !r.on_opencl && crate::qnn::use_for(cfg.qnn);
    if r.sparse {
        r.qf.clear();
        for x in 0..g {
            // f32 queries against the int8 keys, on the CPU and in OpenCL alike.
            r.qf.extend_from_slice(query(op, i, h0 + x));
        }
        r.est.resize_with(g, Vec::new);
        for e in r.est.iter_mut() {
            e.resize(r.hi - r.lo, 0.0);
        }
    }
}

/// Estimates of prepared heads `x0..x0+g` (indices into the row's prepared heads, all of KV
/// head `hk`) for estimated candidates `c0..c1` (relative to `lo`), written through `est[x]`.
#[allow(clippy::too_many_arguments)]
unsafe fn estimate(
    op: &Operands,
    k8: &Keys8,
    hk: usize,
    (x0, g): (usize, usize),
    r: &Row,
    est: &[Ptr],
    (c0, c1): (usize, usize),
) {
    if cfg_on_opencl(k8, hk, (x0, g), r, est, (c0, c1), op)
        || on_qnn(op, hk, (x0, g), r, est, (c0, c1))
    {
        return;
    }
    let mut outs: Vec<&mut [f32]> = est[x0..x0 + g]
        .iter()
        .map(|p| std::slice::from_raw_parts_mut(p.at(0).cast::<f32>().add(c0), c1 - c0))
        .collect();
    let base = r.lo + c0;
    est::scores_f32q(
        &r.qf[x0 * op.d..],
        g,
        op.d,
        c1 - c0,
        |c| k8.at(r.cand[base + c] as usize, hk),
        &mut outs,
    );
}

/// Estimate on the OpenCL device when it is selected and present; false: do it on the CPU
/// (not selected, or OpenCL failed: logged once).
#[allow(clippy::too_many_arguments)]
unsafe fn cfg_on_opencl(
    k8: &Keys8,
    hk: usize,
    (x0, g): (usize, usize),
    r: &Row,
    est: &[Ptr],
    (c0, c1): (usize, usize),
    op: &Operands,
) -> bool {
    if !r.on_opencl {
        return false;
    }
    #[cfg(feature = "opencl")]
    {
        let Ok(cl) = crate::opencl::estimator() else {
            return false;
        };
        let mut outs: Vec<&mut [f32]> = est[x0..x0 + g]
            .iter()
            .map(|p| std::slice::from_raw_parts_mut(p.at(0).cast::<f32>().add(c0), c1 - c0))
            .collect();
        let keys = std::slice::from_raw_parts(k8.base, k8.len);
        match cl.scores(
            keys,
            (k8.row, k8.col0, k8.head, k8.cell0, hk),
            &r.cand,
            r.lo + c0,
            &r.qf[x0 * op.d..],
            (g, op.d, c1 - c0),
            &mut outs,
        ) {
            Ok(()) => {
                OPENCL_CALLS.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    log::warn!("leap-opencl: estimate failed ({e}); estimating on the CPU")
                });
                false
            }
        }
    }
    #[cfg(not(feature = "opencl"))]
    {
        let _ = (k8, hk, x0, g, est, c0, c1, op);
        false
    }
}

/// Estimate on QNN when it is used for this row; false: do it on the CPU (not used, or QNN
/// failed: logged once).
unsafe fn on_qnn(
    op: &Operands,
    hk: usize,
    (x0, g): (usize, usize),
    r: &Row,
    est: &[Ptr],
    (c0, c1): (usize, usize),
) -> bool {
    if !r.on_qnn {
        return false;
    }
    let mut outs: Vec<&mut [f32]> = est[x0..x0 + g]
        .iter()
        .map(|p| std::slice::from_raw_parts_mut(p.at(0).cast::<f32>().add(c0), c1 - c0))
        .collect();
    let base = r.lo + c0;
    let key = |c: usize| {
        op.k.add(r.cand[base + c] as usize * op.k_row + hk * op.k_head)
            .cast::<u16>()
    };
    match crate::qnn::scores(&r.qf[x0 * op.d..], (g, op.d, c1 - c0), key, &mut outs) {
        Ok(()) => true,
        Err(e) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| log::warn!("QNN estimate failed ({e}); estimating on the CPU"));
            false
        }
    }
}

/// QNN launches of the estimate in this process (see [`crate::qnn`]).
pub fn qnn_calls() -> u64 {
    crate::qnn::executes()
}

static OPENCL_CALLS: AtomicU64 = AtomicU64::new(0);

/// Estimates computed by the OpenCL device in this process.
pub fn opencl_calls() -> u64 {
    OPENCL_CALLS.load(Ordering::Relaxed)
}

/// Select head `h`'s keys (group member `x`) and attend them exactly; adds to `stats`.
#[allow(clippy::too_many_arguments)]
unsafe fn finish(
    op: &Operands,
    cfg: &Sparse,
    keep: f32,
    i: usize,
    (h, x): (usize, usize),
    r: &Row,
    s: &mut Head,
    stats: &mut Stats,
    chosen: Option<&mut Chosen>,
) {
    let hk = h / (op.n_head / op.n_head_kv);
    let n = r.cand.len();
    let want = budget(keep, n, cfg);
    s.pick.clear();
    let mut drop = 0;
    if r.sparse && want < n {
        let take = want - r.lo - (n - r.hi);
        let extra = ((take as f32 * cfg.refine).ceil() as usize).min(r.hi - r.lo - take);
        let take = take + extra;
        drop = extra;
        s.top.clear();
        s.top.extend(
            r.est[x]
                .iter()
                .enumerate()
                .map(|(c, &e)| (e * op.scale + r.bias[r.lo + c], (r.lo + c) as u32)),
        );
        if take < s.top.len() {
            s.top
                .select_nth_unstable_by(take, |a, b| b.0.total_cmp(&a.0));
            s.top.truncate(take);
        }
        s.pick.extend(0..r.lo as u32);
        s.pick.extend(s.top.iter().map(|&(_, c)| c));
        s.pick.extend(r.hi as u32..n as u32);
        stats.sparse_rows += 1;
    } else {
        s.pick.extend(0..n as u32);
        stats.dense_rows += 1;
    }
    stats.keys_visible += n as u64;
    stats.keys_kept += (s.pick.len() - drop) as u64;
    exact(op, query(op, i, h), hk, i, h, r, s, drop);
    if let Some(ch) = chosen {
        ch.clear();
        ch.extend(s.pick.iter().map(|&c| r.cand[c as usize]));
        ch.sort_unstable();
    }
}

/// Exact attention of one (row, head) over the picked keys (`s.pick`, indices into
/// `r.cand`), written to the output; first the `drop` lowest-scoring estimated picks (those
/// between the sinks and the recent window) are dropped from `s.pick`.
#[allow(clippy::too_many_arguments)]
unsafe fn exact(
    op: &Operands,
    q: &[f32],
    hk: usize,
    i: usize,
    h: usize,
    r: &Row,
    s: &mut Head,
    drop: usize,
) {
    let (scale, cap) = if op.softcap != 0.0 {
        (op.scale / op.softcap, op.softcap)
    } else {
        (op.scale, 0.0)
    };
    s.scores.clear();
    let mut max = f32::NEG_INFINITY;
    // Picked rows are scattered over the cache: fetch a few ahead.
    const AHEAD: usize = 4;
    let k_bytes = op.d * 2;
    for (t, &c) in s.pick.iter().enumerate() {
        if let Some(&next) = s.pick.get(t + AHEAD) {
            let p =
                op.k.add(r.cand[next as usize] as usize * op.k_row + hk * op.k_head);
            f16::prefetch(p, k_bytes);
        }
        let j = r.cand[c as usize] as usize;
        let mut x = f16::dot(q, op.k.add(j * op.k_row + hk * op.k_head).cast()) * scale;
        if cap != 0.0 {
            x = cap * x.tanh();
        }
        x += r.bias[c as usize];
        max = max.max(x);
        s.scores.push(x);
    }
    if drop > 0 {
        // Rank the estimated picks by exact score; keep all but the `drop` lowest.
        let (lo, hi) = (r.lo, s.pick.len() - (r.cand.len() - r.hi));
        s.top.clear();
        s.top.extend((lo..hi).map(|t| (s.scores[t], t as u32)));
        let keep = s.top.len() - drop;
        s.top
            .select_nth_unstable_by(keep, |a, b| b.0.total_cmp(&a.0));
        s.gone.clear();
        s.gone.resize(s.pick.len(), false);
        for &(_, t) in &s.top[keep..] {
            s.gone[t as usize] = true;
        }
        let mut w = 0;
        for (t, &g) in s.gone.iter().enumerate() {
            if !g {
                s.pick[w] = s.pick[t];
                s.scores[w] = s.scores[t];
                w += 1;
            }
        }
        s.pick.truncate(w);
        s.scores.truncate(w);
        max = s.scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
    let mut sum = 0f32;
    for x in s.scores.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    s.rows.clear();
    s.rows.extend(s.pick.iter().map(|&c| {
        let j = r.cand[c as usize] as usize;
        op.v.add(j * op.v_row + hk * op.v_head).cast::<u16>()
    }));
    s.acc.resize(op.dv, 0.0);
    f16::weighted_sum(&mut s.acc, &s.scores, &s.rows);
    let out = std::slice::from_raw_parts_mut(
        op.dst.add(i * op.dst_row + h * op.dst_head).cast::<f32>(),
        op.dv,
    );
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for (o, a) in out.iter_mut().zip(&s.acc) {
        *o = a * inv;
    }
}

fn add(tot: &Mutex<Stats>, s: &Stats) {
    let mut t = tot.lock().unwrap_or_else(|e| e.into_inner());
    t.sparse_rows += s.sparse_rows;
    t.dense_rows += s.dense_rows;
    t.keys_visible += s.keys_visible;
    t.keys_kept += s.keys_kept;
}

/// The head-wise pipeline of 004 §3.4 (Algorithm 1) for one row whose estimate runs on the
/// OpenCL device: the device estimates head `k+1` while this thread attends head `k`
/// exactly; heads go in order of their budgets, largest first, so that the device's work
/// hides behind the longest exact parts. False (nothing written) when OpenCL failed: the
/// caller estimates the usual way (not asked for, or OpenCL failed).
#[allow(clippy::too_many_arguments)]
unsafe fn pipelined<'a>(
    op: &Operands,
    k8: &Keys8,
    cfg: &Sparse,
    keep: &[f32],
    i: usize,
    r: &mut Row,
    stats: &mut Stats,
    slot: &dyn Fn(usize, usize) -> Option<&'a mut Chosen>,
) -> bool {
    #[cfg(feature = "opencl")]
    {
        let Ok(cl) = crate::opencl::estimator() else {
            return false;
        };
        if !cfg.pipeline.unwrap_or(cl.is_gpu) {
            return false;
        }
        let g = op.n_head / op.n_head_kv;
        let m = r.hi - r.lo;
        let mut order: Vec<usize> = (0..op.n_head).collect();
        order.sort_by(|&a, &b| keep[b].total_cmp(&keep[a]));
        let keys = std::slice::from_raw_parts(k8.base, k8.len);
        let launch = |r: &Row, h: usize| {
            // SAFETY: the shadow and `r.cand` stay untouched until the wait below.
            cl.launch(
                keys,
                (k8.row, k8.col0, k8.head, k8.cell0, h / g),
                &r.cand,
                r.lo,
                &r.qf[h * op.d..(h + 1) * op.d],
                (1, op.d, m),
            )
        };
        let mut pending = match launch(r, order[0]) {
            Ok(p) => Some(p),
            Err(e) => {
                log::warn!("leap-opencl: estimate failed ({e}); estimating on the CPU");
                return false;
            }
        };
        let mut head = Head::default();
        for (k, &h) in order.iter().enumerate() {
            let Some(p) = pending.take() else {
                return false;
            };
            let est = match p.wait() {
                Ok(e) => e,
                Err(e) => {
                    log::warn!("leap-opencl: estimate failed ({e}); estimating on the CPU");
                    return false;
                }
            };
            r.est[h][..m].copy_from_slice(&est[..m]);
            if let Some(&next) = order.get(k + 1) {
                pending = match launch(r, next) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        log::warn!("leap-opencl: estimate failed ({e}); estimating on the CPU");
                        return false;
                    }
                };
            }
            OPENCL_CALLS.fetch_add(1, Ordering::Relaxed);
            finish(op, cfg, keep[h], i, (h, h), r, &mut head, stats, slot(i, h));
        }
        true
    }
    #[cfg(not(feature = "opencl"))]
    {
        let _ = (op, k8, cfg, keep, i, r, stats, slot);
        false
    }
}

/// Compute a node's attention, sparse where `keys8` is given: `keep[h]` per head.
/// Returns the (row, head) pairs' stats, and fills `chosen[i*n_head+h]` if given.
///
/// Work is split by (row, KV head group) — the heads of a group share the estimate's key
/// loads — when there are enough rows for the threads (prefill, verification); a decode step
/// (one row) instead splits the estimate by key ranges, then the heads.
///
/// # Safety
/// `op`'s pointers are valid for its shape; `keys8` (if any) holds every cell's int8 copy.
pub unsafe fn compute(
    op: &Operands,
    keys8: Option<&Keys8>,
    cfg: &Sparse,
    keep: &[f32],
    threads: usize,
    chosen: Option<&mut Vec<Chosen>>,
) -> Stats {
    let g = op.n_head / op.n_head_kv;
    let totals = Mutex::new(Stats::default());
    let chosen_ptr = chosen.map(|c| {
        c.resize_with(op.n_q * op.n_head, Vec::new);
        Ptr(c.as_mut_ptr().cast())
    });
    let slot = |i: usize, h: usize| {
        // SAFETY: every (row, head) slot is written by one task only.
        chosen_ptr.map(|p| unsafe { &mut *p.at(0).cast::<Chosen>().add(i * op.n_head + h) })
    };
    let groups = op.n_q * op.n_head_kv;
    if groups >= 2 * threads || threads <= 1 {
        parallel(threads.min(groups).max(1), &|tid, nth| {
            let mut scratch = SCRATCH.with(|c| c.take());
            let (r, s) = (&mut scratch.0, &mut scratch.1);
            let mut local = Stats::default();
            let mut t = tid;
            while t < groups {
                let (i, hk) = (t / op.n_head_kv, t % op.n_head_kv);
                let h0 = hk * g;
                // SAFETY: each task writes its own output rows and `chosen` slots.
                unsafe {
                    prepare(op, keys8.is_some(), cfg, keep, i, (h0, g), r);
                    if r.sparse {
                        let est: Vec<Ptr> = r
                            .est
                            .iter_mut()
                            .map(|e| Ptr(e.as_mut_ptr().cast()))
                            .collect();
                        estimate(op, keys8.unwrap(), hk, (0, g), r, &est, (0, r.hi - r.lo));
                    }
                    for x in 0..g {
                        finish(
                            op,
                            cfg,
                            keep[h0 + x],
                            i,
                            (h0 + x, x),
                            r,
                            s,
                            &mut local,
                            slot(i, h0 + x),
                        );
                    }
                }
                t += nth;
            }
            SCRATCH.with(|c| c.replace(scratch));
            add(&totals, &local);
        });
    } else {
        // Few rows (decode): per row, every head's estimate split by key ranges, then the
        // heads' selection and exact attention split by heads.
        thread_local! {
            static ROW: std::cell::RefCell<Row> = std::cell::RefCell::new(Row::default());
        }
        let mut r = ROW.with(|c| c.take());
        for i in 0..op.n_q {
            prepare(op, keys8.is_some(), cfg, keep, i, (0, op.n_head), &mut r);
            if r.sparse && r.on_opencl {
                let mut local = Stats::default();
                if pipelined(op, keys8.unwrap(), cfg, keep, i, &mut r, &mut local, &slot) {
                    add(&totals, &local);
                    continue;
                }
            }
            if r.sparse {
                let m = r.hi - r.lo;
                let est: Vec<Ptr> = r
                    .est
                    .iter_mut()
                    .map(|e| Ptr(e.as_mut_ptr().cast()))
                    .collect();
                let (rr, est) = (&r, &est);
                // The OpenCL device and QNN take the whole range in one launch (QNN's
                // estimate depends on all of a row's candidates: its scales are theirs).
                let split = if r.on_opencl || r.on_qnn { 1 } else { threads };
                parallel(split, &|tid, nth| {
                    let (c0, c1) = (m * tid / nth, m * (tid + 1) / nth);
                    for hk in 0..op.n_head_kv {
                        // SAFETY: threads write disjoint ranges of the estimate rows.
                        unsafe { estimate(op, keys8.unwrap(), hk, (hk * g, g), rr, est, (c0, c1)) };
                    }
                });
            }
            // Heads to threads by expected work (their budgets: 004 §3.4 reorders heads for
            // the same reason), largest first onto the least loaded thread.
            let nth = threads.min(op.n_head);
            let mut order: Vec<usize> = (0..op.n_head).collect();
            order.sort_by(|&a, &b| keep[b].total_cmp(&keep[a]));
            let mut load = vec![0f32; nth];
            let mut owner = vec![0usize; op.n_head];
            for &h in &order {
                let t = (0..nth)
                    .min_by(|&a, &b| load[a].total_cmp(&load[b]))
                    .unwrap();
                owner[h] = t;
                load[t] += keep[h].max(0.01);
            }
            let (rr, owner) = (&r, &owner);
            parallel(nth, &|tid, team| {
                let mut scratch = SCRATCH.with(|c| c.take());
                let mut local = Stats::default();
                // (A smaller team than asked for still covers every head.)
                for h in (0..op.n_head).filter(|&h| owner[h] % team == tid) {
                    // SAFETY: each thread writes its own heads' output rows.
                    unsafe {
                        finish(
                            op,
                            cfg,
                            keep[h],
                            i,
                            (h, h),
                            rr,
                            &mut scratch.1,
                            &mut local,
                            slot(i, h),
                        )
                    };
                }
                SCRATCH.with(|c| c.replace(scratch));
                add(&totals, &local);
            });
        }
        ROW.with(|c| c.replace(r));
    }
    let mut s = totals.into_inner().unwrap_or_else(|e| e.into_inner());
    s.nodes = 1;
    s
}

/// Quantize `rows` f16 rows of `n` values (`stride` bytes apart) to Q8_0 rows (`out_row`
/// bytes apart), for shadows filled from a cache.
///
/// # Safety
/// Pointers valid for the rows.
pub unsafe fn quantize_f16_rows(
    src: *const u8,
    stride: usize,
    rows: usize,
    n: usize,
    out: *mut u8,
) {
    let to_q8 = quantizer(g::GGML_TYPE_Q8_0);
    let row_bytes = n / QK * Q8_BYTES;
    let mut tmp = vec![0f32; n];
    for r in 0..rows {
        let p = src.add(r * stride).cast::<u16>();
        for (x, t) in tmp.iter_mut().enumerate() {
            *t = f16::to_f32(*p.add(x));
        }
        to_q8(tmp.as_ptr(), out.add(r * row_bytes).cast(), n as i64);
    }
}

/// Bytes of a Q8_0 row of `n` values.
pub fn q8_row_bytes(n: usize) -> usize {
    n / QK * Q8_BYTES
}

/// Compute a flash-attention node the device took.
///
/// # Safety
/// `node` passed [`supports_fa`]; its sources hold their data.
pub(crate) unsafe fn flash_attn(node: &mut g::ggml_tensor, threads: usize) {
    let configured = sparse();
    let cfg = configured.clone().unwrap_or_default();
    let op = Operands::of(node);
    let dense = vec![1.0; op.n_head];
    {
        let mut cap = CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = cap.as_mut() {
            list.push(capture(node, &op));
            drop(cap);
            compute(&op, None, &cfg, &dense, threads, None);
            return;
        }
    }
    let k = &*node.src[1];
    let root = &*k.view_src;
    let layer = k_cache_layer(root);
    let st = match (&configured, layer) {
        (Some(_), Some(_)) => {
            let mut list = SHADOWS.lock().unwrap_or_else(|e| e.into_inner());
            let sh = shadow_for(&mut list, root);
            let off0 = k.data as usize - root.data as usize;
            let cell0 = off0 / root.nb[1];
            let col0 = (off0 % root.nb[1]) / 2;
            // Cells nobody quantized yet (written while the device was off): from the cache.
            for j in 0..op.n_kv {
                let cell = cell0 + j;
                if cell < sh.cells && !sh.valid[cell] {
                    quantize_f16_rows(
                        (root.data as *const u8).add(cell * root.nb[1]),
                        root.nb[1],
                        1,
                        sh.n_embd,
                        sh.data.as_mut_ptr().add(cell * sh.row_bytes),
                    );
                    sh.valid[cell] = true;
                }
            }
            let fits = cell0 + op.n_kv <= sh.cells
                && col0.is_multiple_of(QK)
                && (k.nb[2] / 2).is_multiple_of(QK);
            let keys8 = Keys8 {
                base: sh.data.as_ptr(),
                len: sh.data.len(),
                cell0,
                row: sh.row_bytes,
                col0: col0 / QK * Q8_BYTES,
                head: k.nb[2] / 2 / QK * Q8_BYTES,
            };
            let keep: Vec<f32> = (0..op.n_head).map(|h| cfg.keep_for(layer, h)).collect();
            compute(&op, fits.then_some(&keys8), &cfg, &keep, threads, None)
        }
        // Taken for profiling (every layer, dense) or a sliding-window layer: dense.
        _ => compute(&op, None, &cfg, &dense, threads, None),
    };
    if let (Some(ab), Some((il, _))) = (ablation(), any_k_cache(root)) {
        if ab.layer == il {
            for i in 0..op.n_q {
                for h in 0..op.n_head {
                    if ab.head.is_none_or(|x| x == h) {
                        let out = op.dst.add(i * op.dst_row + h * op.dst_head).cast::<f32>();
                        std::slice::from_raw_parts_mut(out, op.dv).fill(0.0);
                    }
                }
            }
        }
    }
    let mut tot = STATS.lock().unwrap_or_else(|e| e.into_inner());
    tot.nodes += 1;
    tot.sparse_rows += st.sparse_rows;
    tot.dense_rows += st.dense_rows;
    tot.keys_visible += st.keys_visible;
    tot.keys_kept += st.keys_kept;
}

/// A head (or a whole layer's attention) whose output is zeroed, to measure how much the
/// model's loss needs it (004 Eq. 1-2, `leap profile-heads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ablation {
    pub layer: usize,
    /// `None`: every head of the layer.
    pub head: Option<usize>,
}

static TAKE_ALL: AtomicBool = AtomicBool::new(false);
static ABLATE: Mutex<Option<Ablation>> = Mutex::new(None);

/// Profiling mode: the device takes every flash-attention node (dense unless sparse
/// attention is on), so that [`set_ablation`] reaches every layer. Affects graphs built
/// afterwards (contexts created afterwards).
pub fn set_take_all(on: bool) {
    TAKE_ALL.store(on, Ordering::Relaxed);
}

/// Zero a head's or a layer's attention output in the nodes computed from now on (the
/// device must take them: [`set_take_all`]).
pub fn set_ablation(a: Option<Ablation>) {
    *ABLATE.lock().unwrap_or_else(|e| e.into_inner()) = a;
}

fn ablation() -> Option<Ablation> {
    *ABLATE.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random attention problem in cache layout (cell-major rows of all heads), as a node
    /// captured from a model would be.
    type Problem = Captured;

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn problem(n_q: usize, n_kv: usize, seed: u64) -> Problem {
        let (d, n_head, n_head_kv) = (64, 4, 2);
        let mut s = seed;
        // A few "important" keys per head get large scores; the rest are noise.
        let q: Vec<f32> = (0..n_q * n_head * d).map(|_| rng(&mut s)).collect();
        let mut k: Vec<u16> = (0..n_kv * n_head_kv * d)
            .map(|_| f16::from_f32(rng(&mut s) * 0.3))
            .collect();
        for j in (7..n_kv).step_by(97) {
            for x in 0..n_head_kv * d {
                let qv = q[x % d];
                k[j * n_head_kv * d + x] = f16::from_f32(qv * 4.0);
            }
        }
        let v = (0..n_kv * n_head_kv * d)
            .map(|_| f16::from_f32(rng(&mut s)))
            .collect();
        // Causal: row i sees cells 0..n_kv - n_q + i + 1.
        let mut mask = vec![f16::from_f32(f32::NEG_INFINITY); n_q * n_kv];
        for i in 0..n_q {
            for j in 0..n_kv - n_q + i + 1 {
                mask[i * n_kv + j] = 0;
            }
        }
        Captured {
            layer: 0,
            swa: false,
            d,
            dv: d,
            n_q,
            n_head,
            n_head_kv,
            n_kv,
            q,
            k,
            v,
            mask,
            scale: 1.0 / (d as f32).sqrt(),
            softcap: 0.0,
        }
    }

    fn operands(p: &Problem, dst: &mut [f32]) -> Operands {
        p.operands(dst)
    }

    /// Textbook softmax attention in f64.
    fn reference(p: &Problem) -> Vec<f32> {
        let d = p.d;
        let mut out = vec![0f32; p.n_q * p.n_head * d];
        for i in 0..p.n_q {
            for h in 0..p.n_head {
                let hk = h / (p.n_head / p.n_head_kv);
                let q = &p.q[(i * p.n_head + h) * d..][..d];
                let mut sc = Vec::new();
                for j in 0..p.n_kv {
                    if f16::to_f32(p.mask[i * p.n_kv + j]) == f32::NEG_INFINITY {
                        continue;
                    }
                    let k = &p.k[(j * p.n_head_kv + hk) * d..][..d];
                    let s: f64 = q
                        .iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * f16::to_f32(b) as f64)
                        .sum();
                    sc.push((j, s / (d as f64).sqrt()));
                }
                let m = sc.iter().map(|x| x.1).fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|x| (x.1 - m).exp()).sum();
                for x in 0..d {
                    let mut a = 0f64;
                    for &(j, s) in &sc {
                        a += (s - m).exp() / z
                            * f16::to_f32(p.v[(j * p.n_head_kv + hk) * d + x]) as f64;
                    }
                    out[(i * p.n_head + h) * d + x] = a as f32;
                }
            }
        }
        out
    }

    fn keys8(p: &Problem) -> (Vec<u8>, Keys8) {
        p.shadow()
    }

    fn init() {
        // SAFETY: idempotent.
        unsafe { g::ggml_cpu_init() };
    }

    #[test]
    fn dense_matches_softmax_attention() {
        init();
        let p = problem(3, 300, 1);
        let mut dst = vec![0f32; p.n_q * p.n_head * p.d];
        let op = operands(&p, &mut dst);
        let cfg = Sparse::default();
        // SAFETY: operands point into `p` and `dst`.
        let st = unsafe { compute(&op, None, &cfg, &[0.2; 4], 2, None) };
        assert_eq!(st.sparse_rows, 0);
        let want = reference(&p);
        let err = dst
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-4, "max abs err {err}");
    }

    #[test]
    fn sparse_keeps_the_budget_and_the_important_keys() {
        init();
        let p = problem(2, 2000, 7);
        let (_buf, k8) = keys8(&p);
        let mut dst = vec![0f32; p.n_q * p.n_head * p.d];
        let op = operands(&p, &mut dst);
        let cfg = Sparse {
            min_keys: 256,
            ..Sparse::default()
        };
        let mut chosen = Vec::new();
        // SAFETY: as above; k8 covers every cell.
        let st = unsafe { compute(&op, Some(&k8), &cfg, &[0.2; 4], 2, Some(&mut chosen)) };
        assert_eq!(st.sparse_rows, (p.n_q * p.n_head) as u64);
        for (t, ch) in chosen.iter().enumerate() {
            let i = t / p.n_head;
            let visible = p.n_kv - p.n_q + i + 1;
            assert_eq!(ch.len(), (0.2 * visible as f32).ceil() as usize, "budget");
            // Sinks, the recent window and every planted key are in.
            for j in 0..4 {
                assert!(ch.contains(&j));
            }
            for j in visible - 64..visible {
                assert!(ch.contains(&(j as u32)));
            }
            if t == 0 {
                for j in (7..visible).step_by(97) {
                    assert!(
                        ch.contains(&(j as u32)),
                        "planted key {j} missing in task {t}"
                    );
                }
            }
            assert!(ch.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
            assert!(ch.iter().all(|&j| (j as usize) < visible), "causal");
        }
        // The planted keys carry most of row 0 head 0's attention: its output stays close.
        let want = reference(&p);
        let d = p.d;
        let err = dst[..d]
            .iter()
            .zip(&want[..d])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 0.02, "max abs err {err}");
    }

    #[test]
    fn a_row_attends_alike_in_any_batch() {
        init();
        let p = problem(12, 1500, 11);
        let (_buf, k8) = keys8(&p);
        let cfg = Sparse {
            min_keys: 256,
            ..Sparse::default()
        };
        let mut all = vec![0f32; p.n_q * p.n_head * p.d];
        // SAFETY: operands point into `p` and `all`; k8 covers every cell.
        unsafe { compute(&operands(&p, &mut all), Some(&k8), &cfg, &[0.2; 4], 2, None) };
        for i in 0..p.n_q {
            // Row i alone: a one-row problem with that row's query and mask.
            let one = Problem {
                q: p.q[i * p.n_head * p.d..(i + 1) * p.n_head * p.d].to_vec(),
                mask: p.mask[i * p.n_kv..(i + 1) * p.n_kv].to_vec(),
                n_q: 1,
                k: p.k.clone(),
                v: p.v.clone(),
                ..p
            };
            let mut out = vec![0f32; p.n_head * p.d];
            // SAFETY: as above.
            unsafe {
                compute(
                    &operands(&one, &mut out),
                    Some(&k8),
                    &cfg,
                    &[0.2; 4],
                    2,
                    None,
                )
            };
            assert_eq!(
                out,
                all[i * p.n_head * p.d..(i + 1) * p.n_head * p.d],
                "row {i}"
            );
        }
    }

    #[test]
    fn keep_one_is_dense() {
        init();
        let p = problem(1, 1000, 3);
        let (_buf, k8) = keys8(&p);
        let mut a = vec![0f32; p.n_head * p.d];
        let mut b = a.clone();
        let cfg = Sparse {
            min_keys: 256,
            ..Sparse::default()
        };
        // SAFETY: as above.
        unsafe {
            compute(&operands(&p, &mut a), Some(&k8), &cfg, &[1.0; 4], 1, None);
            compute(&operands(&p, &mut b), None, &cfg, &[1.0; 4], 1, None);
        }
        assert_eq!(a, b);
    }

    #[test]
    fn cache_names() {
        fn t(name: &str) -> g::ggml_tensor {
            // SAFETY: ggml_tensor is plain data; all-zero is a valid (empty) tensor.
            let mut t: g::ggml_tensor = unsafe { std::mem::zeroed() };
            for (d, s) in t.name.iter_mut().zip(name.bytes()) {
                *d = s as _;
            }
            t
        }
        assert_eq!(k_cache_layer(&t("cache_k_l7")), Some(7));
        assert_eq!(k_cache_layer(&t("cache_v_l7")), None);
        assert_eq!(k_cache_layer(&t("cache_swa_k_l3")), None);
        assert_eq!(k_cache_layer(&t("leaf_3")), None);
    }
}

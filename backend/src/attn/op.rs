//! The ggml side of sparse attention: which nodes the device takes (a layer's
//! `FLASH_ATTN_EXT` over a `cache_k_lN` K cache, sliding-window layers included in this
//! llama.cpp, of shapes and types the kernel handles, and the `SET_ROWS` that writes new keys
//! into that cache), a node's [`Operands`], and computing a node the device
//! took: the shadow brought up to date, the node captured or computed (sparsely where the
//! settings say so), an ablated head zeroed, the totals counted.

use super::capture::capture;
use super::shadow::{quantize_f16_rows, quantizer, shadow_for, Keys8, Q8_BYTES, QK, SHADOWS};
use super::{compute, Sparse};
use crate::device::{DeviceConfig, Instance};
use crate::ffi as g;

fn name_of(t: &g::ggml_tensor) -> &str {
    let bytes: &[u8] = {
        let n = t.name.iter().position(|&c| c == 0).unwrap_or(t.name.len());
        // SAFETY: `name` is a char array; reinterpreting its first n bytes as u8.
        unsafe { std::slice::from_raw_parts(t.name.as_ptr().cast(), n) }
    };
    std::str::from_utf8(bytes).unwrap_or("")
}

/// A K cache (`cache_k_l7`, `cache_swa_k_l3`): its layer, and whether its name carries an
/// `swa` tag. This llama.cpp's sliding-window caches carry none (`llama_kv_cache_iswa` gives
/// its two caches no name tag, so both name theirs `cache_k_lN`): the flag is `false` for them.
pub(super) fn any_k_cache(root: &g::ggml_tensor) -> Option<(usize, bool)> {
    let rest = name_of(root).strip_prefix("cache_")?;
    let (tag, layer) = rest.rsplit_once("_l")?;
    if !tag.ends_with('k') {
        return None;
    }
    Some((layer.parse().ok()?, tag.contains("swa")))
}

/// The K cache of a layer (`cache_k_l7`), and its layer; `None` for a cache tagged `swa`
/// (`cache_swa_k_l3`). This llama.cpp names a sliding-window layer's cache like a full one, so
/// the device takes those layers too: their queries see through the mask only the window's
/// keys, fewer than [`Sparse::min_keys`] for Gemma 3's 512-key window, so they attend them
/// densely.
fn k_cache_layer(root: &g::ggml_tensor) -> Option<usize> {
    match any_k_cache(root)? {
        (il, false) => Some(il),
        (_, true) => None,
    }
}

/// Whether the device takes this `SET_ROWS` (a write of new keys into a K cache whose
/// attention it takes).
pub(crate) fn supports_set_rows(op: &g::ggml_tensor, cfg: &DeviceConfig) -> bool {
    if op.op != g::GGML_OP_SET_ROWS || op.type_ != g::GGML_TYPE_F16 || cfg.sparse.is_none() {
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

/// Whether the device takes this flash-attention node under `cfg` (`capturing`: every one,
/// for [`crate::Device::start_capture`]).
pub(crate) fn supports_fa(op: &g::ggml_tensor, cfg: &DeviceConfig, capturing: bool) -> bool {
    let capturing = capturing || cfg.take_all;
    let max_rows = match &cfg.sparse {
        Some(c) => c.max_rows,
        None if capturing => Sparse::default().max_rows,
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
        k_cache_layer(root).is_some() && q.ne[1] as usize <= max_rows
    };
    taken
        && mask_ok
        && max_bias == 0.0
        && f16_cache_shape(op, q, k, v)
        && k.nb[1] == root.nb[1]
        && (q.ne[0] as usize).is_multiple_of(QK)
}

/// A flash-attention node's operands as the device's attention reads them: f32 queries, f16
/// keys and values with contiguous rows, three dimensions, grouped-query heads, an f32 output
/// with contiguous rows (shared by sparse attention and [`crate::lone`]).
pub(crate) fn f16_cache_shape(
    op: &g::ggml_tensor,
    q: &g::ggml_tensor,
    k: &g::ggml_tensor,
    v: &g::ggml_tensor,
) -> bool {
    q.type_ == g::GGML_TYPE_F32
        && k.type_ == g::GGML_TYPE_F16
        && v.type_ == g::GGML_TYPE_F16
        && q.ne[3] == 1
        && k.ne[3] == 1
        && v.ne[3] == 1
        && q.nb[0] == 4
        && k.nb[0] == 2
        && v.nb[0] == 2
        && q.ne[0] == k.ne[0]
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
    pub(crate) unsafe fn of(op: &g::ggml_tensor) -> Self {
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

/// Compute a flash-attention node the device took for the context of `inst`, under its
/// settings now.
///
/// # Safety
/// `node` passed [`supports_fa`]; its sources hold their data.
pub(crate) unsafe fn flash_attn(node: &mut g::ggml_tensor, threads: usize, inst: &Instance) {
    let configured = &inst.config().sparse;
    let cfg = configured.clone().unwrap_or_default();
    let op = Operands::of(node);
    let dense = vec![1.0; op.n_head];
    if inst.capturing() && inst.capture(capture(node, &op)).is_none() {
        compute(&op, None, &cfg, &dense, threads, None);
        return;
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
        // Taken for profiling (every layer, dense) or a cache tagged `swa` (which this
        // llama.cpp never names): dense.
        _ => compute(&op, None, &cfg, &dense, threads, None),
    };
    if let (Some(ab), Some((il, _))) = (inst.ablation(), any_k_cache(root)) {
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
    let st = super::Stats { nodes: 1, ..st };
    inst.add_stats(&st);
    crate::device::TOTALS.add_attn(&st);
}

#[cfg(test)]
mod tests {
    use super::*;

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

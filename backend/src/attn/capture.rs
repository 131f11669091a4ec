//! Captured flash-attention nodes: after [`crate::Device::start_capture`] the device takes every
//! flash-attention node of the decodes that follow, copies its operands ([`Captured`], in
//! compact layouts) and computes it densely; `leap attn-bench` and the tests replay them.

use super::op::any_k_cache;
use super::shadow::{q8_row_bytes, quantize_f16_rows};
use super::{Keys8, Operands};
use crate::ffi as g;

/// A flash-attention node copied from a real decode (`leap attn-bench` replays it), in
/// compact layouts: `q[i][h][d]`, `k[j][hk][d]`, `v[j][hk][dv]`, `mask[i][j]` (f16 bits).
#[derive(Debug, Clone)]
pub struct Captured {
    /// The layer, and whether its K cache's name carries an `swa` tag (never in this
    /// llama.cpp, whose sliding-window caches are named like full ones: see `k_cache_layer`).
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
    /// the view [`compute`](super::compute) reads it through. The buffer must outlive the view.
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

/// Copy a node's operands (it passed [`supports_fa`](super::supports_fa)).
pub(super) unsafe fn capture(node: &g::ggml_tensor, op: &Operands) -> Captured {
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

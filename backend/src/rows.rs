//! The KV cache's writes (`GGML_OP_SET_ROWS` of f32 rows into an f16 cache) on the device,
//! where sparse attention does not take them ([`crate::attn`] keeps its int8 shadow there).
//!
//! Without flash attention llama.cpp stores V transposed, so each new value is a "row" of one
//! element at its own cell: ggml calls its f32-to-f16 conversion once per element, a function
//! call and a loop setup for one half (SmolLM2, 8 rows: 46,080 calls a target call, about 4%
//! of it). Here each matrix of source rows is converted in one call of the same ggml
//! function (`from_float` of f16, elementwise, so its bits are ggml's whatever the batching),
//! then the halves are stored where ggml's loop puts them.

use std::cell::RefCell;

use crate::ffi as g;

/// Whether the device writes `op`: f32 rows into an f16 tensor, indexed by i64 or i32, as
/// ggml's `SET_ROWS` does, with contiguous source rows.
pub(crate) fn supports(op: &g::ggml_tensor) -> bool {
    if op.op != g::GGML_OP_SET_ROWS || op.type_ != g::GGML_TYPE_F16 {
        return false;
    }
    // SAFETY: ggml's sources of a node are valid tensors or null.
    let (Some(s0), Some(s1)) = (unsafe { op.src[0].as_ref() }, unsafe { op.src[1].as_ref() })
    else {
        return false;
    };
    s0.type_ == g::GGML_TYPE_F32
        && (s1.type_ == g::GGML_TYPE_I64 || s1.type_ == g::GGML_TYPE_I32)
        && s0.nb[0] == 4
        && s0.nb[1] == s0.ne[0] as usize * 4
        && op.nb[0] == 2
        && op.ne[0] == s0.ne[0]
        && op.ne[2] == s0.ne[2]
        && op.ne[3] == s0.ne[3]
        && s1.ne[0] == s0.ne[1]
        && s1.ne[1] >= 1
        && s1.ne[2] >= 1
        && s0.ne[2] % s1.ne[1] == 0
        && s0.ne[3] % s1.ne[2] == 0
}

thread_local! {
    /// A matrix of source rows converted (reused from node to node).
    static HALVES: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// Write `node` (which [`supports`] accepted), on the calling thread.
///
/// # Safety
/// `node` is a valid, allocated SET_ROWS node whose sources hold their data, its indices
/// inside the destination (ggml asserts that; here it panics).
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor) {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let convert = crate::attn::quantizer(g::GGML_TYPE_F16);
    let (nc, nr) = (s0.ne[0] as usize, s0.ne[1] as usize);
    let rows_out = node.ne[1];
    HALVES.with(|h| {
        let h = &mut *h.borrow_mut();
        h.resize(nc * nr, 0);
        for i03 in 0..s0.ne[3] as usize {
            for i02 in 0..s0.ne[2] as usize {
                let src = (s0.data as *const u8).add(i02 * s0.nb[2] + i03 * s0.nb[3]);
                convert(src.cast(), h.as_mut_ptr().cast(), (nc * nr) as i64);
                let dst = (node.data as *mut u8).add(i02 * node.nb[2] + i03 * node.nb[3]);
                // This matrix's indices: a row of `s1` (broadcast over the source's matrices).
                let idx = (s1.data as *const u8).add(
                    (i02 % s1.ne[1] as usize) * s1.nb[1] + (i03 % s1.ne[2] as usize) * s1.nb[2],
                );
                let index = |i: usize| -> usize {
                    let p = idx.add(i * s1.nb[0]);
                    let i1 = if s1.type_ == g::GGML_TYPE_I64 {
                        *p.cast::<i64>()
                    } else {
                        i64::from(*p.cast::<i32>())
                    };
                    assert!(
                        (0..rows_out).contains(&i1),
                        "SET_ROWS index {i1} outside 0..{rows_out}"
                    );
                    i1 as usize
                };
                if nc == 1 {
                    // A transposed V cache: one half a cell.
                    for (i, &v) in h.iter().enumerate() {
                        dst.add(index(i) * node.nb[1])
                            .cast::<u16>()
                            .write_unaligned(v);
                    }
                } else {
                    for (i, row) in h.chunks_exact(nc).enumerate() {
                        let d = dst.add(index(i) * node.nb[1]).cast::<u16>();
                        std::ptr::copy_nonoverlapping(row.as_ptr(), d, nc);
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use llama_cpp_sys_2 as sys;

    /// The device's write gives ggml's own `SET_ROWS` bit for bit: whole rows (a K cache's)
    /// and one-element rows (a transposed V cache's), i64 and i32 indices in no order, values
    /// that round to f16 ties, subnormals, infinities and NaN; cells not written keep theirs.
    #[test]
    fn writes_match_ggml_set_rows() {
        let mut rnd = crate::check_values(0x0DDB_A11C_0FFE_E123);
        for (nc, nr, cells, i64_idx) in [(64usize, 5usize, 40usize, true), (1, 37, 300, false)] {
            let src: Vec<f32> = (0..nc * nr)
                .map(|i| match i % 11 {
                    0 => 1.0 + f32::EPSILON * 4096.0, // halfway between two halves
                    1 => 1e-6,
                    2 => 1e6,
                    3 if i > 30 => f32::NAN,
                    _ => rnd(20.0),
                })
                .collect();
            let idx: Vec<usize> = (0..nr).map(|i| (i * 7 + 3) % cells).collect();
            let before: Vec<u16> = (0..nc * cells).map(|i| (i * 31 % 30000) as u16).collect();
            // SAFETY: a private ggml context sized for the tensors and the graph; data written
            // before the graph runs; the node's tensor is ggml's, the same struct both
            // bindings describe.
            unsafe {
                let ctx = sys::ggml_init(sys::ggml_init_params {
                    mem_size: 16 << 20,
                    mem_buffer: std::ptr::null_mut(),
                    no_alloc: false,
                });
                assert!(!ctx.is_null());
                let (n, r, c) = (nc as i64, nr as i64, cells as i64);
                let dst = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F16, n, c);
                let s = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, n, r);
                let ity = if i64_idx {
                    sys::GGML_TYPE_I64
                } else {
                    sys::GGML_TYPE_I32
                };
                let ix = sys::ggml_new_tensor_1d(ctx, ity, r);
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    sys::ggml_get_data(s).cast(),
                    src.len(),
                );
                for (k, &v) in idx.iter().enumerate() {
                    let p = sys::ggml_get_data(ix).cast::<u8>();
                    if i64_idx {
                        p.cast::<i64>().add(k).write(v as i64);
                    } else {
                        p.cast::<i32>().add(k).write(v as i32);
                    }
                }
                let data = sys::ggml_get_data(dst).cast::<u16>();
                std::ptr::copy_nonoverlapping(before.as_ptr(), data, before.len());
                let out = sys::ggml_set_rows(ctx, dst, s, ix);
                let gf = sys::ggml_new_graph(ctx);
                sys::ggml_build_forward_expand(gf, out);
                assert_eq!(
                    sys::ggml_graph_compute_with_ctx(ctx, gf, 2),
                    sys::GGML_STATUS_SUCCESS
                );
                let want = std::slice::from_raw_parts(data, before.len()).to_vec();
                std::ptr::copy_nonoverlapping(before.as_ptr(), data, before.len());
                let node = &mut *out.cast::<crate::ffi::ggml_tensor>();
                assert!(super::supports(node));
                super::compute(node);
                let got = std::slice::from_raw_parts(data, before.len());
                assert_eq!(want, got, "{nc}-element rows");
                assert_ne!(want, before, "the rows were written");
                sys::ggml_free(ctx);
            }
        }
    }
}

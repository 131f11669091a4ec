//! The KV cache's writes (`GGML_OP_SET_ROWS` of f32 rows into an f16 cache) on the device,
//! where sparse attention does not take them ([`crate::attn`] keeps its int8 shadow there).
//!
//! Without flash attention llama.cpp stores V transposed, so each new value is a "row" of one
//! element at its own cell: ggml calls its f32-to-f16 conversion once per element, a function
//! call and a loop setup for one half (SmolLM2, 8 rows: 46,080 calls a target call, about 4%
//! of it). Here each matrix of source rows is converted in one call of the same ggml
//! function (`from_float` of f16, elementwise, so its bits are ggml's whatever the batching),
//! then the halves are stored where ggml's loop puts them: a value's cells for every token
//! together where the indices are llama.cpp's transposed layout ([`by_value`]), since a
//! value's cache row lies a whole row of cells (8 KB on a 4,096-cell context) from the next
//! and a token's values, stored in turn, all fell into the same cache sets (SmolLM2's 8-row
//! call, `leap profile --ops`: the writes 0.40-0.41 ms -> 0.25-0.27 ms).

use std::cell::RefCell;

use crate::ffi as g;
use crate::par::{parallel, Ptr};

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

/// A node's buffers, reused from node to node.
#[derive(Default)]
struct Scratch {
    /// A matrix of source rows converted.
    halves: Vec<u16>,
    /// Each token's first cell, in a value-major write ([`by_value`]).
    bases: Vec<usize>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Fewest one-element writes of llama.cpp's transposed layout that go on every thread: a
/// token's value rows lie a cell row apart (8 KB on a 4,096-cell context), so each write
/// misses the caches and the translation buffer, and a parallel region (~1 us) pays from a
/// few dozen of them (SmolLM2's token: 192 values a layer, Gemma 3's: 256).
const PAR_WRITES: usize = 64;

/// Write `node` (which [`supports`] accepted): a transposed V cache's scattered values on
/// `threads` threads, the rest on the calling thread.
///
/// # Safety
/// `node` is a valid, allocated SET_ROWS node whose sources hold their data, its indices
/// inside the destination (ggml asserts that; here it panics).
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let convert = crate::attn::quantizer(g::GGML_TYPE_F16);
    let (nc, nr) = (s0.ne[0] as usize, s0.ne[1] as usize);
    let rows_out = node.ne[1];
    SCRATCH.with(|sc| {
        let Scratch { halves: h, bases } = &mut *sc.borrow_mut();
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
                    let (nb1, out) = (node.nb[1], Ptr(dst));
                    // SAFETY (each call): `i` is a cell of this matrix (`index` checked it).
                    let put = move |i: usize, v: u16| {
                        out.at(i * nb1).cast::<u16>().write_unaligned(v);
                    };
                    match by_value(h.len(), &index) {
                        Some((values, stride)) => {
                            // A value's cells for every token, before the next value's: each
                            // cache line once (a token at a time, a value's row 8 KB from the
                            // next went to the same cache sets, and every store missed). The
                            // values split over the threads: no two of them share a cell.
                            // Cell `base + e * stride` is inside the matrix (`index`
                            // checked every base, `by_value` the cells after them), and
                            // each value's cells are one thread's.
                            bases.clear();
                            bases.extend((0..h.len() / values).map(|t| index(t * values)));
                            let (h, bases) = (&h[..], &bases[..]);
                            let write = |e0: usize, e1: usize| {
                                for e in e0..e1 {
                                    for (t, &base) in bases.iter().enumerate() {
                                        put(base + e * stride, h[t * values + e]);
                                    }
                                }
                            };
                            if threads > 1 && h.len() >= PAR_WRITES {
                                parallel(threads.min(values), &|tid, nth| {
                                    write(tid * values / nth, (tid + 1) * values / nth)
                                });
                            } else {
                                write(0, values);
                            }
                        }
                        None => {
                            for (i, &v) in h.iter().enumerate() {
                                put(index(i), v);
                            }
                        }
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

/// Whether `n` one-element writes to cells `index(i)` may go in value-major order, and how:
/// `Some((values, stride))` when the cells are llama.cpp's transposed V layout, write
/// `t * values + e` (token t, value e) going to `index(t * values) + e * stride`, with no
/// two writes of different values to one cell (so only writes of one value, which keep their
/// order, could overwrite each other, and the result is the in-order loop's). Every index is
/// read (and range-checked by `index`) once.
fn by_value(n: usize, index: &dyn Fn(usize) -> usize) -> Option<(usize, usize)> {
    if n < 2 {
        return None;
    }
    let (first, second) = (index(0), index(1));
    let stride = second.checked_sub(first).filter(|&s| s > 0)?;
    // The values a token: the run of cells `stride` apart from the first.
    let mut values = 2;
    while values < n && index(values) == first + values * stride {
        values += 1;
    }
    if !n.is_multiple_of(values) {
        return None;
    }
    for t in 0..n / values {
        let base = index(t * values);
        // Cells of different values collide only when two bases differ by a multiple of
        // `stride` smaller than `values` of them: bases whose quotients by `stride` are
        // multiples of `values` (llama.cpp's streams lie `values * stride` apart) never do.
        if !(base / stride).is_multiple_of(values) {
            return None;
        }
        for e in 1..values {
            if index(t * values + e) != base + e * stride {
                return None;
            }
        }
    }
    Some((values, stride))
}

#[cfg(test)]
mod tests {
    use llama_cpp_sys_2 as sys;

    /// llama.cpp's indices of a transposed V cache (`set_input_v_idxs`): token t's value e
    /// at `stream * values * cells + e * cells + cell`, for each token's (stream, cell).
    fn transposed(values: usize, cells: usize, at: &[(usize, usize)]) -> Vec<usize> {
        at.iter()
            .flat_map(|&(s, c)| (0..values).map(move |e| s * values * cells + e * cells + c))
            .collect()
    }

    /// The device's write gives ggml's own `SET_ROWS` bit for bit: whole rows (a K cache's)
    /// and one-element rows (a transposed V cache's), i64 and i32 indices in no order, values
    /// that round to f16 ties, subnormals, infinities and NaN; cells not written keep theirs.
    /// One-element rows also in llama.cpp's transposed V layout (which the device writes a
    /// value at a time), over one stream and two, with a token written twice (the later
    /// write stands), and in layouts that look like it but where writes of different values
    /// meet at one cell (which must keep ggml's order).
    #[test]
    fn writes_match_ggml_set_rows() {
        let mut rnd = crate::check_values(0x0DDB_A11C_0FFE_E123);
        let scattered = |nr: usize, cells: usize| -> Vec<usize> {
            (0..nr).map(|i| (i * 7 + 3) % cells).collect()
        };
        // Cells `c + e * rows` for e below `values`, for each base c (a near-miss layout).
        let rows_from = |bases: &[usize], values: usize, rows: usize| -> Vec<usize> {
            let row = |&c: &usize| (0..values).map(move |e| c + e * rows);
            bases.iter().flat_map(row).collect()
        };
        // (values a row, cells, i64 indices, indices, the value-major layout expected)
        type Case = (usize, usize, bool, Vec<usize>, Option<(usize, usize)>);
        let cases: Vec<Case> = vec![
            // Cells 7 apart: one token's layout to `by_value` (taken for one-element rows).
            (64, 40, true, scattered(5, 40), Some((5, 7))),
            (1, 300, false, scattered(37, 300), Some((37, 7))),
            // Cells 7 apart until they wrap around: ggml's order.
            (1, 300, false, scattered(50, 300), None),
            (
                1,
                300,
                true,
                transposed(6, 50, &[(0, 17), (0, 18), (0, 3), (0, 49)]),
                Some((6, 50)),
            ),
            (1, 300, true, transposed(6, 50, &[(0, 0)]), Some((6, 50))),
            (
                1,
                300,
                false,
                transposed(6, 50, &[(0, 9), (0, 30), (0, 9)]),
                Some((6, 50)),
            ),
            (
                1,
                200,
                true,
                transposed(5, 20, &[(1, 4), (0, 4), (1, 19), (0, 0)]),
                Some((5, 20)),
            ),
            // Enough writes for both threads ([`super::PAR_WRITES`]): two tokens, and one.
            (
                1,
                960,
                true,
                transposed(48, 20, &[(0, 3), (0, 7)]),
                Some((48, 20)),
            ),
            (1, 960, false, transposed(96, 10, &[(0, 4)]), Some((96, 10))),
            // Bases a cell row apart: token 1's value e lands on token 0's value e + 1.
            (1, 210, true, rows_from(&[3, 33], 6, 30), None),
            // Bases 2 rows apart, 3 values a token: token 1's value 0 lands on token 0's 2.
            (1, 150, false, rows_from(&[10, 70], 3, 30), None),
        ];
        for (nc, cells, i64_idx, idx, layout) in cases {
            let nr = idx.len();
            // Which loop the device takes: value by value for llama.cpp's layouts (of one
            // token too), in ggml's order for the rest.
            assert_eq!(super::by_value(nr, &|i| idx[i]), layout, "{idx:?}");
            let src: Vec<f32> = (0..nc * nr)
                .map(|i| match i % 11 {
                    0 => 1.0 + f32::EPSILON * 4096.0, // halfway between two halves
                    1 => 1e-6,
                    2 => 1e6,
                    3 if i > 30 => f32::NAN,
                    _ => rnd(20.0),
                })
                .collect();
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
                for threads in [1, 2] {
                    std::ptr::copy_nonoverlapping(before.as_ptr(), data, before.len());
                    super::compute(node, threads);
                    let got = std::slice::from_raw_parts(data, before.len());
                    assert_eq!(want, got, "{nc}-element rows at {idx:?}, {threads} threads");
                }
                assert_ne!(want, before, "the rows were written");
                sys::ggml_free(ctx);
            }
        }
    }
}

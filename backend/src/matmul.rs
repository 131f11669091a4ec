//! The device's one operation: `dst = src0 x src1` for a quantized weight matrix `src0`
//! (`ne01` rows of `ne00`) and a small batch `src1` (`ne11` rows of `ne00` floats), with Leap's
//! weight-stationary kernels. Activations are quantized with ggml's own `from_float` for the
//! kernel's activation type, exactly as ggml's CPU `mul_mat` does, so each output element is
//! the one ggml's single-row path computes.

use leap_host::qdot::{self, Kind};

use crate::device::Instance;
use crate::ffi as g;
use crate::par::{parallel, parallel_phased, Ptr};
use crate::{MAX_ROWS, MIN_ROWS};

fn kind_of(t: g::ggml_type) -> Option<Kind> {
    match t {
        g::GGML_TYPE_Q8_0 => Some(Kind::Q8_0),
        g::GGML_TYPE_Q5_0 => Some(Kind::Q5_0),
        g::GGML_TYPE_Q4_1 => Some(Kind::Q4_1),
        g::GGML_TYPE_Q4_K => Some(Kind::Q4K),
        g::GGML_TYPE_Q6_K => Some(Kind::Q6K),
        _ => None,
    }
}

/// Batch rows the device takes over repacked `Q4_K` weights. ggml computes one to three rows
/// each as a lone row (`ggml_gemv_q4_K_8x8_q8_K`), but four and more in blocks of four by
/// another product that rounds otherwise (264 of 299 rows of 2- to 24-row batches differed
/// from the row alone: `leap_host`'s test `which_repacked_batches_round_otherwise`); from 64
/// rows (prefill's batches) ggml's product stays, the same in every mode.
const REPACKED_ROWS: std::ops::RangeInclusive<i64> = 4..=63;

/// Whether `t`'s data sits in a repacked-weights buffer (ggml's interleaved layout).
pub(crate) fn is_repacked(t: &g::ggml_tensor) -> bool {
    // SAFETY: a tensor's buffer is null or valid, and a buffer's type has a name.
    unsafe { !t.buffer.is_null() && is_repack_buft(g::ggml_backend_buffer_get_type(t.buffer)) }
}

/// Whether `buft` is ggml's repacked-weights buffer type.
///
/// # Safety
/// `buft` is a valid buffer type.
pub(crate) unsafe fn is_repack_buft(buft: g::ggml_backend_buffer_type_t) -> bool {
    !buft.is_null()
        && std::ffi::CStr::from_ptr(g::ggml_backend_buft_name(buft)).to_bytes() == qdot::REPACK_BUFT
}

/// The output projection's node in llama.cpp's graphs.
const OUTPUT: &[u8] = b"result_output";

/// A tensor's name.
fn tensor_name(t: &g::ggml_tensor) -> &str {
    // SAFETY: `name` is a NUL-terminated char array inside the tensor.
    unsafe { std::ffi::CStr::from_ptr(t.name.as_ptr()) }
        .to_str()
        .unwrap_or("")
}

/// The layer of a weight tensor named `blk.N.…` (llama.cpp's naming).
fn layer_of(weight_name: &str) -> Option<u32> {
    let rest = weight_name.strip_prefix("blk.")?;
    rest[..rest.find('.')?].parse().ok()
}

/// Whether the device computes `op` (see the crate docs for the conditions), the output
/// projection only if `take_output` ([`crate::DeviceConfig::take_output`]).
pub(crate) fn supports(op: &g::ggml_tensor, take_output: bool) -> bool {
    if op.op != g::GGML_OP_MUL_MAT || op.type_ != g::GGML_TYPE_F32 {
        return false;
    }
    // The output projection stays in ggml's split with `result_norm` (unless a host without
    // on-demand projection asks for it, `take_output`): Leap's on-demand projection stops
    // the graph there through the eval callback, and ggml's scheduler only stops the split it
    // is in (a split of this device's would still run after it).
    if !take_output && crate::named(op, OUTPUT) {
        return false;
    }
    let (s0, s1) = (op.src[0], op.src[1]);
    if s0.is_null() || s1.is_null() {
        return false;
    }
    // SAFETY: ggml's sources of a node are valid tensors.
    let (s0, s1) = unsafe { (&*s0, &*s1) };
    let Some(kind) = kind_of(s0.type_) else {
        return false;
    };
    // Weights llama.cpp repacked (its default): the device takes the batches ggml would
    // compute otherwise than a lone row, and only where its kernel rounds as ggml's lone row.
    let rows = if is_repacked(s0) {
        if kind != Kind::Q4K || s0.ne[1] % 8 != 0 || qdot::checked_repacked().is_none() {
            return false;
        }
        REPACKED_ROWS
    } else {
        MIN_ROWS..=MAX_ROWS
    };
    s1.type_ == g::GGML_TYPE_F32
        && s0.ne[2] == 1
        && s0.ne[3] == 1
        && s1.ne[2] == 1
        && s1.ne[3] == 1
        && s0.ne[0] == s1.ne[0]
        && (s0.ne[0] as usize).is_multiple_of(kind.block_len())
        && rows.contains(&s1.ne[1])
        && s1.nb[0] == 4
        && op.nb[0] == 4
        // SAFETY: a valid tensor.
        && unsafe { g::ggml_is_contiguous(s0) }
        && qdot::checked(kind).is_some()
}

/// The quantized activations of the last weight product of a graph, for the next product over
/// the same input: a layer's query, key and value products read one normed row set, its gate
/// and up products another, and each quantized it anew (SmolLM2's 8-row call: ~0.3 ms).
/// ggml's graph allocator leaves a tensor's data as it is until the last node that reads it
/// has run, so within one graph one source tensor holds the same values for all its readers;
/// the store lives for one `graph_compute`, is keyed by the source tensor itself, and is
/// dropped when a node of the graph writes over the source's bytes all the same
/// ([`Quantized::wrote`]: an in-place op ggml's order puts between two readers).
#[derive(Default)]
pub(crate) struct Quantized {
    /// The source tensor and the activation type (`None`: nothing stored).
    key: Option<(*const g::ggml_tensor, g::ggml_type)>,
    /// The source's bytes (its data pointer is part of what must match).
    span: (usize, usize),
    /// The batch rows quantized.
    sel: Vec<usize>,
    bytes: Vec<u8>,
}

impl Quantized {
    /// The bytes of `src`'s rows `sel` quantized to `ty` if they are stored, taken out (`true`),
    /// else `len` zeroed bytes to quantize them into (`false`), in the stored buffer (a graph's
    /// ~200 products then allocate once, not each its own).
    fn take(
        &mut self,
        src: &g::ggml_tensor,
        ty: g::ggml_type,
        sel: &[usize],
        len: usize,
    ) -> (Vec<u8>, bool) {
        // The same tensor's same rows at the same address to the same type (and so the same
        // row length, the product's inner dimension).
        let stored = self.key == Some((src as *const _, ty))
            && self.span.0 == src.data as usize
            && self.sel == sel;
        // Taken out either way: nothing is stored until `keep`.
        self.key = None;
        let mut bytes = std::mem::take(&mut self.bytes);
        if stored {
            debug_assert_eq!(bytes.len(), len);
        } else {
            bytes.clear();
            bytes.resize(len, 0);
        }
        (bytes, stored)
    }

    /// Store `bytes`, `src`'s rows `sel` quantized to `ty`, for the next product.
    ///
    /// # Safety
    /// `src` is a valid, allocated tensor.
    unsafe fn keep(
        &mut self,
        src: &g::ggml_tensor,
        ty: g::ggml_type,
        sel: Vec<usize>,
        bytes: Vec<u8>,
    ) {
        let start = src.data as usize;
        let len = llama_cpp_sys_2::ggml_nbytes((src as *const g::ggml_tensor).cast());
        *self = Self {
            key: Some((src, ty)),
            span: (start, start + len),
            sel,
            bytes,
        };
    }

    /// `node` was computed: forget the activations if it wrote into their source's bytes.
    ///
    /// # Safety
    /// `node` is a valid, allocated tensor.
    pub(crate) unsafe fn wrote(&mut self, node: &g::ggml_tensor) {
        let start = node.data as usize;
        let end = start + llama_cpp_sys_2::ggml_nbytes((node as *const g::ggml_tensor).cast());
        if self.key.is_some() && start < self.span.1 && self.span.0 < end {
            self.key = None;
        }
    }
}

/// Compute `node` (which [`supports`] accepted) with `threads` threads, for the context of
/// `inst`, its activations taken from `last` when the graph's previous product quantized the
/// same ones (and left there for the next); returns the batch rows its early exit skipped.
///
/// # Safety
/// `node` is a valid, allocated MUL_MAT node whose sources hold their data; `last` was filled
/// by nodes of the same graph only.
pub(crate) unsafe fn compute(
    node: &mut g::ggml_tensor,
    threads: usize,
    inst: &Instance,
    last: &mut Quantized,
) -> u64 {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let kind = kind_of(s0.type_).expect("checked in supports");
    let k = qdot::checked(kind).expect("checked in supports");
    let n = s0.ne[0] as usize;
    let (n_w, m) = (s0.ne[1] as usize, s1.ne[1] as usize);
    let tr = &*g::ggml_get_type_traits_cpu(s0.type_);
    let from = (*g::ggml_get_type_traits_cpu(tr.vec_dot_type))
        .from_float
        .expect("the activation type has a quantizer");
    let sel = rows_to_compute(node, inst);
    // `Q8_K` activations (the k-quants') with Leap's vector quantizer where it gives ggml's
    // bytes: ggml's x86-64 build quantizes them with its scalar reference, on the calling
    // thread while the others wait.
    let q8k = (tr.vec_dot_type == g::GGML_TYPE_Q8_K)
        .then(q8k_checked)
        .flatten();
    let act_bytes = g::ggml_row_size(tr.vec_dot_type, n as i64);
    let (mut act, reuse) = last.take(s1, tr.vec_dot_type, &sel, act_bytes * sel.len());
    // Batch rows a pass over a weight tile (prefill-sized batches go through in chunks).
    const CHUNK: usize = 16;
    let n_chunks = sel.len().div_ceil(CHUNK);
    let (base, src, src_row) = (Ptr(act.as_mut_ptr()), Ptr(s1.data.cast()), s1.nb[1]);
    // Batch row j quantized (as ggml's `mul_mat` does) into row j of `act`.
    let quantize = |j: usize| {
        let x = src.at(sel[j] * src_row).cast::<f32>();
        // SAFETY: row j of `act`, written by this call only (callers split the rows).
        let a = std::slice::from_raw_parts_mut(base.at(j * act_bytes), act_bytes);
        if let Some(rounding) = q8k {
            leap_kernels::q8k::quantize(std::slice::from_raw_parts(x, n), a, rounding);
        } else {
            from(x, a.as_mut_ptr().cast(), n as i64);
        }
    };
    // Chunk c's rows, quantized, prepared for the kernel.
    let prepared = |c: usize| {
        let rows = c * CHUNK..((c + 1) * CHUNK).min(sel.len());
        // SAFETY: rows of `act`, quantized before (and not written after) this is called.
        let chunk: Vec<&[u8]> = rows
            .map(|j| std::slice::from_raw_parts(base.at(j * act_bytes), act_bytes))
            .collect();
        k.prepare(n, &chunk)
    };
    let row_bytes = s0.nb[1];
    // Repacked weights: 8-row groups of ggml's interleaved blocks, as many bytes as the rows.
    let repacked = is_repacked(s0);
    if repacked {
        crate::device::TOTALS
            .repacked_rows
            .fetch_add(sel.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
    let weights = std::slice::from_raw_parts(s0.data as *const u8, n_w * row_bytes);
    let (dst, dst_row) = (Ptr(node.data.cast()), node.nb[1]);
    let (tile, tasks) = if repacked {
        // Tiles of whole 8-row groups.
        let tile = tiles(n_w, threads).0.next_multiple_of(8);
        (tile, n_w.div_ceil(tile))
    } else {
        tiles(n_w, threads)
    };
    // One chunk of rows on several threads (a decode's or a verification's): each thread
    // quantizes its share of them inside the products' parallel region, and all prepare them
    // once every share is in: on the calling thread alone, SmolLM2's 8-row call quantized for
    // ~0.48 ms with the other thread waiting (and a region of its own costs about what it
    // would save). Batches of more chunks quantize in a region of their own, chunks to
    // threads.
    let together = n_chunks == 1 && sel.len() > 1 && threads > 1 && tasks > 1;
    let chunks: Vec<qdot::Acts<'_>> = if together {
        Vec::new()
    } else {
        if reuse {
            // Quantized by the graph's previous product.
        } else if n_chunks > 1 && threads > 1 {
            parallel(threads.min(n_chunks), &|tid, nth| {
                for c in tid * n_chunks / nth..(tid + 1) * n_chunks / nth {
                    (c * CHUNK..((c + 1) * CHUNK).min(sel.len())).for_each(quantize);
                }
            });
        } else {
            (0..sel.len()).for_each(quantize);
        }
        (0..n_chunks).map(prepared).collect()
    };
    let work = |chunks: &[qdot::Acts<'_>], task: usize, tmp: &mut Vec<f32>| {
        let i0 = task * tile;
        let len = tile.min(n_w - i0);
        let tile = &weights[i0 * row_bytes..(i0 + len) * row_bytes];
        for (c, acts) in chunks.iter().enumerate() {
            let cm = acts.len();
            tmp.resize(len * cm, 0.0);
            if repacked {
                k.dot_many_repacked(acts, tile, tmp);
            } else {
                k.dot_many(acts, tile, tmp);
            }
            // SAFETY: row r of dst holds n_w floats; tasks write disjoint columns.
            leap_kernels::transpose::columns_to(tmp, cm, len, |r| {
                dst.at(sel[c * CHUNK + r] * dst_row).cast::<f32>().add(i0)
            });
        }
    };
    let shares = leap_host::par::Shares::new(tasks, threads.min(tasks));
    parallel_phased(threads.min(tasks), &|tid, nth, phase| {
        let own;
        let chunks = if together {
            // (`reuse` is the same on every thread, so all wait or none.)
            if !reuse {
                (tid * sel.len() / nth..(tid + 1) * sel.len() / nth).for_each(quantize);
                phase.wait();
            }
            own = [prepared(0)];
            &own[..]
        } else {
            &chunks[..]
        };
        let mut tmp = Vec::with_capacity(tile * CHUNK);
        // A contiguous run of tasks per thread (each streams through its part of the weights
        // in address order, which the hardware prefetchers follow), then what is left of the
        // others', so none waits long for another at the end (and a team smaller than asked
        // for still does every task).
        for t in shares.iter(tid) {
            work(chunks, t, &mut tmp);
        }
    });
    let skipped = (m - sel.len()) as u64;
    last.keep(s1, tr.vec_dot_type, sel, act);
    skipped
}

/// The batch rows of `node` (a weight product) to compute: all, or those an early exit kept
/// past its layer (`Device::exit_mask`), the others' outputs zeroed here.
///
/// # Safety
/// As [`compute`].
unsafe fn rows_to_compute(node: &mut g::ggml_tensor, inst: &Instance) -> Vec<usize> {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let (n_w, m) = (s0.ne[1] as usize, s1.ne[1] as usize);
    match inst.rows_kept(m, || layer_of(tensor_name(s0))) {
        Some(keep) => {
            for r in (0..m).filter(|&r| !keep[r]) {
                let out = (node.data as *mut u8).add(r * node.nb[1]).cast::<f32>();
                std::ptr::write_bytes(out, 0, n_w);
            }
            (0..m).filter(|&r| keep[r]).collect()
        }
        None => (0..m).collect(),
    }
}

/// The rounding ([`leap_kernels::q8k::Rounding`]) with which [`leap_kernels::q8k::quantize`]
/// gives the bytes of the loaded ggml's `Q8_K` quantization, if one does (checked once per
/// process, into zeroed buffers, on rows of several spreads with ties of opposite signs, zero
/// blocks, and a block on which the roundings differ).
fn q8k_checked() -> Option<leap_kernels::q8k::Rounding> {
    use leap_kernels::q8k;
    use std::sync::OnceLock;
    static OK: OnceLock<Option<q8k::Rounding>> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: idempotent init; the static traits table.
        let from = unsafe {
            g::ggml_cpu_init();
            (*g::ggml_get_type_traits_cpu(g::GGML_TYPE_Q8_K)).from_float
        }?;
        let mut rnd = crate::check_values(0x0051_8c3b);
        let n = 5 * 256;
        let rows: Vec<Vec<f32>> = [0.001f32, 1.0, 40.0, 0.0]
            .iter()
            .enumerate()
            .map(|(i, &spread)| {
                let mut x: Vec<f32> = (0..n).map(|_| rnd(spread)).collect();
                if i == 1 {
                    // The same magnitude twice with opposite signs: the first sets the scale.
                    (x[7], x[100]) = (-9.0, 9.0);
                    (x[600], x[700]) = (9.5, -9.5);
                    x[4 * 256..].copy_from_slice(&q8k::telling_block());
                }
                x
            })
            .collect();
        let bytes = q8k::row_bytes(n);
        let ggml: Vec<Vec<u8>> = rows
            .iter()
            .map(|x| {
                let mut want = vec![0u8; bytes];
                // SAFETY: n floats in, a row of n Q8_K values out.
                unsafe { from(x.as_ptr(), want.as_mut_ptr().cast(), n as i64) };
                want
            })
            .collect();
        let found = q8k::Rounding::ALL.into_iter().find(|&r| {
            rows.iter().zip(&ggml).all(|(x, want)| {
                let mut got = vec![0u8; bytes];
                q8k::quantize(x, &mut got, r);
                &got == want
            })
        });
        if found.is_none() {
            log::warn!("Leap's Q8_K quantization does not reproduce ggml's here; using ggml's");
        }
        found
    })
}

/// Weight rows per task, and tasks, for `n_w` rows on `threads` threads: at most 64 rows a
/// task (the tile stays in cache for every chunk of batch rows), at least 4 tasks per thread
/// (with 64, SmolLM2's 192-row K and V products made 3 tasks for 2 threads), and as many tasks
/// for each thread, tiles of an even count (the kernels take weight rows in pairs). With 64
/// rows, SmolLM2's 576-row products made 9 tasks, 4 and 5: the second thread worked 24% longer
/// and the first waited for it.
fn tiles(n_w: usize, threads: usize) -> (usize, usize) {
    let t = threads.max(1);
    let tasks = n_w
        .div_ceil(n_w.div_ceil(4 * t).clamp(4, 64))
        .next_multiple_of(t);
    let tile = n_w.div_ceil(tasks).next_multiple_of(2).max(4);
    (tile, n_w.div_ceil(tile))
}

#[cfg(test)]
mod tests {
    /// Tasks come in equal numbers per thread for the models' matrix heights, and cover the
    /// rows.
    #[test]
    fn tiles_share_the_rows_evenly() {
        for n_w in [192, 256, 576, 640, 1024, 1536, 2048, 49152, 262144] {
            for threads in [1, 2, 4] {
                let (tile, tasks) = super::tiles(n_w, threads);
                assert!(
                    tile * tasks >= n_w && tile * (tasks - 1) < n_w,
                    "{n_w} {threads}"
                );
                assert!(tile <= 64 && tile % 2 == 0, "{n_w} {threads}: {tile}");
                assert_eq!(
                    tasks % threads,
                    0,
                    "{n_w} {threads}: {tasks} tasks of {tile}"
                );
            }
        }
        assert_eq!(super::tiles(576, 2), (58, 10));
    }

    /// Leap's `Q8_K` quantization is the loaded ggml's, byte for byte, with the rounding
    /// its build chose (GCC fuses the product and the addition where it may use FMA, as
    /// Leap's x86-64 build of ggml does).
    #[test]
    fn q8k_quantization_is_ggml_s() {
        let r = super::q8k_checked();
        eprintln!("ggml's Q8_K rounding: {r:?}");
        assert!(r.is_some());
    }

    /// Two products of one input: the second reuses the first's quantized activations, and
    /// both equal ggml's; once the input is written over (and the write reported, as
    /// `graph_compute` does after every node) the next product quantizes it anew.
    #[test]
    fn products_of_one_input_share_its_quantization() {
        use crate::ffi as g;
        use llama_cpp_sys_2 as sys;
        let mut rnd = crate::check_values(0x5EED_0A11);
        // One row (quantized before the products' threads start) and three (quantized by
        // the products' threads themselves).
        for rows in [1i64, 3] {
            let (n, n_w) = (256i64, 64i64);
            let ctx = crate::check::Ctx::new().expect("a ggml context");
            // SAFETY: tensors of the context, filled within their sizes; nodes of its graph.
            unsafe {
                let weights = |rnd: &mut dyn FnMut(f32) -> f32| {
                    let f: Vec<f32> = (0..n * n_w).map(|_| rnd(1.0)).collect();
                    let t = sys::ggml_new_tensor_2d(ctx.0, sys::GGML_TYPE_Q4_1, n, n_w);
                    sys::ggml_quantize_chunk(
                        sys::GGML_TYPE_Q4_1,
                        f.as_ptr(),
                        sys::ggml_get_data(t),
                        0,
                        n_w,
                        n,
                        std::ptr::null(),
                    );
                    t
                };
                let (w1, w2) = (weights(&mut rnd), weights(&mut rnd));
                let x = ctx.tensor([n, rows, 1, 1], &mut || rnd(1.0));
                let (y1, y2) = (
                    sys::ggml_mul_mat(ctx.0, w1, x),
                    sys::ggml_mul_mat(ctx.0, w2, x),
                );
                if super::qdot::checked(super::Kind::Q4_1).is_none()
                    || !super::supports(&*y1.cast::<g::ggml_tensor>(), false)
                {
                    eprintln!("no Q4_1 kernel here");
                    return;
                }
                let inst = crate::device::Instance::default();
                let mut last = super::Quantized::default();
                let device = |y: *mut sys::ggml_tensor, last: &mut super::Quantized| {
                    let node = &mut *y.cast::<g::ggml_tensor>();
                    super::compute(node, 2, &inst, last);
                    let len = (n_w * rows) as usize;
                    std::slice::from_raw_parts(sys::ggml_get_data(y).cast::<u32>(), len).to_vec()
                };
                let want = [ctx.ggml(y1).unwrap(), ctx.ggml(y2).unwrap()];
                assert_eq!(device(y1, &mut last), want[0]);
                assert!(
                    last.key.is_some(),
                    "the first product leaves its activations"
                );
                assert_eq!(device(y2, &mut last), want[1], "the second, reusing them");
                // The input doubled in place, unreported: the store still holds the old one (so
                // reuse did happen), and the product is the old input's.
                let xs =
                    std::slice::from_raw_parts_mut(sys::ggml_get_data_f32(x), (n * rows) as usize);
                xs.iter_mut().for_each(|v| *v *= 2.0);
                let stale = device(y2, &mut last);
                assert_eq!(stale, want[1]);
                let fresh = ctx.ggml(y2).unwrap();
                assert_ne!(fresh, want[1]);
                // Reported: quantized anew, ggml's result on the new values.
                last.wrote(&*x.cast::<g::ggml_tensor>());
                assert_eq!(device(y2, &mut last), fresh);
                assert_eq!(device(y1, &mut last), ctx.ggml(y1).unwrap());
            }
        }
    }

    #[test]
    fn weight_names_give_their_layer() {
        use super::layer_of;
        assert_eq!(layer_of("blk.12.ffn_up.weight"), Some(12));
        assert_eq!(layer_of("blk.0.attn_q.weight"), Some(0));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }
}

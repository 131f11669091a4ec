//! Dense flash attention of 1 to 63 query rows on the device, each row computed as ggml
//! computes a lone row ([`leap_kernels::lone`]), so that `--spec-type leap` keeps llama.cpp's
//! default flash attention and still gives plain decoding's tokens (issue 35); and the check
//! that this gives the loaded ggml's output bit for bit, which finds the [`Arith`] (the build's
//! dot product, its compiler's roundings) under which it does.

use leap_kernels::f16::{from_f32, to_f32};

use crate::ffi as g;
pub use leap_kernels::lone::{
    ariths, dot_zmm, roundings, row, rows, Arith, Dot, Keys, Merge, Rounding, Values, SPLIT_FROM,
};

/// Query rows of a flash-attention node the device computes the lone way. ggml's CPU backend
/// takes 2 to 63 rows (its tile is 64 rows) through one chunk over every key per row, which
/// rounds otherwise than the row alone; 64 rows or more it tiles (prefill, which plain decoding
/// and speculation share). The device takes lone rows too: ggml pads a lone call's key view
/// to 256 cells past the highest cell in use by any sequence, which a verification row cannot
/// see, so a lone row and a verification row both take [`lone_view`] here, the same for both
/// (and ggml's own view whenever the row's sequence holds the highest cells, as a single
/// conversation's does).
const ROWS: std::ops::RangeInclusive<i64> = 1..=63;

/// Query rows [`compute`] computed in this process.
static ROWS_COMPUTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Flash-attention query rows the device computed the lone way in this process (`LEAP_STATS`).
pub fn rows_computed() -> u64 {
    ROWS_COMPUTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Set when the device was asked to take a flash-attention node the lone way and
/// [`agrees_with_ggml`] had found no arithmetic that reproduces the loaded ggml's: ggml then
/// computes a verification's rows in one chunk each, otherwise than each row alone.
static UNREPRODUCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process met flash attention whose verification rows the device could not
/// compute as the loaded ggml computes a lone row (for a host such as llama.cpp's `--spec-type
/// leap`, whose verified drafts would then not be plain decoding's tokens): a ggml whose
/// arithmetic [`agrees_with_ggml`] did not find among [`ariths`] (the f32 builds', AVX512-FP16's
/// and AArch64 FP16's half-precision ones; an SVE build's, say), or a CPU without the kernels.
pub fn verification_rows_inexact() -> bool {
    UNREPRODUCED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The arithmetic the loaded ggml takes ([`agrees_with_ggml`], once per process).
fn checked() -> Option<Arith> {
    use std::sync::OnceLock;
    static R: OnceLock<Option<Arith>> = OnceLock::new();
    *R.get_or_init(|| {
        let r = agrees_with_ggml();
        if r.is_none() && leap_kernels::kq::cpu_ok() {
            log::warn!("Leap's lone-row flash attention does not reproduce ggml's here; leaving flash attention to ggml");
        }
        r
    })
}

/// Whether the device computes `op` the lone way: dense flash attention (the device's sparse
/// attention, profiling's `take_all` and a capture for `leap attn-bench` take it otherwise) over an f16 cache, of [`ROWS`] rows,
/// without sinks, ALiBi or soft-capping, value rows a whole number of ggml's SIMD steps (64
/// halves covers every x86-64 and AArch64 build), where [`agrees_with_ggml`] found a rounding.
pub(crate) fn supports(op: &g::ggml_tensor, cfg: &crate::DeviceConfig, capturing: bool) -> bool {
    if !cfg.lone_attention
        || cfg.sparse.is_some()
        || cfg.take_all
        || capturing
        || op.op != g::GGML_OP_FLASH_ATTN_EXT
    {
        return false;
    }
    let (q, k, v, mask, sinks) = (op.src[0], op.src[1], op.src[2], op.src[3], op.src[4]);
    if q.is_null() || k.is_null() || v.is_null() || !sinks.is_null() {
        return false;
    }
    // SAFETY: ggml's sources of a node are valid tensors.
    let (q, k, v) = unsafe { (&*q, &*k, &*v) };
    let mask_ok = mask.is_null() || {
        // SAFETY: as above.
        let m = unsafe { &*mask };
        m.type_ == g::GGML_TYPE_F16
            && m.ne[2] == 1
            && m.ne[3] == 1
            && m.ne[0] >= k.ne[1]
            && m.ne[1] >= q.ne[1]
            && m.nb[0] == 2
    };
    let param = |i: usize| f32::from_bits(op.op_params[i] as u32);
    op.type_ == g::GGML_TYPE_F32
        && mask_ok
        && param(1) == 0.0
        && param(2) == 0.0
        && ROWS.contains(&q.ne[1])
        && crate::attn::f16_cache_shape(op, q, k, v)
        && v.ne[0] % 64 == 0
        && {
            let ok = checked().is_some();
            if !ok {
                UNREPRODUCED.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            ok
        }
}

/// The cells a row's mask leaves visible: the first, and one past the last, of the call's
/// `n_kv` (all of them without a mask; `None` where it hides every cell).
fn seen(mask: Option<&[u16]>, n_kv: usize) -> Option<(usize, usize)> {
    let Some(m) = mask else {
        return Some((0, n_kv));
    };
    let visible = |c: &usize| m[*c] != leap_kernels::f16::NEG_INFINITY;
    let first = (0..n_kv).find(visible)?;
    Some((first, (first..n_kv).rfind(visible).map_or(first, |c| c + 1)))
}

/// The key view of a row whose visible cells are `seen` ([`seen`]): llama.cpp pads a call's
/// view to 256 cells past the highest cell in use (`llama_kv_cache::get_n_kv`); for a row, the
/// highest cell it sees (its sequence's past and itself; the rows after it in a verification
/// batch are not in use yet when it is decoded alone). At most the call's view.
fn lone_view(seen: Option<(usize, usize)>, n_kv: usize) -> usize {
    let last = seen.map_or(n_kv, |(_, end)| end);
    n_kv.min(last.next_multiple_of(256).max(256))
}

/// Compute a node [`supports`] took: every query row and head the lone way, with the key view
/// [`lone_view`] gives the row and `threads` for the lone call's thread count (llama.cpp
/// passes a batch its `n_threads_batch`; with the default, the same as a lone row's
/// `n_threads`).
///
/// # Safety
/// `node` is a valid FLASH_ATTN_EXT node that passed [`supports`], its sources holding data.
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    SCRATCH.with(|s| {
        let (qs, scores) = &mut *s.borrow_mut();
        compute_with(node, threads, qs, scores)
    })
}

thread_local! {
    /// A thread's block of [`compute`]'s key dot products, `[cell][query]`, before they are
    /// written across as rows.
    static SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// [`compute`]'s rounded query rows and scores, reused from node to node on the calling
    /// thread (a layer's scores are ~100 KB: an allocation that size can be a fresh mapping
    /// every time).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// [`compute`] with its buffers.
unsafe fn compute_with(
    node: &mut g::ggml_tensor,
    threads: usize,
    qs: &mut Vec<f32>,
    scores: &mut Vec<f32>,
) {
    let arith = checked().expect("supports checked the arithmetic");
    let op = &crate::attn::Operands::of(node);
    let (d, n_q, n_kv) = (op.d, op.n_q, op.n_kv);
    ROWS_COMPUTED.fetch_add(n_q as u64, std::sync::atomic::Ordering::Relaxed);
    let per = op.n_head / op.n_head_kv;
    // Query rows of a KV head `hk`, in the order (row i, head j of the group), rounded to f16
    // as ggml's `from_float`.
    let m = n_q * per;
    // Every element is written below.
    let qs = crate::par::prefix(qs, op.n_head_kv * m * d);
    for hk in 0..op.n_head_kv {
        for i in 0..n_q {
            for j in 0..per {
                let h = hk * per + j;
                let src = std::slice::from_raw_parts(
                    op.q.add(i * op.q_row + h * op.q_head).cast::<f32>(),
                    d,
                );
                let at = ((hk * n_q + i) * per + j) * d;
                leap_kernels::kq::round_f16(src, &mut qs[at..at + d]);
            }
        }
    }
    let masks: Vec<Option<&[u16]>> = (0..n_q)
        .map(|i| {
            (!op.mask.is_null()).then(|| {
                std::slice::from_raw_parts(op.mask.add(i * op.mask_row).cast::<u16>(), n_kv)
            })
        })
        .collect();
    let spans: Vec<Option<(usize, usize)>> = masks.iter().map(|m| seen(*m, n_kv)).collect();
    let views: Vec<usize> = spans.iter().map(|s| lone_view(*s, n_kv)).collect();
    let n = views.iter().copied().max().unwrap_or(0);
    // The cells some row sees (a sliding window hides the view's start from every row): a
    // hidden cell's score is never read.
    let (lo, hi) = spans
        .iter()
        .flatten()
        .fold((n, 0), |(lo, hi), &(a, b)| (lo.min(a), hi.max(b)));
    // Every element is written below where it is read.
    let scores = crate::par::prefix(scores, op.n_head_kv * n * m);
    key_products(op, arith.dot, qs, m, lo..hi, n, threads, scores);
    // Each row's mask as f32 over its view, shared by its heads (zeros where there is none).
    let masks: Vec<Vec<f32>> = masks
        .iter()
        .zip(&views)
        .map(|(mk, &view)| match mk {
            Some(mk) => mk[..view].iter().map(|&h| to_f32(h)).collect(),
            None => vec![0f32; view],
        })
        .collect();
    weighted_values(op, arith.rounding, scores, &masks, n, threads);
}

/// The scores of `cells` (the cells some row sees) into `scores`, `[hk][query][cell]` over
/// views of `n` cells (each row's contiguous for its chunks' pass), for the `m` rounded query
/// rows of each key-value head in `qs`: the cells cut over the threads, each computing its
/// cells' `[cell][query]` block and writing it across.
///
/// # Safety
/// `op`'s pointers hold the node's data; `cells` lies inside its key view.
#[allow(clippy::too_many_arguments)]
unsafe fn key_products(
    op: &crate::attn::Operands,
    dot: Dot,
    qs: &[f32],
    m: usize,
    cells: std::ops::Range<usize>,
    n: usize,
    threads: usize,
    scores: &mut [f32],
) {
    use crate::par::{parallel, Ptr};
    let d = op.d;
    let (lo, span) = (cells.start, cells.len());
    let out = Ptr(scores.as_mut_ptr().cast());
    parallel(threads, &|t, nth| {
        let (c0, c1) = (lo + t * span / nth, lo + (t + 1) * span / nth);
        SUMS.with(|s| {
            let sums = &mut *s.borrow_mut();
            // Every element is written by `dots` before it is read.
            let sums = crate::par::prefix(sums, (c1 - c0) * m);
            for hk in 0..op.n_head_kv {
                dots(
                    dot,
                    op.k.add(hk * op.k_head + c0 * op.k_row),
                    op.k_row,
                    c1 - c0,
                    &qs[hk * m * d..(hk + 1) * m * d],
                    d,
                    sums,
                );
                // SAFETY: cells c0..c1 of each query row of kv head hk: this thread's only.
                leap_kernels::transpose::columns_to(sums, m, c1 - c0, |col| {
                    out.at(((hk * m + col) * n + c0) * 4).cast::<f32>()
                });
            }
        })
    });
}

/// Every (row, head)'s output from its scores (as [`key_products`] lays them out over views of
/// `n` cells) and its row's mask (`masks[i]`, as long as the row's view): the tasks by
/// key-value head and view, so that the rows that read the same values over the same view come
/// together; each thread takes a run of them, and `leap_kernels::lone::rows` walks a run's
/// cells together.
///
/// # Safety
/// `op`'s pointers hold the node's data; every cell a row's view holds is in the value cache.
unsafe fn weighted_values(
    op: &crate::attn::Operands,
    rounding: Rounding,
    scores: &[f32],
    masks: &[Vec<f32>],
    n: usize,
    threads: usize,
) {
    use crate::par::{parallel, Ptr};
    let (dv, n_q, per) = (op.dv, op.n_q, op.n_head / op.n_head_kv);
    let m = n_q * per;
    let dst = Ptr(op.dst);
    let stride = op.v_row / 2;
    let mut order: Vec<(usize, usize, usize)> = (0..op.n_head_kv)
        .flat_map(|hk| (0..n_q).flat_map(move |i| (0..per).map(move |j| (hk, i, j))))
        .collect();
    order.sort_by_key(|&(hk, i, _)| (hk, masks[i].len()));
    let order = &order;
    let tasks = order.len();
    parallel(threads.min(tasks), &|t, nth| {
        let mine = &order[t * tasks / nth..(t + 1) * tasks / nth];
        for run in mine.chunk_by(|a, b| a.0 == b.0 && masks[a.1].len() == masks[b.1].len()) {
            let (hk, i0, _) = run[0];
            let view = masks[i0].len();
            let values = std::slice::from_raw_parts(
                op.v.add(hk * op.v_head).cast::<u16>(),
                if view == 0 {
                    0
                } else {
                    (view - 1) * stride + dv
                },
            );
            let keys: Vec<Keys<'_>> = run
                .iter()
                .map(|&(hk, i, j)| {
                    let at = (hk * m + i * per + j) * n;
                    Keys {
                        scores: &scores[at..at + n],
                        mask: &masks[i],
                    }
                })
                .collect();
            let mut outs: Vec<&mut [f32]> = run
                .iter()
                .map(|&(hk, i, j)| {
                    // SAFETY: row i, head h of dst, this task's only.
                    std::slice::from_raw_parts_mut(
                        dst.at(i * op.dst_row + (hk * per + j) * op.dst_head)
                            .cast::<f32>(),
                        dv,
                    )
                })
                .collect();
            let vals = Values {
                data: values,
                stride,
                dv,
            };
            rows(&keys, op.scale, vals, threads, rounding, &mut outs);
        }
    });
}

/// ggml's `vec_dot_f16` as `dot` sums it: `sums[i * m + k]` = f16 key row i (of `rows` at
/// `x`, `stride` bytes apart) · query row k of `qs` (rows of `d` values already rounded to
/// f16; `m = sums.len() / rows` of them).
///
/// # Safety
/// The CPU runs [`leap_kernels::kq`]'s kernels; `x` holds the rows.
unsafe fn dots(
    dot: Dot,
    x: *const u8,
    stride: usize,
    rows: usize,
    qs: &[f32],
    d: usize,
    sums: &mut [f32],
) {
    match dot {
        Dot::Kq => leap_kernels::kq::kernels()[0](x, stride, rows, qs, d, sums),
        Dot::Zmm => {
            let m = sums.len().checked_div(rows).unwrap_or(0);
            for i in 0..rows {
                let k = std::slice::from_raw_parts(x.add(i * stride).cast::<u16>(), d);
                for (j, q) in qs.chunks_exact(d).take(m).enumerate() {
                    sums[i * m + j] = dot_zmm(k, q);
                }
            }
        }
        Dot::Half => {
            let m = sums.len().checked_div(rows).unwrap_or(0);
            let qh: Vec<u16> = qs[..m * d].iter().map(|&v| from_f32(v)).collect();
            for i in 0..rows {
                let k = std::slice::from_raw_parts(x.add(i * stride).cast::<u16>(), d);
                for (j, (q, h)) in qs
                    .chunks_exact(d)
                    .zip(qh.chunks_exact(d))
                    .take(m)
                    .enumerate()
                {
                    sums[i * m + j] = leap_kernels::lone::dot_half(k, h, q);
                }
            }
        }
    }
}

/// ggml's `vec_dot_f16` of f16 key rows with one query row (rounded to f16 first), as `dot`
/// sums it: `scores[c]` for the `n` cells at `keys`, `stride` halves apart.
///
/// # Safety
/// The CPU runs [`leap_kernels::kq`]'s kernels; `keys` holds the rows.
pub unsafe fn scores(dot: Dot, keys: &[u16], stride: usize, n: usize, q: &[f32], out: &mut [f32]) {
    let dk = q.len();
    let mut qr = vec![0f32; dk];
    leap_kernels::kq::round_f16(q, &mut qr);
    assert!(n == 0 || keys.len() >= (n - 1) * stride + dk);
    dots(
        dot,
        keys.as_ptr().cast(),
        stride * 2,
        n,
        &qr,
        dk,
        &mut out[..n],
    );
}

/// The [`Rounding`] under which [`row`] gives the loaded ggml's `FLASH_ATTN_EXT` output bit for
/// bit for lone rows (split and not, one to three threads, masked cells, Gemma 3's and
/// SmolLM2's head sizes), or `None` when none does (or the CPU does not run Leap's kernels).
pub fn agrees_with_ggml() -> Option<Arith> {
    if !leap_kernels::kq::cpu_ok() {
        return None;
    }
    let cases = cases();
    let wants: Vec<Vec<f32>> = cases.iter().map(|c| c.ggml()).collect::<Option<_>>()?;
    ariths().find(|&r| {
        cases.iter().zip(&wants).all(|(c, want)| {
            c.leap(r)
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        })
    })
}

/// A lone-row attention call to check: random f16 keys and values, a mask hiding a prefix
/// (a sliding window's start) and a tail (cells past the row).
#[derive(Clone)]
struct Case {
    d: usize,
    heads: usize,
    kv_heads: usize,
    n_kv: usize,
    threads: usize,
    scale: f32,
    q: Vec<f32>,
    /// `[cell][kv head][d]`, as llama.cpp's cache lays a layer out.
    k: Vec<u16>,
    v: Vec<u16>,
    mask: Vec<u16>,
}

fn cases() -> Vec<Case> {
    let mut rnd = crate::check_values(0x1A57_0F5E_ED00_0001);
    let mut out = Vec::new();
    for (d, heads, kv_heads) in [(256usize, 4usize, 1usize), (64, 9, 3)] {
        for (n_kv, threads, rising) in [
            (256usize, 2usize, false),
            (512, 2, false),
            (768, 1, true),
            (1024, 2, false),
            (1024, 2, true),
            (1280, 3, false),
        ] {
            let cells = n_kv * kv_heads * d;
            let hidden = (0..n_kv).map(|c| c < n_kv / 7 || c >= n_kv - n_kv / 5);
            let q: Vec<f32> = (0..heads * d).map(|_| rnd(2.0)).collect();
            // Rising: each key leans further toward its group's first query, so that new
            // maxima (the rescaling steps) come often, not only in the first cells.
            let k = (0..cells)
                .map(|i| {
                    let (c, j) = (i / (kv_heads * d), i % (kv_heads * d));
                    let lean = if rising {
                        q[(j / d) * (heads / kv_heads) * d + j % d] * c as f32 / n_kv as f32
                    } else {
                        0.0
                    };
                    from_f32(lean + rnd(2.0))
                })
                .collect();
            out.push(Case {
                d,
                heads,
                kv_heads,
                n_kv,
                threads,
                scale: 1.0 / (d as f32).sqrt(),
                q,
                k,
                v: (0..cells).map(|_| from_f32(rnd(1.0))).collect(),
                mask: hidden
                    .map(|h| from_f32(if h { f32::NEG_INFINITY } else { 0.0 }))
                    .collect(),
            });
        }
    }
    out
}

impl Case {
    /// Leap's output, `[head][d]`.
    fn leap(&self, a: Arith) -> Vec<f32> {
        let (d, per) = (self.d, self.heads / self.kv_heads);
        let stride = self.kv_heads * d;
        let mut out = vec![0f32; self.heads * d];
        let mut s = vec![0f32; self.n_kv];
        let mask: Vec<f32> = self.mask.iter().map(|&h| to_f32(h)).collect();
        for h in 0..self.heads {
            let kvh = h / per;
            // SAFETY: the caller checked the CPU; n_kv rows of `stride` halves from kvh * d.
            unsafe {
                scores(
                    a.dot,
                    &self.k[kvh * d..],
                    stride,
                    self.n_kv,
                    &self.q[h * d..(h + 1) * d],
                    &mut s,
                )
            };
            let keys = Keys {
                scores: &s,
                mask: &mask,
            };
            let vals = Values {
                data: &self.v[kvh * d..],
                stride,
                dv: d,
            };
            row(
                keys,
                self.scale,
                vals,
                self.threads,
                a.rounding,
                &mut out[h * d..(h + 1) * d],
            );
        }
        out
    }

    /// ggml's output on the CPU, `[head][d]`, or `None` when the graph fails.
    fn ggml(&self) -> Option<Vec<f32>> {
        use llama_cpp_sys_2 as sys;
        let (d, nh, nhk, nkv) = (
            self.d as i64,
            self.heads as i64,
            self.kv_heads as i64,
            self.n_kv as i64,
        );
        // SAFETY: a private ggml context sized for the tensors, the graph and its work; every
        // tensor's data is written before the graph runs.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params {
                mem_size: (self.k.len() + self.v.len()) * 2 + (64 << 20),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: false,
            });
            if ctx.is_null() {
                return None;
            }
            let qt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, d, nh, 1);
            let kt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F16, d, nhk, nkv);
            let vt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F16, d, nhk, nkv);
            let mt = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F16, nkv, 1);
            let copy = |t: *mut sys::ggml_tensor, p: *const u8, bytes: usize| {
                std::ptr::copy_nonoverlapping(p, sys::ggml_get_data(t).cast::<u8>(), bytes)
            };
            copy(qt, self.q.as_ptr().cast(), self.q.len() * 4);
            copy(kt, self.k.as_ptr().cast(), self.k.len() * 2);
            copy(vt, self.v.as_ptr().cast(), self.v.len() * 2);
            copy(mt, self.mask.as_ptr().cast(), self.mask.len() * 2);
            let q = sys::ggml_permute(ctx, qt, 0, 2, 1, 3);
            let k = sys::ggml_permute(ctx, kt, 0, 2, 1, 3);
            let v = sys::ggml_permute(ctx, vt, 0, 2, 1, 3);
            let fa = sys::ggml_flash_attn_ext(ctx, q, k, v, mt, self.scale, 0.0, 0.0);
            sys::ggml_flash_attn_ext_set_prec(fa, sys::GGML_PREC_F32);
            let gf = sys::ggml_new_graph(ctx);
            sys::ggml_build_forward_expand(gf, fa);
            let st = sys::ggml_graph_compute_with_ctx(ctx, gf, self.threads as i32);
            let out = (st == sys::GGML_STATUS_SUCCESS).then(|| {
                std::slice::from_raw_parts(
                    sys::ggml_get_data(fa).cast::<f32>(),
                    self.heads * self.d,
                )
                .to_vec()
            });
            sys::ggml_free(ctx);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flash-attention node's sizes: head size, query and key-value heads, cache cells,
    /// query rows, mask rows (the rows padded).
    #[derive(Clone, Copy)]
    struct Shape {
        d: usize,
        heads: usize,
        kv_heads: usize,
        n_kv: usize,
        rows: usize,
        pad: usize,
    }

    /// Random query rows (`[row][head][d]`), keys and values (`[cell][kv head][d]`) for `s`,
    /// and its mask (`[pad][n_kv]`): cell c open to row i where `visible(i, c)`.
    fn operands(
        rnd: &mut impl FnMut(f32) -> f32,
        s: Shape,
        visible: impl Fn(usize, usize) -> bool,
    ) -> (Vec<f32>, Vec<u16>, Vec<u16>, Vec<u16>) {
        let cells = s.n_kv * s.kv_heads * s.d;
        let q: Vec<f32> = (0..s.rows * s.heads * s.d).map(|_| rnd(2.0)).collect();
        let k: Vec<u16> = (0..cells).map(|_| from_f32(rnd(2.0))).collect();
        let v: Vec<u16> = (0..cells).map(|_| from_f32(rnd(1.0))).collect();
        let mask: Vec<u16> = (0..s.pad)
            .flat_map(|i| (0..s.n_kv).map(move |c| (i, c)))
            .map(|(i, c)| {
                from_f32(if i < s.rows && visible(i, c) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                })
            })
            .collect();
        (q, k, v, mask)
    }

    /// ggml's lone row `i` of those operands over the first `view` cells, `[head][d]`.
    fn lone_row(
        s: Shape,
        view: usize,
        threads: usize,
        (q, k, v, mask): (&[f32], &[u16], &[u16], &[u16]),
        i: usize,
    ) -> Vec<f32> {
        let (d, hd, kvd) = (s.d, s.heads * s.d, s.kv_heads * s.d);
        Case {
            d,
            heads: s.heads,
            kv_heads: s.kv_heads,
            n_kv: view,
            threads,
            scale: 1.0 / (d as f32).sqrt(),
            q: q[i * hd..(i + 1) * hd].to_vec(),
            k: k[..view * kvd].to_vec(),
            v: v[..view * kvd].to_vec(),
            mask: mask[i * s.n_kv..i * s.n_kv + view].to_vec(),
        }
        .ggml()
        .unwrap()
    }

    /// The output (`[row][head][d]`) of the device's node over these operands (`q`
    /// `[row][head][d]`, `k`/`v` `[cell][kv head][d]`, `mask` `[pad][n_kv]`) with `threads`
    /// threads (scale 1/sqrt(d)), and ggml's own batch of the same rows.
    fn device_and_batch(
        s: Shape,
        q: &[f32],
        k: &[u16],
        v: &[u16],
        mask: &[u16],
        threads: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        use llama_cpp_sys_2 as sys;
        let Shape {
            d,
            heads,
            kv_heads,
            n_kv,
            rows,
            pad,
        } = s;
        let scale = 1.0 / (d as f32).sqrt();
        // SAFETY: a private ggml context sized for the tensors; data written before use.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params {
                mem_size: (k.len() + v.len() + mask.len()) * 2 + (64 << 20),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: false,
            });
            assert!(!ctx.is_null());
            let (di, nh, nhk) = (d as i64, heads as i64, kv_heads as i64);
            let qt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, di, nh, rows as i64);
            let kt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F16, di, nhk, n_kv as i64);
            let vt = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F16, di, nhk, n_kv as i64);
            let mt = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F16, n_kv as i64, pad as i64);
            for (t, p, bytes) in [
                (qt, q.as_ptr().cast::<u8>(), q.len() * 4),
                (kt, k.as_ptr().cast(), k.len() * 2),
                (vt, v.as_ptr().cast(), v.len() * 2),
                (mt, mask.as_ptr().cast(), mask.len() * 2),
            ] {
                std::ptr::copy_nonoverlapping(p, sys::ggml_get_data(t).cast::<u8>(), bytes);
            }
            let fa = |ctx| {
                let f = sys::ggml_flash_attn_ext(
                    ctx,
                    sys::ggml_permute(ctx, qt, 0, 2, 1, 3),
                    sys::ggml_permute(ctx, kt, 0, 2, 1, 3),
                    sys::ggml_permute(ctx, vt, 0, 2, 1, 3),
                    mt,
                    scale,
                    0.0,
                    0.0,
                );
                sys::ggml_flash_attn_ext_set_prec(f, sys::GGML_PREC_F32);
                f
            };
            let (mine, theirs) = (fa(ctx), fa(ctx));
            let node = &mut *mine.cast::<g::ggml_tensor>();
            let cfg = crate::DeviceConfig {
                lone_attention: true,
                ..crate::DeviceConfig::default()
            };
            assert!(supports(node, &cfg, false));
            assert!(!supports(node, &crate::DeviceConfig::default(), false));
            compute(node, threads);
            let gf = sys::ggml_new_graph(ctx);
            sys::ggml_build_forward_expand(gf, theirs);
            assert_eq!(
                sys::ggml_graph_compute_with_ctx(ctx, gf, threads as i32),
                sys::GGML_STATUS_SUCCESS
            );
            let out = |t| {
                std::slice::from_raw_parts(sys::ggml_get_data(t).cast::<f32>(), rows * heads * d)
                    .to_vec()
            };
            let r = (out(mine), out(theirs));
            sys::ggml_free(ctx);
            r
        }
    }

    /// Some rounding reproduces the loaded ggml's lone-row flash attention bit for bit, and the
    /// way a few-row call computes the same row (one chunk over every key) does not: the check
    /// can tell the two apart.
    #[test]
    fn reproduces_ggml_lone_rows() {
        if !leap_kernels::kq::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let r = agrees_with_ggml().expect("a rounding that reproduces ggml");
        // scripts/aarch64 runs this against a ggml built with FP16 arithmetic too, and says so.
        if std::env::var_os("LEAP_GGML_HALF").is_some() {
            assert!(
                r.rounding.half > 0,
                "{r:?}: not the half-precision arithmetic"
            );
        }
        let cases = cases();
        let mut split_differs = false;
        for c in cases
            .iter()
            .filter(|c| c.n_kv >= SPLIT_FROM && c.threads > 1)
        {
            let want = c.ggml().unwrap();
            let one_chunk = Case {
                threads: 1,
                ..c.clone()
            }
            .leap(r);
            split_differs |= one_chunk
                .iter()
                .zip(&want)
                .any(|(a, b)| a.to_bits() != b.to_bits());
        }
        assert!(
            split_differs,
            "one chunk over every key gave ggml's lone rows too"
        );
        let matching: Vec<Arith> = ariths()
            .filter(|&r| {
                cases.iter().all(|c| {
                    let want = c.ggml().unwrap();
                    c.leap(r)
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                })
            })
            .collect();
        eprintln!("arithmetic matching ggml: {matching:?}");
        assert!(matching.contains(&r));
    }

    /// The device's node of several rows gives every row what ggml gives it alone over the
    /// key view a lone call at its position has (rows on both sides of a 256-cell boundary, so
    /// their views differ), where ggml's own batch of the same rows does not.
    #[test]
    fn device_rows_are_ggml_lone_rows() {
        if checked().is_none() {
            eprintln!("no lone-row rounding here (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let mut rnd = crate::check_values(0x0DEF_ACED_0BAD_CAFE);
        for (d, heads, kv_heads) in [(256usize, 4usize, 1usize), (64, 9, 3)] {
            let (n_kv, rows, threads, pad) = (1024usize, 6usize, 2usize, 64usize);
            let first = 764;
            let shape = Shape {
                d,
                heads,
                kv_heads,
                n_kv,
                rows,
                pad,
            };
            // Row i at cell first + i sees its past from cell 50 (no row sees the first 50), a
            // window's start hidden on odd rows.
            let (q, k, v, mask) = operands(&mut rnd, shape, |i, c| {
                c <= first + i && c >= 50 && (i.is_multiple_of(2) || c >= 200)
            });
            let (device, batch) = device_and_batch(shape, &q, &k, &v, &mask, threads);
            let mut batch_differs = false;
            for i in 0..rows {
                let view = (first + i + 1).next_multiple_of(256);
                let lone = lone_row(shape, view, threads, (&q, &k, &v, &mask), i);
                let (got, theirs) = (
                    &device[i * heads * d..(i + 1) * heads * d],
                    &batch[i * heads * d..(i + 1) * heads * d],
                );
                assert!(
                    got.iter()
                        .zip(&lone)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "head size {d}, row {i} (view {view}): the device's row is not ggml's lone row"
                );
                batch_differs |= theirs
                    .iter()
                    .zip(&lone)
                    .any(|(a, b)| a.to_bits() != b.to_bits());
            }
            assert!(
                batch_differs,
                "ggml's batch gave the lone rows too: nothing to reproduce"
            );
        }
    }

    /// A sequence's first rows (a one- or two-token prompt's) see fewer cells than the device
    /// has threads: a thread's share of the key products is empty, and each row is still
    /// ggml's lone row. (llama-server with `--spec-type leap` on SmolLM2 stopped on its first
    /// request here: the AVX2 key kernel divided by its zero cache rows.)
    #[test]
    fn rows_seeing_fewer_cells_than_threads_are_lone_rows() {
        if checked().is_none() {
            eprintln!("no lone-row rounding here (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let mut rnd = crate::check_values(0x0F1E_57CE_11A5_0002);
        for (d, heads, kv_heads) in [(256usize, 4usize, 1usize), (64, 9, 3)] {
            for (rows, threads) in [(1usize, 2usize), (1, 3), (2, 3)] {
                let (n_kv, pad) = (256usize, 64usize);
                let shape = Shape {
                    d,
                    heads,
                    kv_heads,
                    n_kv,
                    rows,
                    pad,
                };
                // Row i at cell i sees cells 0..=i.
                let (q, k, v, mask) = operands(&mut rnd, shape, |i, c| c <= i);
                let (device, _) = device_and_batch(shape, &q, &k, &v, &mask, threads);
                for i in 0..rows {
                    let lone = lone_row(shape, n_kv, threads, (&q, &k, &v, &mask), i);
                    let got = &device[i * heads * d..(i + 1) * heads * d];
                    assert!(
                        got.iter()
                            .zip(&lone)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "head size {d}, {threads} threads, row {i}: not ggml's lone row"
                    );
                }
            }
        }
    }
}

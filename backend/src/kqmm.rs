//! Attention's two matrix products over ggml's f16 KV cache without flash attention
//! (`kq = K x Q` and `kqv = Vᵀ x softmax(kq)`) on the device, in batches of up to 4096 rows,
//! with the kernels of [`leap_kernels::kq`] (where their speed and their bit-for-bit match with
//! ggml's `ggml_vec_dot_f16` are described): here is what ggml's graph needs, which nodes the
//! device takes, how a node is split over threads, which terms of KQV's softmax rows it leaves
//! out (whole kernel steps of zeros: `span`), which cells of `kq` it leaves uncomputed (those
//! the attention mask hides from every query row: `mask_of`), and the check against the ggml
//! this process loaded before the device claims any.

use leap_kernels::kq;

use std::ffi::c_void;

use crate::ffi as g;
use crate::par::{parallel, Ptr};

/// Most rows of a batch taken: decoding's one (its 4 heads share the cache rows),
/// verification's few and prefill's batches, as the device's matrix products. With query
/// groups outer a group's rows stay in L1 whatever the batch; taking prefill's too made Leap's
/// prefill 20-33% faster (see "Prefill" in
/// `docs/measurements.md`).
const MAX_ROWS: i64 = 4096;

/// Whether the device computes `op`: an f16 x f32 `MUL_MAT` with contiguous rows, `src0`
/// broadcast over `src1`'s third dimension, of 1 to [`MAX_ROWS`] rows, on a CPU that runs the
/// kernels (x86-64: AVX2/FMA/F16C; AArch64: all) where they passed [`agrees_with_ggml`].
pub(crate) fn supports(op: &g::ggml_tensor) -> bool {
    if op.op != g::GGML_OP_MUL_MAT || op.type_ != g::GGML_TYPE_F32 || !checked() {
        return false;
    }
    let (s0, s1) = (op.src[0], op.src[1]);
    if s0.is_null() || s1.is_null() {
        return false;
    }
    // SAFETY: ggml's sources of a node are valid tensors.
    let (s0, s1) = unsafe { (&*s0, &*s1) };
    s0.type_ == g::GGML_TYPE_F16
        && s1.type_ == g::GGML_TYPE_F32
        && s0.ne[0] == s1.ne[0]
        && s0.ne[3] == 1
        && s1.ne[3] == 1
        && s0.ne[2] >= 1
        && s1.ne[2] % s0.ne[2] == 0
        && (1..=MAX_ROWS).contains(&s1.ne[1])
        && s0.nb[0] == 2
        && s1.nb[0] == 4
        && op.nb[0] == 4
}

/// The CPU runs the kernels and they passed [`agrees_with_ggml`] (checked once per process).
fn checked() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let ok = agrees_with_ggml();
        if kq::cpu_ok() && !ok {
            log::warn!("Leap's f16 attention products do not reproduce ggml's vec_dot_f16 here; not using them");
        }
        ok
    })
}

/// Compute `node` (which [`supports`] accepted) with `threads` threads; `mask` is the
/// attention mask its scores go through ([`mask_of`]), if known.
///
/// # Safety
/// `node` is a valid, allocated MUL_MAT node whose sources hold their data; `mask`, when
/// given, is [`mask_of`]'s for it.
pub(crate) unsafe fn compute(
    node: &mut g::ggml_tensor,
    threads: usize,
    mask: Option<&g::ggml_tensor>,
) {
    SCRATCH.with(|s| {
        let (q, qt) = (&mut s.queries.borrow_mut(), &mut s.lanes.borrow_mut());
        compute_with(node, threads, mask, q, qt)
    });
}

/// Nodes after a `kq` product searched for the softmax that reads it.
const MASK_LOOKAHEAD: i32 = 4;

/// The attention mask of `node` (node `i` of `cgraph`) when it is attention's scores `kq`
/// and the softmax that reads them comes within [`MASK_LOOKAHEAD`] nodes with a mask the
/// device can read: f32 or f16, a row per query token at least as long as the cache, the
/// same for every head. A cell the mask hides (-inf) for every query row of a chunk leaves
/// its scores out of the softmax whatever they are (`x * scale - inf` is -inf, `exp` of it 0,
/// for any finite score), so [`compute`] leaves such cells' products uncomputed and writes 0
/// there: Gemma 3's sliding-window layers hide all but 512 cells of a full-size cache.
///
/// # Safety
/// `node` is node `i` of the valid graph `cgraph`.
pub(crate) unsafe fn mask_of<'a>(
    node: &g::ggml_tensor,
    cgraph: *mut g::ggml_cgraph,
    i: i32,
) -> Option<&'a g::ggml_tensor> {
    let (s1, n) = (&*node.src[1], g::ggml_graph_n_nodes(cgraph));
    if s1.op == g::GGML_OP_SOFT_MAX {
        return None;
    }
    let me: *const g::ggml_tensor = node;
    let soft = (i + 1..n.min(i + 1 + MASK_LOOKAHEAD))
        .map(|j| &*g::ggml_graph_node(cgraph, j))
        .find(|t| t.op == g::GGML_OP_SOFT_MAX && std::ptr::eq(t.src[0], me))?;
    let mask = soft.src[1].as_ref()?;
    let size = match mask.type_ {
        g::GGML_TYPE_F32 => 4,
        g::GGML_TYPE_F16 => 2,
        _ => return None,
    };
    let usable = mask.ne[0] >= node.ne[0]
        && mask.ne[1] >= node.ne[1]
        && mask.ne[2] == 1
        && mask.ne[3] == 1
        && mask.nb[0] == size
        && !mask.data.is_null();
    usable.then_some(mask)
}

/// The cells `lo..hi` from the first that `mask` (see [`mask_of`]) leaves visible to any of
/// query tokens `tokens` to the last, of `n` cells; `(0, 0)` when it hides all.
///
/// # Safety
/// `mask` is [`mask_of`]'s: rows of at least `n` values for every token of `tokens`.
unsafe fn visible(
    mask: &g::ggml_tensor,
    tokens: impl Iterator<Item = usize>,
    n: usize,
) -> (usize, usize) {
    let (mut lo, mut hi) = (usize::MAX, 0);
    for t in tokens {
        let row = (mask.data as *const u8).add(t * mask.nb[1]);
        let hidden = |c: usize| {
            if mask.type_ == g::GGML_TYPE_F16 {
                *row.cast::<u16>().add(c) == leap_kernels::f16::NEG_INFINITY
            } else {
                *row.cast::<f32>().add(c) == f32::NEG_INFINITY
            }
        };
        if let Some(first) = (0..n).find(|&c| !hidden(c)) {
            let last = (first..n)
                .rev()
                .find(|&c| !hidden(c))
                .expect("first is visible");
            lo = lo.min(first);
            hi = hi.max(last + 1);
        }
    }
    if lo < hi {
        (lo, hi)
    } else {
        (0, 0)
    }
}

/// Buffers reused from node to node: the rounded query rows and their layout for the
/// query-lanes kernel (on the calling thread), and a block's sums (on each worker, the calling
/// thread among them).
struct Scratch {
    queries: std::cell::RefCell<Vec<f32>>,
    lanes: std::cell::RefCell<Vec<f32>>,
    sums: std::cell::RefCell<Vec<f32>>,
}

thread_local! {
    static SCRATCH: Scratch = const {
        Scratch {
            queries: std::cell::RefCell::new(Vec::new()),
            lanes: std::cell::RefCell::new(Vec::new()),
            sums: std::cell::RefCell::new(Vec::new()),
        }
    };
}

/// Query rows from which a chunk of 64-value rows goes to [`kq::lanes`]' kernel: it lays
/// the rows out once per node and fills registers of sixteen query rows (eight with AVX2), so a
/// lone row's three (SmolLM2) would leave most lanes empty; an 8-row verification's 24 fill one
/// and a half (three).
const LANES_ROWS: usize = 8;

/// Query rows per chunk: a prefill's softmax rows are cut into runs this long, each computed
/// over the span its own rows need.
const CHUNK: usize = 16;

/// A run of consecutive query rows `k0..k0 + len` of `src0` matrix `i02` (rows counted within
/// the matrix's `r2 * ne11`), computed over elements `s..e` of their rows only and stored,
/// rounded, at `off` in `q` in rows of `e - s`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Chunk {
    i02: usize,
    k0: usize,
    len: usize,
    s: usize,
    e: usize,
    off: usize,
}

/// The range `lo..hi` from the first term of `row` that is not zero to its last (empty when
/// all are zero; a NaN is not zero).
///
/// Sixteen terms at a time without stopping inside them, so that the test is vector code: a
/// sliding-window row leads with hundreds of zeros and a cache longer than the context ends
/// with them (Gemma's 8-row `kqv`: 32 such rows a layer).
fn nonzero(row: &[f32]) -> (usize, usize) {
    const W: usize = 16;
    let any = |c: &[f32]| c.iter().fold(false, |a, &v| a | (v != 0.0));
    let Some(first) = row.chunks(W).position(any) else {
        return (0, 0);
    };
    let nonzero = "the chunk has a nonzero term";
    let lo = first * W
        + row[first * W..]
            .iter()
            .position(|&v| v != 0.0)
            .expect(nonzero);
    // `rchunks` counts from the end: chunk k ends at `len - k * W`.
    let last = row.rchunks(W).position(any).expect(nonzero);
    let end = row.len() - last * W;
    let start = end.saturating_sub(W);
    let hi = start
        + row[start..end]
            .iter()
            .rposition(|&v| v != 0.0)
            .expect(nonzero)
        + 1;
    (lo, hi)
}

/// The elements `s..e` rows with nonzero ranges `ranges` (of `n` elements) must be computed
/// over: whole steps of the kernels ([`kq::STEP`]) from the row's start, to the row's end at
/// most; `(0, 0)` when every term is zero. Left out are whole steps of zeros and zero
/// leftovers: each of them would have added zero to a sum, so every result keeps its bits.
/// (Unless the cache holds an infinity or a NaN in a left-out step: ggml's `0 * inf` makes
/// its sum NaN, the span's stays finite. llama.cpp clears its cache when it allocates it, so
/// only an f16 overflow of the model's own values could put one there.)
fn span(ranges: &[(usize, usize)], n: usize) -> (usize, usize) {
    let (lo, hi) = ranges
        .iter()
        .filter(|(l, h)| l < h)
        .fold((usize::MAX, 0), |(a, b), &(l, h)| (a.min(l), b.max(h)));
    if lo >= hi {
        return (0, 0);
    }
    let e = hi.div_ceil(kq::STEP) * kq::STEP;
    (lo / kq::STEP * kq::STEP, e.min(n))
}

/// The chunks of `ne02` matrices of `per` query rows each, for rows whose nonzero ranges are
/// `ranges` (row `i02 * per + k`; none: every row whole), consecutive chunks of equal span
/// merged (a `kq` node's query rows have no zeros: one chunk a matrix). Returns them and the
/// length of `q` they need.
fn chunks(
    ne02: usize,
    per: usize,
    n: usize,
    ranges: Option<&[(usize, usize)]>,
) -> (Vec<Chunk>, usize) {
    let mut out: Vec<Chunk> = Vec::new();
    let mut off = 0;
    for i02 in 0..ne02 {
        for k0 in (0..per).step_by(CHUNK) {
            let len = CHUNK.min(per - k0);
            let (s, e) = match ranges {
                Some(r) => span(&r[i02 * per + k0..][..len], n),
                None => (0, n),
            };
            match out.last_mut() {
                Some(c) if c.i02 == i02 && (c.s, c.e) == (s, e) => c.len += len,
                _ => out.push(Chunk {
                    i02,
                    k0,
                    len,
                    s,
                    e,
                    off,
                }),
            }
            off += len * (e - s);
        }
    }
    (out, off)
}

/// `sums[i * c.len + k]` = f16 row i (of `sums.len() / c.len` at `x`, `stride` bytes apart, of
/// the whole row length) · chunk `c`'s query row k, which `q` holds (as [`chunks`] placed it),
/// over the chunk's span.
///
/// # Safety
/// As `dots`: the CPU runs it and `x` holds the rows up to the span's end.
unsafe fn chunk_dots(
    dots: kq::Dots,
    x: *const u8,
    stride: usize,
    c: &Chunk,
    q: &[f32],
    sums: &mut [f32],
) {
    let w = c.e - c.s;
    if w == 0 {
        // Every term zero: ggml's sum is +0.
        sums.fill(0.0);
    } else {
        dots(
            x.add(c.s * 2),
            stride,
            sums.len() / c.len,
            &q[c.off..c.off + c.len * w],
            w,
            sums,
        );
    }
}

/// Each chunk's start in `qt` if the query-lanes kernel takes it (`kernel`: the CPU has one;
/// 64-value rows met by at least [`LANES_ROWS`] query rows, SmolLM2's keys in a
/// verification), its query rows (in `q`, as [`chunks`] placed them) laid out for it there one
/// chunk after another.
fn lanes_layout(
    kernel: bool,
    chunks: &[Chunk],
    q: &[f32],
    qt: &mut Vec<f32>,
) -> Vec<Option<usize>> {
    qt.clear();
    chunks
        .iter()
        .map(|c| {
            (kernel && c.e - c.s == kq::LANES_N && c.len >= LANES_ROWS).then(|| {
                let start = qt.len();
                kq::lanes_queries(&q[c.off..c.off + c.len * kq::LANES_N], c.len, qt);
                start
            })
        })
        .collect()
}

/// `s1`'s query rows (`n` values each, matrices of `per` rows sharing one of the `ne02` cache
/// matrices) in chunks ([`chunks`]: a softmax's rows over the span of their nonzero terms),
/// rounded through f16 as ggml's conversion does into `q`, each chunk's rows over its span one
/// after another; returns the chunks and the length of `q` they fill.
///
/// # Safety
/// `s1` is [`compute`]'s node's `src[1]`, holding its data.
unsafe fn rounded_queries(
    s1: &g::ggml_tensor,
    n: usize,
    ne02: usize,
    per: usize,
    threads: usize,
    q: &mut Vec<f32>,
) -> (Vec<Chunk>, usize) {
    let (ne11, ne12) = (s1.ne[1] as usize, s1.ne[2] as usize);
    let rows = ne12 * ne11;
    let (src, src_nb1, src_nb2) = (Ptr(s1.data.cast()), s1.nb[1], s1.nb[2]);
    let src_row = |row: usize| {
        let (i12, i11) = (row / ne11, row % ne11);
        std::slice::from_raw_parts(src.at(i12 * src_nb2 + i11 * src_nb1).cast::<f32>(), n)
    };
    // A prefill batch's rows and a verification's (KQV's are the softmax's rows, a cache
    // length each: Gemma's 8-row call has 32 of them) on every thread; a lone row's on this
    // one (a region costs ~0.5 us, a row's pass over 1,000 values about as much).
    let par = threads > 1 && rows * n >= 1 << 14;
    let each = |f: &(dyn Fn(usize) + Sync)| {
        if par {
            parallel(threads.min(rows), &|tid, nth| {
                (tid * rows / nth..(tid + 1) * rows / nth).for_each(f)
            });
        } else {
            (0..rows).for_each(f);
        }
    };
    // A softmax row is zero where the mask hides a cell (past a causal row's position, before
    // a sliding window): KQV leaves those terms out, a chunk of rows at a time.
    let ranges = (s1.op == g::GGML_OP_SOFT_MAX).then(|| {
        let mut r = vec![(0usize, 0usize); rows];
        let out = Ptr(r.as_mut_ptr().cast());
        // SAFETY: element `row` of `r`, written by this call only.
        each(&|row| {
            *out.at(row * std::mem::size_of::<(usize, usize)>()).cast() = nonzero(src_row(row))
        });
        r
    });
    let (chunks, len) = chunks(ne02, per, n, ranges.as_deref());
    // Query rows rounded through f16 as ggml's conversion does, each chunk's rows over its
    // span, one after another.
    // Every element of the first `len` is written below.
    let out = Ptr(crate::par::prefix(q, len).as_mut_ptr().cast());
    let per_matrix = per.div_ceil(CHUNK);
    let chunk_of = |row: usize| {
        let (i02, k) = (row / per, row % per);
        // Chunks only merge, so the one holding row k is at or before the unmerged index.
        let guess = (i02 * per_matrix + k / CHUNK).min(chunks.len() - 1);
        let c = chunks[..=guess]
            .iter()
            .rposition(|c| c.i02 == i02 && c.k0 <= k)
            .expect("every row is in a chunk");
        (chunks[c], k)
    };
    each(&|row| {
        let (c, k) = chunk_of(row);
        let w = c.e - c.s;
        // SAFETY: row k's place in chunk c's part of `q`, written by this call only.
        let dst =
            std::slice::from_raw_parts_mut(out.at((c.off + (k - c.k0) * w) * 4).cast::<f32>(), w);
        kq::round_f16(&src_row(row)[c.s..c.e], dst);
    });
    (chunks, len)
}

/// [`compute`] with `q` for the query rows and `qt` for their query-lanes layout.
unsafe fn compute_with(
    node: &mut g::ggml_tensor,
    threads: usize,
    mask: Option<&g::ggml_tensor>,
    q: &mut Vec<f32>,
    qt: &mut Vec<f32>,
) {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let n = s0.ne[0] as usize;
    let (ne01, ne02) = (s0.ne[1] as usize, s0.ne[2] as usize);
    let (ne11, ne12) = (s1.ne[1] as usize, s1.ne[2] as usize);
    let r2 = ne12 / ne02;
    let rows = ne12 * ne11;
    // Query rows ordered (i12, i11): those sharing `src0` matrix i02 are consecutive, `per` of
    // them.
    let per = r2 * ne11;
    let (chunks, len) = rounded_queries(s1, n, ne02, per, threads, q);
    let q = &q[..len];
    // Tasks: blocks of `src0` rows, every matrix (KV head) of a block together (the heads of a
    // cache row share its cache lines); at least 4 blocks per thread, so that no thread waits
    // long for the others (SmolLM2's kqv has 64 rows a head), and at most 64 rows a block.
    // Only the cells some query token sees (all without a mask): the rest of every output
    // row is 0 (see `mask_of`), and the tasks share the visible ones.
    let (lo, hi) = mask.map_or((0, ne01), |m| visible(m, 0..ne11, ne01));
    let (dst, dst_nb1, dst_nb2) = (Ptr(node.data.cast()), node.nb[1], node.nb[2]);
    // Output rows `rows` (of ne12 * ne11) zero outside lo..hi.
    let hidden_zero = |rows: std::ops::Range<usize>| {
        if (lo, hi) == (0, ne01) {
            return;
        }
        for r in rows {
            let (i12, i11) = (r / ne11, r % ne11);
            let row = dst.at(i12 * dst_nb2 + i11 * dst_nb1).cast::<f32>();
            // SAFETY: row (i11, i12) of dst holds ne01 floats; its cells outside lo..hi are
            // written here only (the tasks write lo..hi).
            std::slice::from_raw_parts_mut(row, lo).fill(0.0);
            let hi = hi.max(lo);
            std::slice::from_raw_parts_mut(row.add(hi), ne01 - hi).fill(0.0);
        }
    };
    let span = hi.saturating_sub(lo);
    let block = span.div_ceil(4 * threads).clamp(4, 64);
    let tasks = span.div_ceil(block);
    // Query rows split over the threads instead of cache rows, where each thread's share is
    // [`BY_ROWS`] rows or more and the cache has a matrix per thread at least (so a thread
    // reads at most one more matrix than its share): each thread then writes whole output rows,
    // the rows the softmax after `kq` and the rounding of `kqv`'s query rows give the same
    // thread (both split rows as `tid * rows / nth`), so the scores stay in that core's
    // caches from product to product instead of crossing to the other core twice a layer.
    let by_rows = threads > 1 && rows >= BY_ROWS * threads && ne02 >= threads;
    let chunks = if by_rows {
        split_at(&chunks, per, (1..threads).map(|t| t * rows / threads))
    } else {
        chunks
    };
    let dots = kq::kernels()[0];
    let lanes_kernel = kq::lanes();
    let lanes = lanes_layout(lanes_kernel.is_some(), &chunks, q, qt);
    let qt = &qt[..];
    let (x0, nb01, nb02) = (Ptr(s0.data.cast()), s0.nb[1], s0.nb[2]);
    // Block `b` of cache rows against chunk `c`.
    let work = |b: usize, c: &Chunk, lanes: Option<usize>, sums: &mut Vec<f32>| {
        let (r0, r1) = (lo + b * block, (lo + (b + 1) * block).min(hi));
        sums.resize((r1 - r0) * c.len, 0.0);
        let sums = &mut sums[..(r1 - r0) * c.len];
        let x = x0.at(c.i02 * nb02 + r0 * nb01);
        match (lanes_kernel, lanes) {
            // SAFETY: the CPU runs it (`kq::lanes`); rows r0..r1 of matrix i02, 64 values
            // from the span's start; `qt` from `start` laid out for the chunk's rows.
            (Some(kernel), Some(start)) => {
                kernel(x.add(c.s * 2), nb01, r1 - r0, &qt[start..], c.len, sums)
            }
            _ => chunk_dots(dots, x, nb01, c, q, sums),
        }
        // Each output row's run r0..r1 in address order, eight rows at a time (stores
        // scattered over every row went 4 KB apart on Gemma's 1024 cells and stalled).
        // SAFETY: elements (r0..r1, i11, i12) of dst; tasks write disjoint elements.
        leap_kernels::transpose::columns_to(sums, c.len, r1 - r0, |kk| {
            let k = c.k0 + kk;
            let (i12, i11) = (c.i02 * r2 + k / ne11, k % ne11);
            dst.at(i12 * dst_nb2 + i11 * dst_nb1 + r0 * 4).cast::<f32>()
        });
    };
    let out_rows = ne12 * ne11;
    let nth = if by_rows { threads } else { threads.min(tasks) };
    let shares = leap_host::par::Shares::new(tasks, nth);
    parallel(nth, &|tid, nth| {
        let mine = tid * out_rows / nth..(tid + 1) * out_rows / nth;
        hidden_zero(mine.clone());
        SCRATCH.with(|s| {
            let sums = &mut s.sums.borrow_mut();
            if by_rows {
                // The chunks that start in this thread's rows (`split_at` cut them at every
                // thread's first row), each over every block of cache rows.
                for (c, &lanes) in chunks.iter().zip(&lanes) {
                    if mine.contains(&(c.i02 * per + c.k0)) {
                        (0..tasks).for_each(|b| work(b, c, lanes, sums));
                    }
                }
                return;
            }
            // A contiguous run of blocks per thread (each streams through its part of the
            // cache in address order, which the hardware prefetchers follow), then what is
            // left of the others' (`leap_host::par::Shares`).
            for b in shares.iter(tid) {
                for (c, &lanes) in chunks.iter().zip(&lanes) {
                    work(b, c, lanes, sums);
                }
            }
        })
    });
}

/// Query rows a thread takes at least where [`compute`] splits a node's query rows over the
/// threads: an 8-row verification's 72 (SmolLM2: 24 a KV head) are 36 a thread, a 2-row
/// call's 18 stay split by cache rows.
const BY_ROWS: usize = 16;

/// `chunks` (of matrices of `per` query rows, [`chunks`]'s) with each chunk that holds one of
/// the rows `at` (counted over all matrices) cut there, its second part starting at it.
fn split_at(chunks: &[Chunk], per: usize, at: impl Iterator<Item = usize> + Clone) -> Vec<Chunk> {
    let mut out = Vec::with_capacity(chunks.len() + at.clone().count());
    for c in chunks {
        let (first, w) = (c.i02 * per + c.k0, c.e - c.s);
        let mut k0 = c.k0;
        for a in at.clone().filter(|&a| a > first && a < first + c.len) {
            let k = a - c.i02 * per;
            out.push(Chunk {
                k0,
                len: k - k0,
                off: c.off + (k0 - c.k0) * w,
                ..*c
            });
            k0 = k;
        }
        out.push(Chunk {
            k0,
            len: c.k0 + c.len - k0,
            off: c.off + (k0 - c.k0) * w,
            ..*c
        });
    }
    out
}

/// ggml's f16 `vec_dot` of one row of `n` halves at `x` with one at `y` (nrc = 1, as its
/// `mul_mat` calls it): what the kernels are checked and timed against.
///
/// # Safety
/// `x` and `y` each hold `n` f16 values.
unsafe fn ggml_dot(
    vec_dot: unsafe extern "C" fn(
        i32,
        *mut f32,
        usize,
        *const c_void,
        usize,
        *const c_void,
        usize,
        i32,
    ),
    n: usize,
    x: *const u8,
    y: *const u16,
) -> f32 {
    let mut s = 0f32;
    vec_dot(n as i32, &mut s, 0, x.cast(), 0, y.cast(), 0, 1);
    s
}

/// ggml's CPU traits for f16 (its `vec_dot` and `from_float`), after ggml's CPU init.
fn f16_traits() -> &'static g::ggml_type_traits_cpu {
    // SAFETY: static traits table; idempotent init.
    unsafe {
        g::ggml_cpu_init();
        &*g::ggml_get_type_traits_cpu(g::GGML_TYPE_F16)
    }
}

/// Whether [`compute`]'s arithmetic reproduces ggml's own `vec_dot_f16` (with ggml's f32 to
/// f16 conversion of the query) bit for bit, on pseudo-random rows of several lengths (with
/// and without leftovers past ggml's steps, shorter than one step too) and magnitudes, in
/// groups of every size, for every kernel the CPU runs.
pub fn agrees_with_ggml() -> bool {
    if !kq::cpu_ok() {
        return false;
    }
    let tr = f16_traits();
    let (Some(vec_dot), Some(from)) = (tr.vec_dot, tr.from_float) else {
        return false;
    };
    let mut rnd = crate::check_values(0x9E37_79B9_7F4A_7C15u64);
    for n in [7usize, 64, 256, 1000, 1024, 1057] {
        // Three cache rows: the wide kernel takes them as a pair and a single; for 64-value
        // rows 35: the query-lanes kernel's blocks of sixteen, twice, and a short one.
        let rows = if n == 64 { 35 } else { 3 };
        let x: Vec<u16> = (0..rows * n)
            .map(|i| crate::f16::from_f32(rnd(1.0 + (i % 7) as f32)))
            .collect();
        let raw: Vec<f32> = (0..33 * n)
            .map(|i| rnd(if i % 5 == 0 { 30.0 } else { 0.3 }))
            .collect();
        let mut qs = vec![0f32; raw.len()];
        // SAFETY: the CPU runs the kernels; slices of equal length.
        unsafe { kq::round_f16(&raw, &mut qs) };
        let mut h = vec![0u16; raw.len()];
        // SAFETY: slices of raw.len() elements.
        unsafe { from(raw.as_ptr(), h.as_mut_ptr().cast(), raw.len() as i64) };
        // The rounded query is ggml's (no NaN here: `to_f32` widens the rest exactly).
        if h.iter()
            .zip(&qs)
            .any(|(&h, q)| crate::f16::to_f32(h).to_bits() != q.to_bits())
        {
            return false;
        }
        // Query rows past the wide kernel's groups of four and six too: the groups of an
        // 8-row call's 24 (SmolLM2) and 32 (Gemma) query rows a cache row, and a lone last one.
        // The query-lanes kernel for 64-value rows, in every query count (one or two
        // registers, full or not), the device's from `LANES_ROWS`.
        for m in (1..=9).chain([16, 17, 24, 32, 33]) {
            let mut results: Vec<Vec<f32>> = kq::kernels()
                .iter()
                .map(|dots| {
                    let mut got = vec![0f32; rows * m];
                    // SAFETY: the CPU runs the kernels; `rows` rows of n f16 at x.
                    unsafe { dots(x.as_ptr().cast(), 2 * n, rows, &qs[..m * n], n, &mut got) };
                    got
                })
                .collect();
            if let Some(lanes) = kq::lanes().filter(|_| n == kq::LANES_N) {
                let mut qt = Vec::new();
                kq::lanes_queries(&qs[..m * n], m, &mut qt);
                let mut got = vec![0f32; rows * m];
                // SAFETY: the CPU runs it; `rows` rows of 64 f16 at x; qt made for m rows.
                unsafe { lanes(x.as_ptr().cast(), 2 * n, rows, &qt, m, &mut got) };
                results.push(got);
            }
            for got in results {
                for k in 0..m {
                    for r in 0..rows {
                        // SAFETY: rows of n elements.
                        let want = unsafe {
                            ggml_dot(vec_dot, n, x[r * n..].as_ptr().cast(), h[k * n..].as_ptr())
                        };
                        if want.to_bits() != got[r * m + k].to_bits() {
                            return false;
                        }
                    }
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use leap_kernels::kq;

    /// Every kernel the CPU runs (x86-64: 256-bit, and 32 registers where the CPU has
    /// AVX-512VL; AArch64: NEON) gives ggml's `vec_dot_f16` bit for bit, in every group size
    /// and with leftovers past ggml's last step.
    #[test]
    fn products_match_ggml_vec_dot_f16() {
        if !kq::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        assert!(super::agrees_with_ggml());
    }

    /// Attention's products of grouped heads as ggml's graph has them (`kq`, its softmax
    /// under a causal mask, `kqv` over the transposed values; `kq` alone where the device has
    /// no softmax rows), computed by the device node by node on 1 and 2 threads, give ggml's
    /// CPU backend's result bit for bit: a lone row (its
    /// cache rows split over the threads), an 8-row verification and a 40-row batch (their
    /// query rows split, a KV head's rows cut between the threads, the batch's inside one of
    /// its chunks of 16).
    #[test]
    fn attention_nodes_match_ggml() {
        use crate::ffi as g;
        use llama_cpp_sys_2 as sys;
        if !kq::cpu_ok() || !super::checked() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        // Without the device's softmax rows (AArch64's), `kq` alone.
        let softmax = crate::softmax::exp().is_some();
        let mut rnd = crate::check_values(0x1F83_D9AB_FB41_BD6B);
        let (d, cells, kv_heads, heads) = (64i64, 256i64, 3i64, 9i64);
        for tokens in [1i64, 8, 40] {
            let ctx = crate::check::Ctx::new().expect("a ggml context");
            // SAFETY: tensors of the context, filled within their sizes; nodes of its graph.
            unsafe {
                let half = |ne: [i64; 3], rnd: &mut dyn FnMut(f32) -> f32| {
                    let t = sys::ggml_new_tensor_3d(ctx.0, sys::GGML_TYPE_F16, ne[0], ne[1], ne[2]);
                    let n = (ne[0] * ne[1] * ne[2]) as usize;
                    let h = std::slice::from_raw_parts_mut(sys::ggml_get_data(t).cast::<u16>(), n);
                    h.iter_mut()
                        .for_each(|v| *v = crate::f16::from_f32(rnd(1.0)));
                    t
                };
                let k = half([d, cells, kv_heads], &mut rnd);
                let vt = half([cells, d, kv_heads], &mut rnd);
                let q = ctx.tensor([d, tokens, heads, 1], &mut || rnd(1.0));
                // Token t sees cells up to 200 + t.
                let mask = sys::ggml_new_tensor_2d(ctx.0, sys::GGML_TYPE_F16, cells, tokens);
                let m = std::slice::from_raw_parts_mut(
                    sys::ggml_get_data(mask).cast::<u16>(),
                    (cells * tokens) as usize,
                );
                for (i, v) in m.iter_mut().enumerate() {
                    let (t, c) = (i as i64 / cells, i as i64 % cells);
                    *v = if c <= 200 + t {
                        0
                    } else {
                        leap_kernels::f16::NEG_INFINITY
                    };
                }
                let kq = sys::ggml_mul_mat(ctx.0, k, q);
                let out = if softmax {
                    let soft = sys::ggml_soft_max_ext(ctx.0, kq, mask, 0.125, 0.0);
                    sys::ggml_mul_mat(ctx.0, vt, soft)
                } else {
                    kq
                };
                let want = ctx.ggml(out).expect("ggml computes the graph");
                let compute = |node: &mut g::ggml_tensor, threads: usize| match node.op {
                    g::GGML_OP_MUL_MAT => {
                        assert!(super::supports(node));
                        super::compute(node, threads, None)
                    }
                    g::GGML_OP_SOFT_MAX => crate::softmax::compute(node, threads),
                    op => panic!("op {op} in attention's graph"),
                };
                assert!(
                    ctx.device(out.cast(), &want, &compute),
                    "{tokens} tokens (softmax and kqv: {softmax}): the device differs from ggml"
                );
            }
        }
    }

    /// A chunk's span: whole steps from the row's start around its rows' nonzero terms, to
    /// the row's end at most; nothing when every term is zero.
    #[test]
    fn spans_are_whole_steps_around_the_nonzero_terms() {
        let st = kq::STEP;
        assert_eq!(super::span(&[(0, 0), (0, 0)], 100), (0, 0));
        assert_eq!(super::span(&[(st + 3, st + 4)], 10 * st), (st, 2 * st));
        assert_eq!(
            super::span(&[(st + 3, st + 4), (5, 6)], 10 * st),
            (0, 2 * st)
        );
        assert_eq!(super::span(&[(2 * st, 3 * st)], 10 * st), (2 * st, 3 * st));
        // Past the last whole step: the leftovers go to the row's end.
        assert_eq!(
            super::span(&[(st, 3 * st + 1)], 3 * st + 5),
            (st, 3 * st + 5)
        );
        assert_eq!(
            super::nonzero(&[0.0, -0.0, 1.0, 0.0, f32::NAN, 0.0]),
            (2, 5)
        );
        assert_eq!(super::nonzero(&[0.0, -0.0]), (0, 0));
        // Rows longer than the 16 terms tested at once, with their first and last nonzero
        // terms at every place around those boundaries, against a term-by-term scan.
        let simple = |row: &[f32]| match row.iter().position(|&v| v != 0.0) {
            None => (0, 0),
            Some(lo) => (lo, row.iter().rposition(|&v| v != 0.0).unwrap() + 1),
        };
        for n in [1usize, 15, 16, 17, 33, 64, 100] {
            for lo in 0..n {
                for hi in [lo, lo + 1, lo + 17, n - 1].into_iter().filter(|&h| h < n) {
                    let mut row = vec![0.0f32; n];
                    row[lo] = if lo % 3 == 0 { f32::NAN } else { -2.5 };
                    row[hi.max(lo)] = 1.0;
                    if n > 2 {
                        row[n / 2] = -0.0;
                    }
                    assert_eq!(super::nonzero(&row), simple(&row), "{n} {lo} {hi}");
                }
            }
            assert_eq!(super::nonzero(&vec![0.0; n]), (0, 0));
        }
    }

    /// Softmax rows as a prefill's are (zero before a sliding window and past each row's
    /// position, one row all zero), cut into chunks ([`super::chunks`]) and computed over their
    /// spans only, give ggml's `vec_dot_f16` of the whole rows bit for bit, nonzero leftovers
    /// past the last step included, with every kernel the CPU runs.
    #[test]
    fn softmax_rows_over_their_spans_match_ggml_vec_dot_f16() {
        if !kq::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let tr = super::f16_traits();
        let (vec_dot, from) = (tr.vec_dot.unwrap(), tr.from_float.unwrap());
        let mut rnd = crate::check_values(0x5851_F42D_4C95_7F2D);
        // Cache rows (Vᵀ's rows), two matrices of 37 query rows.
        const ROWS: usize = 3;
        let (ne02, per) = (2usize, 37usize);
        for n in [40usize, 100, 1024, 1057] {
            let x: Vec<u16> = (0..ROWS * n)
                .map(|i| crate::f16::from_f32(rnd(1.0 + (i % 5) as f32)))
                .collect();
            let mut raw = vec![0f32; ne02 * per * n];
            let mut ranges = Vec::new();
            for row in 0..ne02 * per {
                let t = row % per;
                let hi = ((t + 2) * n / per + row % 3).min(n);
                let lo = hi.saturating_sub(n / 3 + 5);
                if t != per / 2 {
                    for v in &mut raw[row * n + lo..row * n + hi] {
                        *v = rnd(1.0).abs() + 1e-3;
                    }
                }
                ranges.push(super::nonzero(&raw[row * n..][..n]));
            }
            let (chunks, len) = super::chunks(ne02, per, n, Some(&ranges));
            assert!(
                chunks.iter().any(|c| c.e - c.s < n) && chunks.iter().any(|c| c.e == n),
                "{n}: {chunks:?}"
            );
            let mut q = vec![0f32; len];
            for c in &chunks {
                let w = c.e - c.s;
                for k in 0..c.len {
                    let row = c.i02 * per + c.k0 + k;
                    // SAFETY: the CPU runs the kernels; slices of w elements.
                    unsafe {
                        kq::round_f16(
                            &raw[row * n + c.s..row * n + c.e],
                            &mut q[c.off + k * w..][..w],
                        )
                    };
                }
            }
            let mut h = vec![0u16; raw.len()];
            // SAFETY: slices of raw.len() elements.
            unsafe { from(raw.as_ptr(), h.as_mut_ptr().cast(), raw.len() as i64) };
            for &dots in kq::kernels() {
                for c in &chunks {
                    let mut sums = vec![f32::NAN; ROWS * c.len];
                    // SAFETY: the CPU runs the kernels; ROWS rows of n f16 at x.
                    unsafe { super::chunk_dots(dots, x.as_ptr().cast(), 2 * n, c, &q, &mut sums) };
                    for k in 0..c.len {
                        let row = c.i02 * per + c.k0 + k;
                        for r in 0..ROWS {
                            // SAFETY: rows of n elements.
                            let want = unsafe {
                                super::ggml_dot(
                                    vec_dot,
                                    n,
                                    x[r * n..].as_ptr().cast(),
                                    h[row * n..].as_ptr(),
                                )
                            };
                            assert_eq!(
                                sums[r * c.len + k].to_bits(),
                                want.to_bits(),
                                "n {n}, query row {row}, cache row {r}, {c:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Of a NaN cache element and a NaN query element (always ggml's `0x7e00` once rounded),
    /// the result keeps the payload ggml's armv8-a build keeps: the cache's within its steps of
    /// 16 (`fmla` returns its first NaN operand), the query's in the leftovers (gcc's `fmul`
    /// has the query first).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn nan_payloads_match_ggml_vec_dot_f16() {
        let tr = super::f16_traits();
        let (vec_dot, from) = (tr.vec_dot.unwrap(), tr.from_float.unwrap());
        const N: usize = 21;
        // Cache row 0: a signalling NaN in the first step; row 1: a quiet one in the leftovers.
        let mut x = vec![0x3c00u16; 2 * N];
        x[3] = 0x7d01;
        x[N + 18] = 0xff21;
        // Query row 0: a NaN on row 0's; query row 1: on row 1's.
        let mut raw = vec![0.5f32; 2 * N];
        raw[3] = f32::from_bits(0x7fa0_0001);
        raw[N + 18] = f32::from_bits(0xffc0_4321);
        let mut qs = vec![0f32; 2 * N];
        let mut h = vec![0u16; 2 * N];
        // SAFETY: slices of 2N elements; the CPU runs the kernels (all AArch64 CPUs).
        unsafe {
            kq::round_f16(&raw, &mut qs);
            from(raw.as_ptr(), h.as_mut_ptr().cast(), 2 * N as i64);
        }
        for dots in kq::kernels() {
            let mut got = [0f32; 4];
            // SAFETY: two rows of N f16 at x.
            unsafe { dots(x.as_ptr().cast(), 2 * N, 2, &qs, N, &mut got) };
            for (i, got) in got.iter().enumerate() {
                let (r, k) = (i / 2, i % 2);
                // SAFETY: rows of N elements.
                let want = unsafe {
                    super::ggml_dot(vec_dot, N, x[r * N..].as_ptr().cast(), h[k * N..].as_ptr())
                };
                assert_eq!(got.to_bits(), want.to_bits(), "row {r} query {k}: {want:?}");
            }
            assert!(got[0].is_nan() && got[3].is_nan());
        }
    }

    /// The query rows are rounded as ggml's f16 `from_float` rounds them, on every exponent
    /// with the rounding bits just below, at and above halfway, on pseudo-random bit patterns
    /// (half subnormals, overflow to infinity), and on NaNs (both give a NaN).
    #[test]
    fn query_rounding_matches_ggml_from_float() {
        if !kq::cpu_ok() {
            eprintln!("the CPU does not run the kernels (x86-64 needs AVX2/FMA/F16C)");
            return;
        }
        let from = super::f16_traits().from_float.expect("f16 from_float");
        let mut rng = leap_kernels::rng::XorShift::new(0x2545_F491_4F6C_DD1D);
        let mut bits: Vec<u32> = (0..1u32 << 19)
            .flat_map(|i| [0, 1, 0xfff, 0x1000, 0x1001, 0x1fff].map(|low| i << 13 | low))
            .collect();
        bits.extend((0..1 << 20).map(|_| (rng.next() >> 32) as u32));
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut got = vec![0f32; x.len()];
        // SAFETY: checked above; slices of equal length.
        unsafe { kq::round_f16(&x, &mut got) };
        let mut want = vec![0u16; x.len()];
        // SAFETY: slices of x.len() elements.
        unsafe { from(x.as_ptr(), want.as_mut_ptr().cast(), x.len() as i64) };
        for ((&x, &g), &w) in x.iter().zip(&got).zip(&want) {
            let w = crate::f16::to_f32(w);
            if x.is_nan() {
                assert!(g.is_nan() && w.is_nan(), "{x:?}");
            } else {
                assert_eq!(g.to_bits(), w.to_bits(), "{x:e} ({:#x})", x.to_bits());
            }
        }
    }
}

//! The small ops between a layer's products on the device: RMS norm, multiply, add, scale,
//! the copy of attention's permuted output into rows (`CONT`) and RoPE, each bit for bit as
//! ggml's CPU backend computes it.
//!
//! Their arithmetic is a few operations an element. What they cost in a decoding call is the
//! switch of backends around them: ggml's scheduler cuts a layer's graph wherever the device's
//! nodes and the CPU backend's meet, and each CPU split is a graph of its own (a plan, a
//! thread pool made and freed, a parallel region, a barrier a node): 2-5 us with two threads
//! on the EPYC VM for a split whose arithmetic takes 0.3 us, and Gemma 3's one-token graph had 181
//! splits, SmolLM2's 361. With these ops on the device a layer is one split, and a one-row
//! node runs on the calling thread (the other thread has nothing to do in a one-row norm in
//! either backend).
//!
//! Each op is the same IEEE operations on the same operands as ggml's (`ggml-cpu/ops.cpp`):
//! - RMS norm: the squares summed in order in f64 (each square rounded to f32 first), then
//!   `scale = 1 / sqrtf((float)(sum / n) + eps)` and `y = x * scale` (ggml's fused norm and
//!   multiply rounds `x * scale` before the weight's product too);
//! - multiply, add, scale (without a bias) and the copy: one operation, or none, an element;
//! - RoPE: ggml's cache of `cosf`/`sinf` of `theta`, `theta` multiplied by
//!   `powf(base, -2 / n_dims)` from the position pair by pair, then the rotation. Where
//!   ggml's build has FMA the compiler may fuse either product of `x0 cos - x1 sin` and
//!   `x0 sin + x1 cos` into the other's sum; which it did is a property of the build, so the
//!   device runs ggml's own op once for each rotation mode ([`rope_fusion`]) and keeps the
//!   rotation that matches it, or leaves that mode's RoPE to ggml.
//!
//! [`checked`] runs ggml's ops on data that tells the roundings apart before the device
//! claims any of them.

use std::sync::OnceLock;

use crate::check::Ctx;
use crate::ffi as g;
use crate::par::{parallel, Ptr};

/// Elements below which a node runs on the calling thread: a parallel region costs more than
/// a one-row call's norm or rotation.
const SERIAL: usize = 16384;

/// The graph's last norm (its weight's product), whose output is the hidden state Leap's
/// on-demand projection reads.
const OUTPUT_NORM: &[u8] = b"result_norm";

/// Whether the device computes `op` (one of the ops above, f32, in the shapes ggml's CPU
/// backend computes them row by row), where [`checked`] passed. The output norm's product
/// only if `take_output` ([`crate::DeviceConfig::take_output`]): it stays in ggml's split with
/// the output projection, where Leap's on-demand projection stops the graph (ggml's scheduler
/// stops only the split the eval callback stops in, so a projection in a split after the
/// device's would still run).
pub(crate) fn supports(op: &g::ggml_tensor, take_output: bool) -> bool {
    if !take_output && op.op == g::GGML_OP_MUL && crate::named(op, OUTPUT_NORM) {
        return false;
    }
    let ok = match op.op {
        g::GGML_OP_RMS_NORM => norm_ok(op),
        g::GGML_OP_MUL | g::GGML_OP_ADD => binary_ok(op),
        g::GGML_OP_SCALE => scale_ok(op),
        g::GGML_OP_CONT => cont_ok(op),
        g::GGML_OP_ROPE => {
            rope_ok(op) && Rope::of(op).is_some_and(|r| rope_fusion(r.neox).is_some())
        }
        _ => false,
    };
    ok && checked()
}

/// f32 with contiguous elements (rows may be strided).
fn f32_rows(t: &g::ggml_tensor) -> bool {
    t.type_ == g::GGML_TYPE_F32 && t.nb[0] == 4
}

/// # Safety
/// `op` is a valid node.
unsafe fn src(op: &g::ggml_tensor, i: usize) -> Option<&g::ggml_tensor> {
    op.src[i].as_ref()
}

fn norm_ok(op: &g::ggml_tensor) -> bool {
    // SAFETY: ggml's sources of a node are valid tensors or null.
    let Some(s0) = (unsafe { src(op, 0) }) else {
        return false;
    };
    f32_rows(op) && f32_rows(s0) && op.ne == s0.ne && f32::from_bits(op.op_params[0] as u32) >= 0.0
}

fn binary_ok(op: &g::ggml_tensor) -> bool {
    // SAFETY: as above.
    let (Some(s0), Some(s1)) = (unsafe { src(op, 0) }, unsafe { src(op, 1) }) else {
        return false;
    };
    f32_rows(op)
        && f32_rows(s0)
        && f32_rows(s1)
        && op.ne == s0.ne
        && (0..4).all(|d| s1.ne[d] > 0 && s0.ne[d] % s1.ne[d] == 0)
}

fn scale_ok(op: &g::ggml_tensor) -> bool {
    // SAFETY: as above.
    let Some(s0) = (unsafe { src(op, 0) }) else {
        return false;
    };
    let bias = f32::from_bits(op.op_params[1] as u32);
    f32_rows(op)
        && f32_rows(s0)
        && op.ne == s0.ne
        && bias == 0.0
        // SAFETY: valid tensors.
        && unsafe { g::ggml_is_contiguous(op) && g::ggml_is_contiguous(s0) }
}

fn cont_ok(op: &g::ggml_tensor) -> bool {
    // SAFETY: as above.
    let Some(s0) = (unsafe { src(op, 0) }) else {
        return false;
    };
    op.type_ == g::GGML_TYPE_F32
        && s0.type_ == g::GGML_TYPE_F32
        && op.ne.iter().product::<i64>() == s0.ne.iter().product::<i64>()
        && s0.ne[0] > 0
        // SAFETY: a valid tensor.
        && unsafe { g::ggml_is_contiguous(op) }
}

/// ggml's `GGML_ROPE_TYPE_NEOX` (llama.h's `LLAMA_ROPE_TYPE_NEOX` is defined as it).
const NEOX: i32 = llama_cpp_sys_2::LLAMA_ROPE_TYPE_NEOX;

/// RoPE's parameters, as `ggml_rope_ext` stores them in `op_params`.
#[derive(Clone, Copy, Debug)]
struct Rope {
    n_dims: usize,
    neox: bool,
    freq_base: f32,
    freq_scale: f32,
    attn_factor: f32,
    n_offs: usize,
}

impl Rope {
    fn of(op: &g::ggml_tensor) -> Option<Rope> {
        let p = &op.op_params;
        let f = |i: usize| f32::from_bits(p[i] as u32);
        let neox = match p[2] {
            0 => false,
            m if m == NEOX => true,
            _ => return None,
        };
        let (n_dims, n_offs) = (usize::try_from(p[1]).ok()?, usize::try_from(p[15]).ok()?);
        // YaRN's ramp (ext_factor) is not reproduced.
        (f(7) == 0.0 && n_dims > 0 && n_dims % 2 == 0 && n_offs % 2 == 0).then_some(Rope {
            n_dims,
            neox,
            freq_base: f(5),
            freq_scale: f(6),
            attn_factor: f(8),
            n_offs,
        })
    }
}

fn rope_ok(op: &g::ggml_tensor) -> bool {
    // SAFETY: as above.
    let (Some(s0), Some(s1)) = (unsafe { src(op, 0) }, unsafe { src(op, 1) }) else {
        return false;
    };
    let Some(r) = Rope::of(op) else { return false };
    op.src[2].is_null()
        && f32_rows(op)
        && f32_rows(s0)
        && op.ne == s0.ne
        && s1.type_ == g::GGML_TYPE_I32
        && s1.ne[0] == s0.ne[2]
        && s0.ne[0] % 2 == 0
        && r.n_offs + r.n_dims <= s0.ne[0] as usize
}

/// Which products of RoPE's rotation ggml's build fuses into the following sum (an FMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fuse {
    /// Both products rounded, then the sum.
    None,
    /// The first product (`x0 cos`, `x0 sin`) fused: `fma(x0, c, -(x1 s))`.
    First,
    /// The second product fused: `fma(-x1, s, x0 c)`, `fma(x1, c, x0 s)`.
    Second,
}

/// The fusions of the two outputs of a rotation (`x0 cos - x1 sin`, `x0 sin + x1 cos`).
pub type Fusion = (Fuse, Fuse);

/// `a * b + c * d` with the fusion `f` (`sub` negates `c * d`).
#[inline(always)]
fn pair_sum(f: Fuse, a: f32, b: f32, c: f32, d: f32) -> f32 {
    match f {
        Fuse::None => a * b + c * d,
        Fuse::First => a.mul_add(b, c * d),
        Fuse::Second => c.mul_add(d, a * b),
    }
}

/// Whether this CPU computes `mul_add` with one instruction (else the fused rotations would
/// call libm's `fmaf` element by element: correct, but slower than ggml).
fn fma_in_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(target_arch = "aarch64")]
    {
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The loaded ggml's RoPE fusion for one rotation mode (NeoX's halves or pairs of
/// neighbours), found once per process ([`rope_fusion_of_ggml`]): a compiler may vectorize one
/// mode's loop and not the other's, and fuse them differently.
fn rope_fusion(neox: bool) -> Option<Fusion> {
    static F: [OnceLock<Option<Fusion>>; 2] = [OnceLock::new(), OnceLock::new()];
    *F[usize::from(neox)].get_or_init(|| {
        let f = rope_fusion_of_ggml(neox);
        let mode = if neox { "NeoX" } else { "pairwise" };
        match f {
            None => log::warn!("Leap's {mode} RoPE does not reproduce ggml's here; not using it"),
            Some(f) => log::debug!("ggml's {mode} RoPE rotation: {f:?}"),
        }
        f
    })
}

/// The ops other than RoPE passed [`agrees_with_ggml`] (checked once per process).
fn checked() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let ok = agrees_with_ggml();
        if !ok {
            log::warn!(
                "Leap's norms and element-wise ops do not reproduce ggml's here; not using them"
            );
        }
        ok
    })
}

/// A tensor's shape and strides, for the threads.
#[derive(Clone, Copy)]
struct Shape {
    ne: [usize; 4],
    nb: [usize; 4],
}

impl Shape {
    fn of(t: &g::ggml_tensor) -> Shape {
        Shape {
            ne: t.ne.map(|n| n as usize),
            nb: t.nb,
        }
    }

    /// Row `r`'s indices in dimensions 1-3 (rows counted over them).
    fn index(&self, r: usize) -> [usize; 3] {
        let (n1, n2) = (self.ne[1], self.ne[2]);
        [r % n1, (r / n1) % n2, r / (n1 * n2)]
    }

    /// Byte offset of row `r`.
    fn row_at(&self, r: usize) -> usize {
        let [i1, i2, i3] = self.index(r);
        i1 * self.nb[1] + i2 * self.nb[2] + i3 * self.nb[3]
    }

    fn rows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }
}

/// Run `work(r)` for rows `0..rows` of `n` elements each: on the calling thread for a small
/// node, else in contiguous runs on `threads` threads.
fn for_rows(rows: usize, n: usize, threads: usize, work: &(dyn Fn(usize) + Sync)) {
    if rows * n < SERIAL || threads <= 1 || rows == 1 {
        (0..rows).for_each(work);
    } else {
        parallel(threads.min(rows), &|tid, nth| {
            (tid * rows / nth..(tid + 1) * rows / nth).for_each(work);
        });
    }
}

/// Compute `node` (which [`supports`] accepted) with `threads` threads.
///
/// # Safety
/// `node` is a valid, allocated node of one of these ops whose sources hold their data.
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    match node.op {
        g::GGML_OP_RMS_NORM => rms_norm(node, threads),
        g::GGML_OP_MUL => binary(node, threads, |a, b| a * b),
        g::GGML_OP_ADD => binary(node, threads, |a, b| a + b),
        g::GGML_OP_SCALE => scale(node, threads),
        g::GGML_OP_CONT => cont(node, threads),
        g::GGML_OP_ROPE => {
            let neox = Rope::of(node).expect("checked in supports").neox;
            rope(
                node,
                threads,
                rope_fusion(neox).expect("checked in supports"),
            )
        }
        op => unreachable!("rowops::compute of op {op}"),
    }
}

/// # Safety
/// As [`compute`].
unsafe fn rms_norm(node: &mut g::ggml_tensor, threads: usize) {
    let s0 = &*node.src[0];
    let eps = f32::from_bits(node.op_params[0] as u32);
    let n = s0.ne[0] as usize;
    let (x, y) = (Ptr(s0.data.cast()), Ptr(node.data.cast()));
    let (s0, dst) = (Shape::of(s0), Shape::of(node));
    let rows = dst.rows();
    // Rows in groups of NORM_ROWS: each row's sum is a chain of f64 additions in ggml's
    // order, and a group's chains run side by side.
    let groups = rows.div_ceil(NORM_ROWS);
    for_rows(groups, n * NORM_ROWS, threads, &|grp| {
        let r0 = grp * NORM_ROWS;
        let last = (r0 + NORM_ROWS).min(rows) - 1;
        // Rows past the last repeat it (their sums are not used).
        let xs: [*const f32; NORM_ROWS] = std::array::from_fn(|k| {
            x.at(s0.row_at((r0 + k).min(last)))
                .cast::<f32>()
                .cast_const()
        });
        // SAFETY: each row holds n floats.
        let sums = unsafe { squares(xs, n) };
        for (k, &sum) in sums.iter().enumerate().take(last + 1 - r0) {
            let mean = (sum / n as f64) as f32;
            let scale = 1.0f32 / (mean + eps).sqrt();
            let (x, y) = (xs[k], y.at(dst.row_at(r0 + k)).cast::<f32>());
            // SAFETY: row r0 + k of each tensor holds n floats; rows are disjoint between
            // threads (the output may be the input itself: each element is read before it is
            // written, and its sum was taken before).
            for i in 0..n {
                unsafe { *y.add(i) = *x.add(i) * scale };
            }
        }
    });
}

/// Rows an RMS norm sums side by side.
const NORM_ROWS: usize = 8;

/// ggml's sum of squares of each of `NORM_ROWS` rows of `n` floats: `sum += (double)(x * x)`
/// from the first element to the last.
///
/// # Safety
/// Each pointer is valid for `n` floats.
#[inline(never)]
unsafe fn squares(xs: [*const f32; NORM_ROWS], n: usize) -> [f64; NORM_ROWS] {
    let mut sums = [0f64; NORM_ROWS];
    for i in 0..n {
        for k in 0..NORM_ROWS {
            let v = *xs[k].add(i);
            sums[k] += f64::from(v * v);
        }
    }
    sums
}

/// # Safety
/// As [`compute`].
unsafe fn binary(node: &mut g::ggml_tensor, threads: usize, op: impl Fn(f32, f32) -> f32 + Sync) {
    let (a, b, y) = (
        Ptr((*node.src[0]).data.cast()),
        Ptr((*node.src[1]).data.cast()),
        Ptr(node.data.cast()),
    );
    let (s0, s1, dst) = (
        Shape::of(&*node.src[0]),
        Shape::of(&*node.src[1]),
        Shape::of(node),
    );
    let (n, n1) = (dst.ne[0], s1.ne[0]);
    for_rows(dst.rows(), n, threads, &|r| {
        let [i1, i2, i3] = s0.index(r);
        let off1 =
            (i1 % s1.ne[1]) * s1.nb[1] + (i2 % s1.ne[2]) * s1.nb[2] + (i3 % s1.ne[3]) * s1.nb[3];
        // SAFETY: row r of src0 and dst hold n floats, src1's broadcast row n1 (n a multiple
        // of it); rows are disjoint between threads (dst may be src0 itself).
        unsafe {
            let (x, w, y) = (
                a.at(s0.row_at(r)).cast::<f32>(),
                b.at(off1).cast::<f32>(),
                y.at(dst.row_at(r)).cast::<f32>(),
            );
            if n1 == n {
                // Sixteen at a time through registers (the output may be an input itself, so
                // the compiler would not vectorize the plain loop): each element read before
                // it is written.
                let whole = n / 16 * 16;
                for i in (0..whole).step_by(16) {
                    let a: [f32; 16] = x.add(i).cast::<[f32; 16]>().read_unaligned();
                    let b: [f32; 16] = w.add(i).cast::<[f32; 16]>().read_unaligned();
                    let c: [f32; 16] = std::array::from_fn(|k| op(a[k], b[k]));
                    y.add(i).cast::<[f32; 16]>().write_unaligned(c);
                }
                for i in whole..n {
                    *y.add(i) = op(*x.add(i), *w.add(i));
                }
            } else {
                for i in 0..n {
                    *y.add(i) = op(*x.add(i), *w.add(i % n1));
                }
            }
        }
    });
}

/// # Safety
/// As [`compute`].
unsafe fn scale(node: &mut g::ggml_tensor, threads: usize) {
    let s0 = &*node.src[0];
    let s = f32::from_bits(node.op_params[0] as u32);
    let (x, y) = (Ptr(s0.data.cast()), Ptr(node.data.cast()));
    let (s0, dst) = (Shape::of(s0), Shape::of(node));
    let n = dst.ne[0];
    for_rows(dst.rows(), n, threads, &|r| {
        // SAFETY: contiguous tensors of the same shape; rows disjoint between threads.
        unsafe {
            let (x, y) = (
                x.at(s0.row_at(r)).cast::<f32>(),
                y.at(dst.row_at(r)).cast::<f32>(),
            );
            for i in 0..n {
                *y.add(i) = *x.add(i) * s;
            }
        }
    });
}

/// # Safety
/// As [`compute`].
unsafe fn cont(node: &mut g::ggml_tensor, threads: usize) {
    let s0 = &*node.src[0];
    let (x, y) = (Ptr(s0.data.cast()), Ptr(node.data.cast()));
    // The source's elements in order into the contiguous destination (whose shape may group
    // them otherwise: `ggml_cont_2d` of a permuted view).
    let s0 = Shape::of(s0);
    let n = s0.ne[0];
    for_rows(s0.rows(), n, threads, &|r| {
        // SAFETY: row r of the source (its elements nb[0] apart) and the destination's
        // elements r * n.. (as many as the source's); rows disjoint between threads.
        unsafe {
            let (x, y) = (x.at(s0.row_at(r)), y.at(r * n * 4).cast::<f32>());
            if s0.nb[0] == 4 {
                std::ptr::copy_nonoverlapping(x.cast::<f32>(), y, n);
            } else {
                for i in 0..n {
                    *y.add(i) = x.add(i * s0.nb[0]).cast::<f32>().read_unaligned();
                }
            }
        }
    });
}

/// ggml's cache of a position's rotations: `cos` and `sin` of each pair's angle, `2 * i`
/// and `2 * i + 1`, for the `ne0 / 2` pairs of a row.
fn rope_cache(r: &Rope, p: i32, ne0: usize, cache: &mut [f32]) {
    let theta_scale = r.freq_base.powf(-2.0f32 / r.n_dims as f32);
    let mut theta = p as f32;
    for i0 in (0..ne0).step_by(2) {
        // ggml: theta / ff (ff 1 without frequency factors), then freq_scale * that.
        let t = r.freq_scale * theta;
        cache[i0] = t.cos() * r.attn_factor;
        cache[i0 + 1] = t.sin() * r.attn_factor;
        theta *= theta_scale;
    }
}

/// What a position's rotations depend on: its parameters' bits and the row's length.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct RotationsKey {
    pos: i32,
    ne0: usize,
    n_dims: usize,
    params: [u32; 3],
}

thread_local! {
    /// Rotations computed on this thread ([`rope_cache`]), by position and parameters: every
    /// layer with the same parameters (Gemma 3's two sets, SmolLM2's one) rotates a position
    /// by the same angles, each a `cosf` and a `sinf`, so they are computed once, not once a
    /// node.
    static ROTATIONS: std::cell::RefCell<std::collections::HashMap<RotationsKey, Box<[f32]>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Positions' rotations [`ROTATIONS`] keeps before it starts over.
const ROTATIONS_KEPT: usize = 1024;

/// The rotations of position `p` for rows of `ne0` ([`rope_cache`]) in `kept` ([`ROTATIONS`]'s
/// map on this thread), computed there the first time.
fn rotations<'m>(
    kept: &'m mut std::collections::HashMap<RotationsKey, Box<[f32]>>,
    r: &Rope,
    p: i32,
    ne0: usize,
) -> &'m [f32] {
    let key = RotationsKey {
        pos: p,
        ne0,
        n_dims: r.n_dims,
        params: [r.freq_base, r.freq_scale, r.attn_factor].map(f32::to_bits),
    };
    if !kept.contains_key(&key) && kept.len() >= ROTATIONS_KEPT {
        kept.clear();
    }
    kept.entry(key).or_insert_with(|| {
        let mut cache = vec![0f32; ne0];
        rope_cache(r, p, ne0, &mut cache);
        cache.into()
    })
}

/// One row's rotation (`ne0` elements at `x`, written at `y`) from `cache`.
///
/// # Safety
/// `x` and `y` hold `ne0` floats; `r.n_offs + r.n_dims <= ne0`.
#[inline(always)]
unsafe fn rotate(r: &Rope, fusion: Fusion, cache: &[f32], x: *const f32, y: *mut f32, ne0: usize) {
    let (f0, f1) = fusion;
    let (xs, ys) = (x.add(r.n_offs), y.add(r.n_offs));
    let half = r.n_dims / 2;
    for i0 in (0..r.n_dims).step_by(2) {
        let (ic, off) = if r.neox { (i0 / 2, half) } else { (i0, 1) };
        let (c, s) = (cache[i0], cache[i0 + 1]);
        let (x0, x1) = (*xs.add(ic), *xs.add(ic + off));
        *ys.add(ic) = pair_sum(f0, x0, c, -x1, s);
        *ys.add(ic + off) = pair_sum(f1, x0, s, x1, c);
    }
    // The channels past the rotated ones are copied.
    for i in (0..r.n_offs).chain(r.n_offs + r.n_dims..ne0) {
        *y.add(i) = *x.add(i);
    }
}

/// [`rotate`] where `mul_add` is one instruction (on x86-64, compiled for FMA).
///
/// # Safety
/// As [`rotate`]; on x86-64 the CPU has FMA.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "fma"))]
unsafe fn rotate_fma(
    r: &Rope,
    fusion: Fusion,
    cache: &[f32],
    x: *const f32,
    y: *mut f32,
    ne0: usize,
) {
    rotate(r, fusion, cache, x, y, ne0)
}

/// # Safety
/// As [`compute`]; `fusion` needs no FMA or the CPU has it ([`rope_fusion_of_ggml`]).
unsafe fn rope(node: &mut g::ggml_tensor, threads: usize, fusion: Fusion) {
    let (s0, s1) = (&*node.src[0], &*node.src[1]);
    let r = Rope::of(node).expect("checked in supports");
    let pos = std::slice::from_raw_parts(s1.data as *const i32, s1.ne[0] as usize);
    let (x, y) = (Ptr(s0.data.cast()), Ptr(node.data.cast()));
    let (s0, dst) = (Shape::of(s0), Shape::of(node));
    let ne0 = dst.ne[0];
    let fused = fusion != (Fuse::None, Fuse::None);
    let rows = dst.rows();
    let run = |range: std::ops::Range<usize>| {
        ROTATIONS.with(|kept| {
            let kept = &mut kept.borrow_mut();
            let (mut cache, mut last): (&[f32], usize) = (&[], usize::MAX);
            for row in range {
                let [_, i2, _] = dst.index(row);
                if i2 != last {
                    cache = rotations(kept, &r, pos[i2], ne0);
                    last = i2;
                }
                // SAFETY: row `row` of the source and destination hold ne0 floats; rows are
                // disjoint between threads.
                unsafe {
                    let (xr, yr) = (
                        x.at(s0.row_at(row)).cast::<f32>().cast_const(),
                        y.at(dst.row_at(row)).cast::<f32>(),
                    );
                    if fused {
                        rotate_fma(&r, fusion, cache, xr, yr, ne0);
                    } else {
                        rotate(&r, fusion, cache, xr, yr, ne0);
                    }
                }
            }
        })
    };
    if rows * ne0 < SERIAL || threads <= 1 || rows == 1 {
        run(0..rows);
    } else {
        parallel(threads.min(rows), &|tid, nth| {
            run(tid * rows / nth..(tid + 1) * rows / nth)
        });
    }
}

/// Whether the device's ops give ggml's result for `out`.
///
/// # Safety
/// As [`Ctx::device`].
unsafe fn same(ctx: &Ctx, out: *mut llama_cpp_sys_2::ggml_tensor) -> bool {
    ctx.ggml(out).is_some_and(|want| {
        ctx.device(out, &want, &|n, t| {
            // SAFETY: the graph's nodes are this module's ops, allocated with data.
            unsafe { compute(n, t) }
        })
    })
}

/// Values for the checks: spread over several magnitudes, with zeros, a negative zero,
/// subnormals and large values.
fn values(seed: u64) -> impl FnMut() -> f32 {
    let mut rnd = crate::check_values(seed);
    let mut i = 0u32;
    move || {
        i += 1;
        match i % 97 {
            5 => 0.0,
            6 => -0.0,
            7 => 1.0e-40,
            8 => 3.0e4,
            k => rnd(if k % 3 == 0 { 200.0 } else { 3.0 }),
        }
    }
}

/// Whether the norms, the element-wise ops and the copy give ggml's own ops bit for bit: RMS
/// norms of rows of several lengths (and the norm times a weight, as ggml fuses them),
/// multiplies and adds with rows broadcast in every dimension, a scale and the copy of a
/// permuted tensor, in 1- and 2-thread runs.
pub fn agrees_with_ggml() -> bool {
    use llama_cpp_sys_2 as sys;
    let Some(ctx) = Ctx::new() else { return false };
    let c = ctx.0;
    let mut v = values(0x9E37_79B9_7F4A_7C15);
    // SAFETY: tensors and nodes of the private context; `same` computes each.
    unsafe {
        let mut ok = true;
        for (n, rows) in [(640usize, 3usize), (1027, 2), (64, 40), (2048, 1)] {
            let x = ctx.tensor([n as i64, rows as i64, 1, 1], &mut v);
            let w = ctx.tensor([n as i64, 1, 1, 1], &mut v);
            let norm = sys::ggml_rms_norm(c, x, 1e-6);
            ok &= same(&ctx, norm);
            let fused = sys::ggml_mul(c, sys::ggml_rms_norm(c, x, 1e-5), w);
            ok &= same(&ctx, fused);
        }
        let a = ctx.tensor([64, 6, 4, 2], &mut v);
        for ne in [
            [64, 6, 4, 2],
            [64, 1, 1, 1],
            [64, 3, 1, 2],
            [1, 1, 1, 1],
            [16, 6, 2, 1],
        ] {
            let b = ctx.tensor(ne, &mut v);
            ok &= same(&ctx, sys::ggml_mul(c, a, b));
            ok &= same(&ctx, sys::ggml_add(c, a, b));
        }
        // Rows with a tail past the last 16 elements, and one shorter than 16.
        for ne0 in [1003i64, 7] {
            let a = ctx.tensor([ne0, 3, 1, 1], &mut v);
            for ne in [[ne0, 3, 1, 1], [ne0, 1, 1, 1]] {
                let b = ctx.tensor(ne, &mut v);
                ok &= same(&ctx, sys::ggml_mul(c, a, b));
                ok &= same(&ctx, sys::ggml_add(c, a, b));
            }
        }
        let s = ctx.tensor([1000, 3, 2, 1], &mut v);
        ok &= same(&ctx, sys::ggml_scale(c, s, 0.0625));
        ok &= same(&ctx, sys::ggml_scale(c, s, 0.3));
        let p = ctx.tensor([64, 5, 9, 1], &mut v);
        ok &= same(&ctx, sys::ggml_cont(c, sys::ggml_permute(c, p, 0, 2, 1, 3)));
        ok &= same(&ctx, sys::ggml_cont(c, sys::ggml_transpose(c, p)));
        let perm = sys::ggml_permute(c, p, 0, 2, 1, 3);
        ok &= same(&ctx, sys::ggml_cont_2d(c, perm, 64 * 9, 5));
        ok
    }
}

/// The fusion of RoPE's rotation with which the device gives the loaded ggml's `ROPE` of mode
/// `neox` bit for bit, if one does ([`rope_fusions_of_ggml`]'s first).
pub fn rope_fusion_of_ggml(neox: bool) -> Option<Fusion> {
    rope_fusions_of_ggml(neox).first().copied()
}

/// Every fusion of RoPE's rotation (of those this CPU runs) that gives the loaded ggml's
/// `ROPE` of mode `neox` bit for bit: ggml's op on Gemma 3's shapes and bases (NeoX) or
/// SmolLM2's and another's (pairs of neighbours), with a frequency scale and an attention
/// factor, positions up to 100k, against each of the nine.
fn rope_fusions_of_ggml(neox: bool) -> Vec<Fusion> {
    use llama_cpp_sys_2 as sys;
    let Some(ctx) = Ctx::new() else {
        return Vec::new();
    };
    let c = ctx.0;
    let mut v = values(0xD1B5_4A32_D192_ED03);
    let positions = [0i32, 1, 2, 17, 511, 999, 4097, 32768, 100_003];
    let all = [Fuse::None, Fuse::First, Fuse::Second];
    let hardware = fma_in_hardware();
    let mut left: Vec<Fusion> = all
        .iter()
        .flat_map(|&a| all.iter().map(move |&b| (a, b)))
        .filter(|&f| hardware || f == (Fuse::None, Fuse::None))
        .collect();
    let neox_mode = NEOX;
    // (head size, heads, mode, base, frequency scale, attention factor)
    let cases = [
        (256i64, 4i64, neox_mode, 10_000f32, 1f32, 1f32),
        (256, 1, neox_mode, 1_000_000.0, 0.125, 1.0),
        (64, 9, 0, 100_000.0, 1.0, 1.0),
        (128, 2, 0, 500_000.0, 0.25, 0.9),
    ];
    for (hd, heads, mode, base, fscale, attn) in cases {
        if (mode == neox_mode) != neox {
            continue;
        }
        // SAFETY: tensors and nodes of the private context; data written before the graphs
        // run; `device` computes the graph's one node, RoPE.
        unsafe {
            let x = ctx.tensor([hd, heads, positions.len() as i64, 1], &mut v);
            let pos = sys::ggml_new_tensor_1d(c, sys::GGML_TYPE_I32, positions.len() as i64);
            std::ptr::copy_nonoverlapping(
                positions.as_ptr(),
                sys::ggml_get_data(pos).cast(),
                positions.len(),
            );
            let out = sys::ggml_rope_ext(
                c,
                x,
                pos,
                std::ptr::null_mut(),
                hd as i32,
                mode,
                4096,
                base,
                fscale,
                0.0,
                attn,
                32.0,
                1.0,
            );
            let Some(want) = ctx.ggml(out) else {
                return Vec::new();
            };
            left.retain(|&f| {
                // The graph's node is the RoPE built above.
                ctx.device(out, &want, &|n, t| rope(n, t, f))
            });
        }
    }
    left
}

#[cfg(test)]
mod tests {
    /// The norms, element-wise ops and the copy are ggml's bit for bit.
    #[test]
    fn row_ops_match_ggml() {
        assert!(super::agrees_with_ggml());
    }

    /// One rotation of RoPE reproduces the loaded ggml's in each mode, and only one: the
    /// check's data tells the fusions apart (where the build fused none, every fused rotation
    /// fails it).
    #[test]
    fn rope_matches_ggml() {
        for neox in [true, false] {
            let f = super::rope_fusions_of_ggml(neox);
            eprintln!("ggml's RoPE rotation, NeoX {neox}: {f:?}");
            assert_eq!(f.len(), 1, "NeoX {neox}: {f:?}");
        }
    }
}

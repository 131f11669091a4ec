//! Attention's softmax without flash attention (`GGML_OP_SOFT_MAX` between the device's `kq`
//! and `kqv` products) on the device, with the kernel of [`leap_kernels::softmax`]: ggml's
//! row in three passes instead of six, and a one-row call's heads spread over every thread
//! (ggml splits a node by the rows of a head, so a decoding row's softmax ran on one thread).
//!
//! Which exponential ggml's build runs ([`Exp`]) is found once per process by running ggml's
//! own op ([`agrees_with_ggml`]); where neither reproduces it bit for bit, the device leaves the
//! node to ggml.

use std::sync::OnceLock;

use leap_kernels::softmax::{self as kernel, Exp, Mask};

use crate::ffi as g;
use crate::par::{parallel, Ptr};

/// Whether the device computes `op`: an f32 `SOFT_MAX` with contiguous rows, a scale, no ALiBi
/// (`max_bias` 0) and no sinks, its mask (if any) f16 or f32 rows of the same length, where
/// [`agrees_with_ggml`] found the loaded ggml's arithmetic.
pub(crate) fn supports(op: &g::ggml_tensor) -> bool {
    if op.op != g::GGML_OP_SOFT_MAX || op.type_ != g::GGML_TYPE_F32 {
        return false;
    }
    let max_bias = f32::from_bits(op.op_params[1] as u32);
    // SAFETY: ggml's sources of a node are valid tensors or null.
    let (s0, mask, sinks) = unsafe { (op.src[0].as_ref(), op.src[1].as_ref(), op.src[2]) };
    let Some(s0) = s0 else { return false };
    let mask_ok = mask.is_none_or(|m| {
        let size = match m.type_ {
            g::GGML_TYPE_F16 => 2,
            g::GGML_TYPE_F32 => 4,
            _ => return false,
        };
        m.nb[0] == size
            && m.ne[0] == s0.ne[0]
            && m.ne[1] >= s0.ne[1]
            && m.ne[2] >= 1
            && m.ne[3] >= 1
            && s0.ne[2] % m.ne[2] == 0
            && s0.ne[3] % m.ne[3] == 0
    });
    max_bias == 0.0
        && sinks.is_null()
        && s0.type_ == g::GGML_TYPE_F32
        && op.ne == s0.ne
        // SAFETY: valid tensors.
        && unsafe { g::ggml_is_contiguous(s0) && g::ggml_is_contiguous(op) }
        && mask_ok
        && exp().is_some()
}

/// The loaded ggml's exponential, found once per process.
pub(crate) fn exp() -> Option<Exp> {
    static EXP: OnceLock<Option<Exp>> = OnceLock::new();
    *EXP.get_or_init(|| {
        let found = agrees_with_ggml();
        if found.is_none() && [Exp::Zmm, Exp::Ymm].into_iter().any(kernel::cpu_ok) {
            log::warn!("Leap's softmax rows do not reproduce ggml's here; not using them");
        }
        found
    })
}

/// Elements below which a node runs on the calling thread.
const SERIAL: usize = 4096;

/// Compute `node` (which [`supports`] accepted) with `threads` threads.
///
/// # Safety
/// `node` is a valid, allocated SOFT_MAX node whose sources hold their data.
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    let exp = exp().expect("checked in supports");
    let s0 = &*node.src[0];
    let mask = node.src[1].as_ref();
    let scale = f32::from_bits(node.op_params[0] as u32);
    let n = s0.ne[0] as usize;
    let [ne01, ne02, ne03] = [1, 2, 3].map(|d| s0.ne[d] as usize);
    let rows = ne01 * ne02 * ne03;
    if n == 0 || rows == 0 {
        return;
    }
    let (src, dst) = (Ptr(s0.data.cast()), Ptr(node.data.cast()));
    let m = mask.map(|m| {
        (
            Ptr(m.data.cast()),
            m.type_ == g::GGML_TYPE_F16,
            [m.nb[1], m.nb[2], m.nb[3]],
            [m.ne[2] as usize, m.ne[3] as usize],
        )
    });
    let work = |r: usize| {
        let (i01, i02, i03) = (r % ne01, r / ne01 % ne02, r / (ne01 * ne02));
        // SAFETY: row r of the contiguous source and destination (n floats each); the mask
        // row ggml broadcasts to it, n elements of its type; rows write disjoint elements.
        unsafe {
            let x = std::slice::from_raw_parts(src.at(r * n * 4).cast::<f32>(), n);
            let y = std::slice::from_raw_parts_mut(dst.at(r * n * 4).cast::<f32>(), n);
            let mask = match m {
                None => Mask::None,
                Some((p, f16, nb, ne)) => {
                    let at = p.at(i01 * nb[0] + i02 % ne[0] * nb[1] + i03 % ne[1] * nb[2]);
                    if f16 {
                        Mask::F16(std::slice::from_raw_parts(at.cast::<u16>(), n))
                    } else {
                        Mask::F32(std::slice::from_raw_parts(at.cast::<f32>(), n))
                    }
                }
            };
            kernel::row(exp, x, mask, scale, y);
        }
    };
    if threads <= 1 || rows < 2 || rows * n < SERIAL {
        (0..rows).for_each(work);
    } else {
        parallel(threads.min(rows), &|tid, nth| {
            (tid * rows / nth..(tid + 1) * rows / nth).for_each(work)
        });
    }
}

/// The [`Exp`] under which [`kernel::row`] gives the loaded ggml's own `SOFT_MAX` bit for bit,
/// or `None`: on rows of several lengths (whole vectors of either width and tails), scales,
/// f16 and f32 masks with hidden cells (`-inf`) broadcast over heads, values far enough apart
/// that the exponentials pass both of ggml's cut-offs, and no mask.
pub fn agrees_with_ggml() -> Option<Exp> {
    let exps: Vec<Exp> = [Exp::Zmm, Exp::Ymm]
        .into_iter()
        .filter(|&e| kernel::cpu_ok(e))
        .collect();
    if exps.is_empty() {
        return None;
    }
    let mut rnd = crate::check_values(0x5DEE_CE66_D1CE_4E5Du64);
    let mut cases = Vec::new();
    for (n, rows, heads, spread) in [
        (1000usize, 3usize, 2usize, 8.0f32),
        (1027, 2, 3, 300.0),
        (37, 4, 1, 1.0),
        (256, 1, 4, 60.0),
    ] {
        let x: Vec<f32> = (0..n * rows * heads).map(|_| rnd(spread)).collect();
        let mask: Vec<f32> = (0..n * rows)
            .map(|i| {
                if i % 7 == 3 || i % n > n - 5 {
                    f32::NEG_INFINITY
                } else {
                    crate::f16::to_f32(crate::f16::from_f32(rnd(4.0)))
                }
            })
            .collect();
        for (mtype, scale) in [(Some(true), 0.125f32), (Some(false), 1.0), (None, 0.7)] {
            cases.push((n, rows, heads, x.clone(), mask.clone(), mtype, scale));
        }
    }
    let wants: Vec<Vec<f32>> = cases
        .iter()
        .map(|(n, rows, heads, x, mask, mtype, scale)| {
            ggml_soft_max(*n, *rows, *heads, x, mask, *mtype, *scale)
        })
        .collect::<Option<_>>()?;
    exps.into_iter().find(|&exp| {
        cases
            .iter()
            .zip(&wants)
            .all(|((n, rows, _, x, mask, mtype, scale), want)| {
                let m16: Vec<u16> = mask.iter().map(|&v| crate::f16::from_f32(v)).collect();
                let mut got = vec![0f32; x.len()];
                for (r, (xr, yr)) in x.chunks(*n).zip(got.chunks_mut(*n)).enumerate() {
                    let i = r % rows;
                    let mask = match mtype {
                        Some(true) => Mask::F16(&m16[i * n..(i + 1) * n]),
                        Some(false) => Mask::F32(&mask[i * n..(i + 1) * n]),
                        None => Mask::None,
                    };
                    kernel::row(exp, xr, mask, *scale, yr);
                }
                want.iter()
                    .zip(&got)
                    .all(|(w, g)| w.to_bits() == g.to_bits())
            })
    })
}

/// ggml's `soft_max_ext` on the CPU over `heads` matrices of `rows` rows of `n`, the mask
/// (`Some(true)`: f16, `Some(false)`: f32) `rows` rows shared by the heads; `None` when the
/// graph fails.
fn ggml_soft_max(
    n: usize,
    rows: usize,
    heads: usize,
    x: &[f32],
    mask: &[f32],
    mtype: Option<bool>,
    scale: f32,
) -> Option<Vec<f32>> {
    use llama_cpp_sys_2 as sys;
    // SAFETY: a private ggml context sized for the tensors, the graph and its work; every
    // tensor's data is written before the graph runs.
    unsafe {
        let ctx = sys::ggml_init(sys::ggml_init_params {
            mem_size: x.len() * 8 + mask.len() * 4 + (16 << 20),
            mem_buffer: std::ptr::null_mut(),
            no_alloc: false,
        });
        if ctx.is_null() {
            return None;
        }
        let (ni, ri, hi) = (n as i64, rows as i64, heads as i64);
        let a = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, ni, ri, hi);
        std::ptr::copy_nonoverlapping(x.as_ptr(), sys::ggml_get_data(a).cast::<f32>(), x.len());
        let m = match mtype {
            None => std::ptr::null_mut(),
            Some(true) => {
                let m = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F16, ni, ri);
                let h: Vec<u16> = mask.iter().map(|&v| crate::f16::from_f32(v)).collect();
                std::ptr::copy_nonoverlapping(h.as_ptr(), sys::ggml_get_data(m).cast(), h.len());
                m
            }
            Some(false) => {
                let m = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, ni, ri);
                std::ptr::copy_nonoverlapping(
                    mask.as_ptr(),
                    sys::ggml_get_data(m).cast(),
                    mask.len(),
                );
                m
            }
        };
        let out = sys::ggml_soft_max_ext(ctx, a, m, scale, 0.0);
        let gf = sys::ggml_new_graph(ctx);
        sys::ggml_build_forward_expand(gf, out);
        let st = sys::ggml_graph_compute_with_ctx(ctx, gf, 2);
        let r = (st == sys::GGML_STATUS_SUCCESS).then(|| {
            std::slice::from_raw_parts(sys::ggml_get_data(out).cast::<f32>(), x.len()).to_vec()
        });
        sys::ggml_free(ctx);
        r
    }
}

#[cfg(test)]
mod tests {
    use leap_kernels::softmax::{cpu_ok, Exp};

    /// Where the CPU runs either kernel, one of them gives the loaded ggml's `SOFT_MAX` bit for
    /// bit (a ggml built for AVX-512 runs the 16-lane arithmetic, one for AVX2 the 8-lane).
    #[test]
    fn softmax_rows_match_ggml() {
        if ![Exp::Zmm, Exp::Ymm].into_iter().any(cpu_ok) {
            eprintln!("the CPU runs neither softmax kernel");
            return;
        }
        let found = super::agrees_with_ggml();
        eprintln!("ggml's softmax arithmetic here: {found:?}");
        assert!(found.is_some());
    }
}

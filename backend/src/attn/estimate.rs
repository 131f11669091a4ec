//! The estimate step: approximate scores of a row's candidate keys for the heads of a KV
//! group, on the CPU (f32 queries against the int8 shadow, `est.rs`), on the OpenCL device
//! (feature `opencl`) or on QNN (feature `qnn`), falling back to the CPU when either fails;
//! and 004's head-wise pipeline, which overlaps the OpenCL estimate of one head with the
//! exact attention of the previous one.

use std::sync::atomic::Ordering;

use super::kernel::Row;
#[cfg(feature = "opencl")]
use super::kernel::{finish, Head};
use super::{Chosen, Keys8, Operands, Sparse, Stats};
use crate::est;
use crate::par::Ptr;

/// Estimates of prepared heads `x0..x0+g` (indices into the row's prepared heads, all of KV
/// head `hk`) for estimated candidates `c0..c1` (relative to `lo`), written through `est[x]`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn estimate(
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
                crate::device::TOTALS
                    .opencl_estimates
                    .fetch_add(1, Ordering::Relaxed);
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

/// Estimates computed by the OpenCL device in this process.
pub fn opencl_calls() -> u64 {
    crate::device::TOTALS
        .opencl_estimates
        .load(Ordering::Relaxed)
}

/// The head-wise pipeline of 004 §3.4 (Algorithm 1) for one row whose estimate runs on the
/// OpenCL device: the device estimates head `k+1` while this thread attends head `k`
/// exactly; heads go in order of their budgets, largest first, so that the device's work
/// hides behind the longest exact parts. False when the pipeline is not asked for
/// ([`Sparse::pipeline`]) or OpenCL failed: the caller then estimates and attends the whole
/// row the usual way (overwriting any heads finished here; their stats are dropped).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pipelined<'a>(
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
            crate::device::TOTALS
                .opencl_estimates
                .fetch_add(1, Ordering::Relaxed);
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

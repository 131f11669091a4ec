//! The `leap-opencl` device's kernels: sparse attention's int8 estimate in OpenCL C 1.2.
//!
//! The queries stay f32 (a GPU multiplies floats as fast as integers); int8 x int8 with
//! per-head scales is the NPU's form (issue 6).
//!
//! Portable tier: runs on any OpenCL 1.2 device, PoCL's CPU device included (no fp16
//! arithmetic: the keys' f16 scales are read with `vload_half`, which 1.2 has without
//! `cl_khr_fp16`; no subgroups). Buffers wrap host memory (`CL_MEM_USE_HOST_PTR`), which is
//! zero-copy on the devices Leap targets (PoCL, and Adreno's unified memory).
//!
//! Adreno tier ([`Tier::Wide`]): on a GPU with OpenCL C 2.0 and `cl_khr_fp16` (Adreno 6xx and
//! later), one work-group per key reads the key row with adjacent work-items (coalesced
//! loads), multiplies in fp16 and adds in f32, then reduces with `work_group_reduce_add`. It
//! cannot run here: PoCL is OpenCL C 1.2 without fp16, and refuses the kernel under
//! `-cl-std=CL2.0` (no `cl_khr_fp16`) and `CL3.0` (no work-group collectives). The selection
//! and the fallback are tested here; the kernel itself only where a device has the features
//! (`the_adreno_tier_runs_or_falls_back` compares it with the CPU there).
//!
//! The OpenCL library is loaded at run time (opencl3's `dynamic`): without one, or without a
//! device, [`estimator`] says why and Leap does not register the device.

use std::sync::{Mutex, OnceLock};

use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{get_all_devices, Device, CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_GPU};
use opencl3::event::Event;
use opencl3::kernel::{ExecuteKernel, Kernel};
use opencl3::memory::{
    Buffer, CL_MEM_COPY_HOST_PTR, CL_MEM_READ_ONLY, CL_MEM_USE_HOST_PTR, CL_MEM_WRITE_ONLY,
};
use opencl3::program::Program;
use opencl3::types::{cl_float, cl_uint, CL_BLOCKING, CL_NON_BLOCKING};

use crate::est::{BLOCK, BLOCK_BYTES};

const SOURCE: &str = r#"
// Estimated scores of g f32 query heads against candidate keys (Q8_0 rows: per block of 32
// an f16 scale then 32 int8 values): out[h*n + c] = sum_b dk_b * (q_h . k)_b.
__kernel void est_q8(__global const char *keys, uint row, uint col0, uint head,
                     uint cell0, uint hk, __global const uint *cand, uint base,
                     __global const float *q, uint g, uint nb,
                     __global float *out, uint n)
{
    uint c = get_global_id(0);
    if (c >= n) return;
    __global const char *k = keys + (ulong)(cell0 + cand[base + c]) * row + col0 + hk * head;
    for (uint h = 0; h < g; h++) {
        float s = 0.0f;
        for (uint b = 0; b < nb; b++) {
            __global const char *blk = k + b * 34;
            float dk = vload_half(0, (__global const half *)blk);
            __global const float *qb = q + (h * nb + b) * 32;
            // Eight lanes at a time: explicit vectors, since a compiler may not reorder a
            // float sum on its own.
            float8 acc = (float8)(0.0f);
            for (uint x = 0; x < 32; x += 8)
                acc += convert_float8(vload8(0, blk + 2 + x)) * vload8(0, qb + x);
            float4 a4 = acc.lo + acc.hi;
            float2 a2 = a4.lo + a4.hi;
            s += dk * (a2.x + a2.y);
        }
        out[h * n + c] = s;
    }
}
"#;

/// The Adreno tier's kernel (OpenCL C 2.0 + `cl_khr_fp16`): same arguments and output as
/// `est_q8`, one work-group per candidate (global size `n * local size`).
const SOURCE_WIDE: &str = r#"
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
__kernel void est_q8_wg(__global const char *keys, uint row, uint col0, uint head,
                        uint cell0, uint hk, __global const uint *cand, uint base,
                        __global const float *q, uint g, uint nb,
                        __global float *out, uint n)
{
    uint c = get_group_id(0);
    uint l = get_local_id(0), w = get_local_size(0);
    __global const char *k = keys + (ulong)(cell0 + cand[base + c]) * row + col0 + hk * head;
    uint d = nb * 32;
    for (uint h = 0; h < g; h++) {
        float s = 0.0f;
        for (uint i = l * 8; i < d; i += w * 8) {
            __global const char *blk = k + (i / 32) * 34;
            float dk = vload_half(0, (__global const half *)blk);
            half8 p = convert_half8(vload8(0, blk + 2 + i % 32))
                    * convert_half8(vload8(0, q + h * d + i));
            float8 f = convert_float8(p);
            float4 a4 = f.lo + f.hi;
            float2 a2 = a4.lo + a4.hi;
            s += dk * (a2.x + a2.y);
        }
        s = work_group_reduce_add(s);
        if (l == 0)
            out[h * n + c] = s;
    }
}
"#;

/// Which estimate kernel a device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// OpenCL C 1.2, one work-item per key: any device, PoCL's CPU device included.
    Portable,
    /// The Adreno tier: one work-group per key, fp16 products, work-group reduction. Needs a
    /// GPU with OpenCL C 2.0 or later and `cl_khr_fp16`.
    Wide,
}

/// `"OpenCL C 2.0 Adreno(TM) 640"` -> (2, 0).
fn c_version(v: &str) -> Option<(u32, u32)> {
    let rest = v.strip_prefix("OpenCL C ")?;
    let num = rest.split_whitespace().next()?;
    let (a, b) = num.split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// The tier for a device (`LEAP_OPENCL_TIER=portable|adreno` can ask for one), and why when
/// the one asked for cannot run.
pub fn tier_for(
    is_gpu: bool,
    opencl_c: &str,
    extensions: &str,
    asked: Option<&str>,
) -> (Tier, Option<String>) {
    let fp16 = extensions.split_whitespace().any(|e| e == "cl_khr_fp16");
    let c2 = c_version(opencl_c).is_some_and(|v| v >= (2, 0));
    let wide_ok = fp16 && c2;
    match asked {
        Some("portable") => (Tier::Portable, None),
        Some("adreno") if wide_ok => (Tier::Wide, None),
        Some("adreno") => (
            Tier::Portable,
            Some(format!(
                "the Adreno tier needs OpenCL C 2.0 and cl_khr_fp16 (device: {opencl_c}{}); \
                 using the portable tier",
                if fp16 { "" } else { ", no cl_khr_fp16" }
            )),
        ),
        Some(other) => (
            Tier::Portable,
            Some(format!(
                "LEAP_OPENCL_TIER={other}: expected portable or adreno; using the portable tier"
            )),
        ),
        None if wide_ok && is_gpu => (Tier::Wide, None),
        None => (Tier::Portable, None),
    }
}

/// An OpenCL device with the estimate kernel built.
pub struct ClEstimator {
    /// Device name and OpenCL C version, for logs and reports.
    pub device: String,
    /// Whether the device is a GPU (its own hardware: the head-wise pipeline pays); PoCL's
    /// CPU device shares the cores the exact part runs on.
    pub is_gpu: bool,
    /// The kernel tier in use.
    pub tier: Tier,
    context: Context,
    queue: CommandQueue,
    kernel: Mutex<Kernel>,
    _program: Program,
}

// SAFETY: OpenCL contexts, queues and programs are thread-safe objects (OpenCL 1.2 §A.2);
// the kernel, whose arguments are per-object state, is behind a mutex.
unsafe impl Send for ClEstimator {}
unsafe impl Sync for ClEstimator {}

fn pick_device() -> Result<Device, String> {
    let gpus = get_all_devices(CL_DEVICE_TYPE_GPU).unwrap_or_default();
    let any = if gpus.is_empty() {
        get_all_devices(CL_DEVICE_TYPE_ALL).map_err(|e| format!("no OpenCL platform ({e})"))?
    } else {
        gpus
    };
    let id = *any.first().ok_or("no OpenCL device")?;
    Ok(Device::new(id))
}

impl ClEstimator {
    /// The first GPU (else any device) of the first platform that has one, with the kernel
    /// built.
    ///
    /// # Errors
    /// Why OpenCL cannot be used here (no library, no device, build failure).
    pub fn new() -> Result<Self, String> {
        Self::with_tier(std::env::var("LEAP_OPENCL_TIER").ok().as_deref())
    }

    /// As [`ClEstimator::new`], asking for a tier (`"portable"`, `"adreno"`; `None`: the best
    /// the device has). A tier the device cannot run falls back to the portable one (logged).
    ///
    /// # Errors
    /// Why OpenCL cannot be used here.
    pub fn with_tier(asked: Option<&str>) -> Result<Self, String> {
        let device = pick_device()?;
        let name = device.name().unwrap_or_default();
        let is_gpu = device.dev_type().is_ok_and(|t| t & CL_DEVICE_TYPE_GPU != 0);
        let version = device.opencl_c_version().unwrap_or_default();
        let extensions = device.extensions().unwrap_or_default();
        let (mut tier, why) = tier_for(is_gpu, &version, &extensions, asked);
        if let Some(why) = why {
            log::warn!("leap-opencl: {why}");
        }
        let context = Context::from_device(&device).map_err(|e| format!("clCreateContext: {e}"))?;
        #[allow(deprecated)]
        let queue = CommandQueue::create_default(&context, 0)
            .map_err(|e| format!("clCreateCommandQueue: {e}"))?;
        let build = |tier: Tier| {
            let (src, opts, entry) = match tier {
                Tier::Portable => (SOURCE, "-cl-std=CL1.2", "est_q8"),
                Tier::Wide => (SOURCE_WIDE, "-cl-std=CL2.0", "est_q8_wg"),
            };
            let program = Program::create_and_build_from_source(&context, src, opts)
                .map_err(|e| format!("building the {tier:?} estimate kernel on {name}: {e}"))?;
            let kernel =
                Kernel::create(&program, entry).map_err(|e| format!("clCreateKernel: {e}"))?;
            Ok::<_, String>((program, kernel))
        };
        let (program, kernel) = match build(tier) {
            Ok(pk) => pk,
            Err(e) if tier == Tier::Wide => {
                log::warn!("leap-opencl: {e}; using the portable tier");
                tier = Tier::Portable;
                build(tier)?
            }
            Err(e) => return Err(e),
        };
        Ok(Self {
            device: format!("{name} ({version})"),
            is_gpu,
            tier,
            context,
            queue,
            kernel: Mutex::new(kernel),
            _program: program,
        })
    }

    /// `out[h][c]` for heads `0..g` of `q` (f32, `g * d`: a GPU multiplies floats as fast as
    /// integers, and the CPU estimate takes f32 queries too, so both rank alike), and
    /// candidates `c` in `0..n`: key `cand[base + c]` of the shadow `keys` (rows of `row`
    /// bytes from cell `cell0`; KV head `hk` at `col0 + hk * head` bytes in the row).
    ///
    /// # Errors
    /// OpenCL failures.
    #[allow(clippy::too_many_arguments)]
    pub fn scores(
        &self,
        keys: &[u8],
        layout: (usize, usize, usize, usize, usize),
        cand: &[u32],
        base: usize,
        q: &[f32],
        (g, d, n): (usize, usize, usize),
        out: &mut [&mut [f32]],
    ) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: `keys` and `cand` outlive the (blocking) read.
        let flat = unsafe { self.enqueue(keys, layout, cand, base, q, (g, d, n), true)? }.wait()?;
        for (h, o) in out.iter_mut().enumerate().take(g) {
            o[..n].copy_from_slice(&flat[h * n..(h + 1) * n]);
        }
        Ok(())
    }

    /// Start [`ClEstimator::scores`] without waiting: the estimates come from
    /// [`Pending::wait`] (`g * n` values, head after head). What the device computes
    /// meanwhile is the head-wise pipeline of 004 §3.4.
    ///
    /// # Safety
    /// `keys` and `cand` are read in place (`CL_MEM_USE_HOST_PTR`): they must stay valid and
    /// unchanged until the returned [`Pending`] has been waited for or dropped.
    ///
    /// # Errors
    /// OpenCL failures.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        keys: &[u8],
        layout: (usize, usize, usize, usize, usize),
        cand: &[u32],
        base: usize,
        q: &[f32],
        shape: (usize, usize, usize),
    ) -> Result<Pending, String> {
        self.enqueue(keys, layout, cand, base, q, shape, false)
    }

    /// [`ClEstimator::launch`], reading the results back blocking or not (a blocking read is
    /// much cheaper than an event wait on PoCL).
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue(
        &self,
        keys: &[u8],
        (row, col0, head, cell0, hk): (usize, usize, usize, usize, usize),
        cand: &[u32],
        base: usize,
        q: &[f32],
        (g, d, n): (usize, usize, usize),
        blocking: bool,
    ) -> Result<Pending, String> {
        let nb = d / BLOCK;
        debug_assert!(q.len() >= g * d && n > 0);
        debug_assert!(d.is_multiple_of(BLOCK) && col0.is_multiple_of(BLOCK_BYTES));
        fn err(what: &'static str) -> impl Fn(opencl3::error_codes::ClError) -> String {
            move |e| format!("{what}: {e}")
        }
        let mut flat = vec![0f32; g * n].into_boxed_slice();
        let kb = Buffer::<u8>::create(
            &self.context,
            CL_MEM_READ_ONLY | CL_MEM_USE_HOST_PTR,
            keys.len(),
            keys.as_ptr() as *mut _,
        )
        .map_err(err("keys buffer"))?;
        let cb = Buffer::<u32>::create(
            &self.context,
            CL_MEM_READ_ONLY | CL_MEM_USE_HOST_PTR,
            cand.len(),
            cand.as_ptr() as *mut _,
        )
        .map_err(err("candidates buffer"))?;
        let qb = Buffer::<f32>::create(
            &self.context,
            CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
            g * d,
            q.as_ptr() as *mut _,
        )
        .map_err(err("query buffer"))?;
        let ob = Buffer::<cl_float>::create(
            &self.context,
            CL_MEM_WRITE_ONLY,
            g * n,
            std::ptr::null_mut(),
        )
        .map_err(err("output buffer"))?;
        let kernel = self.kernel.lock().unwrap_or_else(|e| e.into_inner());
        let u = |x: usize| x as cl_uint;
        let mut exec = ExecuteKernel::new(&kernel);
        exec.set_arg(&kb)
            .set_arg(&u(row))
            .set_arg(&u(col0))
            .set_arg(&u(head))
            .set_arg(&u(cell0))
            .set_arg(&u(hk))
            .set_arg(&cb)
            .set_arg(&u(base))
            .set_arg(&qb)
            .set_arg(&u(g))
            .set_arg(&u(nb))
            .set_arg(&ob)
            .set_arg(&u(n));
        match self.tier {
            Tier::Portable => exec.set_global_work_size(n),
            Tier::Wide => {
                // One work-group per key, 8 values per work-item and step.
                let w = (d / 8).clamp(1, 32);
                exec.set_global_work_size(n * w).set_local_work_size(w)
            }
        };
        exec.enqueue_nd_range(&self.queue)
            .map_err(err("enqueue the estimate kernel"))?;
        drop(kernel);
        // In-order queue: the read runs after the kernel. `flat` is a boxed slice whose heap
        // block stays put when the box moves into `Pending`.
        let read = self
            .queue
            .enqueue_read_buffer(
                &ob,
                if blocking {
                    CL_BLOCKING
                } else {
                    CL_NON_BLOCKING
                },
                0,
                &mut flat,
                &[],
            )
            .map_err(err("reading the estimates"))?;
        Ok(Pending {
            read,
            flat,
            _buffers: (kb, cb, qb, ob),
        })
    }
}

/// Estimates on their way back from the device ([`ClEstimator::launch`]).
pub struct Pending {
    read: Event,
    flat: Box<[f32]>,
    _buffers: (Buffer<u8>, Buffer<u32>, Buffer<f32>, Buffer<cl_float>),
}

impl Pending {
    /// Wait for the estimates.
    ///
    /// # Errors
    /// OpenCL failures.
    pub fn wait(mut self) -> Result<Box<[f32]>, String> {
        self.read
            .wait()
            .map_err(|e| format!("waiting for the estimates: {e}"))?;
        Ok(std::mem::take(&mut self.flat))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // The device may still write `flat`: never free it before the read is done.
        let _ = self.read.wait();
    }
}

/// The process's OpenCL estimator, set up on first use, or why there is none.
pub fn estimator() -> Result<&'static ClEstimator, &'static str> {
    static CL: OnceLock<Result<ClEstimator, String>> = OnceLock::new();
    CL.get_or_init(|| {
        let r = std::panic::catch_unwind(ClEstimator::new)
            .unwrap_or_else(|_| Err("the OpenCL library panicked while loading".into()));
        match &r {
            Ok(e) => log::info!(
                "leap-opencl: estimate kernel ({:?} tier) built on {}",
                e.tier,
                e.device
            ),
            Err(why) => log::debug!("leap-opencl: not available: {why}"),
        }
        r
    })
    .as_ref()
    .map_err(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{est, f16};

    /// Needs an OpenCL device (`make test` installs PoCL); `LEAP_SKIP_OPENCL=1` skips.
    fn cl() -> Option<&'static ClEstimator> {
        if std::env::var_os("LEAP_SKIP_OPENCL").is_some() {
            return None;
        }
        Some(estimator().unwrap_or_else(|why| {
            panic!(
                "no OpenCL device ({why}); install PoCL (scripts/setup) or set LEAP_SKIP_OPENCL=1"
            )
        }))
    }

    #[test]
    fn tiers_follow_the_device_features() {
        let adreno_ext =
            "cl_khr_fp16 cl_khr_3d_image_writes cl_qcom_android_native_buffer_host_ptr";
        let adreno = "OpenCL C 2.0 Adreno(TM) 640";
        assert_eq!(tier_for(true, adreno, adreno_ext, None), (Tier::Wide, None));
        assert_eq!(
            tier_for(true, "OpenCL C 3.0 ", adreno_ext, None).0,
            Tier::Wide
        );
        // A CPU device stays portable unless asked; no fp16 or OpenCL C 1.2: portable.
        assert_eq!(tier_for(false, adreno, adreno_ext, None).0, Tier::Portable);
        assert_eq!(
            tier_for(false, adreno, adreno_ext, Some("adreno")).0,
            Tier::Wide
        );
        assert_eq!(
            tier_for(true, "OpenCL C 1.2 ", adreno_ext, None).0,
            Tier::Portable
        );
        assert_eq!(
            tier_for(true, adreno, "cl_khr_fp64", None).0,
            Tier::Portable
        );
        assert_eq!(
            tier_for(true, adreno, adreno_ext, Some("portable")).0,
            Tier::Portable
        );
        let (t, why) = tier_for(false, "OpenCL C 1.2 pocl", "cl_khr_fp64", Some("adreno"));
        assert_eq!(t, Tier::Portable);
        assert!(why.unwrap().contains("no cl_khr_fp16"));
        assert!(tier_for(true, adreno, adreno_ext, Some("fast")).1.is_some());
        assert_eq!(c_version("OpenCL C 1.2 pocl"), Some((1, 2)));
        assert_eq!(c_version("OpenCL 3.0"), None);
    }

    /// Asking for the Adreno tier where the device lacks it (PoCL) still gives a working
    /// estimator on the portable tier; where the device has it, the Adreno tier matches the
    /// CPU reference.
    #[test]
    fn the_adreno_tier_runs_or_falls_back() {
        if cl().is_none() {
            return;
        }
        let wide = ClEstimator::with_tier(Some("adreno")).expect("an estimator");
        if wide.tier == Tier::Portable {
            eprintln!(
                "{}: no Adreno tier here (checked the fallback)",
                wide.device
            );
        }
        matches_the_cpu_reference(&wide, if wide.tier == Tier::Wide { 2e-3 } else { 1e-4 });
    }

    #[test]
    fn opencl_estimate_matches_the_cpu_reference() {
        let Some(cl) = cl() else { return };
        if !cl.is_gpu {
            assert_eq!(
                cl.tier,
                Tier::Portable,
                "a CPU device runs the portable tier"
            );
        }
        matches_the_cpu_reference(cl, 1e-4);
    }

    fn matches_the_cpu_reference(cl: &ClEstimator, tol: f32) {
        // Two KV heads of d = 64 per cell, 300 cells; estimate head group of KV head 1 for
        // a scattered candidate list.
        let (d, hkv, cells, g) = (64usize, 2usize, 300usize, 3usize);
        let row = hkv * d / BLOCK * BLOCK_BYTES;
        let mut keys = vec![0u8; cells * row];
        let mut rng = leap_kernels::rng::XorShift::new(7);
        let mut rnd = || (rng.next() >> 40) as u32;
        for blk in keys.chunks_exact_mut(BLOCK_BYTES) {
            let s = f16::from_f32(0.001 + (rnd() % 1000) as f32 * 1e-5).to_le_bytes();
            blk[0] = s[0];
            blk[1] = s[1];
            for v in blk[2..].iter_mut() {
                *v = ((rnd() % 255) as i32 - 127) as i8 as u8;
            }
        }
        let q: Vec<f32> = (0..g * d)
            .map(|_| (rnd() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let cand: Vec<u32> = (0..cells as u32).filter(|c| c % 3 != 1).collect();
        let (cell0, hk, base) = (0usize, 1usize, 5usize);
        let n = cand.len() - base;
        let head = d / BLOCK * BLOCK_BYTES;
        let mut got = vec![vec![0f32; n]; g];
        let mut want = got.clone();
        {
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|v| v.as_mut_slice()).collect();
            cl.scores(
                &keys,
                (row, 0, head, cell0, hk),
                &cand,
                base,
                &q,
                (g, d, n),
                &mut outs,
            )
            .expect("OpenCL estimate");
        }
        {
            let mut outs: Vec<&mut [f32]> = want.iter_mut().map(|v| v.as_mut_slice()).collect();
            // SAFETY: every candidate's row lies inside `keys`.
            unsafe {
                est::scores_f32q(
                    &q,
                    g,
                    d,
                    n,
                    |c| keys.as_ptr().add(cand[base + c] as usize * row + hk * head),
                    &mut outs,
                )
            };
        }
        for h in 0..g {
            for c in 0..n {
                let (a, b) = (got[h][c], want[h][c]);
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1.0),
                    "head {h} cand {c}: {a} vs {b}"
                );
            }
        }
    }
}

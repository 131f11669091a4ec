//! Gemma's GELU-gated feed-forward unit (`GGML_OP_GLU`, `GEGLU`) on the device: ggml's runs a
//! row per thread, one element at a time, so a one-row call left it to a single thread; here
//! the kernel of [`leap_kernels::geglu`] (8 elements at a time on x86-64, 4 on AArch64, ggml's
//! arithmetic bit for bit: see there) runs on every thread. (A layer's feed-forward products and
//! the unit also become one split instead of three, but fewer splits alone measured no gain:
//! see "Leap's ggml device: kernel timings" in `docs/measurements.md`.)
//!
//! SmolLM2's (Llama's) SiLU-gated unit (`SWIGLU`) too, with the exponential of the loaded
//! ggml's build that its softmax rows reproduce ([`leap_kernels::softmax::swiglu`]): with it and
//! the ops of [`crate::rowops`] a layer is one split.
//!
//! The table the kernel indexes is ggml's own `ggml_table_gelu_f16` (filled by
//! `ggml_cpu_init`, looked up in the process at run time, widened to f32 once). Checked against
//! ggml's own op once per process before the device claims the unit ([`agrees_with_ggml`]).

use std::sync::OnceLock;

use leap_kernels::geglu as kernel;
use leap_kernels::softmax::Exp;

use crate::ffi as g;
use crate::par::{parallel, Ptr};

/// Whether the device computes `op`: an f32 `GEGLU` over 2-D rows, the gate and the value in
/// two tensors or the two halves of one, on a CPU that runs the unit (x86-64: AVX2/F16C;
/// AArch64: all) where [`agrees_with_ggml`] passed.
pub(crate) fn supports(op: &g::ggml_tensor) -> bool {
    if op.op != g::GGML_OP_GLU {
        return false;
    }
    let unit_ok = match op.op_params[0] {
        u if u == g::GGML_GLU_OP_GEGLU as i32 => table().is_some() && checked(),
        u if u == g::GGML_GLU_OP_SWIGLU as i32 => swiglu_exp().is_some(),
        _ => return false,
    };
    // SAFETY: ggml's sources of a node are valid tensors (src[1] may be null).
    let (s0, s1) = unsafe { (op.src[0].as_ref(), op.src[1].as_ref()) };
    let Some(s0) = s0 else { return false };
    let flat = |t: &g::ggml_tensor| {
        t.type_ == g::GGML_TYPE_F32 && t.nb[0] == 4 && t.ne[2] == 1 && t.ne[3] == 1
    };
    let nc = if s1.is_some() { s0.ne[0] } else { s0.ne[0] / 2 };
    flat(op)
        && flat(s0)
        && s1.is_none_or(|s1| flat(s1) && s1.ne[0] == nc && s1.ne[1] == s0.ne[1])
        && op.ne[0] == nc
        && op.ne[1] == s0.ne[1]
        && unit_ok
}

/// ggml's GELU table widened to f32 (65536 entries), when the process has ggml's CPU backend
/// and the CPU runs the unit.
fn table() -> Option<&'static [f32]> {
    static TABLE: OnceLock<Option<Vec<f32>>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            if !kernel::cpu_ok() {
                return None;
            }
            // SAFETY: idempotent init, then dlsym on the global namespace; the symbol, when
            // present, is ggml's `ggml_fp16_t ggml_table_gelu_f16[1 << 16]`, filled by
            // `ggml_cpu_init` and never written again.
            unsafe {
                g::ggml_cpu_init();
                let p = libc::dlsym(libc::RTLD_DEFAULT, c"ggml_table_gelu_f16".as_ptr());
                if p.is_null() {
                    log::debug!("ggml_table_gelu_f16 not found: GELU units stay with ggml");
                    return None;
                }
                let h = std::slice::from_raw_parts(p as *const u16, 1 << 16);
                // The CPU runs the unit (above); 65536 entries.
                Some(kernel::widen(h))
            }
        })
        .as_deref()
}

/// The unit passed [`agrees_with_ggml`] (checked once per process).
fn checked() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let ok = agrees_with_ggml();
        if !ok {
            log::warn!("Leap's GELU-gated unit does not reproduce ggml's here; not using it");
        }
        ok
    })
}

/// Elements below which a node runs on the calling thread: a parallel region costs more than
/// a one-row call's 2048 (Gemma) or 1536 (SmolLM2), and less than SmolLM2's 8-row 12,288 (an
/// exponential an element: 16,384 kept it on the calling thread, ~7 us a layer with the other
/// thread waiting).
const SERIAL: usize = 4096;

/// Compute `node` (which [`supports`] accepted) with `threads` threads.
///
/// # Safety
/// `node` is a valid, allocated GLU node whose sources hold their data.
pub(crate) unsafe fn compute(node: &mut g::ggml_tensor, threads: usize) {
    let unit = if node.op_params[0] == g::GGML_GLU_OP_SWIGLU as i32 {
        Unit::Swiglu(swiglu_exp().expect("checked in supports"))
    } else {
        Unit::Geglu(table().expect("checked in supports"))
    };
    let s0 = &*node.src[0];
    let s1 = node.src[1].as_ref();
    let nc = node.ne[0] as usize;
    let nr = node.ne[1] as usize;
    let swapped = node.op_params[1] != 0;
    // Row r's gate (x) and value (g), as ggml's `ggml_compute_forward_geglu_f32` reads them.
    let (a, a_nb) = (Ptr(s0.data.cast()), s0.nb[1]);
    let (b, b_nb) = match s1 {
        Some(s1) => (Ptr(s1.data.cast()), s1.nb[1]),
        None => (a, a_nb),
    };
    let (off_a, off_b) = match (s1.is_some(), swapped) {
        (true, _) => (0, 0),
        (false, false) => (0, nc),
        (false, true) => (nc, 0),
    };
    let (dst, dst_nb) = (Ptr(node.data.cast()), node.nb[1]);
    if nc == 0 || nr == 0 {
        return;
    }
    // Work in pieces of a row: every element is independent.
    let pieces = if nc * nr < SERIAL {
        1
    } else {
        (4 * threads).max(nr)
    };
    let per_row = pieces.div_ceil(nr).max(1);
    // Whole vectors of ggml's widest unit (16 lanes), so that each piece's vectors and tail
    // are those of ggml's row.
    let chunk = nc.div_ceil(per_row).next_multiple_of(16);
    let work = |p: usize| {
        let (r, c0) = (p / per_row, (p % per_row) * chunk);
        if r >= nr || c0 >= nc {
            return;
        }
        let len = chunk.min(nc - c0);
        // SAFETY: row r of each tensor holds its nc (or 2 nc) floats; pieces write disjoint
        // elements of dst.
        unsafe {
            let x = a.at(r * a_nb).cast::<f32>().add(off_a + c0);
            let gv = b.at(r * b_nb).cast::<f32>().add(off_b + c0);
            let y = dst.at(r * dst_nb).cast::<f32>().add(c0);
            unit.run(
                std::slice::from_raw_parts(x, len),
                std::slice::from_raw_parts(gv, len),
                std::slice::from_raw_parts_mut(y, len),
            );
        }
    };
    let total = nr * per_row;
    if pieces == 1 || threads <= 1 {
        (0..total).for_each(work);
    } else {
        parallel(threads.min(total), &|tid, nth| {
            for p in tid * total / nth..(tid + 1) * total / nth {
                work(p);
            }
        });
    }
}

/// The gated unit of a node.
#[derive(Clone, Copy)]
enum Unit {
    /// Gemma's GELU unit, with ggml's table widened.
    Geglu(&'static [f32]),
    /// SwiGLU (Llama's, SmolLM2's), with the loaded ggml's exponential.
    Swiglu(Exp),
}

impl Unit {
    fn run(self, x: &[f32], g: &[f32], y: &mut [f32]) {
        match self {
            Unit::Geglu(table) => geglu(table, x, g, y),
            Unit::Swiglu(exp) => leap_kernels::softmax::swiglu(exp, x, g, y),
        }
    }
}

/// The exponential with which SwiGLU's unit reproduces the loaded ggml's (the one its
/// softmax rows use: `crate::softmax`), if it passed [`swiglu_agrees_with_ggml`] (checked once
/// per process).
fn swiglu_exp() -> Option<Exp> {
    static EXP: OnceLock<Option<Exp>> = OnceLock::new();
    *EXP.get_or_init(|| {
        let exp = crate::softmax::exp()?;
        let ok = swiglu_agrees_with_ggml(exp);
        if !ok {
            log::warn!("Leap's SwiGLU unit does not reproduce ggml's here; not using it");
        }
        ok.then_some(exp)
    })
}

/// `y = gelu(x) * g` element by element, ggml's way (see [`leap_kernels::geglu`]).
fn geglu(table: &[f32], x: &[f32], g: &[f32], y: &mut [f32]) {
    // SAFETY: `table` ([`table`]'s 65536 entries) exists only where the CPU runs the unit;
    // slices of equal length.
    unsafe { kernel::geglu(table, x, g, y) }
}

/// Whether [`geglu`] reproduces ggml's own `GEGLU` op bit for bit: both forms (split and
/// fused, swapped or not are the same elements), on values across the table's range and past
/// both cut-offs, on the cut-offs and their neighbours, infinities, zeros, values that round
/// to f16 subnormals, zero or infinity, and NaN (on AArch64 times a NaN), with a length that
/// leaves a tail.
pub fn agrees_with_ggml() -> bool {
    let Some(table) = table() else { return false };
    const NC: usize = 1003;
    const NR: usize = 3;
    const SPECIAL: [f32; 14] = [
        -10.0,
        10.0,
        -9.999999,
        9.999999,
        -10.000001,
        10.000001,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        3.0e-6,
        -1.0e-8,
        65520.0,
        f32::NAN,
    ];
    let mut rnd = crate::check_values(0x2545_F491_4F6C_DD1Du64);
    let x: Vec<f32> = (0..NC * NR)
        .map(|i| match SPECIAL.get(i) {
            Some(&v) => v,
            None => rnd(if i % 3 == 0 { 30.0 } else { 6.0 }),
        })
        .collect();
    // On AArch64 a NaN gate on the NaN value: of two NaNs, the one ggml's product keeps (the
    // x86-64 unit does not pin that order).
    let gv: Vec<f32> = (0..NC * NR)
        .map(|i| match i {
            13 if cfg!(target_arch = "aarch64") => f32::from_bits(0x7fc0_1234),
            _ => rnd(4.0),
        })
        .collect();
    let Some(want) = ggml_unit(&x, &gv, NC, llama_cpp_sys_2::ggml_geglu_split) else {
        return false;
    };
    let mut got = vec![0f32; NC * NR];
    geglu(table, &x, &gv, &mut got);
    got.iter().map(|v| v.to_bits()).eq(want)
}

/// Whether SwiGLU's unit with `exp` gives ggml's own `SWIGLU` op bit for bit: rows of a
/// length that leaves a tail, values past the exponential's cut-offs, zeros, infinities.
pub fn swiglu_agrees_with_ggml(exp: Exp) -> bool {
    const NC: usize = 1539;
    const NR: usize = 3;
    let mut rnd = crate::check_values(0x6A09_E667_F3BC_C908u64);
    let x: Vec<f32> = (0..NC * NR)
        .map(|i| match i % 29 {
            1 => 0.0,
            2 => -0.0,
            3 => 120.0,
            4 => -120.0,
            5 => f32::NEG_INFINITY,
            6 => rnd(300.0),
            _ => rnd(12.0),
        })
        .collect();
    let gv: Vec<f32> = (0..NC * NR).map(|_| rnd(4.0)).collect();
    let Some(want) = ggml_unit(&x, &gv, NC, llama_cpp_sys_2::ggml_swiglu_split) else {
        return false;
    };
    let mut got = vec![0f32; NC * NR];
    for ((x, g), y) in x.chunks(NC).zip(gv.chunks(NC)).zip(got.chunks_mut(NC)) {
        leap_kernels::softmax::swiglu(exp, x, g, y);
    }
    got.iter().map(|v| v.to_bits()).eq(want)
}

/// ggml's own gated unit `unit` (`ggml_geglu_split`, `ggml_swiglu_split`) over rows of `nc` of
/// gates `x` and values `g`, as f32 bits; `None` when the graph fails.
fn ggml_unit(
    x: &[f32],
    g: &[f32],
    nc: usize,
    unit: unsafe extern "C" fn(
        *mut llama_cpp_sys_2::ggml_context,
        *mut llama_cpp_sys_2::ggml_tensor,
        *mut llama_cpp_sys_2::ggml_tensor,
    ) -> *mut llama_cpp_sys_2::ggml_tensor,
) -> Option<Vec<u32>> {
    let ctx = crate::check::Ctx::new()?;
    let ne = [nc as i64, (x.len() / nc) as i64, 1, 1];
    // SAFETY: tensors of the private context, written before its graph runs.
    unsafe {
        let out = unit(ctx.0, ctx.tensor_of(ne, x), ctx.tensor_of(ne, g));
        ctx.ggml(out)
    }
}

#[cfg(test)]
mod tests {
    /// The unit gives ggml's `GEGLU` bit for bit (where the CPU and ggml allow it at all).
    #[test]
    fn geglu_matches_ggml() {
        if !leap_kernels::geglu::cpu_ok() {
            eprintln!("the CPU does not run the unit (x86-64 needs AVX2/F16C)");
            return;
        }
        assert!(
            super::table().is_some(),
            "ggml's GELU table is in the process"
        );
        assert!(super::agrees_with_ggml());
    }

    /// SwiGLU's unit gives ggml's `SWIGLU` bit for bit with the exponential the softmax check
    /// found (where the CPU runs it).
    #[test]
    fn swiglu_matches_ggml() {
        use leap_kernels::softmax::Exp;
        let Some(exp) = crate::softmax::exp() else {
            eprintln!("the CPU runs neither exponential");
            return;
        };
        assert!(super::swiglu_agrees_with_ggml(exp));
        let other = match exp {
            Exp::Zmm => Exp::Ymm,
            Exp::Ymm => Exp::Zmm,
        };
        if leap_kernels::softmax::cpu_ok(other) {
            assert!(
                !super::swiglu_agrees_with_ggml(other),
                "the check tells {other:?} apart"
            );
        }
    }
}

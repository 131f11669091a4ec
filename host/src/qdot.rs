//! The multi-row quantized kernels (`leap_kernels::qdot`) checked against the ggml this process
//! loaded: [`agrees_with_ggml`] runs a kernel and ggml's own single-row `vec_dot` on rows ggml
//! quantized, and [`checked`] keeps a kernel only when every result is the same bit for bit.

pub use leap_kernels::qdot::{Acts, Kernel, Kind};

/// The ggml type id of a kernel's weight type.
pub fn ggml_type(kind: Kind) -> llama_cpp_sys_2::ggml_type {
    use llama_cpp_sys_2 as sys;
    match kind {
        Kind::Q8_0 => sys::GGML_TYPE_Q8_0,
        Kind::Q5_0 => sys::GGML_TYPE_Q5_0,
        Kind::Q4_1 => sys::GGML_TYPE_Q4_1,
        Kind::Q4K => sys::GGML_TYPE_Q4_K,
        Kind::Q6K => sys::GGML_TYPE_Q6_K,
    }
}

/// ggml's own single-row dot product for `kind`'s weights, as its `mul_mat` calls it
/// (`vec_dot` with nrc = 1): `f(n, w, a)` is a row of `n` weights at `w` times a row of `n`
/// values of the activation type at `a`. `None` when ggml has no `vec_dot` for the type.
pub fn ggml_vec_dot(kind: Kind) -> Option<impl Fn(usize, &[u8], &[u8]) -> f32> {
    use llama_cpp_sys_2 as sys;
    let ty = ggml_type(kind);
    // SAFETY: ggml_cpu_init is idempotent; the traits table is static.
    let tr = unsafe {
        sys::ggml_cpu_init();
        &*sys::ggml_get_type_traits_cpu(ty)
    };
    let vec_dot = tr.vec_dot?;
    // Bytes of a block and values a block, of the weight and the activation type.
    // SAFETY: size queries of types ggml has.
    let sizes = unsafe {
        [ty, tr.vec_dot_type].map(|t| (sys::ggml_type_size(t), sys::ggml_blck_size(t) as usize))
    };
    Some(move |n: usize, w: &[u8], a: &[u8]| {
        let [(wb, wv), (ab, av)] = sizes;
        assert!(
            w.len() >= n / wv * wb && a.len() >= n / av * ab,
            "rows shorter than {n} values"
        );
        let mut s = 0.0f32;
        // SAFETY: one full row of each type (checked above).
        unsafe {
            vec_dot(
                n as i32,
                &mut s,
                0,
                w.as_ptr().cast(),
                0,
                a.as_ptr().cast(),
                0,
                1,
            )
        };
        s
    })
}

/// Rows of `ty` quantized by ggml from pseudo-random values of several magnitudes.
fn quantized(
    ty: llama_cpp_sys_2::ggml_type,
    n: usize,
    rows: usize,
    rng: &mut leap_kernels::rng::XorShift,
) -> Vec<Vec<u8>> {
    use llama_cpp_sys_2 as sys;
    // SAFETY: ggml_cpu_init is idempotent; the traits table is static.
    let Some(from) = (unsafe {
        sys::ggml_cpu_init();
        (*sys::ggml_get_type_traits_cpu(ty)).from_float
    }) else {
        return Vec::new();
    };
    (0..rows)
        .map(|r| {
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    let u = rng.centered();
                    if (i * 7 + r) % 23 == 0 {
                        0.0
                    } else {
                        u * (1 + r % 5) as f32
                    }
                })
                .collect();
            // SAFETY: plain size arithmetic; `q` holds one row of `ty`.
            let mut q = vec![0u8; unsafe { sys::ggml_row_size(ty, n as i64) }];
            unsafe { from(x.as_ptr(), q.as_mut_ptr().cast(), n as i64) };
            q
        })
        .collect()
}

/// Whether `k` reproduces ggml's own single-row `vec_dot` for its type bit for bit, on rows
/// ggml quantized from pseudo-random values, 1 to 9 activation rows at once (whole groups
/// and remainders).
pub fn agrees_with_ggml(k: &Kernel) -> bool {
    use llama_cpp_sys_2 as sys;
    let mut rng = leap_kernels::rng::XorShift::new(0x2545_F491_4F6C_DD1D);
    let ty = ggml_type(k.kind());
    // SAFETY: static traits table.
    let tr = unsafe {
        sys::ggml_cpu_init();
        &*sys::ggml_get_type_traits_cpu(ty)
    };
    let Some(vec_dot) = ggml_vec_dot(k.kind()) else {
        return false;
    };
    let n = if k.kind().is_k() { 768 } else { 640 };
    let w = quantized(ty, n, 47, &mut rng);
    let a = quantized(tr.vec_dot_type, n, 9, &mut rng);
    if w.is_empty() || a.is_empty() {
        return false;
    }
    let all: Vec<u8> = w.concat();
    (1..=9).all(|rows| {
        let acts: Vec<&[u8]> = a[..rows].iter().map(Vec::as_slice).collect();
        k.agrees(n, &all, &acts, |wr, ar| vec_dot(n, wr, ar))
    })
}

/// The kernel for `kind` if this CPU has one and it passed [`agrees_with_ggml`] (checked once
/// per process and type).
pub fn checked(kind: Kind) -> Option<Kernel> {
    use std::sync::OnceLock;
    static CHECKED: [OnceLock<Option<Kernel>>; 5] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    let i = match kind {
        Kind::Q8_0 => 0,
        Kind::Q5_0 => 1,
        Kind::Q4_1 => 2,
        Kind::Q4K => 3,
        Kind::Q6K => 4,
    };
    *CHECKED[i].get_or_init(|| {
        let k = Kernel::new(kind)?;
        // On AArch64 ggml's lane order depends on whether it was built with dotprod (Leap's
        // own build is armv8-a; a stock llama.cpp loading the plugin may differ): the first
        // order that reproduces it is the one.
        let candidates = if cfg!(target_arch = "aarch64") {
            vec![k, k.for_ggml_dotprod(true)]
        } else {
            vec![k]
        };
        if let Some(k) = candidates.into_iter().find(agrees_with_ggml) {
            log::info!(
                "leap-cpu: {kind:?} products on Leap's {} kernel",
                k.variant()
            );
            return Some(k);
        }
        log::warn!("Leap's {kind:?} kernel does not reproduce ggml's vec_dot here; not using it");
        None
    })
}

#[cfg(test)]
mod tests {
    use super::{agrees_with_ggml, Kernel, Kind};

    /// Every kernel (with and without VNNI, on 512-bit registers or not) matches ggml's
    /// single-row `vec_dot` bit for bit.
    #[test]
    fn kernels_match_ggml_vec_dot() {
        for kind in [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1, Kind::Q4K, Kind::Q6K] {
            let Some(fast) = Kernel::new(kind) else {
                eprintln!("no {kind:?} kernel on this CPU");
                continue;
            };
            for k in [
                fast,
                fast.with_zmm(),
                fast.without_zmm(),
                fast.without_vnni(),
                fast.without_i8mm(),
                fast.without_dotprod(),
            ] {
                assert!(agrees_with_ggml(&k), "{k:?}");
            }
        }
    }
}

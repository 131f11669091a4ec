//! The multi-row quantized kernels (`leap_kernels::qdot`) checked against the ggml this process
//! loaded: [`agrees_with_ggml`] runs a kernel and ggml's own single-row `vec_dot` on rows ggml
//! quantized, and [`checked`] keeps a kernel only when every result is the same bit for bit.

pub use leap_kernels::qdot::{Acts, Kernel, Kind, Q4K_X8_BYTES};

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

/// The name of ggml's buffer type for weights llama.cpp repacked for the CPU's interleaved
/// kernels (one of the CPU device's extra buffer types).
pub const REPACK_BUFT: &[u8] = b"CPU_REPACK";

/// ggml's buffer type for repacked weights ([`REPACK_BUFT`]), if this ggml has one.
fn repack_buft() -> Option<llama_cpp_sys_2::ggml_backend_buffer_type_t> {
    use llama_cpp_sys_2 as sys;
    // SAFETY: registry queries; the proc address, when present, has the named signature, and
    // the list it returns is NULL-terminated.
    unsafe {
        let dev = sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU);
        if dev.is_null() {
            return None;
        }
        let reg = sys::ggml_backend_dev_backend_reg(dev);
        let f = sys::ggml_backend_reg_get_proc_address(
            reg,
            c"ggml_backend_dev_get_extra_bufts".as_ptr(),
        );
        if f.is_null() {
            return None;
        }
        let get: unsafe extern "C" fn(
            sys::ggml_backend_dev_t,
        ) -> *mut sys::ggml_backend_buffer_type_t = std::mem::transmute(f);
        let mut p = get(dev);
        while !p.is_null() && !(*p).is_null() {
            let name = std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(*p));
            if name.to_bytes() == REPACK_BUFT {
                return Some(*p);
            }
            p = p.add(1);
        }
        None
    }
}

/// A weight matrix in ggml's repacked-weights buffer and a CPU backend to multiply by it:
/// ggml's own products over repacked weights, for the checks below.
struct Repacked {
    ctx: *mut llama_cpp_sys_2::ggml_context,
    buf: llama_cpp_sys_2::ggml_backend_buffer_t,
    backend: llama_cpp_sys_2::ggml_backend_t,
    w: *mut llama_cpp_sys_2::ggml_tensor,
    /// Values a weight row, weight rows.
    n: usize,
    n_w: usize,
}

impl Repacked {
    /// `n_w` rows of `n` values of `ty` (`bytes`, ggml's layout) put in the repacked buffer;
    /// `None` when this ggml has no such buffer or did not repack `ty` here.
    fn new(ty: llama_cpp_sys_2::ggml_type, n: usize, n_w: usize, bytes: &[u8]) -> Option<Self> {
        use llama_cpp_sys_2 as sys;
        let buft = repack_buft()?;
        // SAFETY: a context of tensor metadata, its tensor allocated in `buft`, `bytes` one
        // tensor's worth (ggml checks the size); everything is freed by `drop`.
        unsafe {
            sys::ggml_cpu_init();
            let ctx = sys::ggml_init(Self::params());
            let w = sys::ggml_new_tensor_2d(ctx, ty, n as i64, n_w as i64);
            let buf = sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
            let backend = sys::ggml_backend_cpu_init();
            let r = Self {
                ctx,
                buf,
                backend,
                w,
                n,
                n_w,
            };
            // ggml gave the tensor a repacked layout (its `extra`) only where it has kernels for
            // the type on this CPU; setting data without one crashes inside ggml.
            if buf.is_null() || backend.is_null() || (*w).extra.is_null() {
                return None;
            }
            sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            sys::ggml_backend_tensor_set(w, bytes.as_ptr().cast(), 0, bytes.len());
            (r.bytes() != bytes).then_some(r)
        }
    }

    fn params() -> llama_cpp_sys_2::ggml_init_params {
        // SAFETY: size queries.
        unsafe {
            llama_cpp_sys_2::ggml_init_params {
                mem_size: llama_cpp_sys_2::ggml_tensor_overhead() * 8
                    + llama_cpp_sys_2::ggml_graph_overhead(),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: true,
            }
        }
    }

    /// The weights as ggml holds them (repacked).
    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocated tensor's data, `ggml_nbytes` long, host memory.
        unsafe {
            std::slice::from_raw_parts(
                (*self.w).data as *const u8,
                llama_cpp_sys_2::ggml_nbytes(self.w),
            )
        }
    }

    /// ggml's product of the weights with `x`'s rows (`n` floats each) computed `rows` at a
    /// time: row r's `n_w` results at `r * n_w`.
    fn product(&self, x: &[f32], rows: usize) -> Vec<f32> {
        use llama_cpp_sys_2 as sys;
        let (n, n_w) = (self.n, self.n_w);
        let mut all = Vec::with_capacity(x.len() / n * n_w);
        // SAFETY: a graph of one product in a context of its own, its tensors allocated on the
        // CPU backend, `x` and the output copied within their sizes; freed before returning.
        unsafe {
            let gctx = sys::ggml_init(Self::params());
            let xt = sys::ggml_new_tensor_2d(gctx, sys::GGML_TYPE_F32, n as i64, rows as i64);
            let yt = sys::ggml_mul_mat(gctx, self.w, xt);
            let graph = sys::ggml_new_graph(gctx);
            sys::ggml_build_forward_expand(graph, yt);
            let buf = sys::ggml_backend_alloc_ctx_tensors(gctx, self.backend);
            let mut out = vec![0f32; n_w * rows];
            for chunk in x.chunks_exact(n * rows) {
                sys::ggml_backend_tensor_set(xt, chunk.as_ptr().cast(), 0, n * rows * 4);
                sys::ggml_backend_graph_compute(self.backend, graph);
                sys::ggml_backend_tensor_get(yt, out.as_mut_ptr().cast(), 0, n_w * rows * 4);
                all.extend_from_slice(&out);
            }
            sys::ggml_backend_buffer_free(buf);
            sys::ggml_free(gctx);
        }
        all
    }
}

impl Drop for Repacked {
    fn drop(&mut self) {
        use llama_cpp_sys_2 as sys;
        // SAFETY: made by `new`, freed once.
        unsafe {
            if !self.backend.is_null() {
                sys::ggml_backend_free(self.backend);
            }
            if !self.buf.is_null() {
                sys::ggml_backend_buffer_free(self.buf);
            }
            sys::ggml_free(self.ctx);
        }
    }
}

/// Random weights of `ty` (`n_w` rows of `n`) repacked by ggml, and ggml's products over them
/// of `m` random rows computed alone and `rows` at a time, for `rows` in `2..=m`: how many of
/// those batches' rows differ from the row alone (bit for bit), and of how many. `None` where
/// this ggml does not repack `ty`. Only the test that prints these figures asks.
#[cfg(test)]
fn repacked_batch_rows_differing(
    ty: llama_cpp_sys_2::ggml_type,
    n: usize,
    n_w: usize,
    m: usize,
) -> Option<(usize, usize)> {
    let mut rng = leap_kernels::rng::XorShift::new(0x1234_5678_9ABC_DEF1);
    let w = quantized(ty, n, n_w, &mut rng).concat();
    let r = Repacked::new(ty, n, n_w, &w)?;
    let x: Vec<f32> = (0..n * m).map(|_| rng.centered() * 4.0).collect();
    let alone = r.product(&x, 1);
    let (mut differ, mut total) = (0, 0);
    for rows in 2..=m {
        let batch = r.product(&x[..n * rows], rows);
        for row in 0..rows {
            let (a, b) = (&alone[row * n_w..][..n_w], &batch[row * n_w..][..n_w]);
            differ += usize::from(a.iter().zip(b).any(|(p, q)| p.to_bits() != q.to_bits()));
        }
        total += rows;
    }
    Some((differ, total))
}

/// Whether `k` (a `Q4_K` kernel) gives what ggml's CPU backend gives a lone row over
/// *repacked* `Q4_K` weights, bit for bit ([`Kernel::dot_many_repacked`], reading the weights
/// ggml repacked into its buffer), 1 to 9 rows at once; and whether ggml's own nine-row product
/// over them rounds otherwise (`differs`, for tests). `None` where this ggml does not repack
/// `Q4_K` (no AVX2, or another architecture).
pub fn repacked_agrees_with_ggml(k: &Kernel) -> Option<(bool, bool)> {
    use llama_cpp_sys_2 as sys;
    if k.kind() != Kind::Q4K || !k.has_repacked() {
        return None;
    }
    let (n, n_w, m) = (768usize, 16usize, 9usize);
    let mut rng = leap_kernels::rng::XorShift::new(0x9E37_79B9_7F4A_7C15);
    let w = quantized(sys::GGML_TYPE_Q4_K, n, n_w, &mut rng).concat();
    let x: Vec<f32> = (0..n * m)
        .map(|i| rng.centered() * (1 + i % 3) as f32)
        .collect();
    let r = Repacked::new(sys::GGML_TYPE_Q4_K, n, n_w, &w)?;
    let alone = r.product(&x, 1);
    let differs = r.product(&x, m) != alone;
    // SAFETY: static traits table; each activation row is one Q8_K row of `n` values.
    let acts: Vec<Vec<u8>> = unsafe {
        let from = (*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q8_K))
            .from_float
            .expect("Q8_K has a quantizer");
        x.chunks_exact(n)
            .map(|row| {
                let mut q = vec![0u8; sys::ggml_row_size(sys::GGML_TYPE_Q8_K, n as i64)];
                from(row.as_ptr(), q.as_mut_ptr().cast(), n as i64);
                q
            })
            .collect()
    };
    let agrees = (1..=m).all(|rows| {
        let a: Vec<&[u8]> = acts[..rows].iter().map(Vec::as_slice).collect();
        let prepared = k.prepare(n, &a);
        let mut got = vec![f32::NAN; n_w * rows];
        k.dot_many_repacked(&prepared, r.bytes(), &mut got);
        (0..n_w).all(|i| {
            (0..rows).all(|row| got[i * rows + row].to_bits() == alone[row * n_w + i].to_bits())
        })
    });
    Some((agrees, differs))
}

/// [`checked`]'s `Q4_K` kernel if it also passed [`repacked_agrees_with_ggml`] (once per
/// process): the kernel for weights llama.cpp repacked.
pub fn checked_repacked() -> Option<Kernel> {
    use std::sync::OnceLock;
    static CHECKED: OnceLock<Option<Kernel>> = OnceLock::new();
    *CHECKED.get_or_init(|| {
        let k = checked(Kind::Q4K)?;
        match repacked_agrees_with_ggml(&k) {
            Some((true, _)) => Some(k),
            Some((false, _)) => {
                log::warn!(
                    "Leap's repacked-Q4_K kernel differs from ggml's lone row here: not used"
                );
                None
            }
            None => None,
        }
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

    /// Where ggml repacks `Q4_K` (x86-64 with AVX2), ggml's batch of four rows and more over
    /// repacked weights rounds otherwise than each row alone, and Leap's repacked-`Q4_K`
    /// kernel gives every row the lone row's bits, reading the weights in ggml's repacked
    /// buffer.
    #[test]
    fn the_repacked_kernel_matches_ggmls_lone_row() {
        let Some(k) = Kernel::new(Kind::Q4K).filter(Kernel::has_repacked) else {
            eprintln!("no repacked Q4_K kernel here: skipped");
            return;
        };
        #[cfg(target_arch = "x86_64")]
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let (agrees, differs) =
            super::repacked_agrees_with_ggml(&k).expect("ggml repacks Q4_K with AVX2");
        assert!(agrees);
        assert!(
            differs,
            "ggml's batch rounded as its lone row: the check tells nothing"
        );
        assert!(super::checked_repacked().is_some());
    }

    /// Which repacked types ggml computes otherwise in batches than alone, on this CPU: rows of
    /// 2- to 24-row batches whose results differ from the row alone, printed (`cargo test
    /// --release -p leap-host --lib repacked_batches -- --nocapture`). `Q4_K`'s do wherever ggml
    /// repacks it (the device takes those batches).
    #[test]
    fn which_repacked_batches_round_otherwise() {
        use llama_cpp_sys_2 as sys;
        let mut q4k = None;
        for (name, ty) in [
            ("q4_K", sys::GGML_TYPE_Q4_K),
            ("q4_0", sys::GGML_TYPE_Q4_0),
            ("iq4_nl", sys::GGML_TYPE_IQ4_NL),
            ("q2_K", sys::GGML_TYPE_Q2_K),
            ("q8_0", sys::GGML_TYPE_Q8_0),
        ] {
            match super::repacked_batch_rows_differing(ty, 1024, 512, 24) {
                Some((d, t)) => {
                    eprintln!("{name}: {d} of {t} batch rows differ from the row alone");
                    if ty == sys::GGML_TYPE_Q4_K {
                        q4k = Some(d);
                    }
                }
                None => eprintln!("{name}: not repacked here"),
            }
        }
        if let Some(d) = q4k {
            assert!(
                d > 0,
                "ggml's repacked Q4_K batches rounded as its lone rows"
            );
        }
    }
}

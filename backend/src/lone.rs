//! The check that [`leap_kernels::lone`] gives the loaded ggml's flash attention for a lone
//! query row bit for bit, and the [`Rounding`] under which it does: the ground a verification
//! row must stand on for `--spec-type leap` to keep llama.cpp's default flags (flash attention
//! on) and still give plain decoding's tokens (issue 35). The device does not take those
//! nodes yet.

use leap_kernels::f16::from_f32;
pub use leap_kernels::lone::{roundings, row, Merge, Rounding, SPLIT_FROM};

/// ggml's `vec_dot_f16` of f16 key rows with one query row (rounded to f16 first), through
/// Leap's kernels: `scores[c]` for the `n` cells at `keys`, `stride` halves apart.
///
/// # Safety
/// The CPU runs [`leap_kernels::kq`]'s kernels; `keys` holds the rows.
pub unsafe fn scores(keys: &[u16], stride: usize, n: usize, q: &[f32], out: &mut [f32]) {
    let dk = q.len();
    let mut qr = vec![0f32; dk];
    leap_kernels::kq::round_f16(q, &mut qr);
    assert!(n == 0 || keys.len() >= (n - 1) * stride + dk);
    let dots = leap_kernels::kq::kernels()[0];
    dots(keys.as_ptr().cast(), stride * 2, n, &qr, dk, &mut out[..n]);
}

/// The [`Rounding`] under which [`row`] gives the loaded ggml's `FLASH_ATTN_EXT` output bit for
/// bit for lone rows (split and not, one to three threads, masked cells, Gemma 3's and
/// SmolLM2's head sizes), or `None` when none does (or the CPU does not run Leap's kernels).
pub fn agrees_with_ggml() -> Option<Rounding> {
    if !leap_kernels::kq::cpu_ok() {
        return None;
    }
    let cases = cases();
    let wants: Vec<Vec<f32>> = cases.iter().map(|c| c.ggml()).collect::<Option<_>>()?;
    roundings().find(|&r| {
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
    fn leap(&self, r: Rounding) -> Vec<f32> {
        let (d, per) = (self.d, self.heads / self.kv_heads);
        let stride = self.kv_heads * d;
        let mut out = vec![0f32; self.heads * d];
        let mut s = vec![0f32; self.n_kv];
        for h in 0..self.heads {
            let kvh = h / per;
            // SAFETY: the caller checked the CPU; n_kv rows of `stride` halves from kvh * d.
            unsafe {
                scores(
                    &self.k[kvh * d..],
                    stride,
                    self.n_kv,
                    &self.q[h * d..(h + 1) * d],
                    &mut s,
                )
            };
            row(
                &s,
                &self.mask,
                self.scale,
                &self.v[kvh * d..],
                stride,
                d,
                self.threads,
                r,
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
        let matching: Vec<Rounding> = roundings()
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
        eprintln!("roundings matching ggml: {matching:?}");
        assert!(matching.contains(&r));
    }
}

//! The graphs Leap builds on QNN, and the CPU references every result is compared with.
//!
//! - [`matmul_f32`]: `y[m,n] = x[m,k] · w[k,n]`, `w` baked in as a static tensor.
//! - [`qk_estimate`]: sparse attention's importance estimate (shadowAttn, 004 §3.1):
//!   `s[h,r,c] = q[h,r,:] · k[h,c,:]` with int8 keys (the K cache's shadow) and 16-bit queries,
//!   one scale pair per graph (its scale bucket, [`crate::bucket`]); `h` heads of the same
//!   bucket are fused in one launch (004 §3.4). The output is 16-bit with a range that cannot
//!   saturate. (HTP's MatMul has no 8-bit x 8-bit -> 16-bit form: its validator lists 8x8->8 and
//!   16x8->16, measured on the 2.40 library; an 8-bit score keeps too few levels to rank keys.)
//! - [`matmul_q8`]: a quantized MatMul chunk: 8-bit activations, symmetric int8 static weights,
//!   8-bit output.
//!
//! Int8 values travel as `UFIXED_POINT_8` with offset -128 (`u = i + 128`), int16 as
//! `UFIXED_POINT_16` with offset -32768: the encodings the x86 HTP library computes exactly.

use crate::backend::{Context, Graph, Param};
use crate::error::Result;
use crate::tensor::{f32_bytes, DataType, Quant, Role, TensorSpec};

/// `y[m,n] = x[m,k] · w[k,n]` in f32; `w` is row-major `[k, n]`. Returns the graph and its
/// finalize time in ms.
///
/// # Errors
/// QNN errors from building or finalizing.
pub fn matmul_f32(
    ctx: &Context,
    name: &str,
    (m, k, n): (u32, u32, u32),
    w: &[f32],
) -> Result<(Graph, f64)> {
    let mut g = ctx.graph(name)?;
    let x = g.tensor(
        TensorSpec::new("x", Role::Input, DataType::F32, &[m, k]),
        None,
    )?;
    let wt = g.tensor(
        TensorSpec::new("w", Role::Static, DataType::F32, &[k, n]),
        Some(f32_bytes(w)),
    )?;
    let y = g.tensor(
        TensorSpec::new("y", Role::Output, DataType::F32, &[m, n]),
        None,
    )?;
    g.node("matmul", "MatMul", &[], &[x, wt], &[y])?;
    g.finalize()
}

/// The shape of a fused Q·K estimate: `heads` heads of `rows` queries against `keys` keys of
/// dimension `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QkShape {
    pub heads: u32,
    pub rows: u32,
    pub keys: u32,
    pub d: u32,
}

/// The output quantization of a Q·K graph: symmetric 16-bit covering `±32767·127·d·λq·λk`,
/// the largest possible int16 x int8 dot product, so the estimate never saturates.
pub fn qk_output_quant(d: u32, q_scale: f32, k_scale: f32) -> Quant {
    let bound = 32767.0 * 127.0 * d as f64 * q_scale as f64 * k_scale as f64;
    Quant::symmetric_u16((bound / 32767.0) as f32)
}

/// The tensors of a Q·K graph (inputs `q`, `k`, output `s`), for building and for reloading
/// it from a context binary.
pub fn qk_tensors(shape: QkShape, q_scale: f32, k_scale: f32) -> Vec<TensorSpec> {
    qk_tensors_as(
        shape,
        Quant::symmetric_u16(q_scale),
        (DataType::UFixed8, Quant::symmetric_u8(k_scale)),
        qk_output_quant(shape.d, q_scale, k_scale),
    )
}

/// The tensors of a Q·K graph with 16-bit queries quantized as `q`, keys of type and
/// quantization `k`, and 16-bit scores quantized as `s`.
pub fn qk_tensors_as(shape: QkShape, q: Quant, k: (DataType, Quant), s: Quant) -> Vec<TensorSpec> {
    let QkShape {
        heads,
        rows,
        keys,
        d,
    } = shape;
    vec![
        TensorSpec::new("q", Role::Input, DataType::UFixed16, &[heads, rows, d]).quantized(q),
        TensorSpec::new("k", Role::Input, k.0, &[heads, keys, d]).quantized(k.1),
        TensorSpec::new("s", Role::Output, DataType::UFixed16, &[heads, rows, keys]).quantized(s),
    ]
}

/// The Q·K estimate graph for one scale pair. Inputs: `q` `[heads, rows, d]` as [`to_u16`] of
/// int16 values and `k` `[heads, keys, d]` as [`to_u8`] of int8 values; output `s`
/// `[heads, rows, keys]` 16-bit, see [`qk_output_quant`].
///
/// # Errors
/// QNN errors from building or finalizing.
pub fn qk_estimate(
    ctx: &Context,
    name: &str,
    shape: QkShape,
    q_scale: f32,
    k_scale: f32,
) -> Result<(Graph, f64)> {
    let mut g = ctx.graph(name)?;
    let [qs, ks, ss]: [TensorSpec; 3] = qk_tensors(shape, q_scale, k_scale)
        .try_into()
        .map_err(|_| crate::Error::Shape("a Q·K graph has three tensors"))?;
    let q = g.tensor(qs, None)?;
    let k = g.tensor(ks, None)?;
    let s = g.tensor(ss, None)?;
    g.node(
        "qk",
        "MatMul",
        &[
            Param::Bool("transpose_in0", false),
            Param::Bool("transpose_in1", true),
        ],
        &[q, k],
        &[s],
    )?;
    g.finalize()
}

/// A quantized MatMul chunk: `x` `[m,k]` 8-bit with `x_quant`, static symmetric int8 weights
/// `w` `[k,n]` with `w_scale`, output `[m,n]` 8-bit with `y_quant`.
///
/// # Errors
/// QNN errors from building or finalizing.
pub fn matmul_q8(
    ctx: &Context,
    name: &str,
    (m, k, n): (u32, u32, u32),
    w: &[i8],
    w_scale: f32,
    x_quant: Quant,
    y_quant: Quant,
) -> Result<(Graph, f64)> {
    let mut g = ctx.graph(name)?;
    let x = g.tensor(
        TensorSpec::new("x", Role::Input, DataType::UFixed8, &[m, k]).quantized(x_quant),
        None,
    )?;
    let wb: Vec<u8> = w.iter().map(|&v| v as u8).collect();
    let wt = g.tensor(
        TensorSpec::new("w", Role::Static, DataType::SFixed8, &[k, n]).quantized(Quant {
            scale: w_scale,
            offset: 0,
        }),
        Some(&wb),
    )?;
    let y = g.tensor(
        TensorSpec::new("y", Role::Output, DataType::UFixed8, &[m, n]).quantized(y_quant),
        None,
    )?;
    g.node("matmul", "MatMul", &[], &[x, wt], &[y])?;
    g.finalize()
}

// ---------------------------------------------------------------------------------------------
// CPU side: quantization, references, comparison. Pure code.

/// Int8 as `UFIXED_POINT_8` with offset -128.
pub fn to_u8(x: &[i8]) -> Vec<u8> {
    x.iter().map(|&v| (v as u8) ^ 0x80).collect()
}

/// The symmetric int8 scale of `x`: `max|x| / 127` (1 for all zeros).
pub fn symmetric_scale(x: &[f32]) -> f32 {
    symmetric_scale_to(x, 127.0)
}

/// The symmetric scale mapping `max|x|` to `top` (1 for all zeros).
pub fn symmetric_scale_to(x: &[f32], top: f32) -> f32 {
    let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if m > 0.0 {
        m / top
    } else {
        1.0
    }
}

/// Int16 as `UFIXED_POINT_16` with offset -32768.
pub fn to_u16(x: &[i16]) -> Vec<u16> {
    x.iter().map(|&v| (v as u16) ^ 0x8000).collect()
}

/// Quantize to int16 with `scale`, rounding to nearest and clamping to ±32767.
pub fn quantize_i16(x: &[f32], scale: f32) -> Vec<i16> {
    x.iter()
        .map(|&v| (v / scale).round().clamp(-32767.0, 32767.0) as i16)
        .collect()
}

/// Quantize to int8 with `scale`, rounding to nearest and clamping to ±127.
pub fn quantize_i8(x: &[f32], scale: f32) -> Vec<i8> {
    x.iter()
        .map(|&v| (v / scale).round().clamp(-127.0, 127.0) as i8)
        .collect()
}

/// Quantize to an 8-bit unsigned tensor with `quant` (`q = round(x/scale) - offset`).
pub fn quantize_u8(x: &[f32], quant: Quant) -> Vec<u8> {
    x.iter()
        .map(|&v| ((v / quant.scale).round() - quant.offset as f32).clamp(0.0, 255.0) as u8)
        .collect()
}

/// The asymmetric 8-bit quantization covering `[lo, hi]` (which is widened to include 0).
pub fn range_quant_u8(lo: f32, hi: f32) -> Quant {
    let (lo, hi) = (lo.min(0.0), hi.max(0.0));
    let scale = ((hi - lo) / 255.0).max(f32::MIN_POSITIVE);
    Quant {
        scale,
        offset: (lo / scale).round() as i32,
    }
}

/// Fold the keys' per-channel ranges into the queries: channel `c` of every key is divided by
/// `m_c = max_j |k[j][c]|` and channel `c` of every query multiplied by it, so `q·k` is
/// unchanged while one per-tensor int8 scale fits every key channel (SmoothQuant's migration,
/// taken all the way: the 16-bit queries have the range to spare). `q` and `k` are rows of `d`.
pub fn smooth_keys(q: &mut [f32], k: &mut [f32], d: usize) {
    let mut m = vec![0f32; d];
    for row in k.chunks(d) {
        for (mc, &v) in m.iter_mut().zip(row) {
            *mc = mc.max(v.abs());
        }
    }
    for row in k.chunks_mut(d) {
        for (v, &mc) in row.iter_mut().zip(&m) {
            if mc > 0.0 {
                *v /= mc;
            }
        }
    }
    for row in q.chunks_mut(d) {
        for (v, &mc) in row.iter_mut().zip(&m) {
            if mc > 0.0 {
                *v *= mc;
            }
        }
    }
}

/// `y[m,n] = x[m,k] · w[k,n]`, accumulated in f64.
pub fn matmul_ref(x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| x[i * k + p] as f64 * w[p * n + j] as f64)
                .sum();
            y[i * n + j] = s as f32;
        }
    }
    y
}

/// Exact Q·K on the integers: `s[h,r,c] = Σ q[h,r,:]·k[h,c,:]`.
pub fn qk_ref_int(q: &[i16], k: &[i8], shape: QkShape) -> Vec<i64> {
    let (h, r, c, d) = (
        shape.heads as usize,
        shape.rows as usize,
        shape.keys as usize,
        shape.d as usize,
    );
    let mut s = vec![0i64; h * r * c];
    for hh in 0..h {
        for rr in 0..r {
            let qrow = &q[(hh * r + rr) * d..][..d];
            for cc in 0..c {
                let krow = &k[(hh * c + cc) * d..][..d];
                s[(hh * r + rr) * c + cc] = qrow
                    .iter()
                    .zip(krow)
                    .map(|(&a, &b)| a as i64 * b as i64)
                    .sum();
            }
        }
    }
    s
}

/// Dequantize a 16-bit output.
pub fn dequantize_u16(x: &[u16], quant: Quant) -> Vec<f32> {
    x.iter().map(|&v| quant.dequantize(v as i64)).collect()
}

/// Dequantize an 8-bit output.
pub fn dequantize_u8(x: &[u8], quant: Quant) -> Vec<f32> {
    x.iter().map(|&v| quant.dequantize(v as i64)).collect()
}

/// `max |a - b|`.
pub fn max_abs_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Indices of the `k` largest values (ties broken by lower index).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Mean over rows of `|top_k(estimate) ∩ top_k(exact)| / k`; rows are `n` long.
pub fn top_k_recall(estimate: &[f32], exact: &[f32], n: usize, k: usize) -> f64 {
    let rows = exact.len() / n;
    if rows == 0 || k == 0 {
        return 1.0;
    }
    let mut total = 0.0;
    for r in 0..rows {
        let want = top_k(&exact[r * n..][..n], k);
        let got = top_k(&estimate[r * n..][..n], k);
        let mut mark = vec![false; n];
        for i in want {
            mark[i] = true;
        }
        total += got.iter().filter(|&&i| mark[i]).count() as f64 / k as f64;
    }
    total / rows as f64
}

/// A small deterministic generator for test data (xorshift64*), uniform in `[-1, 1)`.
pub struct Lcg(pub u64);

impl Lcg {
    /// The next value in `[-1, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (v as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` values scaled by `scale`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_travels_as_offset_u8() {
        assert_eq!(to_u8(&[-128, -1, 0, 1, 127]), vec![0, 127, 128, 129, 255]);
        assert_eq!(to_u16(&[-32768, -1, 0, 1]), vec![0, 32767, 32768, 32769]);
        assert_eq!(quantize_i16(&[1.0, -70000.0], 0.5), vec![2, -32767]);
        let q = Quant::symmetric_u8(0.5);
        assert_eq!(q.dequantize(to_u8(&[3])[0] as i64), 1.5);
    }

    #[test]
    fn quantizers_round_and_clamp() {
        assert_eq!(quantize_i8(&[0.26, -0.24, 9.0], 0.5), vec![1, 0, 18]);
        assert_eq!(quantize_i8(&[1000.0], 1.0), vec![127]);
        let q = range_quant_u8(-1.0, 3.0);
        let back = dequantize_u8(&quantize_u8(&[-1.0, 0.0, 3.0], q), q);
        assert!(max_abs_err(&back, &[-1.0, 0.0, 3.0]) <= q.scale / 2.0 + 1e-6);
        assert_eq!(symmetric_scale(&[0.0, -254.0]), 2.0);
    }

    #[test]
    fn qk_reference_and_output_range() {
        let shape = QkShape {
            heads: 2,
            rows: 1,
            keys: 2,
            d: 2,
        };
        let s = qk_ref_int(&[1, 2, 3, 4], &[1, 1, -1, 0, 2, 2, 0, 1], shape);
        assert_eq!(s, vec![3, -1, 14, 4]);
        let oq = qk_output_quant(2, 1.0, 1.0);
        // The largest product maps to (about) the top code.
        let top = 32767.0 * 127.0 * 2.0 / oq.scale - oq.offset as f32;
        assert!((top - 65535.0).abs() < 1.5, "{top}");
    }

    #[test]
    fn recall_counts_overlap() {
        let exact = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0];
        assert_eq!(top_k(&exact, 2), vec![0, 1]);
        assert_eq!(top_k_recall(&exact, &exact, 6, 2), 1.0);
        let est = [5.0, 0.0, 3.0, 2.0, 1.0, 4.0];
        assert_eq!(top_k_recall(&est, &exact, 6, 2), 0.5);
        assert_eq!(top_k_recall(&est, &exact, 3, 1), 0.5);
    }

    #[test]
    fn smoothing_keeps_scores_and_evens_key_channels() {
        let mut rng = Lcg(1);
        let (d, n) = (8, 5);
        let q0 = rng.vec(2 * d, 1.0);
        let mut k0 = rng.vec(n * d, 1.0);
        for row in k0.chunks_mut(d) {
            row[3] *= 50.0; // an outlier channel
        }
        let (mut q, mut k) = (q0.clone(), k0.clone());
        smooth_keys(&mut q, &mut k, d);
        let dot = |q: &[f32], k: &[f32], r: usize, j: usize| -> f32 {
            (0..d).map(|c| q[r * d + c] * k[j * d + c]).sum()
        };
        for r in 0..2 {
            for j in 0..n {
                assert!((dot(&q, &k, r, j) - dot(&q0, &k0, r, j)).abs() < 1e-3);
            }
        }
        assert!(k.iter().all(|v| v.abs() <= 1.0));
        assert!((0..d).all(|c| k.chunks(d).any(|row| row[c].abs() == 1.0)));
    }

    #[test]
    fn matmul_reference() {
        let y = matmul_ref(&[1.0, 2.0], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], (1, 2, 3));
        assert_eq!(y, vec![3.0, 2.0, 2.0]);
    }
}

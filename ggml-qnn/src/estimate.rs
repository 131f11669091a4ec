//! Sparse attention's Q·K estimate on QNN with **per-row scales**: one static graph serves
//! every head, because the CPU normalizes what goes in and rescales what comes out.
//!
//! A static QNN graph bakes its tensors' scales in. 004 §3.3 therefore quantizes each head
//! with one scale and keeps graphs for buckets of scales ([`crate::bucket`]); on Gemma 3 that
//! left the int8 estimate at 0.97-0.98 recall@20% (one scale per head is too coarse for keys
//! whose norms differ). Here the scales move out of the graph, which is exact for `q·k`:
//!
//! 1. **Channels** ([`crate::ops::smooth_keys`]): channel `c` of the keys is divided by its
//!    largest magnitude `m_c` over the keys, the queries multiplied by it.
//! 2. **Keys**: each smoothed key `j` is divided by its own largest magnitude `σ_j`, so every
//!    key uses the whole int8 range (`k̂ ∈ [-1, 1]`, static scale 1/127).
//! 3. **Queries**: each smoothed query row is multiplied by
//!    `α = min(1 / max|q|, R / Σ|q|)`, so it fits the static 16-bit input (`|q̃| ≤ 1`) and its
//!    score with any `k̂` fits the static 16-bit output range `±R` (`|q̃·k̂| ≤ Σ|q̃| ≤ R`): the
//!    output cannot saturate, and is not spread over the worst case `d·max|q|` either.
//!
//! The graph computes `q̃·k̂` (16-bit x 8-bit -> 16-bit MatMul, the form HTP's validator
//! offers), and the CPU returns `s = out · σ_j / α`. Keys are padded to a multiple of
//! [`KEY_BLOCK`] (zero keys) so a growing context reuses a handful of graph shapes; graphs
//! are cached by shape. Scores are returned for the real keys only.

use crate::backend::{Context, Device, Graph};
use crate::bucket::{GraphCache, GraphKey};
use crate::error::{Error, Result};
use crate::ops::{self, QkShape};
use crate::tensor::{u16_bytes, u16_bytes_mut, DataType, Quant, TensorSpec};
use crate::Api;
use crate::Backend;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The static output range `R`: scores of normalized operands lie in `[-R, R]`.
pub const OUT_RANGE: f32 = 16.0;
/// Keys are padded to a multiple of this many (graph shapes grow in these steps).
pub const KEY_BLOCK: usize = 512;

/// The key precision of the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyBits {
    /// int8 keys (`UFIXED_POINT_8`), what the NPU's MatMul is fast at.
    Eight,
    /// 16-bit keys (`UFIXED_POINT_16`), if the backend's validator accepts 16 x 16.
    Sixteen,
}

impl KeyBits {
    fn top(self) -> f32 {
        match self {
            KeyBits::Eight => 127.0,
            KeyBits::Sixteen => 32767.0,
        }
    }
    fn dtype(self) -> DataType {
        match self {
            KeyBits::Eight => DataType::UFixed8,
            KeyBits::Sixteen => DataType::UFixed16,
        }
    }
    fn quant(self) -> Quant {
        match self {
            KeyBits::Eight => Quant::symmetric_u8(1.0 / 127.0),
            KeyBits::Sixteen => Quant::symmetric_u16(1.0 / 32767.0),
        }
    }
}

/// The output quantization: symmetric 16-bit over `±OUT_RANGE`.
pub fn out_quant() -> Quant {
    Quant::symmetric_u16(OUT_RANGE / 32767.0)
}

/// The tensors of a normalized estimate graph (inputs `q`, `k`, output `s`).
pub fn tensors(shape: QkShape, bits: KeyBits) -> Vec<TensorSpec> {
    ops::qk_tensors_as(
        shape,
        Quant::symmetric_u16(1.0 / 32767.0),
        (bits.dtype(), bits.quant()),
        out_quant(),
    )
}

/// Build and finalize the normalized estimate graph of `shape`.
///
/// # Errors
/// QNN errors from building (validation refuses unsupported key precisions) or finalizing.
pub fn graph(ctx: &Context, name: &str, shape: QkShape, bits: KeyBits) -> Result<(Graph, f64)> {
    let mut g = ctx.graph(name)?;
    let [qs, ks, ss]: [TensorSpec; 3] = tensors(shape, bits)
        .try_into()
        .map_err(|_| Error::Shape("an estimate graph has three tensors"))?;
    let q = g.tensor(qs, None)?;
    let k = g.tensor(ks, None)?;
    let s = g.tensor(ss, None)?;
    g.node(
        "qk",
        "MatMul",
        &[
            crate::Param::Bool("transpose_in0", false),
            crate::Param::Bool("transpose_in1", true),
        ],
        &[q, k],
        &[s],
    )?;
    g.finalize()
}

/// Normalized, quantized operands of one launch and the factors that undo the normalization.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The launch's shape (keys padded to [`KEY_BLOCK`]).
    pub shape: QkShape,
    /// The real keys per head.
    pub keys: usize,
    pub bits: KeyBits,
    /// `[heads, rows, d]` as `UFIXED_POINT_16`.
    pub q: Vec<u16>,
    /// `[heads, keys, d]` as `UFIXED_POINT_8` (or 16, as native-endian pairs).
    pub k: Vec<u8>,
    /// `1/α` per (head, row).
    pub row_scale: Vec<f32>,
    /// `σ_j` per (head, key).
    pub key_scale: Vec<f32>,
}

/// Normalize and quantize `heads` heads of `rows` queries (`q`, rows of `d`) against their
/// `keys` keys (`k`, rows of `d`, per head), see the module docs.
pub fn prepare(
    q: &[f32],
    k: &[f32],
    (heads, rows, keys, d): (usize, usize, usize, usize),
    bits: KeyBits,
) -> Prepared {
    assert!(q.len() >= heads * rows * d && k.len() >= heads * keys * d);
    let padded = keys.div_ceil(KEY_BLOCK).max(1) * KEY_BLOCK;
    let ksize = bits.dtype().size();
    let mut out = Prepared {
        shape: QkShape {
            heads: heads as u32,
            rows: rows as u32,
            keys: padded as u32,
            d: d as u32,
        },
        keys,
        bits,
        q: Vec::with_capacity(heads * rows * d),
        k: vec![0; heads * padded * d * ksize],
        row_scale: Vec::with_capacity(heads * rows),
        key_scale: Vec::with_capacity(heads * keys),
    };
    // Zero in the stored encodings (symmetric: the offset's code).
    let zero_k: &[u8] = match bits {
        KeyBits::Eight => &[0x80],
        KeyBits::Sixteen => &[0x00, 0x80],
    };
    let top = bits.top();
    let mut m = vec![0f32; d];
    let mut qs = vec![0f32; d];
    for h in 0..heads {
        let kh = &k[h * keys * d..][..keys * d];
        m.fill(0.0);
        for row in kh.chunks_exact(d) {
            for (mc, &v) in m.iter_mut().zip(row) {
                *mc = mc.max(v.abs());
            }
        }
        let kout = &mut out.k[h * padded * d * ksize..][..padded * d * ksize];
        for (j, row) in kh.chunks_exact(d).enumerate() {
            let sigma =
                row.iter().zip(&m).fold(
                    0f32,
                    |a, (&v, &mc)| if mc > 0.0 { a.max((v / mc).abs()) } else { a },
                );
            out.key_scale.push(sigma);
            let dst = &mut kout[j * d * ksize..][..d * ksize];
            for (c, (&v, &mc)) in row.iter().zip(&m).enumerate() {
                let x = if mc > 0.0 && sigma > 0.0 {
                    (v / (mc * sigma) * top).round().clamp(-top, top) as i32
                } else {
                    0
                };
                match bits {
                    KeyBits::Eight => dst[c] = (x as i8 as u8) ^ 0x80,
                    KeyBits::Sixteen => dst[c * 2..c * 2 + 2]
                        .copy_from_slice(&((x as i16 as u16) ^ 0x8000).to_ne_bytes()),
                }
            }
        }
        for pad in kout[keys * d * ksize..].chunks_exact_mut(ksize) {
            pad.copy_from_slice(zero_k);
        }
        for r in 0..rows {
            let qr = &q[(h * rows + r) * d..][..d];
            let (mut max, mut sum) = (0f32, 0f32);
            for ((s, &v), &mc) in qs.iter_mut().zip(qr).zip(&m) {
                *s = v * mc;
                max = max.max(s.abs());
                sum += s.abs();
            }
            // A margin for rounding: the quantized row's Σ|q| stays within R.
            let alpha = if max > 0.0 {
                (1.0 / max).min(OUT_RANGE * 0.999 / sum)
            } else {
                1.0
            };
            out.row_scale.push(1.0 / alpha);
            out.q.extend(qs.iter().map(|&v| {
                ((v * alpha * 32767.0).round().clamp(-32767.0, 32767.0) as i16 as u16) ^ 0x8000
            }));
        }
    }
    out
}

impl Prepared {
    /// Scores `[heads, rows, keys]` (real keys only) from the graph's output `s`.
    pub fn finish(&self, s: &[u16], out: &mut [f32]) {
        let (heads, rows, padded) = (
            self.shape.heads as usize,
            self.shape.rows as usize,
            self.shape.keys as usize,
        );
        let oq = out_quant();
        for h in 0..heads {
            for r in 0..rows {
                let inv_alpha = self.row_scale[h * rows + r];
                let src = &s[(h * rows + r) * padded..][..self.keys];
                let dst = &mut out[(h * rows + r) * self.keys..][..self.keys];
                let sig = &self.key_scale[h * self.keys..][..self.keys];
                for ((o, &v), &sg) in dst.iter_mut().zip(src).zip(sig) {
                    *o = oq.dequantize(v as i64) * inv_alpha * sg;
                }
            }
        }
    }

    /// What the graph computes, on the CPU: the exact integer products rounded once to the
    /// output's step (the reference the device is checked against).
    pub fn simulate(&self) -> Vec<u16> {
        let (heads, rows, keys, d) = (
            self.shape.heads as usize,
            self.shape.rows as usize,
            self.shape.keys as usize,
            self.shape.d as usize,
        );
        let kq = self.bits.quant();
        let oq = out_quant();
        let key = |h: usize, j: usize, c: usize| -> i64 {
            let at = (h * keys + j) * d + c;
            match self.bits {
                KeyBits::Eight => (self.k[at] ^ 0x80) as i8 as i64,
                KeyBits::Sixteen => {
                    (u16::from_ne_bytes([self.k[2 * at], self.k[2 * at + 1]]) ^ 0x8000) as i16
                        as i64
                }
            }
        };
        let mut s = Vec::with_capacity(heads * rows * keys);
        for h in 0..heads {
            for r in 0..rows {
                let qr = &self.q[(h * rows + r) * d..][..d];
                for j in 0..keys {
                    let dot: i64 = (0..d)
                        .map(|c| ((qr[c] ^ 0x8000) as i16 as i64) * key(h, j, c))
                        .sum();
                    let real = dot as f64 / 32767.0 * kq.scale as f64;
                    let code = (real / oq.scale as f64).round() - oq.offset as f64;
                    s.push(code.clamp(0.0, 65535.0) as u16);
                }
            }
        }
        s
    }
}

/// The estimate on a QNN device: one context, graphs cached by shape, executes counted.
pub struct Estimator {
    ctx: Context,
    graphs: Mutex<GraphCache<Graph>>,
    executes: AtomicU64,
    /// Finalize time of every graph built so far, ms.
    finalize_ms: Mutex<f64>,
}

impl Estimator {
    /// A backend, (default) device and context on `api`.
    ///
    /// # Errors
    /// QNN errors creating them.
    pub fn open(api: Arc<Api>) -> Result<Estimator> {
        let backend = Backend::new(api)?;
        Estimator::new(&Device::new(&backend, None)?)
    }

    /// A context of its own on `device`.
    ///
    /// # Errors
    /// QNN errors creating it.
    pub fn new(device: &Device) -> Result<Estimator> {
        let ctx = Context::new(device)?;
        Ok(Estimator {
            ctx,
            graphs: Mutex::new(GraphCache::default()),
            executes: AtomicU64::new(0),
            finalize_ms: Mutex::new(0.0),
        })
    }

    /// Run the graph for `p`'s shape (built on first use) and return its raw output.
    ///
    /// # Errors
    /// QNN errors building or executing the graph.
    pub fn run(&self, p: &Prepared) -> Result<Vec<u16>> {
        let key = GraphKey {
            op: "qkn",
            shape: vec![p.shape.heads, p.shape.rows, p.shape.keys, p.shape.d],
            dtype: match p.bits {
                KeyBits::Eight => "q16xq8",
                KeyBits::Sixteen => "q16xq16",
            },
            bucket: None,
        };
        let mut s = vec![0u16; (p.shape.heads * p.shape.rows * p.shape.keys) as usize];
        {
            let mut cache = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            let g = cache.get_or_build(key, |k| {
                let (g, ms) = graph(&self.ctx, &k.name(), p.shape, p.bits)?;
                *self.finalize_ms.lock().unwrap_or_else(|e| e.into_inner()) += ms;
                Ok::<_, Error>(g)
            })?;
            // Executing under the lock: one launch at a time (the emulator uses the cores).
            g.execute(&[u16_bytes(&p.q), &p.k], &mut [u16_bytes_mut(&mut s)])?;
        }
        self.executes.fetch_add(1, Ordering::Relaxed);
        Ok(s)
    }

    /// Scores `[heads, rows, keys]` of f32 queries against f32 keys (see [`prepare`]).
    ///
    /// # Errors
    /// As [`Estimator::run`].
    pub fn scores(
        &self,
        q: &[f32],
        k: &[f32],
        dims: (usize, usize, usize, usize),
        out: &mut [f32],
    ) -> Result<()> {
        let p = prepare(q, k, dims, KeyBits::Eight);
        let s = self.run(&p)?;
        p.finish(&s, out);
        Ok(())
    }

    /// Graph executions so far.
    pub fn executes(&self) -> u64 {
        self.executes.load(Ordering::Relaxed)
    }

    /// Graphs built so far and their total finalize time (ms).
    pub fn graphs(&self) -> (usize, f64) {
        let n = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).len();
        (
            n,
            *self.finalize_ms.lock().unwrap_or_else(|e| e.into_inner()),
        )
    }
}

/// Keep the estimate's top `k` plus `extra` more candidates, re-rank those by the exact
/// scores and keep the best `k`: what sparse attention's kept set is (`leap-backend`'s
/// `Sparse::refine`). Returns the recall of that kept set against the exact top-k, averaged
/// over rows of `n`.
pub fn kept_recall(estimate: &[f32], exact: &[f32], n: usize, k: usize, extra: usize) -> f64 {
    let rows = exact.len() / n;
    if rows == 0 || k == 0 {
        return 1.0;
    }
    let mut total = 0.0;
    for r in 0..rows {
        let (e, x) = (&estimate[r * n..][..n], &exact[r * n..][..n]);
        let want = ops::top_k(x, k);
        let cand = ops::top_k(e, (k + extra).min(n));
        let mut by_exact: Vec<usize> = cand;
        by_exact.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        by_exact.truncate(k);
        let mut mark = vec![false; n];
        for i in want {
            mark[i] = true;
        }
        total += by_exact.iter().filter(|&&i| mark[i]).count() as f64 / k as f64;
    }
    total / rows as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Lcg;

    fn exact(
        q: &[f32],
        k: &[f32],
        (heads, rows, keys, d): (usize, usize, usize, usize),
    ) -> Vec<f32> {
        let mut s = Vec::new();
        for h in 0..heads {
            for r in 0..rows {
                let qr = &q[(h * rows + r) * d..][..d];
                for j in 0..keys {
                    let kr = &k[(h * keys + j) * d..][..d];
                    s.push(qr.iter().zip(kr).map(|(a, b)| a * b).sum());
                }
            }
        }
        s
    }

    #[test]
    fn normalization_undoes_exactly_and_cannot_saturate() {
        let mut rng = Lcg(3);
        let dims = (2, 3, 700, 64);
        let q = rng.vec(2 * 3 * 64, 2.0);
        let mut k = rng.vec(2 * 700 * 64, 1.0);
        for (j, row) in k.chunks_mut(64).enumerate() {
            row[5] *= 40.0; // an outlier channel
            for v in row.iter_mut() {
                *v *= 1.0 + (j % 13) as f32; // keys of different norms
            }
        }
        let want = exact(&q, &k, dims);
        for bits in [KeyBits::Eight, KeyBits::Sixteen] {
            let p = prepare(&q, &k, dims, bits);
            assert_eq!(p.shape.keys, 1024);
            let s = p.simulate();
            assert!(s.iter().all(|&v| v != 0 && v != 65535), "saturated");
            let mut got = vec![0f32; want.len()];
            p.finish(&s, &mut got);
            let top = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let err = ops::max_abs_err(&got, &want);
            let tol = match bits {
                KeyBits::Eight => 2e-2,
                KeyBits::Sixteen => 1e-3,
            };
            assert!(err < tol * top, "{bits:?}: {err} at {top}");
        }
    }

    #[test]
    fn kept_recall_reranks_the_extra_candidates() {
        let exact = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0];
        // The estimate swaps ranks 2 and 3.
        let est = [5.0, 3.0, 4.0, 2.0, 1.0, 0.0];
        assert_eq!(ops::top_k_recall(&est, &exact, 6, 2), 0.5);
        assert_eq!(kept_recall(&est, &exact, 6, 2, 0), 0.5);
        assert_eq!(kept_recall(&est, &exact, 6, 2, 1), 1.0);
    }
}

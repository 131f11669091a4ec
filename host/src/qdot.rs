//! Weight-stationary dot products of one quantized weight row against several activation rows,
//! each bit-identical to ggml's single-row `vec_dot` for the type.
//!
//! ggml's CPU `mul_mat` computes every output element with one `vec_dot` call: for k activation
//! rows it unpacks each weight block k times. These kernels unpack it once and reuse it for
//! every row. They keep ggml's arithmetic exactly, so a row's result does not depend on how many
//! rows were computed with it (the batch invariance greedy speculation needs): per 32-weight
//! block the integer products are summed into the same 8 lanes (elements 4m..4m+3), each lane
//! is converted to `f32` and accumulated with one fused multiply-add by the block's scale
//! product, block after block, and the 8 lanes are reduced in ggml's `hsum_float_8` order.
//!
//! x86-64 with AVX2/FMA/F16C only (what ggml's own single-row kernels use in this build);
//! [`Kernel::new`] returns `None` elsewhere and callers fall back to ggml's `vec_dot` one row at
//! a time. Callers check a kernel against ggml on random data ([`Kernel::agrees`]) before use.

/// A weight type with a weight-stationary kernel here, and the activation type it pairs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `Q8_0` weights x `Q8_0` activations.
    Q8_0,
    /// `Q5_0` weights x `Q8_0` activations.
    Q5_0,
    /// `Q4_1` weights x `Q8_1` activations.
    Q4_1,
    /// `Q4_K` weights (super-blocks of 256) x `Q8_K` activations.
    Q4K,
    /// `Q6_K` weights x `Q8_K` activations.
    Q6K,
}

impl Kind {
    /// The kernel for a ggml type name, if there is one.
    pub fn from_ggml_name(name: &str) -> Option<Self> {
        match name {
            "q8_0" => Some(Self::Q8_0),
            "q5_0" => Some(Self::Q5_0),
            "q4_1" => Some(Self::Q4_1),
            "q4_K" => Some(Self::Q4K),
            "q6_K" => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Values per block (32, or 256 for the k-quants' super-blocks).
    pub fn block_len(self) -> usize {
        if self.is_k() {
            kquant::QK_K
        } else {
            32
        }
    }

    /// A k-quant (super-blocks, `Q8_K` activations).
    pub fn is_k(self) -> bool {
        matches!(self, Self::Q4K | Self::Q6K)
    }

    /// Bytes of one weight block ([`Kind::block_len`] weights).
    pub fn weight_block(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q5_0 => 22,
            Self::Q4_1 => 20,
            Self::Q4K => kquant::Q4K_BYTES,
            Self::Q6K => kquant::Q6K_BYTES,
        }
    }

    /// Bytes of one activation block (`Q8_0`: 34, `Q8_1`: 36, `Q8_K`: 292).
    pub fn act_block(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q5_0 => 34,
            Self::Q4_1 => 36,
            Self::Q4K | Self::Q6K => kquant::Q8K_BYTES,
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod kquant;
#[cfg(not(target_arch = "x86_64"))]
mod kquant {
    pub(super) const QK_K: usize = 256;
    pub(super) const Q8K_BYTES: usize = 292;
    pub(super) const Q4K_BYTES: usize = 144;
    pub(super) const Q6K_BYTES: usize = 210;
}

/// Rows per pass over a weight block: enough to amortise the unpacking, few enough to keep
/// every accumulator in a register.
const GROUP: usize = 4;

/// A checked-available kernel for one weight type.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    kind: Kind,
    /// AVX-512 VNNI (`vpdpbusd`): the same integer lane sums in one instruction.
    vnni: bool,
    /// AVX-512 registers holding two weight rows' lanes each (with VNNI); for the k-quants,
    /// their 256-bit code with AVX-512VL's 32 registers.
    zmm: bool,
}

/// Activation rows prepared for [`Kernel::dot_many`]: the rows and their block scales as `f32`.
pub struct Acts<'a> {
    rows: Vec<&'a [u8]>,
    /// `scales[r * nb + b]`: row r's block b scale.
    scales: Vec<f32>,
    /// For the AVX-512 kernels: row r's 32 quants of block b at `(r * nb + b) * 32`, with the
    /// sign bit flipped (`q + 128` as unsigned) for the signed-weight types.
    qs: Vec<u8>,
    /// `Q8_1`'s block sums as `f32` (`Q4_1` only), indexed like `scales`.
    sums: Vec<f32>,
    nb: usize,
}

impl Acts<'_> {
    /// Rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

impl Kernel {
    /// The kernel for `kind` when this CPU can run it (AVX2, FMA and F16C).
    pub fn new(kind: Kind) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                let vnni = std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vl");
                // Not for Q8_0: its 512-bit kernel ran a 65536 x 640 pass 4x slower than the
                // 256-bit ones (6.1 ms against 1.6 ms, one thread, one row), where Q5_0's and
                // Q4_1's run faster (`tests/examples/qdottime.rs`).
                let zmm = vnni
                    && kind != Kind::Q8_0
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw");
                return Some(Self { kind, vnni, zmm });
            }
        }
        let _ = kind;
        None
    }

    /// The same kernel without AVX-512 VNNI (nor AVX-512 registers): for comparing them.
    pub fn without_vnni(self) -> Self {
        Self {
            vnni: false,
            zmm: false,
            ..self
        }
    }

    /// The same kernel on 256-bit registers only: for comparing them.
    pub fn without_zmm(self) -> Self {
        Self { zmm: false, ..self }
    }

    /// The same kernel on AVX-512 registers where this CPU has them, also for `Q8_0`, which
    /// [`Kernel::new`] keeps off them: for comparing them.
    pub fn with_zmm(self) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let zmm = self.vnni
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw");
            Self { zmm, ..self }
        }
        #[cfg(not(target_arch = "x86_64"))]
        self
    }

    /// The weight type.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Check `acts` (rows of `n` values of the activation type) and convert their scales.
    ///
    /// # Panics
    /// When `n` is not a multiple of 32 or a row is shorter than `n` needs.
    pub fn prepare<'a>(&self, n: usize, acts: &[&'a [u8]]) -> Acts<'a> {
        if self.kind.is_k() {
            assert_eq!(n % kquant::QK_K, 0, "row length not a multiple of 256");
            let nb = n / kquant::QK_K;
            for a in acts {
                assert!(
                    a.len() >= nb * kquant::Q8K_BYTES,
                    "activation row too short"
                );
            }
            return Acts {
                rows: acts.to_vec(),
                scales: Vec::new(),
                qs: Vec::new(),
                sums: Vec::new(),
                nb,
            };
        }
        assert_eq!(n % 32, 0, "row length not a multiple of 32");
        let (nb, ab) = (n / 32, self.kind.act_block());
        let mut scales = Vec::with_capacity(acts.len() * nb);
        let mut qs = Vec::new();
        let mut sums = Vec::new();
        let f16 = |a: &[u8], at: usize| f16_to_f32(u16::from_le_bytes([a[at], a[at + 1]]));
        // Where a block's 32 quants start (after d, and s for Q8_1).
        let q_at = ab - 32;
        for a in acts {
            assert!(a.len() >= nb * ab, "activation row too short");
            scales.extend((0..nb).map(|b| f16(a, b * ab)));
            if self.zmm {
                let flip = if self.kind == Kind::Q4_1 { 0 } else { 0x80 };
                for b in 0..nb {
                    qs.extend(a[b * ab + q_at..(b + 1) * ab].iter().map(|&q| q ^ flip));
                }
                if self.kind == Kind::Q4_1 {
                    sums.extend((0..nb).map(|b| f16(a, b * ab + 2)));
                }
            }
        }
        Acts {
            rows: acts.to_vec(),
            scales,
            qs,
            sums,
            nb,
        }
    }

    /// Dot products of every weight row in `w` (consecutive rows of `acts`' length) with every
    /// activation row: `out[i * acts.len() + r]` for weight row i and activation row r.
    ///
    /// # Panics
    /// When `w` is not whole rows or `out` has the wrong length.
    pub fn dot_many(&self, acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
        let row = acts.nb * self.kind.weight_block();
        assert!(
            row > 0 && w.len().is_multiple_of(row),
            "not whole weight rows"
        );
        assert_eq!(out.len(), w.len() / row * acts.len());
        if acts.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `new` checked the CPU features; lengths checked above and in `prepare`.
        unsafe {
            if self.kind == Kind::Q4K && self.zmm {
                kquant::q4k_wide(&acts.rows, acts.nb, w, out)
            } else if self.kind == Kind::Q4K {
                kquant::q4k(&acts.rows, acts.nb, w, out)
            } else if self.kind == Kind::Q6K && self.zmm {
                kquant::q6k_wide(&acts.rows, acts.nb, w, out)
            } else if self.kind == Kind::Q6K {
                kquant::q6k(&acts.rows, acts.nb, w, out)
            } else if self.zmm {
                x86::zmm::many(self.kind, acts, w, out)
            } else if self.vnni {
                x86::vnni::many(self.kind, acts, w, out)
            } else {
                x86::avx2::many(self.kind, acts, w, out)
            }
        };
    }

    /// Whether this kernel reproduces `reference` (ggml's single-row `vec_dot`) bit for bit on
    /// every weight row of `weights` against every row of `acts` (made by the caller with
    /// ggml's own quantizers), computed together.
    pub fn agrees(
        &self,
        n: usize,
        weights: &[u8],
        acts: &[&[u8]],
        mut reference: impl FnMut(&[u8], &[u8]) -> f32,
    ) -> bool {
        let row = n / self.kind.block_len() * self.kind.weight_block();
        let a = self.prepare(n, acts);
        let mut out = vec![0.0f32; weights.len() / row * acts.len()];
        self.dot_many(
            &a,
            &weights[..out.len() / acts.len().max(1) * row],
            &mut out,
        );
        weights
            .chunks_exact(row)
            .zip(out.chunks_exact(acts.len().max(1)))
            .all(|(w, o)| {
                acts.iter()
                    .zip(o)
                    .all(|(a, o)| reference(w, a).to_bits() == o.to_bits())
            })
    }
}

/// IEEE half to single (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value = man * 2^-24.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[cfg(target_arch = "x86_64")]
// Accumulators are indexed by row inside fully unrolled constant-length loops.
#[allow(clippy::needless_range_loop)]
mod x86 {
    /// The kernels, once per instruction set: `$lanes(ax, sy)` sums u8 x i8 products of 4
    /// consecutive bytes into 8 `i32` lanes (ggml's `mul_sum_us8_pairs_float` before the
    /// conversion; maddubs + madd and vpdpbusd give the same integers for these ranges).
    macro_rules! kernels {
        ($name:ident, $feat:literal, $lanes:ident) => {
            pub(super) mod $name {
                use super::super::{Acts, Kind, GROUP};
                use std::arch::x86_64::*;

                #[inline]
                #[target_feature(enable = $feat)]
                pub(in crate::qdot) unsafe fn f16(p: *const u8) -> f32 {
                    let bits = u16::from_le_bytes([*p, *p.add(1)]);
                    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
                }

                /// ggml's `hsum_float_8`: halves, then pairs, then the last two.
                #[inline]
                #[target_feature(enable = $feat)]
                pub(in crate::qdot) unsafe fn hsum(x: __m256) -> f32 {
                    let mut r = _mm256_extractf128_ps(x, 1);
                    r = _mm_add_ps(r, _mm256_castps256_ps128(x));
                    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
                    r = _mm_add_ss(r, _mm_movehdup_ps(r));
                    _mm_cvtss_f32(r)
                }

                /// 32 nibbles as bytes: low nibbles (elements 0..15) then high (16..31), as
                /// ggml's `bytes_from_nibbles_32`.
                #[inline]
                #[target_feature(enable = $feat)]
                pub(in crate::qdot) unsafe fn nibbles(p: *const u8) -> __m256i {
                    let t = _mm_loadu_si128(p.cast());
                    let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
                    _mm256_and_si256(_mm256_set1_epi8(0x0F), b)
                }

                /// ggml's `bytes_from_bits_32`: 0xFF where bit j of the 32-bit word is set.
                #[inline]
                #[target_feature(enable = $feat)]
                pub(in crate::qdot) unsafe fn bits(p: *const u8) -> __m256i {
                    let x = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
                    let shuf = _mm256_set_epi64x(
                        0x0303030303030303,
                        0x0202020202020202,
                        0x0101010101010101,
                        0,
                    );
                    let b = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
                    let b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
                    _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1))
                }

                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn lanes(ax: __m256i, sy: __m256i) -> __m256 {
                    _mm256_cvtepi32_ps(super::$lanes(ax, sy))
                }

                /// K activation rows against one weight row.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn group<const K: usize>(
                    kind: Kind,
                    nb: usize,
                    x: *const u8,
                    y: [*const u8; K],
                    yd: [*const f32; K],
                    out: *mut f32,
                ) {
                    let (wb, ab) = (kind.weight_block(), kind.act_block());
                    let mut acc = [_mm256_setzero_ps(); K];
                    let mut summs = [0.0f32; K];
                    match kind {
                        Kind::Q8_0 | Kind::Q5_0 => {
                            for b in 0..nb {
                                let xb = x.add(b * wb);
                                let qx = if kind == Kind::Q8_0 {
                                    _mm256_loadu_si256(xb.add(2).cast())
                                } else {
                                    let hi = _mm256_andnot_si256(
                                        bits(xb.add(2)),
                                        _mm256_set1_epi8(0xF0u8 as i8),
                                    );
                                    _mm256_or_si256(nibbles(xb.add(6)), hi)
                                };
                                let dx = _mm256_set1_ps(f16(xb));
                                // ggml's `mul_sum_i8_pairs_float`: |x| times y with x's sign.
                                let ax = _mm256_sign_epi8(qx, qx);
                                for r in 0..K {
                                    let d = _mm256_mul_ps(dx, _mm256_broadcast_ss(&*yd[r].add(b)));
                                    let qy = _mm256_loadu_si256(y[r].add(b * ab + 2).cast());
                                    let q = lanes(ax, _mm256_sign_epi8(qy, qx));
                                    acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
                                }
                            }
                            for r in 0..K {
                                *out.add(r) = hsum(acc[r]);
                            }
                        }
                        Kind::Q4_1 => {
                            for b in 0..nb {
                                let xb = x.add(b * wb);
                                let (d0, m) = (_mm256_set1_ps(f16(xb)), f16(xb.add(2)));
                                let qx = nibbles(xb.add(4));
                                for r in 0..K {
                                    let yb = y[r].add(b * ab);
                                    // ggml's `summs += m * s` (fused there; the f16 x f16
                                    // product is exact in f32, so fused or not agree).
                                    summs[r] = m.mul_add(f16(yb.add(2)), summs[r]);
                                    let d = _mm256_mul_ps(d0, _mm256_broadcast_ss(&*yd[r].add(b)));
                                    let qy = _mm256_loadu_si256(yb.add(4).cast());
                                    acc[r] = _mm256_fmadd_ps(d, lanes(qx, qy), acc[r]);
                                }
                            }
                            for r in 0..K {
                                *out.add(r) = hsum(acc[r]) + summs[r];
                            }
                        }
                        Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
                    }
                }

                #[target_feature(enable = $feat)]
                pub(in crate::qdot) unsafe fn many(
                    kind: Kind,
                    acts: &Acts<'_>,
                    w: &[u8],
                    out: &mut [f32],
                ) {
                    let (nb, k) = (acts.nb, acts.rows.len());
                    let row = nb * kind.weight_block();
                    let y: Vec<*const u8> = acts.rows.iter().map(|a| a.as_ptr()).collect();
                    let yd: Vec<*const f32> =
                        (0..k).map(|r| acts.scales.as_ptr().add(r * nb)).collect();
                    for (i, o) in out.chunks_exact_mut(k).enumerate() {
                        let x = w.as_ptr().add(i * row);
                        let mut r = 0;
                        while r < k {
                            let o = o.as_mut_ptr().add(r);
                            match k - r {
                                1 => group::<1>(kind, nb, x, [y[r]], [yd[r]], o),
                                2 => {
                                    group::<2>(kind, nb, x, [y[r], y[r + 1]], [yd[r], yd[r + 1]], o)
                                }
                                3 => group::<3>(
                                    kind,
                                    nb,
                                    x,
                                    [y[r], y[r + 1], y[r + 2]],
                                    [yd[r], yd[r + 1], yd[r + 2]],
                                    o,
                                ),
                                _ => group::<GROUP>(
                                    kind,
                                    nb,
                                    x,
                                    [y[r], y[r + 1], y[r + 2], y[r + 3]],
                                    [yd[r], yd[r + 1], yd[r + 2], yd[r + 3]],
                                    o,
                                ),
                            }
                            r += GROUP;
                        }
                    }
                }
            }
        };
    }

    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn maddubs(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy))
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    unsafe fn dpbusd(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
    }

    /// Two weight rows at once in 512-bit registers: lanes 0-7 are the first row's ggml
    /// lanes, 8-15 the second's, each accumulated and reduced exactly as on 256 bits. The
    /// integer lane sums come from one `vpdpbusd` a row: for signed weights x and activations
    /// y, `sum (y + 128) x - sum 128 x = sum x y` (the second sum once per weight block).
    pub(super) mod zmm {
        use super::super::{Acts, Kind, GROUP};
        use std::arch::x86_64::*;

        // The 256-bit helpers (their features are a subset of these kernels': they inline).
        use super::avx2::{bits, f16, hsum, nibbles};

        /// A block's 32 weights as signed bytes (`Q8_0`, `Q5_0`) or nibbles (`Q4_1`).
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn weights(kind: Kind, x: *const u8) -> __m256i {
            match kind {
                Kind::Q8_0 => _mm256_loadu_si256(x.add(2).cast()),
                Kind::Q5_0 => {
                    let hi = _mm256_andnot_si256(bits(x.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
                    _mm256_or_si256(nibbles(x.add(6)), hi)
                }
                Kind::Q4_1 => nibbles(x.add(4)),
                Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
            }
        }

        /// Two blocks' 16 bytes of nibbles as 64 bytes: [a low, a high, b low, b high].
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn nibbles_pair(pa: *const u8, pb: *const u8) -> __m512i {
            let t = _mm256_set_m128i(_mm_loadu_si128(pb.cast()), _mm_loadu_si128(pa.cast()));
            let z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
            // 128-bit lanes (a, b, a>>4, b>>4) -> (a, a>>4, b, b>>4).
            let z = _mm512_shuffle_i64x2(z, z, 0b11_01_10_00);
            _mm512_and_si512(z, _mm512_set1_epi8(0x0F))
        }

        /// Two `Q5_0` blocks unpacked together: lanes 0-255 the first block's 32 weights (as
        /// `weights` gives them), 256-511 the second's.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn q5_0_pair(xa: *const u8, xb: *const u8) -> __m512i {
            let nib = nibbles_pair(xa.add(6), xb.add(6));
            // Fifth bits: byte j of each block is set where bit j of its qh is.
            let qa = u32::from_le_bytes([*xa.add(2), *xa.add(3), *xa.add(4), *xa.add(5)]);
            let qb = u32::from_le_bytes([*xb.add(2), *xb.add(3), *xb.add(4), *xb.add(5)]);
            let w = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi32(qa as i32)),
                _mm256_set1_epi32(qb as i32),
                1,
            );
            let shuf = _mm512_set_epi64(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            );
            let b = _mm512_shuffle_epi8(w, shuf);
            let set = _mm512_test_epi8_mask(b, _mm512_set1_epi64(0x8040201008040201u64 as i64));
            // Where the bit is clear, the weight is nibble - 16 (0xF0 | nibble), as ggml's
            // andnot/or.
            _mm512_or_si512(
                nib,
                _mm512_maskz_mov_epi8(!set, _mm512_set1_epi8(0xF0u8 as i8)),
            )
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn pair256(lo: __m256i, hi: __m256i) -> __m512i {
            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn pair_ps(lo: f32, hi: f32) -> __m512 {
            let l = _mm512_castps_pd(_mm512_set1_ps(lo));
            _mm512_castpd_ps(_mm512_insertf64x4(
                l,
                _mm256_castps_pd(_mm256_set1_ps(hi)),
                1,
            ))
        }

        /// Weight rows `x0`, `x1` against K activation rows starting at `r0`.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn pair<const K: usize>(
            kind: Kind,
            acts: &Acts<'_>,
            r0: usize,
            x0: *const u8,
            x1: *const u8,
            o0: *mut f32,
            o1: *mut f32,
        ) {
            let nb = acts.nb;
            let wb = kind.weight_block();
            let q = acts.qs.as_ptr().add(r0 * nb * 32);
            let yd = acts.scales.as_ptr().add(r0 * nb);
            let mut acc = [_mm512_setzero_ps(); K];
            let mut summs = [[0.0f32; K]; 2];
            for b in 0..nb {
                let (xa, xb) = (x0.add(b * wb), x1.add(b * wb));
                let qx = match kind {
                    Kind::Q5_0 => q5_0_pair(xa, xb),
                    Kind::Q4_1 => nibbles_pair(xa.add(4), xb.add(4)),
                    Kind::Q8_0 => pair256(weights(kind, xa), weights(kind, xb)),
                    Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
                };
                let d = pair_ps(f16(xa), f16(xb));
                if kind == Kind::Q4_1 {
                    let (m0, m1) = (f16(xa.add(2)), f16(xb.add(2)));
                    let ys = acts.sums.as_ptr().add(r0 * nb);
                    for r in 0..K {
                        let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                            q.add((r * nb + b) * 32).cast(),
                        ));
                        let lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, y);
                        let dd = _mm512_mul_ps(d, _mm512_set1_ps(*yd.add(r * nb + b)));
                        acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[r]);
                        let s = *ys.add(r * nb + b);
                        summs[0][r] = m0.mul_add(s, summs[0][r]);
                        summs[1][r] = m1.mul_add(s, summs[1][r]);
                    }
                } else {
                    let c = _mm512_dpbusd_epi32(
                        _mm512_setzero_si512(),
                        _mm512_set1_epi8(0x80u8 as i8),
                        qx,
                    );
                    let negc = _mm512_sub_epi32(_mm512_setzero_si512(), c);
                    for r in 0..K {
                        let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                            q.add((r * nb + b) * 32).cast(),
                        ));
                        let lanes = _mm512_dpbusd_epi32(negc, y, qx);
                        let dd = _mm512_mul_ps(d, _mm512_set1_ps(*yd.add(r * nb + b)));
                        acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[r]);
                    }
                }
            }
            for r in 0..K {
                let lo = _mm512_castps512_ps256(acc[r]);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
                if kind == Kind::Q4_1 {
                    *o0.add(r) = hsum(lo) + summs[0][r];
                    *o1.add(r) = hsum(hi) + summs[1][r];
                } else {
                    *o0.add(r) = hsum(lo);
                    *o1.add(r) = hsum(hi);
                }
            }
        }

        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(in crate::qdot) unsafe fn many(kind: Kind, acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
            let (nb, k) = (acts.nb, acts.rows.len());
            let row = nb * kind.weight_block();
            let n_w = out.len() / k;
            let mut i = 0;
            while i + 2 <= n_w {
                let x0 = w.as_ptr().add(i * row);
                let (o0, o1) = (
                    out.as_mut_ptr().add(i * k),
                    out.as_mut_ptr().add((i + 1) * k),
                );
                let mut r = 0;
                while r < k {
                    let (a, b) = (o0.add(r), o1.add(r));
                    match k - r {
                        1 => pair::<1>(kind, acts, r, x0, x0.add(row), a, b),
                        2 => pair::<2>(kind, acts, r, x0, x0.add(row), a, b),
                        3 => pair::<3>(kind, acts, r, x0, x0.add(row), a, b),
                        _ => pair::<GROUP>(kind, acts, r, x0, x0.add(row), a, b),
                    }
                    r += GROUP;
                }
                i += 2;
            }
            if i < n_w {
                super::vnni::many(kind, acts, &w[i * row..], &mut out[i * k..]);
            }
        }
    }

    kernels!(avx2, "avx2,fma,f16c", maddubs);
    kernels!(vnni, "avx2,fma,f16c,avx512vnni,avx512vl", dpbusd);
}

/// The ggml type id of a kernel's weight type.
fn ggml_type(kind: Kind) -> llama_cpp_sys_2::ggml_type {
    use llama_cpp_sys_2 as sys;
    match kind {
        Kind::Q8_0 => sys::GGML_TYPE_Q8_0,
        Kind::Q5_0 => sys::GGML_TYPE_Q5_0,
        Kind::Q4_1 => sys::GGML_TYPE_Q4_1,
        Kind::Q4K => sys::GGML_TYPE_Q4_K,
        Kind::Q6K => sys::GGML_TYPE_Q6_K,
    }
}

/// Rows of `ty` quantized by ggml from pseudo-random values of several magnitudes.
fn quantized(
    ty: llama_cpp_sys_2::ggml_type,
    n: usize,
    rows: usize,
    seed: &mut u64,
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
                    *seed ^= *seed << 13;
                    *seed ^= *seed >> 7;
                    *seed ^= *seed << 17;
                    let u = (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
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
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let ty = ggml_type(k.kind);
    // SAFETY: static traits table.
    let tr = unsafe {
        sys::ggml_cpu_init();
        &*sys::ggml_get_type_traits_cpu(ty)
    };
    let Some(vec_dot) = tr.vec_dot else {
        return false;
    };
    let n = if k.kind.is_k() { 768 } else { 640 };
    let w = quantized(ty, n, 47, &mut seed);
    let a = quantized(tr.vec_dot_type, n, 9, &mut seed);
    if w.is_empty() || a.is_empty() {
        return false;
    }
    let all: Vec<u8> = w.concat();
    (1..=9).all(|rows| {
        let acts: Vec<&[u8]> = a[..rows].iter().map(Vec::as_slice).collect();
        k.agrees(n, &all, &acts, |wr, ar| {
            let mut s = 0.0f32;
            // SAFETY: one full row of each type; nrc = 1 as ggml's mul_mat calls it.
            unsafe {
                vec_dot(
                    n as i32,
                    &mut s,
                    0,
                    wr.as_ptr().cast(),
                    0,
                    ar.as_ptr().cast(),
                    0,
                    1,
                )
            };
            s
        })
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
        if agrees_with_ggml(&k) {
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
            ] {
                assert!(agrees_with_ggml(&k), "{k:?}");
            }
        }
    }
}

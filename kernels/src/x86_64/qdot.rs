//! AVX2 (and AVX-512 VNNI) kernels for the 32-weight block types (`Q8_0`, `Q5_0`, `Q4_1`):
//! ggml's x86-64 `vec_dot` arithmetic, one weight block unpacked once for several rows.

// Accumulators are indexed by row inside fully unrolled constant-length loops.
#![allow(clippy::needless_range_loop)]

/// The kernels, once per instruction set: `$lanes(ax, sy)` sums u8 x i8 products of 4
/// consecutive bytes into 8 `i32` lanes (ggml's `mul_sum_us8_pairs_float` before the
/// conversion; maddubs + madd and vpdpbusd give the same integers for these ranges).
macro_rules! kernels {
    ($name:ident, $feat:literal, $lanes:ident) => {
        pub(super) mod $name {
            use super::super::AHEAD;
            use super::super::{Acts, Kind, WIDE};
            use super::{half, halves, CHUNK};
            use std::arch::x86_64::*;

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

            /// K activation rows (group `g`'s first K, of [`WIDE`]) against one weight row of
            /// kind `KIND` (a [`Kind`] as `u8`, so that each kind's loop is its own code). Per
            /// weight block, unpacked once for them, and row: the integer lane sums, their
            /// conversion, the scale product and the fused multiply-add, as ggml's; `Q4_1`'s
            /// `m * s` terms go a group's rows to a vector, each lane the scalar chain ggml
            /// runs.
            ///
            /// The scale products `dx * dy` come first, [`CHUNK`] weight blocks at a time: one
            /// 8-lane product per block makes the group's eight (lane r row r's, the product
            /// ggml's scalar one), stored, and each row's fused multiply-add takes its own as a
            /// broadcast from memory, a load with no arithmetic. A product per block and row
            /// (eight copies of `dy` in memory times `dx`) was one more instruction in each
            /// row's chain on the two pipes that multiply, and held `dx` in a register the
            /// eight accumulators needed.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn group<const KIND: u8, const K: usize>(
                acts: &Acts<'_>,
                t: *const f32,
                g: usize,
                x: *const u8,
                out: *mut f32,
            ) {
                let kind = Kind::from_u8(KIND);
                let nb = acts.nb;
                let (wb, ab) = (kind.weight_block(), kind.act_block());
                // Where a block's quants start in a weight block and an activation block.
                let (xq, yq) = match kind {
                    Kind::Q8_0 => (2, 2),
                    Kind::Q5_0 => (6, 2),
                    _ => (4, 4),
                };
                let y: [*const u8; K] = std::array::from_fn(|r| acts.rows[g * WIDE + r].as_ptr());
                let ys = acts.wide_scales.as_ptr().add(g * nb * WIDE);
                let sums = acts.block_sums.as_ptr().wrapping_add(g * nb * WIDE);
                let mut acc = [_mm256_setzero_ps(); K];
                let mut summs = _mm256_setzero_ps();
                let mut ds = std::mem::MaybeUninit::<[__m256; CHUNK]>::uninit();
                let dp = ds.as_mut_ptr().cast::<f32>();
                for c in (0..nb).step_by(CHUNK) {
                    let n = (nb - c).min(CHUNK);
                    for j in 0..n {
                        let dx = _mm256_broadcast_ss(&*half(t, x.add((c + j) * wb)));
                        let d = _mm256_mul_ps(dx, _mm256_loadu_ps(ys.add((c + j) * WIDE)));
                        _mm256_store_ps(dp.add(j * 8), d);
                    }
                    for j in 0..n {
                        let b = c + j;
                        let xb = x.add(b * wb);
                        _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add(AHEAD).cast());
                        let db = dp.add(j * 8);
                        match kind {
                            Kind::Q8_0 | Kind::Q5_0 => {
                                let qx = if kind == Kind::Q8_0 {
                                    _mm256_loadu_si256(xb.add(xq).cast())
                                } else {
                                    let hi = _mm256_andnot_si256(
                                        bits(xb.add(2)),
                                        _mm256_set1_epi8(0xF0u8 as i8),
                                    );
                                    _mm256_or_si256(nibbles(xb.add(xq)), hi)
                                };
                                // ggml's `mul_sum_i8_pairs_float`: |x| times y with x's sign.
                                let ax = _mm256_sign_epi8(qx, qx);
                                for r in 0..K {
                                    let qy = _mm256_loadu_si256(y[r].add(b * ab + yq).cast());
                                    let q = lanes(ax, _mm256_sign_epi8(qy, qx));
                                    acc[r] = _mm256_fmadd_ps(
                                        _mm256_broadcast_ss(&*db.add(r)),
                                        q,
                                        acc[r],
                                    );
                                }
                            }
                            _ => {
                                let qx = nibbles(xb.add(xq));
                                // ggml's `summs += m * s` (fused there; the f16 x f16 product
                                // is exact in f32, so fused or not agree), with `s` converted
                                // from f16 once per call (`Acts::block_sums`).
                                summs = _mm256_fmadd_ps(
                                    _mm256_broadcast_ss(&*half(t, xb.add(2))),
                                    _mm256_loadu_ps(sums.add(b * WIDE)),
                                    summs,
                                );
                                for r in 0..K {
                                    let qy = _mm256_loadu_si256(y[r].add(b * ab + yq).cast());
                                    let q = lanes(qx, qy);
                                    acc[r] = _mm256_fmadd_ps(
                                        _mm256_broadcast_ss(&*db.add(r)),
                                        q,
                                        acc[r],
                                    );
                                }
                            }
                        }
                    }
                }
                if kind == Kind::Q4_1 {
                    let mut s = [0.0f32; WIDE];
                    _mm256_storeu_ps(s.as_mut_ptr(), summs);
                    for r in 0..K {
                        *out.add(r) = hsum(acc[r]) + s[r];
                    }
                } else {
                    for r in 0..K {
                        *out.add(r) = hsum(acc[r]);
                    }
                }
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn many_of<const KIND: u8>(acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
                let (nb, k) = (acts.nb, acts.rows.len());
                let row = nb * Kind::from_u8(KIND).weight_block();
                let t = halves().as_ptr();
                for (i, o) in out.chunks_exact_mut(k).enumerate() {
                    let x = w.as_ptr().add(i * row);
                    let mut r = 0;
                    while r < k {
                        let (g, o) = (r / WIDE, o.as_mut_ptr().add(r));
                        match k - r {
                            1 => group::<KIND, 1>(acts, t, g, x, o),
                            2 => group::<KIND, 2>(acts, t, g, x, o),
                            3 => group::<KIND, 3>(acts, t, g, x, o),
                            4 => group::<KIND, 4>(acts, t, g, x, o),
                            5 => group::<KIND, 5>(acts, t, g, x, o),
                            6 => group::<KIND, 6>(acts, t, g, x, o),
                            7 => group::<KIND, 7>(acts, t, g, x, o),
                            _ => group::<KIND, WIDE>(acts, t, g, x, o),
                        }
                        r += WIDE;
                    }
                }
            }

            #[target_feature(enable = $feat)]
            pub(in crate::qdot) unsafe fn many(
                kind: Kind,
                acts: &Acts<'_>,
                w: &[u8],
                out: &mut [f32],
            ) {
                match kind {
                    Kind::Q8_0 => many_of::<{ Kind::Q8_0 as u8 }>(acts, w, out),
                    Kind::Q5_0 => many_of::<{ Kind::Q5_0 as u8 }>(acts, w, out),
                    Kind::Q4_1 => many_of::<{ Kind::Q4_1 as u8 }>(acts, w, out),
                    Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
                }
            }
        }
    };
}

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Weight blocks whose scale products the 256-bit kernels compute ahead of their products (a
/// 1 KB buffer on the stack: a row of up to 1024 values in one go).
const CHUNK: usize = 32;

/// Every half's `f32` value (exact, [`crate::f16::to_f32`]), indexed by its bits: a block's
/// scale is then one load (a broadcast straight from memory) where converting it takes a move
/// into a vector register, the conversion and a broadcast. A model's scales take few distinct
/// values, so few of the table's lines stay in the caches.
fn halves() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(crate::f16::to_f32).collect())
}

/// Where [`halves`] (at `t`) holds the value of the half at `p`.
#[inline]
unsafe fn half(t: *const f32, p: *const u8) -> *const f32 {
    t.add(usize::from(p.cast::<u16>().read_unaligned()))
}

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
/// y: for `Q8_0`, `sum (y + 128) x - 128 sum x` (the second term once per weight block
/// pair), for `Q5_0` `sum (x + 128) y - 128 sum y` (the second term once per activation block
/// and call, [`Acts`]' `lane_sums`; the 128 is folded into the unpacking). A block pair's
/// scales come from [`halves`] (two broadcasts from memory, one of them masked) and its
/// unpacking from broadcasts and masked operations, where shuffles (one port on these CPUs)
/// made a one-row pass twice as long as its products.
pub(super) mod zmm {
    use super::super::AHEAD;
    use super::super::{Acts, Kind, GROUP};
    use std::arch::x86_64::*;

    // The 256-bit helper (its features are a subset of these kernels': it inlines).
    use super::avx2::hsum;
    use super::{half, halves};

    /// Two blocks' 16 bytes of nibbles (at `pa`, `pb`) as 64 bytes: [a low, a high, b low,
    /// b high], each byte's other four bits still to be cleared.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn nibbles_pair(pa: *const u8, pb: *const u8) -> __m512i {
        let z = _mm512_broadcast_i32x4(_mm_loadu_si128(pa.cast()));
        let z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128(pb.cast()));
        // The high nibbles down in 128-bit lanes 1 and 3 (16-bit elements 8-15, 24-31).
        _mm512_mask_srli_epi16(z, 0xFF00_FF00, z, 4)
    }

    /// Two `Q5_0` blocks' weights plus 128 (as unsigned bytes): lanes 0-255 the first block's
    /// 32, 256-511 the second's.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q5_0_pair(xa: *const u8, xb: *const u8) -> __m512i {
        let nib = nibbles_pair(xa.add(6), xb.add(6));
        // Fifth bits: bit j of a block's qh belongs to its weight j, which is byte j here.
        let qa = xa.add(2).cast::<u32>().read_unaligned();
        let qb = xb.add(2).cast::<u32>().read_unaligned();
        let set = u64::from(qa) | (u64::from(qb) << 32);
        // A weight is nibble - 16 where its bit is clear, the nibble where it is set (ggml's
        // andnot/or); plus 128 that is 0x70 | nibble and 0x80 | nibble.
        let high =
            _mm512_mask_blend_epi8(set, _mm512_set1_epi8(0x70), _mm512_set1_epi8(0x80u8 as i8));
        // (nib & 0x0F) | high
        _mm512_ternarylogic_epi32::<0xEA>(nib, _mm512_set1_epi8(0x0F), high)
    }

    /// The two blocks' weights as `vpdpbusd`'s unsigned operand: `Q4_1`'s nibbles, the
    /// signed types' weights plus 128.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn weights_pair(kind: Kind, xa: *const u8, xb: *const u8) -> __m512i {
        match kind {
            Kind::Q5_0 => q5_0_pair(xa, xb),
            Kind::Q4_1 => {
                _mm512_and_si512(nibbles_pair(xa.add(4), xb.add(4)), _mm512_set1_epi8(0x0F))
            }
            Kind::Q8_0 => _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(xa.add(2).cast())),
                _mm256_loadu_si256(xb.add(2).cast()),
                1,
            ),
            Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
        }
    }

    /// The two blocks' scales `d`: the first's in lanes 0-7, the second's in 8-15.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn scales_pair(t: *const f32, xa: *const u8, xb: *const u8) -> __m512 {
        let d = _mm512_set1_ps(*half(t, xa));
        _mm512_mask_broadcastss_ps(d, 0xFF00, _mm_load_ss(half(t, xb)))
    }

    /// Weight rows `x0`, `x1` against K activation rows starting at `r0`; returns K. `t` is
    /// [`halves`].
    #[inline]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn pair<const KIND: u8, const K: usize>(
        acts: &Acts<'_>,
        t: *const f32,
        r0: usize,
        x0: *const u8,
        x1: *const u8,
        o0: *mut f32,
        o1: *mut f32,
    ) -> usize {
        // A constant in each instance: no kind is tested inside the loops.
        let kind = Kind::from_u8(KIND);
        let nb = acts.nb;
        let wb = kind.weight_block();
        let q = acts.qs.as_ptr().add(r0 * nb * 32);
        let yd = acts.scales.as_ptr().add(r0 * nb);
        let ls = acts.lane_sums.as_ptr().wrapping_add(r0 * nb * 8);
        let mut acc = [_mm512_setzero_ps(); K];
        let mut summs = [[0.0f32; K]; 2];
        // `Q4_1`'s `m * s` sums for whole groups of four rows (`r0` is then a multiple of
        // four: `many` takes 8 or 4 rows first): four rows' running sums in one register per
        // weight row, each lane the same fused multiply-add chain as ggml's scalar one.
        let by4 = K.is_multiple_of(GROUP);
        let mut summs4 = [[_mm_setzero_ps(); 2]; 2];
        for b in 0..nb {
            let (xa, xb) = (x0.add(b * wb), x1.add(b * wb));
            _mm_prefetch::<_MM_HINT_T0>(xa.wrapping_add(AHEAD).cast());
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add(AHEAD).cast());
            let qx = weights_pair(kind, xa, xb);
            let d = scales_pair(t, xa, xb);
            if kind == Kind::Q4_1 {
                let (m0, m1) = (half(t, xa.add(2)), half(t, xb.add(2)));
                if by4 {
                    let (v0, v1) = (_mm_set1_ps(*m0), _mm_set1_ps(*m1));
                    let gs = acts.group_sums.as_ptr();
                    for h in 0..K / GROUP {
                        let s = _mm_loadu_ps(gs.add(((r0 / GROUP + h) * nb + b) * GROUP));
                        summs4[0][h] = _mm_fmadd_ps(v0, s, summs4[0][h]);
                        summs4[1][h] = _mm_fmadd_ps(v1, s, summs4[1][h]);
                    }
                } else {
                    let ys = acts.sums.as_ptr().add(r0 * nb);
                    for r in 0..K {
                        let s = *ys.add(r * nb + b);
                        summs[0][r] = (*m0).mul_add(s, summs[0][r]);
                        summs[1][r] = (*m1).mul_add(s, summs[1][r]);
                    }
                }
            }
            // `Q8_0`: `sum (y + 128) x - 128 sum x`, the second term once a block pair (unused
            // by the other kinds).
            let negc = if kind == Kind::Q8_0 {
                let c =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(0x80u8 as i8), qx);
                _mm512_sub_epi32(_mm512_setzero_si512(), c)
            } else {
                _mm512_setzero_si512()
            };
            for r in 0..K {
                let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(q.add((r * nb + b) * 32).cast()));
                let lanes = match kind {
                    Kind::Q8_0 => _mm512_dpbusd_epi32(negc, y, qx),
                    // `Q5_0`: `sum (x + 128) y - 128 sum y`, the second term from the call's
                    // activations.
                    Kind::Q5_0 => _mm512_dpbusd_epi32(
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(ls.add((r * nb + b) * 8).cast())),
                        qx,
                        y,
                    ),
                    // `Q4_1`: unsigned nibbles times signed activations as they are.
                    Kind::Q4_1 => _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, y),
                    Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
                };
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(*yd.add(r * nb + b)));
                acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[r]);
            }
        }
        if by4 {
            for (w, sums) in summs4.iter().enumerate() {
                for (h, v) in sums.iter().take(K / GROUP).enumerate() {
                    let mut lanes = [0.0f32; GROUP];
                    _mm_storeu_ps(lanes.as_mut_ptr(), *v);
                    summs[w][h * GROUP..(h + 1) * GROUP].copy_from_slice(&lanes);
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
        K
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(in crate::qdot) unsafe fn many(kind: Kind, acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
        match kind {
            Kind::Q8_0 => many_of::<{ Kind::Q8_0 as u8 }>(acts, w, out),
            Kind::Q5_0 => many_of::<{ Kind::Q5_0 as u8 }>(acts, w, out),
            Kind::Q4_1 => many_of::<{ Kind::Q4_1 as u8 }>(acts, w, out),
            Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own kernels"),
        }
    }

    /// [`many`] for one kind (`kind as u8`): each pass's kind a constant, so the kind's
    /// branches leave the loops (with the kind an argument they stayed in them, a jump
    /// through a table every block).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn many_of<const KIND: u8>(acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
        let kind = Kind::from_u8(KIND);
        let (nb, k) = (acts.nb, acts.rows.len());
        let row = nb * kind.weight_block();
        let n_w = out.len() / k;
        let t = halves().as_ptr();
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
                // Eight rows to a pass where there are eight: a weight block's unpacking
                // (about as many instructions as a row's products) then serves twice as
                // many rows.
                r += match k - r {
                    1 => pair::<KIND, 1>(acts, t, r, x0, x0.add(row), a, b),
                    2 => pair::<KIND, 2>(acts, t, r, x0, x0.add(row), a, b),
                    3 => pair::<KIND, 3>(acts, t, r, x0, x0.add(row), a, b),
                    4..8 => pair::<KIND, GROUP>(acts, t, r, x0, x0.add(row), a, b),
                    _ => pair::<KIND, { 2 * GROUP }>(acts, t, r, x0, x0.add(row), a, b),
                };
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

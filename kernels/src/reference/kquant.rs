//! ggml's `vec_dot_q4_K_q8_K` and `vec_dot_q6_K_q8_K` in portable scalar Rust.
//!
//! Everything inside a super-block is integer (exact in any order); the orders differ in which
//! integers become one `f32` and how those are accumulated:
//!
//! - AArch64 NEON (`arch/arm/quants.c`, with or without dotprod: the dotprod choice only
//!   changes how the integer sums are formed, and each super-block's sums are reduced to one
//!   `i32` before any float operation): one scalar accumulator. gcc -O3 fused every update
//!   (the disassembly of Leap's `libggml-cpu.so`): `Q4_K` `sumf = fmsub(mins, dmin, sumf)` then
//!   `sumf = fmadd(sumi, d, sumf)`, `Q6_K` `sum = fmadd(d_all * y.d, isum - 32 * isum_mins,
//!   sum)`, with `d`, `dmin` and `d_all * y.d` each one rounded product.
//! - x86-64 AVX2 (`arch/x86/quants.c`): 8 `f32` lanes, lane `l` holding the products of bytes
//!   `4l..4l+3` of each 32-quant run, one fused multiply-add per super-block, reduced in
//!   `hsum_float_8`'s order; `Q4_K`'s mins in 4 more lanes (lane `m`: mins `2m`, `2m+1`).

use super::Order;
use crate::f16::to_f32;
use crate::qdot::{Kind, Q4K_BYTES, Q6K_BYTES, Q8K_BYTES};

/// One weight row of `nb` super-blocks of `kind` (`Q4_K` or `Q6_K`) against one `Q8_K` row, in
/// `order`'s arithmetic.
///
/// # Panics
/// When `kind` is not a k-quant or the rows are shorter than `nb` super-blocks.
pub(super) fn dot(kind: Kind, order: Order, nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wb, f): (usize, Unpack) = match kind {
        Kind::Q4K => (Q4K_BYTES, q4k),
        Kind::Q6K => (Q6K_BYTES, q6k),
        _ => panic!("{kind:?} is not a k-quant"),
    };
    let blocks = w[..nb * wb]
        .chunks_exact(wb)
        .zip(a[..nb * Q8K_BYTES].chunks_exact(Q8K_BYTES))
        .map(|(x, y)| f(x, y));
    match order {
        Order::Neon | Order::NeonDotprod => {
            let mut sum = 0.0f32;
            for b in blocks {
                if kind == Kind::Q4K {
                    // `sumf -= dmin * mins` compiled to `fmsub`: `sum - dmin * mins`, rounded once.
                    sum = (-b.dmin).mul_add(b.mins.iter().sum::<i32>() as f32, sum);
                }
                sum = b.d.mul_add(b.lanes.iter().sum::<i32>() as f32, sum);
            }
            sum
        }
        Order::X86Avx2 => {
            let (mut acc, mut acc_m) = ([0.0f32; 8], [0.0f32; 4]);
            for b in blocks {
                for (acc, &s) in acc.iter_mut().zip(&b.lanes) {
                    *acc = b.d.mul_add(s as f32, *acc);
                }
                // ggml: `dmin = -y.d * x.dmin`, exactly the negated product.
                for (acc, &s) in acc_m.iter_mut().zip(&b.mins) {
                    *acc = (-b.dmin).mul_add(s as f32, *acc);
                }
            }
            let x = acc;
            let h = ((x[4] + x[0]) + (x[6] + x[2])) + ((x[5] + x[1]) + (x[7] + x[3]));
            if kind == Kind::Q4K {
                h + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
            } else {
                h
            }
        }
    }
}

/// One super-block's integers from its weight and activation bytes.
type Unpack = fn(&[u8], &[u8]) -> Block;

/// One super-block's integers and scales, in AVX2's lanes (the NEON order sums them).
struct Block {
    /// `y.d * x.d` (for `Q6_K` the same product, `d_all * y.d`).
    d: f32,
    /// `y.d * x.dmin` (`Q4_K`; 0 for `Q6_K`).
    dmin: f32,
    /// Lane `l`: the scaled products of quants `32k + 4l..32k + 4l + 4` (`l < 4`) or
    /// `32k + 16 + 4(l - 4)..` (`l >= 4`) over the 8 runs `k` of 32 (`Q6_K`: less 32 times the
    /// scaled activation sums of the same lane).
    lanes: [i32; 8],
    /// `Q4_K`: lane `m`: `mins[2m] * (bsums[4m] + bsums[4m + 1]) + mins[2m + 1] * (bsums[4m +
    /// 2] + bsums[4m + 3])`.
    mins: [i32; 4],
}

/// The activation row's scale, quants and 16-quant sums.
fn q8k(y: &[u8]) -> (f32, &[u8], [i32; 16]) {
    let d = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
    let bsums =
        std::array::from_fn(|k| i32::from(i16::from_le_bytes([y[260 + 2 * k], y[261 + 2 * k]])));
    (d, &y[4..260], bsums)
}

fn f16_at(x: &[u8], at: usize) -> f32 {
    to_f32(u16::from_le_bytes([x[at], x[at + 1]]))
}

/// `Q4_K`'s 8 six-bit scales and 8 six-bit mins from their 12 packed bytes.
pub(crate) fn q4k_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let sm: [(u8, u8); 8] = std::array::from_fn(|j| scale_min_k4(j, q));
    (sm.map(|p| p.0), sm.map(|p| p.1))
}

/// Value `j`'s six-bit scale and minimum of 8 packed in 12 bytes `q` (ggml's
/// `get_scale_min_k4`): a `Q4_K` block's sub-block `j`, or, in a repacked `block_q4_Kx8`, row `j`'s
/// of one sub-block.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn q4k(x: &[u8], y: &[u8]) -> Block {
    let (yd, q8, bsums) = q8k(y);
    let (sc, mins) = q4k_scales(&x[4..16]);
    let q4 = &x[16..144];
    let mut lanes = [0i32; 8];
    // Runs of 32: run 2j takes the low nibbles of q4[32j..32j + 32], run 2j + 1 the high ones.
    for run in 0..8 {
        for (i, &q) in q8[32 * run..32 * run + 32].iter().enumerate() {
            let b = q4[32 * (run / 2) + i];
            let v = if run % 2 == 0 { b & 0xf } else { b >> 4 };
            lanes[i / 4] += i32::from(sc[run]) * i32::from(v) * i32::from(q as i8);
        }
    }
    let pairs: [i32; 8] = std::array::from_fn(|k| bsums[2 * k] + bsums[2 * k + 1]);
    Block {
        d: yd * f16_at(x, 0),
        dmin: yd * f16_at(x, 2),
        lanes,
        mins: std::array::from_fn(|m| {
            i32::from(mins[2 * m]) * pairs[2 * m] + i32::from(mins[2 * m + 1]) * pairs[2 * m + 1]
        }),
    }
}

fn q6k(x: &[u8], y: &[u8]) -> Block {
    let (yd, q8, bsums) = q8k(y);
    let (ql, qh) = (&x[0..128], &x[128..192]);
    let sc: [i32; 16] = std::array::from_fn(|k| i32::from(x[192 + k] as i8));
    let mut lanes = [0i32; 8];
    // Quant 128h + 32g + i: low bits from ql[64h + 32(g % 2) + i] (high nibble for g >= 2),
    // high bits from qh[32h + i] >> 2g; 16 quants to a scale.
    for h in 0..2 {
        for g in 0..4 {
            for i in 0..32 {
                let l = ql[64 * h + 32 * (g % 2) + i];
                let lo = if g < 2 { l & 0xf } else { l >> 4 };
                let q = lo | (((qh[32 * h + i] >> (2 * g)) & 3) << 4);
                let n = 128 * h + 32 * g + i;
                lanes[i / 4] += sc[n / 16] * i32::from(q) * i32::from(q8[n] as i8);
            }
        }
    }
    for (l, lane) in lanes.iter_mut().enumerate() {
        *lane -= 32 * (bsums[2 * l] * sc[2 * l] + bsums[2 * l + 1] * sc[2 * l + 1]);
    }
    Block {
        d: f16_at(x, 208) * yd,
        dmin: 0.0,
        lanes,
        mins: [0; 4],
    }
}

/// One `Q4_K` weight row of `nb` super-blocks against one `Q8_K` row as ggml's one-row
/// product over repacked `Q4_K` weights computes its column (x86's
/// `ggml_gemv_q4_K_8x8_q8_K`): per super-block the whole integer sum and the whole minimum
/// term, each one fused multiply-add into its own accumulator, and their difference.
pub(crate) fn q4k_repacked(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut acc_m) = (0.0f32, 0.0f32);
    for b in 0..nb {
        let blk = q4k(&w[b * Q4K_BYTES..], &a[b * Q8K_BYTES..]);
        let isum: i32 = blk.lanes.iter().sum();
        let imin: i32 = blk.mins.iter().sum();
        acc = (isum as f32).mul_add(blk.d, acc);
        acc_m = (imin as f32).mul_add(blk.dmin, acc_m);
    }
    acc - acc_m
}

#[cfg(test)]
mod tests {
    use super::{q4k_scales, Order};
    use crate::f16::{from_f32, to_f32};
    use crate::qdot::{Kernel, Kind, Q4K_BYTES, Q6K_BYTES, Q8K_BYTES, QK_K};

    /// xorshift64*: reproducible test data without dependencies.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn byte(&mut self) -> u8 {
            (self.next() >> 56) as u8
        }

        /// `±[0.5, 1) * 2^e` for `e` in `lo..hi`.
        fn scale(&mut self, lo: i32, hi: i32) -> f32 {
            let m = 0.5 + (self.next() >> 40) as f32 / (1u64 << 25) as f32;
            let e = lo + (self.next() % (hi - lo) as u64) as i32;
            let s = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
            s * m * 2f32.powi(e)
        }

        /// A finite half of magnitude about `2^lo..2^hi`.
        fn half(&mut self, lo: i32, hi: i32) -> [u8; 2] {
            from_f32(self.scale(lo, hi)).to_le_bytes()
        }
    }

    /// One weight super-block of `kind`: random quants and scales, finite halves.
    fn weight_block(kind: Kind, rng: &mut Rng) -> Vec<u8> {
        let mut b: Vec<u8> = (0..kind.weight_block()).map(|_| rng.byte()).collect();
        match kind {
            Kind::Q4K => {
                b[0..2].copy_from_slice(&rng.half(-14, 4));
                b[2..4].copy_from_slice(&rng.half(-14, 4));
            }
            _ => b[208..210].copy_from_slice(&rng.half(-14, 4)),
        }
        b
    }

    /// One `Q8_K` super-block whose `bsums` are its quants' sums (as ggml's quantizer writes).
    fn q8k_block(rng: &mut Rng) -> Vec<u8> {
        let mut b = rng.scale(-12, 2).to_le_bytes().to_vec();
        let qs: Vec<i8> = (0..QK_K).map(|_| rng.byte() as i8).collect();
        b.extend(qs.iter().map(|&q| q as u8));
        for c in qs.chunks_exact(16) {
            b.extend(c.iter().map(|&q| i16::from(q)).sum::<i16>().to_le_bytes());
        }
        assert_eq!(b.len(), Q8K_BYTES);
        b
    }

    /// Rows of `nb` super-blocks.
    fn rows(nb: usize, n: usize, mut block: impl FnMut() -> Vec<u8>) -> Vec<Vec<u8>> {
        (0..n)
            .map(|_| (0..nb).flat_map(|_| block()).collect())
            .collect()
    }

    /// The dequantized dot product in `f64` (ggml's `dequantize_row_q*_K` times `Q8_K`'s).
    fn naive(kind: Kind, nb: usize, w: &[u8], a: &[u8]) -> f64 {
        let mut sum = 0.0;
        for b in 0..nb {
            let y = &a[b * Q8K_BYTES..];
            let yd = f64::from(f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
            let f16 =
                |x: &[u8], at: usize| f64::from(to_f32(u16::from_le_bytes([x[at], x[at + 1]])));
            let wv: Vec<f64> = match kind {
                Kind::Q4K => {
                    let x = &w[b * Q4K_BYTES..];
                    let (sc, m) = q4k_scales(&x[4..16]);
                    (0..QK_K)
                        .map(|n| {
                            let (c, i) = (n / 64, n % 64);
                            let q = x[16 + 32 * c + i % 32];
                            let (q, s) = if i < 32 {
                                (q & 15, 2 * c)
                            } else {
                                (q >> 4, 2 * c + 1)
                            };
                            f16(x, 0) * f64::from(sc[s]) * f64::from(q)
                                - f16(x, 2) * f64::from(m[s])
                        })
                        .collect()
                }
                _ => {
                    let x = &w[b * Q6K_BYTES..];
                    (0..QK_K)
                        .map(|n| {
                            let (h, l) = (n / 128, n % 128);
                            let (g, i) = (l / 32, l % 32);
                            let lo = x[64 * h + 32 * (g % 2) + i];
                            let lo = if g < 2 { lo & 15 } else { lo >> 4 };
                            let q =
                                i32::from(lo | (((x[128 + 32 * h + i] >> (2 * g)) & 3) << 4)) - 32;
                            f16(x, 208) * f64::from(x[192 + n / 16] as i8) * f64::from(q)
                        })
                        .collect()
                }
            };
            sum += wv
                .iter()
                .zip(&y[4..260])
                .map(|(w, &q)| w * yd * f64::from(q as i8))
                .sum::<f64>();
        }
        sum
    }

    /// Every order is ggml's dot product up to rounding (catches a misplaced quant or scale,
    /// which the bitwise kernel tests below would share with the reference).
    #[test]
    fn reference_is_the_dequantized_dot() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for kind in [Kind::Q4K, Kind::Q6K] {
            for nb in 1..=3 {
                for _ in 0..20 {
                    let w = rows(nb, 1, || weight_block(kind, &mut rng)).remove(0);
                    let a = rows(nb, 1, || q8k_block(&mut rng)).remove(0);
                    let exact = naive(kind, nb, &w, &a);
                    // Cancellation: bound the error by the magnitude of the terms.
                    let scale = naive_abs(kind, nb, &w, &a);
                    for order in [Order::Neon, Order::NeonDotprod, Order::X86Avx2] {
                        let got = f64::from(super::super::dot(kind, order, nb * QK_K, &w, &a));
                        assert!(
                            (got - exact).abs() <= 1e-5 * scale,
                            "{kind:?} {order:?}: {got} against {exact}"
                        );
                    }
                }
            }
        }
    }

    /// Sum of the terms' magnitudes, an upper bound on any partial sum.
    fn naive_abs(kind: Kind, nb: usize, w: &[u8], a: &[u8]) -> f64 {
        let mut abs_a = a.to_vec();
        for b in 0..nb {
            for q in &mut abs_a[b * Q8K_BYTES + 4..b * Q8K_BYTES + 260] {
                *q = (*q as i8).unsigned_abs().min(127);
            }
        }
        // Large enough for every term: all quants positive, the weight side bounded by its
        // largest scale; a loose bound is enough to tell rounding from a wrong quant.
        naive(kind, nb, w, &abs_a).abs()
            + 1e3
                * (0..nb)
                    .map(|b| {
                        let y = &a[b * Q8K_BYTES..];
                        f64::from(f32::from_le_bytes([y[0], y[1], y[2], y[3]]).abs())
                    })
                    .sum::<f64>()
                * max_weight_scale(kind, nb, w)
    }

    fn max_weight_scale(kind: Kind, nb: usize, w: &[u8]) -> f64 {
        let at: &[usize] = if kind == Kind::Q4K { &[0, 2] } else { &[208] };
        (0..nb)
            .flat_map(|b| {
                at.iter().map(move |&o| {
                    let x = &w[b * kind.weight_block() + o..];
                    f64::from(to_f32(u16::from_le_bytes([x[0], x[1]])).abs())
                })
            })
            .fold(0.0, f64::max)
            * 63.0
            * 128.0
    }

    /// Every kernel variant this CPU runs gives, for every weight row and every activation row
    /// (1 to 17 at a time, so every group size and pairing), exactly the reference's bits in
    /// the order of the ggml it stands for.
    #[test]
    fn kernels_match_the_reference_bitwise() {
        let mut rng = Rng(0x0123_4567_89ab_cdef);
        for kind in [Kind::Q4K, Kind::Q6K] {
            let Some(fast) = Kernel::new(kind) else {
                eprintln!("no {kind:?} kernel on this CPU: skipped");
                continue;
            };
            let mut variants = vec![fast];
            for k in [
                fast.without_i8mm(),
                fast.without_dotprod(),
                fast.without_zmm(),
                fast.without_vnni(),
            ] {
                if !variants.iter().any(|v| v.variant() == k.variant()) {
                    variants.push(k);
                }
            }
            // ggml built with or without dotprod: the same k-quant arithmetic on AArch64.
            let builds: &[(bool, Order)] = if cfg!(target_arch = "aarch64") {
                &[(false, Order::Neon), (true, Order::NeonDotprod)]
            } else {
                &[(false, Order::X86Avx2)]
            };
            for nb in 1..=3 {
                let n = nb * QK_K;
                let w: Vec<u8> = rows(nb, 5, || weight_block(kind, &mut rng)).concat();
                // Past two passes of eight rows.
                for m in 1..=17 {
                    let a = rows(nb, m, || q8k_block(&mut rng));
                    let a: Vec<&[u8]> = a.iter().map(Vec::as_slice).collect();
                    for &k in &variants {
                        for &(on, order) in builds {
                            let k = k.for_ggml_dotprod(on);
                            let acts = k.prepare(n, &a);
                            let mut out = vec![f32::NAN; 5 * m];
                            k.dot_many(&acts, &w, &mut out);
                            for (i, x) in w.chunks_exact(nb * kind.weight_block()).enumerate() {
                                for (r, y) in a.iter().enumerate() {
                                    let want = super::super::dot(kind, order, n, x, y);
                                    assert_eq!(
                                        out[i * m + r].to_bits(),
                                        want.to_bits(),
                                        "{kind:?} {} {order:?}: nb {nb}, {m} rows, weight row {i}, row {r}: {} against {want}",
                                        k.variant(),
                                        out[i * m + r]
                                    );
                                }
                            }
                        }
                    }
                    variants
                        .iter()
                        .for_each(|k| eprintln!("{kind:?} nb {nb} rows {m}: {} ok", k.variant()));
                }
            }
        }
    }

    /// ggml's `make_block_q4_Kx8` (8-byte interleave), transcribed: the repacked layout of
    /// `rows` (a multiple of 8) `Q4_K` rows of `nb` super-blocks, as `repack_q4_K_to_q4_K_8_bl`
    /// writes it.
    fn repack(src: &[u8], rows: usize, nb: usize) -> Vec<u8> {
        let mut packed = Vec::new();
        for g in 0..rows / 8 {
            for x in 0..nb {
                let blk: Vec<&[u8]> = (0..8)
                    .map(|j| &src[((g * 8 + j) * nb + x) * Q4K_BYTES..][..Q4K_BYTES])
                    .collect();
                for b in &blk {
                    packed.extend_from_slice(&b[0..2]);
                }
                for b in &blk {
                    packed.extend_from_slice(&b[2..4]);
                }
                let mut scales = [0u8; 96];
                for half in 0..2 {
                    for i in 0..4 {
                        let (mut s, mut m) = ([0u8; 8], [0u8; 8]);
                        for j in 0..8 {
                            let q = &blk[j][4..16];
                            if half == 0 {
                                s[j] = q[i] & 63;
                                m[j] = q[i + 4] & 63;
                            } else {
                                s[j] = ((q[i] & 192) >> 2) | (q[i + 8] & 15);
                                m[j] = ((q[i + 4] & 192) >> 2) | ((q[i + 8] & 240) >> 4);
                            }
                        }
                        let o = &mut scales[48 * half + 12 * i..][..12];
                        for c in 0..4 {
                            o[c] = (s[c] & 63) + ((s[c + 4] & 48) << 2);
                            o[c + 4] = (m[c] & 63) + ((m[c + 4] & 48) << 2);
                            o[c + 8] = (s[c + 4] & 15) + ((m[c + 4] & 15) << 4);
                        }
                    }
                }
                packed.extend_from_slice(&scales);
                for i in 0..128 {
                    let (id, off) = (i % 8, (i / 8) * 8);
                    packed.extend_from_slice(&blk[id][16 + off..16 + off + 8]);
                }
            }
        }
        assert_eq!(packed.len(), src.len());
        packed
    }

    /// The repacked-`Q4_K` kernel, over weights in ggml's repacked layout, gives every weight
    /// row and activation row (1 to 17 at a time) the reference's bits over the same rows in
    /// `Q4_K`'s own layout; the reference is not the one-row `vec_dot`'s (so the comparison
    /// tells the two roundings apart).
    #[test]
    fn repacked_kernel_matches_its_reference_bitwise() {
        let mut rng = Rng(0x5555_aaaa_1234_5678);
        let Some(k) = Kernel::new(Kind::Q4K).filter(Kernel::has_repacked) else {
            eprintln!("no repacked Q4_K kernel here: skipped");
            return;
        };
        let mut differs = 0;
        for nb in 1..=3 {
            let n = nb * QK_K;
            let w: Vec<u8> = rows(nb, 16, || weight_block(Kind::Q4K, &mut rng)).concat();
            let packed = repack(&w, 16, nb);
            assert_ne!(packed, w);
            for m in 1..=17 {
                let a = rows(nb, m, || q8k_block(&mut rng));
                let a: Vec<&[u8]> = a.iter().map(Vec::as_slice).collect();
                let acts = k.prepare(n, &a);
                let mut out = vec![f32::NAN; 16 * m];
                k.dot_many_repacked(&acts, &packed, &mut out);
                for (i, x) in w.chunks_exact(nb * Q4K_BYTES).enumerate() {
                    for (r, y) in a.iter().enumerate() {
                        let want = super::q4k_repacked(nb, x, y);
                        assert_eq!(
                            out[i * m + r].to_bits(),
                            want.to_bits(),
                            "nb {nb}, {m} rows, weight row {i}, row {r}"
                        );
                        let one_row = super::super::dot(Kind::Q4K, Order::X86Avx2, n, x, y);
                        differs += usize::from(one_row.to_bits() != want.to_bits());
                    }
                }
            }
        }
        assert!(
            differs > 0,
            "the two roundings never differed: the test tells nothing"
        );
    }
}
